"""FireModule (SqueezeNet):  s = cbr_squeeze(x);  y = concat_1(cbr_1x1(s), cbr_3x3(s))

cbr is act(conv2d(t, W) + b), the conv sub-pattern of ConvBiasRelu (patterns/conv.py) with the
epilogue kernels/conv2d runs: the bias as Conv's input or an Add, Relu, Clip or none. Both
expand branches read the same squeeze output, and the Concat may list them in either order.
The kernel computes s once and writes each branch's epilogue (bias, activation) straight into
its channel range of y, so no Concat copy is left: in NCHW (kernels/fire), or in the blocked
layout, each expand conv writing its channel blocks of y (FireKernel's tactics).
"""

from __future__ import annotations

from dataclasses import replace

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Pattern, op
from fusion_patterns.activation import CLIPPING
from fusion_patterns.concat import why_not_blocked
from fusion_patterns.conv import (
    BlockedPart,
    bind_blocked_concat,
    blocked_concat,
    blocked_plan,
    check_conv,
    conv_attributes,
    conv_epilogue,
    conv_plan,
    folded,
)

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


def _convs(attrs: dict, constants: list) -> dict:
    """Each conv's attributes and folded (weight, bias), by prefix."""
    constants = [*constants, *[None] * (len(INPUTS) - len(constants))]  # trailing absent inputs
    given = dict(zip(INPUTS, constants, strict=True))
    convs = {}
    for prefix in BRANCHES:
        conv = {k[len(prefix) :]: v for k, v in attrs.items() if k.startswith(prefix)}
        given_k = [None, *(given[prefix + k] for k in ("W", "B", "bias_add"))]
        convs[prefix] = (conv, *folded(conv, given_k))
    return convs


def fire_plan(attrs: dict, constants: list, convs: dict | None = None):
    """The kernel's FirePlan: the three convs' weights packed, the branches in Concat order
    (convs: _convs' result, when made already)."""
    from fusion_kernels.fire import prepare_fire  # heavy (Numba): only when a kernel is built

    convs = _convs(attrs, constants) if convs is None else convs
    plans = {prefix: conv_plan(*c) for prefix, c in convs.items()}
    expands = [plans[EXPAND1], plans[EXPAND3]]
    return prepare_fire(plans[SQUEEZE], *(expands[:: ORDERS[attrs["branch_order"]]]))


class FireKernel:
    """Called on NCHW input it runs kernels/fire. `tactics` offers first the blocked layout
    when the first expand conv in Concat order fills whole blocks (patterns/concat.
    why_not_blocked; the squeeze's output is blocked whatever its channels): the squeeze conv
    on the direct kernel, then each expand conv writing its channel blocks of y ("blocked": in
    place; "blocked-wino": the 3x3 one on the blocked Winograd kernel, in place too); then
    "nchw" (their fallback). `nchw_only` says why there is no blocked tactic, when there is
    none."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built
        from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc, tile_options
        from fusion_kernels.fire import fire

        convs = _convs(attrs, constants)  # folded once for every tactic
        plan = fire_plan(attrs, constants, convs)
        self.run = lambda x, *_constants: (fire(x, plan),)
        self.tactics = [Tactic("nchw", self.run)]
        order = [EXPAND1, EXPAND3][:: ORDERS[attrs["branch_order"]]]
        b = block()
        channels = [convs[p][1].shape[0] for p in order]
        self.nchw_only = why_not_blocked(4, channels, b)
        if self.nchw_only is not None:
            self.nchw_only = f"expand convs in Concat order: {self.nchw_only}"
            return
        conv, w, bias = convs[SQUEEZE]
        squeeze = blocked_plan(conv, w, bias, tile_options(w.shape)[0])
        for name, winograd in (("blocked", False), ("blocked-wino", True)):
            parts = [BlockedPart(*convs[p], winograd=winograd, in_block=b) for p in order]
            if winograd and all(p.wino is None for p in parts):
                break

            def run_blocked(xb, *_constants, parts=parts):
                return (blocked_concat(parts, [conv_nchwc(xb, squeeze)] * len(parts)),)

            def bind(xb, *_constants, parts=parts):
                first = bind_conv_nchwc(xb, squeeze)
                rest = bind_blocked_concat(parts, [first(xb)] * len(parts))
                k = len(parts)
                return lambda xb, *_constants: (rest([first(xb)] * k),)

            self.tactics.insert(-1, Tactic(name, run_blocked, blocked_inputs=(0,),
                                           in_blocks=(squeeze.in_block,), blocked_outputs=(0,),
                                           out_channels=(sum(channels),), bind=bind))  # fmt: skip
        # NCHW: the blocked tactics' fallback (timed per node on Zen 4 it lost all 16 Fire
        # modules, 2.6x at the median: bench/NOTES.md)
        self.tactics[-1] = replace(self.tactics[-1], fallback=True)

    def __call__(self, x, *constants):
        return self.run(x, *constants)


INPUTS = ("squeeze_x", *(p + name for p in BRANCHES for name in ("W", "B", "bias_add")))

RULE = Rule(
    "FireModule",
    fire_module(),
    inputs=INPUTS,
    prepare=FireKernel,
    attributes=fire_attributes,
    check=check_fire,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=20,  # contains three ConvBiasRelu (10) matches, so it goes first
    description="SqueezeNet Fire: squeeze conv, 1x1 and 3x3 expand convs, Concat on channels",
    explain_after="Conv",
)
