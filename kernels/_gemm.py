"""Register-blocked SGEMM micro-kernel shared by the convolution paths.

    tile[i, j] = sum_k A[k, i] * B[k, j]     i < MR = 4 output channels, j < NR = 16 pixels

A is a packed panel [K, MR] (weights, packed once), B a packed panel [K, NR] (input pixels).
Per k it reads MR + NR floats and does MR * NR FMAs; the 4x16 accumulators live in eight
ymm registers as eight 8-tuples, which the SLP vectorizer turns into vector FMAs (see
config.GEMM_FASTMATH); 4x16 was the fastest tile shape measured (bench/NOTES.md).

Two entry points: gemm_batch returns raw tiles (Winograd transforms them further, the LSTM
adds its gates); gemm_block fuses bias + activation into the stores (im2col and 1x1
convolutions). Both index their operands as rows of 2-D arrays (see tile_sum).
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


@numba.jit(**INLINE_GEMM)
def load8u(m, r, q):
    """m[r, q : q + 8] of a 2-D array, q unsigned: no negative-index wraparound select on the
    offset, so the eight loads stay one vector load. (The row's select is loop-invariant.)"""
    u = np.uint64
    return (m[r, q], m[r, q + u(1)], m[r, q + u(2)], m[r, q + u(3)],
            m[r, q + u(4)], m[r, q + u(5)], m[r, q + u(6)], m[r, q + u(7)])  # fmt: skip


@numba.jit(**INLINE_GEMM)
def tile_sum(a2, ar, b2, br, b0, bs, k_len):
    """The 4x16 tile sum_k A[k, i] B[k, j] as eight 8-tuples (r_i: columns 0-7 of row i, s_i:
    8-15). A is the packed panel a2[ar] ([K, MR] flat); B[k, j] = b2[br, b0 + k * bs + j]
    (b0, bs unsigned): a packed panel (bs = NR) or, for a 1x1 convolution, 16 pixels of the
    input's rows in place (bs = H*W).

    Operands are rows of 2-D arrays indexed in place, never sliced views: a view of an array
    that both threads use costs an atomic refcount update on a shared cache line (Numba's NRT
    incref/decref), as slow per tile as the FMAs at K = 16."""
    z = np.float32(0.0)
    r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = (z, z, z, z, z, z, z, z)
    o = b0
    for k in range(k_len):
        lo8, hi8 = load8u(b2, br, o), load8u(b2, br, o + np.uint64(8))
        o += bs
        q = MR * k
        a0, a1, a2_, a3 = a2[ar, q], a2[ar, q + 1], a2[ar, q + 2], a2[ar, q + 3]
        r0, s0 = fma8(r0, a0, lo8), fma8(s0, a0, hi8)
        r1, s1 = fma8(r1, a1, lo8), fma8(s1, a1, hi8)
        r2, s2 = fma8(r2, a2_, lo8), fma8(s2, a2_, hi8)
        r3, s3 = fma8(r3, a3, lo8), fma8(s3, a3, hi8)
    return r0, r1, r2, r3, s0, s1, s2, s3


@numba.jit(**INLINE_GEMM)
def store8r(m, x, i, q, r):
    """m[x, i, q : q + 8] = r for a 3-D array, q a constant."""
    m[x, i, q], m[x, i, q + 1], m[x, i, q + 2], m[x, i, q + 3] = r[0], r[1], r[2], r[3]
    m[x, i, q + 4], m[x, i, q + 5], m[x, i, q + 6], m[x, i, q + 7] = r[4], r[5], r[6], r[7]


@numba.jit(**JIT_GEMM)
def gemm_batch(a2, a0, a_step, b2, n_b, k_len, mt):
    """mt[x, :MR, :NR] = A^T B for x < n_b, A the panel a2[a0 + x * a_step] and B the panel
    b2[x]: the n_b independent GEMMs of a Winograd transform (a_step 1), or one A against
    several B (a_step 0), in one call, so the call's argument refcounts are paid once."""
    b0, bs = np.uint64(0), np.uint64(NR)
    for x in range(n_b):
        r0, r1, r2, r3, s0, s1, s2, s3 = tile_sum(a2, a0 + x * a_step, b2, x, b0, bs, k_len)
        store8r(mt, x, 0, 0, r0)
        store8r(mt, x, 0, 8, s0)
        store8r(mt, x, 1, 0, r1)
        store8r(mt, x, 1, 8, s1)
        store8r(mt, x, 2, 0, r2)
        store8r(mt, x, 2, 8, s2)
        store8r(mt, x, 3, 0, r3)
        store8r(mt, x, 3, 8, s3)


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
def _store_act8u(out3, n, m, q, r, b, lo, hi):
    """out3[n, m, q : q + 8] = act(r + b) with q unsigned: no negative-index wraparound select
    on the pixel index, so the eight stores stay one vector store (and no view of out3)."""
    u = np.uint64
    out3[n, m, q], out3[n, m, q + u(1)] = _act1(r[0], b, lo, hi), _act1(r[1], b, lo, hi)
    out3[n, m, q + u(2)], out3[n, m, q + u(3)] = _act1(r[2], b, lo, hi), _act1(r[3], b, lo, hi)
    out3[n, m, q + u(4)], out3[n, m, q + u(5)] = _act1(r[4], b, lo, hi), _act1(r[5], b, lo, hi)
    out3[n, m, q + u(6)], out3[n, m, q + u(7)] = _act1(r[6], b, lo, hi), _act1(r[7], b, lo, hi)


@numba.jit(**JIT_GEMM)
def gemm_block(a2, a0, n_mb, b2, br, b0, b_step, bs, n_pan, k_len, out3, n, m0, m_len, p0,
               p_len, bias, lo, hi, tile):  # fmt: skip
    """out3[n, m0 + m, p0 + p] = act(sum_k A[k, m] B[k, p] + bias[m0 + m]) for m < m_len and
    the n_pan input panels: every channel panel a2[a0 + mb] (mb < n_mb, MR rows each) against
    every input panel j (pixels p0 + j NR ..., up to p_len), all in one call. Panel j is B of
    tile_sum at row br, offset b0 + j * b_step and row stride bs (all unsigned).

    A full 4x16 tile gets bias and activation in registers and is stored straight to out3 (a
    scalar epilogue costs as much as the FMAs at small K); a partial one goes through `tile`
    and store_tile. One tile body for the whole block: inlined twice into the parallel im2col
    driver, it made that driver's compile take minutes."""
    for mb in range(n_mb):
        mm = mb * MR
        rows = min(MR, m_len - mm)
        m = m0 + mm
        for j in range(n_pan):
            q0 = p0 + j * NR
            cols = min(NR, p_len - q0)
            bj = b0 + np.uint64(j) * b_step
            r0, r1, r2, r3, s0, s1, s2, s3 = tile_sum(a2, a0 + mb, b2, br, bj, bs, k_len)
            if rows == MR and cols == NR:
                uq, u8 = np.uint64(q0), np.uint64(8)
                c0, c1, c2, c3 = bias[m], bias[m + 1], bias[m + 2], bias[m + 3]
                _store_act8u(out3, n, m, uq, r0, c0, lo, hi)
                _store_act8u(out3, n, m, uq + u8, s0, c0, lo, hi)
                _store_act8u(out3, n, m + 1, uq, r1, c1, lo, hi)
                _store_act8u(out3, n, m + 1, uq + u8, s1, c1, lo, hi)
                _store_act8u(out3, n, m + 2, uq, r2, c2, lo, hi)
                _store_act8u(out3, n, m + 2, uq + u8, s2, c2, lo, hi)
                _store_act8u(out3, n, m + 3, uq, r3, c3, lo, hi)
                _store_act8u(out3, n, m + 3, uq + u8, s3, c3, lo, hi)
            else:
                store8(tile[0], 0, r0)
                store8(tile[0], 8, s0)
                store8(tile[1], 0, r1)
                store8(tile[1], 8, s1)
                store8(tile[2], 0, r2)
                store8(tile[2], 8, s2)
                store8(tile[3], 0, r3)
                store8(tile[3], 8, s3)
                store_tile(tile, out3, n, m, rows, q0, cols, bias, lo, hi)


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
