"""Cutting a fused model into run steps, onnxruntime "islands" and kernel nodes (pure graph
planning: the steps that run them are in fusion/runtime/steps.py).

A fused node whose rule has a kernel runs that kernel; every other node runs in onnxruntime.
Consecutive standard nodes are grouped into islands (one InferenceSession each), and the graph is
layered so that there are as few islands as the dependencies allow:

    depth(standard node) = max(depth(standard producer), depth(kernel producer) + 1)
    depth(kernel node)   = max(depth(any producer))

Island d runs, then the kernels of depth d (in graph order), then island d + 1. A standard node
only has to wait for an island boundary when it reads a kernel's output, so each island boundary
is forced by some kernel -> standard edge and the number of islands is minimal.

Constant-valued nodes (Constant, Identity of a constant) are folded at build time: islands receive
their values as initializers and kernels as precomputed inputs, never recomputed per run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx
from onnx import helper, numpy_helper

from fusion.catalog import DOMAIN
from fusion.functions import single_node_model
from fusion.graph import GraphView, ValueType, node_label, topological_order
from fusion.ort import DEFAULT, ISLAND, ISLAND_WITHOUT_CONV, Settings, inference_session


def is_fused(model: onnx.ModelProto) -> bool:
    """Whether the model has fused nodes (nodes in the fusion domain)."""
    return any(node.domain == DOMAIN for node in model.graph.node)


@dataclass
class IslandPlan:
    """Standard nodes run together by one onnxruntime session."""

    name: str
    nodes: list[onnx.NodeProto]
    inputs: list[str]  # values read from the run's environment, in a fixed order
    outputs: list[str]  # values needed later (by another step or as graph outputs)
    constants: list[str] = field(default_factory=list)  # become the island's initializers


@dataclass
class KernelPlan:
    """One fused node run by its kernel."""

    name: str
    node: onnx.NodeProto
    inputs: list[str]  # aligned to node.input; "" for an absent optional input
    outputs: list[str]


def values_read(view: GraphView) -> list[set[str]]:
    """Per node, every value it reads: its inputs and outer-scope values its subgraphs use."""
    reads: list[set[str]] = [set() for _ in view.nodes]
    for value, consumers in view.consumers.items():
        for i in consumers:
            reads[i].add(value)
    return reads


def live_nodes(view: GraphView, reads: list[set[str]]) -> set[int]:
    """Nodes a graph output depends on; the rest is dead code (an island of it would have no
    outputs, which onnxruntime refuses)."""
    live: set[int] = set()
    pending = [v for v in view.graph_outputs if v in view.producer]
    while pending:
        i = view.producer[pending.pop()][0]
        if i not in live:
            live.add(i)
            pending.extend(v for v in reads[i] if v in view.producer)
    return live


def is_folded(view: GraphView, node: onnx.NodeProto) -> bool:
    """A Constant (or Identity of a constant): its value is known when the session is built."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Constant", "Identity"):
        return False
    return all(view.constant(out) is not None for out in node.output if out)


def plan(
    view: GraphView, is_kernel: Callable[[onnx.NodeProto], bool]
) -> list[IslandPlan | KernelPlan]:
    """The run steps of the graph, islands and kernels interleaved by depth (see module doc)."""
    reads = values_read(view)
    live = live_nodes(view, reads)
    deps = [[view.producer[v][0] for v in values if v in view.producer] for values in reads]
    order = topological_order(deps, lambda i: node_label(view.nodes[i]))
    order = [i for i in order if i in live]
    kernel = {i for i in order if is_kernel(view.nodes[i])}
    folded = {i for i in order if i not in kernel and is_folded(view, view.nodes[i])}
    depth: dict[int, int] = {}
    for i in order:
        if i in folded:
            continue
        d = 0
        for value in reads[i]:
            j = view.producer.get(value, (None,))[0]
            if j is None or j in folded:
                continue
            crosses = j in kernel and i not in kernel  # a kernel's output read by onnxruntime
            d = max(d, depth[j] + crosses)
        depth[i] = d

    steps: list[IslandPlan | KernelPlan] = []
    islands = 0
    for d in range(max(depth.values(), default=-1) + 1):
        members = [i for i in order if depth.get(i) == d and i not in kernel]
        if members:
            steps.append(_island(view, reads, members, f"island{islands}"))
            islands += 1
        for i in order:
            if depth.get(i) == d and i in kernel:
                node = view.nodes[i]
                steps.append(
                    KernelPlan(node_label(node), node, list(node.input), list(node.output))
                )
    return steps


