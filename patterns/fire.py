"""FireModule (SqueezeNet):  s = cbr_squeeze(x);  y = concat_1(cbr_1x1(s), cbr_3x3(s))

cbr is act(conv2d(t, W) + b), the conv sub-pattern of ConvBiasRelu (patterns/conv.py) with the
epilogue kernels/conv2d runs: the bias as Conv's input or an Add, Relu, Clip or none. Both
expand branches read the same squeeze output, and the Concat may list them in either order.
The kernel computes s once and writes each branch's epilogue (bias, activation) straight into
its channel range of y, so no Concat copy is left.
"""

from __future__ import annotations

from fusion.catalog import Rule
from fusion.pattern import Alt, Pattern, op
from patterns.activation import CLIPPING
from patterns.conv import check_conv, conv_attributes, conv_epilogue, conv_plan, folded

SQUEEZE, EXPAND1, EXPAND3 = "squeeze_", "expand1x1_", "expand3x3_"
BRANCHES = {SQUEEZE: (1, 1), EXPAND1: (1, 1), EXPAND3: (3, 3)}  # capture prefix -> kernel
ORDERS = {"1x1,3x3": 1, "3x3,1x1": -1}  # branch_order attribute -> step over (e1, e3)
CHANNEL_AXES = (1, -3)  # axis 1 of an NCHW tensor, however it is written


def cbr(x: Pattern | None, prefix: str) -> Pattern:
    """One conv of the module: bias, then Relu, Clip or nothing (no BatchNorm, no residual)."""
    return conv_epilogue(x, prefix, kinds=CLIPPING, residual=False, norm=False)


def fire_module(x: Pattern | None = None) -> Pattern:
    """Squeeze conv, then a 1x1 and a 3x3 expand conv of its output, concatenated."""
    squeeze = cbr(x, SQUEEZE)
    e1, e3 = cbr(squeeze, EXPAND1), cbr(squeeze, EXPAND3)
    # The order is an alternative; `check` tells the branches apart by their kernels.
    return Alt(*(op.Concat(a, b, _name="concat") for a, b in ((e1, e3), (e3, e1))))


def check_fire(m) -> str | None:
    axis = m.attrs("concat").get("axis")
    if axis not in CHANNEL_AXES:
        return f"Concat on axis {axis}; a Fire module concatenates channels (axis 1)"
    for prefix, kernel in BRANCHES.items():
        reason = check_conv(m, prefix)
        if reason:
            return f"{prefix[:-1]}: {reason}"
        have = tuple(m.const(prefix + "W").shape[2:])
        if have != kernel:
            size = "x".join(map(str, have))
            return f"{prefix[:-1]} conv is {size}, a Fire module needs {kernel[0]}x{kernel[1]}"
    return None


def fire_attributes(m) -> dict:
    """Each conv's attributes under its prefix, and which branch comes first in the Concat."""
    attrs = {}
    for prefix in BRANCHES:
        attrs.update({prefix + k: v for k, v in conv_attributes(m, prefix).items()})
    first = m.node("concat").input[0] == m.node(EXPAND3 + "act").output[0]
    attrs["branch_order"] = "3x3,1x1" if first else "1x1,3x3"
    return attrs


def fire_plan(attrs: dict, constants: list):
    """The kernel's FirePlan: the three convs' weights packed, the branches in Concat order."""
    from kernels.fire import prepare_fire  # heavy (Numba): only when a kernel is built

    constants = [*constants, *[None] * (len(INPUTS) - len(constants))]  # trailing absent inputs
    given = dict(zip(INPUTS, constants, strict=True))
    plans = {}
    for prefix in BRANCHES:
        conv = {k[len(prefix) :]: v for k, v in attrs.items() if k.startswith(prefix)}
        w, bias = folded(conv, [None, *(given[prefix + k] for k in ("W", "B", "bias_add"))])
        plans[prefix] = conv_plan(conv, w, bias)
    expands = [plans[EXPAND1], plans[EXPAND3]]
    return prepare_fire(plans[SQUEEZE], *(expands[:: ORDERS[attrs["branch_order"]]]))


def make_kernel(attrs: dict, constants: list):
    """Pack the three convs' weights once; run(x) returns the concatenated output."""
    from kernels.fire import fire  # heavy (Numba): only when a kernel is built

    plan = fire_plan(attrs, constants)

    def run(x, *_constants):
        return (fire(x, plan),)

    return run


INPUTS = ("squeeze_x", *(p + name for p in BRANCHES for name in ("W", "B", "bias_add")))

RULE = Rule(
    "FireModule",
    fire_module(),
    inputs=INPUTS,
    prepare=make_kernel,
    attributes=fire_attributes,
    check=check_fire,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=20,  # contains three ConvBiasRelu (10) matches, so it goes first
    description="SqueezeNet Fire: squeeze conv, 1x1 and 3x3 expand convs, Concat on channels",
    explain_after="Conv",
)
