"""ConvBiasRelu: every exporter variant fuses, every near-miss does not and says why.

Each fused model is checked with the full ONNX checker and run in plain onnxruntime (through
the fused nodes' function bodies) against the original.
"""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_fuses, conv_block, near_miss

import fusion
from fusion.models import conv_stack


def rewrite_and_compare(model, expect: int):
    return assert_fuses(model, ["ConvBiasRelu"] * expect, rtol=1e-5, atol=1e-5)


VARIANTS = [
    dict(bias="input"),  # PyTorch
    dict(bias="add"),  # TensorFlow: Add of [1,C,1,1]
    dict(bias="add", bias_shape=(8, 1, 1)),
    dict(bias="add", bias_shape=(1,)),  # one value for every channel
    dict(bias="both"),
    dict(bias="none"),
    dict(act="clip"),
    dict(act="relu6", bias="add"),
    dict(strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(auto_pad="SAME_UPPER"),
    dict(dilations=[2, 2], pads=[2, 2, 2, 2]),
    dict(k=1),
    dict(group=2),
]


@pytest.mark.parametrize("opset", [9, 13, 17])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_variant_fuses(variant, opset):
    g = GraphBuilder(opset=opset)
    y = conv_block(g, "x", 4, 8, **variant)
    rewrite_and_compare(g.model({"x": ["N", 4, 9, 9]}, [y]), expect=1)


def test_bias_add_constant_first_and_identity_weights():
    g = GraphBuilder()
    w = g.node("Identity", [g.weight(8, 4, 3, 3)])
    conv = g.node("Conv", ["x", w], pads=[1, 1, 1, 1])
    added = g.node("Add", [g.weight(1, 8, 1, 1), conv])  # constant on the left
    y = g.node("Relu", [added])
    result = rewrite_and_compare(g.model({"x": [1, 4, 6, 6]}, [y]), expect=1)
    assert result.model.graph.node[0].op_type == "Identity"  # left in place, read as a constant


def test_weight_from_constant_node():
    g = GraphBuilder()
    w = np.random.default_rng(1).standard_normal((8, 4, 3, 3)).astype(np.float32)
    g.nodes.append(
        onnx.helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w))
    )
    y = g.node("Relu", [g.node("Conv", ["x", "w"])])
    rewrite_and_compare(g.model({"x": [1, 4, 6, 6]}, [y]), expect=1)


def test_four_blocks_in_a_row_all_fuse():
    for form in ("tf", "pytorch"):
        model = conv_stack(blocks=4, channels=8, size=10, form=form)
        result = rewrite_and_compare(model, expect=4)
        assert result.counts()["ConvBiasRelu"] == 4


def test_intermediate_is_graph_output():
    """The Conv fuses alone (a conv with no epilogue is a fused conv too); the Relu stays."""
    g = GraphBuilder()
    conv = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv3")
    y = g.node("Relu", [conv], name="/relu3")
    near_miss(
        g.model({"x": [1, 4, 6, 6]}, [y, conv]),
        "ConvBiasRelu",
        "Conv /conv3: its output /conv3_out is also a graph output",
        fused=["ConvBiasRelu"],
    )


def test_intermediate_used_elsewhere():
    g = GraphBuilder()
    conv = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv")
    y = g.node("Relu", [conv])
    z = g.node("Sigmoid", [conv], name="/side")
    near_miss(
        g.model({"x": [1, 4, 6, 6]}, [y, z]),
        "ConvBiasRelu",
        "its output /conv_out is also used by Sigmoid /side",
        fused=["ConvBiasRelu"],
    )


def test_float16_is_left_alone():
    g = GraphBuilder()
    w = g.const(np.ones((8, 4, 3, 3), np.float16))
    y = g.node("Relu", [g.node("Conv", ["x", w], name="/conv7")])
    model = g.model({"x": [1, 4, 6, 6]}, [y], elem=onnx.TensorProto.FLOAT16)
    near_miss(model, None, "Conv /conv7: dtype float16, kernels are float32-only")


def test_width_shaped_bias_is_not_a_channel_bias():
    g = GraphBuilder()
    y = conv_block(g, "x", 4, 8, bias="add", bias_shape=(8,), pads=[1, 1, 1, 1])
    near_miss(g.model({"x": [1, 4, 8, 8]}, [y]), "ConvBiasRelu",
              "Add of shape [8] is not a per-channel bias", fused=["ConvBiasRelu"])  # fmt: skip


def test_weights_fed_at_run_time_are_not_fused():
    g = GraphBuilder()
    y = g.node("Relu", [g.node("Conv", ["x", "w"], name="/c")])
    model = g.model({"x": [1, 4, 6, 6], "w": [8, 4, 3, 3]}, [y])
    near_miss(model, None, "Conv /c: input w is not a constant")


def test_conv3d_is_not_fused():
    g = GraphBuilder()
    y = g.node("Relu", [g.node("Conv", ["x", g.weight(8, 4, 3, 3, 3)], name="/c3d")])
    near_miss(
        g.model({"x": [1, 4, 5, 5, 5]}, [y]),
        None,
        "Conv /c3d: x has rank 5: the kernels run 1-D and 2-D convs",
    )


def test_clip_with_run_time_bound_is_not_fused():
    g = GraphBuilder()
    conv = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv")
    y = g.node("Clip", [conv, "lo"], name="/clip")
    model = g.model({"x": [1, 4, 6, 6], "lo": []}, [y])
    near_miss(model, "ConvBiasRelu", "Clip /clip: input lo is not a constant",
              fused=["ConvBiasRelu"])  # fmt: skip


def test_unrelated_relu_is_not_reported():
    """(A 2-D MatMul + Relu on a graph input is no classifier head either: LinearAct is quiet.)"""
    g = GraphBuilder()
    y = g.node("Relu", [g.node("MatMul", ["x", g.weight(4, 4)])])
    text = near_miss(g.model({"x": [2, 4]}, [y]), None)
    (quiet,) = [line for line in text.splitlines() if line.startswith("no match")]
    assert "ConvBiasRelu" in quiet.split(": ")[1].split(", ")  # one line for the silent rules
    assert not [line for line in text.splitlines() if line.startswith("  ")]  # no near-miss


def test_input_model_is_not_modified():
    model = conv_stack(blocks=2, channels=4, size=6)
    before = model.SerializeToString()
    fusion.rewrite(model)
    assert model.SerializeToString() == before
