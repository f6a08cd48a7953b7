"""InvertedResidual:  y = project(depthwise(expand(x))) [+ x], MobileNetV2's block in one node.

    e = act_e(bn(conv1x1(x)))          expand C -> E (absent: expansion 1, e = x)
    d = act_d(bn(depthwise_kxk(e)))    stride 1 or 2, group = E
    y = act_p(bn(conv1x1(d)) [+ x]) [+ x]   project E -> M, the block's input added before or
                                       after the activation (ResNet, MobileNetV2)

Each conv is the conv-epilogue sub-pattern of patterns/conv.py (bias, BatchNorm, any
activation of the table) with its captures prefixed e_, d_, p_. Run op by op, e and d go to
memory and back; kernels/inverted_residual.py computes the block depth first, in bands of
output rows whose e and d stay in L2. Tactics: that kernel ("blocked-depthfirst"), and the op-
by-op plan with the blocked conv kernels ("blocked-opbyop"), so the race compares them.
A tensor inside the block that is also a graph output or read elsewhere is not fused away (the
rewriter's safety check). Squeeze-excitation between the depthwise conv and the projection
(MobileNetV3, EfficientNet) is not this pattern: its gate needs the whole plane of d, which a
band does not have. There the block splits at the gate: ExpandDepthwise takes the expand and
the depthwise conv (the same kernel, stopping at d: e never leaves the core's cache), then
SqueezeExciteConv the gate and the projection (patterns/squeeze_excite.py: the gate folded
into the projection's weights, so d g is never written either).

ExpandDepthwise:  d = act_d(bn(depthwise_kxk(act_e(bn(conv1x1(x))))))
"""

from __future__ import annotations

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Op, Opt, Var
from fusion_patterns.activation import activation_keywords
from fusion_patterns.conv import INPUTS as CONV_INPUTS
from fusion_patterns.conv import (
    check_conv,
    conv_attributes,
    conv_epilogue,
    folded,
    pointwise_reason,
)

PREFIXES = ("e_", "d_", "p_")
PER_CONV = CONV_INPUTS[1:-1]  # W, B, bias_add, bn_scale, bn_bias, bn_mean, bn_var
INPUTS = ("x", *(p + name for p in PREFIXES for name in PER_CONV))


def _grouped(m, node) -> str | None:
    """The middle conv is grouped (a depthwise one, checked in full by check)."""
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    return None if group > 1 else f"{node.name}: group {group}, not a depthwise conv"


def _constrain(p, name: str, where) -> None:
    """Set `where` on the node pattern captured as `name` inside the sub-pattern p."""
    if isinstance(p, Op):
        if p.name == name:
            p.where = where
        for q in p.inputs:
            _constrain(q, name, where)
    elif isinstance(p, Alt):
        for q in p.options:
            _constrain(q, name, where)
    elif isinstance(p, Opt):
        _constrain(p.pattern, name, where)


def _depthwise_chain(x):
    """The depthwise kxk conv with its epilogue on x: the expand's output, or the block's
    input (expansion 1)."""
    d = conv_epilogue(x, "d_", residual=False, pad=True)  # Keras pads before a strided one
    _constrain(d, "d_conv", _grouped)  # structural: a chain of plain convs is no near-miss
    return d


def inverted_residual():
    x = Var("x", dtype="float32", rank=4)
    d = _depthwise_chain(Alt(conv_epilogue(x, "e_", residual=False), x))
    return conv_epilogue(d, "p_", residual=x)  # the block's input added before or after act_p


def expand_depthwise():
    x = Var("x", dtype="float32", rank=4)
    return _depthwise_chain(conv_epilogue(x, "e_", residual=False))


def attributes(m) -> dict:
    convs = [p for p in PREFIXES if p + "conv" in m.node_index]
    attrs = {f"{p}{k}": v for p in convs for k, v in conv_attributes(m, p).items()}
    return {**attrs, "expand": int("e_" in convs)}  # p_residual: "before", "after" or absent


