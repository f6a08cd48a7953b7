"""SpatialMean: a ReduceMean over the trailing spatial axes (a Conv1d classifier's mean over
time, a global average pool written as ReduceMean) fuses and matches onnxruntime, NCHW and
blocked, keepdims 0 and 1, axes as attribute (opset 17) or input (opset 18); a ReduceMean over
other axes does not fuse and says why."""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, conv_block, fused_ops, near_miss, run_ort

import fusion
from fusion.runtime import Session

CATALOG = fusion.default_catalog()


def mean_model(shape, axes, keepdims, opset, conv=False):
    """x -> (a conv, 1-D or 2-D) -> ReduceMean(axes, keepdims), input [N, *shape[1:]]."""
    g = GraphBuilder(opset=opset)
    x = "x"
    if conv:
        c = shape[1]
        w = g.weight(c, c, *([3] * (len(shape) - 2)))
        x = g.node("Relu", [g.node("Conv", [x, w], pads=[1, 1] * (len(shape) - 2))])
    if opset >= 18:
        y = g.node("ReduceMean", [x, g.const(np.array(axes, np.int64))], keepdims=keepdims)
    else:
        y = g.node("ReduceMean", [x], axes=list(axes), keepdims=keepdims)
    return g.model({"x": ["N", *shape[1:]]}, [y])


def check(model, batch, tactic, ops):
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ops, result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    dims = [d.dim_value or batch for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(1).standard_normal(dims).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics=tactic)
    (got,) = session.run(None, {"x": x})
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    return session


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize(("shape", "axes"), [((1, 1, 7), [2]), ((1, 17, 13), [-1]),
                                             ((1, 5, 1), [2])])  # fmt: skip
def test_mean_over_time_matches_onnxruntime(shape, axes, batch, keepdims, opset):
    check(mean_model(shape, axes, keepdims, opset), batch, "nchw", ["SpatialMean"])


@pytest.mark.parametrize("tactic", ["blocked", "nchw"])
@pytest.mark.parametrize("batch", [0, 2])
@pytest.mark.parametrize(("shape", "axes"), [((1, 3, 7, 13), [2, 3]), ((1, 17, 13, 1), [-1, -2]),
                                             ((1, 24, 1, 1), [3, 2])])  # fmt: skip
def test_mean_over_plane_keepdims_matches_onnxruntime(shape, axes, batch, tactic):
    session = check(mean_model(shape, axes, 1, 18), batch, tactic, ["SpatialMean"])
    assert list(session.choices.values()) == [tactic]


@pytest.mark.parametrize("opset", [17, 18])
def test_conv1d_classifier_mean_leaves_no_island(opset):
    """Conv1d + ReLU, then the mean over time: both fused, no onnxruntime node left."""
    model = mean_model((1, 5, 13), [2], 0, opset, conv=True)
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ["ConvBiasRelu", "SpatialMean"], result.explain()
    assert all(n.domain != "" for n in result.model.graph.node)
    x = np.random.default_rng(2).standard_normal((3, 5, 13)).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics="kernel")
    assert_close(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_global_average_pool_head_still_its_own_rule():
    g = GraphBuilder(opset=18)
    x = conv_block(g, "x", 3, 6, k=1)
    y = g.node("ReduceMean", [x, g.const(np.array([2, 3], np.int64))], keepdims=0)
    result = fusion.rewrite(g.model({"x": ["N", 3, 5, 5]}, [y]), CATALOG)
    assert fused_ops(result.model) == ["ConvBiasRelu", "GlobalAvgPoolFlatten"], result.explain()


@pytest.mark.parametrize(("axes", "want"), [([1], "not the spatial axes [2]"),
                                            ([1, 2], "not the spatial axes [2]")])  # fmt: skip
def test_mean_over_channels_does_not_fuse(axes, want):
    near_miss(mean_model((1, 4, 7), axes, 1, 18), "SpatialMean", want, catalog=CATALOG)


def test_mean_over_one_of_two_spatial_axes_does_not_fuse():
    model = mean_model((1, 4, 7, 7), [3], 1, 17)
    near_miss(model, "SpatialMean", "over axes [3], not the spatial axes [2, 3]", catalog=CATALOG)


def test_mean_without_axes_does_not_fuse():
    g = GraphBuilder(opset=18)
    y = g.node("ReduceMean", ["x"], keepdims=1)
    model = g.model({"x": ["N", 4, 7]}, [y])
    near_miss(model, "SpatialMean", "without axes reduces every axis", catalog=CATALOG)
