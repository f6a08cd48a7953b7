"""ConvConcat:  y = concat_1(cbr_1(x_1), ..., cbr_B(x_B))   for B >= 2 branches

cbr_k is a ConvBiasRelu node (stage 0's fused Conv + epilogue) whose output only the Concat
reads, with the epilogue kernels/conv2d runs: bias, Relu, Clip or none (no BatchNorm, residual or
other activation: such a branch is named in the reason). This is the general form of
SqueezeNet's Fire module that TensorRT calls concat elision: the last convolution of each branch
of an Inception block (GoogLeNet's 1x1, 3x3, 5x5 and pool-projection branches) writes its
epilogue straight into its channel range of y, so the Concat copy disappears. The branches may
read different inputs (Inception's 3x3 branch reads a 1x1 reduction, its pool branch a MaxPool)
and have any kernel, stride or padding, as long as their outputs agree in batch and size
(checked when the kernel runs).

A Concat has any number of inputs, which a pattern cannot state, so this rule has a finder
anchored on Concat, at stage 1 (it reads the ConvBiasRelu nodes stage 0 made). A Fire module,
fused at stage 0, has no Concat left for it.
"""

from __future__ import annotations

from dataclasses import replace

from fusion.catalog import DOMAIN, Rule, Tactic
from fusion.graph import GraphView
from fusion.matcher import Match
from fusion_patterns.concat import why_not_blocked
from fusion_patterns.conv import (
    BlockedPart,
    bind_blocked_concat,
    blocked_concat,
    clips_only,
    conv_plan,
    folded,
)
from fusion_patterns.fire import CHANNEL_AXES

CONV_INPUTS = 4  # a branch's inputs: a ConvBiasRelu node's x, W, B, bias_add ("" when absent)


def _branch(view: GraphView, value: str) -> int | None:
    """The ConvBiasRelu node that produces `value`, if one does."""
    producer = view.producer.get(value)
    if producer is None:
        return None
    node = view.nodes[producer[0]]
    return producer[0] if node.op_type == "ConvBiasRelu" and node.domain == DOMAIN else None


def find_concat(view: GraphView, index: int) -> list[Match] | str | None:
    """The Concat at `index` with every input a ConvBiasRelu output; a reason when only some
    are, or when the Concat is not on the channel axis; None when none is."""
    concat = view.nodes[index]
    branches = [_branch(view, value) for value in concat.input]
    if len(branches) < 2 or all(b is None for b in branches):
        return None
    for k, (value, b) in enumerate(zip(concat.input, branches, strict=True)):
        if b is None:
            return f"input {k} ({value}) is not the output of a ConvBiasRelu"
    for k, b in enumerate(branches):
        reason = _nchw_branch(view, b)
        if reason:
            return f"branch {k} ({view.nodes[b].name}): {reason}"
    if len(set(branches)) != len(branches):
        return "the same ConvBiasRelu output is concatenated more than once"
    outputs = {view.nodes[b].output[0]: k for k, b in enumerate(branches)}
    for k, b in enumerate(branches):
        if view.nodes[b].input[0] in outputs:
            j = outputs[view.nodes[b].input[0]]
            return f"branch {k} reads branch {j}'s output (consecutive convs, not branches)"
    axis = view.attributes(concat).get("axis")
    if axis not in CHANNEL_AXES:
        return f"Concat on axis {axis}, not on the channels (axis 1)"
    parts = []
    for b in branches:
        inputs = list(view.nodes[b].input)[:CONV_INPUTS]
        parts += inputs + [""] * (CONV_INPUTS - len(inputs))
    names = {f"b{k}": b for k, b in enumerate(branches)}
    values = {"parts": parts, "y": concat.output[0]}
    return [Match.of(view, values, {"concat": index, **names}, [*branches, index])]


def _nchw_branch(view: GraphView, index: int) -> str | None:
    """Why the concat kernel (kernels/conv2d per branch) cannot run this ConvBiasRelu node."""
    node = view.nodes[index]
    attrs = view.attributes(node)
    if any(node.input[CONV_INPUTS:]):
        return "a BatchNorm or residual in its epilogue; the concat kernel runs bias and clip only"
    if view.constant(node.input[1]).ndim != 4:
        return "a 1-D conv; the concat kernel runs 2-D ones"
    if not clips_only(attrs):
        return f"a {attrs.get('activation')} epilogue; the concat kernel runs bias and clip only"
    return None


