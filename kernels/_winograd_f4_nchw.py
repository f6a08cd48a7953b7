"""Winograd F(4x4, 3x3) path for 3x3, stride 1, dilation 1, group 1 convolutions.

Each 4x4 output tile comes from a 6x6 input patch d (Lavin & Gray 2015, points 0, +-1, +-2):

    Y = A^T [ sum_c (G g_c G^T) * (B^T d_c B) ] A        (* is elementwise over 6x6)

    B^T = [[4,  0, -5,  0, 1, 0],      G = [[ 1/4,     0,    0],
           [0, -4, -4,  1, 1, 0],           [-1/6,  -1/6, -1/6],
           [0,  4, -4, -1, 1, 0],           [-1/6,   1/6, -1/6],
           [0, -2, -1,  2, 1, 0],           [1/24,  1/12,  1/6],
           [0,  2, -1, -2, 1, 0],           [1/24, -1/12,  1/6],
           [0,  4,  0, -5, 0, 1]]           [   0,     0,    1]]
    A^T = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]

36 GEMMs U[xi] [M, C] x V[xi] [C, tiles]: 36 multiplies per 16 outputs, 4x fewer than direct
(F(2x2) is 2.25x) and the input is gathered 2.25 values per output instead of 4. The price is
accuracy: the transforms scale by up to 8 (A) and 5 (B), so float32 rounding grows with C, about
10x F(2x2)'s (bench/NOTES.md, Winograd); so it is opt-in. U is computed once in float64 at
prepare time.

Same one-pass structure as F(2x2) (_winograd_f2_nchw.py): a work item takes NR tiles (the GEMM
tile's NR), transforms their patches for all C channels into a private V [36, C + 1, NR], runs
the 36 GEMMs per channel panel and writes the outputs.
"""

import numba
import numpy as np

from ._gemm import act, gemm_batch, pack_a
from ._winograd_f2_nchw import gather_tile
from .config import INLINE_GEMM, JIT, JIT_GEMM, PARALLEL, ZERO_I64
from .simd import vfma, vload, vstore

