"""Linear layer with its epilogue: y = act(x W + b) + r   (x [M, K], W [K, N], b [N], r [M, N])

act: IDENTITY; GELU_ERF  t (1 + erf(t / sqrt 2)) / 2;
     GELU_TANH  t (1 + tanh(c (t + 0.044715 t^3))) / 2  with c = sqrt(2 / pi).
The residual r is optional (a transformer's skip connection).

The product is one BLAS call (numpy's matmul; SciPy, which Numba's np.dot needs, is not a
dependency); the epilogue is one pass over the rows of the product, with erf and tanh as
rational approximations (Eigen's, clamped: max abs error 7e-8 and 3e-8), which the loop
vectorizer turns into vector code (libm's erf/tanh are scalar calls). The pass runs in the
calling thread unless it is a GELU over more than SERIAL_GELU values: a parallel region started
right after OpenBLAS's call waits for cores its idle workers still spin on, which cost more than
a bias and residual add (bench/NOTES.md, transformers).
"""

import numba
import numpy as np

from .config import INLINE, JIT, PARALLEL

__all__ = ["ACTIVATIONS", "GELU_ERF", "GELU_TANH", "IDENTITY", "bias_act", "linear_act"]

IDENTITY, GELU_ERF, GELU_TANH = 0, 1, 2
ACTIVATIONS = {None: IDENTITY, "identity": IDENTITY, "gelu": GELU_ERF, "gelu_tanh": GELU_TANH}

f32 = np.float32
HALF, ONE, FOUR, TANH_CLAMP = f32(0.5), f32(1.0), f32(4.0), f32(7.90531110763549805)
INV_SQRT2, TANH_C, CUBIC = f32(0.7071067811865476), f32(0.7978845608028654), f32(0.044715)
# erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (+-1 beyond, in float32)
EA = [f32(c) for c in (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                       -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                       -1.60960333262415e-02)]  # fmt: skip
EB = [f32(c) for c in (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                       -7.37332916720468e-03, -1.42647390514189e-02)]  # fmt: skip
# tanh(x) = x P(x^2) / Q(x^2) on [-7.9, 7.9]
TA = [f32(c) for c in (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                       5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                       4.89352455891786e-03)]  # fmt: skip
TB = [f32(c) for c in (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                       4.89352518554385e-03)]  # fmt: skip
EA0, EA1, EA2, EA3, EA4, EA5, EA6 = EA
EB0, EB1, EB2, EB3, EB4 = EB
TA0, TA1, TA2, TA3, TA4, TA5, TA6 = TA
TB0, TB1, TB2, TB3 = TB


@numba.jit(**INLINE)
def erf32(a):
    """erf(a); compares, not min/max, so that a NaN passes through."""
    x = FOUR if a > FOUR else a
    x = -FOUR if x < -FOUR else x
    x2 = x * x
    p = ((((((EA0 * x2 + EA1) * x2 + EA2) * x2 + EA3) * x2 + EA4) * x2 + EA5) * x2 + EA6) * x
    q = (((EB0 * x2 + EB1) * x2 + EB2) * x2 + EB3) * x2 + EB4
    return p / q


@numba.jit(**INLINE)
def tanh32(a):
    x = TANH_CLAMP if a > TANH_CLAMP else a
    x = -TANH_CLAMP if x < -TANH_CLAMP else x
    x2 = x * x
    p = ((((((TA0 * x2 + TA1) * x2 + TA2) * x2 + TA3) * x2 + TA4) * x2 + TA5) * x2 + TA6) * x
    q = ((TB0 * x2 + TB1) * x2 + TB2) * x2 + TB3
    return p / q


@numba.jit(**JIT)
def bias_act_row(y, i, b, r, has_residual, act):
    """y[i] = act(y[i] + b) (+ r[i]): one row, in place. One loop per activation, so that each
    is a plain vectorizable loop."""
    n = y.shape[1]
    if act == GELU_ERF:
        for j in range(n):
            v = y[i, j] + b[j]
            y[i, j] = HALF * v * (ONE + erf32(v * INV_SQRT2))
    elif act == GELU_TANH:
        for j in range(n):
            v = y[i, j] + b[j]
            y[i, j] = HALF * v * (ONE + tanh32(TANH_C * (v + CUBIC * v * v * v)))
    else:
        for j in range(n):
            y[i, j] += b[j]
    if has_residual:
        for j in range(n):
            y[i, j] += r[i, j]


@numba.jit(**PARALLEL)
def _bias_act(y, b, r, has_residual, act):
    for i in numba.prange(y.shape[0]):
        bias_act_row(y, i, b, r, has_residual, act)


@numba.jit(**JIT)
def _bias_act_serial(y, b, r, has_residual, act):
    for i in range(y.shape[0]):
        bias_act_row(y, i, b, r, has_residual, act)


SERIAL_GELU = 1 << 15  # values; GELU over more runs in parallel


_NO_RESIDUAL = np.zeros((1, 1), np.float32)


def bias_act(y, b, act=IDENTITY, residual=None):
    """y = act(y + b) (+ residual) in place; y [M, N] float32 C-contiguous, b [N], residual
    [M, N] or None. Returns y.

    >>> bias_act(np.zeros((2, 3), np.float32), np.ones(3, np.float32), GELU_ERF)
    """
    if y.dtype != np.float32 or y.ndim != 2 or not y.flags.c_contiguous:
        raise ValueError(f"y must be a C-contiguous 2-D float32 array, got {y.dtype} {y.shape}")
    if b.shape != (y.shape[1],):
        raise ValueError(f"bias of shape {b.shape} does not match {y.shape[1]} columns")
    if act not in (IDENTITY, GELU_ERF, GELU_TANH):
        raise ValueError(f"unknown activation code {act}")
    r = _NO_RESIDUAL
    if residual is not None:
        r = np.ascontiguousarray(np.broadcast_to(residual, y.shape), dtype=np.float32)
    parallel = act != IDENTITY and y.size > SERIAL_GELU
    run = _bias_act if parallel else _bias_act_serial
    run(y, np.ascontiguousarray(b, np.float32), r, residual is not None, act)
    return y


def linear_act(x, w, b, act=IDENTITY, residual=None):
    """act(x W + b) (+ residual) for x [M, K] float32, w [K, N], b [N]: [M, N] float32.

    >>> x, w = np.ones((4, 8), np.float32), np.ones((8, 2), np.float32)
    >>> linear_act(x, w, np.zeros(2, np.float32), GELU_TANH)
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"cannot multiply x {x.shape} by W {w.shape}")
    y = np.matmul(x, w)  # BLAS
    return bias_act(y, b, act, residual)
