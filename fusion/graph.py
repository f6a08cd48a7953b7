"""A read-only index over an ONNX graph: producers, consumers, types, constants, attributes;
and the allocator of the names a rewrite writes into it (GraphView.names).

Built once per rewrite (or per runtime session), so that matching never rescans the graph.
Value types come from the graph's own declarations first and from ONNX shape inference for
values the graph does not describe.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.helper import make_tensor_value_info

from fusion.modelfile import over_2gb, weightless_copy
from fusion.onnx_defaults import attribute_defaults
from fusion.shapes import refine_types


@dataclass(frozen=True)
class ValueType:
    """Element type and shape of a value; shape entries are ints, strings (symbolic) or None."""

    elem_type: int  # onnx.TensorProto.FLOAT, ...; 0 when unknown
    shape: tuple | None  # None when the rank is unknown

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def dtype_name(self) -> str:
        if not self.elem_type:
            return "unknown"
        return onnx.helper.tensor_dtype_to_np_dtype(self.elem_type).name


def _value_type(type_proto: onnx.TypeProto) -> ValueType | None:
    if not type_proto.HasField("tensor_type"):
        return None
    tt = type_proto.tensor_type
    elem = tt.elem_type if tt.elem_type in _KNOWN_ELEM_TYPES else 0  # a corrupt one: unknown
    if not tt.HasField("shape"):
        return ValueType(elem, None)
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return ValueType(elem, tuple(dims))


_KNOWN_ELEM_TYPES = frozenset(onnx.helper.get_all_tensor_dtypes())


def node_label(node: onnx.NodeProto) -> str:
    """How a node is named in messages: 'Conv /conv1', or 'Conv (output y)' when unnamed."""
    return (
        f"{node.op_type} {node.name}" if node.name else f"{node.op_type} (output {node.output[0]})"
    )


class GraphView:
    """Index of one onnx.GraphProto (the main graph; subgraphs are left alone)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.nodes: list[onnx.NodeProto] = list(self.graph.node)
        self.opset = {o.domain or "": o.version for o in model.opset_import}
        self.producer: dict[str, tuple[int, int]] = {}  # value -> (node index, output index)
        self.consumers: dict[str, list[int]] = {}  # value -> indices of consuming nodes
        self.by_op: dict[str, list[int]] = {}  # op_type -> indices of its nodes, in graph order
        for i, node in enumerate(self.nodes):
            self.by_op.setdefault(node.op_type, []).append(i)
            for k, out in enumerate(node.output):
                if out:
                    self.producer[out] = (i, k)
            for name in set(node.input) | implicit_inputs(node):
                if name:
                    self.consumers.setdefault(name, []).append(i)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.graph_inputs = [i.name for i in self.graph.input if i.name not in self.initializers]
        self.graph_outputs = {o.name for o in self.graph.output}
        self._const_cache: dict[str, np.ndarray | None] = {}
        self._attr_cache: dict[int, dict] = {}

    # ---- types -------------------------------------------------------------------------------
    @cached_property
    def _types(self) -> dict[str, ValueType]:
        types: dict[str, ValueType] = {}
        for t in self.graph.initializer:
            types[t.name] = ValueType(t.data_type, tuple(t.dims))
        skeleton = weightless_copy(self.model) if over_2gb(self.model) else self.model
        for vi in [*self._inferred(skeleton).values(), *self.graph.value_info]:
            vt = _value_type(vi.type)
            if vt is not None:
                types.setdefault(vi.name, vt)
        for vi in list(self.graph.input) + list(self.graph.output):
            vt = _value_type(vi.type)
            if vt is not None and (vt.shape is not None or vi.name not in types):
                types[vi.name] = vt  # declarations win over inference (unless shapeless)
        self.__dict__["_types"] = types  # refine_types reads them through type_of

        hinted = None  # the model without its weights' bytes, copied once if a round needs it

        def infer(dims: dict[str, tuple]) -> dict[str, ValueType]:
            nonlocal hinted
            model = hinted = hinted or weightless_copy(self.model)
            del model.graph.value_info[:]  # ONNX keeps a declared unk__N over what it infers
            for out in model.graph.output:
                if out.name in dims:  # ONNX takes an output's type from its declaration
                    out.type.CopyFrom(make_tensor_value_info(out.name, 0, dims[out.name]).type)
                    out.type.tensor_type.elem_type = types[out.name].elem_type
                    continue
                for dim in out.type.tensor_type.shape.dim:
                    if dim.dim_param.startswith("unk__"):
                        dim.Clear()
            for name, shape in dims.items():
                elem = types[name].elem_type if name in types else 0
                model.graph.value_info.append(make_tensor_value_info(name, elem, shape))
            found = {name: _value_type(vi.type) for name, vi in self._inferred(model).items()}
            return {name: vt for name, vt in found.items() if vt is not None}

        declared = dict(types)
        try:
            refine_types(self, types, infer)
        except Exception:  # noqa: BLE001 (refinement is best effort: ONNX's types stand)
            types.clear()
            types.update(declared)
        return types

    @staticmethod
    def _inferred(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
        """ONNX shape inference's value infos, by name (none where it fails: it is best effort,
        declared types still count)."""
        try:
            graph = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
        except Exception:
            return {}
        return {vi.name: vi for vi in [*graph.value_info, *graph.output]}

    def type_of(self, value: str) -> ValueType | None:
        vt = self._types.get(value)
        if vt is None:
            arr = self.constant(value)
            if arr is not None:
                elem = onnx.helper.np_dtype_to_tensor_dtype(arr.dtype)
                vt = ValueType(elem, tuple(arr.shape))
        return vt

    # ---- constants ---------------------------------------------------------------------------
    def constant_source(self, value: str) -> str | None:
        """The initializer or Constant-node output behind `value`, looking through Identity."""
        seen = 0
        while value and seen < 64:
            if value in self.initializers:
                return value if value not in self.graph_inputs_with_defaults else None
            prod = self.producer.get(value)
            if prod is None:
                return None
            node = self.nodes[prod[0]]
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                return value
            if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
                return None
            value, seen = node.input[0], seen + 1
        return None

    @cached_property
    def graph_inputs_with_defaults(self) -> set[str]:
        """Initializers that are also graph inputs can be overridden by a feed: not constants."""
        return {i.name for i in self.graph.input} & set(self.initializers)

    def constant(self, value: str) -> np.ndarray | None:
        """The numpy value of `value` if it is constant (initializer or Constant, via Identity)."""
        if value in self._const_cache:
            return self._const_cache[value]
        src = self.constant_source(value)
        arr = None
        if src is not None:
            if src in self.initializers:
                arr = numpy_helper.to_array(self.initializers[src])
            else:
                arr = _constant_node_value(self.nodes[self.producer[src][0]])
        self._const_cache[value] = arr
        return arr

    # ---- attributes --------------------------------------------------------------------------
    def attributes(self, node: onnx.NodeProto) -> dict:
        """The node's attributes with ONNX defaults applied (Conv without strides has strides 1)."""
        key = id(node)
        if key not in self._attr_cache:
            self._attr_cache[key] = self._attributes(node)
        return dict(self._attr_cache[key])

    def _attributes(self, node: onnx.NodeProto) -> dict:
        attrs = attribute_defaults(node, self.opset, self.type_of)
        for a in node.attribute:
            attrs[a.name] = onnx.helper.get_attribute_value(a)
            if isinstance(attrs[a.name], bytes):
                attrs[a.name] = attrs[a.name].decode()
        return attrs

    def is_graph_output(self, value: str) -> bool:
        return value in self.graph_outputs

    # ---- names -------------------------------------------------------------------------------
    @cached_property
    def names(self) -> Names:
        """The one allocator of value names for what a rewrite writes into this graph: every
        writer of the same graph shares it, so no two take the same name either."""
        return Names(value_names(self.graph))

    @cached_property
    def node_names(self) -> Names:
        """The same for node names (a namespace of their own in ONNX)."""
        return Names(node_names(self.graph))


class Names:
    """Fresh names: the hint itself when free, else the hint with the first free `_k` suffix.
    A name handed out is taken from then on.

    >>> view.names.fresh("/lstm/W_0")  # '/lstm/W_0', or '/lstm/W_0_1' if the model has it
    """

    def __init__(self, taken: Iterable[str]):
        self.taken = set(taken)

    def fresh(self, hint: str) -> str:
        name, k = hint, 0
        while name in self.taken:
            k += 1
            name = f"{hint}_{k}"
        self.taken.add(name)
        return name


def value_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a graph holds: inputs, outputs, initializers (sparse too), value_info,
    node inputs and outputs, and the same inside its subgraphs (If/Loop/Scan bodies: a name
    they define must not be defined outside as well)."""
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names.update(t.name for t in graph.initializer)
    names.update(t.values.name for t in graph.sparse_initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for g in _subgraphs(node):
            names |= value_names(g)
    names.discard("")
    return names


def node_names(graph: onnx.GraphProto) -> set[str]:
    """Every node name in a graph and its subgraphs."""
    names = {node.name for node in graph.node}
    for node in graph.node:
        for g in _subgraphs(node):
            names |= node_names(g)
    names.discard("")
    return names


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [
        g
        for a in node.attribute
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)
    ]


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_float", "value_int"):
            dt = np.float32 if a.name == "value_float" else np.int64
            return np.array(onnx.helper.get_attribute_value(a), dtype=dt)
        if a.name in ("value_floats", "value_ints"):
            dt = np.float32 if a.name == "value_floats" else np.int64
            return np.array(onnx.helper.get_attribute_value(a), dtype=dt)
    return None


def topological_order(
    deps: Sequence[Iterable[int]], label: Callable[[int], str] = lambda i: f"node {i}"
) -> list[int]:
    """Indices 0 .. n - 1 with each node after the nodes it depends on (deps[i]), taking the
    lowest ready index each time: a node moves only as far as its inputs require, so a graph
    already in order keeps its order. ValueError naming a node on a cycle."""
    users: list[list[int]] = [[] for _ in deps]
    waiting = []
    for i, needs in enumerate(deps):
        needs = set(needs)
        waiting.append(len(needs))
        for d in needs:
            users[d].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(deps):
        stuck = min(set(range(len(deps))) - set(order))
        raise ValueError(f"the graph has a cycle through {label(stuck)}")
    return order


def implicit_inputs(node: onnx.NodeProto) -> set[str]:
    """Outer-scope values that a node's subgraphs (If/Loop/Scan bodies) read implicitly."""
    names: set[str] = set()
    for g in _subgraphs(node):
        local = {i.name for i in g.input} | {t.name for t in g.initializer}
        for n in g.node:
            local.update(n.output)
        for n in g.node:
            names.update(x for x in set(n.input) | implicit_inputs(n) if x and x not in local)
        names.update(o.name for o in g.output if o.name not in local)
    return names
