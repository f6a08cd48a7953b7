"""Winograd F(2x2, 3x3) path for 3x3, stride 1, dilation 1, group 1 convolutions.

Each 2x2 output tile comes from a 4x4 input patch d (Lavin & Gray 2015):

    Y = A^T [ sum_c (G g_c G^T) * (B^T d_c B) ] A        (* is elementwise over 4x4)

    B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
    G   = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]

so the sum over c becomes 16 independent GEMMs, U[xi] [M, C] x V[xi] [C, tiles], with
16 * M * C multiplies per 4 outputs instead of 36 * M * C: 2.25x fewer FLOPs. U = G g G^T is
computed once in float64 at prepare time. The transforms only add and subtract (and halve, in
G), so float32 error stays within a few ulps of the direct sum.

One pass, fused per tile panel: a work item takes NR consecutive tiles (NR, MR: the GEMM
micro-kernel's tile, _gemm), transforms their input
patches for all C channels into a private V [16, C + 1, NR] (65 KiB at C = 64, stays in L2),
runs the 16 GEMMs for every channel panel against it and writes the outputs: no shared buffer,
no barrier between transform and GEMM. F(4x4) (_winograd_f4_nchw.py, opt-in) has the same structure
and shares gather_tile. Measurements: bench/NOTES.md, Winograd.
"""

import math

import numba
import numpy as np

from ._gemm import gemm_batch, pack_a
from .config import INLINE, JIT, JIT_GEMM, PARALLEL, ZERO_I64
from .simd import clip, vload, vstore

# The 4 x 4 points of the transform domain: one GEMM each, batched (an int64, not a literal:
# kernels/config.py I64)
POINTS = np.int64(16)
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
# _VPAD: V [16, C, NR] is allocated [16, C + 1, NR], one panel row of padding per xi: at
# C * NR * 4 bytes a multiple of 4 KiB (C = 64 at NR = 16) the 16 rows written per tile would
# share L1 sets and thrash.


def pack_weights(weight, mr):
    """U[xi] = (G g G^T)[xi] for every (m, c), packed as GEMM A-panels [M/mr, 16, C, mr], flat
    (mr: the micro-kernel's MR): the 16 panels one work item reads are contiguous (at a 4 KiB
    stride they would all fall in the same L1 sets)."""
    u = np.einsum("ai,mcij,bj->abmc", _G, weight.astype(np.float64), _G).astype(np.float32)
    m, c = weight.shape[:2]
    panels = [pack_a(u[a, b], mr).reshape(-1, c * mr) for a in range(4) for b in range(4)]
    return np.ascontiguousarray(np.stack(panels, axis=1)).ravel()


