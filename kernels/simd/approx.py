"""float32 exp, sigmoid, tanh, erf and log1p on [0, 1], each one source for the vectors of
kernels.simd and for float32 scalars: `exp(v)` in a kernel compiles for the type of v.

    exp(x)      Cody-Waite reduction x = k ln2 + r, |r| <= ln2 / 2, e^r = 1 + r + r^2 P(r)
                (Cephes's expf), then times 2^k (ldexp_small: AVX-512's vscalefps on 16
                lanes where the target has it, else two factors): below -87.3 the result goes
                through the denormals to 0 (0 below -104), above 88.72 it is inf; -inf / inf:
                0 / inf.
    sigmoid(x)  1 / (1 + e^-|x|), times e^-|x| for x < 0: exactly 0 below -104 (following e^x
                through the denormals before), exactly 1 above 16.7, never NaN for a finite x.
    tanh(x)     x P(x^2) / Q(x^2), Eigen's rational fit on [-7.9, 7.9]; +-1 beyond 8.32, x
                itself for |x| < 4e-4.
    erf(x)      x P(x^2) / Q(x^2), Eigen's rational fit on [-4, 4], +-1 beyond.
    log1p01(y)  log(1 + y) for y in [0, 1] (softplus): 2 atanh(s), s = y / (2 + y), by its
                series to s^13.
A NaN gives NaN (the clamps are compares, which a NaN fails). Maximum errors against float64,
measured by tests/test_simd.py on a grid of 600001 points over [-120, 120] plus 40000 tiny
magnitudes down to the denormals, at W = 8, 16 and on scalars alike (`pytest
tests/test_simd.py -k test_fit_accuracy -s` prints them): exp 1.0 ulp, sigmoid 2.4 ulp, tanh
4.2 ulp (2.5e-7 absolute), erf 3.2e-7 absolute (5.3 ulp), log1p01 2.3 ulp; without FMA
(x86-64 baseline) tanh 5.3 ulp and erf 4.1e-7, the others the same.

Compiled with JIT_FIT (no "reassoc", which would undo the reduction): a caller's flags do not
reach them, LLVM inlines them as compiled.
"""

import numba
import numpy as np

from ..config import JIT_FIT
from ._ops import ldexp_small, roundeven, vfma, vselect

__all__ = ["erf", "exp", "log1p01", "sigmoid", "tanh"]

f32 = np.float32
ZERO, ONE, TWO = f32(0.0), f32(1.0), f32(2.0)

EXP_HI, EXP_LO = f32(89.0), f32(-104.0)  # e^89 = inf, e^-104 = 0 in float32; |k| stays small
LOG2E = f32(1.44269504088896341)
NEG_LN2_HI, NEG_LN2_LO = f32(-0.693359375), f32(2.12194440e-4)  # ln 2 in two parts (Cephes)
E0, E1, E2, E3, E4, E5 = (f32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))  # fmt: skip

TANH_CLAMP, TANH_TINY = f32(7.90531110763549805), f32(0.0004)
TANH_ONE = f32(8.32)  # beyond, 1 is nearer tanh(x) than the fit's last value, 1 - 2^-22
T13, T11, T9, T7, T5, T3, T1 = (f32(c) for c in (
    -2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
    1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03))  # fmt: skip
U6, U4, U2, U0 = (f32(c) for c in (1.19825839466702e-06, 1.18534705686654e-04,
                                    2.26843463243900e-03, 4.89352518554385e-03))  # fmt: skip

ERF_CLAMP = f32(4.0)
R13, R11, R9, R7, R5, R3, R1 = (f32(c) for c in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
    -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02))  # fmt: skip
S8, S6, S4, S2, S0 = (f32(c) for c in (-1.45660718464996e-05, -2.13374055278905e-04,
                                        -1.68282697438203e-03, -7.37332916720468e-03,
                                        -1.42647390514189e-02))  # fmt: skip

A13, A11, A9, A7, A5, A3 = (f32(1 / n) for n in (13, 11, 9, 7, 5, 3))


@numba.jit(**JIT_FIT)
def exp(x):
    """e^x, float32 (vector or scalar).

    >>> exp(vload(L, a, 0))
    """
    x = vselect(x < EXP_LO, EXP_LO, vselect(x > EXP_HI, EXP_HI, x))  # a NaN fails both
    k = roundeven(x * LOG2E)
    r = vfma(k, NEG_LN2_HI, x)
    r = vfma(k, NEG_LN2_LO, r)
    p = vfma(vfma(vfma(vfma(vfma(E0, r, E1), r, E2), r, E3), r, E4), r, E5)
    return ldexp_small(vfma(p * r, r, r) + ONE, k)  # 1 + r + r^2 p(r), times 2^k


@numba.jit(**JIT_FIT)
def sigmoid(x):
    """1 / (1 + e^-x), float32 (vector or scalar), as t / (1 + t) with t = e^x for x < 0 (so
    that it follows e^x down through the denormals rather than 1 / (1 + inf) = 0)."""
    t = exp(-abs(x))
    r = ONE / (ONE + t)
    return vselect(x < ZERO, t * r, r)


@numba.jit(**JIT_FIT)
def tanh(x):
    """tanh(x), float32 (vector or scalar)."""
    c = vselect(x < -TANH_CLAMP, -TANH_CLAMP, vselect(x > TANH_CLAMP, TANH_CLAMP, x))
    s = c * c
    p = vfma(vfma(vfma(vfma(vfma(vfma(T13, s, T11), s, T9), s, T7), s, T5), s, T3), s, T1)
    q = vfma(vfma(vfma(U6, s, U4), s, U2), s, U0)
    a = abs(x)
    y = vselect(
        a > TANH_ONE, vselect(x < ZERO, -ONE, ONE), c * (p / q)
    )  # the fit ends at 1 - 2^-22
    return vselect(a < TANH_TINY, x, y)


@numba.jit(**JIT_FIT)
def erf(x):
    """erf(x), float32 (vector or scalar)."""
    c = vselect(x < -ERF_CLAMP, -ERF_CLAMP, vselect(x > ERF_CLAMP, ERF_CLAMP, x))
    s = c * c
    p = vfma(vfma(vfma(vfma(vfma(vfma(R13, s, R11), s, R9), s, R7), s, R5), s, R3), s, R1)
    q = vfma(vfma(vfma(vfma(S8, s, S6), s, S4), s, S2), s, S0)
    return c * (p / q)  # c P / Q would pass through the denormals for a tiny c


@numba.jit(**JIT_FIT)
def log1p01(y):
    """log(1 + y) for y in [0, 1], float32 (vector or scalar): 2 atanh(s) with s = y / (2 + y)
    <= 1/3, whose series 2 s (1 + s^2/3 + s^4/5 + ...) is cut where its terms fall below
    float32's rounding."""
    s = y / (TWO + y)
    z = s * s
    t = vfma(vfma(vfma(vfma(vfma(vfma(A13, z, A11), z, A9), z, A7), z, A5), z, A3), z, ONE)
    return TWO * s * t
