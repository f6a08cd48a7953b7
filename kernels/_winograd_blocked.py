"""Winograd F(m x m, 3x3) on blocked tensors [N, C/b, H, W, b]: F(2x2) and F(4x4) in one driver.

Each m x m output tile comes from an a x a input patch d (a = m + 2, Lavin & Gray 2015):

    Y = A^T [ sum_c U_c * (B^T d_c B) ] A,   U_c = G g_c G^T     (* elementwise over a x a)

In the blocked layout a pixel is a vector of b channels, so B^T d B and A^T M A are lane-
parallel vector sums over a block's channels (no transposes), and the channel sum becomes a*a
independent GEMMs, M[xi] [tiles, M] = V[xi] [tiles, C] U[xi] [C, M], run on the register tile
(simd.tile: rows = tiles, each a broadcast of V; cols = output blocks, vectors of U). U is
transformed in float64 and packed once ([OGG, a*a, K, FB b], K = C padded to blocks).

The transforms are written out as sums (_in4/_in6 one axis of B^T d B, _out4/_out6 one axis of
A^T M A), each applied along the rows and then the columns of a patch held in registers:

    F(4x4): B^T d = (4 d0 - 5 d2 + d4,  (d3 + d4) - 4 (d1 + d2),  (d4 - d3) + 4 (d1 - d2),
                     (d4 - d2) + 2 (d3 - d1),  (d4 - d2) - 2 (d3 - d1),  4 d1 - 5 d3 + d5)
            A^T m = (m0 + s1 + s2,  e1 + 2 e2,  s1 + 4 s2,  e1 + 8 e2 + m5),
                    s1 = m1 + m2, e1 = m1 - m2, s2 = m3 + m4, e2 = m3 - m4
    F(2x2): B^T d = (d0 - d2, d1 + d2, d2 - d1, d1 - d3),  A^T m = (m0 + m1 + m2, m1 - m2 - m3)

12 one-axis transforms of about 12 operations each per F(4x4) patch and block, against 576
FMAs of the GEMMs per patch, block and 4 output blocks; a loop over B^T's coefficients (the
first version) spent more there than the GEMMs saved.

A work item is (image, group of P tiles, range of output-block groups). It transforms its
tiles' patches for every input block into a private V [a*a, P, K], then per group of FB output
blocks runs, for each xi, the GEMM of all its tiles (PR at a time, the register tile) into
mt [a*a, P, FB b], so that U's [K, FB b] panel of that xi is read from L1 by every row group;
then transforms mt back, the epilogue (bias, residual, activation: epilogue.finish) applied
to each output vector before it is stored. V and mt are sized together to half of L2 by the
wrapper. No shared buffer, no barrier.

NaN/inf: a transform mixes a patch's pixels, so one NaN would reach outputs that a direct conv
leaves finite. Every transformed value is checked (v * 0 is NaN exactly for inf and NaN); an
item that saw one sets bad[0] and the caller runs the direct kernel instead.
"""

import numba
import numpy as np

from .config import I64, JIT_GEMM, PARALLEL, ZERO_I64
from .epilogue import BEFORE, NO_RESIDUAL, activate_rows, finish
from .simd import (
    borrow,
    hsum,
    tile_fma,
    tile_store,
    tile_zeros,
    vbroadcast,
    vfma,
    vload,
    vstore,
    vzero,
)
from .simd.activation import IDENTITY, clip_bounds, clips

ZERO = np.float32(0.0)

# geometry fields (int64 array g)
N, CB, H, W, PT, PL, OH, OW, MB, M, TW, T_LEN, P, N_TG, OGG, FB, N_MS, RESIDUAL, KIND = range(19)
YMB = 19  # y's blocks per image: MB, or more when y is a part of a concatenation's tensor
N_GEO = 20


@numba.jit(**JIT_GEMM)
def _in4(d0, d1, d2, d3):
    """B^T d along one axis, F(2x2, 3x3)."""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@numba.jit(**JIT_GEMM)
