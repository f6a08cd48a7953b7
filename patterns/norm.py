"""BatchNormAct:  y = act(BatchNormalization(x)) = act(x s + t)   per channel,

s = scale / sqrt(var + eps), t = bias - mean s, act any activation of patterns/activation.py or
none. A BatchNorm that follows a conv folds into it (ConvBiasRelu, which goes first); this rule
takes the ones that do not: DenseNet's pre-activation BN + Relu after each Concat, and the BN
the dynamo exporter leaves standing. Unfused, each is an onnxruntime island between kernels.

The kernel is one pass of kernels/pointwise.py, on blocked tensors (4-D x, between blocked
kernels) or NCHW / [N, C, ...].
"""

from __future__ import annotations

from dataclasses import replace

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Var, op
from fusion_patterns.activation import (
    activation,
    activation_attributes,
    activation_keywords,
    check_relu6,
)
from fusion_patterns.conv import bn_affine, check_bn

BN = ("bn_scale", "bn_bias", "bn_mean", "bn_var")


def batch_norm_act(x=None, prefix: str = "", where=None):
    """act(BatchNormalization(x)) or the BatchNormalization alone; captures named with
    `prefix` (PreActConv's norm before its conv), `where` a check on the BatchNormalization."""
    x = x if x is not None else Var("x", dtype="float32")
    bn = op.BatchNormalization(x, *(Const(prefix + n) for n in BN), _name=prefix + "bn",
                               _where=where)  # fmt: skip
    return Alt(activation(bn, prefix), bn)


def attributes(m) -> dict:
    rank = m.type("x").rank if m.type("x") is not None else None
    return {**activation_attributes(m), "epsilon": float(m.attrs("bn").get("epsilon", 1e-5)),
            "rank": -1 if rank is None else int(rank)}  # fmt: skip


def check(m) -> str | None:
    vt = m.type("x")
    if vt is None or vt.rank is None or vt.rank < 2:
        return f"{m['x']} has rank {None if vt is None else vt.rank}; BatchNorm needs [N, C, ...]"
    return check_bn(m, "", m.const("bn_scale").size) or check_relu6(m)


class BatchNormKernel:
    """Tactics: blocked (a 4-D x), then NCHW (its fallback, when there is a blocked one)."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built
        from fusion_kernels.pointwise import pointwise, pointwise_blocked, prepare_pointwise

        s, t = bn_affine(*constants[1:5], attrs["epsilon"])
        plan = prepare_pointwise(s.size, s, t, **activation_keywords(attrs))
        self.run = lambda x, *_constants: (pointwise(x, plan),)
        self.tactics = [Tactic("nchw", self.run)]
        if attrs.get("rank") == 4:
            blocked = lambda xb, *_constants: (pointwise_blocked(xb, plan),)  # noqa: E731
            self.tactics.insert(0, Tactic(
                "blocked", blocked, blocked_inputs=(0,), in_blocks=(block(),), blocked_outputs=(0,),
                out_channels=(s.size,),
            ))  # fmt: skip
            self.tactics[-1] = replace(self.tactics[-1], fallback=True)  # the blocked one's

    def __call__(self, x, *constants):
        return self.run(x, *constants)


RULE = Rule(
    "BatchNormAct",
    batch_norm_act(),
    inputs=("x", *BN),
    prepare=BatchNormKernel,
    attributes=attributes,
    check=check,
    priority=5,  # after ConvBiasRelu, which folds a BatchNorm that follows a conv
    description="BatchNormalization (inference) + optional activation, float32, per channel",
    explain_after="BatchNormalization",
    from_last=True,
)
