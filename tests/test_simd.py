"""The SIMD layer (kernels.simd), its approximations (kernels.simd.approx) and the activation
table (kernels.simd.activation), against NumPy: every operation at W = 8 and W = 16 (a Lanes
argument forces the width, so both run on any machine; 16 lanes on AVX2 are ymm pairs), on
data with NaN, +-inf, +-0 and denormals; masked tails of every length; the fits against float64
on dense grids; two small kernels written on the layer; the on-disk cache in fresh processes;
the width setting. Harnesses are compiled with the kernels' flags (kernels.config.JIT),
uncached."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

from fusion_kernels import simd
from fusion_kernels.config import FASTMATH, JIT, JIT_FIT
from fusion_kernels.simd import (
    activation,
    approx,
    borrow,
    hmax,
    hmin,
    hsum,
    mask_all,
    tail_mask,
    vall,
    vany,
    vbroadcast,
    vfma,
    vget,
    vload,
    vload_aligned,
    vload_masked,
    vmax,
    vmin,
    vpack,
    vpermute,
    vselect,
    vset,
    vstore,
    vstore_aligned,
    vstore_masked,
    vtranspose,
    vtranspose_part,
    vunpack,
    vzero,
)
from fusion_kernels.simd.activation import KINDS, activate, encode

ROOT = Path(__file__).resolve().parent.parent
HARNESS = dict(JIT, cache=False)
f32 = np.float32
ONE, ZERO = f32(1.0), f32(0.0)
TINY = np.finfo(np.float32).smallest_subnormal
FMAX = np.finfo(np.float32).max
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, TINY, -TINY, 3e-39, -3e-39, 1.1754944e-38,
                    FMAX, -FMAX, 1.0, -1.0, 0.5, 2.0], np.float32)  # fmt: skip


def _numba_features():
    """The CPU features Numba compiles for (+name / -name)."""
    from numba.core.registry import cpu_target

    return cpu_target.target_context.codegen().magic_tuple()[2].split(",")


def has_fma():
    return "+fma" in _numba_features()


@pytest.fixture(params=[8, 16], ids=["W8", "W16"])
def L(request):
    return simd.Lanes(request.param)


def mixed(n, seed, scale=3.0):
    """n float32 values: normal * scale, every third replaced by one of SPECIAL."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[::3] = rng.choice(SPECIAL, x[::3].size)
    return x


def ulps(y, ref):
    """|y - ref| in units of the last place of ref rounded to float32 (a denormal's spacing
    below FLT_MIN), where both are finite; ref in float64."""
    with np.errstate(over="ignore"):
        r32 = ref.astype(np.float32)
        spacing = np.spacing(np.abs(r32)).astype(np.float64)  # inf at FLT_MAX: 0 ulp
    return np.abs(y.astype(np.float64) - ref) / spacing


def assert_special_match(y, ref):
    """NaN where ref (float64, rounded to float32) is NaN, the same infinity where it is one."""
    with np.errstate(over="ignore"):
        r32 = ref.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(r32))
    inf = np.isinf(r32) | np.isinf(y)
    np.testing.assert_array_equal(y[inf], r32[inf])


def finite(y, ref):
    with np.errstate(over="ignore"):
        return np.isfinite(ref.astype(np.float32)) & np.isfinite(y)


# ---- element-wise operations ---------------------------------------------------------------------
N_BINARY = 22


@numba.jit(**HARNESS)
def _binary(L, x, y, z, out):
    for i in range(0, x.shape[0], L.width):
        a, b, c = vload(L, x, i), vload(L, y, i), vload(L, z, i)
        vstore(out[0], i, a + b)
        vstore(out[1], i, a - b)
        vstore(out[2], i, a * b)
        vstore(out[3], i, a / b)
        vstore(out[4], i, -a)
        vstore(out[5], i, abs(a))
        vstore(out[6], i, vfma(a, b, c))
        vstore(out[7], i, vmax(a, b))
        vstore(out[8], i, vmin(a, b))
        vstore(out[9], i, vselect(a < b, ONE, ZERO))
        vstore(out[10], i, vselect(a <= b, ONE, ZERO))
        vstore(out[11], i, vselect(a > b, ONE, ZERO))
        vstore(out[12], i, vselect(a >= b, ONE, ZERO))
        vstore(out[13], i, vselect(a == b, ONE, ZERO))
        vstore(out[14], i, vselect(a != b, ONE, ZERO))
        vstore(out[15], i, vselect((a < b) & ~(b < c) | (a == c) ^ (c > 0), a, c))
        vstore(out[16], i, 2 * a - 1.5)  # numbers on either side are broadcast
        vstore(out[17], i, f32(3) / a)
        acc = vzero(L) + a
        acc += b
        acc *= vbroadcast(L, x[i])
        vstore(out[18], i, acc)
        vstore(out[19], i, vfma(f32(0.5), b, 1.0))
        vstore(out[20], i, vmax(a, 0.0))
        vstore(out[21], i, vselect(a > 1.0, 1, vmin(b, c)))


