"""LinearGelu:      y = gelu(x W + b) (+ r)
LinearResidual:  y = x W + b + r          (a transformer's output projection and skip connection)

    gelu(t) = t (1 + erf(t / sqrt 2)) / 2                          (BERT: the Erf form)
            = t (1 + tanh(sqrt(2 / pi) (t + 0.044715 t^3))) / 2     (GPT-2: the tanh form)

The product is the shared linear sub-pattern in any rank (patterns/linear.py linear_nd: MatMul
on [B, S, K], or Reshape + Gemm + Reshape as the exporters write nn.Linear); either GELU is
written with Div or Mul by the constants, the halving anywhere in the product, or as the
Gelu op (opset 20). These rules have a priority below a user's (0), so that a user's own rule
for the same nodes (the README's MatMulBiasGelu) claims them first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Var, op
from fusion_patterns.activation import activation_keywords
from fusion_patterns.linear import (
    check_linear,
    linear_attributes,
    linear_nd,
    linear_params,
    onnx_reshape,
)

LINEAR = ("W", "fc_c", "fc_b", "fc_flat", "fc_unflat")


@dataclass(frozen=True)
class near:  # noqa: N801 (used like a function: Const("half", where=near(0.5)))
    """A constraint on a constant: None when it is `value` (within 0.1 %), else the reason.
    A class, not a closure, so that a catalog pickles (the bench sends it to its workers)."""

    value: float

    def __call__(self, c: np.ndarray) -> str | None:
        if c.size == 1 and np.allclose(c, self.value, rtol=1e-3):
            return None
        return f"{c.ravel()[:1]} is not {self.value:g}"


def erf_gelu(t):
    erf = op.Erf(Alt(op.Div(t, Const("sqrt2", where=near(math.sqrt(2)))),
                     op.Mul(t, Const("inv_sqrt2", where=near(1 / math.sqrt(2))))))  # fmt: skip
    return halved(t, op.Add(erf, Const("one", where=near(1.0))))


def tanh_gelu(t):
    cube = op.Mul(op.Pow(t, Const("three", where=near(3.0))), Const("c", where=near(0.044715)))
    inner = op.Mul(op.Add(t, cube), Const("k", where=near(math.sqrt(2 / math.pi))))
    return halved(t, op.Add(op.Tanh(inner, _name="tanh"), Const("one", where=near(1.0))))


def halved(t, factor):
    """t * factor * 0.5 in the three orders exporters multiply them."""
    half = Const("half", where=near(0.5))
    return Alt(op.Mul(op.Mul(t, factor), half), op.Mul(t, op.Mul(factor, half)),
               op.Mul(op.Mul(t, half), factor))  # fmt: skip


def gelu(t):
    return Alt(erf_gelu(t), tanh_gelu(t), op.Gelu(t, _name="gelu_op"))


def with_residual(y, optional: bool):
    added = op.Add(y, Var("residual", dtype="float32"), _name="residual_add")
    return Alt(added, y) if optional else added


def residual_follows(m, prefix: str) -> str | None:
    """Why this match is not fused where it stands, if its output's one reader extends it: the
    Add of a residual (another computed value), the Add of the bias when the match ends at the
    product, the Reshape back to [B, S, N] after a Gemm. The match rooted at that node takes
    them (a rule tries the nodes in graph order, so the smaller match comes first)."""
    if "residual_add" in m.node_index:
        return None
    value = m.view.nodes[max(m.nodes)].output[0]
    readers = m.view.consumers.get(value, [])
    if len(readers) != 1 or m.view.is_graph_output(value):
        return None
    add = m.view.nodes[readers[0]]
    if add.op_type == "Reshape" and f"{prefix}_unflatten" not in m.node_index:
        return f"its output is read only by {add.name or add.output[0]}, which extends the match"
    if add.op_type != "Add":
        return None
    constant = [m.view.constant(v) is not None for v in add.input]
    if not any(constant) or (m[f"{prefix}_b"] is None and "one" not in m and "gelu_op" not in m):
        return f"its output is read only by {add.name or add.output[0]}, which extends the match"
    return None


def activation(m) -> str:
    if "gelu_op" in m.node_index:
        return "gelu_tanh" if m.attrs("gelu_op").get("approximate") == "tanh" else "gelu"
    return "gelu_tanh" if "tanh" in m.node_index else "gelu"


def check(m) -> str | None:
    reason = check_linear(m, "W", "fc") or residual_follows(m, "fc")
    if reason:
        return reason
    if m["residual"] is not None and m.const("residual") is not None:
        return f"{m['residual']} is a constant: a bias, not a residual"
    x = m.type("x")
    plain = "residual_add" in m.node_index and "gelu_op" not in m.node_index and "one" not in m
    if plain and (x is None or x.rank is None or x.rank < 3):
        return "a residual linear needs x of rank 3 ([batch, sequence, features])"
    return None


def attributes(m) -> dict:
    act = activation(m) if "one" in m or "gelu_op" in m.node_index else "identity"
    return {"activation": act, **linear_attributes(m, "fc")}


def make_kernel(attrs: dict, constants: list):
    """Pack W and the bias once; the kernel reshapes as the matched Reshapes did."""
    from fusion_kernels.dense_gemm import bind_dense_gemm, prepare_dense  # heavy (Numba): at build
    from fusion_kernels.linear_act import linear_act
    from fusion_kernels.simd.activation import encode

    weight, bias = linear_params(attrs["fc_linear"], *constants[1:4])
    plan = prepare_dense(weight, bias, encode(**activation_keywords(attrs)))
    k, n = plan.k, plan.n

    def shapes(x, flat, unflat):
        """x's shape for the product, and the output's (as the matched Reshapes give them)."""
        x2 = onnx_reshape(x, flat) if flat is not None else x.reshape(-1, k)
        shape = x.shape[:-1] + (n,) if flat is None else (x2.shape[0], n)
        final = onnx_reshape(np.empty(shape, np.bool_), unflat).shape if unflat is not None \
            else shape  # fmt: skip
        return x2, final

    def run(x, _w, _c, _b, flat=None, unflat=None, residual=None):
        x2, final = shapes(x, flat, unflat)
        r = None if residual is None else np.broadcast_to(residual, final).reshape(-1, n)
        return (linear_act(x2, plan, r).reshape(final),)

    def bind(x, _w, _c, _b, flat=None, unflat=None, residual=None):
        """The product bound to these shapes (Tactic.bind), and to the Reshapes' targets: a
        call with other target values (computed at run time, so not in the step's key) runs
        unbound."""
        x2, final = shapes(x, flat, unflat)
        r = None if residual is None else np.broadcast_to(residual, final).reshape(-1, n)
        call, x2_shape = bind_dense_gemm(x2, plan, r), x2.shape
        targets = [(t, None if t is None else np.array(t)) for t in (flat, unflat)]

        def bound(x, w_, c_, b_, flat=None, unflat=None, residual=None):
            for t, (was, value) in zip((flat, unflat), targets, strict=True):
                if t is not was and (t is None or value is None or not np.array_equal(t, value)):
                    return run(x, w_, c_, b_, flat, unflat, residual)
            r = None if residual is None else np.broadcast_to(residual, final).reshape(-1, n)
            return (call(x.reshape(x2_shape), r).reshape(final),)

        return bound

    run.tactics = [Tactic("kernel", run, bind=bind)]
    return run


x = Var("x", dtype="float32")
# One kernel for both; its products are long float32 sums (error relative to the output's scale)
SHARED = dict(inputs=("x", *LINEAR, "residual"), prepare=make_kernel, attributes=attributes,
              check=check, accumulates=True)  # fmt: skip
RULES = [
    Rule(
        "LinearGelu",
        with_residual(gelu(linear_nd(x, "W", "fc")), optional=True),
        priority=-10,
        description="linear (MatMul or Gemm, bias, any rank) + GELU (Erf or tanh) + residual Add",
        explain_after="Erf",
        **SHARED,
    ),
    Rule(
        "LinearResidual",
        with_residual(linear_nd(x, "W", "fc"), optional=False),
        priority=-11,
        description="linear (MatMul or Gemm, bias, any rank) + residual Add, x of rank 3",
        explain_after="MatMul",
        **SHARED,
    ),
]
