"""Hugging Face models as PyTorch exports them (tests/fixtures/export_transformers.py: tiny
BERT, DistilBERT, GPT-2, Llama, each by the TorchScript and the dynamo exporter, with eager
and with sdpa attention): every layer fuses (Llama's with its rotary embeddings, grouped-query
heads and SwiGLU MLP), and fusion.Session agrees with onnxruntime on the
unfused graph at batch 1 and 4, sequences 64 and 130, with and without padding (padding
positions included; with GPT-2's causal mask a left-padded row's first queries see no key,
the rows sdpa's NaN guard turns to zeros)."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_close, fused_ops, near_miss, run_ort

import fusion

FIXTURES = Path(__file__).parent / "fixtures"
EXPORTERS = ("ts17", "dynamo18")
FORMS = ("", "_sdpa")  # transformers' eager attention, and sdpa (its default)
LAYERS = 2
# Per model: the fused nodes of a 2-layer export (embeddings' Add + LayerNorm is SkipLayerNorm).
ENCODER = {"Attention": LAYERS, "LinearGelu": LAYERS, "LinearResidual": LAYERS,
           "SkipLayerNorm": 1, "LayerNorm": 2 * LAYERS}  # fmt: skip
LLAMA = {"Attention": LAYERS, "GatedMLP": LAYERS, "RMSNorm": 2 * LAYERS + 1}
EXPECTED = {"bert": ENCODER, "distilbert": ENCODER, "gpt2": ENCODER, "llama": LLAMA}
# Ops that must not be left to onnxruntime once every layer is fused.
LAYER_OPS = {"MatMul", "Gemm", "Softmax", "LayerNormalization", "Erf", "Tanh", "Split", "Sigmoid"}


def load(name: str, exporter: str, form: str = "") -> onnx.ModelProto:
    return onnx.load(FIXTURES / f"{name}_tiny{form}.{exporter}.onnx")


def feeds(batch: int, seq: int, padded: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + batch * 1000 + seq)
    mask = np.ones((batch, seq), np.int64)
    if padded:
        mask[-1, seq - seq // 4 :] = 0  # right padding (BERT) ...
        mask[0, :3] = 0  # ... and left padding (GPT-2's batched generation)
    return {"input_ids": rng.integers(0, 64, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.parametrize("form", FORMS, ids=["eager", "sdpa"])
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_layer_fuses_and_agrees_with_onnxruntime(name, exporter, form):
    model = load(name, exporter, form)
    result = fusion.rewrite(model)
    assert result.counts() == EXPECTED[name], result.explain()
    left = {n.op_type for n in result.model.graph.node} & LAYER_OPS
    assert not left, f"left to onnxruntime: {left}"
    session = fusion.Session(result.model)
    for batch, seq, padded in [(1, 64, False), (4, 64, True), (1, 130, True), (4, 130, False)]:
        f = feeds(batch, seq, padded)
        (got,), (want,) = session.run(None, f), run_ort(model, f)
        assert_close(got, want, 1e-4, 1e-5, what=f"{name}{form}.{exporter} b{batch} s{seq}")


def break_softmax_axis(model: onnx.ModelProto, layer: int) -> str:
    """The `layer`-th Softmax made to normalize the queries' axis; returns its label."""
    softmax = [n for n in model.graph.node if n.op_type == "Softmax"][layer]
    for a in softmax.attribute:
        if a.name == "axis":
            a.i = 2
    return softmax.name


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_explain_names_the_node_that_broke_the_attention_of_a_layer(exporter):
    model = load("bert", exporter)
    broken = break_softmax_axis(model, 1)
    result = fusion.rewrite(model)
    assert fused_ops(result.model).count("Attention") == LAYERS - 1
    text = result.explain("Attention")
    assert f"Softmax {broken}: axis=2, attention's Softmax is over the keys" in text, text