def test_elementwise_ops_match_numpy(L):
    n = 16 * 64
    x, y, z = mixed(n, 1), mixed(n, 2), mixed(n, 3)
    x[:16], y[:16] = SPECIAL, SPECIAL[::-1]  # every special against every other, somewhere
    x[16:32], y[16:32] = SPECIAL, np.roll(SPECIAL, 5)
    out = np.full((N_BINARY, n), 7.0, np.float32)
    _binary(L, x, y, z, out)
    one = np.float32(1)
    with np.errstate(all="ignore"):
        exact = [x + y, x - y, x * y, x / y, -x, np.abs(x), None, np.maximum(x, y),
                 np.minimum(x, y), x < y, x <= y, x > y, x >= y, x == y, x != y,
                 np.where((x < y) & ~(y < z) | (x == z) ^ (z > 0), x, z), None, f32(3) / x,
                 (x + y) * np.repeat(x[:: L.width], L.width), None, np.maximum(x, f32(0)),
                 np.where(x > 1, one, np.minimum(y, z))]  # fmt: skip
        # a b + c: rounded once with FMA; without it the product is rounded (and may overflow)
        product = x.astype(np.float64) * y if has_fma() else (x * y).astype(np.float64)
        fused = {6: product + z, 16: 2.0 * x.astype(np.float64) - 1.5,
                 19: 0.5 * y.astype(np.float64) + 1.0}  # fmt: skip
    for k, ref in enumerate(exact):
        if ref is not None:  # bit for bit, NaN where NumPy has NaN (+-0 compare equal)
            np.testing.assert_array_equal(out[k], ref.astype(np.float32), err_msg=f"op {k}")
    for k, ref in fused.items():  # within an ulp (a double rounding in the reference)
        assert_special_match(out[k], ref)
        ok = finite(out[k], ref)
        assert ulps(out[k][ok], ref[ok]).max() <= 1, f"op {k}"


