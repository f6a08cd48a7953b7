"""GRU models built op by op the way exporters write them, and the native ONNX GRU twin.

    r, z = sig(x Wr + h Rr + b), sig(x Wz + h Rz + b),   n = tanh(x Wn + bxn + r (h Rn + bhn))
    h' = (1 - z) n + z h

`GRUWeights` holds PyTorch's layout (weight_ih [3H, I], weight_hh [3H, H], gate order r, z, n).
`unrolled_gru` writes T cells the way `torch.onnx.export` writes `nn.GRUCell` in a Python loop
(form "torch": Gemm(x) and Gemm(h) each cut by a Split, h' = (h - n) z + n) or as tf2onnx writes
a Keras GRU(reset_after=True) cell (form "keras": MatMul + bias Add, gates z, r, n, h' = z h +
(1 - z) n); `x[t]` is a Gather, the outputs are stacked by Unsqueeze + Concat. `native_gru` is
the same network as one ONNX GRU node (gates z, r, h; linear_before_reset=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from fusion.models.lstm import RNNGraph


@dataclass
class GRUWeights:
    W: np.ndarray  # [3H, I], gates r, z, n
    R: np.ndarray  # [3H, H]
    Wb: np.ndarray  # [3H]
    Rb: np.ndarray  # [3H]

    @classmethod
    def random(cls, input_size: int, hidden: int, seed: int = 0) -> GRUWeights:
        rng = np.random.default_rng(seed)
        scale = 1.0 / np.sqrt(hidden)

        def u(*shape):
            return rng.uniform(-scale, scale, shape).astype(np.float32)

        return cls(u(3 * hidden, input_size), u(3 * hidden, hidden), u(3 * hidden), u(3 * hidden))

    @property
    def hidden(self) -> int:
        return self.R.shape[1]

    def reorder(self, order: str) -> GRUWeights:
        """The same weights with the gate blocks in `order` (a permutation of "rzn")."""
        idx = np.concatenate(
            [np.arange(3 * self.hidden).reshape(3, -1)["rzn".index(g)] for g in order]
        )
        return GRUWeights(self.W[idx], self.R[idx], self.Wb[idx], self.Rb[idx])


def gru_cell(g: RNNGraph, x: str, h: str, w: GRUWeights, form: str = "torch") -> str:
    """Append one cell to `g`; returns h'. Weights are shared across calls by name."""
    order = "rzn" if form == "torch" else "zrn"
    ww = w.reorder(order)
    if g.weights_key != form:
        g.weights_key = form
        w_, r_ = (ww.W, ww.R) if form == "torch" else (ww.W.T.copy(), ww.R.T.copy())
        g.weights = [g.named(w_, "W"), g.named(ww.Wb, "Wb"), g.named(r_, "R"), g.named(ww.Rb, "Rb")]
    wn, wb, rn, rb = g.weights
    if form == "torch":
        gx, gh = g.node("Gemm", [x, wn, wb], transB=1), g.node("Gemm", [h, rn, rb], transB=1)
    else:
        gx = g.node("Add", [g.node("MatMul", [x, wn]), wb])
        gh = g.node("Add", [g.node("MatMul", [h, rn]), rb])
    hid = w.hidden
    sizes = g.named(np.array([hid] * 3, np.int64), "split")
    xs = dict(zip(order, g.node("Split", [gx, sizes], 3, axis=1), strict=True))
    hs = dict(zip(order, g.node("Split", [gh, sizes], 3, axis=1), strict=True))
    r = g.node("Sigmoid", [g.node("Add", [hs["r"], xs["r"]])])
    z = g.node("Sigmoid", [g.node("Add", [hs["z"], xs["z"]])])
    n = g.node("Tanh", [g.node("Add", [xs["n"], g.node("Mul", [hs["n"], r])])])
    if form == "torch":
        return g.node("Add", [g.node("Mul", [g.node("Sub", [h, n]), z]), n])
    one = g.named(np.array(1.0, np.float32), "one")
    keep, new = g.node("Mul", [z, h]), g.node("Mul", [g.node("Sub", [one, z]), n])
    return g.node("Add", [keep, new])


def unrolled_gru(w: GRUWeights, steps: int, batch: int | str = "N", form: str = "torch"):
    """X [T, B, I], h0 [B, H] -> Y [T, B, H], h_n; T cells unrolled (see module doc).

    >>> model = unrolled_gru(GRUWeights.random(128, 256), steps=16)
    """
    g = RNNGraph(17)
    hid, size = w.hidden, w.W.shape[1]
    h, ys = "h0", []
    for t in range(steps):
        x = g.node("Gather", ["X", g.named(np.array(t, np.int64), "t")], axis=0)
        h = gru_cell(g, x, h, w, form)
        ys.append(g.axes_op("Unsqueeze", h, [0]))
    g.nodes.append(helper.make_node("Concat", ys, ["Y"], name="/stack", axis=0))
    for node in g.nodes:
        node.input[:] = ["h_n" if v == h else v for v in node.input]
        node.output[:] = ["h_n" if v == h else v for v in node.output]
    inputs = {"X": [steps, batch, size], "h0": [batch, hid]}
    return g.model(inputs, {"Y": [steps, batch, hid], "h_n": [batch, hid]}, name="gru")


def native_gru(w: GRUWeights, steps: int, batch: int | str = "N") -> onnx.ModelProto:
    """The same network as one ONNX GRU node (gates z, r, h; linear_before_reset=1)."""
    g = RNNGraph(17)
    ww = w.reorder("zrn")
    b = np.concatenate([ww.Wb, ww.Rb])
    inputs = ["X", g.named(ww.W[None], "W"), g.named(ww.R[None], "R"), g.named(b[None], "B")]
    inputs += ["", g.axes_op("Unsqueeze", "h0", [0])]
    y, yh = g.node("GRU", inputs, 2, hidden_size=w.hidden, linear_before_reset=1)
    g.nodes.append(helper.make_node("Squeeze", [y, g.named(np.array([1]), "axes")], ["Y"]))
    g.nodes.append(helper.make_node("Squeeze", [yh, g.named(np.array([0]), "axes")], ["h_n"]))
    hid, size = w.hidden, w.W.shape[1]
    inputs = {"X": [steps, batch, size], "h0": [batch, hid]}
    return g.model(inputs, {"Y": [steps, batch, hid], "h_n": [batch, hid]}, name="gru")