def _in6(L, d0, d1, d2, d3, d4, d5):
    """B^T d along one axis, F(4x4, 3x3)."""
    four, m4, m5 = vbroadcast(L, 4.0), vbroadcast(L, -4.0), vbroadcast(L, -5.0)
    two = vbroadcast(L, 2.0)
    s12, s34, e12, e43 = d1 + d2, d3 + d4, d1 - d2, d4 - d3
    e31, e42 = d3 - d1, d4 - d2
    return (vfma(four, d0, vfma(m5, d2, d4)), vfma(m4, s12, s34), vfma(four, e12, e43),
            vfma(two, e31, e42), e42 - two * e31, vfma(four, d1, vfma(m5, d3, d5)))  # fmt: skip


@numba.jit(**JIT_GEMM)
def _out4(m0, m1, m2, m3):
    """A^T m along one axis, F(2x2, 3x3)."""
    return m0 + m1 + m2, m1 - m2 - m3


@numba.jit(**JIT_GEMM)
def _out6(L, m0, m1, m2, m3, m4, m5):
    """A^T m along one axis, F(4x4, 3x3)."""
    s1, e1, s2, e2 = m1 + m2, m1 - m2, m3 + m4, m3 - m4
    two, four, eight = vbroadcast(L, 2.0), vbroadcast(L, 4.0), vbroadcast(L, 8.0)
    return m0 + s1 + s2, vfma(two, e2, e1), vfma(four, s2, s1), vfma(eight, e2, e1) + m5


@numba.jit(**JIT_GEMM)
def _pixel(L, xf, o, j, lo, hi, b):
    """x's pixel j of a patch row starting at flat offset o, zero where j is outside [lo, hi)."""
    return vload(L, xf, o + j * b) if lo <= j < hi else vzero(L)


@numba.jit(**JIT_GEMM)
def _row4(L, xf, o, lo, hi, b):
    return _in4(_pixel(L, xf, o, I64[0], lo, hi, b), _pixel(L, xf, o, I64[1], lo, hi, b),
                _pixel(L, xf, o, I64[2], lo, hi, b),
                _pixel(L, xf, o, I64[3], lo, hi, b))  # fmt: skip


@numba.jit(**JIT_GEMM)
def _row6(L, xf, o, lo, hi, b):
    return _in6(L, _pixel(L, xf, o, I64[0], lo, hi, b), _pixel(L, xf, o, I64[1], lo, hi, b),
                _pixel(L, xf, o, I64[2], lo, hi, b), _pixel(L, xf, o, I64[3], lo, hi, b),
                _pixel(L, xf, o, I64[4], lo, hi, b),
                _pixel(L, xf, o, I64[5], lo, hi, b))  # fmt: skip


@numba.jit(**JIT_GEMM)
def _rows(h, w, base, r0, i, s0, b, a):
    """(flat offset of patch row i's first pixel, first and end column inside x) for the
    patch at image row r0 + i, column s0 of an h x w image; the columns are empty when the
    row is outside."""
    y = r0 + i
    if y < 0 or y >= h:
        return 0, 0, 0
    return ((base + y) * w + s0) * b, max(0, -s0), min(a, w - s0)


@numba.jit(**JIT_GEMM)
def _put4(v, o, stride, vals, probe, zero):
    """v[o + k stride] = vals[k], k < 4; returns probe + sum vals * 0."""
    vstore(v, o, vals[0])
    vstore(v, o + stride, vals[1])
    vstore(v, o + 2 * stride, vals[2])
    vstore(v, o + 3 * stride, vals[3])
    return vfma(vals[0] + vals[1] + vals[2] + vals[3], zero, probe)


@numba.jit(**JIT_GEMM)
def _put6(v, o, stride, vals, probe, zero):
    """v[o + k stride] = vals[k], k < 6; returns probe + sum vals * 0."""
    vstore(v, o, vals[0])
    vstore(v, o + stride, vals[1])
    vstore(v, o + 2 * stride, vals[2])
    vstore(v, o + 3 * stride, vals[3])
    vstore(v, o + 4 * stride, vals[4])
    vstore(v, o + 5 * stride, vals[5])
    return vfma(vals[0] + vals[1] + vals[2] + vals[3] + vals[4] + vals[5], zero, probe)


