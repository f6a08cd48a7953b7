"""GraphView's types where ONNX shape inference gives up: sizes computed from Shape (TorchScript's
chunk as two Slices ending at Shape(x)[1] // 2, Reshape targets assembled from Shape entries)
are read from the graph's own arithmetic and carried on to the ops below; what the graph does
not determine stays unknown."""

from __future__ import annotations

import numpy as np
import onnx
from helpers import GraphBuilder

from fusion.graph import GraphView
from fusion.shapes import unknown


def scalar_dim(gb, x, axis):
    """Shape(x)[axis] as TorchScript writes it: a Gather with a scalar index."""
    return gb.node("Gather", [gb.node("Shape", [x]), gb.const(np.array(axis, np.int64))], axis=0)


def inferred_by_onnx(model, value):
    graph = onnx.shape_inference.infer_shapes(model).graph
    for vi in list(graph.value_info) + list(graph.output):
        if vi.name == value:
            dims = vi.type.tensor_type.shape.dim
            return tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims)
    return None


def chunk_model(channels):
    """x [N, C, 5, 5] cut in two halves along C by Slices whose bounds come from Shape(x)[1]
    (TorchScript's chunk), each half then through a Relu."""
    gb = GraphBuilder(opset=17)
    one, two = gb.const(np.array([1], np.int64)), gb.const(np.array([2], np.int64))
    c = gb.node("Unsqueeze", [scalar_dim(gb, "x", 1), gb.const(np.array([0], np.int64))])
    half = gb.node("Div", [gb.node("Add", [c, one]), two])
    zero = gb.const(np.array([0], np.int64))
    first = gb.node("Slice", ["x", zero, gb.node("Mul", [half, one]), one])
    second = gb.node("Slice", ["x", half, gb.node("Mul", [half, two]), one])
    outs = [gb.node("Relu", [first]), gb.node("Relu", [second])]
    return gb.model({"x": ["N", channels, 5, 5]}, outs), outs


def test_slices_with_computed_bounds_have_their_sizes():
    model, (a, b) = chunk_model(6)
    assert not isinstance(inferred_by_onnx(model, a)[1], int)  # what the test is about
    view = GraphView(model)
    assert view.type_of(a).shape == ("N", 3, 5, 5)
    assert view.type_of(b).shape == ("N", 3, 5, 5)


def test_odd_channels_split_as_the_slices_say():
    model, (a, b) = chunk_model(7)  # (7 + 1) // 2 = 4, then the 3 left
    view = GraphView(model)
    assert view.type_of(a).shape == ("N", 4, 5, 5)
    assert view.type_of(b).shape == ("N", 3, 5, 5)


def test_reshape_target_from_shape_entries():
    """[N, 2, C / 2, -1] from x's Shape: C/2 and the -1 are known, N stays the input's name,
    and a Transpose and a Relu below it get the sizes too."""
    gb = GraphBuilder(opset=17)
    axes = gb.const(np.array([0], np.int64))
    n = gb.node("Unsqueeze", [scalar_dim(gb, "x", 0), axes])
    c = gb.node("Unsqueeze", [gb.node("Div", [scalar_dim(gb, "x", 1), gb.const(np.array(2))]),
                              axes])  # fmt: skip
    target = gb.node("Concat", [n, gb.const(np.array([2], np.int64)), c,
                                gb.const(np.array([-1], np.int64))], axis=0)  # fmt: skip
    y = gb.node("Reshape", ["x", target])
    z = gb.node("Relu", [gb.node("Transpose", [y], perm=[0, 2, 1, 3])])
    model = gb.model({"x": ["N", 6, 5, 5]}, [z])
    assert not isinstance(inferred_by_onnx(model, y)[2], int)
    view = GraphView(model)
    assert view.type_of(y).shape == ("N", 2, 3, 25)
    assert view.type_of(z).shape == ("N", 3, 2, 25)


def test_nothing_is_made_up():
    """A channel count the graph does not fix (a symbolic C) stays unknown."""
    model, (a, _) = chunk_model(6)
    dim = model.graph.input[0].type.tensor_type.shape.dim[1]
    dim.Clear()
    dim.dim_param = "C"
    del model.graph.value_info[:]
    view = GraphView(model)
    shape = view.type_of(a).shape
    assert shape is None or not isinstance(shape[1], int)


def test_float_arithmetic_on_a_size_is_not_followed():
    """x[:, :int(x.size(1) * 0.5)] traced: Cast to float, Mul 0.5, Cast back. Not an integer
    computation: the size stays unknown rather than a truncated guess (it was 0)."""
    gb = GraphBuilder(opset=17)
    c = gb.node("Cast", [scalar_dim(gb, "x", 1)], to=onnx.TensorProto.FLOAT)
    half = gb.node("Mul", [c, gb.const(np.array(0.5, np.float32))])
    end = gb.node("Unsqueeze", [gb.node("Cast", [half], to=onnx.TensorProto.INT64),
                                gb.const(np.array([0], np.int64))])  # fmt: skip
    one = gb.const(np.array([1], np.int64))
    y = gb.node("Relu", [gb.node("Slice", ["x", gb.const(np.array([0], np.int64)), end, one])])
    view = GraphView(gb.model({"x": ["N", 8, 4, 4]}, [y]))
    shape = view.type_of(y).shape
    assert shape is None or not isinstance(shape[1], int)


def test_integer_division_rounds_toward_zero():
    from fusion.shapes import _div

    assert [_div(7, 2), _div(-7, 2), _div(7, -2), _div(-7, -2), _div(1, 0)] == [3, -3, -3, 3, None]


