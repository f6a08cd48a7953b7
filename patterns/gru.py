"""GRUCell:  z, r = sig(x Wz + h Rz + b), sig(x Wr + h Rr + b),
            n = tanh(x Wn + bxn + r (h Rn + bhn)),   h' = (1 - z) n + z h

From primitive ops on the shared linear sub-pattern: linear(x, W) and linear(h, R), each cut
into three gates by a Split (PyTorch nn.GRUCell: Gemm + Split; Keras GRU(reset_after=True) via
tf2onnx: MatMul + bias Add + Split), the gates in any order: which is which follows from the
structure (through Tanh: the candidate n; multiplying h R's block inside the Tanh: the reset r;
blending h and n: the update z), and x and h follow from it too (h is the value the blend keeps),
so equal input and hidden sizes need no guess. The blend is PyTorch's (h - n) z + n or Keras's
z h + (1 - z) n. The reset applied before the recurrent product (Keras reset_after=False, ONNX
linear_before_reset=0: n = tanh(x Wn + (r h) Rn + b)) is matched and refused with its reason:
the kernel applies r after the product, in one pass over R per step.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Alt, Const, Opt, Var, op
from patterns.linear import check_linear, linear, linear_attributes, linear_inputs, linear_params
from patterns.lstm import last_axis

X_LINEAR, H_LINEAR = linear_inputs("W", "x"), linear_inputs("R", "h")
WEIGHTS = (*X_LINEAR, *H_LINEAR)  # the fused node's inputs after x, h
GATES = ("z", "r", "n")  # the kernel's order


def near_one(value) -> str | None:
    return None if np.allclose(value, 1.0) else f"{value} is not 1 (1 - z)"


def cell():
    x, h = Var("x", dtype="float32", rank=2), Var("h", dtype="float32", rank=2)
    gx = op.Split(linear(x, "W", "x"), Opt(Const("x_sizes")), axis=last_axis, _name="split_x")
    gh = op.Split(linear(h, "R", "h"), Opt(Const("h_sizes")), axis=last_axis, _name="split_h")
    r = op.Sigmoid(op.Add(gx.any_output(), gh.any_output(), _name="pre_r"), _name="act_r")
    z = op.Sigmoid(op.Add(gx.any_output(), gh.any_output(), _name="pre_z"), _name="act_z")
    reset_after = op.Mul(r, gh.any_output(), _name="reset")
    reset_before = op.MatMul(op.Mul(r, h), Const("Rn"), _name="reset_before")
    n = op.Tanh(op.Add(gx.any_output(), Alt(reset_after, reset_before), _name="pre_n"))
    return Alt(
        op.Add(op.Mul(op.Sub(h, n), z), n, _name="h_out"),  # PyTorch
        op.Add(op.Mul(z, h), op.Mul(op.Sub(Const("one", where=near_one), z), n), _name="h_out"),
    )


def _block(m, node: str, split: str) -> int | None:
    """Which output of Split `split` the Add `node` reads (None: none)."""
    for value in m.node(node).input:
        producer = m.view.producer.get(value)
        if producer and producer[0] == m.node_index[split]:
            return producer[1]
    return None


def gate_blocks(m) -> list[int] | str:
    """The column block of z, r, n (the same in x W and in h R), or why there is none."""
    if "reset_before" in m.node_index:
        return "the reset gate multiplies h before the recurrent product (linear_before_reset=0)"
    gx = [_block(m, f"pre_{g}", "split_x") for g in GATES]
    gh = [_block(m, node, "split_h") for node in ("pre_z", "pre_r", "reset")]
    if sorted(gx) != [0, 1, 2] or gx != gh:
        return f"the gate blocks of x W {gx} and of h R {gh} differ"
    return gx


def check(m) -> str | None:
    blocks = gate_blocks(m)
    if isinstance(blocks, str):
        return blocks
    reason = check_linear(m, "W", "x") or check_linear(m, "R", "h")
    if reason:
        return reason
    for split in ("split_x", "split_h"):
        sizes = m.const(f"{split[-1]}_sizes")
        sizes = m.attrs(split).get("split") if sizes is None else sizes
        if len(m.node(split).output) != 3 or (sizes is not None and len(set(sizes)) > 1):
            return f"{split}: the Split must cut the product into 3 equal gates"
    return None


def attributes(m) -> dict:
    return {"gates": gate_blocks(m), **linear_attributes(m, "x"), **linear_attributes(m, "h")}


def cell_weights(attrs: dict, weights: list):
    """(Wx [I, 3H], Wh [H, 3H], bx [3H], bh [3H]) in gate order z, r, n from a cell's
    constants (in WEIGHTS order)."""
    named = dict(zip(WEIGHTS, list(weights) + [None] * len(WEIGHTS), strict=False))
    wx, bx = linear_params(attrs["x_linear"], *(named[k] for k in X_LINEAR))
    wh, bh = linear_params(attrs["h_linear"], *(named[k] for k in H_LINEAR))
    hidden = wh.shape[0]
    cols = np.concatenate([np.arange(k * hidden, (k + 1) * hidden) for k in attrs["gates"]])
    return wx[:, cols], wh[:, cols], bx[cols], bh[cols]


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs one step."""
    from kernels.lstm import gru_sequence, prepare_gru  # heavy (Numba): only when built

    plan = prepare_gru(*cell_weights(attrs, constants[2:]))

    def run(x, h, *_weights):
        return (gru_sequence(x[None], h, plan)[0],)

    return run


RULE = Rule(
    "GRUCell",
    cell(),
    inputs=("x", "h", *WEIGHTS),
    outputs=("h_out",),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    priority=10,
    description="GRU cell on linear(x) and linear(h) cut by Splits, reset after the product",
    explain_after="Tanh",
)
