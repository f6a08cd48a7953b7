"""Shape computations a fused node takes in with it (Rule.absorb_shapes).

TorchScript exports compute a Reshape's target from the Shape of a value, sometimes a value
the match computes itself (GPT-2's attention reads Shape(Split output) to reshape it). Such a
Shape, and the integer arithmetic below it (Gather, Unsqueeze, Concat, ...), would make the
match's inner value escape. When everything that arithmetic computes is read only by the match
(and by itself), it joins the match: the fused node's body computes it, the kernel ignores it.
"""

from __future__ import annotations

from onnx import TensorProto

from fusion.graph import GraphView

SHAPE_OPS = frozenset({
    "Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Div", "Mul", "Add",
    "Sub", "Reshape", "ConstantOfShape", "Equal", "Where", "Expand", "Range", "Max", "Min", "Neg",
    "Identity",
})  # fmt: skip
INTEGER = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL})


def absorb_shapes(view: GraphView, nodes: list[int], outputs) -> tuple[list[int], set, list[str]]:
    """(nodes with the shape computations that read them, the values those compute, the
    non-constant values they read from outside, in graph order). Every Shape of a value the
    match computes starts one; the integer nodes below it join while each is a SHAPE_OPS node
    with integer outputs that are not graph outputs. If any of them falls outside that, none
    joins (the match's escape check then names the reader)."""
    inside, kept = set(nodes), set(outputs)
    stack = [
        user
        for i in nodes
        for value in view.nodes[i].output
        if value and value not in kept
        for user in view.consumers.get(value, ())
        if user not in inside and view.nodes[user].op_type == "Shape"
    ]
    cone: set[int] = set()
    while stack:
        index = stack.pop()
        if index in cone:
            continue
        node = view.nodes[index]
        if node.op_type not in SHAPE_OPS or node.domain not in ("", "ai.onnx"):
            return nodes, set(), []
        for value in node.output:
            vt = view.type_of(value) if value else None
            if value and (vt is None or vt.elem_type not in INTEGER or view.is_graph_output(value)):
                return nodes, set(), []
            stack += [u for u in view.consumers.get(value, ()) if u not in inside and u not in cone]
        cone.add(index)
    computed = {value for i in cone for value in view.nodes[i].output if value}
    produced = computed | {value for i in nodes for value in view.nodes[i].output if value}
    reads = []
    for i in sorted(cone):
        for value in view.nodes[i].input:
            if (
                value
                and value not in produced
                and value not in reads
                and view.constant(value) is None
            ):
                reads.append(value)
    return sorted(inside | cone), computed, reads
