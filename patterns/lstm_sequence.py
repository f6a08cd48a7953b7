"""LSTMSequence:  (h_t, c_t) = LSTMCell(x_t, h_{t-1}, c_{t-1}; W, R, b)  for t = 1 .. T

A chain of LSTMCell nodes (stage 0's fused cells) with the same weights, where cell t + 1 reads
h' and c' of cell t as its h and c, becomes one node: its inputs are every step's x, then h0,
c0 and the weights; its outputs every step's h, then every step's c (so no intermediate value
can escape). The roles come from the data flow: c' links the cells, and the input through which
h' arrives is the next cell's h, whichever the cell pattern bound it to (with equal input and
hidden sizes it cannot tell x from h); the head's h is the one multiplied by the weights the
second cell applies to h. When the steps' x are cut from one X (Gather(X, t), PyTorch's `x[t]`;
Split(X, axis=0) + Squeeze, tf.unstack) and the h's are stacked by Unsqueeze + Concat
(torch.stack, tf.stack), those fold in too: the node reads X and writes Y first, so a session
runs the whole layer as one kernel call with no onnxruntime island around it; otherwise they
stay outside (one island before, one after). The kernel runs the whole sequence in one Numba
call (kernels/lstm.py). A chain has any length, which a pattern cannot state, so this rule has
a finder anchored on LSTMCell, stage 1; a cell whose c' another cell reads in a way that does
not chain says why (fusion.explain).
"""

from __future__ import annotations

import numpy as np
import onnx

from fusion.catalog import DOMAIN, Rule
from fusion.graph import GraphView, node_label
from fusion.matcher import Match
from fusion_patterns.lstm import WEIGHTS, cell_weights
from fusion_patterns.rnn_steps import StandardNodes, StepOutputs, fold_steps

IFGO_TO_ONNX = [0, 3, 1, 2]  # the kernel's gate blocks i, f, g, o -> ONNX's i, o, f, c

# A cell's roles with x and h exchanged: its inputs' order, and its attributes' names.
SWAP_INPUTS = [1, 0, 2, *(3 + WEIGHTS.index(w) for w in ("R", "h_c", "h_b", "W", "x_c", "x_b"))]
SWAP_INPUTS += list(range(len(SWAP_INPUTS), 3 + len(WEIGHTS)))
SWAP_ATTRS = {"x_linear": "h_linear", "h_linear": "x_linear"}


def _is_cell(node: onnx.NodeProto) -> bool:
    return node.op_type == "LSTMCell" and node.domain == DOMAIN


def _roles(node: onnx.NodeProto, swapped: bool) -> list[str]:
    """The cell's inputs as x, h, c, *WEIGHTS: as the node has them, or with x and h (and
    their weights) exchanged when the node's x input is the chain's h."""
    inputs = (list(node.input) + [""] * (3 + len(WEIGHTS)))[: 3 + len(WEIGHTS)]
    return [inputs[k] for k in SWAP_INPUTS] if swapped else inputs


def _attributes(view: GraphView, node: onnx.NodeProto, swapped: bool) -> dict:
    attrs = view.attributes(node)
    if not swapped:
        return attrs
    if attrs.get("form") == "concat":
        return {**attrs, "swapped": 1}
    return {SWAP_ATTRS.get(k, k): v for k, v in attrs.items()}


def _differs(view: GraphView, a, b) -> str | None:
    """Why cells a and b ((node, swapped) pairs) cannot share one set of weights, if not."""
    (na, sa), (nb, sb) = a, b
    if _attributes(view, na, sa) != _attributes(view, nb, sb):
        return f"{node_label(nb)} has other attributes than {node_label(na)}"
    for name, va, vb in zip(WEIGHTS, _roles(na, sa)[3:], _roles(nb, sb)[3:], strict=True):
        if va == vb:
            continue
        ca, cb = view.constant(va) if va else None, view.constant(vb) if vb else None
        if ca is None or cb is None or ca.shape != cb.shape or not np.array_equal(ca, cb):
            return f"{node_label(nb)} has other weights ({name}) than {node_label(na)}"
    return None


def _next_cell(view: GraphView, index: int):
    """(j, swapped): the cell that reads this cell's c' as its c and h' as its h (swapped:
    h' arrives as that node's x, which data flow says is its h); a reason when a cell reads
    c' and the link is not that; None when no cell reads c' (or node `index` is no cell)."""
    node = view.nodes[index]
    if not _is_cell(node):
        return None
    h_out, c_out = node.output[:2]
    links, reason = [], None
    for j in view.consumers.get(c_out, ()):
        user = view.nodes[j]
        if not _is_cell(user):
            continue
        if user.input[2] != c_out:
            reason = f"{node_label(user)} reads c' of {node_label(node)} but not as its c"
        elif h_out in user.input[:2]:
            links.append((j, user.input[0] == h_out))
        else:
            reason = f"{node_label(user)} reads c' of {node_label(node)} but not its h'"
    if len(links) > 1:
        return f"c' of {node_label(node)} feeds {len(links)} cells"
    return links[0] if links else reason


def _head_orientation(view: GraphView, head: int, second) -> bool | str:
    """Whether the head's x is its h (data flow cannot say: h0 comes from outside), taken
    as the orientation whose weights the second cell has; or why neither fits."""
    reasons = []
    for swapped in (False, True):
        reason = _differs(view, (view.nodes[head], swapped), (view.nodes[second[0]], second[1]))
        if reason is None:
            return swapped
        reasons.append(reason)
    return reasons[0]


