"""A CNN's classifier head in each exporter's form (GlobalAveragePool + Flatten, ReduceMean +
Reshape or keepdims=0, then Gemm, with MobileNetV3's Gemm + HardSwish + Gemm) fuses into
GlobalAvgPoolFlatten and LinearAct nodes whose kernels give onnxruntime's outputs; near-misses
say why."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, assert_fuses, near_miss, run_bound, run_ort

import fusion


def head(g, x, channels, form, classes=10, hidden=None):
    if form == "gap":
        t = g.node("Flatten", [g.node("GlobalAveragePool", [x])], axis=1)
    elif form == "reshape":  # dynamo: axes as input, keepdims, then Reshape to [-1, C]
        m = g.node("ReduceMean", [x, g.const(np.array([-1, -2]))], keepdims=1)
        t = g.node("Reshape", [m, g.const(np.array([-1, channels]))])
    else:  # "keepdims0": ShuffleNet's dynamo export
        t = g.node("ReduceMean", [x, g.const(np.array([2, 3]))], keepdims=0)
    if hidden:  # MobileNetV3: Gemm, HardSwish, Gemm
        t = g.node("HardSwish", [g.node("Gemm", [t, g.weight(hidden, channels), g.weight(hidden)],
                                        transB=1)])  # fmt: skip
        channels = hidden
    return g.node("Gemm", [t, g.weight(classes, channels), g.weight(classes)], transB=1)


@pytest.mark.parametrize("form,hidden", [("gap", None), ("reshape", None), ("keepdims0", 12)])
def test_head_fuses_and_runs(form, hidden):
    g = GraphBuilder(opset=18)
    y = head(g, "x", 16, form, hidden=hidden)
    model = g.model({"x": ["N", 16, 5, 5]}, [y])
    result = assert_fuses(
        model, ["GlobalAvgPoolFlatten", *["LinearAct"] * (2 if hidden else 1)], rtol=1e-5
    )
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 16, 5, 5))}
        feeds = {"x": feeds["x"].astype(np.float32)}
        want = run_ort(model, feeds)[0]
        got = fusion.Session(result.model, threads=2, fuse=False).run(None, feeds)[0]
        assert_close(got, want, 1e-5, 1e-5)
        session = fusion.Session(result.model, threads=2, fuse=False, tactics="kernel")
        assert_close(run_bound(session, feeds)[0], want, 1e-5, 1e-5)  # checked, bound, replayed


def test_reshape_with_a_zero_is_declined():
    """A 0 in Reshape's shape copies a dim (or is a 0 with allowzero): not the head's [N, C]."""
    g = GraphBuilder(opset=18)
    m = g.node("ReduceMean", ["x", g.const(np.array([2, 3]))], keepdims=1)
    y = g.node("Reshape", [m, g.const(np.array([0, -1]))], name="/flat")
    # the mean alone still fuses (SpatialMean), the Reshape stays
    near_miss(g.model({"x": [2, 16, 5, 5]}, [y]), "GlobalAvgPoolFlatten", fused=["SpatialMean"])
    text = fusion.rewrite(g.model({"x": [2, 16, 5, 5]}, [y])).explain("GlobalAvgPoolFlatten")
    assert "GlobalAvgPoolFlatten: 0 fused" in text


def test_products_of_3d_inputs_are_left_to_their_own_rules():
    """A transformer's [B, S, K] x W is not a classifier head."""
    g = GraphBuilder()
    y = g.node("Relu", [g.node("MatMul", ["x", g.weight(8, 4)])])
    near_miss(g.model({"x": [2, 3, 8]}, [y]), None)


def test_gemm_with_a_matrix_for_bias_is_declined():
    g = GraphBuilder()
    t = g.node("Flatten", [g.node("GlobalAveragePool", ["x"])], axis=1)
    y = g.node("Gemm", [t, g.weight(8, 4), g.weight(3, 4)], name="/fc")  # C: a [3, 4] matrix
    near_miss(g.model({"x": [3, 8, 2, 2]}, [y]), "LinearAct", "is not a row of 4 values",
              fused=["GlobalAvgPoolFlatten"])  # fmt: skip
