"""Pooling. MaxPool2D:  y = MaxPool(x)   for a 4-D float32 x, any kernel, stride, padding,
dilation; or MaxPool(Pad(x)) with zeros around the planes and no padding of the pool's own
(Keras's ZeroPadding2D + MaxPooling2D, ResNet50's stem): the MaxPool of x padded by -inf, then
at least 0 wherever a window holds a padded place. GlobalAvgPoolFlatten:  y = mean_hw(x) as
[N, C]: Flatten(GlobalAveragePool(x)), or ReduceMean over H, W then Reshape / Flatten, or with
keepdims=0, or a Squeeze of the spatial axes (tf2onnx).

A one-op rule. Between fused nodes a lone MaxPool (SqueezeNet's and GoogLeNet's, after a conv
or a Fire module) would otherwise run as an onnxruntime island of its own: a session call, a
layout its conv-less island keeps NCHW, and the kernels' threads sleeping meanwhile. As a kernel
it runs in-process (kernels/pool.py). The Indices output, if something reads it, keeps the
node out (the rewriter says which node reads it).

GlobalAveragePool + Flatten is the head PyTorch's TorchScript exporter writes for every
torchvision classifier (adaptive_avg_pool2d to 1x1, then torch.flatten(x, 1)); the dynamo
exporter writes ReduceMean + Reshape. Fused, the model's tail needs no island.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion_kernels.windows import prepare_maxpool
from fusion_patterns.conv import check_pad, pad_amounts, padded


def known_channels(m) -> dict:
    """{"channels": C} when the model gives x's channel count (a pool or head can then also
    run on the blocked layout, whose blocks do not say how many channels they hold), else {}."""
    vt = m.type("x")
    if vt is not None and vt.shape and len(vt.shape) == 4 and isinstance(vt.shape[1], int):
        return {"channels": vt.shape[1]}
    return {}


def with_blocked(run, blocked_run, attrs: dict, keeps_layout: bool = True, bind=None):
    """`run` (NCHW) with its tactics: first `blocked_run` on the blocked layout (output blocked
    too when `keeps_layout`; `bind` its Tactic.bind) if the channel count is known, then `run`
    itself, the blocked one's fallback (timed per node on Zen 4 the blocked pools won 57 of 57
    at W = 16, 31 of 34 with the 8-lane code: bench/NOTES.md)."""
    from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built

    channels = attrs.get("channels")
    run.tactics = [Tactic("nchw", run, fallback=bool(channels))]
    if channels:
        out = dict(blocked_outputs=(0,), out_channels=(channels,)) if keeps_layout else {}
        run.tactics.insert(0, Tactic("blocked", blocked_run, blocked_inputs=(0,),
                                     in_blocks=(block(),), **out, bind=bind))  # fmt: skip
    return run


def attributes(m) -> dict:
    pool = m.attrs("pool")
    extra = pad_amounts(m)  # a zero Pad before a MaxPool: see make_kernel
    attrs = {
        "kernel_shape": list(pool["kernel_shape"]),
        "strides": list(pool["strides"]),
        "pads": [a + b for a, b in zip(pool["pads"], extra, strict=True)],
        "dilations": list(pool["dilations"]),
        "ceil_mode": int(pool.get("ceil_mode", 0)),
        "auto_pad": "NOTSET" if any(extra) else pool.get("auto_pad", "NOTSET"),
    }
    if any(extra):
        attrs["zero_padded"] = extra
    return attrs | known_channels(m)


def _plan(attrs: dict):
    return prepare_maxpool(
        attrs["kernel_shape"],
        strides=attrs["strides"],
        pads=attrs["pads"],
        dilations=attrs["dilations"],
        ceil_mode=attrs["ceil_mode"],
        auto_pad=attrs["auto_pad"],
    )


def check(m) -> str | None:
    if "pad" in m.node_index:
        reason = check_pad(m, consumer="pool")
        pool = m.attrs("pool")
        if reason is None and (any(pool["pads"]) or pool.get("ceil_mode", 0)):
            reason = (f"Pad {m.node('pad').name} before a MaxPool with pads "
                      f"{list(pool['pads'])} or ceil_mode: its windows reach past the "
                      "zeros")  # fmt: skip
        if reason:
            return reason
    attrs = attributes(m)
    kernel, strides = attrs["kernel_shape"], attrs["strides"]
    if len(kernel) != 2:
        return f"a {len(kernel)}-D MaxPool, the kernel is 2-D"
    try:
        _plan(attrs)  # the kernel's own checks (pads smaller than the kernel, ...)
    except ValueError as exc:
        return str(exc)
    if attrs["auto_pad"].startswith("SAME") and any(
        k < s for k, s in zip(kernel, strides, strict=True)
    ):
        return (
            f"SAME padding with a kernel {kernel} smaller than the stride {strides}: "
            "its padding can be negative (onnxruntime rejects such inputs)"
        )
    return None


def make_kernel(attrs: dict, constants: list):
    """The NCHW kernel; with the channel count known, the blocked-layout one first as a tactic
    (between blocked convs it saves two layout conversions)."""
    from fusion_kernels.pool import (  # heavy (Numba): only when built
        bind_maxpool_blocked,
        maxpool2d,
        maxpool_blocked,
    )

    plan = _plan(attrs)

    def run(x):
        return (padded_by_zeros(maxpool2d(x, plan), x.shape[2:4], attrs),)

    def run_blocked(xb):
        return (padded_by_zeros(maxpool_blocked(xb, plan), xb.shape[2:4], attrs),)

    def bind(xb):
        call, size = bind_maxpool_blocked(xb, plan), xb.shape[2:4]
        return lambda xb: (padded_by_zeros(call(xb), size, attrs),)

    return with_blocked(run, run_blocked, attrs, bind=bind)


def border(size: int, out: int, kernel: int, stride: int, dilation: int, before: int,
           after: int) -> np.ndarray:  # fmt: skip
    """The outputs along one axis whose window reaches into the padding (`before` and `after`
    the `size` inputs)."""
    start = np.arange(out) * stride
    return (start < before) | (start + (kernel - 1) * dilation >= before + size)


def padded_by_zeros(y, size, attrs: dict):
    """A Pad of zeros then a MaxPool without padding of its own, from the MaxPool of x padded
    by -inf (y, its pads the Pad's): each output whose window holds a padded place is at least
    0, the rest are as computed. y is NCHW or blocked (axes 2, 3 its rows and columns)."""
    pads = attrs.get("zero_padded")
    if pads is None:
        return y
    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel_shape"], attrs["strides"], attrs["dilations"]
    rows = border(size[0], y.shape[2], kh, sh, dh, pads[0], pads[2])
    cols = border(size[1], y.shape[3], kw, sw, dw, pads[1], pads[3])
    y[:, :, rows] = np.maximum(y[:, :, rows], 0)
    y[:, :, :, cols] = np.maximum(y[:, :, :, cols], 0)
    return y


RULE = Rule(
    "MaxPool2D",
    op.MaxPool(padded(Var("x", dtype="float32", rank=4)), _name="pool"),
    inputs=("x",),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    description="2-D MaxPool, float32 NCHW, in-process between fused nodes (no island)",
    explain_after="MaxPool",
    rtol=0.0,
    atol=0.0,
)


def make_gap_kernel(attrs: dict, constants: list):
    """The NCHW kernel; with the channel count known, first a tactic reading the blocked
    layout (after a blocked conv, no conversion before the head)."""
    from fusion_kernels.pool import (  # heavy (Numba)
        bind_global_average_pool_blocked,
        global_average_pool,
        global_average_pool_blocked,
    )

    shape = attrs.get("shape")

    def shaped(y):
        return (y if shape is None else y.reshape(shape),)  # Reshape's rule when no 0 is in it

    def run(x, *_constants):
        return shaped(global_average_pool(x))

    def run_blocked(xb, *_constants):
        return shaped(global_average_pool_blocked(xb, attrs["channels"]))

    def bind(xb, *_constants):
        call = bind_global_average_pool_blocked(xb, attrs["channels"])
        return lambda xb, *_constants: shaped(call(xb))

    return with_blocked(run, run_blocked, attrs, keeps_layout=False, bind=bind)


def gap_head():
    """The plane means as [N, C] in each exporter's form: Flatten(GlobalAveragePool(x))
    (TorchScript), ReduceMean over H, W then Reshape or Flatten, or with keepdims=0 (dynamo),
    GlobalAveragePool then Squeeze of axes 2, 3 (tf2onnx)."""
    x = Var("x", dtype="float32", rank=4)
    mean = op.ReduceMean(x, Opt(Const("axes")), _name="gap")
    gap = op.GlobalAveragePool(x, _name="gap")
    return Alt(
        op.Flatten(gap, _name="flat"),
        op.Flatten(mean, _name="flat"),
        op.Reshape(mean, Const("shape"), _name="flat"),
        *(op.Squeeze(p, Opt(Const("squeeze_axes")), _name="flat") for p in (gap, mean)),
        mean,
    )


def gap_attributes(m) -> dict:
    """Reshape's shape, if the head has one; the channel count when the model gives it (the
    head can then also read the blocked layout)."""
    attrs = {} if m.const("shape") is None else {"shape": [int(d) for d in m.const("shape")]}
    return attrs | known_channels(m)


def check_gap(m) -> str | None:
    gap = m.node("gap")
    if gap.op_type == "ReduceMean":
        attrs = m.attrs("gap")
        axes = attrs.get("axes") if m.const("axes") is None else m.const("axes").tolist()
        if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            return f"ReduceMean {gap.name} over axes {axes}, not the spatial axes [2, 3]"
        if "flat" not in m.node_index and attrs.get("keepdims", 1):
            return f"ReduceMean {gap.name} keeps its dims ([N, C, 1, 1]); the head gives [N, C]"
    if "flat" not in m.node_index:
        return None
    flat = m.node("flat")
    if flat.op_type == "Squeeze":  # tf2onnx's; axes an input (opset >= 13) or an attribute
        axes = m.const("squeeze_axes")
        axes = m.attrs("flat").get("axes") if axes is None else axes.tolist()
        if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            return f"Squeeze {flat.name} of axes {axes}; the head squeezes the spatial axes [2, 3]"
        return None
    if flat.op_type == "Flatten":
        axis = m.attrs("flat").get("axis", 1)
        return None if axis in (1, -3) else f"Flatten on axis {axis}; the head flattens from axis 1"
    shape = m.const("shape").tolist()
    if 0 in shape or len(shape) != 2:
        return f"Reshape {flat.name} to {shape}; the head reshapes to two dims, none of them 0"
    return None


GAP_FLATTEN = Rule(  # the name is historical: files fused before bind their kernel by it
    "GlobalAvgPoolFlatten",
    gap_head(),
    inputs=("x",),
    prepare=make_gap_kernel,
    attributes=gap_attributes,
    check=check_gap,
    description="the mean of each channel plane as [N, C] (GlobalAveragePool + Flatten, "
    "ReduceMean + Reshape), float32 NCHW: classifier heads",
    explain_after="GlobalAveragePool",
    from_last=True,  # Reshape/Flatten first, so that a ReduceMean is not tried alone before
)


# AvgPool2D:  y[n, c, i, j] = mean of x over the window (i kh .. i kh + kh - 1, j kw ..)
# DenseNet's transitions (2x2, stride 2): windows that tile the image, no padding, so the
# mean is a reshape and a sum, exact on either layout. Other forms stay with onnxruntime.
def check_avg(m) -> str | None:
    attrs = attributes(m)
    kernel, strides = attrs["kernel_shape"], attrs["strides"]
    if len(kernel) != 2:
        return f"a {len(kernel)}-D AveragePool, the kernel is 2-D"
    tiles = "the kernel takes windows that tile the image without padding"
    if strides != kernel or any(attrs["pads"]) or attrs["auto_pad"] not in ("NOTSET", "VALID"):
        pads, auto = attrs["pads"], attrs["auto_pad"]
        return f"windows {kernel}, strides {strides}, pads {pads} ({auto}): {tiles}"
    if attrs["ceil_mode"] or any(d != 1 for d in attrs["dilations"]):
        return f"ceil_mode or dilations: {tiles}"
    return None


def make_avg_kernel(attrs: dict, constants: list):
    """The window means (kernels/pool.py tiled_average_pool): NCHW, and blocked ([N, CB, H,
    W, b]) when the channel count is known. (NumPy's mean over the window axes of a reshaped
    view took 0.68 ms a DenseNet transition, onnxruntime 0.02.)"""
    from fusion_kernels.pool import tiled_average_pool  # heavy (Numba): only when a kernel is built

    kh, kw = attrs["kernel_shape"]

    def avg(x):
        return (tiled_average_pool(x, kh, kw),)

    return with_blocked(avg, avg, attrs)


AVG_POOL = Rule(
    "AvgPool2D",
    op.AveragePool(Var("x", dtype="float32", rank=4), _name="pool"),
    inputs=("x",),
    prepare=make_avg_kernel,
    attributes=attributes,
    check=check_avg,
    description="2-D AveragePool with windows that tile the image (DenseNet's transitions)",
    explain_after="AveragePool",
)


# SpatialMean:  y = ReduceMean(x, axes = the trailing spatial axes)   x [N, C, L] or [N, C, H, W]
# A keyword-spotting Conv1d classifier's mean over time, or a global average pool written as
# ReduceMean that no Flatten follows (keepdims 1 or 0, axes an attribute before opset 18, an
# input from 18). The plane means of GlobalAvgPoolFlatten's kernel, the output shaped as
# ReduceMean's: [N, C], or [N, C, 1(, 1)] with keepdims. A [N, C, L] tensor is the plane [L, 1].
def rank_3_or_4(t) -> str | None:
    """A [N, C, L] or [N, C, H, W] tensor (a function, not a lambda: rules are pickled)."""
    return None if t.rank in (3, 4) else "x is not 3-D or 4-D"


def spatial_axes(m) -> str | None:
    """Why ReduceMean `mean` is not over exactly x's trailing spatial axes, or None."""
    mean, rank = m.node("mean"), m.type("x").rank
    axes = m.attrs("mean").get("axes") if m["axes"] is None else m.const("axes").tolist()
    if axes is None:
        return f"ReduceMean {mean.name} without axes reduces every axis, not only the spatial ones"
    if sorted(a % rank for a in axes) != list(range(2, rank)):
        return (
            f"ReduceMean {mean.name} over axes {axes}, not the spatial axes {list(range(2, rank))}"
        )
    return None


