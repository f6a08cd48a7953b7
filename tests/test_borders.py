"""Per-node choices revised for the conversions at their borders (fusion/runtime/borders.py): a
node between two blocked ones takes its blocked tactic when the two conversions its NCHW
tactic needs cost more than the time it saves, and keeps the NCHW one when they do not."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from fusion.catalog import Tactic
from fusion.graph import GraphView
from fusion.runtime.borders import NCHW, reads_and_writes, revise
from fusion.runtime.tactics import ONNXRUNTIME

SHAPE = (1, 24, 56, 56)
BLOCKED = Tactic("blocked", print, blocked_inputs=(0,), in_blocks=(16,), blocked_outputs=(0,),
                 out_channels=(24,))  # fmt: skip
PLAIN = Tactic("nchw", print)


def chain(n: int = 3) -> GraphView:
    """x -> node0 -> v0 -> node1 -> v1 ... -> y, every node a fused one."""
    names = ["x", *(f"v{k}" for k in range(n - 1)), "y"]
    nodes = [helper.make_node(f"Op{k}", [names[k]], [names[k + 1]], domain="fusion", name=f"n{k}")
             for k in range(n)]  # fmt: skip
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)])  # fmt: skip
    return GraphView(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def converting(cost: float):
    seen = []

    def times(shape, block):
        seen.append((shape, block))
        return cost, cost

    return times, seen


def run(view, middle: dict, cost: float, first=BLOCKED):
    """Outer nodes blocked (1 us each), the middle one timed as `middle`, starting from the
    middle's fastest."""
    times = {0: {"blocked": 1e-6, ONNXRUNTIME: 1.0}, 1: dict(middle),
             2: {"blocked": 1e-6, ONNXRUNTIME: 1.0}}  # fmt: skip
    options = {0: [BLOCKED, None], 1: [BLOCKED, PLAIN, None], 2: [BLOCKED, None]}
    fastest = min(middle, key=middle.get)
    choices = {0: first, 1: {"blocked": BLOCKED, "nchw": PLAIN}.get(fastest), 2: BLOCKED}
    shapes = {"x": SHAPE, "v0": SHAPE, "v1": SHAPE, "y": SHAPE}
    convert, seen = converting(cost)
    return revise(view, choices, options, times, shapes, 16, convert), seen


def test_a_node_between_blocked_ones_stays_blocked_when_conversions_cost_more():
    view = chain()
    got, seen = run(view, {"blocked": 12e-6, "nchw": 10e-6, ONNXRUNTIME: 1.0}, cost=50e-6)
    assert got[1] is BLOCKED  # 12 us beats 10 us + two 50 us conversions
    assert seen and all(shape == SHAPE for shape, _ in seen)


def test_a_much_faster_nchw_tactic_keeps_its_conversions():
    got, _ = run(chain(), {"blocked": 500e-6, "nchw": 10e-6, ONNXRUNTIME: 1.0}, cost=50e-6)
    assert got[1] is PLAIN


def test_free_conversions_change_nothing():
    got, _ = run(chain(), {"blocked": 12e-6, "nchw": 10e-6, ONNXRUNTIME: 1.0}, cost=0.0)
    assert got[1] is PLAIN


def test_a_node_may_go_to_its_body_or_leave_it():
    """The body (None) reads and writes NCHW like any plain tactic: between blocked nodes it
    is left for the blocked tactic when the conversions outweigh what the body saves."""
    view = chain()
    got, _ = run(view, {"blocked": 20e-6, "nchw": 1.0, ONNXRUNTIME: 15e-6}, cost=50e-6)
    assert got[1] is BLOCKED
    got, _ = run(view, {"blocked": 500e-6, "nchw": 1.0, ONNXRUNTIME: 15e-6}, cost=50e-6)
    assert got[1] is None


def test_forms_of_a_tactic():
    node = onnx.helper.make_node("Op", ["a", "w"], ["b"], domain="fusion")
    assert reads_and_writes(node, BLOCKED, 16) == ({"a": {16}, "w": {NCHW}}, {"b": 16})
    assert reads_and_writes(node, None, 16) == ({"a": {NCHW}, "w": {NCHW}}, {"b": NCHW})
    residual = Tactic("nchw-in", print, blocked_inputs=(1,), in_blocks=(16,),
                      blocked_outputs=(0,), out_channels=(8,))  # fmt: skip
    twice = onnx.helper.make_node("Op", ["x", "x"], ["y"], domain="fusion")  # conv(x) + x
    assert reads_and_writes(twice, residual, 16)[0] == {"x": {NCHW, 16}}


def test_two_nodes_that_must_move_together():
    """A stem that can write blocked (reading NCHW) and a pool after it, both fastest in NCHW
    alone, before a blocked-only node: either moving alone adds a conversion, both moving
    removes one. The walk from every node's fastest blocked tactic finds it."""
    stem = Tactic("stem", print, blocked_outputs=(0,), out_channels=(24,))
    view = chain()
    times = {0: {"nchw": 10e-6, "stem": 12e-6, ONNXRUNTIME: 1.0},
             1: {"nchw": 10e-6, "blocked": 12e-6, ONNXRUNTIME: 1.0},
             2: {"blocked": 1e-6, ONNXRUNTIME: 1.0}}  # fmt: skip
    options = {0: [stem, PLAIN, None], 1: [BLOCKED, PLAIN, None], 2: [BLOCKED, None]}
    choices = {0: PLAIN, 1: PLAIN, 2: BLOCKED}
    shapes = {"x": SHAPE, "v0": SHAPE, "v1": SHAPE, "y": SHAPE}
    convert, _ = converting(50e-6)
    got = revise(view, choices, options, times, shapes, 16, convert)
    assert got == {0: stem, 1: BLOCKED, 2: BLOCKED}
    cheap, _ = converting(0.0)  # free conversions: the fastest alone stay
    assert revise(view, choices, options, times, shapes, 16, cheap) == choices