def test_a_declared_negative_size_is_unknown_not_an_error():
    model, (a, _) = chunk_model(6)
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_value = -1
    view = GraphView(model)
    assert view.type_of(a).shape[1] == 3  # the channels still follow


def test_a_slice_that_is_a_graph_output_gets_its_size_in_one_round(monkeypatch):
    """ONNX takes an output's type from its declaration, not from value_info hints: the
    size is set directly, and the rounds stop when nothing changes (they ran all 64)."""
    import fusion.graph

    gb = GraphBuilder(opset=17)
    c = gb.node("Unsqueeze", [scalar_dim(gb, "x", 1), gb.const(np.array([0], np.int64))])
    half = gb.node("Div", [c, gb.const(np.array([2], np.int64))])
    one = gb.const(np.array([1], np.int64))
    y = gb.node("Slice", ["x", gb.const(np.array([0], np.int64)), half, one])
    model = gb.model({"x": ["N", 6, 5, 5]}, [y])
    calls = []
    real = fusion.graph.refine_types

    def counting(view, types, infer):
        return real(view, types, lambda dims: calls.append(1) or infer(dims))

    monkeypatch.setattr(fusion.graph, "refine_types", counting)
    assert GraphView(model).type_of(y).shape == ("N", 3, 5, 5)
    assert len(calls) <= 2


def residual_model():
    """x [N, 8, H, W] with H and W symbolic: a stride-2 conv, then two 'same' 3x3 convs on one
    path and a 1x1 on the other, added (a ResNet block after its downsampling), and a max pool
    with ceil_mode below."""
    gb = GraphBuilder(opset=17)
    rng = np.random.default_rng(0)

    def conv(x, k, s=1, pad=0):
        w = gb.const(rng.standard_normal((8, 8, k, k)).astype(np.float32))
        return gb.node("Conv", [x, w], kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4)

    down = gb.node("Relu", [conv("x", 3, 2, 1)])
    path = conv(gb.node("Relu", [conv(down, 3, 1, 1)]), 3, 1, 1)
    total = gb.node("Add", [path, conv(down, 1)])
    pool = gb.node("MaxPool", [total], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    return gb.model({"x": ["N", 8, "H", "W"]}, [pool]), (down, path, total, pool)


def test_windows_name_the_sizes_of_symbolic_planes():
    """ONNX names each conv output's H and W afresh (unk__N); the window's arithmetic names
    them instead, the same name for the same arithmetic, so the Add's two inputs are provably
    one shape and the rules that absorb a residual Add can."""
    model, (down, path, total, pool) = residual_model()
    assert inferred_by_onnx(model, path)[2] != inferred_by_onnx(model, down)[2]
    view = GraphView(model)
    h, w = view.type_of(down).shape[2:]
    assert (h, w) == ("(H+0)/2", "(W+0)/2")  # (H + 2 - 3 + 1) / 2, floored
    assert view.type_of(path).shape == view.type_of(total).shape == ("N", 8, h, w)
    assert view.type_of(pool).shape[2:] == (f"({h}-2)/2^", f"({w}-2)/2^")  # ceil_mode


def test_symbolic_planes_keep_their_residual_fusion():
    import fusion

    model, _ = residual_model()
    fused = fusion.rewrite(model).model
    ops = [n.op_type for n in fused.graph.node]
    assert "Add" not in ops and "Conv" not in ops  # the Add inside a fused conv


def test_deep_symbolic_planes_are_named_in_few_rounds(monkeypatch):
    """70 residual blocks of 'same' convs on a symbolic H, W (deeper than ResNet-101's 33): the
    window names are carried on through the Relus and Adds within a round, so the last block's
    Add is still one shape (one conv deeper per round ran out of rounds at 64, and each round
    is ONNX's inference of the whole graph)."""
    import fusion.graph

    gb = GraphBuilder(opset=17)
    rng = np.random.default_rng(0)
    x = gb.node("Relu", ["x"])
    scale = gb.const(np.ones((4, 1, 1), np.float32))
    for _ in range(70):
        w = gb.const(rng.standard_normal((4, 4, 3, 3)).astype(np.float32))
        y = gb.node("Mul", [gb.node("Conv", [x, w], kernel_shape=[3, 3], pads=[1] * 4), scale])
        x = gb.node("Add", [gb.node("Relu", [y]), x])
    model = gb.model({"x": ["N", 4, "H", "W"]}, [x])
    calls = []
    real = fusion.graph.refine_types

    def counting(view, types, infer):
        return real(view, types, lambda dims: calls.append(1) or infer(dims))

    monkeypatch.setattr(fusion.graph, "refine_types", counting)
    assert GraphView(model).type_of(x).shape == ("N", 4, "H", "W")
    assert len(calls) <= 2


def test_elementwise_names_only_what_broadcasting_fixes():
    """An Add of two planes named differently (H and W) leaves the output's size unknown: a
    name is never made up, and broadcasting proves neither."""
    gb = GraphBuilder(opset=17)
    w = gb.const(np.ones((2, 2, 1, 1), np.float32))
    a = gb.node("Conv", ["x", w], kernel_shape=[1, 1], strides=[2, 2])
    b = gb.node("Conv", ["y", w], kernel_shape=[1, 1], strides=[2, 2])
    total = gb.node("Add", [a, b])
    model = gb.model({"x": ["N", 2, "H", "H"], "y": ["N", 2, "W", "W"]}, [total])
    view = GraphView(model)
    assert view.type_of(a).shape[2] == "(H+0)/2" and view.type_of(b).shape[2] == "(W+0)/2"
    assert unknown(view.type_of(total).shape[2])
