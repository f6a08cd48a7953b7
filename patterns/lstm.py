"""LSTMCell:  [i f g o] = x W + h R + b,  c' = sig(f) c + sig(i) tanh(g),  h' = sig(o) tanh(c')

Pre-activations as Gemm(x, W, b, transB=1) + Gemm(h, R, b2, transB=1) (PyTorch nn.LSTMCell),
MatMul(x, W) + MatMul(h, R) + b in any association, or MatMul(Concat(x, h), W) + b (TF/Keras),
optionally with a constant forget bias added before f's sigmoid. The four gates come from one
Split or four Slices in any order: which is which follows from the structure (through Tanh: the
candidate g; multiplied with c: f; multiplied with tanh(c'): o), and `gates` records the column
block of each, so the kernel repacks the weights into the order i, f, g, o once.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Alt, Const, Opt, Var, op

GATES = ("gi", "gf", "gg", "go")  # captures of the pre-activations of i, f, g, o


def last_axis(axis) -> str | None:
    return None if axis in (1, -1) else f"axis={axis}, gates must be split along the last axis"


def preactivation(x, h):
    """x W + h R + b in the forms exporters write (captures W, R, B, B2; nodes gemm_x, gemm_h)."""
    gemm = dict(transA=0, alpha=1.0, beta=1.0)
    xg = op.Gemm(x, Const("W"), Opt(Const("B")), **gemm, _name="gemm_x")
    hg = op.Gemm(h, Const("R"), Opt(Const("B2")), **gemm, _name="gemm_h")
    xw, hr, b = op.MatMul(x, Const("W")), op.MatMul(h, Const("R")), Const("B")
    cat = op.Concat(x, h, axis=last_axis, _name="concat")
    return Alt(
        op.Add(xg, hg),
        op.Add(op.Add(xw, hr), b),
        op.Add(op.Add(xw, b), hr),
        op.Add(op.Add(hr, b), xw),
        op.Add(op.MatMul(cat, Const("W")), b),
    )


def cell(gates: str):
    """The cell with its gates separated by "split" (one Split) or "slice" (four Slices)."""
    x, h = Var("x", dtype="float32", rank=2), Var("h", dtype="float32", rank=2)
    pre = preactivation(x, h)
    if gates == "split":
        split = op.Split(pre, Opt(Const("split_sizes")), axis=last_axis, _name="split")
        gi, gf, gg, go = (split.any_output(name) for name in GATES)
    else:
        gi, gf, gg, go = (
            op.Slice(
                pre,
                Const(n + "_starts"),
                Const(n + "_ends"),
                Const(n + "_axes"),
                Opt(Const(n + "_steps")),
                _name=n,
            )
            for n in GATES
        )
    f = op.Sigmoid(Alt(op.Add(gf, Const("forget_bias"), _name="forget_add"), gf), _name="act_f")
    i, g = op.Sigmoid(gi, _name="act_i"), op.Tanh(gg, _name="act_g")
    c_new = op.Add(op.Mul(f, Var("c", dtype="float32")), op.Mul(i, g), _name="c_out")
    # Tanh(c') first: a Mul that is not h' fails on its first input, before the gates are tried.
    return op.Mul(op.Tanh(c_new), op.Sigmoid(go, _name="act_o"), _name="h_out")


def gate_value(m, gate: str) -> str:
    """The pre-activation of gate "i", "f", "g" or "o", read from its activation node
    (the matcher does not bind a repeated Split's any_output names, so no m["gi"])."""
    value = m.node(f"act_{gate}").input[0]
    if gate == "f" and "forget_add" in m.node_index:
        value = next(v for v in m.node("forget_add").input if m.view.constant(v) is None)
    return value


def gate_blocks(m) -> list[int] | str:
    """Column block (0..3) of the i, f, g, o pre-activations, or why they are not 4 equal blocks."""
    hidden = hidden_size(m)
    blocks = []
    for name in GATES:
        if "split" in m.node_index:
            blocks.append(m.view.producer[gate_value(m, name[1])][1])
            continue
        starts, ends, axes = (
            m.const(f"{name}_{k}").reshape(-1) for k in ("starts", "ends", "axes")
        )
        steps = m.const(f"{name}_steps")
        if len(starts) != 1 or axes[0] not in (1, -1) or (steps is not None and steps[0] != 1):
            return f"gate Slice {name} must take one contiguous range of the last axis"
        start, end = int(starts[0]), min(int(ends[0]), 4 * hidden)
        if start % hidden or end - start != hidden:
            return f"gate Slice [{start}:{end}] is not a block of {hidden} columns"
        blocks.append(start // hidden)
    if sorted(blocks) != [0, 1, 2, 3]:
        return f"gate blocks {blocks} do not cover the four blocks once each"
    return blocks


def hidden_size(m) -> int:
    w = m.const("W")
    transposed = "gemm_x" in m.node_index and m.attrs("gemm_x")["transB"]
    return (w.shape[0] if transposed else w.shape[1]) // 4


def check(m) -> str | None:
    hidden = hidden_size(m)
    split = m.attrs("split") if "split" in m.node_index else {}
    sizes = m.const("split_sizes") if m["split_sizes"] else split.get("split")
    if split and (len(m.node("split").output) != 4 or (sizes is not None and len(set(sizes)) > 1)):
        return "the Split must cut the pre-activations into 4 equal gates"
    blocks = gate_blocks(m)
    if isinstance(blocks, str):
        return blocks
    for name, size in (("B", 4 * hidden), ("B2", 4 * hidden), ("forget_bias", hidden)):
        value = m.const(name)
        if value is not None and value.size not in (1, size):
            return f"{name} of shape {list(value.shape)} is not a bias of {size} values"
    hid = m.type("h")
    if hid is not None and hid.shape and isinstance(hid.shape[-1], int) and hid.shape[-1] != hidden:
        return f"h has {hid.shape[-1]} columns, the weights have {hidden} hidden units"
    return None


def attributes(m) -> dict:
    form = (
        "gemm" if "gemm_x" in m.node_index else "concat" if "concat" in m.node_index else "matmul"
    )
    trans = [int(m.attrs(n)["transB"]) for n in ("gemm_x", "gemm_h")] if form == "gemm" else [0, 0]
    return {"form": form, "gates": gate_blocks(m), "transB": trans}


def cell_weights(attrs: dict, constants: list):
    """(Wx [I, 4H], Wh [H, 4H], bias [4H]) in gate order i, f, g, o from a cell's constants."""
    _, _, _, w, r, b, b2, forget = (list(constants) + [None] * 8)[:8]
    tx, th = attrs["transB"]
    w, r = (w.T if tx else w), (None if r is None else r.T if th else r)
    hidden = w.shape[1] // 4
    if attrs["form"] == "concat":
        w, r = w[: w.shape[0] - hidden], w[w.shape[0] - hidden :]
    bias = np.zeros(4 * hidden, np.float32)
    for value in (b, b2):
        bias += 0 if value is None else np.broadcast_to(value.reshape(-1), bias.shape)
    blocks = list(attrs["gates"])
    if forget is not None:
        bias[blocks[1] * hidden : (blocks[1] + 1) * hidden] += forget.reshape(-1)
    cols = np.concatenate([np.arange(k * hidden, (k + 1) * hidden) for k in blocks])
    return w[:, cols], r[:, cols], bias[cols]


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs one step."""
    from kernels.lstm import lstm_cell, prepare_lstm  # heavy (Numba): only when a kernel is built

    plan = prepare_lstm(*cell_weights(attrs, constants))

    def run(x, h, c, *_weights):
        return lstm_cell(x, h, c, plan)

    return run


RULE = Rule(
    "LSTMCell",
    Alt(cell("split"), cell("slice")),
    inputs=("x", "h", "c", "W", "R", "B", "B2", "forget_bias"),
    outputs=("h_out", "c_out"),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    priority=10,
    description="LSTM cell from Gemm/MatMul, Split/Slice gates, Sigmoid/Tanh, float32",
    explain_after="Add",
)
