"""The steps of an unrolled recurrence, shared by the LSTM and GRU sequence rules: folding the
per-step inputs cut from one X (Gather, or Split + Squeeze) and the stacking of the per-step
outputs into one Y (Unsqueeze + Concat) into the fused node; the node's per-step outputs as
views made on demand; the nodes of a standard-op form (rewrite(standard_ops=True)).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusion.graph import GraphView
from fusion.matcher import Match


def fold_steps(view: GraphView, values: dict):
    """Captures with X [T, B, I] as the only step input and Y [T, B, H] as the first output,
    and the nodes that fold in, when the steps' x are cut from one X and their h stacked into
    one Y (_unstacked, _stacked); None otherwise."""
    unstacked, stacked = _unstacked(view, values["xs"]), _stacked(view, values["hs"])
    if unstacked is None or stacked is None:
        return None
    (data, before), (y, after) = unstacked, stacked
    return {**values, "xs": [data], "hs": [y, *values["hs"]]}, before + after


def _axis0(view: GraphView, node: onnx.NodeProto) -> bool:
    """The node's axes (input 1 or attribute) are [0]."""
    axes = view.constant(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    axes = view.attributes(node).get("axes") if axes is None else axes
    return axes is not None and np.reshape(axes, -1).tolist() == [0]


def _unstacked(view: GraphView, xs: list[str]):
    """(X, nodes) when x_t = Gather(X, t, axis=0) (PyTorch's x[t]) or x_t = Squeeze(output t
    of Split(X, axis=0) into T parts, axes=[0]) (tf.unstack, as tf2onnx writes it)."""
    data, nodes = None, []
    for t, x in enumerate(xs):
        index = view.producer.get(x, (None,))[0]
        node = None if index is None else view.nodes[index]
        if node is not None and node.op_type == "Squeeze" and _axis0(view, node):
            split = view.producer.get(node.input[0])
            if split is None or split[1] != t or view.nodes[split[0]].op_type != "Split":
                return None
            cut = view.nodes[split[0]]
            if view.attributes(cut).get("axis") != 0 or len(cut.output) != len(xs):
                return None
            source, nodes = cut.input[0], nodes + [index] + ([split[0]] if t == 0 else [])
        elif node is not None and node.op_type == "Gather" and view.attributes(node)["axis"] == 0:
            at = view.constant(node.input[1])
            if at is None or at.ndim != 0 or int(at) != t:
                return None
            source, nodes = node.input[0], nodes + [index]
        else:
            return None
        if data not in (None, source):
            return None
        data = source
    return data, nodes


def _stacked(view: GraphView, hs: list[str]):
    """(Y, nodes) when Y = Concat(Unsqueeze(h_t, axes=[0]) for t, axis=0) (torch.stack,
    tf.stack)."""
    nodes, parts = [], []
    for h in hs:
        users = [j for j in view.consumers.get(h, ()) if view.nodes[j].op_type == "Unsqueeze"]
        if len(users) != 1 or not _axis0(view, view.nodes[users[0]]):
            return None
        nodes.append(users[0])
        parts.append(view.nodes[users[0]].output[0])
    users = view.consumers.get(parts[0], [])
    concat = view.nodes[users[0]] if len(users) == 1 else None
    if concat is None or concat.op_type != "Concat" or list(concat.input) != parts:
        return None
    if view.attributes(concat).get("axis") != 0:
        return None
    return concat.output[0], [*nodes, users[0]]


class StepOutputs(Sequence):
    """A sequence node's outputs, (Y,) h_1 .. h_T (, c_1 .. c_T), as views of hs and cs made
    when asked for: a session reads only those a later step uses (often Y, h_T and c_T of
    2 T + 1). cs None: a GRU's, no c."""

    def __init__(self, hs: np.ndarray, cs: np.ndarray | None, stacked: bool):
        self.hs, self.cs, self.first, self.steps = hs, cs, int(stacked), len(hs)
        self.size = self.first + (1 if cs is None else 2) * self.steps

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.size <= i < self.size:
            raise IndexError(i)
        i = i % self.size - self.first
        if i < 0:
            return self.hs
        return self.hs[i] if i < self.steps else self.cs[i - self.steps]


class StandardNodes:
    """Nodes and initializers of a standard form, their names under `prefix`, each taken from
    the graph's allocators (view.names, view.node_names): never a name the model holds."""

    def __init__(self, view: GraphView, prefix: str):
        self.view, self.prefix = view, prefix
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, array: np.ndarray, hint: str) -> str:
        name = self.view.names.fresh(f"{self.prefix}{hint}_{len(self.inits)}")
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs, n_out: int = 1, out: str | None = None, **attrs):
        if op_type in ("Squeeze", "Unsqueeze") and self.view.opset.get("", 1) < 13:
            attrs["axes"] = numpy_helper.to_array(self.inits.pop()).tolist()
            inputs = inputs[:1]
        k, fresh = len(self.nodes), self.view.names.fresh
        outs = [out] if out else [fresh(f"{self.prefix}{op_type}_{k}_{i}") for i in range(n_out)]
        name = self.view.node_names.fresh(f"{self.prefix}{op_type}_{k}")
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs if n_out > 1 else outs[0]

    def unsqueeze(self, value: str) -> str:
        return self.op("Unsqueeze", [value, self.const(np.array([0]), "axes")])