@numba.jit(**JIT_GEMM)
def _transform2(L, xf, h, w, base, r0, s0, v, vo, stride, probe):
    """V[xi] = (B^T d B)[xi] for the F(2x2) patch at image (r0, s0) of the h x w plane at row
    `base` (xi = 4 k + u at v[vo + xi stride]), zero outside the image; returns probe + sum V
    * 0. xf and v borrowed (pointers): this runs per patch, and arrays passed down cost a
    reference count each per call (bench/NOTES.md)."""
    b, zero = L.width, vzero(L)
    o, lo, hi = _rows(h, w, base, r0, I64[0], s0, b, I64[4])
    e0 = _row4(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[1], s0, b, I64[4])
    e1 = _row4(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[2], s0, b, I64[4])
    e2 = _row4(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[3], s0, b, I64[4])
    e3 = _row4(L, xf, o, lo, hi, b)
    # e[i] = d[i] B (along columns); now B^T along rows, column u at a time
    k = 4 * stride
    probe = _put4(v, vo, k, _in4(e0[0], e1[0], e2[0], e3[0]), probe, zero)
    probe = _put4(v, vo + stride, k, _in4(e0[1], e1[1], e2[1], e3[1]), probe, zero)
    probe = _put4(v, vo + 2 * stride, k, _in4(e0[2], e1[2], e2[2], e3[2]), probe, zero)
    return _put4(v, vo + 3 * stride, k, _in4(e0[3], e1[3], e2[3], e3[3]), probe, zero)


@numba.jit(**JIT_GEMM)
def _transform4(L, xf, h, w, base, r0, s0, v, vo, stride, probe):
    """As _transform2 for the F(4x4) patch (6 x 6, xi = 6 k + u)."""
    b, zero = L.width, vzero(L)
    o, lo, hi = _rows(h, w, base, r0, I64[0], s0, b, I64[6])
    e0 = _row6(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[1], s0, b, I64[6])
    e1 = _row6(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[2], s0, b, I64[6])
    e2 = _row6(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[3], s0, b, I64[6])
    e3 = _row6(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[4], s0, b, I64[6])
    e4 = _row6(L, xf, o, lo, hi, b)
    o, lo, hi = _rows(h, w, base, r0, I64[5], s0, b, I64[6])
    e5 = _row6(L, xf, o, lo, hi, b)
    k = 6 * stride
    probe = _put6(v, vo, k, _in6(L, e0[0], e1[0], e2[0], e3[0], e4[0], e5[0]), probe, zero)
    probe = _put6(v, vo + stride, k, _in6(L, e0[1], e1[1], e2[1], e3[1], e4[1], e5[1]), probe,
                  zero)  # fmt: skip
    probe = _put6(v, vo + 2 * stride, k, _in6(L, e0[2], e1[2], e2[2], e3[2], e4[2], e5[2]),
                  probe, zero)  # fmt: skip
    probe = _put6(v, vo + 3 * stride, k, _in6(L, e0[3], e1[3], e2[3], e3[3], e4[3], e5[3]),
                  probe, zero)  # fmt: skip
    probe = _put6(v, vo + 4 * stride, k, _in6(L, e0[4], e1[4], e2[4], e3[4], e4[4], e5[4]),
                  probe, zero)  # fmt: skip
    return _put6(v, vo + 5 * stride, k, _in6(L, e0[5], e1[5], e2[5], e3[5], e4[5], e5[5]),
                 probe, zero)  # fmt: skip


@numba.jit(**JIT_GEMM)
def _store(L, yf, res, q, v, bias, residual, lo, hi):
    """y[q : q + b] = clip(v + bias (+ the residual when `residual` is BEFORE or AFTER), lo, hi):
    the epilogue when the activation is a clip (-inf, inf for none); other activations run
    on the stored rows (activate_rows), so that their code is emitted once, not per pixel."""
    r = vload(L, res, q)  # y itself when there is none: read, never used
    vstore(yf, q, finish(v + bias, r, residual, True, lo, hi, IDENTITY, ZERO, ZERO))


@numba.jit(**JIT_GEMM)
def _store_row2(L, yf, res, q, vals, count, bias, residual, lo, hi):
    """y[q + j b] = _store of vals[j] for the pixels j < count of a 2-pixel output row (those
    inside the output)."""
    _store(L, yf, res, q, vals[0], bias, residual, lo, hi)
    if count > 1:
        _store(L, yf, res, q + L.width, vals[1], bias, residual, lo, hi)


@numba.jit(**JIT_GEMM)
def _store_row4(L, yf, res, q, vals, count, bias, residual, lo, hi):
    """As _store_row2 for a 4-pixel row."""
    _store_row2(L, yf, res, q, vals[:2], count, bias, residual, lo, hi)
    if count > 2:
        _store_row2(L, yf, res, q + 2 * L.width, vals[2:], count - 2, bias, residual, lo, hi)


