"""LSTMSequence:  (h_t, c_t) = LSTMCell(x_t, h_{t-1}, c_{t-1}; W, R, b)  for t = 1 .. T

A chain of LSTMCell nodes (stage 0's fused cells) with the same weights, where cell t + 1 reads
h' and c' of cell t as its h and c, becomes one node: its inputs are every step's x, then h0,
c0 and the weights; its outputs every step's h, then every step's c (so no intermediate value
can escape). When the steps' x are Gather(X, t, axis=0) and the h's are stacked by Unsqueeze +
Concat (PyTorch's `x[t]` and `torch.stack`), those fold in too: the node reads X and writes Y
first, so a session runs the whole layer as one kernel call with no onnxruntime island around
it; otherwise they stay outside (one island before, one after). The kernel runs the whole
sequence in one Numba call (kernels/lstm.py). A chain has any
length, which a pattern cannot state, so this rule has a finder anchored on LSTMCell, stage 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from fusion.catalog import DOMAIN, Rule
from fusion.graph import GraphView, node_label
from fusion.matcher import Match
from patterns.lstm import cell_weights

WEIGHTS = ("W", "R", "B", "B2", "forget_bias")  # inputs 3.. of an LSTMCell node


def _is_cell(node: onnx.NodeProto) -> bool:
    return node.op_type == "LSTMCell" and node.domain == DOMAIN


def _weights(node: onnx.NodeProto) -> list[str]:
    return (list(node.input[3:]) + [""] * len(WEIGHTS))[: len(WEIGHTS)]


def _differs(view: GraphView, a: onnx.NodeProto, b: onnx.NodeProto) -> str | None:
    """Why cells a and b cannot share one set of weights, if they cannot."""
    if view.attributes(a) != view.attributes(b):
        return f"{node_label(b)} has other attributes than {node_label(a)}"
    for name, va, vb in zip(WEIGHTS, _weights(a), _weights(b), strict=True):
        if va == vb:
            continue
        ca, cb = view.constant(va), view.constant(vb) if vb else None
        if ca is None or cb is None or ca.shape != cb.shape or not np.array_equal(ca, cb):
            return f"{node_label(b)} has other weights ({name}) than {node_label(a)}"
    return None


def _next_cell(view: GraphView, index: int) -> int | None:
    """The cell that reads this cell's h' and c' as its h and c, if exactly one does (None
    when node `index` is no cell: the head's h may come from any node)."""
    if not _is_cell(view.nodes[index]):
        return None
    h_out, c_out = view.nodes[index].output[:2]
    users = [
        j
        for j in view.consumers.get(c_out, ())
        if _is_cell(view.nodes[j]) and view.nodes[j].input[1:3] == [h_out, c_out]
    ]
    return users[0] if len(users) == 1 else None


def find_chain(view: GraphView, index: int) -> list[Match] | str | None:
    """The longest chain of same-weight cells starting at `index` (which must be its head)."""
    head = view.nodes[index]
    prev = view.producer.get(head.input[1])
    linked = prev is not None and _next_cell(view, prev[0]) == index
    if linked and _differs(view, view.nodes[prev[0]], head) is None:
        return None  # not the head: the chain is found from its first cell
    chain, reason = [index], None
    while (j := _next_cell(view, chain[-1])) is not None:
        reason = _differs(view, view.nodes[chain[-1]], view.nodes[j])
        if reason:
            break
        chain.append(j)
    if len(chain) < 2:
        return reason
    cells = [view.nodes[i] for i in chain]
    values = {
        "xs": [cell.input[0] for cell in cells],
        "h0": head.input[1],
        "c0": head.input[2],
        **dict(zip(WEIGHTS, _weights(head), strict=True)),
        "hs": [cell.output[0] for cell in cells],
        "cs": [cell.output[1] for cell in cells],
    }
    folded = _fold_gather_and_stack(view, values)
    plain = Match.of(view, values, {"head": index}, chain)
    return (
        [plain]
        if folded is None
        else [Match.of(view, folded[0], {"head": index}, chain + folded[1]), plain]
    )


def _fold_gather_and_stack(view: GraphView, values: dict):
    """x_t = Gather(X, t, axis=0) and Y = Concat(Unsqueeze(h_t, 0), axis=0), as PyTorch exports
    `x[t]` and `torch.stack`: captures with X as the only input and Y as the first output."""
    data, nodes = None, []
    for t, x in enumerate(values["xs"]):
        node = view.nodes[view.producer[x][0]] if x in view.producer else None
        if node is None or node.op_type != "Gather" or view.attributes(node).get("axis") != 0:
            return None
        index = view.constant(node.input[1])
        if index is None or index.ndim != 0 or int(index) != t or data not in (None, node.input[0]):
            return None
        data = node.input[0]
        nodes.append(view.producer[x][0])
    stacked = []
    for h in values["hs"]:
        users = [j for j in view.consumers.get(h, ()) if view.nodes[j].op_type == "Unsqueeze"]
        if len(users) != 1:
            return None
        node = view.nodes[users[0]]
        axes = view.constant(node.input[1]) if len(node.input) > 1 else None
        axes = view.attributes(node).get("axes") if axes is None else axes
        if axes is None or np.reshape(axes, -1).tolist() != [0]:
            return None
        nodes.append(users[0])
        stacked.append(node.output[0])
    users = view.consumers.get(stacked[0], [])
    concat = view.nodes[users[0]] if len(users) == 1 else None
    if concat is None or concat.op_type != "Concat" or list(concat.input) != stacked:
        return None
    if view.attributes(concat).get("axis") != 0:
        return None
    captures = {**values, "xs": [data], "hs": [concat.output[0], *values["hs"]]}
    return captures, [*nodes, users[0]]


def attributes(m: Match) -> dict:
    steps = len(m["cs"])
    return {**m.attrs("head"), "steps": steps, "folded": int(len(m["xs"]) != steps)}


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs all steps."""
    from kernels.lstm import lstm_sequence, prepare_lstm  # heavy (Numba): only when built

    steps, folded = attrs["steps"], attrs.get("folded", 0)
    n_x = 1 if folded else steps
    plan = prepare_lstm(*cell_weights(attrs, [None] * 3 + list(constants[n_x + 2 :])))

    def run(*inputs):
        x = inputs[0] if folded else np.stack(inputs[:steps])
        hs, cs = lstm_sequence(x, inputs[n_x], inputs[n_x + 1], plan)
        return StepOutputs(hs, cs, stacked=bool(folded))

    return run


class StepOutputs(Sequence):
    """The node's outputs, (Y,) h_1 .. h_T, c_1 .. c_T, as views of hs and cs made when asked
    for: a session reads only those a later step uses (often Y, h_T and c_T of 2 T + 1)."""

    def __init__(self, hs: np.ndarray, cs: np.ndarray, stacked: bool):
        self.hs, self.cs, self.first, self.steps = hs, cs, int(stacked), len(hs)
        self.size = self.first + 2 * self.steps

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.size <= i < self.size:
            raise IndexError(i)
        i = i % self.size - self.first
        if i < 0:
            return self.hs
        return self.hs[i] if i < self.steps else self.cs[i - self.steps]


RULE = Rule(
    "LSTMSequence",
    None,
    inputs=("xs", "h0", "c0", *WEIGHTS),
    outputs=("hs", "cs"),
    prepare=make_kernel,
    attributes=attributes,
    finder=find_chain,
    anchor_ops=("LSTMCell",),
    stage=1,
    priority=10,
    description="a chain of LSTMCell nodes with the same weights, as one recurrence",
)
