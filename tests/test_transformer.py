"""Transformer blocks (issue 21): LinearGelu, LinearResidual, GatedMLP, LayerNorm, SkipLayerNorm,
RMSNorm on graphs built here, each fused node against onnxruntime on the unfused graph on several
shapes, a near-miss per pattern with its reason, and the kernels against naive NumPy."""

import math

import numpy as np
import pytest
from helpers import (
    GraphBuilder,
    assert_all_close,
    assert_close,
    fused_ops,
    near_miss,
    run_bound,
    run_ort,
)
from onnx import helper

import fusion
from fusion_kernels.attention import attention
from fusion_kernels.dense_gemm import prepare_dense
from fusion_kernels.layernorm import SERIAL_MAX, layer_norm
from fusion_kernels.linear_act import gated_mlp, linear_act, prepare_gated_mlp
from fusion_kernels.simd.activation import encode

SHAPES = [(1, 7), (2, 33), (4, 64)]  # (batch, sequence)
E, N = 24, 40


def model_of(g: GraphBuilder, y: str, e: int = E, outputs=None):
    m = g.model({"x": ["B", "S", e]}, outputs or [y])
    return m


def check_shapes(model, ops, rtol=1e-4, atol=1e-5):
    """Fuses into `ops`; fusion.Session agrees with onnxruntime on the unfused graph, its
    kernels checked, bound and replayed (run_bound), and at its default tactics."""
    result = fusion.rewrite(model)
    assert fused_ops(result.model) == ops, result.explain()
    for batch, seq in SHAPES:
        rng = np.random.default_rng(batch * 100 + seq)
        feeds = {"x": rng.standard_normal((batch, seq, E)).astype(np.float32)}
        want = run_ort(model, feeds)
        assert_all_close(run_bound(fusion.Session(result.model, tactics="kernel"), feeds), want,
                         rtol, atol)  # fmt: skip
        assert_all_close(fusion.Session(result.model).run(None, feeds), want, rtol, atol)
    return result


def gelu(g, t, form):
    if form == "erf":
        e = g.node("Erf", [g.node("Div", [t, g.const(np.float32(math.sqrt(2)))])])
        e1 = g.node("Add", [e, g.const(np.float32(1.0))])
        return g.node("Mul", [g.node("Mul", [t, e1]), g.const(np.float32(0.5))])
    cube = g.node(
        "Mul", [g.node("Pow", [t, g.const(np.float32(3.0))]), g.const(np.float32(0.044715))]
    )
    inner = g.node("Mul", [g.node("Add", [t, cube]), g.const(np.float32(math.sqrt(2 / math.pi)))])
    th = g.node("Add", [g.node("Tanh", [inner]), g.const(np.float32(1.0))])
    return g.node("Mul", [g.node("Mul", [t, g.const(np.float32(0.5))]), th])


def linear3d(g, x, k, n, form):
    """nn.Linear on [B, S, k]: MatMul + Add, or (the dynamo form) Reshape + Gemm + Reshape."""
    w, b = g.weight(k, n), g.weight(n, scale=0.1)
    if form == "matmul":
        return g.node("Add", [g.node("MatMul", [x, w]), b])
    flat = g.node("Reshape", [x, g.const(np.array([-1, k], np.int64))])
    y = g.node("Gemm", [flat, w, b])
    shape = g.node(
        "Concat", [g.node("Shape", [x], start=0, end=2), g.const(np.array([n], np.int64))], axis=0
    )
    return g.node("Reshape", [y, shape])


