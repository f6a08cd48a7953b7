"""LSTMCell:  [i f g o] = x W + h R + b,  c' = sig(f) c + sig(i) tanh(g),  h' = sig(o) tanh(c')

The pre-activations are written on the shared linear sub-pattern (patterns/linear.py):
linear(x, W) + linear(h, R) (PyTorch nn.LSTMCell: Gemm + Gemm; MatMul + MatMul with the bias
anywhere), product(x, W) + product(h, R) + b, or linear(Concat(x, h), W) (TF/Keras, tf2onnx's
Gemm(Concat, W, b, transB=0)), optionally with a constant forget bias added before f's sigmoid.
The four gates come from one Split or four Slices in any order: which is which follows from the
structure (through Tanh: the candidate g; multiplied with c: f; multiplied with tanh(c'): o),
and `gates` records the column block of each, so the kernel repacks the weights into the order
i, f, g, o once. Which input is x and which h is not decided here (with equal sizes the cell
cannot tell, and x W + h R does not care): a chain decides it from the data flow
(patterns/lstm_sequence.py).
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion_patterns.linear import (
    check_linear,
    linear,
    linear_attributes,
    linear_inputs,
    linear_params,
    out_features,
    product,
)

GATES = ("gi", "gf", "gg", "go")  # captures of the pre-activations of i, f, g, o
X_LINEAR, H_LINEAR = linear_inputs("W", "x"), linear_inputs("R", "h")
WEIGHTS = (*X_LINEAR, *H_LINEAR, "bias", "forget_bias")  # the fused node's inputs after x, h, c


def last_axis(axis) -> str | None:
    return None if axis in (1, -1) else f"axis={axis}, gates must be split along the last axis"


def preactivation(x, h):
    """x W + h R + b in the forms exporters write (captures of patterns/linear.py, prefixes x
    and h; `bias` when the bias is added after the sum; node `concat` in the concat form)."""
    return Alt(
        op.Add(linear(x, "W", "x"), linear(h, "R", "h")),
        op.Add(op.Add(product(x, "W", "x"), product(h, "R", "h")), Const("bias")),
        linear(op.Concat(x, h, axis=last_axis, _name="concat"), "W", "x"),
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
    return out_features(m, "W", "x") // 4


def check(m) -> str | None:
    concat = "concat" in m.node_index
    reason = check_linear(m, "W", "x") or (None if concat else check_linear(m, "R", "h"))
    if reason:
        return reason
    hidden = hidden_size(m)
    if out_features(m, "W", "x") % 4 or (not concat and out_features(m, "R", "h") != 4 * hidden):
        return "the products do not give 4 equal gate blocks"
    split = m.attrs("split") if "split" in m.node_index else {}
    sizes = m.const("split_sizes") if m["split_sizes"] else split.get("split")
    if split and (len(m.node("split").output) != 4 or (sizes is not None and len(set(sizes)) > 1)):
        return "the Split must cut the pre-activations into 4 equal gates"
    blocks = gate_blocks(m)
    if isinstance(blocks, str):
        return blocks
    for name, size in (("bias", 4 * hidden), ("forget_bias", hidden)):
        value = m.const(name)
        if value is not None and value.size not in (1, size):
            return f"{name} of shape {list(value.shape)} is not a bias of {size} values"
    hid = m.type("h")
    if hid is not None and hid.shape and isinstance(hid.shape[-1], int) and hid.shape[-1] != hidden:
        return f"h has {hid.shape[-1]} columns, the weights have {hidden} hidden units"
    return None


def attributes(m) -> dict:
    concat = "concat" in m.node_index
    h_linear = {"h_linear": [0.0, 1.0, 1.0]} if concat else linear_attributes(m, "h")
    return {
        "form": "concat" if concat else "sum",
        "gates": gate_blocks(m),
        **linear_attributes(m, "x"),
        **h_linear,
    }


def cell_weights(attrs: dict, weights: list):
    """(Wx [I, 4H], Wh [H, 4H], bias [4H]) in gate order i, f, g, o from a cell's constants
    (in WEIGHTS order). attrs["swapped"] = 1: the node's x is the cell's h and its h the x."""
    named = dict(zip(WEIGHTS, list(weights) + [None] * len(WEIGHTS), strict=False))
    x_w, x_b = linear_params(attrs["x_linear"], *(named[k] for k in X_LINEAR))
    swapped = bool(attrs.get("swapped", 0))
    if attrs["form"] == "concat":
        hidden = x_w.shape[1] // 4
        size = x_w.shape[0] - hidden  # Concat(x, h): x's rows first (h's when swapped)
        w, r = (x_w[hidden:], x_w[:hidden]) if swapped else (x_w[:size], x_w[size:])
        bias = x_b
    else:
        r, h_b = linear_params(attrs["h_linear"], *(named[k] for k in H_LINEAR))
        w, r = (r, x_w) if swapped else (x_w, r)
        hidden, bias = w.shape[1] // 4, x_b + h_b
    if named["bias"] is not None:
        bias = bias + np.broadcast_to(named["bias"].reshape(-1), bias.shape)
    blocks = list(attrs["gates"])
    forget = named["forget_bias"]
    if forget is not None:
        bias[blocks[1] * hidden : (blocks[1] + 1) * hidden] += forget.reshape(-1)
    cols = np.concatenate([np.arange(k * hidden, (k + 1) * hidden) for k in blocks])
    return w[:, cols], r[:, cols], bias[cols]


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs one step."""
    from fusion_kernels.lstm import (  # heavy (Numba): only when a kernel is built
        lstm_cell,
        prepare_lstm,
    )

    plan = prepare_lstm(*cell_weights(attrs, constants[3:]))

    def run(x, h, c, *_weights):
        return lstm_cell(x, h, c, plan)

    return run


RULE = Rule(
    "LSTMCell",
    Alt(cell("split"), cell("slice")),
    inputs=("x", "h", "c", *WEIGHTS),
    outputs=("h_out", "c_out"),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    priority=10,
    description="LSTM cell on linear(x) + linear(h) or linear(Concat(x, h)), Split/Slice gates",
    explain_after="Add",
)
