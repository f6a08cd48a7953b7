"""ConvBiasRelu:  y = act(conv2d(x, W) + b),  act(t) = max(t, 0) or min(max(t, lo), hi).

Exporters write the bias as Conv's third input (PyTorch), as a separate Add of a per-channel
constant shaped [C,1,1] or [1,C,1,1] (TensorFlow converters), or both: the kernel folds them
into one vector when the session is built. A [C]-shaped Add is not a channel bias: against
NCHW it broadcasts along the width axis, so it is declined with that reason.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Opt, Pattern, Var, op


def per_channel(bias: np.ndarray) -> str | None:
    """A constant added to an NCHW tensor is a channel bias if it broadcasts along axis 1 only."""
    if bias.ndim > 4:
        return f"bias of shape {list(bias.shape)} has more than 4 axes"
    shape = (1,) * (4 - bias.ndim) + bias.shape
    if shape[0] != 1 or shape[2] != 1 or shape[3] != 1:
        return f"Add of shape {list(bias.shape)} is not a per-channel bias"
    return None


def conv_bias_relu(x: Pattern | None = None, prefix: str = "") -> Pattern:
    """Conv (+ bias Add) + Relu/Clip, on input `x`; captures are named with `prefix`."""
    x = x if x is not None else Var(prefix + "x", dtype="float32", rank=4)
    conv = op.Conv(x, Const(prefix + "W"), Opt(Const(prefix + "B")), _name=prefix + "conv")
    biased = Alt(op.Add(conv, Const(prefix + "bias_add", where=per_channel)), conv)
    bounds = Opt(Const(prefix + "clip_min")), Opt(Const(prefix + "clip_max"))
    return Alt(
        op.Relu(biased, _name=prefix + "act"),
        op.Clip(biased, *bounds, _name=prefix + "act"),
    )


def conv_attributes(m, prefix: str = "") -> dict:
    """What the kernel needs to know about one Conv + activation of a match."""
    conv = m.attrs(prefix + "conv")
    act = m.node(prefix + "act")
    lo, hi = -np.inf, np.inf
    if act.op_type == "Clip":
        clip = m.attrs(prefix + "act")
        lo, hi = clip.get("min", lo), clip.get("max", hi)  # opset < 11: attributes
        if m.const(prefix + "clip_min") is not None:
            lo = m.const(prefix + "clip_min")
        if m.const(prefix + "clip_max") is not None:
            hi = m.const(prefix + "clip_max")
    return {
        "strides": list(conv["strides"]),
        "pads": list(conv["pads"]),
        "dilations": list(conv["dilations"]),
        "group": int(conv["group"]),
        "auto_pad": conv["auto_pad"],
        "activation": "relu" if act.op_type == "Relu" else "clip",
        "clip_min": float(lo),
        "clip_max": float(hi),
    }


def check_bias(m, prefix: str = "") -> str | None:
    bias = m.const(prefix + "bias_add")
    channels = m.const(prefix + "W").shape[0]
    if bias is not None and bias.size not in (1, channels):
        return f"bias of shape {list(bias.shape)} does not match {channels} output channels"
    return None


def folded_bias(channels: int, *biases: np.ndarray | None) -> np.ndarray | None:
    """The sum of Conv's bias and the Add's constant, as one vector of `channels` values."""
    present = [np.broadcast_to(b.reshape(-1), (channels,)) for b in biases if b is not None]
    return np.sum(present, axis=0, dtype=np.float32) if present else None


def conv_plan(attrs: dict, weight: np.ndarray, bias: np.ndarray | None):
    from kernels.conv2d import prepare_conv2d  # heavy (Numba): only when a kernel is built

    return prepare_conv2d(
        weight,
        bias,
        strides=tuple(attrs["strides"]),
        pads=tuple(attrs["pads"]),
        dilations=tuple(attrs["dilations"]),
        group=attrs["group"],
        auto_pad=attrs["auto_pad"],
        activation=attrs["activation"],
        clip_min=attrs["clip_min"],
        clip_max=attrs["clip_max"],
    )


def blocked_plans(attrs: dict, weight: np.ndarray, bias: np.ndarray | None) -> list:
    """The conv packed for the blocked-layout kernel, once per register tile worth timing
    (none when that kernel cannot run it)."""
    from kernels.conv_nchwc import supports, tile_options  # heavy (Numba)

    if supports(weight.shape, attrs["group"]) is not None:
        return []
    return [
        blocked_plan(attrs, weight, bias, t) for t in tile_options(weight.shape, attrs["group"])
    ]


def blocked_plan(attrs: dict, weight: np.ndarray, bias: np.ndarray | None, tile: int):
    """The conv packed for the blocked-layout kernel with `tile` output blocks per tile."""
    from kernels.conv_nchwc import prepare_conv_nchwc  # heavy (Numba)

    return prepare_conv_nchwc(
        weight,
        bias,
        strides=tuple(attrs["strides"]),
        pads=tuple(attrs["pads"]),
        dilations=tuple(attrs["dilations"]),
        group=attrs["group"],
        auto_pad=attrs["auto_pad"],
        activation=attrs["activation"],
        clip_min=attrs["clip_min"],
        clip_max=attrs["clip_max"],
        tile=tile,
    )


class ConvKernel:
    """A fused conv's kernel: called on an NCHW input it runs the NCHW kernel; `tactics` offers
    the blocked-layout kernel first (when it supports the conv; one tactic per register tile
    worth timing, "blocked-f4" = 4 output blocks per tile), then the NCHW one."""

    def __init__(self, attrs: dict, weight: np.ndarray, bias: np.ndarray | None):
        from kernels.conv2d import conv2d_bias_act  # heavy (Numba): only when a kernel is built
        from kernels.conv_nchwc import conv_nchwc

        nchw = conv_plan(attrs, weight, bias)
        self.run = lambda x, *_constants: (conv2d_bias_act(x, nchw),)
        self.tactics = [
            Tactic(
                f"blocked-f{plan.fb}",
                lambda xb, *_constants, plan=plan: (conv_nchwc(xb, plan),),
                blocked_inputs=(0,),
                in_blocks=(plan.in_block,),
                blocked_outputs=(0,),
                out_channels=(weight.shape[0],),
            )
            for plan in blocked_plans(attrs, weight, bias)
        ]
        self.tactics.append(Tactic(f"nchw-{nchw.method}", self.run))

    def __call__(self, x, *constants):
        return self.run(x, *constants)


def make_kernel(attrs: dict, constants: list):
    """Prepare the weights once (for every tactic); the kernel runs the fused convolution."""
    _, weight, bias, bias_add = (list(constants) + [None] * 4)[:4]
    return ConvKernel(attrs, weight, folded_bias(weight.shape[0], bias, bias_add))


RULE = Rule(
    "ConvBiasRelu",
    conv_bias_relu(),
    inputs=("x", "W", "B", "bias_add"),
    prepare=make_kernel,
    attributes=conv_attributes,
    check=check_bias,
    priority=10,
    description="2-D Conv + bias (Conv input or Add) + Relu or Clip, float32 NCHW",
    explain_after="Conv",
)