@pytest.mark.parametrize("act", ["erf", "tanh"])
@pytest.mark.parametrize("form", ["matmul", "gemm"])
@pytest.mark.parametrize("residual", [False, True])
def test_linear_gelu_matches_onnxruntime(act, form, residual):
    g = GraphBuilder(seed=3)
    y = gelu(g, linear3d(g, "x", E, N, form), act)
    if residual:
        y = g.node("Add", [y, g.node("Sigmoid", [g.node("MatMul", ["x", g.weight(E, N)])])])
    result = check_shapes(model_of(g, y), ["LinearGelu"])
    (node,) = [n for n in result.model.graph.node if n.op_type == "LinearGelu"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["activation"] == (b"gelu" if act == "erf" else b"gelu_tanh")
    assert (len(node.input) == 7 and node.input[6] != "") == residual  # the 7th input


@pytest.mark.parametrize("form", ["matmul", "gemm"])
def test_linear_residual_matches_onnxruntime(form):
    g = GraphBuilder(seed=4)
    h = g.node("Tanh", ["x"])
    y = g.node("Add", [linear3d(g, h, E, E, form), "x"])
    check_shapes(model_of(g, y), ["LinearResidual"])


def layer_norm_graph(g, x, form, axis=-1):
    gamma, beta = g.weight(E, scale=1.0), g.weight(E, scale=0.1)
    if form == "op":
        return g.node("LayerNormalization", [x, gamma, beta], axis=axis, epsilon=1e-5)
    mean = g.node("ReduceMean", [x], axes=[axis])
    d = g.node("Sub", [x, mean])
    var = g.node("ReduceMean", [g.node("Pow", [d, g.const(np.float32(2.0))])], axes=[axis])
    std = g.node("Sqrt", [g.node("Add", [var, g.const(np.float32(1e-6))])])
    return g.node("Add", [g.node("Mul", [g.node("Div", [d, std]), gamma]), beta])


@pytest.mark.parametrize("form", ["op", "primitive"])
def test_layer_norm_and_skip_layer_norm_match_onnxruntime(form):
    g = GraphBuilder(seed=5)
    y = layer_norm_graph(g, g.node("Tanh", ["x"]), form)
    check_shapes(model_of(g, y), ["LayerNorm"])
    g = GraphBuilder(seed=6)
    s = g.node("Add", [g.node("Tanh", ["x"]), g.node("Sigmoid", ["x"])])
    y = layer_norm_graph(g, s, form)
    check_shapes(model_of(g, y, outputs=[y, s]), ["SkipLayerNorm"])  # the sum is read too


def rms_graph(g, x, form, axes=(-1,)):
    sq = g.node("Pow", [x, g.const(np.float32(2.0))])
    std = g.node("Sqrt", [g.node("Add", [g.node("ReduceMean", [sq], axes=list(axes)),
                                         g.const(np.float32(1e-6))])])  # fmt: skip
    if form == "div":
        norm = g.node("Div", [x, std])
    elif form == "reciprocal":
        norm = g.node("Mul", [x, g.node("Reciprocal", [std])])
    else:  # Llama's TorchScript export
        norm = g.node("Mul", [x, g.node("Div", [g.const(np.float32(1.0)), std])])
    return g.node("Mul", [g.weight(E, scale=1.0), norm])


@pytest.mark.parametrize("form", ["div", "reciprocal", "one_over"])
def test_rms_norm_matches_onnxruntime(form):
    g = GraphBuilder(seed=7)
    check_shapes(model_of(g, rms_graph(g, g.node("Tanh", ["x"]), form)), ["RMSNorm"])


@pytest.mark.parametrize("tactic", ["rows", "rows-parallel", "rows-serial"])
def test_norms_run_either_row_driver(tactic):
    """The norms' tactics: the threshold's choice, rows over the threads, rows on the calling
    thread (timed per shape under the "fastest" and "kernels" policies), each against
    onnxruntime."""
    models = []
    g = GraphBuilder(seed=5)
    models.append(model_of(g, layer_norm_graph(g, g.node("Tanh", ["x"]), "op")))
    g = GraphBuilder(seed=6)
    s = g.node("Add", [g.node("Tanh", ["x"]), g.node("Sigmoid", ["x"])])
    y = layer_norm_graph(g, s, "op")
    models.append(model_of(g, y, outputs=[y, s]))  # SkipLayerNorm: the sum is read too
    g = GraphBuilder(seed=7)
    models.append(model_of(g, rms_graph(g, g.node("Tanh", ["x"]), "div")))
    for model, op in zip(models, ["LayerNorm", "SkipLayerNorm", "RMSNorm"], strict=True):
        result = fusion.rewrite(model)
        assert fused_ops(result.model) == [op], result.explain()
        for batch, seq in SHAPES:
            feeds = {"x": np.random.default_rng(seq).standard_normal((batch, seq, E))
                     .astype(np.float32)}  # fmt: skip
            session = fusion.Session(result.model, tactics=tactic)
            assert set(session.choices.values()) == {tactic}
            assert_all_close(session.run(None, feeds), run_ort(model, feeds), 1e-4, 1e-5)


# ---- near-misses -----------------------------------------------------------------------------
def gated(g, x, act, form, width=N, up_width=None):
    """act(x Wg + bg) * (x Wu + bu), then the down product back to E (Llama's MLP for SiLU)."""
    t = linear3d(g, x, E, width, form)
    gate = g.node("Mul", [t, g.node("Sigmoid", [t])]) if act == "silu" else gelu(g, t, act)
    h = g.node("Mul", [gate, linear3d(g, x, E, up_width or width, form)])
    return linear3d(g, h, width, E, form)


@pytest.mark.parametrize("act", ["silu", "erf", "tanh"])
@pytest.mark.parametrize("form", ["matmul", "gemm"])
@pytest.mark.parametrize("residual", [False, True])
def test_gated_mlp_matches_onnxruntime(act, form, residual):
    g = GraphBuilder(seed=21)
    x = g.node("Tanh", ["x"])
    y = gated(g, x, act, form)
    y = g.node("Add", [y, x]) if residual else y
    check_shapes(model_of(g, y), ["GatedMLP"])


def test_near_miss_gated_mlp_with_a_narrower_up_product():
    g = GraphBuilder(seed=22)
    y = gated(g, g.node("Tanh", ["x"]), "silu", "matmul", up_width=1)  # broadcast over features
    near_miss(model_of(g, y), "GatedMLP", f"the gate has {N} features, the up product 1")


@pytest.mark.parametrize("m,e,i,n", [(1, 3, 17, 5), (33, 24, 40, 24), (100, 17, 3, 1)])
def test_gated_mlp_kernel_against_naive(m, e, i, n):
    rng = np.random.default_rng(m + i)
    x = rng.standard_normal((m, e)).astype(np.float32)
    wg, wu = (rng.standard_normal((e, i)).astype(np.float32) * 0.3 for _ in range(2))
    b = rng.standard_normal(2 * i).astype(np.float32) * 0.1
    wd, bd = rng.standard_normal((i, n)).astype(np.float32) * 0.3, np.ones(n, np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    x[0, 0] = np.nan  # row 0 is NaN everywhere, as onnxruntime's
    g, u = x.astype(np.float64) @ wg + b[:i], x.astype(np.float64) @ wu + b[i:]
    for act, f in (("silu", lambda t: t / (1 + np.exp(-t))), ("relu", lambda t: np.maximum(t, 0))):
        want = (f(g) * u) @ wd + bd + r
        got = gated_mlp(x, prepare_gated_mlp(np.hstack([wg, wu]), b, encode(act), wd, bd), r)
        assert_close(got, want, 1e-4, 1e-5, check_dtype=False)


def test_near_miss_gelu_with_a_wrong_constant():
    g = GraphBuilder(seed=8)
    t = linear3d(g, "x", E, N, "matmul")
    e = g.node("Erf", [g.node("Div", [t, g.const(np.float32(1.5))])])
    y = g.node("Mul", [g.node("Mul", [t, g.node("Add", [e, g.const(np.float32(1.0))])]),
                       g.const(np.float32(0.5))])  # fmt: skip
    near_miss(model_of(g, y), "LinearGelu", "is not 1.41421", fused=[])


def test_near_miss_residual_linear_needs_rank_3():
    g = GraphBuilder(seed=9)
    x2 = g.node("Reshape", ["x", g.const(np.array([-1, E], np.int64))])
    y = g.node("Add", [g.node("Add", [g.node("MatMul", [x2, g.weight(E, E)]), g.weight(E)]), x2])
    near_miss(model_of(g, y), "LinearResidual", "needs x of rank 3", fused=[])


def test_near_miss_layer_norm_on_another_axis():
    g = GraphBuilder(seed=10)
    x = g.node("Tanh", ["x"])
    y = g.node("LayerNormalization", [x, g.weight(E, scale=1.0), g.weight(E)], axis=1)
    y = g.node("Reshape", [y, g.const(np.array([0, 0, E], np.int64))])
    text = near_miss(model_of(g, y), "LayerNorm", "axis=1: kernels normalize the last axis only")
    assert "LayerNorm: 0 fused" in text
    g = GraphBuilder(seed=11)
    s = g.node("Add", [g.node("Tanh", ["x"]), "x"])
    y = layer_norm_graph(g, s, "primitive", axis=1)
    near_miss(model_of(g, y), "SkipLayerNorm", "ReduceMean over axes [1]", fused=[])


def test_near_miss_rms_norm_over_two_axes():
    g = GraphBuilder(seed=12)
    y = rms_graph(g, g.node("Tanh", ["x"]), "div", axes=(1, 2))
    near_miss(model_of(g, y), "RMSNorm", "ReduceMean over axes [1, 2]", fused=[])


# ---- kernels against naive NumPy -------------------------------------------------------------
def rotate_half(t, cos, sin):
    """t cos + cat(-t[..., D/2:], t[..., :D/2]) sin, as Llama writes it."""
    half = t.shape[-1] // 2
    return t * cos + np.concatenate([-t[..., half:], t[..., :half]], axis=-1) * sin


def naive_attention(x, w_qkv, b_qkv, h, hkv, scale, w_out, b_out, mask, rotary=None):
    b, s, _ = x.shape
    d = w_qkv.shape[1] // (h + 2 * hkv)
    qkv = x.reshape(b * s, -1).astype(np.float64) @ w_qkv + b_qkv
    q, k, v = np.split(qkv, [h * d, (h + hkv) * d], axis=1)
    q = q.reshape(b, s, h, d).transpose(0, 2, 1, 3)
    k, v = (t.reshape(b, s, hkv, d).transpose(0, 2, 1, 3) for t in (k, v))
    if rotary is not None:
        q, k = (rotate_half(t, *rotary) for t in (q, k))
    k, v = (np.repeat(t, h // hkv, 1) for t in (k, v))
    scores = q @ k.transpose(0, 1, 3, 2) * scale + (0 if mask is None else mask)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ v
    return (o.transpose(0, 2, 1, 3).reshape(b * s, h * d) @ w_out + b_out).reshape(b, s, -1)


@pytest.mark.parametrize(
    "b,s,heads,kv_heads,d", [(1, 7, 2, 2, 8), (2, 70, 4, 2, 16), (1, 130, 3, 1, 20)]
)
def test_attention_kernel_against_naive(b, s, heads, kv_heads, d):
    rng = np.random.default_rng(s)
    e = 24
    x = rng.standard_normal((b, s, e)).astype(np.float32)
    w_qkv = (rng.standard_normal((e, (heads + 2 * kv_heads) * d)) * 0.2).astype(np.float32)
    b_qkv = (rng.standard_normal(w_qkv.shape[1]) * 0.1).astype(np.float32)
    w_out = (rng.standard_normal((heads * d, e)) * 0.2).astype(np.float32)
    b_out = np.zeros(e, np.float32)
    lowest = np.finfo(np.float32).min
    padding = np.zeros((b, 1, 1, s), np.float32)
    padding[-1, ..., s - s // 3 :] = lowest  # the last row padded at the end
    causal = np.where(np.tril(np.ones((s, s), bool)), 0, lowest).astype(np.float32)
    both = np.where((padding < 0) | (causal < 0), lowest, 0).astype(np.float32)  # HF's: 0 or lowest
    for mask in (None, padding, causal, both):
        got = attention(x, prepare_dense(w_qkv, b_qkv), heads, kv_heads, d**-0.5,
                        prepare_dense(w_out, b_out), mask)  # fmt: skip
        want = naive_attention(x, w_qkv, b_qkv, heads, kv_heads, d**-0.5, w_out, b_out, mask)
        assert_close(got, want, 1e-4, 1e-5, check_dtype=False)


@pytest.mark.parametrize("b,s,heads,kv_heads,d", [(1, 7, 2, 2, 8), (2, 70, 4, 2, 16)])
def test_attention_kernel_with_rotary_embeddings_against_naive(b, s, heads, kv_heads, d):
    """Llama's rotary embedding: cos and sin per position ([1 or B, 1, S, D], as the model
    computes them from the positions, the same for every head), on Q and K before the scores."""
    rng = np.random.default_rng(s + 1)
    e = 24
    x = rng.standard_normal((b, s, e)).astype(np.float32)
    w_qkv = (rng.standard_normal((e, (heads + 2 * kv_heads) * d)) * 0.2).astype(np.float32)
    b_qkv = (rng.standard_normal(w_qkv.shape[1]) * 0.1).astype(np.float32)
    w_out = (rng.standard_normal((heads * d, e)) * 0.2).astype(np.float32)
    b_out = (rng.standard_normal(e) * 0.1).astype(np.float32)
    causal = np.where(np.tril(np.ones((s, s), bool)), 0, -np.inf).astype(np.float32)
    for batch_of_angles in (1, b):
        pos = np.arange(s)[None, None, :, None] + rng.integers(0, 9, (batch_of_angles, 1, 1, 1))
        freqs = pos * (1e-2 ** (np.arange(d // 2) / (d // 2)))
        angles = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        got = attention(x, prepare_dense(w_qkv, b_qkv), heads, kv_heads, d**-0.5,
                        prepare_dense(w_out, b_out), causal, rotary=(cos, sin))  # fmt: skip
        want = naive_attention(x, w_qkv, b_qkv, heads, kv_heads, d**-0.5, w_out, b_out, causal,
                               rotary=(cos, sin))  # fmt: skip
        assert_close(got, want, 1e-4, 1e-5, check_dtype=False)
    with pytest.raises(ValueError, match="not \\[batch, 1,"):
        attention(x, prepare_dense(w_qkv, b_qkv), heads, kv_heads, 0.3,
                  prepare_dense(w_out, b_out), None,
                  rotary=(np.ones((b, 2, s, d), np.float32),) * 2)  # fmt: skip


def test_attention_kernel_gives_nan_for_a_row_that_attends_to_nothing_as_softmax_does():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 24)).astype(np.float32)
    mask = np.zeros((1, 1, 5, 5), np.float32)
    mask[0, 0, 2] = -np.inf
    y = attention(x, prepare_dense(w), 1, 1, 0.3, prepare_dense(np.eye(8, dtype=np.float32)),
                  mask)  # fmt: skip
    assert np.isnan(y[0, 2]).all() and not np.isnan(np.delete(y[0], 2, axis=0)).any()


def test_attention_kernel_zeroes_the_rows_sdpa_guards():
    """sdpa's export guards its Softmax (Where(IsNaN(p), 0, p)): a query with every key masked,
    or with a NaN score (a NaN key: NaN + -inf is NaN, so every query of its batch), gives a
    row of zeros before the output linear (its bias here); other rows are the unguarded
    kernel's."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 37, 8)).astype(np.float32)
    x[1, 30, 3] = np.nan  # key 30 of batch 1 is NaN: every score against it is
    w = rng.standard_normal((8, 24)).astype(np.float32)
    mask = np.zeros((2, 1, 37, 37), np.float32)
    mask[0, 0, 2] = -np.inf  # query 2 of batch 0 sees no key
    mask[1, 0, :, 30] = -np.inf
    b_out = rng.standard_normal(8).astype(np.float32)
    args = (x, prepare_dense(w), 2, 2, 0.3, prepare_dense(np.eye(8, dtype=np.float32), b_out),
            mask)  # fmt: skip
    plain, guarded = attention(*args), attention(*args, nan_to_zero=True)
    nan_rows = np.zeros((2, 37), bool)
    nan_rows[0, 2] = nan_rows[1] = True
    assert (np.isnan(plain).any(axis=2) == nan_rows).all()
    np.testing.assert_array_equal(guarded[nan_rows], np.broadcast_to(b_out, (38, 8)))
    np.testing.assert_array_equal(guarded[~nan_rows], plain[~nan_rows])


@pytest.mark.parametrize("seed,act", list(enumerate(["identity", "gelu", "gelu_tanh"])))
@pytest.mark.parametrize("n", [23, 1000])  # one column panel, many work items
def test_linear_act_kernel_against_naive(seed, act, n):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((37, 19)) * 3).astype(np.float32)
    w = rng.standard_normal((19, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal((37, n)).astype(np.float32)
    t = x.astype(np.float64) @ w + b
    if act == "gelu":
        t = 0.5 * t * (1 + np.vectorize(math.erf)(t / math.sqrt(2)))
    elif act == "gelu_tanh":
        t = 0.5 * t * (1 + np.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
    plan = prepare_dense(w, b, encode(act))
    assert_close(linear_act(x, plan, r), t + r, 1e-4, 1e-4, check_dtype=False)
    y = linear_act(np.full((2, 19), np.nan, np.float32), plan)
    assert np.isnan(y).all()  # NaN passes through the clamps


# rows of one lane, a whole number of vectors at either width, a tail; the serial and the
# parallel driver
@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("n", [1, 31, 256, SERIAL_MAX // 30 + 1])
@pytest.mark.parametrize("width", [8, 16])
def test_layer_norm_kernel_against_naive(n, width, parallel):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 6, n)) + 100).astype(np.float32)  # |mean| >> std
    g, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    s = x.astype(np.float64) + 1
    want = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5) * g + b
    y, total = layer_norm(x, g, b, 1e-5, residual=np.float32(1), return_sum=True, width=width,
                          parallel=parallel)  # fmt: skip
    assert_close(y, want, 1e-4, 1e-4, check_dtype=False)
    assert_close(total, s, 1e-6, 0, check_dtype=False)
    rms = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * g
    got = layer_norm(x, g, None, 1e-6, rms=True, width=width, parallel=parallel)
    assert_close(got, rms, 1e-4, 1e-5, check_dtype=False)


def test_kernels_refuse_bad_shapes():
    with pytest.raises(ValueError, match="cannot multiply"):
        linear_act(np.ones((2, 3), np.float32), prepare_dense(np.ones((4, 5), np.float32)))
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(np.ones((1, 4, 8), np.float32), prepare_dense(np.ones((8, 24), np.float32)),
                  1, 1, 1.0, prepare_dense(np.ones((8, 8), np.float32)),
                  np.zeros((1, 1, 3, 4), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        layer_norm(np.ones((2, 3)), np.ones(3))