# ---- lanes and reductions ------------------------------------------------------------------------
@numba.jit(**HARNESS)
def _lanes(L, x, out, lane_out):
    w = L.width
    for c in range(x.shape[0] // w):
        v = vload(L, x, c * w)
        out[0, c] = hsum(v)
        out[1, c] = hmax(v)
        out[2, c] = hmin(v)
        out[3, c] = vany(v > 0)
        out[4, c] = vall(v > 0)
        out[5, c] = vget(v, c % w)
        vstore(lane_out, c * w, vset(v, (c + 1) % w, -5.0))


def test_lane_ops_and_reductions(L):
    w = L.width
    rng = np.random.default_rng(4)
    x = rng.standard_normal(w * 200).astype(np.float32)
    x[: 16 * w : 3] = rng.choice(SPECIAL, x[: 16 * w : 3].size)  # 16 vectors with specials
    x[16 * w : 17 * w] = 1.0  # all positive: vall
    out = np.zeros((6, x.size // w), np.float32)
    lane_out = np.zeros_like(x)
    _lanes(L, x, out, lane_out)
    chunks = x.reshape(-1, w).astype(np.float64)
    with np.errstate(invalid="ignore"):
        total = chunks.sum(axis=1)
    assert_special_match(out[0], total)
    ok = np.isfinite(total)
    bound = w * np.finfo(np.float32).eps * np.abs(chunks[ok]).sum(axis=1)  # any summation order
    assert np.all(np.abs(out[0][ok] - total[ok]) <= bound)
    np.testing.assert_array_equal(out[1], chunks.max(axis=1).astype(np.float32))  # NaN if any
    np.testing.assert_array_equal(out[2], chunks.min(axis=1).astype(np.float32))
    np.testing.assert_array_equal(out[3], (chunks > 0).any(axis=1))
    np.testing.assert_array_equal(out[4], (chunks > 0).all(axis=1))
    assert out[4].sum() >= 1
    lanes = np.arange(len(chunks))
    np.testing.assert_array_equal(out[5], x.reshape(-1, w)[lanes, lanes % w])
    ref = x.reshape(-1, w).copy()
    ref[lanes, (lanes + 1) % w] = -5.0
    np.testing.assert_array_equal(lane_out, ref.ravel())


@numba.jit(**HARNESS)
def _permute(L, x, idx, out):
    w = L.width
    for i in range(x.size // w):
        vstore(out, i * w, vpermute(vload(L, x, i * w), idx, i * w))


def test_permute_takes_the_lanes_its_table_names(L):
    """Each vector its own random lane map (repeats allowed, NaN and inf carried as any
    value); an index past the width wraps (idx & (W - 1)), it is never undefined."""
    w = L.width
    rng = np.random.default_rng(5)
    x = rng.standard_normal(w * 64).astype(np.float32)
    x[::7] = rng.choice(SPECIAL, x[::7].size)
    idx = rng.integers(0, w, x.size).astype(np.int32)
    idx[-w:] = np.arange(w, 2 * w)  # out of range: lane k
    out = np.zeros_like(x)
    _permute(L, x, idx, out)
    rows = x.reshape(-1, w)
    want = rows[np.arange(len(rows))[:, None], idx.reshape(-1, w) % w]
    np.testing.assert_array_equal(out.reshape(-1, w), want)


@numba.jit(**HARNESS)
def _transpose(L, x, xo, ldx, nx, y, yo, ldy, ny, part):
    if part:
        vtranspose_part(L, x, xo, ldx, nx, y, yo, ldy, ny)
    else:
        vtranspose(L, x, xo, ldx, y, yo, ldy)


@pytest.mark.parametrize("w", simd.WIDTHS)
@pytest.mark.parametrize("nx, ny", [(None, None), (1, 0), (3, 16), (16, 5), (0, 2), (7, 7)])
def test_transposes_move_a_block_and_no_more(w, nx, ny):
    """y[yo + k ldy + j] = x[xo + j ldx + k], NaN and inf carried, at every width; with counts,
    x's rows past nx read as zeros (here they lie past the array's end) and y's rows past ny
    untouched."""
    L = simd.lanes(w)
    part = nx is not None
    nx, ny = (w, w) if not part else (min(nx, w), min(ny, w))
    ldx, ldy, xo, yo = w + 3, w + 5, 2, 1
    x = mixed(xo + (nx - 1) * ldx + w if nx else 1, 6)  # rows past nx: outside x
    y = np.full(yo + w * ldy, -7.0, np.float32)
    _transpose(L, x, xo, ldx, nx, y, yo, ldy, ny, part)
    want = np.full_like(y, -7.0)
    for k in range(ny):
        for j in range(w):
            want[yo + k * ldy + j] = x[xo + j * ldx + k] if j < nx else 0.0
    np.testing.assert_array_equal(y, want)


# ---- loads and stores ----------------------------------------------------------------------------
@numba.jit(**HARNESS)
def _copy(L, src, dst, i, aligned):
    if aligned:
        vstore_aligned(dst, i, vload_aligned(L, src, i) + 1.0)
    else:
        vstore(dst, i, vload(L, src, i) + 1.0)


@numba.jit(**HARNESS)
def _copy_masked(L, src, dst, i, n, loaded):
    m = tail_mask(L, n)
    v = vload_masked(L, src, i, m)
    vstore(loaded, 0, v)
    vstore_masked(dst, i, v + 1.0, m)


@numba.jit(**HARNESS)
def _copy_borrowed(L, src, dst, i, n):
    """_copy and _copy_masked's stores at offsets i and i + W, through borrowed pointers."""
    sp, dp = borrow(src), borrow(dst)
    vstore(dp, i, vload(L, sp, i) + 1.0)
    m = tail_mask(L, n)
    vstore_masked(dp, i + L.width, vload_masked(L, sp, i + L.width, m) + 1.0, m)


@numba.jit(**HARNESS)
def _borrow_any(a):
    return borrow(a)


@numba.jit(**HARNESS)
def _load_if(L, src, i, flag, loaded):
    vstore(loaded, 0, vload_masked(L, src, i, mask_all(L, flag)))


def test_a_whole_vector_mask_loads_all_lanes_or_none(L):
    """mask_all(L, flag): every lane or none; none reads nothing (here from an offset past the
    array's end, which a plain load would read)."""
    w = L.width
    src = mixed(2 * w, 8)
    loaded = np.empty(w, np.float32)
    _load_if(L, src, w, True, loaded)
    np.testing.assert_array_equal(loaded, src[w:])
    _load_if(L, src, 2 * w, False, loaded)
    np.testing.assert_array_equal(loaded, np.zeros(w, np.float32))


def aligned_array(n, align=64):
    """n float32 values starting on an `align`-byte boundary."""
    raw = np.empty(n + align // 4, np.float32)
    skip = (-raw.ctypes.data % align) // 4
    return raw[skip : skip + n]


def test_loads_and_stores(L):
    w = L.width
    src = aligned_array(4 * w)
    src[:] = mixed(4 * w, 5)
    for i, aligned in ((0, True), (w, True), (3, False), (2 * w + 1, False)):
        dst = aligned_array(4 * w)
        dst[:] = 7.0
        _copy(L, src, dst, i, aligned)
        ref = np.full(4 * w, 7.0, np.float32)
        ref[i : i + w] = src[i : i + w] + f32(1)
        np.testing.assert_array_equal(dst, ref)


def test_borrowed_pointers_load_and_store_as_their_arrays_do(L):
    """borrow(a): a's data as a pointer, which vload/vstore (masked or not) take in place of a,
    at the same flat offsets; only float32 C-contiguous arrays lend one."""
    w = L.width
    src = mixed(4 * w, 8)
    for i, n in ((0, w), (3, 5), (w + 1, 0)):
        dst = np.full(4 * w, 7.0, np.float32)
        _copy_borrowed(L, src, dst, i, n)
        ref = np.full(4 * w, 7.0, np.float32)
        ref[i : i + w + n] = src[i : i + w + n] + f32(1)
        np.testing.assert_array_equal(dst, ref, err_msg=f"at {i}, tail {n}")
    for bad in (np.zeros(4, np.int64), np.zeros((4, 4), np.float32)[:, ::2]):
        with pytest.raises(numba.core.errors.TypingError, match="borrow"):
            _borrow_any(bad)


def test_masked_tails_touch_only_their_lanes(L):
    """Every tail length 0 .. W (and below 0, above W): the masked lanes are loaded and stored,
    the others load as 0 and leave the guard values around the destination as they were."""
    w = L.width
    src = mixed(3 * w, 6)
    loaded = np.empty(w, np.float32)
    for n in (-1, *range(w + 1), w + 3):
        for i in (0, w + 3):
            dst = np.full(3 * w, 7.0, np.float32)
            _copy_masked(L, src, dst, i, n, loaded)
            k = min(max(n, 0), w)
            ref = np.full(3 * w, 7.0, np.float32)
            ref[i : i + k] = src[i : i + k] + f32(1)
            np.testing.assert_array_equal(dst, ref, err_msg=f"tail {n} at {i}")
            np.testing.assert_array_equal(loaded[:k], src[i : i + k])
            assert not loaded[k:].any(), f"tail {n}: lanes past it must load as 0"


def test_masked_tail_at_the_end_of_mapped_memory(L):
    """A tail ending where the next page is unmapped: the masked-off lanes are not touched (an
    unmasked load or store there would fault)."""
    page, w = mmap.PAGESIZE, L.width
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    buf = mmap.mmap(-1, 4 * page)
    mem = np.frombuffer(buf, np.float32)
    n_page = page // 4
    src, dst = mem[:n_page], mem[2 * n_page : 3 * n_page]
    src[:] = np.arange(n_page, dtype=np.float32)
    for start in (page, 3 * page):
        assert libc.mprotect(mem.ctypes.data + start, page, 0) == 0  # PROT_NONE
    try:
        loaded = np.empty(w, np.float32)
        for n in range(w):
            dst[:] = -1.0
            _copy_masked(L, src, dst, n_page - n, n, loaded)
            assert np.array_equal(dst[n_page - n :], src[n_page - n :] + f32(1))
            assert np.all(dst[: n_page - n] == -1.0)
    finally:
        for start in (page, 3 * page):
            libc.mprotect(mem.ctypes.data + start, page, mmap.PROT_READ | mmap.PROT_WRITE)
        del src, dst, mem
        buf.close()


# ---- exp, sigmoid, tanh, erf ---------------------------------------------------------------------
@numba.jit(**HARNESS)
def _fits(L, x, out):
    for i in range(0, x.shape[0], L.width):
        v = vload(L, x, i)
        vstore(out[0], i, approx.exp(v))
        vstore(out[1], i, approx.sigmoid(v))
        vstore(out[2], i, approx.tanh(v))
        vstore(out[3], i, approx.erf(v))
        vstore(out[4], i, approx.log1p01(abs(v)))


@numba.jit(**HARNESS)
def _fits_scalar(x, out):
    for i in range(x.shape[0]):
        out[0, i] = approx.exp(x[i])
        out[1, i] = approx.sigmoid(x[i])
        out[2, i] = approx.tanh(x[i])
        out[3, i] = approx.erf(x[i])
        out[4, i] = approx.log1p01(abs(x[i]))


def fit_grid():
    """A dense grid over [-120, 120], one over tiny magnitudes down to the denormals, and the
    specials, padded to a multiple of 16."""
    tiny = np.geomspace(TINY, 1.0, 20000)
    x = np.concatenate([np.linspace(-120, 120, 600001), tiny, -tiny, SPECIAL])
    x = x.astype(np.float32)
    return np.concatenate([x, np.zeros(-x.size % 16, np.float32)])


def fit_references(x):
    xd = x.astype(np.float64)
    with np.errstate(all="ignore"):
        erf = np.array([math.erf(v) if not math.isnan(v) else v for v in xd.tolist()])
        a = np.abs(xd)
        return {"exp": np.exp(xd), "sigmoid": 1 / (1 + np.exp(-xd)), "tanh": np.tanh(xd),
                "erf": erf, "log1p01": np.where(a <= 1, np.log1p(a), np.nan)}  # fmt: skip


# the maximum errors measured (kernels/simd/approx.py), with a little room; tanh and erf lose
# a little without FMA (5.3 ulp, 4.1e-7: measured with NUMBA_CPU_NAME=x86-64 NUMBA_CPU_FEATURES="")
ULP_BOUND = {"exp": 1.5, "sigmoid": 3.0, "tanh": 5.0 if has_fma() else 6.0, "log1p01": 3.0}
ERF_ABS = 3.5e-7 if has_fma() else 5e-7


@pytest.mark.parametrize("w", [8, 16, 0], ids=["W8", "W16", "scalar"])
def test_fit_accuracy(w):
    x = fit_grid()
    out = np.zeros((5, x.size), np.float32)
    if w:
        _fits(simd.Lanes(w), x, out)
    else:
        _fits_scalar(x, out)
    errors = {}
    for k, (name, ref) in enumerate(fit_references(x).items()):
        y = out[k]
        on = ~np.isnan(ref) if name == "log1p01" else slice(None)  # log1p01 is for [0, 1]
        y, ref = y[on], ref[on]
        assert_special_match(y, ref)
        ok = finite(y, ref)
        errors[name] = ulps(y[ok], ref[ok]).max(), np.abs(y[ok] - ref[ok]).max()
        print(f"{name} (W={w or 'scalar'}): max {errors[name][0]:.2f} ulp, "
              f"{errors[name][1]:.3g} absolute")  # fmt: skip
    assert errors.pop("erf")[1] <= ERF_ABS
    assert all(errors[name][0] <= bound for name, bound in ULP_BOUND.items()), errors


def test_fit_limits(L):
    """The ends: exp underflows without NaN and overflows to inf; sigmoid, tanh and erf reach
    their limits exactly; infinities go to the limits; NaN stays NaN."""
    x = np.concatenate([np.linspace(-200, 200, 40000), SPECIAL]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])
    out = np.zeros((5, x.size), np.float32)
    _fits(L, x, out)
    ex, sig, th, erf = out[:4]
    nan = np.isnan(x)
    assert np.all(np.isnan(out[:, nan]))
    assert not np.isnan(out[:4, ~nan]).any()
    below = x < -87.34  # e^x below FLT_MIN: a denormal or 0
    assert np.all((ex[below] >= 0) & (ex[below] < 1.1754944e-38)) and np.all(ex[x < -104] == 0)
    assert np.all(ex[x > 88.73] == np.inf) and np.all(np.isfinite(ex[x < 88.72]))
    assert np.all(sig[x < -104] == 0) and np.all(sig[x > 17] == 1)
    assert np.all((sig[~nan] >= 0) & (sig[~nan] <= 1))
    assert np.all(th[x > 9.1] == 1) and np.all(th[x < -9.1] == -1)
    assert np.all(np.abs(th[~nan]) <= 1)
    assert np.all(erf[x >= 4] == 1) and np.all(erf[x <= -4] == -1)
    assert np.signbit(th[x == 0]).tolist() == np.signbit(x[x == 0]).tolist()  # tanh(-0) = -0


# ---- the activation table ------------------------------------------------------------------------
@numba.jit(**HARNESS)
def _activate(L, kind, a, b, x, out):
    for i in range(0, x.shape[0], L.width):
        vstore(out, i, activate(kind, a, b, vload(L, x, i)))


@numba.jit(**HARNESS)
def _activate_scalar(kind, a, b, x, out):
    for i in range(x.shape[0]):
        out[i] = activate(kind, a, b, x[i])


def _erf(x):
    return np.array([math.erf(v) if not math.isnan(v) else v for v in x.tolist()])


def _sig(x):
    return 1 / (1 + np.exp(-x))


REFERENCE = {  # float64, onnxruntime's formulas
    "identity": lambda x, a, b: x,
    "relu": lambda x, a, b: np.maximum(x, 0),
    "leaky_relu": lambda x, a, b: np.where(x < 0, a * x, x),
    "clip": lambda x, a, b: np.minimum(np.maximum(x, a), b),
    "sigmoid": lambda x, a, b: _sig(x),
    "tanh": lambda x, a, b: np.tanh(x),
    "hard_sigmoid": lambda x, a, b: np.clip(a * x + b, 0, 1),
    "hard_swish": lambda x, a, b: x * np.clip(x / 6 + 0.5, 0, 1),
    "silu": lambda x, a, b: x * _sig(x),
    "gelu": lambda x, a, b: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x, a, b: (
        0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    ),
    "elu": lambda x, a, b: np.where(x < 0, a * np.expm1(x), x),
    "selu": lambda x, a, b: b * np.where(x > 0, x, a * np.expm1(x)),
    "softplus": lambda x, a, b: np.logaddexp(0, x),
    "softsign": lambda x, a, b: x / (1 + np.abs(x)),
}
EXACT = {"identity", "relu", "leaky_relu", "clip"}
CASES = [(k, {}) for k in KINDS] + [
    ("leaky_relu", {"alpha": 0.1}),
    ("clip", {"clip_min": -1.5, "clip_max": 6.0}),
    ("hard_sigmoid", {"alpha": 0.3, "beta": 0.4}),
    ("elu", {"alpha": 1.3}),
]


def test_table_covers_every_kind():
    assert sorted(REFERENCE) == sorted(KINDS)


@pytest.mark.parametrize("w", [8, 16, 0], ids=["W8", "W16", "scalar"])
def test_activations_match_numpy(w):
    x = np.concatenate([np.linspace(-25, 25, 4001), mixed(4000, 7, 6.0), SPECIAL])
    x = x.astype(np.float32)
    x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])
    for name, params in CASES:
        kind, a, b = encode(name, **params)
        out = np.empty_like(x)
        if w:
            _activate(simd.Lanes(w), kind, a, b, x, out)
        else:
            _activate_scalar(kind, a, b, x, out)
        with np.errstate(all="ignore"):
            ref = REFERENCE[name](x.astype(np.float64), float(a), float(b))
        assert_special_match(out, ref)
        ok = finite(out, ref)
        if name in EXACT:
            np.testing.assert_array_equal(out[ok], ref[ok].astype(np.float32), err_msg=name)
        else:  # x f(x) has f's absolute error times |x| (gelu near -5: 0.5 |x| erf's error)
            err = np.abs(out[ok] - ref[ok])
            assert np.all(err <= 2e-6 * np.abs(ref[ok]) + 5e-7 * np.maximum(1, np.abs(x[ok]))), name


@numba.jit(**HARNESS)
def _clip_kinds(L, kind, a, b, x, out):
    """out[0] = activate, out[1] = clip by clip_bounds, on vectors; out[2] the same on scalars."""
    lo, hi = activation.clip_bounds(kind, a, b)
    for i in range(0, x.shape[0], L.width):
        v = vload(L, x, i)
        vstore(out[0], i, activate(kind, a, b, v))
        vstore(out[1], i, activation.clip(v, lo, hi))
    for i in range(x.shape[0]):
        out[2, i] = activation.clip(x[i], lo, hi)


def test_clipping_kinds_are_their_clip(L):
    """identity, relu and clip are clip(v, *clip_bounds(kind, a, b)), NaN and signs included;
    the other kinds are not clips."""
    x = np.concatenate([SPECIAL, mixed(4 * 16, 3)])
    for name, params in [("identity", {}), ("relu", {}), ("clip", {"clip_min": -0.5}),
                         ("clip", {"clip_min": -1.0, "clip_max": 6.0})]:  # fmt: skip
        kind, a, b = encode(name, **params)
        assert kind in activation.CLIPPING and activation.clips(kind)
        out = np.empty((3, x.size), np.float32)
        _clip_kinds(L, kind, a, b, x, out)
        for row in out[1:]:  # bit for bit (-0 included)
            np.testing.assert_array_equal(row.view(np.int32), out[0].view(np.int32), name)
    assert activation.clip_bounds(*encode("relu")) == (0.0, np.inf)
    assert activation.clip_bounds(*encode("sigmoid")) == (-np.inf, np.inf)
    others = [k for k in range(len(KINDS)) if k not in activation.CLIPPING]
    assert not any(activation.clips(k) for k in others)


@numba.jit(**HARNESS)
def _tuples(L, x, out):
    """out = unpack(pack(x tuple) * 2) + 1, through tuples of W."""
    w = L.width
    for i in range(0, x.shape[0], w):
        t = vunpack(vload(L, x, i) * f32(2.0))
        for k in range(w):
            out[i + k] = t[k] + f32(1.0)
    t8 = (x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7])
    vstore(out, x.shape[0], vpack(t8) - f32(1.0))
    vstore(out, x.shape[0] + 8, vpack((1, 2, 3, 4, 5, 6, 7, 8.5)))


def test_tuples_pack_and_unpack(L):
    x = mixed(4 * 16, 5)
    out = np.empty(x.size + 16, np.float32)
    _tuples(L, x, out)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(out[: x.size], x * f32(2.0) + f32(1.0))
        np.testing.assert_array_equal(out[x.size : x.size + 8], x[:8] - f32(1.0))
    np.testing.assert_array_equal(out[x.size + 8 :], [1, 2, 3, 4, 5, 6, 7, 8.5])


def test_encode():
    assert encode() == (activation.IDENTITY, 0.0, 0.0)
    assert encode("leaky_relu") == (activation.LEAKY_RELU, f32(0.01), 0.0)
    assert encode("hard_sigmoid", alpha=0.25) == (activation.HARD_SIGMOID, 0.25, 0.5)
    assert encode("relu6") == (activation.CLIP, 0.0, 6.0)
    assert encode("clip", 9.0, 9.0, clip_min=0.0, clip_max=6.0) == (activation.CLIP, 0.0, 6.0)
    assert encode("relu", clip_min=-1.0, clip_max=6.0) == (activation.CLIP, 0.0, 6.0)
    assert encode(None, clip_min=-1.0) == (activation.CLIP, -1.0, np.inf)
    assert encode("relu") == (activation.RELU, 0.0, 0.0)
    with pytest.raises(ValueError, match="one of"):
        encode("swish7")
    with pytest.raises(ValueError, match="no clip bounds"):
        encode("sigmoid", clip_max=1.0)
    with pytest.raises(ValueError, match="clip_min must be <= clip_max"):
        encode("clip", clip_min=2.0, clip_max=1.0)
    with pytest.raises(ValueError, match="must be numbers"):
        encode("elu", alpha=math.nan)


# ---- kernels written on the layer ----------------------------------------------------------------
@numba.jit(**HARNESS)
def _row_act(L, kind, a, b, x, w, c, y):
    """y = act(x w + c), any length: whole vectors, then one masked tail."""
    n, lw = x.shape[0], L.width
    i = 0
    while i + lw <= n:
        v = vfma(vload(L, x, i), vload(L, w, i), vload(L, c, i))
        vstore(y, i, activate(kind, a, b, v))
        i += lw
    m = tail_mask(L, n - i)
    v = vfma(vload_masked(L, x, i, m), vload_masked(L, w, i, m), vload_masked(L, c, i, m))
    vstore_masked(y, i, activate(kind, a, b, v), m)


@pytest.mark.parametrize("name", ["relu", "silu", "gelu"])
def test_row_kernel(L, name):
    kind, a, b = encode(name)
    w = L.width
    for n in (0, 1, w - 1, w, w + 1, 3 * w + 5):
        x, wt, c = mixed(n, 8), mixed(n, 9), mixed(n, 10)
        buf = np.full(n + w, 7.0, np.float32)  # guard values after y
        _row_act(L, kind, a, b, x, wt, c, buf[:n])
        with np.errstate(all="ignore"):  # x w + c rounded to float32, as the kernel has it
            pre = (x.astype(np.float64) * wt + c).astype(np.float32)
            ref = REFERENCE[name](pre.astype(np.float64), 0.0, 0.0)
        y = buf[:n]
        assert_special_match(y, ref)
        ok = finite(y, ref)
        np.testing.assert_allclose(y[ok], ref[ok], rtol=1e-5, atol=1e-6)
        assert np.all(buf[n:] == 7.0)


@numba.jit(**HARNESS)
def _gemm(L, a, b, c):
    """c += a @ b (a [M, K], b [K, N], c [M, N]), on 4 x 2W register tiles; the last columns
    of a row through masks, the last M % 4 rows one at a time."""
    m_len, k_len = a.shape
    n_len, w = b.shape[1], L.width
    for j in range(0, n_len, 2 * w):
        m0, m1 = tail_mask(L, n_len - j), tail_mask(L, n_len - j - w)
        for i in range(0, m_len - m_len % 4, 4):
            c00, c01 = vload_masked(L, c[i], j, m0), vload_masked(L, c[i], j + w, m1)
            c10, c11 = vload_masked(L, c[i + 1], j, m0), vload_masked(L, c[i + 1], j + w, m1)
            c20, c21 = vload_masked(L, c[i + 2], j, m0), vload_masked(L, c[i + 2], j + w, m1)
            c30, c31 = vload_masked(L, c[i + 3], j, m0), vload_masked(L, c[i + 3], j + w, m1)
            for k in range(k_len):
                b0, b1 = vload_masked(L, b[k], j, m0), vload_masked(L, b[k], j + w, m1)
                a0, a1, a2, a3 = a[i, k], a[i + 1, k], a[i + 2, k], a[i + 3, k]
                c00, c01 = vfma(a0, b0, c00), vfma(a0, b1, c01)
                c10, c11 = vfma(a1, b0, c10), vfma(a1, b1, c11)
                c20, c21 = vfma(a2, b0, c20), vfma(a2, b1, c21)
                c30, c31 = vfma(a3, b0, c30), vfma(a3, b1, c31)
            vstore_masked(c[i], j, c00, m0)
            vstore_masked(c[i], j + w, c01, m1)
            vstore_masked(c[i + 1], j, c10, m0)
            vstore_masked(c[i + 1], j + w, c11, m1)
            vstore_masked(c[i + 2], j, c20, m0)
            vstore_masked(c[i + 2], j + w, c21, m1)
            vstore_masked(c[i + 3], j, c30, m0)
            vstore_masked(c[i + 3], j + w, c31, m1)
        for i in range(m_len - m_len % 4, m_len):
            r0, r1 = vload_masked(L, c[i], j, m0), vload_masked(L, c[i], j + w, m1)
            for k in range(k_len):
                r0 = vfma(a[i, k], vload_masked(L, b[k], j, m0), r0)
                r1 = vfma(a[i, k], vload_masked(L, b[k], j + w, m1), r1)
            vstore_masked(c[i], j, r0, m0)
            vstore_masked(c[i], j + w, r1, m1)


def test_gemm_micro_kernel(L):
    w = L.width
    rng = np.random.default_rng(11)
    for m, k, n in ((1, 1, 1), (4, 16, 2 * w), (5, 7, w + 3), (9, 33, 4 * w + 1), (3, 5, w - 1)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        c = rng.standard_normal((m, n)).astype(np.float32)
        ref = c.astype(np.float64) + a.astype(np.float64) @ b
        _gemm(L, a, b, c)
        np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5 * math.sqrt(k))


def test_the_vector_is_written():
    """At W = 8 on an AVX2 + FMA target the row kernel is ymm FMAs and masked moves."""
    feats = _numba_features()
    if "+avx2" not in feats or "+fma" not in feats or "+avx512f" in feats:
        pytest.skip("checks the AVX2 code")
    kind, a, b = encode("relu")
    x = np.ones(13, np.float32)
    _row_act(simd.Lanes(8), kind, a, b, x, x, x, x.copy())
    lanes8 = numba.typeof(simd.Lanes(8))
    asm = _row_act.inspect_asm(next(s for s in _row_act.signatures if s[0] == lanes8))
    assert "vfmadd" in asm and "%ymm" in asm and "vmaskmovps" in asm


def test_fast_math_keeps_nan_and_inf():
    for options in (JIT, JIT_FIT):
        assert not {"nnan", "ninf", "fast"} & set(options["fastmath"])
    assert "reassoc" not in JIT_FIT["fastmath"] and "reassoc" in FASTMATH


# ---- fresh processes: the cache, the width -------------------------------------------------------
CACHED_KERNEL = """
import numba
from fusion_kernels.simd.approx import exp
from fusion_kernels.config import JIT
from fusion_kernels.simd import tail_mask, vload, vload_masked, vstore, vstore_masked


@numba.jit(**JIT)
def exp_rows(L, x, y):
    n, w = x.shape[0], L.width
    i = 0
    while i + w <= n:
        vstore(y, i, exp(vload(L, x, i)))
        i += w
    m = tail_mask(L, n - i)
    vstore_masked(y, i, exp(vload_masked(L, x, i, m)), m)
"""

CACHE_RUN = """
import numpy as np
from fusion_kernels import simd
from fusion_kernels.simd import approx
from cached_kernel import exp_rows

x = np.linspace(-5, 5, 37, dtype=np.float32)
for w in (8, 16):
    y = np.zeros_like(x)
    exp_rows(simd.Lanes(w), x, y)
    assert np.allclose(y, np.exp(x), rtol=1e-6), (w, y)
print(len(exp_rows.stats.cache_hits), len(exp_rows.stats.cache_misses), len(approx.exp.overloads))
"""


def run_python(code, env=None, cwd=None):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(cwd or ""), str(ROOT)])))
    full.pop("FUSION_SIMD_WIDTH", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_cache_reloads_in_a_fresh_process(tmp_path):
    """A kernel on the layer, at both widths, compiled into an empty cache, then loaded from it
    by a second process without compiling anything (nor its callee, exp)."""
    (tmp_path / "cached_kernel.py").write_text(CACHED_KERNEL)
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = run_python(CACHE_RUN, env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["0", "2", "2"]  # two widths compiled, exp at each
    second = run_python(CACHE_RUN, env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["2", "0", "0"]  # both loaded, nothing compiled


WIDTH_RUN = """
import os
from fusion_kernels import simd  # reads nothing yet
try:
    print(simd.width(), simd.lanes().width)
except ValueError as err:
    print("error:", err)
"""


@numba.jit(**HARNESS)
def _width_of(L, x):
    return L.width + x.shape[0]


def test_a_lanes_argument_is_typed_without_python(monkeypatch):
    """Numba's dispatcher types a Lanes from its _numba_type_ in C: without it, every call of a
    kernel from Python went back into the interpreter (typeof_pyval), 7 us per call."""
    x = np.zeros(3, np.float32)
    assert _width_of(simd.Lanes(8), x) == 11  # compiled
    monkeypatch.setattr(_width_of, "typeof_pyval", lambda value: pytest.fail(f"typeof {value}"))
    assert _width_of(simd.Lanes(8), x) == 11


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"FUSION_SIMD_WIDTH": "16"}, "16 16"),
        ({"FUSION_SIMD_WIDTH": "8"}, "8 8"),
        ({"FUSION_SIMD_WIDTH": "12"}, "error: FUSION_SIMD_WIDTH must be 8 or 16, got '12'"),
        (
            {"NUMBA_CPU_NAME": "skylake-avx512", "NUMBA_CPU_FEATURES": "+avx512f,+avx2,+fma"},
            "16 16",
        ),  # fmt: skip
        ({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma,-avx512f"}, "8 8"),
    ],
    ids=["forced16", "forced8", "invalid", "avx512-target", "avx2-target"],
)
def test_width_setting(env, expected):
    run = run_python(WIDTH_RUN, env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected


def test_width_follows_the_target():
    run = run_python(WIDTH_RUN)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == ("16" if "+avx512f" in _numba_features() else "8")
