"""LSTM models built op by op the way exporters write them, and the native ONNX LSTM twin.

    c' = f * c + i * g,   h' = o * tanh(c'),   [i f g o] = act(x W^T + h R^T + b)

`LSTMWeights` holds PyTorch's layout (weight_ih [4H, I], weight_hh [4H, H], gate order i, f, g,
o). `unrolled_lstm` writes T cells the way `torch.onnx.export` writes `nn.LSTMCell` called in a
Python loop: `x[t]` is a Gather, the cells chain h and c, and `torch.stack` of the per-step h is
Unsqueeze + Concat. Variants as parameters:

- form: "gemm" (PyTorch: Gemm(x, W, b, transB=1) + Gemm(h, R, b2, transB=1)), "matmul"
  (MatMul(x, W^T) + MatMul(h, R^T) + b, `assoc` picks the association), "concat"
  (TF/Keras: MatMul(Concat(x, h), [W^T; R^T]) + b), "concat_gemm" (tf2onnx's
  Gemm(Concat(x, h), [W^T; R^T], b, transB=0));
- gates: "split_input" (opset 13+), "split_attribute" (opset 11), "num_outputs" (opset 18),
  "slice" (four Slices, written in a shuffled order);
- order: the gate order of the pre-activation columns, a permutation of "ifgo"
  (PyTorch "ifgo", TF BasicLSTMCell "igfo");
- forget_bias: a constant added to f before its sigmoid (TF's forget_bias=1.0).

`native_lstm` is the same network as one ONNX LSTM node (gate order i, o, f, c) with the same
inputs (X [T, B, I], h0 [B, H], c0 [B, H]) and outputs (Y [T, B, H], h_n, c_n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from fusion.models.builder import GraphBuilder

OPSET = {"split_input": 17, "split_attribute": 11, "num_outputs": 18, "slice": 17}


@dataclass
class LSTMWeights:
    W: np.ndarray  # [4H, I], gates i, f, g, o
    R: np.ndarray  # [4H, H]
    Wb: np.ndarray  # [4H]
    Rb: np.ndarray  # [4H]

    @classmethod
    def random(cls, input_size: int, hidden: int, seed: int = 0) -> LSTMWeights:
        rng = np.random.default_rng(seed)
        scale = 1.0 / np.sqrt(hidden)  # PyTorch's init range, keeps the gates unsaturated

        def u(*shape):
            return rng.uniform(-scale, scale, shape).astype(np.float32)

        return cls(u(4 * hidden, input_size), u(4 * hidden, hidden), u(4 * hidden), u(4 * hidden))

    @property
    def hidden(self) -> int:
        return self.R.shape[1]

    def reorder(self, order: str) -> LSTMWeights:
        """The same weights with the gate blocks in `order` (a permutation of "ifgo")."""
        idx = np.concatenate(
            [np.arange(4 * self.hidden).reshape(4, -1)["ifgo".index(g)] for g in order]
        )
        return LSTMWeights(self.W[idx], self.R[idx], self.Wb[idx], self.Rb[idx])


class RNNGraph(GraphBuilder):
    def __init__(self, opset: int):
        super().__init__(opset)
        self.weights_key, self.weights = None, []  # one set of initializers per chain

    def named(self, array, hint: str) -> str:
        """An initializer named `{hint}_{n}`."""
        return self.const(array, self.fresh(f"{hint}_"))

    def axes_op(self, op_type: str, x: str, axes: list[int]) -> str:
        if self.opset >= 13:
            return self.node(op_type, [x, self.named(np.array(axes, np.int64), "axes")])
        return self.node(op_type, [x], axes=axes)


def lstm_cell(
    g: RNNGraph,
    x,
    h,
    c,
    w: LSTMWeights,
    form="gemm",
    gates="split_input",
    order="ifgo",
    forget_bias=0.0,
    assoc=0,
):
    """Append one cell to `g`; returns (h', c'). Weights are shared across calls by name."""
    hid, ww = w.hidden, w.reorder(order)
    key = (form, order, forget_bias)
    if g.weights_key != key:  # one set of initializers for the whole chain
        g.weights_key = key
        if form == "gemm":
            g.weights = [
                g.named(ww.W, "W"),
                g.named(ww.Wb, "Wb"),
                g.named(ww.R, "R"),
                g.named(ww.Rb, "Rb"),
            ]
        elif form == "matmul":
            g.weights = [
                g.named(ww.W.T.copy(), "W"),
                g.named(ww.R.T.copy(), "R"),
                g.named(ww.Wb + ww.Rb, "b"),
            ]
        else:  # concat, concat_gemm
            wcat = np.concatenate([ww.W.T, ww.R.T], axis=0)
            g.weights = [g.named(wcat, "W"), g.named(ww.Wb + ww.Rb, "b")]
    if form == "gemm":
        wn, wb, rn, rb = g.weights
        pre = g.node(
            "Add", [g.node("Gemm", [x, wn, wb], transB=1), g.node("Gemm", [h, rn, rb], transB=1)]
        )
    elif form == "matmul":
        wn, rn, b = g.weights
        xw, hr = g.node("MatMul", [x, wn]), g.node("MatMul", [h, rn])
        if assoc == 0:
            pre = g.node("Add", [g.node("Add", [xw, hr]), b])
        elif assoc == 1:
            pre = g.node("Add", [hr, g.node("Add", [b, xw])])
        else:
            pre = g.node("Add", [xw, g.node("Add", [hr, b])])
    elif form == "concat":
        wn, b = g.weights
        pre = g.node("Add", [g.node("MatMul", [g.node("Concat", [x, h], axis=1), wn]), b])
    else:
        wn, b = g.weights
        pre = g.node("Gemm", [g.node("Concat", [x, h], axis=1), wn, b], transB=0)
    chunks = _split_gates(g, pre, hid, gates)
    gate = dict(zip(order, chunks, strict=True))
    f_pre = gate["f"]
    if forget_bias:
        f_pre = g.node("Add", [f_pre, g.named(np.array(forget_bias, np.float32), "forget_bias")])
    i, f = g.node("Sigmoid", [gate["i"]]), g.node("Sigmoid", [f_pre])
    cand, o = g.node("Tanh", [gate["g"]]), g.node("Sigmoid", [gate["o"]])
    c_new = g.node("Add", [g.node("Mul", [f, c]), g.node("Mul", [i, cand])])
    h_new = g.node("Mul", [o, g.node("Tanh", [c_new])])
    return h_new, c_new


def _split_gates(g: RNNGraph, pre: str, hid: int, gates: str) -> list[str]:
    if gates == "split_input":
        return g.node("Split", [pre, g.named(np.array([hid] * 4, np.int64), "split")], 4, axis=1)
    if gates == "split_attribute":
        return g.node("Split", [pre], 4, axis=1, split=[hid] * 4)
    if gates == "num_outputs":
        return g.node("Split", [pre], 4, axis=1, num_outputs=4)
    outs = {}
    for k in (2, 0, 3, 1):  # exporters do not promise an order
        starts, ends = [k * hid], [(k + 1) * hid if k < 3 else np.iinfo(np.int64).max]
        args = [np.array(v, np.int64) for v in (starts, ends, [-1] if k % 2 else [1])]
        outs[k] = g.node("Slice", [pre, *(g.named(a, "slice") for a in args)])
    return [outs[k] for k in range(4)]


def unrolled_lstm(w: LSTMWeights, steps: int, batch: int | str = "N", **cell) -> onnx.ModelProto:
    """X [T, B, I], h0, c0 [B, H] -> Y [T, B, H], h_n, c_n; T cells unrolled (see module doc).

    >>> model = unrolled_lstm(LSTMWeights.random(128, 256), steps=16, form="gemm")
    """
    g = RNNGraph(OPSET[cell.get("gates", "split_input")])
    hid, size = w.hidden, w.W.shape[1]
    h, c, ys = "h0", "c0", []
    for t in range(steps):
        x = g.node("Gather", ["X", g.named(np.array(t, np.int64), "t")], axis=0)
        h, c = lstm_cell(g, x, h, c, w, **cell)
        ys.append(g.axes_op("Unsqueeze", h, [0]))
    g.nodes.append(helper.make_node("Concat", ys, ["Y"], name="/stack", axis=0))
    for node in g.nodes:  # the last state is a graph output under its own name, no Identity
        node.input[:] = [{h: "h_n", c: "c_n"}.get(v, v) for v in node.input]
        node.output[:] = [{h: "h_n", c: "c_n"}.get(v, v) for v in node.output]
    inputs = {"X": [steps, batch, size], "h0": [batch, hid], "c0": [batch, hid]}
    outputs = {"Y": [steps, batch, hid], "h_n": [batch, hid], "c_n": [batch, hid]}
    return g.model(inputs, outputs, name="lstm")


def cell_model(
    w: LSTMWeights, batch: int | str = "N", extra_output: str | None = None, **cell
) -> onnx.ModelProto:
    """One cell: x [B, I], h, c [B, H] -> h', c' (and `extra_output`, an intermediate, if named
    by its op type, e.g. "Tanh": the first node of that type becomes an output too)."""
    g = RNNGraph(OPSET[cell.get("gates", "split_input")])
    h, c = lstm_cell(g, "x", "h", "c", w, **cell)
    hid, size = w.hidden, w.W.shape[1]
    outputs = {h: [batch, hid], c: [batch, hid]}
    if extra_output:
        outputs[next(n.output[0] for n in g.nodes if n.op_type == extra_output)] = None
    return g.model({"x": [batch, size], "h": [batch, hid], "c": [batch, hid]}, outputs, name="lstm")


def native_lstm(w: LSTMWeights, steps: int, batch: int | str = "N", forget_bias=0.0):
    """The same network as one ONNX LSTM node (gates i, o, f, c), same inputs and outputs."""
    g = RNNGraph(17)
    ww = w.reorder("iofg")
    b = np.concatenate([ww.Wb, ww.Rb])
    b[2 * w.hidden : 3 * w.hidden] += np.float32(forget_bias)
    inputs = ["X", g.named(ww.W[None], "W"), g.named(ww.R[None], "R"), g.named(b[None], "B"), ""]
    inputs += [g.axes_op("Unsqueeze", "h0", [0]), g.axes_op("Unsqueeze", "c0", [0])]
    y, yh, yc = g.node("LSTM", inputs, 3, hidden_size=w.hidden)
    g.nodes.append(helper.make_node("Squeeze", [y, g.named(np.array([1]), "axes")], ["Y"]))
    g.nodes.append(helper.make_node("Squeeze", [yh, g.named(np.array([0]), "axes")], ["h_n"]))
    g.nodes.append(helper.make_node("Squeeze", [yc, g.named(np.array([0]), "axes")], ["c_n"]))
    hid, size = w.hidden, w.W.shape[1]
    inputs = {"X": [steps, batch, size], "h0": [batch, hid], "c0": [batch, hid]}
    outputs = {"Y": [steps, batch, hid], "h_n": [batch, hid], "c_n": [batch, hid]}
    return g.model(inputs, outputs, name="lstm")
