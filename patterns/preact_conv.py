"""PreActConv:  y = act_c(bn_c(conv1x1(act_n(bn_n(x)))))   float32 [N, C, H, W] -> [N, M, H, W]

A BatchNormalization (+ activation) whose output only a 1x1 conv reads: DenseNet's layers and
transitions (BN and ReLU of the concatenated features, then the 1x1 conv; pre-activation
ResNets' first conv). The norm cannot fold into the conv's weights (its activation comes
first), so op by op its output goes to memory and back. The conv's side is the conv-epilogue
sub-pattern of patterns/conv.py (bias, BatchNorm, any activation), captures prefixed c_; the
norm's is BatchNormAct's (patterns/norm.py), prefixed n_.

Tactics on blocked tensors: kernels/preact_conv.py, the norm of a band of pixels computed into
L2 and read there by the conv's register tiles ("blocked-preact-fN", one per register tile
worth timing, as the conv's own), and the two passes through memory ("blocked-opbyop"), so the
race compares them. A norm output that is also a graph
output or read by another node is not fused away (the rewriter's safety check).
"""

from __future__ import annotations

from fusion.catalog import Rule, Tactic
from fusion.pattern import Var
from fusion_patterns.activation import activation_attributes, activation_keywords, check_relu6
from fusion_patterns.conv import INPUTS as CONV_INPUTS
from fusion_patterns.conv import (
    bn_affine,
    check_bn,
    check_conv,
    conv_attributes,
    conv_epilogue,
    folded,
    pointwise_reason,
)
from fusion_patterns.norm import BN, batch_norm_act

PER_CONV = CONV_INPUTS[1:-1]  # W, B, bias_add, bn_scale, bn_bias, bn_mean, bn_var
INPUTS = ("x", *("n_" + name for name in BN), *("c_" + name for name in PER_CONV))


def _not_after_a_conv(m, node) -> str | None:
    """The norm does not follow a conv (or a conv's bias Add): ConvBiasRelu folds such a norm
    into that conv's weights, which costs nothing at run time (structural: no near-miss)."""
    src = m.view.producer.get(node.input[0])
    before = m.view.nodes[src[0]] if src else None
    if before is not None and before.op_type == "Add":
        convs = [m.view.producer.get(v) for v in before.input]
        if any(p and m.view.nodes[p[0]].op_type == "Conv" for p in convs):
            return f"{node.name} follows a conv's bias Add {before.name}"
    if before is not None and before.op_type == "Conv":
        return f"{node.name} follows Conv {before.name}: it folds into that conv"
    return None


def preact_conv():
    x = Var("x", dtype="float32", rank=4)
    return conv_epilogue(batch_norm_act(x, "n_", _not_after_a_conv), "c_", residual=False)


def attributes(m) -> dict:
    conv = {f"c_{k}": v for k, v in conv_attributes(m, "c_").items()}
    norm = {f"n_{k}": v for k, v in activation_attributes(m, "n_").items()}
    return {**conv, **norm, "n_epsilon": float(m.attrs("n_bn").get("epsilon", 1e-5))}


def check(m) -> str | None:
    w = m.const("c_W")
    return (
        pointwise_reason(m, "c_")
        or check_bn(m, "n_", w.shape[1])
        or check_relu6(m, "n_")
        or check_conv(m, "c_")
    )


class PreActConvKernel:
    """Tactics on blocked tensors: the depth-first kernel once per register tile worth timing
    (the conv's own choice: "blocked-preact-f4" = 4 output blocks a tile), then the norm's pass
    and the conv (its output through memory); called on NCHW it runs the first."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block, from_blocked, to_blocked  # heavy (Numba)
        from fusion_kernels.conv_nchwc import conv_nchwc, tile_options
        from fusion_kernels.pointwise import pointwise_blocked
        from fusion_kernels.preact_conv import bind_preact_conv, preact_conv, prepare_preact_conv

        k = 1 + len(BN)
        s, t = bn_affine(*constants[1:k], attrs["n_epsilon"])
        conv = {key[2:]: v for key, v in attrs.items() if key.startswith("c_")}
        norm = {key[2:]: v for key, v in attrs.items() if key.startswith("n_")}
        w, bias = folded(conv, [None, *constants[k:]])
        plans = [prepare_preact_conv(s, t, w, bias, norm_act=activation_keywords(norm),
                                     conv_act=activation_keywords(conv), tile=tile)
                 for tile in tile_options(w.shape)]  # fmt: skip
        first, m = plans[0], plans[0].out_channels

        def depthfirst(plan):
            return lambda xb, *_constants: (preact_conv(xb, plan),)

        def bind(plan):
            def bound(xb, *_constants):
                call = bind_preact_conv(xb, plan)
                return lambda xb, *_constants: (call(xb),)

            return bound

        def opbyop(xb, *_constants):
            return (conv_nchwc(pointwise_blocked(xb, first.norm), first.conv),)

        def run(x, *_constants):
            return (from_blocked(preact_conv(to_blocked(x, block=first.block), first), m),)

        blocked = dict(blocked_inputs=(0,), in_blocks=(block(),), blocked_outputs=(0,),
                       out_channels=(m,))  # fmt: skip
        self.run = run
        self.tactics = [
            *(
                Tactic(
                    f"blocked-preact-f{p.conv.fb}",
                    depthfirst(p),
                    **blocked,
                    depth_first=True,
                    bind=bind(p),
                )
                for p in plans
            ),
            Tactic("blocked-opbyop", opbyop, **blocked),
        ]

    def __call__(self, x, *constants):
        return self.run(x, *constants)


RULE = Rule(
    "PreActConv",
    preact_conv(),
    inputs=INPUTS,
    prepare=PreActConvKernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=15,  # before ConvBiasRelu (10) takes the conv and BatchNormAct (5) the norm
    description="BatchNormalization + activation -> 1x1 conv (+ its epilogue), float32",
    # Only whole matches are near-misses (their reasons: escapes, checks): a partial one is any
    # BatchNormalization after a conv, noise in every CNN's explanation.
    explain_after="PreActConv",
    from_last=True,
)
