"""FLOPs of a model: 2 x multiply-adds of its Conv, MatMul, Gemm and LSTM nodes.

Shapes are inferred for the actual inputs (and, where inference cannot follow, taken from one
onnxruntime run on them: inferred_shapes); all runners are credited with the original model's
FLOPs. The heaviest node's GEMM shape ([M, K] x [K, N]; a Conv's im2col shape) is kept for the
SGEMM reference (fusion.bench.sgemm).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from fusion.graph import GraphView, node_label
from fusion.modelfile import shapes_from_a_run


@dataclass
class Flops:
    total: int
    by_op: dict[str, int]
    gemm_shape: tuple[int, int, int] | None  # [M, K] x [K, N] of the heaviest node
    notes: list[str]
    by_node: dict[str, int] = field(default_factory=dict)  # node label -> FLOPs


COUNTED = ("Conv", "MatMul", "Gemm", "LSTM")  # the ops whose FLOPs are counted


def inferred_shapes(
    model: onnx.ModelProto, feeds: dict | None = None, threads: int | None = None
) -> dict[str, list[int]]:
    """Every value's shape that the graph's types work out for these feeds' shapes
    (GraphView's: ONNX shape inference, and the sizes it leaves to Shape arithmetic, as in
    TorchScript's ShuffleNet), initializers included. Given feeds, the inputs and outputs of
    the counted nodes that inference still misses come from one onnxruntime run on them
    (fusion.modelfile.shapes_from_a_run: a TorchScript transformer's MatMuls, whose reshape
    targets are Shape arithmetic on the token ids); other values of unknown or symbolic shape
    are left out. threads: that run's (None: onnxruntime's choice)."""
    view = GraphView(_with_input_shapes(model, feeds or {}))
    shapes = {}
    for name in {*view.producer, *view.graph_inputs, *view.initializers}:
        vt = view.type_of(name)
        if vt is not None and vt.shape is not None and all(isinstance(d, int) for d in vt.shape):
            shapes[name] = list(vt.shape)
    if feeds:
        missing = sorted({v for node in model.graph.node if node.op_type in COUNTED
                          for v in (*node.input, *node.output[:1])
                          if v and v not in shapes})  # fmt: skip
        ran = shapes_from_a_run(model, missing, feeds, threads) if missing else {}
        shapes |= {v: list(shape) for v, (shape, _) in ran.items()}
    return shapes


def count_flops(model: onnx.ModelProto, feeds: dict | None = None,
                shapes: dict | None = None) -> Flops:  # fmt: skip
    """2 x multiply-adds of Conv, MatMul, Gemm and LSTM nodes, on the shapes inferred_shapes
    gives for `feeds` (or `shapes`, when the caller has them already).

    >>> count_flops(conv_stack(blocks=1, channels=8, size=4, batch=1)).total   # 2*8*8*9*16
    18432
    """
    shapes = inferred_shapes(model, feeds) if shapes is None else shapes
    by_op: dict[str, int] = {}
    by_node: dict[str, int] = {}
    best, best_shape, unknown = 0, None, 0
    for node in model.graph.node:
        if node.op_type not in COUNTED:
            continue
        got = _node_flops(node, shapes)
        if got is None:
            unknown += 1
            continue
        flops, gemm = got
        by_op[node.op_type] = by_op.get(node.op_type, 0) + flops
        by_node[node_label(node)] = flops
        if flops > best:
            best, best_shape = flops, gemm
    notes = [f"{unknown} Conv/MatMul/Gemm/LSTM nodes of unknown shape not counted"] * (unknown > 0)
    return Flops(sum(by_op.values()), by_op, best_shape, notes, by_node)


def _node_flops(node, shapes) -> tuple[int, tuple[int, int, int]] | None:
    ins = [shapes.get(v) if v else None for v in node.input]
    out = shapes.get(node.output[0])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv" and ins[1] and out:
        m, cg, *kernel = ins[1]
        k = cg * int(np.prod(kernel))
        pixels = int(np.prod(out)) // m  # N x spatial
        return 2 * m * k * pixels, (m, k, pixels)
    if node.op_type == "MatMul" and ins[0] and ins[1] and out:
        k = ins[0][-1]
        n = ins[1][-1] if len(ins[1]) > 1 else 1
        rows = max(1, int(np.prod(out)) // n)
        return 2 * rows * k * n, (rows, k, n)
    if node.op_type == "Gemm" and ins[0] and out:
        k = ins[0][0] if attrs.get("transA") else ins[0][-1]
        m, n = out
        return 2 * m * k * n, (m, k, n)
    if node.op_type == "LSTM" and ins[0] and ins[2]:
        steps, batch, size = ins[0]
        dirs, gates, hidden = ins[2]
        return 2 * steps * batch * dirs * gates * (size + hidden), (steps * batch, size, gates)
    return None


def _with_input_shapes(model: onnx.ModelProto, feeds: dict) -> onnx.ModelProto:
    """A copy whose graph inputs declare the fed arrays' shapes (so inference gets numbers)."""
    if not feeds:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for vi in copy.graph.input:
        if vi.name in feeds and vi.type.HasField("tensor_type"):
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for d in np.shape(feeds[vi.name]):
                shape.dim.add().dim_value = int(d)
    del copy.graph.value_info[:]  # stale symbolic shapes would win over the inferred ones
    for vi in copy.graph.output:  # so would the outputs' declared ones
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    return copy
