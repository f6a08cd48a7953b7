"""Winograd F(2x2, 3x3) path for 3x3, stride 1, dilation 1, group 1 convolutions.

Each 2x2 output tile comes from a 4x4 input patch d (Lavin & Gray 2015):

    Y = A^T [ sum_c (G g_c G^T) * (B^T d_c B) ] A        (* is elementwise over 4x4)

    B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
    G   = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]

so the sum over c becomes 16 independent GEMMs, U[xi] [M, C] x V[xi] [C, tiles], with
16 * M * C multiplies per 4 outputs instead of 36 * M * C: 2.25x fewer FLOPs. U = G g G^T is
computed once in float64 at prepare time. The transforms only add and subtract (and halve, in
G), so float32 error stays within a few ulps of the direct sum (measured max relative error vs
onnxruntime ~1e-6 on the 64-channel stack).
"""

import math

import numba
import numpy as np

from ._gemm import MR, NR, act, microkernel, pack_a
from .config import JIT, PARALLEL

_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])


def pack_weights(weight):
    """U[xi] = (G g G^T)[xi] for every (m, c), packed as GEMM A-panels [M/MR, 16, C, MR], flat:
    the 16 panels one work item reads are contiguous (at a 4 KiB stride they would all fall in
    the same L1 sets)."""
    u = np.einsum("ai,mcij,bj->abmc", _G, weight.astype(np.float64), _G).astype(np.float32)
    m, c = weight.shape[:2]
    panels = [pack_a(u[a, b]).reshape(-1, c * MR) for a in range(4) for b in range(4)]
    return np.ascontiguousarray(np.stack(panels, axis=1)).ravel()


@numba.jit(**JIT)
def _input_strip(x, n, c, th, tw_len, pt, pl, rows, v):
    """V = B^T d B for all tiles of tile row th, channel c, into the GEMM panels
    v[tile panel, xi, c * NR + q] (tile t = th * TW + tw = panel * NR + q).

    Whole rows at a time: first the four input rows (zero-padded) are combined vertically
    (B^T d, vectorized over columns), then each tile combines four adjacent columns (. B).
    """
    h, w = x.shape[2], x.shape[3]
    width = rows.shape[1]
    for i in range(4):
        r = 2 * th - pt + i
        for j in range(width):
            s = j - pl
            inside = 0 <= r < h and 0 <= s < w
            rows[i, j] = x[n, c, r, s] if inside else np.float32(0.0)
    for j in range(width):
        a0, a1, a2, a3 = rows[0, j], rows[1, j], rows[2, j], rows[3, j]
        rows[0, j], rows[1, j], rows[2, j], rows[3, j] = a0 - a2, a1 + a2, a2 - a1, a1 - a3
    for tw in range(tw_len):
        t = th * tw_len + tw
        tp, col = t // NR, c * NR + t % NR
        j = 2 * tw
        for i in range(4):
            a0, a1, a2, a3 = rows[i, j], rows[i, j + 1], rows[i, j + 2], rows[i, j + 3]
            v[n, tp, 4 * i, col] = a0 - a2
            v[n, tp, 4 * i + 1, col] = a1 + a2
            v[n, tp, 4 * i + 2, col] = a2 - a1
            v[n, tp, 4 * i + 3, col] = a1 - a3


@numba.jit(**JIT)
def _output_tiles(mt, out3, n, m0, rows, t0, t_len, tw_len, oh_len, ow_len, bias, lo, hi):
    """Epilogue: Y = A^T M A for each tile in mt [16, MR, NR], then bias and activation."""
    for i in range(rows):
        b = bias[m0 + i]
        dst = out3[n, m0 + i]
        for q in range(min(NR, t_len - t0)):
            t = t0 + q
            y0, x0 = 2 * (t // tw_len), 2 * (t % tw_len)
            # A^T M: two rows of four
            u0 = mt[0, i, q] + mt[4, i, q] + mt[8, i, q]
            u1 = mt[1, i, q] + mt[5, i, q] + mt[9, i, q]
            u2 = mt[2, i, q] + mt[6, i, q] + mt[10, i, q]
            u3 = mt[3, i, q] + mt[7, i, q] + mt[11, i, q]
            l0 = mt[4, i, q] - mt[8, i, q] - mt[12, i, q]
            l1 = mt[5, i, q] - mt[9, i, q] - mt[13, i, q]
            l2 = mt[6, i, q] - mt[10, i, q] - mt[14, i, q]
            l3 = mt[7, i, q] - mt[11, i, q] - mt[15, i, q]
            # (A^T M) A, cropped at the right and bottom edge for odd output sizes
            p = y0 * ow_len + x0
            dst[p] = act(u0 + u1 + u2 + b, lo, hi)
            if x0 + 1 < ow_len:
                dst[p + 1] = act(u1 - u2 - u3 + b, lo, hi)
            if y0 + 1 < oh_len:
                dst[p + ow_len] = act(l0 + l1 + l2 + b, lo, hi)
                if x0 + 1 < ow_len:
                    dst[p + ow_len + 1] = act(l1 - l2 - l3 + b, lo, hi)


@numba.jit(**PARALLEL)
def winograd_conv(x, u_packed, bias, out3, pt, pl, oh_len, ow_len, lo, hi):
    """out3[N, M, OH*OW] = act(conv3x3(x) + bias) with F(2x2, 3x3)."""
    n_len, c_len = x.shape[0], x.shape[1]
    m_len = out3.shape[1]
    tw_len = (ow_len + 1) // 2
    t_len = ((oh_len + 1) // 2) * tw_len
    n_pan = (t_len + NR - 1) // NR
    n_mb = (m_len + MR - 1) // MR
    # Transformed input: for each (image, tile panel) 16 GEMM B-operands [C, NR].
    # Columns of tiles past the last one stay uninitialised: GEMM columns are independent and
    # those outputs are never stored.
    th_len = (oh_len + 1) // 2
    # Rows padded by one cache line: at C * NR * 4 bytes = 4 KiB (C = 64) the 16 rows written
    # per tile would share L1 sets and thrash (measured serially on the 64-channel 56x56
    # layer: 4.6 ms unpadded, 1.2 ms padded).
    v = np.empty((n_len, n_pan, 16, c_len * NR + 16), np.float32)
    for item in numba.prange(n_len * c_len * th_len):  # (image, channel, tile row): disjoint
        n, c, th = item // (c_len * th_len), (item // th_len) % c_len, item % th_len
        rows = np.empty((4, 2 * tw_len + 2), np.float32)
        _input_strip(x, n, c, th, tw_len, pt, pl, rows, v)
    # Items are (image, tile panel, channel panel): disjoint output tiles, no races.
    for item in numba.prange(n_len * n_pan * n_mb):
        n = item // (n_pan * n_mb)
        tp = (item // n_mb) % n_pan
        mb = item % n_mb
        mt = np.empty((16, MR, NR), np.float32)
        vp = v[n, tp]
        for xi in range(16):
            microkernel(u_packed, (mb * 16 + xi) * c_len * MR, vp[xi], 0, c_len, mt[xi])
        m0 = mb * MR
        rows = min(MR, m_len - m0)
        _output_tiles(mt, out3, n, m0, rows, tp * NR, t_len, tw_len, oh_len, ow_len, bias, lo, hi)


@numba.jit(**PARALLEL)
def all_finite(x):
    """True when x holds no inf or NaN (a parallel reduction, no temporary array)."""
    flat = x.reshape(-1)
    bad = 0
    for i in numba.prange(flat.size):
        if not math.isfinite(flat[i]):
            bad += 1
    return bad == 0
