"""The dense GEMM (kernels/dense_gemm.py) at W = 8 and W = 16 in one process (a plan's width is
an argument: 16 lanes on AVX2 are ymm pairs), against NumPy in float64: odd M, N, K (partial
row tiles, masked columns), K cut into blocks (partial sums through the output, the epilogue
after the last), the activations and the residual, NaN and inf as onnxruntime's MatMul + Add
gives them, outputs into a given buffer, the same bits at any thread count, and the split
of the work."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import assert_close, run_ort
from onnx import TensorProto, helper, numpy_helper

from fusion_kernels._gemm import row_tile
from fusion_kernels.config import get_threads, set_threads
from fusion_kernels.dense_gemm import blocking, dense_gemm, prepare_dense
from fusion_kernels.machine import cache_bytes
from fusion_kernels.simd.activation import encode
from fusion_kernels.simd.tile import tile

WIDTHS = (8, 16)
SIZES = (1, 3, 17, 100)
SQRT2 = math.sqrt(2)


def operands(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(np.float32)
    return x, w, rng.standard_normal(n).astype(np.float32)


def product(x, w, b):
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float64) @ w.astype(np.float64) + b


NAIVE = {  # the activations on float64, as ONNX defines them
    "identity": lambda t: t,
    "relu": lambda t: np.maximum(t, 0),
    "clip": lambda t: np.clip(t, -0.5, 0.75),
    "gelu": lambda t: 0.5 * t * (1 + np.vectorize(math.erf)(t / SQRT2)),
    "gelu_tanh": lambda t: 0.5 * t * (1 + np.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3))),
    "silu": lambda t: t / (1 + np.exp(-t)),
    "sigmoid": lambda t: 1 / (1 + np.exp(-t)),
    "leaky_relu": lambda t: np.where(t < 0, 0.1 * t, t),
}
KEYWORDS = {"clip": {"clip_min": -0.5, "clip_max": 0.75}, "leaky_relu": {"alpha": 0.1}}


@pytest.mark.parametrize("width", WIDTHS)
def test_odd_sizes(width):
    for m, k, n in itertools.product(SIZES, SIZES, SIZES):
        x, w, b = operands(m, k, n, seed=m * 10007 + n * 101 + k)
        got = dense_gemm(x, prepare_dense(w, b, width=width))
        assert_close(got, product(x, w, b), 1e-5, 1e-5, check_dtype=False, what=f"{m}x{k}x{n}")
        x.setflags(write=False)  # a graph input or initializer (one row is read in place)
        got = dense_gemm(x, prepare_dense(w, b, width=width))
        assert_close(got, product(x, w, b), 1e-5, 1e-5, check_dtype=False, what=f"{m}x{k}x{n}")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("act", list(NAIVE))
@pytest.mark.parametrize("m", [37, 1, 3])  # 1 and 3: tiles of M rows (row_tile), x unpacked at 1
def test_activations_and_residual(width, act, m):
    x, w, b = operands(m, 19, 53, seed=5)
    r = np.random.default_rng(6).standard_normal((m, 53)).astype(np.float32)
    plan = prepare_dense(w, b, encode(act, **KEYWORDS.get(act, {})), width=width)
    want = NAIVE[act](product(x, w, b))
    assert_close(dense_gemm(x, plan), want, 1e-5, 1e-5, check_dtype=False, what=act)
    assert_close(dense_gemm(x, plan, residual=r), want + r, 1e-5, 1e-5, check_dtype=False)
    row = r[0]  # a residual that broadcasts to [M, N]
    assert_close(dense_gemm(x, plan, residual=row), want + row, 1e-5, 1e-5, check_dtype=False)


@pytest.mark.parametrize("width", WIDTHS)
def test_k_in_blocks(width):
    """K past the K block (a quarter of L2 per panel, blocking()): partial sums through y, the
    bias, GELU and the residual once, after the last block."""
    plan = prepare_dense(np.zeros((1, 1), np.float32), width=width)
    nr = plan.tile.cols * plan.lanes.width
    k = cache_bytes(2) // (8 * nr) + 7  # three blocks or more
    assert blocking(5, k, 30, plan.tile.rows, nr, 1)[2] < k
    x, w, b = operands(5, k, 30, seed=7)
    r = np.ones((5, 30), np.float32)
    got = dense_gemm(x, prepare_dense(w, b, encode("gelu"), width=width), residual=r)
    assert_close(got, NAIVE["gelu"](product(x, w, b)) + 1, 1e-5, 1e-4, check_dtype=False)


def linear_model(w, b):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", w.shape[1]])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("width", WIDTHS)
def test_nan_and_inf_as_onnxruntime(width):
    """A NaN in x makes its row NaN (every weight multiplies it, 0 included); an inf makes its
    row inf or NaN as the weights' signs and zeros say; the other rows are untouched."""
    x, w, b = operands(9, 20, 41, seed=8)
    w[3, 5] = 0.0  # inf * 0 is NaN
    x[2, 7], x[6, 3] = np.nan, np.inf
    got = dense_gemm(x, prepare_dense(w, b, width=width))
    assert np.isnan(got[2]).all() and np.isnan(got[6, 5])
    (want,) = run_ort(linear_model(w, b), {"x": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    assert_close(got[finite], want[finite], 1e-5, 1e-5)


def test_into_a_given_output_empty_sizes_and_refusals():
    x, w, b = operands(6, 8, 10, seed=9)
    plan = prepare_dense(w, b)
    buffer = np.full(70, 7.0, np.float32)
    out = buffer[5:65].reshape(6, 10)  # a C-contiguous view inside a bigger buffer
    assert dense_gemm(x, plan, out=out) is out
    assert_close(out, product(x, w, b), 1e-5, 1e-5, check_dtype=False)
    assert (buffer[:5] == 7).all() and (buffer[65:] == 7).all()
    with pytest.raises(ValueError, match="cannot multiply"):
        dense_gemm(np.ones((6, 9), np.float32), plan)
    with pytest.raises(ValueError, match="float32"):
        dense_gemm(x.astype(np.float64), plan)
    with pytest.raises(ValueError, match="C-contiguous"):
        dense_gemm(x, plan, out=np.empty((10, 6), np.float32).T)
    with pytest.raises(ValueError, match="does not match"):
        prepare_dense(w, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="activation kind"):
        prepare_dense(w, act=(99, 0.0, 0.0))
    assert dense_gemm(np.ones((0, 8), np.float32), plan).shape == (0, 10)
    bias = np.arange(5, dtype=np.float32)
    no_k = dense_gemm(np.ones((3, 0), np.float32), prepare_dense(np.zeros((0, 5)), bias))
    np.testing.assert_array_equal(no_k, np.broadcast_to(bias, (3, 5)))  # K = 0: the bias


def test_the_same_bits_at_any_thread_count():
    """Each output belongs to one tile, summed in one order, whatever thread runs it."""
    x, w, b = operands(130, 70, 300, seed=10)
    plan = prepare_dense(w, b, encode("silu"))
    before = get_threads()
    try:
        runs = []
        for threads in (1, 2):
            set_threads(threads)
            runs.append(dense_gemm(x, plan))
    finally:
        set_threads(before)
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("m,k,n", [(1, 768, 768), (128, 768, 768), (128, 256, 1024), (7, 3000, 33),
                                   (512, 768, 2304)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_split_of_the_work(m, k, n, threads):
    """K in equal blocks, every row tile and column panel in some item, and the threads' shares
    of the tiles within one item's tiles of each other (prange's equal item counts)."""
    mr, nr = 4, 24
    n_rb, n_cb, kc = blocking(m, k, n, mr, nr, threads)
    n_kb = -(-k // kc)
    assert kc * n_kb >= k and kc * (n_kb - 1) < k
    row_tiles, panels = -(-m // mr), -(-n // nr)
    assert 1 <= n_rb <= row_tiles and 1 <= n_cb <= panels
    rows = [(i + 1) * row_tiles // n_rb - i * row_tiles // n_rb for i in range(n_rb)]
    cols = [(i + 1) * panels // n_cb - i * panels // n_cb for i in range(n_cb)]
    items = [c * r for c in cols for r in rows]  # column blocks outer, as the kernel runs them
    q, rem = divmod(len(items), threads)
    counts = [q + (t < rem) for t in range(threads)]
    shares = [sum(items[sum(counts[:t]) : sum(counts[: t + 1])]) for t in range(threads)]
    assert sum(shares) == row_tiles * panels
    assert max(shares) - sum(shares) / threads <= max(items)


@pytest.mark.parametrize("full", [tile(14, 2), tile(4, 3), tile(6, 4)])
def test_the_row_tile_pads_m_the_least(full):
    """Of the row counts whose rank-1 update does 1.5 FMAs per load, the one with the fewest
    rows past M, ties to the most rows; never more rows than the register file's tile. An M
    below all of them: M rows (none padded)."""
    ok = [r for r in range(1, full.rows + 1) if 2 * r * full.cols >= 3 * (r + full.cols)]
    for m in range(1, 600):
        t = row_tile(m, full)
        assert t.cols == full.cols
        if m < min(ok):
            assert t.rows == m
            continue
        assert t.rows in ok
        padded = {r: -(-m // r) * r for r in ok}
        assert padded[t.rows] == min(padded.values())
        assert t.rows == max(r for r in ok if padded[r] == padded[t.rows])
    assert row_tile(128, tile(14, 2)).rows == 8  # 128 rows, not the 14-row tile's 140
    assert row_tile(14 * 9, tile(14, 2)) is tile(14, 2)