@numba.jit(**JIT_GEMM)
def _output2(L, s, mo, stride, yf, res, q, rows, cols, ow, bias, residual, lo, hi):
    """y = A^T M A + bias, the clip applied (_store), for the F(2x2) tile whose M[xi] is at
    s[mo + xi stride]; q: y's flat offset of the tile's first pixel, rows x cols of it inside
    the output (ow the output's width)."""
    b = L.width
    # f_u = A^T along column u of M (f_u[i]: row i of A^T M), then A along each row i
    f0 = _out4(vload(L, s, mo), vload(L, s, mo + 4 * stride), vload(L, s, mo + 8 * stride),
               vload(L, s, mo + 12 * stride))  # fmt: skip
    f1 = _out4(vload(L, s, mo + stride), vload(L, s, mo + 5 * stride),
               vload(L, s, mo + 9 * stride), vload(L, s, mo + 13 * stride))  # fmt: skip
    f2 = _out4(vload(L, s, mo + 2 * stride), vload(L, s, mo + 6 * stride),
               vload(L, s, mo + 10 * stride), vload(L, s, mo + 14 * stride))  # fmt: skip
    f3 = _out4(vload(L, s, mo + 3 * stride), vload(L, s, mo + 7 * stride),
               vload(L, s, mo + 11 * stride), vload(L, s, mo + 15 * stride))  # fmt: skip
    _store_row2(L, yf, res, q, _out4(f0[0], f1[0], f2[0], f3[0]), cols, bias, residual, lo, hi)
    if rows > 1:
        _store_row2(L, yf, res, q + ow * b, _out4(f0[1], f1[1], f2[1], f3[1]), cols, bias,
                    residual, lo, hi)  # fmt: skip


@numba.jit(**JIT_GEMM)
def _output4(L, s, mo, stride, yf, res, q, rows, cols, ow, bias, residual, lo, hi):
    """As _output2 for the F(4x4) tile (M 6 x 6, Y 4 x 4)."""
    b = L.width
    f0 = _out6(L, vload(L, s, mo), vload(L, s, mo + 6 * stride), vload(L, s, mo + 12 * stride),
               vload(L, s, mo + 18 * stride), vload(L, s, mo + 24 * stride),
               vload(L, s, mo + 30 * stride))  # fmt: skip
    f1 = _out6(L, vload(L, s, mo + stride), vload(L, s, mo + 7 * stride),
               vload(L, s, mo + 13 * stride), vload(L, s, mo + 19 * stride),
               vload(L, s, mo + 25 * stride), vload(L, s, mo + 31 * stride))  # fmt: skip
    f2 = _out6(L, vload(L, s, mo + 2 * stride), vload(L, s, mo + 8 * stride),
               vload(L, s, mo + 14 * stride), vload(L, s, mo + 20 * stride),
               vload(L, s, mo + 26 * stride), vload(L, s, mo + 32 * stride))  # fmt: skip
    f3 = _out6(L, vload(L, s, mo + 3 * stride), vload(L, s, mo + 9 * stride),
               vload(L, s, mo + 15 * stride), vload(L, s, mo + 21 * stride),
               vload(L, s, mo + 27 * stride), vload(L, s, mo + 33 * stride))  # fmt: skip
    f4 = _out6(L, vload(L, s, mo + 4 * stride), vload(L, s, mo + 10 * stride),
               vload(L, s, mo + 16 * stride), vload(L, s, mo + 22 * stride),
               vload(L, s, mo + 28 * stride), vload(L, s, mo + 34 * stride))  # fmt: skip
    f5 = _out6(L, vload(L, s, mo + 5 * stride), vload(L, s, mo + 11 * stride),
               vload(L, s, mo + 17 * stride), vload(L, s, mo + 23 * stride),
               vload(L, s, mo + 29 * stride), vload(L, s, mo + 35 * stride))  # fmt: skip
    for i in range(4):  # constant trip count: unrolled, f*[i] then constant indices
        if i < rows:
            row = _out6(L, f0[i], f1[i], f2[i], f3[i], f4[i], f5[i])
            _store_row4(L, yf, res, q + i * ow * b, row, cols, bias, residual, lo, hi)


