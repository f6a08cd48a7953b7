"""Pooling. MaxPool2D:  y = MaxPool(x)   for a 4-D float32 x, any kernel, stride, padding,
dilation. GlobalAvgPoolFlatten:  y = Flatten(GlobalAveragePool(x), axis=1)   ([N, C]).

A one-op rule. Between fused nodes a lone MaxPool (SqueezeNet's and GoogLeNet's, after a conv
or a Fire module) would otherwise run as an onnxruntime island of its own: a session call, a
layout its conv-less island keeps NCHW, and the kernels' threads sleeping meanwhile. As a kernel
it runs in-process (kernels/pool.py). The Indices output, if something reads it, keeps the
node out (the rewriter says which node reads it).

GlobalAveragePool + Flatten is the head PyTorch exports for every torchvision classifier
(adaptive_avg_pool2d to 1x1, then torch.flatten(x, 1)); fused, the model's tail needs no island.
"""

from __future__ import annotations

from fusion.catalog import Rule, Tactic
from fusion.pattern import Var, op
from kernels.windows import prepare_maxpool


def attributes(m) -> dict:
    pool = m.attrs("pool")
    attrs = {
        "kernel_shape": list(pool["kernel_shape"]),
        "strides": list(pool["strides"]),
        "pads": list(pool["pads"]),
        "dilations": list(pool["dilations"]),
        "ceil_mode": int(pool.get("ceil_mode", 0)),
        "auto_pad": pool.get("auto_pad", "NOTSET"),
    }
    vt = m.type("x")
    if vt is not None and vt.shape and len(vt.shape) == 4 and isinstance(vt.shape[1], int):
        attrs["channels"] = vt.shape[1]  # known: the pool can also run on the blocked layout
    return attrs


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
    from kernels.blocked import BLOCK  # heavy (Numba): only when a kernel is built
    from kernels.pool import maxpool2d, maxpool_blocked

    plan = _plan(attrs)

    def run(x):
        return (maxpool2d(x, plan),)

    run.tactics = [Tactic("nchw", run)]
    if attrs.get("channels"):
        blocked = Tactic(
            "blocked",
            lambda xb: (maxpool_blocked(xb, plan),),
            blocked_inputs=(0,),
            in_blocks=(BLOCK,),
            blocked_outputs=(0,),
            out_channels=(attrs["channels"],),
        )
        run.tactics.insert(0, blocked)
    return run


RULE = Rule(
    "MaxPool2D",
    op.MaxPool(Var("x", dtype="float32", rank=4), _name="pool"),
    inputs=("x",),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    description="2-D MaxPool, float32 NCHW, in-process between fused nodes (no island)",
    explain_after="MaxPool",
    rtol=0.0,
    atol=0.0,
)


def gap_attributes(m) -> dict:
    vt = m.type("x")
    if vt is not None and vt.shape and len(vt.shape) == 4 and isinstance(vt.shape[1], int):
        return {"channels": vt.shape[1]}  # known: the head can also read the blocked layout
    return {}


def make_gap_kernel(attrs: dict, constants: list):
    """The NCHW kernel; with the channel count known, first a tactic reading the blocked
    layout (after a blocked conv, no conversion before the head)."""
    from kernels.blocked import BLOCK  # heavy (Numba): only when a kernel is built
    from kernels.pool import global_average_pool, global_average_pool_blocked

    def run(x):
        return (global_average_pool(x),)

    run.tactics = [Tactic("nchw", run)]
    channels = attrs.get("channels")
    if channels:
        blocked = Tactic(
            "blocked",
            lambda xb: (global_average_pool_blocked(xb, channels),),
            blocked_inputs=(0,),
            in_blocks=(BLOCK,),
        )
        run.tactics.insert(0, blocked)
    return run


def check_flatten(m) -> str | None:
    axis = m.attrs("flat").get("axis", 1)
    return None if axis in (1, -3) else f"Flatten on axis {axis}; the head flattens from axis 1"


GAP_FLATTEN = Rule(
    "GlobalAvgPoolFlatten",
    op.Flatten(op.GlobalAveragePool(Var("x", dtype="float32", rank=4), _name="gap"), _name="flat"),
    inputs=("x",),
    prepare=make_gap_kernel,
    attributes=gap_attributes,
    check=check_flatten,
    description="GlobalAveragePool + Flatten(axis=1), float32 NCHW -> [N, C] (classifier heads)",
    explain_after="GlobalAveragePool",
)
