"""Attention's flash core on the SIMD layer (kernels/attention.py) at W = 8 and W = 16 in one
process (the width comes with the plans, prepare_dense(width=...)), against onnxruntime running
the unfused attention subgraph built here: Q, K, V linears, heads split, scaled Q K^T plus an
additive mask, Softmax (with sdpa's IsNaN/Where guard or without), times V, heads merged,
output linear and residual. Head sizes 1 to 64 (whole vectors and masked tails), sequences 1
to 128 (one partial key tile to several key blocks), grouped-query heads, causal masks (the
skipped key blocks), fully masked rows, NaN and inf in the inputs, batch 0."""

import numpy as np
import pytest
from helpers import assert_close, run_ort
from onnx import TensorProto, helper, numpy_helper

from fusion_kernels.attention import attention, attention_core
from fusion_kernels.dense_gemm import prepare_dense

WIDTHS = (8, 16)
E = 12  # embedding
LOWEST = np.finfo(np.float32).min


def attention_graph(b, s, heads, kv_heads, d, scale, params, mask_shape, guard, residual):
    """The unfused subgraph as exporters write it, for onnxruntime: [b, s, E] -> [b, s, E]."""
    w_qkv, b_qkv, w_out, b_out = params
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, **attrs):
        out = f"t{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    cols = np.split(np.arange(w_qkv.shape[1]), [heads * d, (heads + kv_heads) * d])
    q, k, v = (
        node("Add", [node("MatMul", ["x", const(f"w{n}", w_qkv[:, c])]), const(f"b{n}", b_qkv[c])])
        for n, c in zip("qkv", cols, strict=True)
    )
    q = node("Transpose", [node("Reshape", [q, const("qs", np.array([b, s, heads, d]))])],
             perm=[0, 2, 1, 3])  # fmt: skip
    kv_shape = const("kvs", np.array([b, s, kv_heads, d]))
    k = node("Transpose", [node("Reshape", [k, kv_shape])], perm=[0, 2, 3, 1])  # [b, Hkv, d, s]
    v = node("Transpose", [node("Reshape", [v, kv_shape])], perm=[0, 2, 1, 3])  # [b, Hkv, s, d]
    if kv_heads < heads:  # grouped-query heads: each K, V head repeated for its group
        r = heads // kv_heads
        k = node("Reshape", [node("Expand", [node("Unsqueeze", [k, const("ax", np.array([2]))]),
                                             const("ek", np.array([b, kv_heads, r, d, s]))]),
                             const("hk", np.array([b, heads, d, s]))])  # fmt: skip
        v = node("Reshape", [node("Expand", [node("Unsqueeze", [v, "ax"]),
                                             const("ev", np.array([b, kv_heads, r, s, d]))]),
                             const("hv", np.array([b, heads, s, d]))])  # fmt: skip
    scores = node("Mul", [node("MatMul", [q, k]), const("scale", np.float32(scale))])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, E])]
    if mask_shape is not None:
        scores = node("Add", [scores, "mask"])
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, mask_shape))
    p = node("Softmax", [scores], axis=-1)
    if guard:
        p = node("Where", [node("IsNaN", [p]), const("zero", np.float32(0)), p])
    o = node("Transpose", [node("MatMul", [p, v])], perm=[0, 2, 1, 3])
    o = node("MatMul", [node("Reshape", [o, const("ms", np.array([b, s, heads * d]))]),
                        const("wo", w_out)])  # fmt: skip
    y = node("Add", [o, const("bo", b_out)])
    if residual:
        y = node("Add", [y, "x"])
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def params_of(rng, heads, kv_heads, d):
    w_qkv = (rng.standard_normal((E, (heads + 2 * kv_heads) * d)) * 0.4).astype(np.float32)
    b_qkv = (rng.standard_normal(w_qkv.shape[1]) * 0.1).astype(np.float32)
    w_out = (rng.standard_normal((heads * d, E)) * 0.3).astype(np.float32)
    b_out = (rng.standard_normal(E) * 0.1).astype(np.float32)
    return w_qkv, b_qkv, w_out, b_out


def check(x, heads, kv_heads, d, mask, width, guard=False, residual=False, seed=0):
    """The kernel against onnxruntime on the unfused subgraph, on the same x and mask."""
    b, s, _ = x.shape
    params = params_of(np.random.default_rng(seed), heads, kv_heads, d)
    w_qkv, b_qkv, w_out, b_out = params
    scale = d**-0.5
    mask_shape = None if mask is None else list(mask.shape)
    model = attention_graph(b, s, heads, kv_heads, d, scale, params, mask_shape, guard, residual)
    feeds = {"x": x} if mask is None else {"x": x, "mask": mask}
    (want,) = run_ort(model, feeds)
    got = attention(x, prepare_dense(w_qkv, b_qkv, width=width), heads, kv_heads, scale,
                    prepare_dense(w_out, b_out, width=width), mask, x if residual else None,
                    nan_to_zero=guard)  # fmt: skip
    assert_close(got, want, 1e-4, 1e-5, what=f"b{b} s{s} h{heads}/{kv_heads} d{d} w{width}")
    return got


