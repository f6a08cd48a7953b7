"""GRUSequence:  h_t = GRUCell(x_t, h_{t-1}; W, R, b)  for t = 1 .. T

A chain of GRUCell nodes (stage 0's fused cells) with the same weights, where cell t + 1 reads
h' of cell t as its h (the cell pattern tells h from x by structure, so stacked layers, whose
next layer reads h' as its x, never chain across), becomes one node: inputs every step's x,
then h0 and the weights; outputs every step's h. The per-step inputs cut from one X and the
stacking of the outputs fold in as for the LSTM (patterns/rnn_steps.py); the kernel runs the
whole sequence in one Numba call (kernels/lstm.py, prepare_gru). Anchored on GRUCell, stage 1;
written as the ONNX GRU op by rewrite(standard_ops=True).
"""

from __future__ import annotations

import numpy as np
import onnx

from fusion.catalog import DOMAIN, Rule
from fusion.graph import GraphView, node_label
from fusion.matcher import Match
from fusion_patterns.gru import WEIGHTS, cell_weights
from fusion_patterns.rnn_steps import StandardNodes, StepOutputs, fold_steps


def _is_cell(node: onnx.NodeProto) -> bool:
    return node.op_type == "GRUCell" and node.domain == DOMAIN


def _differs(view: GraphView, a: onnx.NodeProto, b: onnx.NodeProto) -> str | None:
    """Why cells a and b cannot share one set of weights, if they cannot."""
    if view.attributes(a) != view.attributes(b):
        return f"{node_label(b)} has other attributes than {node_label(a)}"
    for name, va, vb in zip(WEIGHTS, a.input[2:], b.input[2:], strict=False):
        ca, cb = (view.constant(v) if v else None for v in (va, vb))
        if va != vb and (ca is None or cb is None or not np.array_equal(ca, cb)):
            return f"{node_label(b)} has other weights ({name}) than {node_label(a)}"
    return None


def _next_cell(view: GraphView, index: int) -> int | str | None:
    """The cell that reads this cell's h' as its h; None when none does."""
    node = view.nodes[index]
    if not _is_cell(node):
        return None
    users = [j for j in view.consumers.get(node.output[0], ()) if _is_cell(view.nodes[j])]
    links = [j for j in users if view.nodes[j].input[1] == node.output[0]]
    if len(links) > 1:
        return f"h' of {node_label(node)} feeds {len(links)} cells as their h"
    return links[0] if links else None


def find_chain(view: GraphView, index: int) -> list[Match] | str | None:
    """The longest chain of same-weight cells starting at `index` (which must be its head)."""
    head = view.nodes[index]
    prev = view.producer.get(head.input[1])
    linked = prev is not None and _next_cell(view, prev[0]) == index
    if linked and _differs(view, view.nodes[prev[0]], head) is None:
        return None  # not the head: the chain is found from its first cell
    chain, reason = [index], None
    while isinstance(j := _next_cell(view, chain[-1]), int):
        reason = _differs(view, view.nodes[chain[-1]], view.nodes[j])
        if reason:
            break
        chain.append(j)
    if len(chain) < 2:
        return reason or (j if isinstance(j, str) else None)
    cells = [view.nodes[i] for i in chain]
    values = {
        "xs": [c.input[0] for c in cells],
        "h0": head.input[1],
        **dict(zip(WEIGHTS, list(head.input[2:]) + [""] * len(WEIGHTS), strict=False)),
        "hs": [c.output[0] for c in cells],
    }
    plain = Match.of(view, values, {"head": index}, chain)
    folded = fold_steps(view, values)
    if folded is None:
        return [plain]
    return [Match.of(view, folded[0], {"head": index}, chain + folded[1]), plain]


def attributes(m: Match) -> dict:
    steps = len(m["xs"]) if len(m["xs"]) > 1 else len(m["hs"]) - 1
    return {**m.attrs("head"), "steps": steps, "folded": int(len(m["hs"]) != steps)}


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs all steps."""
    from fusion_kernels.gru import gru_sequence, prepare_gru  # heavy (Numba): only when built

    steps, folded = attrs["steps"], attrs["folded"]
    n_x = 1 if folded else steps
    plan = prepare_gru(*cell_weights(attrs, constants[n_x + 1 :]), attrs["linear_before_reset"])

    def run(*inputs):
        x = inputs[0] if folded else np.stack(inputs[:steps])
        return StepOutputs(gru_sequence(x, inputs[n_x], plan), None, stacked=bool(folded))

    return run


def standard(view: GraphView, node: onnx.NodeProto):
    """The fused chain as the ONNX GRU op (gates z, r, h; the cells' linear_before_reset)."""
    attrs = view.attributes(node)
    steps, folded = attrs["steps"], attrs["folded"]
    n_x = 1 if folded else steps
    inputs = list(node.input) + [""] * (n_x + 1 + len(WEIGHTS) - len(node.input))
    wx, wh, bx, bh = cell_weights(
        attrs, [view.constant(v) if v else None for v in inputs[n_x + 1 :]]
    )
    outputs = list(node.output)
    ys, hs = outputs[:folded], outputs[folded:]
    read = {v for n in view.nodes if n is not node for v in n.input} | view.graph_outputs
    g = StandardNodes(view, f"{node.name or outputs[0]}/")
    x = inputs[0] if folded else g.op("Concat", [g.unsqueeze(v) for v in inputs[:steps]], axis=0)
    weights = [g.const(wx.T[None], "W"), g.const(wh.T[None], "R")]
    weights.append(g.const(np.concatenate([bx, bh])[None], "B"))
    gru_in = [x, *weights, "", g.unsqueeze(inputs[n_x])]
    lbr = attrs["linear_before_reset"]
    y4, yh = g.op("GRU", gru_in, n_out=2, hidden_size=wh.shape[0], linear_before_reset=lbr)
    per_step = [t for t, h in enumerate(hs[:-1]) if h in read]
    if per_step or (ys and ys[0] in read):
        y = g.op("Squeeze", [y4, g.const(np.array([1]), "axes")], out=ys[0] if ys else None)
        for t in per_step:
            g.op("Gather", [y, g.const(np.array(t), f"t{t}")], out=hs[t], axis=0)
    if hs[-1] in read:
        g.op("Squeeze", [yh, g.const(np.array([0]), "axes")], out=hs[-1])
    return g.nodes, g.inits


RULE = Rule(
    "GRUSequence",
    None,
    inputs=("xs", "h0", *WEIGHTS),
    outputs=("hs",),
    prepare=make_kernel,
    attributes=attributes,
    finder=find_chain,
    anchor_ops=("GRUCell",),
    stage=1,
    priority=10,
    standard=standard,
    description="a chain of GRUCell nodes with the same weights, as one recurrence",
)
