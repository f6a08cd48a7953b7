"""Register-blocked SGEMM micro-kernel shared by the convolution paths.

    tile[i, j] = sum_k A[k, i] * B[k, j]     i < MR = 4 output channels, j < NR = 16 pixels

A is a packed panel [K, MR] (weights, packed once), B a packed panel [K, NR] (input pixels).
Per k it reads MR + NR floats and does MR * NR FMAs; the 4x16 accumulators live in eight
ymm registers as eight 8-tuples, which the SLP vectorizer turns into vector FMAs (see
config.GEMM_FASTMATH). Measured single-core on this machine: 4x16 ~33-38 GFLOP/s, 4x8 ~29,
6x8 ~31, 8x8 ~31 (K = 64 and 576); the scalar form without SLP was ~3.
"""

import numba
import numpy as np

from .config import INLINE_GEMM, JIT, JIT_GEMM

MR = 4
NR = 16


@numba.jit(**INLINE_GEMM)
def _fma8(c, a, b):
    # c + a * b on an 8-tuple: one ymm FMA after SLP.
    return (
        c[0] + a * b[0], c[1] + a * b[1], c[2] + a * b[2], c[3] + a * b[3],
        c[4] + a * b[4], c[5] + a * b[5], c[6] + a * b[6], c[7] + a * b[7],
    )  # fmt: skip


@numba.jit(**INLINE_GEMM)
def _load8(v, q):
    return (v[q], v[q + 1], v[q + 2], v[q + 3], v[q + 4], v[q + 5], v[q + 6], v[q + 7])


@numba.jit(**INLINE_GEMM)
def _store8(tile, i, j, r):
    # Constant tuple indices keep r in registers (a variable index would spill it).
    tile[i, j + 0] = r[0]
    tile[i, j + 1] = r[1]
    tile[i, j + 2] = r[2]
    tile[i, j + 3] = r[3]
    tile[i, j + 4] = r[4]
    tile[i, j + 5] = r[5]
    tile[i, j + 6] = r[6]
    tile[i, j + 7] = r[7]


@numba.jit(**JIT_GEMM)
def microkernel(a, ao, b, bo, k_len, tile):
    """tile[:MR, :NR] = A^T B for panels a[ao : ao + k_len*MR] and b[bo : bo + k_len*NR]."""
    z = np.float32(0.0)
    r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = (z, z, z, z, z, z, z, z)
    for k in range(k_len):
        lo = _load8(b, bo + NR * k)
        hi = _load8(b, bo + NR * k + 8)
        q = ao + MR * k
        a0, a1, a2, a3 = a[q], a[q + 1], a[q + 2], a[q + 3]
        r0, s0 = _fma8(r0, a0, lo), _fma8(s0, a0, hi)
        r1, s1 = _fma8(r1, a1, lo), _fma8(s1, a1, hi)
        r2, s2 = _fma8(r2, a2, lo), _fma8(s2, a2, hi)
        r3, s3 = _fma8(r3, a3, lo), _fma8(s3, a3, hi)
    _store8(tile, 0, 0, r0)
    _store8(tile, 0, 8, s0)
    _store8(tile, 1, 0, r1)
    _store8(tile, 1, 8, s1)
    _store8(tile, 2, 0, r2)
    _store8(tile, 2, 8, s2)
    _store8(tile, 3, 0, r3)
    _store8(tile, 3, 8, s3)


def pack_a(w2d):
    """Pack weights [M, K] into MR-row panels [ceil(M/MR), K, MR] (zero rows past M), flat."""
    m, k = w2d.shape
    mb = -(-m // MR)
    padded = np.zeros((mb * MR, k), np.float32)
    padded[:m] = w2d
    return np.ascontiguousarray(padded.reshape(mb, MR, k).transpose(0, 2, 1)).ravel()


@numba.jit(**JIT)
def act(v, lo, hi):
    """Bias-added value clipped to [lo, hi]; relu is lo = 0, no activation is (-inf, inf).

    Written as compares, not min/max, so a NaN passes through unchanged as in onnxruntime.
    """
    if v < lo:
        v = lo
    if v > hi:
        v = hi
    return v


@numba.jit(**JIT)
def store_tile(tile, out3, n, m0, rows, p0, cols, bias, lo, hi):
    """Epilogue: out3[n, m0 + i, p0 + j] = act(tile[i, j] + bias[m0 + i]) while tile is in L1."""
    for i in range(rows):
        b = bias[m0 + i]
        dst = out3[n, m0 + i]
        for j in range(cols):
            dst[p0 + j] = act(tile[i, j] + b, lo, hi)
