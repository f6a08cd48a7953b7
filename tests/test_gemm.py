"""The GEMM micro-kernel (kernels/_gemm.py) at W = 8 and W = 16 in one process (a plan's width
is an argument: 16 lanes on AVX2 are ymm pairs), against NumPy in float64: odd M, N, K, the
bias + clip epilogue with NaN and inf passing as onnxruntime's compares let them, partial
tiles (rows past M not stored, columns past N masked), outputs that are channel slices of a
bigger buffer, B read in place, and the raw tiles of gemm_batch."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import naive_conv, naive_lstm

from fusion.models import LSTMWeights
from fusion_kernels import _gemm
from fusion_kernels.conv2d import conv2d_bias_act, output_shape, prepare_conv2d
from fusion_kernels.lstm import lstm_sequence, prepare_lstm

WIDTHS = (8, 16)
SIZES = (1, 3, 17, 100)


def packed_b(b, nr):
    """B [K, N] as NR-column panels [ceil(N / NR), K, NR] (zero columns past N), flat."""
    k, n = b.shape
    n_pan = -(-n // nr)
    padded = np.zeros((k, n_pan * nr), np.float32)
    padded[:, :n] = b
    return np.ascontiguousarray(padded.reshape(k, n_pan, nr).transpose(1, 0, 2)).ravel()


def reference(a, b, bias, lo, hi):
    """clip(a @ b + bias, lo, hi) in float64, NaN passing through (compares, not min/max)."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = a.astype(np.float64) @ b.astype(np.float64) + bias[:, None]
    y = np.where(y < lo, lo, y)
    return np.where(y > hi, hi, y)