def _axes_are(view: GraphView, node: onnx.NodeProto, axis: int) -> bool:
    axes = view.constant(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    axes = view.attributes(node).get("axes") if axes is None else axes
    return axes is not None and np.reshape(axes, -1).tolist() == [axis]


def native_matches(view: GraphView, index: int, key: str, names: tuple, fused: tuple,
                   states: tuple, axes: tuple) -> list[Match]:  # fmt: skip
    """The native op (LSTM, GRU) at `index` as a match of its own, named `key`, reading the
    `fused` ones of its inputs (`names`: the op's input order) and writing its outputs; for one
    direction, first the same with its Unsqueeze/Squeeze folded in (fold_native)."""
    node = view.nodes[index]
    inputs = dict(zip(names, node.input, strict=False))
    values = {name: inputs.get(name, "") for name in fused}
    values["outputs"] = [v for v in node.output if v]
    plain = Match.of(view, values, {key: index}, [index])
    if view.attributes(node).get("direction") == "bidirectional":
        return [plain]
    folded = fold_native(view, index, values, states, axes)
    if folded is None:
        return [plain]
    return [Match.of(view, folded[0], {key: index}, folded[1]), plain]


def fold_native(view: GraphView, index: int, values: dict, states: tuple, axes: tuple):
    """A one-direction native op (LSTM, GRU) with the Unsqueeze(s, axes=[0]) of its initial
    `states` and the Squeeze of its outputs (`axes` per output: Y's direction axis 1, the final
    states' 0), as PyTorch exports nn.LSTM and nn.GRU, folded in: (values, nodes) reading and
    writing the squeezed values, or None when there is nothing to fold."""
    node, values, nodes = view.nodes[index], dict(values), [index]
    for name in states:
        producer = view.producer.get(values[name]) if values[name] else None
        before = view.nodes[producer[0]] if producer else None
        if before is not None and before.op_type == "Unsqueeze" and _axes_are(view, before, 0):
            values[name] = before.input[0]
            nodes.append(producer[0])
    outputs = []
    for value, axis in zip(node.output, axes, strict=False):
        users = view.consumers.get(value, []) if value else []
        after = view.nodes[users[0]] if len(users) == 1 else None
        fold = after is not None and after.op_type == "Squeeze" and _axes_are(view, after, axis)
        if fold and not view.is_graph_output(value):
            nodes.append(users[0])
            value = after.output[0]
        if value:
            outputs.append(value)
    values["outputs"] = outputs
    return (values, sorted(nodes)) if len(nodes) > 1 else None


def shaped_outputs(ys: list, finals: list, present: list, squeezed: list) -> tuple:
    """A native op's present outputs from per-direction sequences ys ([T, B, H] each) and final
    states (finals: per state, a list per direction): Y [T, D, B, H] and the states [D, B, H],
    or, squeezed (one direction, fold_native), [T, B, H] and [B, H] without copies."""
    if len(ys) == 1:
        outs = [np.ascontiguousarray(ys[0])[:, None], *(f[0][None] for f in finals)]
    else:
        outs = [np.stack(ys, axis=1), *(np.stack(f) for f in finals)]
    kept = [(k, v) for k, (v, keep) in enumerate(zip(outs, present, strict=True)) if keep]
    return tuple(
        (v[:, 0] if k == 0 else v[0]) if fold else v
        for (k, v), fold in zip(kept, list(squeezed) + [0] * len(kept), strict=False)
    )