@numba.jit(**INLINE)
def gather_tile(x3, n, c, t, t_len, tw_len, pt, pl, h, w, m, d, q):
    """d[a i + j, q] = x[n, c, m th - pt + i, m tw - pl + j] (i, j < a = m + 2): the input patch
    of tile t = th * TW + tw of an F(m x m, 3x3) transform, zero outside the image and past
    the last tile. Interior patches index with unsigned offsets, so no load carries Numba's
    negative-index wraparound select; x3 ([N, C, H*W]) is indexed, not sliced (a view of the
    shared input costs an atomic refcount update, see _gemm)."""
    a = m + 2
    r = m * (t // tw_len) - pt
    s = m * (t % tw_len) - pl
    if t < t_len and r >= 0 and s >= 0 and r + a <= h and s + a <= w:
        o = numba.uint64(r * w + s)
        for i in range(a):
            for j in range(a):
                d[a * i + j, q] = x3[n, c, o + numba.uint64(i * w + j)]
    else:
        for i in range(a):
            for j in range(a):
                inside = t < t_len and 0 <= r + i < h and 0 <= s + j < w
                d[a * i + j, q] = x3[n, c, (r + i) * w + s + j] if inside else np.float32(0.0)


@numba.jit(**JIT_GEMM)
def _transform_panel(L, T, d, v, c):
    """v[:, c] = B^T d B for the NR patches in d[:16] (row 4 i + j = patch pixel (i, j)), a
    vector of W patches at a time; d[16:32] is scratch for the rows of B^T d. d is [32, NR],
    v [16, C + 1, NR] (flat offsets: row r of d at r NR, v[xi, c] at (xi (C + 1) + c) NR)."""
    w = L.width
    nr = T.cols * w
    vx, vc = v.shape[1] * nr, c * nr  # one xi's stride in v, channel c's offset
    for q in range(0, nr, w):
        for j in range(4):  # B^T d, column j: rows (0 - 2, 1 + 2) and (2 - 1, 1 - 3)
            t0, t1 = vload(L, d, j * nr + q), vload(L, d, (4 + j) * nr + q)
            t2, t3 = vload(L, d, (8 + j) * nr + q), vload(L, d, (12 + j) * nr + q)
            vstore(d, (16 + j) * nr + q, t0 - t2)
            vstore(d, (20 + j) * nr + q, t1 + t2)
            vstore(d, (24 + j) * nr + q, t2 - t1)
            vstore(d, (28 + j) * nr + q, t1 - t3)
        for i in range(4):  # (B^T d) B: the same combination over the columns of row i
            r = (16 + 4 * i) * nr + q
            a0, a1 = vload(L, d, r), vload(L, d, r + nr)
            a2, a3 = vload(L, d, r + 2 * nr), vload(L, d, r + 3 * nr)
            o = 4 * i * vx + vc + q
            vstore(v, o, a0 - a2)
            vstore(v, o + vx, a1 + a2)
            vstore(v, o + 2 * vx, a2 - a1)
            vstore(v, o + 3 * vx, a1 - a3)


@numba.jit(**JIT)
def _input_panel(L, T, x3, n, t0, t_len, tw_len, pt, pl, h, w, d, v):
    """V = B^T d B for tiles t0 .. t0 + NR - 1 and every channel, into the GEMM B-panels
    v[xi, c, q]. Tiles past the last are zero (their outputs are never stored).
    Channel by channel, the patches are gathered (scalar) and then transformed (vector)."""
    for c in range(x3.shape[1]):
        for q in range(T.cols * L.width):
            gather_tile(x3, n, c, t0 + q, t_len, tw_len, pt, pl, h, w, 2, d, q)
        _transform_panel(L, T, d, v, c)


@numba.jit(**JIT_GEMM)
def _output_tiles(L, T, mt, out3, n, m0, rows, n_t, ty, tx, oh_len, ow_len, bias, lo, hi, y):
    """Epilogue: Y = A^T M A for each tile in mt [16, MR, NR], then bias and clip.

    The transform runs on W tiles per vector into y [4, NR] (the four outputs of each tile,
    bias and clip applied), then each tile's 2x2 block is stored at its place: tile q's
    top-left output is (ty[q], tx[q]); n_t tiles are real. (Scalar, this transform costs
    about as much as the 16 GEMMs at small C.)"""
    w, mr = L.width, T.rows
    nr = T.cols * w
    for i in range(rows):
        b = bias[m0 + i]
        for q in range(0, nr, w):
            o, x = i * nr + q, mr * nr  # mt[xi, i, q] at o + xi x
            m4, m5, m6, m7 = (vload(L, mt, o + 4 * x), vload(L, mt, o + 5 * x),
                              vload(L, mt, o + 6 * x), vload(L, mt, o + 7 * x))  # fmt: skip
            m8, m9, m10, m11 = (vload(L, mt, o + 8 * x), vload(L, mt, o + 9 * x),
                                vload(L, mt, o + 10 * x), vload(L, mt, o + 11 * x))  # fmt: skip
            # A^T M: rows u (0 + 4 + 8) and l (4 - 8 - 12) of four columns each
            u0, u1 = (vload(L, mt, o) + m4) + m8, (vload(L, mt, o + x) + m5) + m9
            u2, u3 = (vload(L, mt, o + 2 * x) + m6) + m10, (vload(L, mt, o + 3 * x) + m7) + m11
            l0, l1 = (m4 - m8) - vload(L, mt, o + 12 * x), (m5 - m9) - vload(L, mt, o + 13 * x)
            l2, l3 = (m6 - m10) - vload(L, mt, o + 14 * x), (m7 - m11) - vload(L, mt, o + 15 * x)
            # (A^T M) A: columns (0 + 1 + 2) and (1 - 2 - 3)
            vstore(y, q, clip(((u0 + u1) + u2) + b, lo, hi))
            vstore(y, nr + q, clip(((u1 - u2) - u3) + b, lo, hi))
            vstore(y, 2 * nr + q, clip(((l0 + l1) + l2) + b, lo, hi))
            vstore(y, 3 * nr + q, clip(((l1 - l2) - l3) + b, lo, hi))
        m_ = m0 + i
        for q in range(n_t):  # cropped at the right and bottom edge for odd output sizes
            y0, x0 = ty[q], tx[q]
            p = y0 * ow_len + x0
            out3[n, m_, p] = y[0, q]
            if x0 + 1 < ow_len:
                out3[n, m_, p + 1] = y[1, q]
            if y0 + 1 < oh_len:
                out3[n, m_, p + ow_len] = y[2, q]
                if x0 + 1 < ow_len:
                    out3[n, m_, p + ow_len + 1] = y[3, q]


@numba.jit(**JIT)
def _finite_panel(v, c_len):
    """True when no transformed value is inf or NaN: x * 0 is NaN exactly for those, and a
    NaN makes the sum NaN (fastmath here keeps NaN and inf, see config)."""
    acc = np.float32(0.0)
    nr = v.shape[2]
    for xi in range(16):
        row = v[xi].reshape(-1)
        for k in range(c_len * nr):
            acc += row[k] * np.float32(0.0)
    return acc == 0.0


@numba.jit(**PARALLEL)
def winograd_conv(x, u_packed, bias, out3, L, T, pt, pl, oh_len, ow_len, lo, hi, n_ms, bad):
    """out3[N, M, OH*OW] = clip(conv3x3(x) + bias, lo, hi) with F(2x2, 3x3), on the
    micro-kernel of width L and tile T (MR = T.rows, NR = T.cols W tiles per panel); each
    tile panel's channel panels are split into n_ms ranges (see conv2d.m_splits).

    Sets bad[0] when an inf or NaN reached a transformed tile: out3 is then not what a direct
    convolution gives, and the caller must run im2col instead (see conv2d_bias_act). Checking
    the transformed panels costs one multiply-add per value already in L1, where a separate
    pass over x cost a parallel region and a read of the whole input."""
    n_len, c_len = x.shape[0], x.shape[1]
    m_len = out3.shape[1]
    mr, nr = T.rows, T.cols * L.width
    tw_len = (ow_len + 1) // 2
    t_len = ((oh_len + 1) // 2) * tw_len
    n_pan = (t_len + nr - 1) // nr
    n_mb = (m_len + mr - 1) // mr
    h, w = x.shape[2], x.shape[3]
    x3 = x.reshape(n_len, c_len, h * w)
    mb_per = (n_mb + n_ms - 1) // n_ms
    a_panel = c_len * mr  # U[xi]'s channel panel mb at (mb * 16 + xi) * a_panel of u_packed
    # Items are (image, tile panel, channel-panel range): disjoint outputs, private scratch.
    for item in numba.prange(n_len * n_pan * n_ms):
        n, tp, ms = item // (n_pan * n_ms), (item // n_ms) % n_pan, item % n_ms
        v = np.empty((16, c_len + 1, nr), np.float32)  # + 1: see _VPAD; v[xi]: a B panel
        d = np.empty((32, nr), np.float32)
        mt = np.empty((16, mr, nr), np.float32)
        y = np.empty((4, nr), np.float32)
        ty = np.empty(nr, np.int64)
        tx = np.empty(nr, np.int64)
        n_t = min(nr, t_len - tp * nr)
        for q in range(n_t):
            ty[q], tx[q] = 2 * ((tp * nr + q) // tw_len), 2 * ((tp * nr + q) % tw_len)
        _input_panel(L, T, x3, n, tp * nr, t_len, tw_len, pt, pl, h, w, d, v)
        if not _finite_panel(v, c_len):
            bad[0] = 1  # any item may set it; all set the same value
        for mb in range(ms * mb_per, min(n_mb, (ms + 1) * mb_per)):
            gemm_batch(L, T, u_packed, mb * 16 * a_panel, a_panel, v, ZERO_I64, (c_len + 1) * nr,
                       POINTS, c_len, mt)  # fmt: skip
            m0 = mb * mr
            rows = min(mr, m_len - m0)
            _output_tiles(L, T, mt, out3, n, m0, rows, n_t, ty, tx, oh_len, ow_len, bias, lo,
                          hi, y)  # fmt: skip


@numba.jit(**PARALLEL)
def all_finite(x):
    """True when x holds no inf or NaN (a parallel reduction, no temporary array)."""
    flat = x.reshape(-1)
    bad = 0
    for i in numba.prange(flat.size):
        if not math.isfinite(flat[i]):
            bad += 1
    return bad == 0
