"""GRUCell:  z, r = sig(x Wz + h Rz + b), sig(x Wr + h Rr + b),
            n = tanh(x Wn + bxn + r (h Rn + bhn)),   h' = (1 - z) n + z h

From primitive ops on the shared linear sub-pattern: linear(x, W) and linear(h, R), each cut
into three gates by a Split (PyTorch nn.GRUCell: Gemm + Split; Keras GRU(reset_after=True) via
tf2onnx: MatMul + bias Add + Split), the gates in any order: which is which follows from the
structure (through Tanh: the candidate n; multiplying h R's block inside the Tanh: the reset r;
blending h and n: the update z), and x and h follow from it too (h is the value the blend keeps),
so equal input and hidden sizes need no guess. The blend is PyTorch's (h - n) z + n or Keras's
z h + (1 - z) n. With the reset applied before the recurrent product (Keras reset_after=False,
ONNX linear_before_reset=0: n = tanh(x Wn + linear(r h, Rn) + b)), h's product has only the z and
r blocks (tf2onnx cuts it into [H, H, 0]) and the kernel runs two stages per step.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion_patterns import linear as lin
from fusion_patterns.lstm import last_axis

X_LINEAR, H_LINEAR, N_LINEAR = (
    lin.linear_inputs(*a) for a in (("W", "x"), ("R", "h"), ("Rn", "n"))
)
WEIGHTS = (*X_LINEAR, *H_LINEAR, *N_LINEAR)  # the fused node's inputs after x, h
GATES = ("z", "r", "n")  # the kernel's order


def near_one(value) -> str | None:
    return None if np.allclose(value, 1.0) else f"{value} is not 1 (1 - z)"


def cell():
    x, h = Var("x", dtype="float32", rank=2), Var("h", dtype="float32", rank=2)
    gx = op.Split(lin.linear(x, "W", "x"), Opt(Const("x_sizes")), axis=last_axis, _name="split_x")
    gh = op.Split(lin.linear(h, "R", "h"), Opt(Const("h_sizes")), axis=last_axis, _name="split_h")
    r = op.Sigmoid(op.Add(gx.any_output(), gh.any_output(), _name="pre_r"), _name="act_r")
    z = op.Sigmoid(op.Add(gx.any_output(), gh.any_output(), _name="pre_z"), _name="act_z")
    reset_after = op.Mul(r, gh.any_output(), _name="reset")
    reset_before = lin.linear(op.Mul(r, h), "Rn", "n")
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


def reset_before(m) -> bool:
    return "n_mm" in m.node_index


def gate_blocks(m) -> tuple[list[int], list[int]] | str:
    """The column blocks of z, r, n in x W and in h R (z, r only when the reset comes before
    the product), or why they do not match."""
    gx = [_block(m, f"pre_{g}", "split_x") for g in GATES]
    names = ("pre_z", "pre_r") if reset_before(m) else ("pre_z", "pre_r", "reset")
    gh = [_block(m, node, "split_h") for node in names]
    if sorted(gx) != [0, 1, 2] or gh != gx[: len(gh)]:
        return f"the gate blocks of x W {gx} and of h R {gh} differ"
    return gx, gh


def check(m) -> str | None:
    blocks = gate_blocks(m)
    if isinstance(blocks, str):
        return blocks
    reason = lin.check_linear(m, "W", "x") or lin.check_linear(m, "R", "h")
    reason = reason or (lin.check_linear(m, "Rn", "n") if reset_before(m) else None)
    if reason:
        return reason
    hidden = lin.out_features(m, "W", "x") // 3
    gates = 2 if reset_before(m) else 3
    for split, n in (("split_x", 3), ("split_h", gates)):
        sizes = m.const(f"{split[-1]}_sizes")
        sizes = m.attrs(split).get("split") if sizes is None else sizes
        outputs = len(m.node(split).output)
        sizes = [hidden * n // outputs] * outputs if sizes is None else list(sizes)
        if sizes[:n] != [hidden] * n or any(sizes[n:]):
            return f"{split}: the Split must cut the product into {n} gates of {hidden}"
    if reset_before(m) and lin.out_features(m, "Rn", "n") != hidden:
        return f"Rn does not give {hidden} columns"
    return None


def attributes(m) -> dict:
    gx, gh = gate_blocks(m)
    n_linear = lin.linear_attributes(m, "n") if reset_before(m) else {"n_linear": [0.0, 1.0, 1.0]}
    linears = {**lin.linear_attributes(m, "x"), **lin.linear_attributes(m, "h"), **n_linear}
    return {"gates": gx, "h_gates": gh, "linear_before_reset": int(not reset_before(m)), **linears}


def cell_weights(attrs: dict, weights: list):
    """(Wx [I, 3H], Wh [H, 3H], bx [3H], bh [3H]) in gate order z, r, n from a cell's
    constants (in WEIGHTS order)."""
    named = dict(zip(WEIGHTS, list(weights) + [None] * len(WEIGHTS), strict=False))
    wx, bx = lin.linear_params(attrs["x_linear"], *(named[k] for k in X_LINEAR))
    wh, bh = lin.linear_params(attrs["h_linear"], *(named[k] for k in H_LINEAR))
    hidden = wh.shape[0]

    def blocks(order):
        return np.concatenate([np.arange(k * hidden, (k + 1) * hidden) for k in order])

    wx, bx = wx[:, blocks(attrs["gates"])], bx[blocks(attrs["gates"])]
    wh, bh = wh[:, blocks(attrs["h_gates"])], bh[blocks(attrs["h_gates"])]
    if not attrs["linear_before_reset"]:  # n's recurrent weights from their own product
        wn, bn = lin.linear_params(attrs["n_linear"], *(named[k] for k in N_LINEAR))
        wh, bh = np.concatenate([wh, wn], axis=1), np.concatenate([bh, bn])
    return wx, wh, bx, bh


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs one step."""
    from fusion_kernels.gru import gru_sequence, prepare_gru  # heavy (Numba): only when built

    plan = prepare_gru(*cell_weights(attrs, constants[2:]), attrs["linear_before_reset"])

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
    description="GRU cell on linear(x) and linear(h) cut by Splits, reset after or before",
    explain_after="Tanh",
)
