"""Layer normalization over the last axis, with the residual Add before it (skip LayerNorm),
and RMSNorm:

    s = x + r                                   (skip; s is also returned when asked)
    LayerNorm: y = (s - mean(s)) / sqrt(var(s) + eps) * g + b     var: the biased variance
    RMSNorm:   y = s / sqrt(mean(s^2) + eps) * g

Rows are independent: a driver over rows, each row normalized in a sequence of passes in
vectors of the SIMD layer (sum, centred sum of squares, scale) while it is in L1; in parallel
above SERIAL_MAX values (below, a parallel region's start costs more than the work:
bench/NOTES.md, transformers).
The centred second pass is what onnxruntime does too: var = E[s^2] - E[s]^2 in float32 loses
digits when |mean| >> std. A row whose sum or squares overflow float32 (|s| about 1e19 and up)
is normalized again divided by its largest |s|, eps by its square: the norm is the same, and
finite for any finite row (onnxruntime returns NaN or zeros there).
"""

import numba
import numpy as np

from .config import INLINE_FIT, JIT_FIT, PARALLEL, get_threads
from .simd import (
    hsum,
    lanes,
    tail_mask,
    vfma,
    vload,
    vload_masked,
    vselect,
    vstore,
    vstore_masked,
    vzero,
)
from .workspace import as_rows

__all__ = ["layer_norm"]

ONE = np.float32(1.0)
CHUNK = 32  # vectors of squares summed apart before they join the row's sum
INF = np.float32(np.inf)


@numba.jit(**INLINE_FIT)
def moments(L, y, i, rms):
    """The mean (0 for RMSNorm) of row i of y [rows, n] and its sum of squares about it, in
    vectors (the last n % W values under a mask, zeroed). The mean is the first value plus the
    mean of the differences from it, whose running sums stay near std sqrt(n) where |mean| >>
    std; the squares are summed CHUNK vectors at a time. Compiled without "reassoc" (JIT_FIT),
    which let LLVM undo both: 1.6e-4 error at 17477 values of mean 100 and std 1 at W = 8 with
    it, 1.6e-5 without (tests/test_transformer.py's case)."""
    n, w = y.shape[1], L.width
    o, nw = i * n, n - n % w
    tail = tail_mask(L, n - nw)
    mean = np.float32(0.0)
    if not rms:
        pivot = y[i, 0]
        acc = vzero(L)
        for j in range(0, nw, w):
            acc += vload(L, y, o + j) - pivot
        if nw < n:
            acc += vselect(tail, vload_masked(L, y, o + nw, tail) - pivot, np.float32(0.0))
        mean = pivot + hsum(acc) / np.float32(n)
    acc = vzero(L)
    for j0 in range(0, nw, CHUNK * w):  # sums of CHUNK squares, then their sum (RMSNorm's
        part = vzero(L)  # squares about 0 grow with the mean, not the spread)
        for j in range(j0, min(nw, j0 + CHUNK * w), w):
            d = vload(L, y, o + j) - mean
            part = vfma(d, d, part)
        acc += part
    if nw < n:
        d = vselect(tail, vload_masked(L, y, o + nw, tail) - mean, np.float32(0.0))
        acc = vfma(d, d, acc)
    return mean, hsum(acc)


@numba.jit(**JIT_FIT)
def norm_rows(L, x, r, has_r, s, has_s, i0, i1, g, b, has_b, eps, rms, y):
    """Rows i0 .. i1: y[i] = norm(x[i] + r[i]) * g + b, s[i] = x[i] + r[i] when has_s; W values
    at a time, the last n % W under a mask (never read or written past the row). Compiled
    without "reassoc": it let LLVM undo the sums' ordering (moments), a 1.6e-4 error."""
    n, w = x.shape[1], L.width
    nw = n - n % w
    tail = tail_mask(L, n - nw)
    for i in range(i0, i1):
        eps_i = eps
        o = i * n
        for j in range(0, nw, w):
            v = vload(L, x, o + j)
            if has_r:
                v += vload(L, r, o + j)
            vstore(y, o + j, v)
            if has_s:
                vstore(s, o + j, v)
        if nw < n:  # a store under a mask costs more (microcoded on AVX2 Zen): only the tail's
            v = vload_masked(L, x, o + nw, tail)
            if has_r:
                v += vload_masked(L, r, o + nw, tail)
            vstore_masked(y, o + nw, v, tail)
            if has_s:
                vstore_masked(s, o + nw, v, tail)
        mean, ss = moments(L, y, i, rms)
        if not ss < INF:  # a sum or a square overflowed, or the row holds inf or NaN
            peak = np.float32(0.0)
            for j in range(n):
                peak = max(peak, abs(y[i, j]))
            if peak < INF:  # finite: the same norm of y / peak, with eps / peak^2
                c = ONE / peak
                for j in range(n):
                    y[i, j] *= c
                eps_i = eps_i * c * c
                mean, ss = moments(L, y, i, rms)
        var = ss / np.float32(n) + eps_i
        # 1 / sqrt(inf) is 0 (a row holding inf, as onnxruntime: x / inf); fastmath's "afn" would
        # make it NaN
        scale = np.float32(0.0) if var == INF else ONE / np.sqrt(var)
        for j in range(0, nw, w):
            v = (vload(L, y, o + j) - mean) * scale * vload(L, g, j)
            if has_b:
                v += vload(L, b, j)
            vstore(y, o + j, v)
        if nw < n:
            v = (vload_masked(L, y, o + nw, tail) - mean) * scale * vload_masked(L, g, nw, tail)
            if has_b:
                v += vload_masked(L, b, nw, tail)
            vstore_masked(y, o + nw, v, tail)