# The 6 x 6 points of the transform domain: one GEMM each, batched (an int64, not a literal:
# kernels/config.py I64)
POINTS = np.int64(36)
_G = np.array(
    [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
     [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]
)  # fmt: skip
_F2, _F4, _F5, _F8 = np.float32(2.0), np.float32(4.0), np.float32(5.0), np.float32(8.0)


def pack_weights(weight, mr):
    """U[xi] = (G g G^T)[xi] for every (m, c), packed as GEMM A-panels [M/mr, 36, C, mr], flat
    (mr: the micro-kernel's MR)."""
    u = np.einsum("ai,mcij,bj->abmc", _G, weight.astype(np.float64), _G).astype(np.float32)
    c = weight.shape[1]
    panels = [pack_a(u[a, b], mr).reshape(-1, c * mr) for a in range(6) for b in range(6)]
    return np.ascontiguousarray(np.stack(panels, axis=1)).ravel()


@numba.jit(**INLINE_GEMM)
def _bt6(z0, z1, z2, z3, z4, z5):
    """B^T z for six vectors z (one column or row of W patches)."""
    s12, d12 = z1 + z2, z1 - z2
    s34, d43 = z3 + z4, z4 - z3
    e, f = z4 - z2, z3 - z1
    return (
        vfma(-_F5, z2, vfma(_F4, z0, z4)),
        vfma(-_F4, s12, s34),
        vfma(_F4, d12, d43),
        vfma(_F2, f, e),
        vfma(-_F2, f, e),
        vfma(-_F5, z3, vfma(_F4, z1, z5)),
    )


@numba.jit(**INLINE_GEMM)
def _at6(m0, m1, m2, m3, m4, m5):
    """A^T m for six vectors m."""
    s12, d12 = m1 + m2, m1 - m2
    s34, d34 = m3 + m4, m3 - m4
    return (
        (m0 + s12) + s34,
        vfma(_F2, d34, d12),
        vfma(_F4, s34, s12),
        vfma(_F8, d34, d12) + m5,
    )


@numba.jit(**JIT)
def _gather(x3, n, c, t0, t_len, tw_len, pt, pl, h, w, org, d):
    """d[6 i + j, q] = the 6x6 input patch of tile t0 + q in channel c. Interior tiles (org[q]
    >= 0, the patch's flat offset, computed once per panel: an integer division per tile and
    channel cost more than the loads) are unrolled; edge tiles go through gather_tile."""
    u = numba.uint64
    for q in range(org.shape[0]):
        o = org[q]
        if o >= 0:
            for i in range(6):
                k, r = 6 * i, u(o + i * w)
                d[k, q], d[k + 1, q] = x3[n, c, r], x3[n, c, r + u(1)]
                d[k + 2, q], d[k + 3, q] = x3[n, c, r + u(2)], x3[n, c, r + u(3)]
                d[k + 4, q], d[k + 5, q] = x3[n, c, r + u(4)], x3[n, c, r + u(5)]
        else:
            gather_tile(x3, n, c, t0 + q, t_len, tw_len, pt, pl, h, w, 4, d, q)


@numba.jit(**JIT_GEMM)
def _transform_panel(L, T, d, v, c):
    """v[:, c] = B^T d B for the NR patches in d[:36] (row 6 i + j = patch pixel (i, j)), a
    vector of W patches at a time; d[36:72] holds the rows of B^T d. d is [72, NR], v
    [36, C + 1, NR] (flat offsets, as _winograd_f2_nchw._transform_panel's)."""
    w = L.width
    nr = T.cols * w
    vx, vc = v.shape[1] * nr, c * nr
    for q in range(0, nr, w):
        for j in range(6):
            o = j * nr + q
            t = _bt6(vload(L, d, o), vload(L, d, o + 6 * nr), vload(L, d, o + 12 * nr),
                     vload(L, d, o + 18 * nr), vload(L, d, o + 24 * nr),
                     vload(L, d, o + 30 * nr))  # fmt: skip
            for k in range(6):  # unrolled by LLVM: tuple index must be constant
                vstore(d, (36 + 6 * k + j) * nr + q, t[k])
        for k in range(6):
            r = (36 + 6 * k) * nr + q
            t = _bt6(vload(L, d, r), vload(L, d, r + nr), vload(L, d, r + 2 * nr),
                     vload(L, d, r + 3 * nr), vload(L, d, r + 4 * nr),
                     vload(L, d, r + 5 * nr))  # fmt: skip
            for j in range(6):
                vstore(v, (6 * k + j) * vx + vc + q, t[j])


@numba.jit(**JIT_GEMM)
def _output_transform(L, T, mt, i, ys):
    """ys[4 r + s, q] = (A^T M A)[r, s] for the NR tiles of output channel row i of mt
    ([36, MR, NR]); ys is [40, NR]."""
    w = L.width
    nr = T.cols * w
    x = T.rows * nr  # mt[xi, i, q] at xi x + i nr + q
    for q in range(0, nr, w):
        for j in range(6):
            o = j * x + i * nr + q
            t = _at6(vload(L, mt, o), vload(L, mt, o + 6 * x), vload(L, mt, o + 12 * x),
                     vload(L, mt, o + 18 * x), vload(L, mt, o + 24 * x),
                     vload(L, mt, o + 30 * x))  # fmt: skip
            for r in range(4):
                vstore(ys, (16 + 6 * r + j) * nr + q, t[r])
        for r in range(4):
            k = (16 + 6 * r) * nr + q
            t = _at6(vload(L, ys, k), vload(L, ys, k + nr), vload(L, ys, k + 2 * nr),
                     vload(L, ys, k + 3 * nr), vload(L, ys, k + 4 * nr),
                     vload(L, ys, k + 5 * nr))  # fmt: skip
            for s in range(4):
                vstore(ys, (4 * r + s) * nr + q, t[s])


@numba.jit(**JIT)
def _store_tiles(ys, dst, dsto, b, lo, hi):
    """dst[dsto[q] + r * OW + s] = act(ys[4 r + s, q] + b) for the tiles' valid outputs; dsto
    [4, NR] holds per tile the flat offset, valid rows and columns (0 past the last tile)."""
    ow_len = dsto[3, 0]
    for q in range(ys.shape[1]):
        p, rows, cols = dsto[0, q], dsto[1, q], dsto[2, q]
        for r in range(rows):
            out = dst[p + r * ow_len :]
            if cols == 4:
                for s in range(4):
                    out[s] = act(ys[4 * r + s, q] + b, lo, hi)
            else:
                for s in range(cols):
                    out[s] = act(ys[4 * r + s, q] + b, lo, hi)


@numba.jit(**JIT)
def _panel_offsets(t0, t_len, tw_len, pt, pl, h, w, oh_len, ow_len, org, dsto):
    """Per tile t0 + q: org[q] = flat input offset of an interior patch (-1 at the edges),
    dsto[:3, q] = flat output offset, valid rows, valid columns; dsto[3, 0] = OW."""
    dsto[3, 0] = ow_len
    for q in range(org.shape[0]):
        t = t0 + q
        y0, x0 = 4 * (t // tw_len), 4 * (t % tw_len)
        r, s = y0 - pt, x0 - pl
        inside = t < t_len and r >= 0 and s >= 0 and r + 6 <= h and s + 6 <= w
        org[q] = r * w + s if inside else -1
        dsto[0, q] = y0 * ow_len + x0
        dsto[1, q] = min(4, oh_len - y0) if t < t_len else 0
        dsto[2, q] = min(4, ow_len - x0)


@numba.jit(**PARALLEL)
def winograd4_conv(x, u_packed, bias, out3, L, T, pt, pl, oh_len, ow_len, lo, hi, n_ms):
    """out3[N, M, OH*OW] = clip(conv3x3(x) + bias, lo, hi) with F(4x4, 3x3), on the
    micro-kernel of width L and tile T; each tile panel's channel panels are split into n_ms
    ranges (see conv2d.m_splits)."""
    n_len, c_len, h, w = x.shape
    m_len = out3.shape[1]
    mr, nr = T.rows, T.cols * L.width
    tw_len = (ow_len + 3) // 4
    t_len = ((oh_len + 3) // 4) * tw_len
    n_pan = (t_len + nr - 1) // nr
    n_mb = (m_len + mr - 1) // mr
    x3 = x.reshape(n_len, c_len, h * w)
    mb_per = (n_mb + n_ms - 1) // n_ms
    a_panel = c_len * mr  # U[xi]'s channel panel mb at (mb * 36 + xi) * a_panel of u_packed
    # Items are (image, tile panel, channel-panel range): disjoint outputs, private scratch.
    for item in numba.prange(n_len * n_pan * n_ms):
        n, tp, ms = item // (n_pan * n_ms), (item // n_ms) % n_pan, item % n_ms
        t0 = tp * nr
        v = np.empty((36, c_len + 1, nr), np.float32)  # + 1 row: no 4 KiB stride (F2's)
        d = np.empty((72, nr), np.float32)
        mt = np.empty((36, mr, nr), np.float32)
        ys = np.empty((40, nr), np.float32)
        org = np.empty(nr, np.int64)
        dsto = np.empty((4, nr), np.int64)
        _panel_offsets(t0, t_len, tw_len, pt, pl, h, w, oh_len, ow_len, org, dsto)
        for c in range(c_len):
            _gather(x3, n, c, t0, t_len, tw_len, pt, pl, h, w, org, d)
            _transform_panel(L, T, d, v, c)
        for mb in range(ms * mb_per, min(n_mb, (ms + 1) * mb_per)):
            gemm_batch(L, T, u_packed, mb * 36 * a_panel, a_panel, v, ZERO_I64, (c_len + 1) * nr,
                       POINTS, c_len, mt)  # fmt: skip
            m0 = mb * mr
            for i in range(min(mr, m_len - m0)):
                _output_transform(L, T, mt, i, ys)
                _store_tiles(ys, out3[n, m0 + i], dsto, bias[m0 + i], lo, hi)
