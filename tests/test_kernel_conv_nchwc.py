"""kernels.conv_nchwc (the blocked direct conv with its fused epilogue) and kernels.blocked (the
layout conversions), against onnxruntime running the unfused Conv [+ Add] [+ activation] graph.

Odd shapes on purpose: channel counts that are not multiples of a block (1, 3, 5, 17, 100),
images of width 1, 7, 13, 17, asymmetric pads, pads wider than the kernel, dilations, strides,
groups of whole blocks, batch 2, and every epilogue (activations, a residual before or after).
The tolerance is the rules' (1e-4 relative plus 1e-5 absolute) on outputs of order 1.
"""

import numpy as np
import pytest
from helpers import assert_close, run_ort
from onnx import TensorProto, helper, numpy_helper

from kernels.blocked import block, from_blocked, to_blocked
from kernels.conv_nchwc import (
    conv_nchwc,
    output_shape,
    prepare_conv_nchwc,
    supports,
    tile_options,
)

RTOL, ATOL = 1e-4, 1e-5

node = helper.make_node
# activation name -> ONNX nodes applying it to "t", writing "a" (and its kernel parameters)
ACTS = {
    None: ([], {}),
    "relu": ([node("Relu", ["t"], ["a"])], {}),
    "clip": ([node("Clip", ["t", "lo", "hi"], ["a"])], {"clip_min": -0.5, "clip_max": 0.75}),
    "leaky_relu": ([node("LeakyRelu", ["t"], ["a"], alpha=0.1)], {"alpha": 0.1}),
    "sigmoid": ([node("Sigmoid", ["t"], ["a"])], {}),
    "silu": ([node("Sigmoid", ["t"], ["s"]), node("Mul", ["t", "s"], ["a"])], {}),
    "hard_sigmoid": (
        [node("HardSigmoid", ["t"], ["a"], alpha=0.3, beta=0.4)],
        {"alpha": 0.3, "beta": 0.4},
    ),
    "hard_swish": ([node("HardSwish", ["t"], ["a"])], {}),
    "tanh": ([node("Tanh", ["t"], ["a"])], {}),
    "gelu": (
        [
            node("Div", ["t", "sqrt2"], ["d"]),
            node("Erf", ["d"], ["e"]),
            node("Add", ["e", "one"], ["e1"]),
            node("Mul", ["t", "e1"], ["m"]),
            node("Mul", ["m", "half"], ["a"]),
        ],
        {},
    ),
}