@numba.jit(**PARALLEL)
def winograd_blocked(L, T, xf, u, bias, yf, res, g, act_a, act_b, scratch, bad):
    """yf = epilogue(conv3x3(xf)) with F(m x m, 3x3), m = g[M], on blocked flat arrays: xf
    [N, CB, H, W, b], yf and res [N, MB, OH, OW, b] (yf [N, YMB, OH, OW, b] from its first
    block when y is blocks of a concatenation's larger tensor: no residual then); u the packed
    transformed weights [OGG, a*a, K, FB b]; bias [OGG FB b]; scratch [threads, a*a P (K + FB b)]
    (kernels.workspace.per_thread). Sets bad[0] when a transformed value was inf or NaN (the
    caller then runs the direct conv)."""
    b = L.width
    m = g[M]
    a = m + 2
    a2 = a * a
    k_len = g[CB] * b
    p_len, n_tg, n_ms, ogg = g[P], g[N_TG], g[N_MS], g[OGG]
    pr, fb = T.rows, T.cols
    fbw = fb * b
    oh, ow, tw = g[OH], g[OW], g[TW]
    h, w = g[H], g[W]
    kind, residual = g[KIND], g[RESIDUAL]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)  # -inf, inf when not a clip
    early = residual if simple or residual == BEFORE else NO_RESIDUAL  # what _store adds
    og_per = (ogg + n_ms - 1) // n_ms
    mt_off = a2 * p_len * k_len
    v_stride = p_len * k_len  # between one xi and the next in V
    m_stride = p_len * fbw  # in mt
    for item in numba.prange(g[N] * n_tg * n_ms):
        n, tg, ms = item // (n_tg * n_ms), (item // n_ms) % n_tg, item % n_ms
        s = scratch[numba.get_thread_id()]
        # the per-patch transforms and stores on pointers (borrow): no reference counts
        xp, sp, yp, rp = borrow(xf), borrow(s), borrow(yf), borrow(res)
        t_first = tg * p_len
        tiles = min(p_len, g[T_LEN] - t_first)
        probe = vzero(L)
        for cb in range(g[CB]):
            base = (n * g[CB] + cb) * g[H]
            for p in range(tiles):
                t = t_first + p
                r0, s0 = m * (t // tw) - g[PT], m * (t % tw) - g[PL]
                vo = p * k_len + cb * b
                if m == 2:
                    probe = _transform2(L, xp, h, w, base, r0, s0, sp, vo, v_stride, probe)
                else:
                    probe = _transform4(L, xp, h, w, base, r0, s0, sp, vo, v_stride, probe)
        if hsum(probe) != 0:  # NaN != 0 too
            bad[0] = 1  # any item may set it; all set the same value
        for og in range(ms * og_per, min(ogg, (ms + 1) * og_per)):
            for xi in range(a2):  # U[og, xi] stays in L1 across the row groups
                uo = (og * a2 + xi) * k_len * fbw
                for p0 in range(0, tiles, pr):
                    acc = tile_zeros(L, T)
                    vo = xi * v_stride + p0 * k_len
                    for c in range(k_len):
                        acc = tile_fma(acc, s, vo + c, k_len, u, uo + c * fbw)
                    tile_store(s, mt_off + xi * m_stride + p0 * fbw, acc)
            for f in range(fb):
                mb = og * fb + f
                if mb >= g[MB]:
                    break
                bv = vload(L, bias, mb * b)
                for p in range(tiles):
                    t = t_first + p
                    y0, x0 = m * (t // tw), m * (t % tw)
                    q = (((n * g[YMB] + mb) * oh + y0) * ow + x0) * b
                    mo = mt_off + p * fbw + f * b
                    rows, cols = min(m, oh - y0), min(m, ow - x0)
                    if m == 2:
                        _output2(L, sp, mo, m_stride, yp, rp, q, rows, cols, ow, bv, early, lo, hi)
                    else:
                        _output4(L, sp, mo, m_stride, yp, rp, q, rows, cols, ow, bv, early, lo, hi)
                    if not simple:
                        for i in range(rows):
                            activate_rows(L, yf, res, q + i * ow * b, I64[1], ZERO_I64,
                                          cols * b, residual, kind, act_a, act_b)  # fmt: skip