def _depthwise_reason(m) -> str | None:
    """Why the middle conv is not a depthwise one the block kernel runs, if it is not."""
    wd, a = m.const("d_W"), m.attrs("d_conv")
    if wd.ndim != 4 or wd.shape[1] != 1 or int(a["group"]) != wd.shape[0]:
        return f"d: a {list(wd.shape)} conv of group {a['group']}, not a depthwise one"
    k, strides = wd.shape[2], list(a["strides"])
    if wd.shape[3] != k or strides not in ([1, 1], [2, 2]) or any(v != 1 for v in a["dilations"]):
        return (
            f"d: a {list(wd.shape[2:])} depthwise conv with strides {strides}, dilations "
            f"{list(a['dilations'])}: the block kernel runs square filters, stride 1 or 2"
        )
    pads = conv_attributes(m, "d_")["pads"]  # a Pad before it included
    if a["auto_pad"] not in ("NOTSET", "") and "d_pad" not in m.node_index or max(pads) >= k:
        return f"d: auto_pad {a['auto_pad']}, pads {pads}"
    return None


def check_expand_depthwise(m) -> str | None:
    reason = _depthwise_reason(m) or pointwise_reason(m, "e_")
    if reason:
        return reason
    we, wd = m.const("e_W"), m.const("d_W")
    if we.shape[0] != wd.shape[0]:
        return f"weights {list(we.shape)}, {list(wd.shape)} do not chain"
    for p in PREFIXES[:2]:
        reason = check_conv(m, p, res="x")
        if reason:
            return f"{p[:-1]}: {reason}"
    return None


def check(m) -> str | None:
    reason = _depthwise_reason(m)
    if reason:
        return reason
    wd, strides = m.const("d_W"), list(m.attrs("d_conv")["strides"])
    expand = "e_conv" in m.node_index
    for p in ("e_", "p_") if expand else ("p_",):
        reason = pointwise_reason(m, p)
        if reason:
            return reason
    we, wp = m.const("e_W"), m.const("p_W")
    if (expand and we.shape[0] != wd.shape[0]) or wp.shape[1] != wd.shape[0]:
        return f"weights {[list(w.shape) for w in (we, wd, wp) if w is not None]} do not chain"
    for p in PREFIXES if expand else PREFIXES[1:]:
        reason = check_conv(m, p, res="x")
        if reason:
            return f"{p[:-1]}: {reason}"
    vt = m.type("x")
    add = next((m.node(n) for n in ("p_res_before", "p_res_after") if n in m.node_index), None)
    if add is not None:
        c = vt.shape[1] if vt is not None and vt.shape else None
        if strides != [1, 1] or c != wp.shape[0]:
            return (
                f"Add {add.name}: the residual needs stride 1 and {wp.shape[0]} "
                f"channels in {m['x']}, got strides {strides} and {c}"
            )
    return None