def block(L, T, a, b, bias, lo, hi, out3, in_place=False):
    """gemm_block over all of a [M, K] and b [K, N] into out3[0] (any layout)."""
    m, k = a.shape
    n = b.shape[1]
    mr, nr = T.rows, T.cols * L.width
    ap = _gemm.pack_a(a, mr)
    lo, hi = np.float32(lo), np.float32(hi)
    if in_place:  # full panels straight from b's rows, the rest packed (as im2col's 1x1)
        full = n // nr
        _gemm.gemm_block(L, T, ap, 0, -(-m // mr), b, 0, nr, n, full, k, out3, 0, 0, m, 0, n,
                         bias, lo, hi)  # fmt: skip
        rest = np.ascontiguousarray(b[:, full * nr :])
        bp = packed_b(rest, nr) if rest.shape[1] else np.zeros(k * nr, np.float32)
        n_pan = -(-rest.shape[1] // nr)
        _gemm.gemm_block(L, T, ap, 0, -(-m // mr), bp, 0, k * nr, nr, n_pan, k, out3, 0, 0, m,
                         full * nr, n, bias, lo, hi)  # fmt: skip
    else:
        n_pan = -(-n // nr)
        _gemm.gemm_block(L, T, ap, 0, -(-m // mr), packed_b(b, nr), 0, k * nr, nr, n_pan, k,
                         out3, 0, 0, m, 0, n, bias, lo, hi)  # fmt: skip


def operands(m, n, k, seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) / math.sqrt(k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    return a, b, rng.standard_normal(m).astype(np.float32)


def tolerance(k):
    return dict(rtol=1e-5, atol=1e-5 * math.sqrt(k))


@pytest.mark.parametrize("width", WIDTHS)
def test_block_on_odd_sizes(width):
    L, T = _gemm.micro_tile(width)
    for m, n, k in itertools.product(SIZES, SIZES, SIZES):
        a, b, bias = operands(m, n, k, seed=m * 10007 + n * 101 + k)
        out = np.full((1, m, n), 7.0, np.float32)
        block(L, T, a, b, bias, -np.inf, np.inf, out)
        np.testing.assert_allclose(out[0], reference(a, b, bias, -np.inf, np.inf),
                                   err_msg=f"M={m} N={n} K={k}", **tolerance(k))  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_block_into_a_slice_stores_nothing_outside(width):
    """A channel slice of a wider buffer (Numba layout "A", stored through its strides), with
    a clip: the partial tiles touch neither the rows past M nor the columns past N."""
    L, T = _gemm.micro_tile(width)
    for m, n, k in ((17, 100, 3), (3, 17, 100), (1, 1, 17)):
        a, b, bias = operands(m, n, k, seed=k)
        buf = np.full((1, m + 5, n + 9), 7.0, np.float32)
        out = buf[:, 2 : 2 + m, 3 : 3 + n]
        block(L, T, a, b, bias, -0.5, 0.75, out)
        np.testing.assert_allclose(out[0], reference(a, b, bias, -0.5, 0.75), **tolerance(k))
        outside = np.ones(buf.shape, bool)
        outside[:, 2 : 2 + m, 3 : 3 + n] = False
        assert (buf[outside] == 7.0).all()


@pytest.mark.parametrize("width", WIDTHS)
def test_block_reads_b_in_place(width):
    """B's full panels read from its rows (row stride N), the last partial one packed."""
    L, T = _gemm.micro_tile(width)
    nr = T.cols * L.width
    for m, n, k in ((17, 3 * nr + 5, 17), (3, 2 * nr, 100), (100, nr - 1, 3)):
        a, b, bias = operands(m, n, k, seed=n)
        out = np.full((1, m, n), 7.0, np.float32)
        block(L, T, a, b, bias, 0.0, np.inf, out, in_place=True)
        np.testing.assert_allclose(out[0], reference(a, b, bias, 0.0, np.inf), **tolerance(k))


@pytest.mark.parametrize("width", WIDTHS)
def test_nan_and_inf_pass_as_onnxruntime_lets_them(width):
    """A NaN in A poisons its output row, an inf in B its column (inf, -inf or NaN as the
    signs fall); the clip leaves NaN alone and clamps the infinities."""
    L, T = _gemm.micro_tile(width)
    m, n, k = 17, 100, 17
    a, b, bias = operands(m, n, k, seed=3)
    a[4, 5] = np.nan
    b[2, 30], b[7, 61] = np.inf, -np.inf
    for lo, hi in ((-np.inf, np.inf), (0.0, 6.0)):
        out = np.empty((1, m, n), np.float32)
        block(L, T, a, b, bias, lo, hi, out)
        want = reference(a, b, bias, lo, hi)
        assert np.isnan(want[4]).all() and np.isnan(out[0, 4]).all()
        np.testing.assert_array_equal(np.isnan(out[0]), np.isnan(want))
        np.testing.assert_allclose(out[0], want, **tolerance(k))  # inf == inf, NaN == NaN


@pytest.mark.parametrize("width", WIDTHS)
def test_batch_stores_raw_tiles(width):
    """gemm_batch: n_b tiles, A and B of tile x at flat offsets a0 + x a_step, b0 + x b_step."""
    L, T = _gemm.micro_tile(width)
    mr, nr = T.rows, T.cols * L.width
    rng = np.random.default_rng(width)
    for k in SIZES:
        n_b = 3
        a = rng.standard_normal((n_b, k, mr)).astype(np.float32)
        b = rng.standard_normal((n_b, k, nr)).astype(np.float32)
        a[1, k - 1, mr - 1] = np.nan
        mt = np.empty((n_b, mr, nr), np.float32)
        pad = 5  # panels after a leading pad, as Winograd's V rows
        af, bf = np.concatenate([np.zeros(pad, np.float32), a.ravel()]), b.ravel()
        _gemm.gemm_batch(L, T, af, pad, k * mr, bf, 0, k * nr, n_b, k, mt)
        want = np.einsum("xki,xkj->xij", a.astype(np.float64), b)
        np.testing.assert_allclose(mt, want, **tolerance(k))
        assert np.isnan(mt[1, mr - 1]).all() and np.isfinite(mt[1, : mr - 1]).all()
        _gemm.gemm_batch(L, T, af, pad, 0, bf, 0, k * nr, n_b, k, mt)  # one A, several B
        np.testing.assert_allclose(mt[2], a[0].T.astype(np.float64) @ b[2], **tolerance(k))


CONVS = {  # (N, C, H, W, M, kernel, strides, pads, group, winograd_tile): one per path
    "im2col_gathered": (1, 5, 11, 10, 7, (3, 2), (1, 2), (1, 0, 2, 1), 1, 2),
    "1x1_in_place": (2, 24, 7, 9, 20, (1, 1), (1, 1), (0, 0, 0, 0), 2, 2),
    "1x1_copied": (1, 200, 5, 7, 9, (1, 1), (1, 1), (0, 0, 0, 0), 1, 2),
    "winograd2": (2, 16, 13, 11, 18, (3, 3), (1, 1), (1, 1, 1, 1), 1, 2),
    "winograd4": (1, 12, 9, 14, 10, (3, 3), (1, 1), (1, 1, 1, 1), 1, 4),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONVS))
def test_conv_plans_of_both_widths_in_one_process(name):
    n, c, h, w, m, kernel, strides, pads, group, tile = CONVS[name]
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    k = c // group * kernel[0] * kernel[1]
    wt = (rng.standard_normal((m, c // group, *kernel)) / math.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    kwargs = dict(strides=strides, pads=pads, group=group, activation="relu")
    for width in WIDTHS:
        plan = prepare_conv2d(wt, bias, winograd_tile=tile, width=width, **kwargs)
        assert plan.lanes.width == width and plan.tile == _gemm.micro_tile(width)[1]
        _, p = output_shape(x.shape, plan)
        want = naive_conv(x, wt, bias.reshape(1, m, 1, 1), strides, p, (1, 1), group, 0.0)
        np.testing.assert_allclose(conv2d_bias_act(x, plan), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", WIDTHS)
def test_lstm_plans_of_both_widths_in_one_process(width):
    """The input projection on the micro-kernel at either width (a block's 32 columns: 4 x 8
    or 2 x 16 lanes); 15 rows: a full tile and GEMV rows, or tiles with a partial one."""
    size, hidden, steps, batch = 7, 13, 5, 3
    w = LSTMWeights.random(size, hidden, seed=4)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps, batch, size)).astype(np.float32)
    h0, c0 = (rng.standard_normal((batch, hidden)).astype(np.float32) for _ in range(2))
    plan = prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb, width=width)
    assert plan.lanes.width == width and plan.tile.cols * width == 32
    for got, want in zip(lstm_sequence(x, h0, c0, plan), naive_lstm(x, h0, c0, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_bad_width():
    with pytest.raises(ValueError, match="lanes"):
        prepare_conv2d(np.ones((2, 2, 1, 1), np.float32), width=12)
