"""Models the catalog cannot fuse stay unchanged and say why; patterns inside control-flow
subgraphs are left alone and nothing breaks.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_close,
    cli,
    control_flow_model,
    conv_block,
    random_feeds,
    run_ort,
    typed_model,
)
from onnx import TensorProto, helper

import fusion
from fusion.modelfile import save_model

# ---- models the catalog cannot fuse ----------------------------------------------------------


def int8_qdq_model() -> onnx.ModelProto:
    """A quantized (QDQ) Conv + Relu as quantization tools write it: int8 in, int8 out."""
    g = GraphBuilder()
    scale, zero = g.const(np.float32(0.05)), g.const(np.int8(0))
    w = g.const(g.rng.integers(-50, 50, (4, 2, 3, 3)).astype(np.int8))
    x = g.node("DequantizeLinear", ["x", scale, zero])
    wf = g.node("DequantizeLinear", [w, scale, zero])
    y = g.node("Relu", [g.node("Conv", [x, wf], pads=[1, 1, 1, 1], name="/conv")])
    q = g.node("QuantizeLinear", [y, scale, zero])
    return g.model({"x": ["N", 2, 5, 5]}, [q], elem=TensorProto.INT8)


def unknown_rank_model() -> onnx.ModelProto:
    """Conv reads a Reshape to a shape fed at run time: its input's rank is unknown."""
    g = GraphBuilder()
    y = conv_block(g, g.node("Reshape", ["x", "shape"]), 2, 4)
    graph_inputs = {"x": ["N", 50], "shape": ["k"]}
    graph = helper.make_graph(
        g.nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, graph_inputs["x"])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N", "C", "H", "W"])],
        g.inits,
    )
    graph.input.append(helper.make_tensor_value_info("shape", TensorProto.INT64, ["k"]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


UNFUSABLE = {
    "float16": (lambda: typed_model(TensorProto.FLOAT16), "dtype float16, kernels are float32"),
    "float64": (lambda: typed_model(TensorProto.DOUBLE), "dtype float64, kernels are float32"),
    "int8 QDQ": (int8_qdq_model, "Conv /conv"),
    "unknown rank": (unknown_rank_model, "rank of /reshape1_out is unknown"),
}


@pytest.mark.parametrize("case", list(UNFUSABLE))
def test_unfusable_model_is_left_unchanged_with_a_reason(capsys, tmp_path, case):
    build, reason = UNFUSABLE[case]
    model = build()
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    save_model(model, src)
    code, out, _ = cli(capsys, "rewrite", src, "-o", dst, "--explain")
    assert code == 0 and "0 fusions" in out
    assert "ConvBiasRelu: 0 fused, 1 not fused" in out and reason in out, out
    assert dst.read_bytes() == src.read_bytes()
    if case == "float64":
        return  # onnxruntime has no float64 Conv on CPU: nothing to run
    feeds = random_feeds(model)
    if case == "int8 QDQ":
        feeds = {"x": np.random.default_rng(0).integers(-100, 100, (2, 2, 5, 5)).astype(np.int8)}
    if case == "unknown rank":
        x = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
        feeds = {"x": x, "shape": np.array([2, 2, 5, 5], np.int64)}
    want = run_ort(model, feeds)
    got = fusion.Session(str(dst), threads=1).run(None, feeds)
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


# ---- control flow ----------------------------------------------------------------------------
def test_patterns_in_subgraphs_are_left_alone_and_nothing_breaks(capsys, tmp_path):
    model = control_flow_model()
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    save_model(model, src)
    code, out, _ = cli(capsys, "rewrite", src, "-o", dst, "--explain")
    assert code == 0 and "2 fusions (" in out, out
    assert "is also used by If" in out  # the escape through the If branch was seen
    fused = onnx.load(str(dst))
    onnx.checker.check_model(fused, full_check=True)
    # the first block whole, the second's Conv alone (its output is read inside the If)
    assert [n.op_type for n in fused.graph.node].count("ConvBiasRelu") == 2
    for node in fused.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:  # bodies are untouched
                original = next(n for n in model.graph.node if n.op_type == node.op_type)
                assert attr.g == next(a.g for a in original.attribute if a.name == attr.name)
    for seed in range(2):
        feeds = random_feeds(model, batch=2, seed=seed)
        want = run_ort(model, feeds)
        for got in (run_ort(fused, feeds), fusion.Session(fused, threads=1).run(None, feeds)):
            for g, w in zip(got, want, strict=True):
                assert_close(g, w, rtol=1e-4, atol=1e-5)