class InvertedResidualKernel:
    """Tactics on blocked tensors: the depth-first block kernel, then the op-by-op plan (the
    blocked conv kernels, e and d through memory); called on NCHW it runs the first. Without
    p_ attributes (ExpandDepthwise) the block stops at d."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block_size, from_blocked, to_blocked  # heavy (Numba)
        from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc
        from fusion_kernels.inverted_residual import (
            bind_inverted_residual,
            inverted_residual,
            prepare_inverted_residual,
        )

        n = len(PER_CONV)
        convs, acts = {}, []
        for k, p in enumerate(PREFIXES):
            conv = {key[len(p) :]: v for key, v in attrs.items() if key.startswith(p)}
            if not conv:  # expansion 1
                convs[p], _ = (None, None), acts.append(None)
                continue
            convs[p] = folded(conv, [None, *constants[1 + n * k : 1 + n * (k + 1)]])
            acts.append(activation_keywords(conv))
        d_attrs = {key[2:]: v for key, v in attrs.items() if key.startswith("d_")}
        stride, pads = d_attrs["strides"][0], tuple(d_attrs["pads"])
        residual = attrs.get("p_residual")  # None, "before" or "after"
        (we, be), (wd, bd), (wp, bp) = (convs[p] for p in PREFIXES)
        plan = prepare_inverted_residual(we, be, wd, bd, wp, bp, stride=stride, pads=pads,
                                         acts=acts, residual=residual)  # fmt: skip
        c, m = plan.in_channels, plan.out_channels
        steps = plan.convs  # the same packed weights, run one by one through memory

        def depthfirst(xb, *_constants):
            return (inverted_residual(xb, plan),)

        def opbyop(xb, *_constants):
            t = xb
            if we is None and xb.shape[-1] != plan.block:  # C < b: the depthwise reads b-blocks
                t = to_blocked(from_blocked(xb, c), plan.block)
            for step in steps[:-1]:
                t = conv_nchwc(t, step)
            r = None
            if residual:
                r = (
                    xb
                    if xb.shape[-1] == plan.block
                    else to_blocked(from_blocked(xb, c), plan.block)
                )
            return (conv_nchwc(t, steps[-1], residual=r),)

        def bind_depthfirst(xb, *_constants):
            call = bind_inverted_residual(xb, plan)
            return None if call is None else lambda xb, *_constants: (call(xb),)

        def bind_opbyop(xb, *_constants):
            if xb.shape[-1] != plan.block:  # re-blocked per call
                return None
            calls, t = [], xb
            for step in steps:
                r = xb if residual and step is steps[-1] else None
                calls.append(bind_conv_nchwc(t, step, residual=r))
                t = calls[-1](t, r)
            *firsts, last = calls

            def call(xb, *_constants):
                t = xb
                for first in firsts:
                    t = first(t)
                return (last(t, xb if residual else None),)

            return call

        def run(x, *_constants):
            return (from_blocked(inverted_residual(to_blocked(x), plan), m),)

        blocked = dict(blocked_inputs=(0,), in_blocks=(block_size(c),), blocked_outputs=(0,),
                       out_channels=(m,))  # fmt: skip
        self.run = run
        self.tactics = [Tactic("blocked-depthfirst", depthfirst, **blocked, depth_first=True,
                               bind=bind_depthfirst),
                        Tactic("blocked-opbyop", opbyop, **blocked, bind=bind_opbyop)]  # fmt: skip

    def __call__(self, x, *constants):
        return self.run(x, *constants)


def make_kernel(attrs: dict, constants: list):
    return InvertedResidualKernel(attrs, constants)


RULE = Rule(
    "InvertedResidual",
    inverted_residual(),
    inputs=INPUTS,
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=18,  # before ConvBiasRelu (10) takes its convs one by one (FireModule: 20)
    description="inverted residual: 1x1 expand -> depthwise kxk -> 1x1 project [+ x], float32",
    # Only whole-block matches are near-misses (their reasons: escapes, checks): a partial one
    # is any conv after a conv, and would be noise in every CNN's explanation.
    explain_after="InvertedResidual",
    from_last=True,  # the root may be any node of the chain: the longest chain claims first
)


EXPAND_DEPTHWISE = Rule(
    "ExpandDepthwise",
    expand_depthwise(),
    inputs=INPUTS[: 1 + 2 * len(PER_CONV)],  # x, the e_ and d_ constants
    prepare=make_kernel,
    attributes=attributes,
    check=check_expand_depthwise,
    accumulates=True,
    priority=16,  # after InvertedResidual (a whole block first), before ConvBiasRelu (10)
    description="1x1 expand -> depthwise kxk, depth first (the block before an SE gate), float32",
    explain_after="ExpandDepthwise",  # as InvertedResidual: only whole matches are near-misses
    from_last=True,
)
