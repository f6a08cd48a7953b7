"""GatedMLP:  y = (act(x Wg + bg) * (x Wu + bu)) Wd + bd (+ r)

A transformer's gated feed-forward block as one node: Llama's SwiGLU (act = SiLU, written
t * Sigmoid(t)), GeGLU (GELU), or any activation of patterns/activation.py; the gate and up
products are patterns/linear.py's linear_nd of one x (MatMul on [B, S, E], or Gemm between
Reshapes), the down product likewise, the residual Add optional. It contains LinearResidual's
nodes (the down product and the skip connection), so it goes first.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Var, op
from fusion_patterns.activation import activation, activation_attributes, activation_keywords
from fusion_patterns.linear import (
    check_linear,
    linear_attributes,
    linear_inputs,
    linear_nd,
    linear_params,
    onnx_reshape,
    out_features,
)
from fusion_patterns.linear_gelu import residual_follows, with_residual

LINEARS = tuple(
    name for p in ("gate", "up", "down") for name in (*linear_inputs(f"W{p}", p), f"{p}_flat",
                                                     f"{p}_unflat")
)  # fmt: skip
INPUTS = ("x", *LINEARS, "residual")


def pattern():
    x = Var("x", dtype="float32")
    gate = activation(linear_nd(x, "Wgate", "gate"), "gate_")
    gated = op.Mul(gate, linear_nd(x, "Wup", "up"), _name="gated")
    return with_residual(linear_nd(gated, "Wdown", "down"), optional=True)


def check(m) -> str | None:
    for p in ("gate", "up", "down"):
        reason = check_linear(m, f"W{p}", p)
        if reason:
            return reason
    reason = residual_follows(m, "down")
    if reason:
        return reason
    width = out_features(m, "Wgate", "gate")
    if out_features(m, "Wup", "up") != width:
        return f"the gate has {width} features, the up product {out_features(m, 'Wup', 'up')}"
    if m["residual"] is not None and m.const("residual") is not None:
        return f"{m['residual']} is a constant: a bias, not a residual"
    return None


def attributes(m) -> dict:
    linear = {}
    for p in ("gate", "up", "down"):
        linear.update(linear_attributes(m, p))
    return {**activation_attributes(m, "gate_"), **linear}


def make_kernel(attrs: dict, constants: list):
    """The gate and up weights side by side, every product packed once; one kernel for the
    block."""
    from fusion_kernels.linear_act import (  # heavy (Numba): at build time
        gated_mlp,
        prepare_gated_mlp,
    )
    from fusion_kernels.simd.activation import encode

    named = dict(zip(INPUTS, constants, strict=False))
    (wg, bg), (wu, bu), (wd, bd) = (
        linear_params(attrs[f"{p}_linear"], *(named[k] for k in linear_inputs(f"W{p}", p)))
        for p in ("gate", "up", "down")
    )
    act = encode(**activation_keywords(attrs))
    plan = prepare_gated_mlp(np.concatenate([wg, wu], axis=1), np.concatenate([bg, bu]), act,
                             wd, bd)  # fmt: skip

    def run(x, *rest):
        given = dict(zip(INPUTS[1:], rest, strict=False))
        e, n = plan.gate_up.k, plan.down.n
        rows = x.size // e
        shape = (*x.shape[:-1], n)  # the Gemm form's Reshape back, when computed inside
        if given.get("down_unflat") is not None:
            shape = onnx_reshape(np.empty((rows, n), np.bool_), given["down_unflat"]).shape
        r = given.get("residual")
        r = None if r is None else np.broadcast_to(r, shape).reshape(-1, n)
        return (gated_mlp(x.reshape(-1, e), plan, r).reshape(shape),)

    return run


RULE = Rule(
    "GatedMLP",
    pattern(),
    inputs=INPUTS,
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=-5,  # before LinearResidual (-11), whose nodes it contains
    description="gated feed-forward block: act(x Wgate) * (x Wup), then Wdown, optional "
    "residual (Llama's SwiGLU, GeGLU; any activation of the table)",
    explain_after="Sigmoid",
    absorb_shapes=True,  # the Gemm form's Reshape back reads Shape of the gated product
)