def causal(s):
    return np.where(np.tril(np.ones((s, s), bool)), 0, -np.inf).astype(np.float32)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("d", [1, 3, 17, 32, 64])
@pytest.mark.parametrize("s", [1, 3, 17, 100, 128])
def test_head_sizes_and_sequences_against_onnxruntime(width, d, s):
    """Every head size (under a lane mask when not a whole vector) at every sequence (one
    partial key tile, several key blocks), plain, with a padding mask of the float minimum
    (HF's), and causal with -inf; grouped-query heads and the residual on the larger shapes."""
    rng = np.random.default_rng(100 * d + s)
    x = rng.standard_normal((2, s, E)).astype(np.float32)
    check(x, 2, 2, d, None, width, seed=d)
    padding = np.zeros((2, 1, 1, s), np.float32)
    padding[1, ..., s - s // 3 :] = LOWEST  # batch 1 padded at the end
    check(x, 4, 2, d, padding, width, residual=True, seed=d + 1)
    check(x, 3, 1, d, causal(s)[None, None], width, guard=True, seed=d + 2)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("s", [3, 100])
def test_fully_masked_rows_nan_or_guarded_to_zero(width, s):
    """A query whose every key is -inf: Softmax gives a NaN row, sdpa's guard zeros; a row
    whose keys are all the float minimum (the last, and the first two under left padding)
    is uniform over every key (nothing is skipped for its block); the causal block skip
    stays exact around them. Per-head masks [b, H, s, s]."""
    rng = np.random.default_rng(s)
    x = rng.standard_normal((2, s, E)).astype(np.float32)
    mask = np.broadcast_to(causal(s), (2, 2, s, s)).copy()
    mask[0, 1, s // 2] = -np.inf
    mask[1, 0, s - 1] = LOWEST
    mask[1, 0, :, :2] = LOWEST  # left padding: queries 0, 1 see only the float minimum
    mask[1, 1, :, : s // 2] = -np.inf  # the first key blocks masked for every query of a head
    mask[1, 1, :, s // 2] = 0
    for guard in (False, True):
        y = check(x, 2, 2, 17, mask, width, guard=guard)
        assert np.isnan(y[0, s // 2]).all() != guard  # the NaN row of head 1 reaches every column
        assert np.isnan(y).sum() == (0 if guard else E)


@pytest.mark.parametrize("width", WIDTHS)
def test_nan_and_inf_inputs_against_onnxruntime(width):
    """A NaN or inf in x reaches Q, K and V of its position: NaN scores for every query
    against it (a NaN row) or for its query, as onnxruntime's, a masked key's included (its
    score NaN + -inf is NaN, and p = 0 times its NaN V is NaN). Not with sdpa's guard: there
    onnxruntime's 0 p times a NaN V is NaN again, where the kernel gives the guarded row's 0
    (test_transformer.py's test_attention_kernel_zeroes_the_rows_sdpa_guards)."""
    rng = np.random.default_rng(3)
    for bad in (np.nan, np.inf, -np.inf):
        x = rng.standard_normal((2, 17, E)).astype(np.float32)
        x[0, 5, 2] = bad
        x[1, 16, 0] = bad
        mask = np.zeros((2, 1, 17, 17), np.float32)
        mask[1, 0, :, 16] = -np.inf  # batch 1's bad key is masked: its V still multiplies 0
        check(x, 2, 1, 8, mask, width)
        check(x, 2, 2, 3, None, width)


@pytest.mark.parametrize("width", WIDTHS)
def test_batch_zero_and_empty_results(width):
    params = params_of(np.random.default_rng(0), 2, 1, 5)
    plans = prepare_dense(*params[:2], width=width), prepare_dense(*params[2:], width=width)
    x = np.zeros((0, 7, E), np.float32)
    y = attention(x, plans[0], 2, 1, 0.5, plans[1], np.zeros((0, 1, 1, 7), np.float32))
    assert y.shape == (0, 7, E)
    assert attention_core(np.zeros((0, 20), np.float32), 0, 7, 2, 1, 5, 0.5).shape == (0, 10)


def test_core_refuses_bad_shapes():
    with pytest.raises(ValueError, match="key/value heads"):
        attention_core(np.zeros((6, 20), np.float32), 2, 3, 3, 2, 4, 0.5)
    with pytest.raises(ValueError, match="does not broadcast"):
        attention_core(np.zeros((6, 20), np.float32), 2, 3, 2, 1, 5, 0.5,
                       np.zeros((3, 1, 1, 3), np.float32))  # fmt: skip