def find_chain(view: GraphView, index: int) -> list[Match] | str | None:
    """The longest chain of same-weight cells starting at `index` (which must be its head)."""
    head = view.nodes[index]
    prev = view.producer.get(head.input[2])
    if prev is not None and _is_cell(view.nodes[prev[0]]):
        link = _next_cell(view, prev[0])
        if isinstance(link, tuple) and link[0] == index:
            orient = _head_orientation(view, prev[0], link)
            if not isinstance(orient, str):
                return None  # not the head: the chain is found from its first cell
    second = _next_cell(view, index)
    if not isinstance(second, tuple):
        return second  # a reason the chain did not form, or None: a lone cell
    orient = _head_orientation(view, index, second)
    if isinstance(orient, str):
        return orient
    cells = [(index, orient), second]
    reason = None
    while isinstance(link := _next_cell(view, cells[-1][0]), tuple):
        prev_cell = (view.nodes[cells[-1][0]], cells[-1][1])
        reason = _differs(view, prev_cell, (view.nodes[link[0]], link[1]))
        if reason:
            break
        cells.append(link)
    roles = [_roles(view.nodes[i], s) for i, s in cells]
    values = {
        "xs": [r[0] for r in roles],
        "h0": roles[0][1],
        "c0": roles[0][2],
        **dict(zip(WEIGHTS, roles[0][3:], strict=True)),
        "hs": [view.nodes[i].output[0] for i, _ in cells],
        "cs": [view.nodes[i].output[1] for i, _ in cells],
    }
    chain = [i for i, _ in cells]
    nodes = {"head": index}
    folded = fold_steps(view, values)
    plain = Match.of(view, values, nodes, chain)
    if folded is None:
        return [plain]
    return [Match.of(view, folded[0], nodes, chain + folded[1]), plain]


def attributes(m: Match) -> dict:
    """The head cell's attributes in the chain's roles, the number of steps and whether X and Y
    are folded in."""
    head = m.node("head")
    swapped = m["h0"] == head.input[0] and m["h0"] != head.input[1]
    steps = len(m["cs"])
    attrs = _attributes(m.view, head, swapped)
    return {**attrs, "steps": steps, "folded": int(len(m["xs"]) != steps)}


def make_kernel(attrs: dict, constants: list):
    """Pack the weights once; the returned function runs all steps."""
    from fusion_kernels.lstm import lstm_sequence, prepare_lstm  # heavy (Numba): only when built

    steps, folded = attrs["steps"], attrs.get("folded", 0)
    n_x = 1 if folded else steps
    plan = prepare_lstm(*cell_weights(attrs, constants[n_x + 2 :]))

    def run(*inputs):
        x = inputs[0] if folded else np.stack(inputs[:steps])
        hs, cs = lstm_sequence(x, inputs[n_x], inputs[n_x + 1], plan)
        return StepOutputs(hs, cs, stacked=bool(folded))

    return run


def standard(view: GraphView, node: onnx.NodeProto):
    """The fused chain as the ONNX LSTM op (rewrite(standard_ops=True)): (nodes, initializers)
    computing the outputs that anything reads, or why it cannot (the op returns only the last
    step's c)."""
    attrs = view.attributes(node)
    steps, folded = attrs["steps"], attrs.get("folded", 0)
    n_x = 1 if folded else steps
    inputs = list(node.input) + [""] * (n_x + 2 + len(WEIGHTS) - len(node.input))
    constants = [view.constant(v) if v else None for v in inputs[n_x + 2 :]]
    wx, wh, b = cell_weights(attrs, constants)
    hidden = wh.shape[0]
    cols = np.concatenate([np.arange(k * hidden, (k + 1) * hidden) for k in IFGO_TO_ONNX])
    outputs = list(node.output)
    ys, hs, cs = outputs[:folded], outputs[folded : folded + steps], outputs[folded + steps :]
    read = {v for n in view.nodes if n is not node for v in n.input} | view.graph_outputs
    if any(c in read for c in cs[:-1]):
        return "a step's c other than the last is read, and the LSTM op returns only the last"
    g = StandardNodes(view, f"{node.name or outputs[0]}/")
    x = inputs[0] if folded else g.op("Concat", [g.unsqueeze(v) for v in inputs[:steps]], axis=0)
    weights = [
        g.const(wx[:, cols].T[None], "W"),
        g.const(wh[:, cols].T[None], "R"),
        g.const(np.concatenate([b[cols], np.zeros_like(b)])[None], "B"),
    ]
    lstm_in = [x, *weights, "", g.unsqueeze(inputs[n_x]), g.unsqueeze(inputs[n_x + 1])]
    y4, yh, yc = g.op("LSTM", lstm_in, n_out=3, hidden_size=hidden)
    per_step = [t for t, h in enumerate(hs[:-1]) if h in read]
    if per_step or (ys and ys[0] in read):
        y = g.op("Squeeze", [y4, g.const(np.array([1]), "axes")], out=ys[0] if ys else None)
        for t in per_step:
            g.op("Gather", [y, g.const(np.array(t), f"t{t}")], out=hs[t], axis=0)
    for value, state in ((hs[-1], yh), (cs[-1], yc)):
        if value in read:
            g.op("Squeeze", [state, g.const(np.array([0]), "axes")], out=value)
    return g.nodes, g.inits


RULE = Rule(
    "LSTMSequence",
    None,
    inputs=("xs", "h0", "c0", *WEIGHTS),
    outputs=("hs", "cs"),
    prepare=make_kernel,
    attributes=attributes,
    finder=find_chain,
    anchor_ops=("LSTMCell",),
    standard=standard,
    stage=1,
    priority=10,
    description="a chain of LSTMCell nodes with the same weights, as one recurrence",
)