def attributes(m: Match) -> dict:
    """Each branch's ConvBiasRelu attributes under the prefix b<k>_, and the branch count."""
    count = sum(1 for name in m.node_index if name.startswith("b"))
    attrs = {"branches": count}
    for k in range(count):
        attrs.update({f"b{k}_{key}": v for key, v in m.attrs(f"b{k}").items()})
    return attrs


class ConvConcatKernel:
    """Called on NCHW inputs it runs kernels/conv_concat (kernels/conv2d per branch, each
    writing its channel range of y). `tactics` offers first the blocked layout, when every
    branch but the last fills whole blocks (patterns/concat.why_not_blocked) and the blocked
    kernels run every branch: "blocked", each branch's direct conv writing its channel blocks
    of y in place, and "blocked-wino" when a branch is a 3x3 stride-1 conv (Inception's), those
    on the blocked Winograd kernel; then "nchw" (their fallback). `nchw_only` says why there
    is no blocked tactic, when there is none."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built
        from fusion_kernels.conv_concat import conv_concat

        count = attrs["branches"]
        constants = [*constants, *[None] * (count * CONV_INPUTS - len(constants))]
        convs, plans = [], []
        for k in range(count):
            conv = {key[len(f"b{k}_") :]: v for key, v in attrs.items() if key.startswith(f"b{k}_")}
            w, bias = folded(conv, constants[k * CONV_INPUTS : (k + 1) * CONV_INPUTS])
            convs.append((conv, w, bias))
            plans.append(conv_plan(conv, w, bias))

        def run(*inputs):
            return (conv_concat(list(inputs[::CONV_INPUTS]), plans),)

        self.run = run
        self.tactics = [Tactic("nchw", run)]
        self.nchw_only = why_not_blocked(4, [w.shape[0] for _, w, _ in convs], block())
        if self.nchw_only is not None:
            return
        for winograd in (False, True):
            parts = [BlockedPart(conv, w, bias, winograd) for conv, w, bias in convs]
            reasons = [(k, p.reason) for k, p in enumerate(parts) if p.reason is not None]
            if reasons:
                self.nchw_only = f"branch {reasons[0][0]}: {reasons[0][1]}"
                break
            if winograd and all(p.wino is None for p in parts):
                break
            name = "blocked-wino" if winograd else "blocked"
            self.tactics.insert(-1, _blocked_tactic(parts, name))
        if len(self.tactics) > 1:  # NCHW: the blocked ones' fallback (timed per node on Zen 4
            # it lost all 18 of GoogLeNet's, 1.65x at the median: bench/NOTES.md)
            self.tactics[-1] = replace(self.tactics[-1], fallback=True)

    def __call__(self, *inputs):
        return self.run(*inputs)


def _blocked_tactic(parts: list, name: str) -> Tactic:
    def run_blocked(*inputs):
        return (blocked_concat(parts, inputs[::CONV_INPUTS]),)

    def bind(*inputs):
        call = bind_blocked_concat(parts, inputs[::CONV_INPUTS])
        return lambda *inputs: (call(inputs[::CONV_INPUTS]),)

    return Tactic(name, run_blocked,
                  blocked_inputs=tuple(range(0, len(parts) * CONV_INPUTS, CONV_INPUTS)),
                  in_blocks=tuple(p.in_block for p in parts), blocked_outputs=(0,),
                  out_channels=(sum(p.direct.out_channels for p in parts),),
                  bind=bind)  # fmt: skip


RULE = Rule(
    "ConvConcat",
    None,
    inputs=("parts",),
    outputs=("y",),
    prepare=ConvConcatKernel,
    attributes=attributes,
    finder=find_concat,
    anchor_ops=("Concat",),
    stage=1,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=10,
    description="Concat on channels of ConvBiasRelu outputs (Inception branches), no copy",
)
