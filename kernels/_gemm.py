"""Register-blocked SGEMM micro-kernel shared by the convolution paths.

    tile[i, j] = sum_k A[k, i] * B[k, j]     i < MR = 4 output channels, j < NR = 16 pixels

A is a packed panel [K, MR] (weights, packed once), B a packed panel [K, NR] (input pixels).
Per k it reads MR + NR floats and does MR * NR FMAs; the 4x16 accumulators live in eight
ymm registers as eight 8-tuples, which the SLP vectorizer turns into vector FMAs (see
config.GEMM_FASTMATH). Measured single-core on this machine: 4x16 ~33-38 GFLOP/s, 4x8 ~29,
6x8 ~31, 8x8 ~31 (K = 64 and 576); the scalar form without SLP was ~3.

Two entry points: microkernel returns the raw tile (Winograd transforms it further);
gemm_tile fuses bias + activation into the stores (im2col and 1x1 convolutions).
Both want their operands as views starting at index 0 (see microkernel).
"""

import numba
import numpy as np

from .config import INLINE_GEMM, JIT, JIT_GEMM

MR = 4
NR = 16


# 8-tuples of float32 are what the SLP vectorizer turns into one ymm register each.


@numba.jit(**INLINE_GEMM)
def fma8(c, a, b):
    # c + a * b, a scalar: one ymm FMA after SLP.
    return (
        c[0] + a * b[0], c[1] + a * b[1], c[2] + a * b[2], c[3] + a * b[3],
        c[4] + a * b[4], c[5] + a * b[5], c[6] + a * b[6], c[7] + a * b[7],
    )  # fmt: skip


@numba.jit(**INLINE_GEMM)
def add8(a, b):
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3],
            a[4] + b[4], a[5] + b[5], a[6] + b[6], a[7] + b[7])  # fmt: skip


@numba.jit(**INLINE_GEMM)
def sub8(a, b):
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3],
            a[4] - b[4], a[5] - b[5], a[6] - b[6], a[7] - b[7])  # fmt: skip


@numba.jit(**INLINE_GEMM)
def load8(v, q):
    return (v[q], v[q + 1], v[q + 2], v[q + 3], v[q + 4], v[q + 5], v[q + 6], v[q + 7])


@numba.jit(**INLINE_GEMM)
def store8(v, q, r):
    # Constant tuple indices keep r in registers (a variable index would spill it).
    v[q], v[q + 1], v[q + 2], v[q + 3] = r[0], r[1], r[2], r[3]
    v[q + 4], v[q + 5], v[q + 6], v[q + 7] = r[4], r[5], r[6], r[7]


@numba.jit(**JIT_GEMM)
def microkernel(a, b, k_len, tile):
    """tile[:MR, :NR] = A^T B for panels a[: k_len*MR] and b[: k_len*NR].

    Pass the panels as views starting at 0, not as (array, offset): with an offset of unknown
    sign every load keeps Numba's negative-index wraparound select, which blocks SLP (measured
    K = 64: 9 GFLOP/s with offsets into both, 30 with B a view, 38 with both views).
    """
    z = np.float32(0.0)
    r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = (z, z, z, z, z, z, z, z)
    for k in range(k_len):
        lo = load8(b, NR * k)
        hi = load8(b, NR * k + 8)
        q = MR * k
        a0, a1, a2, a3 = a[q], a[q + 1], a[q + 2], a[q + 3]
        r0, s0 = fma8(r0, a0, lo), fma8(s0, a0, hi)
        r1, s1 = fma8(r1, a1, lo), fma8(s1, a1, hi)
        r2, s2 = fma8(r2, a2, lo), fma8(s2, a2, hi)
        r3, s3 = fma8(r3, a3, lo), fma8(s3, a3, hi)
    store8(tile[0], 0, r0)
    store8(tile[0], 8, s0)
    store8(tile[1], 0, r1)
    store8(tile[1], 8, s1)
    store8(tile[2], 0, r2)
    store8(tile[2], 8, s2)
    store8(tile[3], 0, r3)
    store8(tile[3], 8, s3)