def mean_attributes(m) -> dict:
    rank = m.type("x").rank
    keep = int(m.attrs("mean").get("keepdims", 1))
    return {"rank": rank, "keepdims": keep} | (known_channels(m) if rank == 4 else {})


def make_mean_kernel(attrs: dict, constants: list):
    """GlobalAveragePool's plane means, NCHW (any rank-3/4 x) and, for [N, C, H, W] with the
    channel count known, read from the blocked layout; the output NCHW, shaped as ReduceMean's."""
    from fusion_kernels.pool import global_average_pool, global_average_pool_blocked  # heavy

    ones = (1,) * (attrs["rank"] - 2) if attrs["keepdims"] else ()

    def shaped(y):
        return (y.reshape(*y.shape, *ones),)

    def run(x, *_constants):
        n, c = x.shape[:2]
        if n == 0 or c == 0:  # an empty batch: nothing to average
            return shaped(np.empty((n, c), np.float32))
        return shaped(global_average_pool(x.reshape(n, c, x.shape[2], -1)))

    def run_blocked(xb, *_constants):
        if xb.shape[0] == 0:
            return shaped(np.empty((0, attrs["channels"]), np.float32))
        return shaped(global_average_pool_blocked(xb, attrs["channels"]))

    return with_blocked(run, run_blocked, attrs, keeps_layout=False)


SPATIAL_MEAN = Rule(
    "SpatialMean",
    op.ReduceMean(
        Var(
            "x",
            dtype="float32",
            where=rank_3_or_4,
        ),
        Opt(Const("axes")),
        _name="mean",
    ),
    inputs=("x",),
    prepare=make_mean_kernel,
    attributes=mean_attributes,
    check=spatial_axes,
    # after GlobalAvgPoolFlatten and SqueezeExcite, which take theirs with it, and after the
    # norms (-12, -13): a transformer's [B, T, H] mean over H is a LayerNorm's or RMSNorm's
    priority=-20,
    description="ReduceMean over the trailing spatial axes (time, or H and W), float32: "
    "a Conv1d classifier's mean over time, a global average pool without Flatten",
    explain_after="ReduceMean",
)