# ---- sdpa's forms: near-misses name what differs ---------------------------------------------
def _nodes(model, op_type: str, name_part: str = "") -> list:
    return [n for n in model.graph.node if n.op_type == op_type and name_part in n.name]


def _constant(model, name: str, value, dtype=np.float32) -> str:
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value, dtype), name))
    return name


def test_a_nan_guard_that_fills_other_than_zero_is_not_attention():
    model = load("bert", "ts17", "_sdpa")
    for k, guard in enumerate(_nodes(model, "Where", "attention/self/Where_1")):
        guard.input[1] = _constant(model, f"fill_{k}", [1.0])
    near_miss(model, "Attention", "the Softmax's NaN guard fills [1.], not 0")


def test_a_per_axis_key_scale_is_not_a_scalar_scale():
    model = load("bert", "dynamo18", "_sdpa")
    k_scales = [
        n
        for n in _nodes(model, "Mul")
        if n.input[0].startswith("val_")
        and any(p.output[0] == n.input[0] and p.op_type == "Reshape" for p in model.graph.node)
    ]
    assert len(k_scales) == LAYERS  # the Mul on each layer's K^T
    for k, mul in enumerate(k_scales):
        mul.input[1] = _constant(model, f"k_scale_{k}", np.full((8, 1), 0.6))
    near_miss(model, "Attention", "is not a scalar")


def test_a_key_reshape_that_regroups_values_is_not_a_transpose():
    """dynamo's sdpa flattens K's heads, transposes in 3-D and unflattens to [B, H, D, S]: a
    target that ends in [S, D] instead makes other values, and the match says so."""
    model = load("bert", "dynamo18", "_sdpa")
    reshapes = [
        n
        for n in _nodes(model, "Reshape")
        if any(
            p.op_type == "Transpose"
            and p.output[0] == n.input[0]
            and onnx.helper.get_attribute_value(p.attribute[0]) == [0, 2, 1]
            for p in model.graph.node
        )
    ]
    assert len(reshapes) == LAYERS
    for reshape in reshapes:
        target = next(p for p in model.graph.node if reshape.input[1] in p.output)
        target.input[1], target.input[2] = target.input[2], target.input[1]  # [B, H, S, D]
    near_miss(model, "Attention", "regroups the heads' values, not only their axes")


def test_a_context_reshape_that_regroups_values_is_not_a_no_op():
    model = load("bert", "ts17", "_sdpa")
    for concat in _nodes(model, "Concat", "attention/self/Concat_3"):
        concat.input[2], concat.input[3] = concat.input[3], concat.input[2]  # [B, -1, D, S]
    near_miss(model, "Attention", "regroups the heads' values, not only their axes")


def test_rotary_halves_that_are_not_halves_are_not_attention():
    model = load("llama", "dynamo18", "_sdpa")
    three = _constant(model, "three", [3], np.int64)
    negs = {n.output[0] for n in _nodes(model, "Neg")}
    halves = {c.input[1] for c in _nodes(model, "Concat") if c.input[0] in negs}
    firsts = [n for n in _nodes(model, "Slice") if n.output[0] in halves]
    assert len(firsts) == 2 * LAYERS  # Q's and K's first halves, [0, 4) of 8
    for first in firsts:
        first.input[2] = three
    near_miss(
        model, "Attention", "the rotary halves slice [0, 3] and [4, ", "not [0, 4) and [4, 8)"
    )


def test_a_grouped_query_repeat_to_other_heads_is_not_attention():
    model = load("llama", "dynamo18")
    for expand in _nodes(model, "Expand", "expand_"):
        target = next(n for n in model.graph.node if expand.input[1] in n.output)
        target.input[2] = _constant(model, f"one_{expand.name}", [1.0])  # [B, 2, 1, S, 8]
        model.graph.initializer[-1].CopyFrom(
            onnx.numpy_helper.from_array(np.array([1], np.int64), model.graph.initializer[-1].name)
        )
    near_miss(model, "Attention", "regroups the heads' values")