@numba.jit(**INLINE_GEMM)
def _act1(v, b, lo, hi):
    v = v + b
    v = lo if v < lo else v  # compares, not min/max: a NaN passes through (see act)
    return hi if v > hi else v


@numba.jit(**INLINE_GEMM)
def store_act8(dst, q, r, b, lo, hi):
    """dst[q : q + 8] = act(r + b): the epilogue on one ymm register (compare + blend)."""
    store8(dst, q, (_act1(r[0], b, lo, hi), _act1(r[1], b, lo, hi), _act1(r[2], b, lo, hi),
                    _act1(r[3], b, lo, hi), _act1(r[4], b, lo, hi), _act1(r[5], b, lo, hi),
                    _act1(r[6], b, lo, hi), _act1(r[7], b, lo, hi)))  # fmt: skip


@numba.jit(**INLINE_GEMM)
def gemm_tile(a, b, k_len, out3, n, m0, rows, p0, cols, bias, lo, hi, tile):
    """out3[n, m0 + i, p0 + j] = act(sum_k A[k, i] B[k, j] + bias[m0 + i]) for i < rows, j < cols.

    a and b are packed panels (views starting at 0, see microkernel). A full 4x16 tile gets
    bias and activation in registers and is stored straight to out3 (the scalar store_tile
    epilogue cost as much as the FMAs at K = 16); a partial tile goes through `tile` and
    store_tile. A separate function, not inlined at the Numba level: inlined into the parallel
    im2col driver twice it took that driver 350 s to compile (now a few seconds).
    """
    z = np.float32(0.0)
    r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = (z, z, z, z, z, z, z, z)
    for k in range(k_len):
        lo8, hi8 = load8(b, NR * k), load8(b, NR * k + 8)
        q = MR * k
        a0, a1, a2, a3 = a[q], a[q + 1], a[q + 2], a[q + 3]
        r0, s0 = fma8(r0, a0, lo8), fma8(s0, a0, hi8)
        r1, s1 = fma8(r1, a1, lo8), fma8(s1, a1, hi8)
        r2, s2 = fma8(r2, a2, lo8), fma8(s2, a2, hi8)
        r3, s3 = fma8(r3, a3, lo8), fma8(s3, a3, hi8)
    if rows == MR and cols == NR:
        d0, d1 = out3[n, m0, p0:], out3[n, m0 + 1, p0:]
        d2, d3 = out3[n, m0 + 2, p0:], out3[n, m0 + 3, p0:]
        b0, b1, b2, b3 = bias[m0], bias[m0 + 1], bias[m0 + 2], bias[m0 + 3]
        store_act8(d0, 0, r0, b0, lo, hi)
        store_act8(d0, 8, s0, b0, lo, hi)
        store_act8(d1, 0, r1, b1, lo, hi)
        store_act8(d1, 8, s1, b1, lo, hi)
        store_act8(d2, 0, r2, b2, lo, hi)
        store_act8(d2, 8, s2, b2, lo, hi)
        store_act8(d3, 0, r3, b3, lo, hi)
        store_act8(d3, 8, s3, b3, lo, hi)
    else:
        store8(tile[0], 0, r0)
        store8(tile[0], 8, s0)
        store8(tile[1], 0, r1)
        store8(tile[1], 8, s1)
        store8(tile[2], 0, r2)
        store8(tile[2], 8, s2)
        store8(tile[3], 0, r3)
        store8(tile[3], 8, s3)
        store_tile(tile, out3, n, m0, rows, p0, cols, bias, lo, hi)


@numba.jit(**JIT_GEMM)
def gemm_panels(a, panels, k_len, out3, n, m0, rows, p0, p_len, bias, lo, hi, tile):
    """gemm_tile for one A panel over consecutive B panels: panels[j] holds pixels
    p0 + j * NR ... (up to p_len). One call per A panel rather than per tile: at K = 16 the
    call and its array views cost as much as the tile's FMAs."""
    for j in range(panels.shape[0]):
        q0 = p0 + j * NR
        gemm_tile(a, panels[j], k_len, out3, n, m0, rows, q0, min(NR, p_len - q0), bias, lo, hi,
                  tile)  # fmt: skip


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