@numba.jit(**PARALLEL)
def _layer_norm(L, x, r, has_r, s, has_s, g, b, has_b, eps, rms, y, parts):
    m = x.shape[0]
    for p in numba.prange(parts):
        norm_rows(L, x, r, has_r, s, has_s, p * m // parts, (p + 1) * m // parts, g, b, has_b,
                  eps, rms, y)  # fmt: skip


# Values (64 rows of 256) above which the rows are split between the threads: a parallel
# region's start costs 1-2 us with the workers spinning (kernels/config.py), a 128 x 256
# LayerNorm 15 us on one thread and 11 on two, 16 x 256 5.3 and 6.5 (Zen 4, bench/NOTES.md,
# "Transformers and recurrent nets on AVX-512"; 1 << 19 before: 128 x 768 ran serial).
SERIAL_MAX = 1 << 14


_EMPTY = np.zeros((1, 1), np.float32)


def _vector(a, n):
    """gamma or beta as C-contiguous float32 [n] (as it is when it already is one)."""
    if type(a) is np.ndarray and a.shape == (n,) and a.dtype == np.float32 and (
            a.flags.c_contiguous):  # fmt: skip
        return a
    return np.ascontiguousarray(np.broadcast_to(np.asarray(a, np.float32).reshape(-1), n))


def layer_norm(x, gamma, beta=None, eps=1e-5, residual=None, rms=False, return_sum=False,
               width=None, parallel=None):  # fmt: skip
    """LayerNorm (rms=False) or RMSNorm (rms=True) of x + residual over the last axis.
    x float32 [..., N]; gamma, beta [N] (or broadcastable to it); residual broadcastable to x.
    Returns y, or (y, x + residual) with return_sum. width: the lanes, 8 or 16 (None: the
    process's, kernels.simd.width()). parallel: rows over the threads (True) or on the calling
    thread (False); None: in parallel above SERIAL_MAX values (a fused node's tactics time
    both instead: patterns/layernorm.py).

    >>> layer_norm(np.ones((2, 4), np.float32), np.ones(4, np.float32), np.zeros(4, np.float32))
    """
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be float32 with a non-empty last axis, got {x.dtype} {x.shape}")
    n = x.shape[-1]
    shape = x.shape
    if residual is not None:
        shape = np.broadcast_shapes(x.shape, np.shape(residual))
        if shape[-1] != n:
            raise ValueError(f"residual of shape {np.shape(residual)} changes the last axis")
    x2 = as_rows(x, shape)
    r2 = as_rows(residual, shape) if residual is not None else _EMPTY
    g = _vector(gamma, n)
    has_b = beta is not None
    b = _vector(beta, n) if has_b else g
    y = np.empty(x2.shape, np.float32)
    s = np.empty(x2.shape, np.float32) if return_sum else _EMPTY
    args = (lanes(width), x2, r2, residual is not None, s, return_sum)
    rest = (g, b, has_b, np.float32(eps), bool(rms), y)
    if (x2.size > SERIAL_MAX) if parallel is None else parallel:
        _layer_norm(*args, *rest, min(x2.shape[0], 4 * get_threads()))
    else:
        norm_rows(*args, 0, x2.shape[0], *rest)
    y = y.reshape(shape)
    return (y, s.reshape(shape)) if return_sum else y
