"""Layer normalization over the last axis, with the residual Add before it (skip LayerNorm),
and RMSNorm:

    s = x + r                                   (skip; s is also returned when asked)
    LayerNorm: y = (s - mean(s)) / sqrt(var(s) + eps) * g + b     var: the biased variance
    RMSNorm:   y = s / sqrt(mean(s^2) + eps) * g

Rows are independent: a driver over rows, each row normalized in one serial pass sequence
(sum, centred sum of squares, scale) while it is in L1; in parallel above SERIAL_MAX values
(below, a parallel region's start costs more than the work: bench/NOTES.md, transformers).
The centred second pass is what onnxruntime does too: var = E[s^2] - E[s]^2 in float32 loses
digits when |mean| >> std. A row whose sum or squares overflow float32 (|s| about 1e19 and up)
is normalized again divided by its largest |s|, eps by its square: the norm is the same, and
finite for any finite row (onnxruntime returns NaN or zeros there).
"""

import numba
import numpy as np

from .config import INLINE, JIT, PARALLEL

__all__ = ["layer_norm"]

ONE = np.float32(1.0)
INF = np.float32(np.inf)


@numba.jit(**INLINE)
def moments(y, i, rms):
    """Row i's mean (0 for RMSNorm) and its sum of squares about it."""
    n = y.shape[1]
    mean = np.float32(0.0)
    if not rms:
        total = np.float32(0.0)
        for j in range(n):
            total += y[i, j]
        mean = total / np.float32(n)
    ss = np.float32(0.0)
    for j in range(n):
        d = y[i, j] - mean
        ss += d * d
    return mean, ss


@numba.jit(**JIT)
def norm_row(x, r, has_r, s, has_s, i, g, b, has_b, eps, rms, y):
    """Row i: y[i] = norm(x[i] + r[i]) * g + b, s[i] = x[i] + r[i] when has_s."""
    n = x.shape[1]
    if has_r:
        for j in range(n):
            y[i, j] = x[i, j] + r[i, j]
    else:
        for j in range(n):
            y[i, j] = x[i, j]
    if has_s:
        for j in range(n):
            s[i, j] = y[i, j]
    mean, ss = moments(y, i, rms)
    if not ss < INF:  # a sum or a square overflowed, or the row holds inf or NaN
        peak = np.float32(0.0)
        for j in range(n):
            peak = max(peak, abs(y[i, j]))
        if peak < INF:  # finite: the same norm of y / peak, with eps / peak^2
            c = ONE / peak
            for j in range(n):
                y[i, j] *= c
            eps = eps * c * c
            mean, ss = moments(y, i, rms)
    var = ss / np.float32(n) + eps
    # 1 / sqrt(inf) is 0 (a row holding inf, as onnxruntime: x / inf); fastmath's "afn" would
    # make it NaN
    scale = np.float32(0.0) if var == INF else ONE / np.sqrt(var)
    if has_b:
        for j in range(n):
            y[i, j] = (y[i, j] - mean) * scale * g[j] + b[j]
    else:
        for j in range(n):
            y[i, j] = (y[i, j] - mean) * scale * g[j]


@numba.jit(**PARALLEL)
def _layer_norm(x, r, has_r, s, has_s, g, b, has_b, eps, rms, y):
    for i in numba.prange(x.shape[0]):
        norm_row(x, r, has_r, s, has_s, i, g, b, has_b, eps, rms, y)


@numba.jit(**JIT)
def _layer_norm_serial(x, r, has_r, s, has_s, g, b, has_b, eps, rms, y):
    for i in range(x.shape[0]):
        norm_row(x, r, has_r, s, has_s, i, g, b, has_b, eps, rms, y)


SERIAL_MAX = 1 << 19  # values (512 rows of 1024); more run in parallel


_EMPTY = np.zeros((1, 1), np.float32)


def _rows(a, shape, what):
    a = np.ascontiguousarray(np.broadcast_to(a, shape), dtype=np.float32)
    return a.reshape(-1, shape[-1]) if a.ndim else a.reshape(1, 1)


def layer_norm(x, gamma, beta=None, eps=1e-5, residual=None, rms=False, return_sum=False):
    """LayerNorm (rms=False) or RMSNorm (rms=True) of x + residual over the last axis.
    x float32 [..., N]; gamma, beta [N] (or broadcastable to it); residual broadcastable to x.
    Returns y, or (y, x + residual) with return_sum.

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
    x2 = _rows(x, shape, "x")
    r2 = _rows(residual, shape, "residual") if residual is not None else _EMPTY
    g = np.ascontiguousarray(np.broadcast_to(np.asarray(gamma, np.float32).reshape(-1), n))
    has_b = beta is not None
    b = np.ascontiguousarray(np.broadcast_to(np.asarray(beta, np.float32).reshape(-1), n)) \
        if has_b else g  # fmt: skip
    y = np.empty(x2.shape, np.float32)
    s = np.empty(x2.shape, np.float32) if return_sum else _EMPTY
    run = _layer_norm if x2.size > SERIAL_MAX else _layer_norm_serial
    run(x2, r2, residual is not None, s, return_sum, g, b, has_b, np.float32(eps), bool(rms), y)
    y = y.reshape(shape)
    return (y, s.reshape(shape)) if return_sum else y
