"""Keras CNNs as tf2onnx writes them (tests/fixtures/export_keras_cnn.py: MobileNetV2's and
ResNet50's blocks at a few channels, random weights): the input's NHWC -> NCHW Transpose, the
ZeroPadding2D Pads before convs and the max pool, and the head (GlobalAveragePool, Squeeze,
MatMul, Add, Softmax) all join fused nodes, so no onnxruntime island is left; outputs against
onnxruntime on the export, on each tactic; each absorbed form's near-miss says why."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, conv_block, near_miss, random_feeds, run_ort

import fusion
from fusion.runtime import Session

FIXTURES = Path(__file__).parent / "fixtures"
CATALOG = fusion.default_catalog()
EXPORTS = {
    "keras_mobilenet_mini.onnx": {"InvertedResidual": 4, "ConvBiasRelu": 2, "LinearAct": 1,
                                  "GlobalAvgPoolFlatten": 1},
    "keras_resnet_mini.onnx": {"ConvBiasRelu": 12, "MaxPool2D": 1, "LinearAct": 1,
                               "GlobalAvgPoolFlatten": 1},
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXPORTS))
def test_keras_export_fuses_whole_and_matches_onnxruntime(name):
    model = onnx.load(FIXTURES / name)
    assert model.graph.node[0].op_type == "Transpose"  # NHWC in, as Keras takes it
    result = fusion.rewrite(model, CATALOG)
    assert result.counts() == EXPORTS[name]
    onnx.checker.check_model(result.model, full_check=True)
    coverage = fusion.coverage(model, result=result).summary()
    assert coverage.endswith("onnxruntime islands: 0"), coverage
    for tactic in ("kernel", "nchw"):
        session = Session(result.model, threads=2, catalog=CATALOG, tactics=tactic)
        assert not session.islands
        for batch in (1, 3):
            feeds = random_feeds(model, batch=batch, seed=batch)
            (want,) = run_ort(model, feeds)
            (got,) = session.run(None, feeds)
            assert_close(got, want, rtol=1e-4, atol=1e-5, what=f"{tactic} batch {batch}")


def test_the_stem_reads_nhwc_without_a_copy_on_the_blocked_layout():
    """Blocked, an NHWC image of 3 channels is [N, 1, H, W, 3] as it is: the stem's blocked
    tactic reads the graph input with no conversion step before it."""
    result = fusion.rewrite(onnx.load(FIXTURES / "keras_mobilenet_mini.onnx"), CATALOG)
    session = Session(result.model, threads=2, catalog=CATALOG, tactics="kernel")
    first = session.steps[0]
    assert first.kind == "kernel" and first.name.startswith("ConvBiasRelu")


# ---- the forms, one at a time, and their near-misses ---------------------------------------
def check(model, fused, batches=(1, 2)):
    result = fusion.rewrite(model, CATALOG)
    assert sorted(result.counts()) == sorted(fused), result.explain()
    coverage = fusion.coverage(model, result=result).summary()
    assert coverage.endswith("onnxruntime islands: 0"), coverage
    for tactic in ("kernel", "nchw"):
        session = Session(result.model, threads=2, catalog=CATALOG, tactics=tactic)
        for batch in batches:
            feeds = random_feeds(model, batch=batch, seed=batch)
            (want,) = run_ort(model, feeds)
            assert_close(session.run(None, feeds)[0], want, 1e-4, 1e-5, what=tactic)


def pad(g, x, pads, value=None, mode="constant"):
    inputs = [x, g.const(np.array(pads, np.int64))]
    if value is not None:
        inputs.append(g.const(np.array(value, np.float32)))
    return g.node("Pad", inputs, mode=mode, name="/pad")


@pytest.mark.parametrize("conv_pads", [[0, 0, 0, 0], [1, 0, 1, 2]], ids=["valid", "own-pads"])
def test_a_zero_pad_before_a_conv_becomes_its_padding(conv_pads):
    g = GraphBuilder(seed=2)
    x = pad(g, "x", [0, 0, 0, 1, 0, 0, 1, 2])  # bottom 1, left 1, right 2: asymmetric
    y = conv_block(g, x, 5, 7, k=3, strides=[2, 2], pads=conv_pads)
    check(g.model({"x": ["N", 5, 9, 8]}, [y]), ["ConvBiasRelu"])


@pytest.mark.parametrize(
    "pads, value, mode, reason",
    [
        ([0, 0, 1, 1, 0, 0, 1, 1], 0.5, "constant", "pads with constant 0.5; a conv's padding"),
        ([0, 0, 1, 1, 0, 0, 1, 1], None, "reflect", "pads with reflect"),
        ([0, 1, 0, 0, 0, 0, 0, 0], None, "constant", "only the spatial axes of a 4-D x"),
    ],
    ids=["value", "reflect", "channels"],
)
def test_a_pad_that_is_not_zeros_around_the_planes_stays_out(pads, value, mode, reason):
    g = GraphBuilder(seed=3)
    p = pad(g, "x", pads, value, mode)
    y = conv_block(g, p, 4, 6, k=3)
    text = near_miss(g.model({"x": ["N", 4, 6, 6]}, [y]), None, reason, fused=["ConvBiasRelu"])
    assert "Pad /pad" in text


def test_a_transpose_that_is_not_nhwc_to_nchw_stays_out():
    g = GraphBuilder(seed=4)
    t = g.node("Transpose", ["x"], perm=[0, 2, 1, 3], name="/t")
    y = conv_block(g, t, 4, 6, k=1)
    near_miss(g.model({"x": ["N", 4, 5, 5]}, [y]), None,
              "Transpose /t with perm [0, 2, 1, 3], not NHWC -> NCHW",
              fused=["ConvBiasRelu"])  # fmt: skip


@pytest.mark.parametrize("channels", [3, 20])  # at most a block: read as is; more: converted
def test_an_nhwc_input_joins_its_conv(channels):
    g = GraphBuilder(seed=channels)
    t = g.node("Transpose", ["x"], perm=[0, 3, 1, 2])
    y = conv_block(g, t, channels, 16, k=3, strides=[2, 2], pads=[1, 1, 1, 1])
    check(g.model({"x": ["N", 11, 10, channels]}, [y]), ["ConvBiasRelu"])


def test_a_zero_pad_before_a_max_pool_on_signed_values():
    """Pad's zeros win over negative inputs at the borders: the fused pool pads with -inf and
    takes at least 0 wherever a window holds a padded place."""
    g = GraphBuilder(seed=5)
    p = pad(g, "x", [0, 0, 1, 0, 0, 0, 2, 1])
    y = g.node("MaxPool", [p], kernel_shape=[3, 3], strides=[2, 2])
    model = g.model({"x": ["N", 16, 9, 10]}, [y])
    result = fusion.rewrite(model, CATALOG)
    assert result.counts() == {"MaxPool2D": 1}
    x = -np.abs(np.random.default_rng(0).standard_normal((2, 16, 9, 10))).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    assert (want == 0).any() and (want < 0).any()
    for tactic in ("kernel", "nchw"):  # blocked (16 channels known) and NCHW
        session = Session(result.model, threads=2, catalog=CATALOG, tactics=tactic)
        assert_close(session.run(None, {"x": x})[0], want, 0.0, 0.0, what=tactic)


def test_a_pad_before_a_max_pool_with_pads_of_its_own_stays_out():
    g = GraphBuilder(seed=6)
    p = pad(g, "x", [0, 0, 1, 1, 0, 0, 1, 1])
    y = g.node("MaxPool", [p], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="/pool")
    # the pool fuses alone, the Pad stays out
    near_miss(g.model({"x": ["N", 8, 6, 6]}, [y]), "MaxPool2D",
              "before a MaxPool with pads [1, 1, 1, 1] or ceil_mode",
              fused=["MaxPool2D"])  # fmt: skip


def head(g, x, channels, squeeze_axes=(2, 3), softmax_axis=-1):
    m = g.node("GlobalAveragePool", [x])
    s = g.node("Squeeze", [m, g.const(np.array(squeeze_axes, np.int64))], name="/squeeze")
    y = g.node("Add", [g.node("MatMul", [s, g.weight(channels, 10)]), g.weight(10)])
    return g.node("Softmax", [y], axis=softmax_axis, name="/softmax")


def test_the_keras_head_fuses_into_the_pool_and_the_linear_layer():
    g = GraphBuilder(seed=7)
    y = head(g, conv_block(g, "x", 3, 24, k=3, pads=[1, 1, 1, 1]), 24)
    check(g.model({"x": ["N", 3, 8, 8]}, [y]),
          ["ConvBiasRelu", "GlobalAvgPoolFlatten", "LinearAct"])  # fmt: skip


def test_a_squeeze_of_other_axes_or_a_softmax_over_the_batch_is_not_the_head():
    g = GraphBuilder(seed=8)
    m = g.node("GlobalAveragePool", ["x"])
    s = g.node("Squeeze", [m, g.const(np.array([3], np.int64))], name="/squeeze")
    near_miss(g.model({"x": ["N", 6, 4, 4]}, [s]), "GlobalAvgPoolFlatten",
              "Squeeze /squeeze of axes [3]; the head squeezes the spatial axes")  # fmt: skip
    g = GraphBuilder(seed=9)
    y = head(g, "x", 6, softmax_axis=0)
    near_miss(g.model({"x": ["N", 6, 4, 4]}, [y]), "LinearAct",
              "Softmax /softmax on axis 0, not over the classes",
              fused=["GlobalAvgPoolFlatten", "LinearAct"])  # fmt: skip