def reference(x, w, b, attrs, activation=None, residual=None, r=None):
    """onnxruntime on Conv, then Add(r) before or after the activation, as the graph says."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs)]
    value = "c"
    if residual == "before":
        nodes.append(helper.make_node("Add", [value, "r"], ["cr"]))
        value = "cr"
    nodes.append(helper.make_node("Identity", [value], ["t"]))
    act_nodes, _ = ACTS[activation]
    nodes += act_nodes if act_nodes else [helper.make_node("Identity", ["t"], ["a"])]
    out = "a"
    if residual == "after":
        nodes.append(helper.make_node("Add", ["a", "r"], ["y"]))
        out = "y"
    f32 = np.float32
    consts = {"w": w, "b": b, "lo": f32(-0.5), "hi": f32(0.75), "sqrt2": f32(np.sqrt(2)),
              "one": f32(1), "half": f32(0.5)}  # fmt: skip
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))]
    feeds = {"x": x}
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, list(r.shape)))
        feeds["r"] = r
    graph = helper.make_graph(
        nodes, "conv", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return run_ort(model, feeds)[0]


def run_blocked(x, w, b, attrs, activation=None, residual=None, r=None, tile=None):
    group = attrs.get("group", 1)
    plan = prepare_conv_nchwc(
        w, b, strides=attrs.get("strides", (1, 1)), pads=attrs.get("pads", (0, 0, 0, 0)),
        dilations=attrs.get("dilations", (1, 1)), group=group, activation=activation,
        residual=residual, tile=tile, **ACTS[activation][1],
    )  # fmt: skip
    xb = to_blocked(x, block=plan.in_block)
    rb = to_blocked(r, block=block()) if residual else None  # the output's block
    yb = conv_nchwc(xb, plan, residual=rb)
    assert yb.shape == output_shape(xb.shape, plan)
    return from_blocked(yb, w.shape[0])


def case(n, c, m, h, w, k, seed=0, group=1, **attrs):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    kh, kw = (k, k) if isinstance(k, int) else k
    wt = rng.standard_normal((m, c // group, kh, kw), dtype=np.float32)
    wt /= np.sqrt(c // group * kh * kw)
    b = rng.standard_normal(m, dtype=np.float32)
    return x, wt, b, {"group": group, **attrs}


SHAPES = [
    # n, c, m, h, w, kernel, attrs
    (1, 3, 8, 13, 17, 3, {"pads": (1, 1, 1, 1)}),
    (2, 5, 17, 7, 7, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    (1, 16, 24, 9, 11, 5, {"pads": (2, 2, 2, 2)}),
    (1, 64, 64, 14, 14, 3, {"pads": (1, 1, 1, 1)}),
    (1, 17, 100, 1, 13, 1, {}),
    (3, 8, 8, 1, 1, 1, {}),
    (1, 3, 64, 23, 23, 7, {"strides": (2, 2), "pads": (3, 3, 3, 3)}),
    (1, 32, 16, 10, 10, 3, {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
    (1, 64, 64, 8, 8, 3, {"pads": (1, 1, 1, 1), "group": 8}),
    (1, 48, 48, 9, 9, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1), "group": 2}),
    (1, 128, 256, 7, 7, 3, {"pads": (1, 1, 1, 1)}),
    (1, 1, 8, 5, 40, 1, {}),
    (2, 96, 32, 6, 30, 1, {"strides": (2, 2)}),
    (1, 24, 24, 12, 12, 3, {"pads": (1, 1, 1, 1), "group": 3}),
    (1, 16, 16, 3, 3, 5, {"pads": (4, 4, 4, 4)}),
    (1, 17, 9, 13, 7, (1, 3), {"pads": (0, 2, 0, 1)}),  # asymmetric pads, a 1x3 kernel
    (1, 12, 40, 1, 17, (1, 5), {"pads": (0, 2, 0, 2)}),  # a Conv1d written as H = 1
    (2, 100, 8, 17, 1, 3, {"pads": (1, 1, 1, 1)}),  # width 1
    # depthwise (group == C == M): its own kernel
    (1, 20, 20, 13, 13, 3, {"pads": (1, 1, 1, 1), "group": 20}),
    (2, 32, 32, 17, 17, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1), "group": 32}),
    (1, 5, 5, 7, 30, 5, {"pads": (2, 2, 2, 2), "group": 5}),
    (1, 16, 16, 9, 9, 5, {"strides": (2, 2), "pads": (2, 1, 2, 3), "group": 16}),
    (1, 8, 8, 10, 10, 3, {"pads": (2, 2, 2, 2), "dilations": (2, 2), "group": 8}),
    (1, 24, 24, 1, 1, 3, {"pads": (1, 1, 1, 1), "group": 24}),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[:6]}{s[6]}")
def test_against_onnxruntime(shape):
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, **attrs)
    assert_close(
        run_blocked(x, wt, b, attrs, "relu"), reference(x, wt, b, attrs, "relu"), RTOL, ATOL
    )


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("residual", [None, "before", "after"])
@pytest.mark.parametrize("depthwise", [False, True], ids=["direct", "depthwise"])
def test_every_epilogue(activation, residual, depthwise):
    c, group = (20, 20) if depthwise else (12, 1)
    x, wt, b, attrs = case(2, c, 20, 9, 7, 3, seed=3, group=group, pads=(1, 1, 1, 1))
    r = np.random.default_rng(4).standard_normal((2, 20, 9, 7), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, activation, residual, r)
    assert_close(got, reference(x, wt, b, attrs, activation, residual, r), RTOL, ATOL)


@pytest.mark.parametrize("width", [6, 7, 9])
def test_k_cut_into_chunks_when_weights_pass_half_of_l2(width):
    # 512 input channels, 3x3: 590 KB of packed weights per group of 4 output blocks is past
    # half of any L2 here, so K is cut into chunks and the accumulators wait in the per-item
    # buffer; widths 6 and 7 leave an interior remainder (an overlapping tile), 9 none.
    x, wt, b, attrs = case(1, 512, 40, 5, width, 3, seed=5, pads=(1, 1, 1, 1))
    r = np.random.default_rng(8).standard_normal((1, 40, 5, width), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, "silu", "before", r)
    assert_close(got, reference(x, wt, b, attrs, "silu", "before", r), RTOL, ATOL)


@pytest.mark.parametrize("c", [1, 3, 5, 8, 17, 100])
@pytest.mark.parametrize("size", [(1, 1), (7, 13)])
def test_layout_round_trip(c, size):
    x = np.random.default_rng(c).standard_normal((2, c, *size), dtype=np.float32)
    xb = to_blocked(x)
    assert xb.shape[-1] == (block() if c >= block() else c)
    assert np.array_equal(from_blocked(xb, c), x)
    assert not xb[:, -1, ..., c % xb.shape[-1] or xb.shape[-1] :].any()  # padding is zero
    assert np.array_equal(from_blocked(to_blocked(x, block=8), c), x)


def test_nan_and_inf_pass_through_like_onnxruntime():
    x, wt, b, attrs = case(1, 8, 8, 6, 6, 3, pads=(1, 1, 1, 1))
    x[0, 2, 3, 3], x[0, 5, 0, 0] = np.nan, np.inf
    got = run_blocked(x, wt, b, attrs, "relu")
    want = reference(x, wt, b, attrs, "relu")
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert_close(got, want, RTOL, ATOL)


def test_refusals_say_why():
    assert "whole blocks of 8" in supports((12, 3, 3, 3), group=4)
    assert supports((16, 8, 3, 3), group=2) is None
    with pytest.raises(ValueError, match="whole blocks"):
        prepare_conv_nchwc(np.ones((12, 3, 3, 3), np.float32), group=4)
    plan = prepare_conv_nchwc(np.ones((8, 16, 3, 3), np.float32))
    with pytest.raises(ValueError, match="reads 16 channels"):
        conv_nchwc(to_blocked(np.ones((1, 8, 5, 5), np.float32)), plan)
    with pytest.raises(ValueError, match="empty"):
        conv_nchwc(to_blocked(np.ones((1, 16, 2, 2), np.float32)), plan)


@pytest.mark.parametrize("group", [1, 8], ids=["direct", "depthwise"])
def test_batch_0_gives_an_empty_output(group):
    x, wt, b, attrs = case(1, 8, 8, 6, 6, 3, group=group, pads=(1, 1, 1, 1))
    got = run_blocked(x[:0], wt, b, attrs, "relu")
    assert got.shape == (0, 8, 6, 6)


@pytest.mark.parametrize("tile", [4, 2, 1])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 12, 24, 5, 17, 3, {"pads": (1, 1, 1, 1)}),  # interior 15: whole tiles + an overlap
        (2, 16, 40, 3, 30, 1, {}),  # 1x1: every column interior
        (1, 8, 8, 4, 5, 3, {"pads": (1, 1, 1, 1)}),  # a row narrower than most tiles
    ],
    ids=lambda s: f"{s[:6]}" if isinstance(s, tuple) else str(s),
)
def test_every_register_tile(shape, tile):
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, seed=6, **attrs)
    r = np.random.default_rng(7).standard_normal((n, m, h, w), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, "sigmoid", "after", r, tile=tile)
    assert_close(got, reference(x, wt, b, attrs, "sigmoid", "after", r), RTOL, ATOL)


def test_tile_options():
    assert tile_options((64, 64, 3, 3)) == (4,)  # 8 blocks: no tile computes padding
    assert tile_options((24, 16, 1, 1)) == (4, 1)  # 3 blocks: 3x4 padded, or 12x1 tight
    assert tile_options((8, 16, 1, 1)) == (1,)
    assert tile_options((32, 1, 3, 3), group=32) == (1,)  # depthwise: its own kernel
    with pytest.raises(ValueError, match="tile"):
        prepare_conv_nchwc(np.ones((8, 8, 1, 1), np.float32), tile=3)
