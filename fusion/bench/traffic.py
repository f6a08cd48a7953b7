"""Memory traffic of the depth-first blocks, estimated from the graph (issue 28's report).

A block is a fused node that chains convs: a Conv inside it reads a value that another node
inside it made, with image planes (an inverted residual's expanded tensor e and its depthwise
output d; a DenseNet layer's normalized input to its 1x1 conv; not squeeze-excitation's
per-channel vectors). Run op by op (a tactic that is not depth_first, fusion.catalog.Tactic:
the "opbyop" ones, a Fire module's, which writes its squeeze; or the function body in
onnxruntime), each such value is written to memory once and read back by each of its
consumers; run depth first, it lives in the kernel's cache-sized scratch (or, a
squeeze-excitation gate folded into the next conv's weights, is never made), and only the
block's inputs and outputs move. So, per block:

    depth first = bytes of its activation inputs + bytes of its outputs
    op by op    = depth first + sum over the values between its convs of bytes x (1 + readers)

Weights are left out (either way they are read once), and so are the values inside one conv's
epilogue (conv -> activation -> residual add: every plan, onnxruntime's too, applies those as
the conv's output is stored). An estimate of bytes moved, not a measurement: whether a tensor
written "to memory" comes back from L2, L3 or DRAM depends on its size and on the machine.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from fusion.graph import GraphView, node_label


def originals(fusions) -> dict[str, set[str]]:
    """Fused node label -> the labels of the original model's nodes it replaced (a later
    stage's fused node replaced earlier fused nodes: followed down to the originals)."""
    inside: dict[str, set[str]] = {}
    for f in fusions:
        inside[f"{f.rule} {f.node}"] = set().union(*(inside.get(r, {r}) for r in f.replaced))
    return inside


def _bytes(view: GraphView, shapes: dict, value: str) -> int | None:
    shape = shapes.get(value)
    vt = view.type_of(value)
    if shape is None or vt is None or not vt.elem_type:
        return None
    return (
        int(np.prod(shape, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(vt.elem_type).itemsize
    )


def _planes(shapes: dict, value: str) -> bool:
    """Whether a value has image planes (an axis past N and C longer than 1), unknown counting
    as yes: squeeze-excitation's per-channel vectors [N, C, 1, 1] between its two small convs
    do not make it a block."""
    shape = shapes.get(value)
    return shape is None or any(d > 1 for d in shape[2:])


def block_bytes(view: GraphView, shapes: dict, members: set[str]) -> tuple[int, int] | None:
    """(depth first, op by op) bytes of the fused node made of these original nodes, or None
    when it is not a block (no value between two of its convs) or a size is unknown."""
    index = [i for i, n in enumerate(view.nodes) if node_label(n) in members]
    inside = set(index)
    made = {out for i in index for out in view.nodes[i].output if out}
    ends, extra, chained = 0, 0, False
    reads: set[str] = set()
    for value in made:
        readers = [j for j in view.consumers.get(value, ()) if j in inside]
        size = _bytes(view, shapes, value)
        if any(view.nodes[j].op_type == "Conv" for j in readers) and _planes(shapes, value):
            if size is None:
                return None
            chained = True
            extra += size * (1 + len(readers))
        if view.is_graph_output(value) or len(readers) < len(view.consumers.get(value, ())):
            if size is None:
                return None
            ends += size  # an output of the block
    if not chained:
        return None
    for i in index:
        for value in view.nodes[i].input:
            if value and value not in made and view.constant(value) is None:
                reads.add(value)
    for value in reads:
        size = _bytes(view, shapes, value)
        if size is None:
            return None
        ends += size
    return ends, ends + extra


def block_traffic(model: onnx.ModelProto, fusions, shapes: dict, steps: list[dict]) -> dict:
    """The blocks' traffic per run under the plan that ran (the bench's profile rows: a kernel
    step whose tactic is depth_first, fusion.catalog.Tactic), against every block op by op;
    shapes: the original model's value shapes for the run's feeds (flops.inferred_shapes).
    Empty when the model has no block."""
    view = GraphView(model)
    deep = {s["name"] for s in steps if s.get("kind") == "kernel" and s.get("depth_first")}
    blocks = depth_first = 0
    as_run = op_by_op = 0
    inner = {r for f in fusions for r in f.replaced}  # fused nodes a later stage fused again
    for label, members in originals(fusions).items():
        if label in inner:
            continue
        got = block_bytes(view, shapes, members)
        if got is None:
            continue
        first, ops = got
        blocks += 1
        if label in deep:
            depth_first += 1
            as_run += first
        else:
            as_run += ops
        op_by_op += ops
    if not blocks:
        return {}
    return {"blocks": blocks, "depth_first": depth_first, "mb_as_run": as_run / 1e6,
            "mb_op_by_op": op_by_op / 1e6}  # fmt: skip


def describe(traffic: dict) -> str:
    """One line for the report: '4.1 MB (op by op 9.8; 10 of 11 depth first)'."""
    if not traffic:
        return "-"
    return (f"{traffic['mb_as_run']:.1f} MB (op by op {traffic['mb_op_by_op']:.1f}; "
            f"{traffic['depth_first']} of {traffic['blocks']} depth first)")  # fmt: skip