def _island(view: GraphView, reads: list[set[str]], members: list[int], name: str) -> IslandPlan:
    inside = set(members)
    produced = {out for i in members for out in view.nodes[i].output if out}
    inputs: list[str] = []
    constants: list[str] = []
    for i in members:
        for value in sorted(reads[i] - produced):
            target = constants if view.constant(value) is not None else inputs
            if value not in target:
                target.append(value)
    outputs = [
        out
        for i in members
        for out in view.nodes[i].output
        if out
        and (view.is_graph_output(out) or any(j not in inside for j in view.consumers.get(out, [])))
    ]
    return IslandPlan(name, [view.nodes[i] for i in members], inputs, outputs, constants)


def island_model(
    view: GraphView, island: IslandPlan, types: dict[str, ValueType | None]
) -> onnx.ModelProto:
    """A standalone model for one island; `types` gives each input's type (dtype required)."""
    initializers = []
    for value in island.constants:
        source = view.initializers.get(value)
        if source is not None and source.data_location != onnx.TensorProto.EXTERNAL:
            initializers.append(source)
        else:
            initializers.append(numpy_helper.from_array(view.constant(value), value))
    graph = helper.make_graph(
        island.nodes,
        f"{view.graph.name}_{island.name}",
        [_value_info(value, types[value]) for value in island.inputs],
        [_value_info(value, view.type_of(value)) for value in island.outputs],
        initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=list(view.model.opset_import),
        functions=list(view.model.functions),
        ir_version=view.model.ir_version,
    )
    return model


def _value_info(name: str, vt: ValueType | None) -> onnx.ValueInfoProto:
    if vt is None or not vt.elem_type:
        return onnx.ValueInfoProto(name=name)  # onnxruntime infers output types itself
    shape = None if vt.shape is None else [d if d not in (None, "") else None for d in vt.shape]
    return helper.make_tensor_value_info(name, vt.elem_type, shape)


_BLOCKED_LAYOUT_OPS = {"Conv", "ConvTranspose", "FusedConv"}  # ops NCHWc speeds up


def may_hold_a_conv(node: onnx.NodeProto) -> bool:
    """A conv op, or a node whose function body or subgraphs (If, Loop, Scan) may hold one."""
    return (
        node.op_type in _BLOCKED_LAYOUT_OPS
        or node.domain not in ("", "ai.onnx")
        or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute
        )
    )


def island_settings(island: IslandPlan, alone: bool = False) -> Settings:
    """How an island's onnxruntime session runs. `alone`: no kernel runs in the plan, so the
    island is the whole model and runs as onnxruntime does by default (workers spinning): a
    model with nothing fused then runs as fast as plain onnxruntime. Between kernels, idle
    workers must not spin (they would take the cores from Numba's threads), and onnxruntime's
    blocked NCHWc layout pays for its border reorders only across convs: an island without one
    (pools between conv kernels) is optimized short of it."""
    if alone:
        return DEFAULT
    return ISLAND if any(may_hold_a_conv(n) for n in island.nodes) else ISLAND_WITHOUT_CONV


def run_body(model: onnx.ModelProto, node: onnx.NodeProto, args, settings: Settings) -> list:
    """onnxruntime's outputs of one fused node: its function body on `args`."""
    single, feeds = single_node_model(model, node, args)
    return inference_session(single, settings, threads=1).run(None, feeds)
