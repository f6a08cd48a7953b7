"""Depthwise convolution on blocked tensors (group == C == M): one filter per channel, so the b
channels of a block (b = L.width, 8 or 16) are b independent convolutions, one vector lane each.

    y[n, cb, oh, ow, :] = epilogue(sum_{i, j} x[n, cb, ih, iw, :] * W[cb, i, j, :])
    ih = oh sh - pt + i dh,   iw = ow sw - pl + j dw        (taps outside the image add nothing)

A tile holds TILE = 8 pixels of one block: 8 vector accumulators; per tap one weight vector and
8 input vectors (8 independent FMA chains, 10 registers of AVX2's 16 or AVX-512's 32). The
epilogue (kernels/epilogue.py: bias, residual, a clip) is applied to the accumulators in
registers and stored once; other activations run on the finished row (epilogue.activate_rows).

Where a tile reads. Every tap of a tile reads base + taps[t] + p step for its pixels p: the
source is either x itself or a zero-padded copy of the rows it needs, so there is one tile body
and no bound test inside it. Four ways, chosen per shape (conv_nchwc._depthwise_split sets
g[PAD]):
- PAD = 3: x read in place, every column in tiles, the filter rows outside the image skipped
  and the columns outside a row loaded through masks as zeros (masked_edges: the row-shared
  loads of 3- and 5-wide filters mask a tile's first two and last two input vectors of a row;
  a masked-off lane is not read, so nothing outside x is touched): no copy and no edge pixel,
  the least work, taken wherever it applies on a row of at least a tile (on one thread 2-22%
  faster than the best of the others on 56-112-wide rows, from 7% faster to 6% slower on
  14-28-wide ones; on 7-wide rows the padded copy stays ahead: bench/NOTES.md).
- PAD = 1: a work item (image, block, rows) copies the input rows its outputs read into a
  zero-padded scratch once, and every tile reads the scratch: each input vector is copied
  once per item (plus the halo rows), the cheaper way at stride 1 and on small images (7x7,
  14x14), where most tiles touch an edge.
- PAD = 0: tiles whose taps are all inside the image read x; a tile at an edge first copies
  its own (kh - 1) dh + 1 rows of (TILE - 1) sw + (kw - 1) dw + 1 pixels. At stride 2 an
  item's padded copy moves twice the vectors the FMAs read per output row (sh input rows of
  the padded width per output row, each copied once, against TILE FMAs per 8 outputs): x
  read in place saves that copy.
- PAD = 2: nothing copied (_row_in_place): per output row the filter rows outside the image
  are skipped, tiles cover the columns whose taps all lie inside, and the few columns at the
  left and right edges run one pixel at a time with a test per tap (_pixel). For the filters
  whose loads are not shared (dilated, 7 wide, 5 wide at 8 lanes); on small images the edge
  pixels cost more than PAD 1's copy (bench/NOTES.md).
PAD 0, 1 and 2 are ranked by a count of the vector operations they cost.
A row's last tile ends at the row's end, overlapping the one before (tile_column): a tile
past the end would read padding, a copy at PAD 0, where at stride 2 on an even width the
overlapping one reads only x.
x, y and the packed weights ([CB, KH, KW, b]) share the block b, which the kernel takes from
L, compiled once per width.
"""

import numba
import numpy as np

from ._blocked_geometry import (
    ACT,
    BI,
    CB,
    DH,
    DW,
    KH,
    KW,
    OH,
    OW,
    PAD,
    PL,
    PT,
    RESIDUAL,
    ROW0,
    ROWS,
    SH,
    SW,
    H,
    N,
    W,
)  # fmt: skip
from .config import FORCE_GEMM, I64, INLINE_GEMM, JIT_GEMM, PARALLEL, ZERO_I64
from .epilogue import BEFORE, NO_RESIDUAL, activate_rows, finish
from .simd import borrow, mask_all, tail_mask, vfma, vload, vload_masked, vstore, vzero
from .simd.activation import IDENTITY, clip, clip_bounds, clips

ZERO = np.float32(0.0)

u = np.uint64
TILE = 8  # pixels per tile


@numba.jit(**INLINE_GEMM)
def _put(L, a, bias, yf, q, res, residual, lo, hi):
    """y[q : q + b] = the epilogue of accumulator a: bias, the residual (when `residual` is
    BEFORE or AFTER), the clip [lo, hi] (-inf, inf when the activation is no clip)."""
    # y itself when there is none: read, never used, and worth it: the load brings y's line
    # into the cache ahead of the store (without it 1.2-1.6x slower, bench/NOTES.md)
    r = vload(L, res, q)
    vstore(yf, q, finish(a + bias, r, residual, True, lo, hi, IDENTITY, ZERO, ZERO))


@numba.jit(**INLINE_GEMM)
def _put_clip(L, a, bias, yf, q, lo, hi):
    """y[q : q + b] = clip(a + bias, lo, hi): _put without a residual."""
    vstore(yf, q, clip(a + bias, lo, hi))


@numba.jit(**INLINE_GEMM)
def _put_clip7(L, a0, a1, a2, a3, a4, a5, a6, bias, yf, q, lo, hi):
    """_put_clip of a tile's first 7 accumulators, one vector of b apart from q."""
    b = u(L.width)
    _put_clip(L, a0, bias, yf, q, lo, hi)
    _put_clip(L, a1, bias, yf, q + b, lo, hi)
    _put_clip(L, a2, bias, yf, q + u(2) * b, lo, hi)
    _put_clip(L, a3, bias, yf, q + u(3) * b, lo, hi)
    _put_clip(L, a4, bias, yf, q + u(4) * b, lo, hi)
    _put_clip(L, a5, bias, yf, q + u(5) * b, lo, hi)
    _put_clip(L, a6, bias, yf, q + u(6) * b, lo, hi)


@numba.jit(**FORCE_GEMM)
def _sum_taps(L, src, x0, step, wf, w0, taps, n_taps):
    """The 8 accumulators sum_t src[x0 + taps[t] + p step] * wf[w0 + t b], p < TILE: one weight
    vector and 8 input vectors per tap."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(L)
    b = u(L.width)
    for t in range(n_taps):
        q = u(taps[t] + x0)
        w = vload(L, wf, u(w0) + u(t) * b)
        a0 = vfma(vload(L, src, q), w, a0)
        a1 = vfma(vload(L, src, q + step), w, a1)
        a2 = vfma(vload(L, src, q + u(2) * step), w, a2)
        a3 = vfma(vload(L, src, q + u(3) * step), w, a3)
        a4 = vfma(vload(L, src, q + u(4) * step), w, a4)
        a5 = vfma(vload(L, src, q + u(5) * step), w, a5)
        a6 = vfma(vload(L, src, q + u(6) * step), w, a6)
        a7 = vfma(vload(L, src, q + u(7) * step), w, a7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@numba.jit(**FORCE_GEMM)
def _sum_rows3(L, src, x0, sw, wf, w0, taps, kh, m0, m1, mr1, mr0):
    """The same sums for a filter 3 wide, undilated, stride sw 1 or 2: per filter row the
    (TILE - 1) sw + 3 input vectors the row's taps share are loaded once (10 or 17 loads and 3
    weights for 24 FMAs, where tap by tap takes 27 loads): pixel p's taps are v[p sw + j]. The
    first two and last two of them through masks m0, m1, mr1, mr0 (all lanes, or none: a
    column outside the row reads as zeros, _edge_masks)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(L)
    b = u(L.width)
    for i in range(kh):
        q = u(taps[3 * i] + x0)
        wo = u(w0) + u(3 * i) * b
        wa, wb, wc = vload(L, wf, wo), vload(L, wf, wo + b), vload(L, wf, wo + u(2) * b)
        v0, v1 = vload_masked(L, src, q, m0), vload_masked(L, src, q + b, m1)
        v2, v3 = vload(L, src, q + u(2) * b), vload(L, src, q + u(3) * b)
        v4, v5 = vload(L, src, q + u(4) * b), vload(L, src, q + u(5) * b)
        v6, v7 = vload(L, src, q + u(6) * b), vload(L, src, q + u(7) * b)
        if sw == 1:
            v8 = vload_masked(L, src, q + u(8) * b, mr1)
            v9 = vload_masked(L, src, q + u(9) * b, mr0)
            a0 = vfma(v2, wc, vfma(v1, wb, vfma(v0, wa, a0)))
            a1 = vfma(v3, wc, vfma(v2, wb, vfma(v1, wa, a1)))
            a2 = vfma(v4, wc, vfma(v3, wb, vfma(v2, wa, a2)))
            a3 = vfma(v5, wc, vfma(v4, wb, vfma(v3, wa, a3)))
            a4 = vfma(v6, wc, vfma(v5, wb, vfma(v4, wa, a4)))
            a5 = vfma(v7, wc, vfma(v6, wb, vfma(v5, wa, a5)))
            a6 = vfma(v8, wc, vfma(v7, wb, vfma(v6, wa, a6)))
            a7 = vfma(v9, wc, vfma(v8, wb, vfma(v7, wa, a7)))
        else:
            v8, v9 = vload(L, src, q + u(8) * b), vload(L, src, q + u(9) * b)
            v10, v11 = vload(L, src, q + u(10) * b), vload(L, src, q + u(11) * b)
            v12, v13 = vload(L, src, q + u(12) * b), vload(L, src, q + u(13) * b)
            v14 = vload(L, src, q + u(14) * b)
            v15 = vload_masked(L, src, q + u(15) * b, mr1)
            v16 = vload_masked(L, src, q + u(16) * b, mr0)
            a0 = vfma(v2, wc, vfma(v1, wb, vfma(v0, wa, a0)))
            a1 = vfma(v4, wc, vfma(v3, wb, vfma(v2, wa, a1)))
            a2 = vfma(v6, wc, vfma(v5, wb, vfma(v4, wa, a2)))
            a3 = vfma(v8, wc, vfma(v7, wb, vfma(v6, wa, a3)))
            a4 = vfma(v10, wc, vfma(v9, wb, vfma(v8, wa, a4)))
            a5 = vfma(v12, wc, vfma(v11, wb, vfma(v10, wa, a5)))
            a6 = vfma(v14, wc, vfma(v13, wb, vfma(v12, wa, a6)))
            a7 = vfma(v16, wc, vfma(v15, wb, vfma(v14, wa, a7)))
    return a0, a1, a2, a3, a4, a5, a6, a7


@numba.jit(**FORCE_GEMM)
def _load11(L, src, q, m0, m1, m9, m10):
    """The 11 vectors src[q + j b], j < 11, the first two and last two through masks: a 5-wide
    filter row's inputs for 4 pixels at stride 2, or all but the last for 8 at stride 1."""
    b = u(L.width)
    return (vload_masked(L, src, q, m0), vload_masked(L, src, q + b, m1),
            vload(L, src, q + u(2) * b), vload(L, src, q + u(3) * b),
            vload(L, src, q + u(4) * b), vload(L, src, q + u(5) * b),
            vload(L, src, q + u(6) * b), vload(L, src, q + u(7) * b),
            vload(L, src, q + u(8) * b), vload_masked(L, src, q + u(9) * b, m9),
            vload_masked(L, src, q + u(10) * b, m10))  # fmt: skip


@numba.jit(**FORCE_GEMM)
def _fma5(a, v0, v1, v2, v3, v4, w):
    """a + sum_j v_j w[j]: one pixel's 5 taps of a filter row, in tap order."""
    return vfma(v4, w[4], vfma(v3, w[3], vfma(v2, w[2], vfma(v1, w[1], vfma(v0, w[0], a)))))


@numba.jit(**FORCE_GEMM)
def _half5s2(a0, a1, a2, a3, v, w):
    """4 pixels at stride 2 from their row's 11 input vectors v (pixel p reads v[2 p + j])."""
    return (_fma5(a0, v[0], v[1], v[2], v[3], v[4], w), _fma5(a1, v[2], v[3], v[4], v[5], v[6], w),
            _fma5(a2, v[4], v[5], v[6], v[7], v[8], w),
            _fma5(a3, v[6], v[7], v[8], v[9], v[10], w))  # fmt: skip


@numba.jit(**FORCE_GEMM)
def _sum_rows5(L, src, x0, sw, wf, w0, taps, kh, m0, m1, mr1, mr0):
    """The same sums for a filter 5 wide, undilated, stride sw 1 or 2, its loads shared as in
    _sum_rows3: per filter row 12 input vectors and 5 weights for 40 FMAs at stride 1 (tap by
    tap: 45 loads), at stride 2 two half tiles of 4 pixels, 11 input vectors each (19 at once
    would take every register). Tap by tap the loop ran at 13 cycles a tap for 8 FMAs with its
    data in L1 on Zen 4 (bench/NOTES.md), about the rate of its 9 loads if each 512-bit load
    takes one of the L1's cycles; shared, 17 loads feed 40 FMAs. 25 vectors live: a register
    file of 32 (AVX-512) holds them, so item takes this path at 16 lanes only."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(L)
    b = u(L.width)
    full = tail_mask(L, L.width)
    for i in range(kh):
        q = u(taps[5 * i] + x0)
        wo = u(w0) + u(5 * i) * b
        w = (vload(L, wf, wo), vload(L, wf, wo + b), vload(L, wf, wo + u(2) * b),
             vload(L, wf, wo + u(3) * b), vload(L, wf, wo + u(4) * b))  # fmt: skip
        if sw == 1:  # v10 and v11 may lie past the row's end
            v = _load11(L, src, q, m0, m1, full, mr1)
            v11 = vload_masked(L, src, q + u(11) * b, mr0)
            a0 = _fma5(a0, v[0], v[1], v[2], v[3], v[4], w)
            a1 = _fma5(a1, v[1], v[2], v[3], v[4], v[5], w)
            a2 = _fma5(a2, v[2], v[3], v[4], v[5], v[6], w)
            a3 = _fma5(a3, v[3], v[4], v[5], v[6], v[7], w)
            a4 = _fma5(a4, v[4], v[5], v[6], v[7], v[8], w)
            a5 = _fma5(a5, v[5], v[6], v[7], v[8], v[9], w)
            a6 = _fma5(a6, v[6], v[7], v[8], v[9], v[10], w)
            a7 = _fma5(a7, v[7], v[8], v[9], v[10], v11, w)
        else:  # pixels 0-3 read v0-v10, pixels 4-7 the 11 vectors 8 on (v17, v18 the last)
            a0, a1, a2, a3 = _half5s2(a0, a1, a2, a3, _load11(L, src, q, m0, m1, full, full), w)
            v = _load11(L, src, q + u(8) * b, full, full, mr1, mr0)
            a4, a5, a6, a7 = _half5s2(a4, a5, a6, a7, v, w)
    return a0, a1, a2, a3, a4, a5, a6, a7


@numba.jit(**FORCE_GEMM)
def _tile(L, src, x0, step, wf, w0, taps, n_taps, npx, bias, yf, yo, res, residual, lo, hi,
          shared, m0, m1, mr1, mr0):  # fmt: skip
    """y[yo + p b] = epilogue(sum_t src[x0 + taps[t] + p step] * wf[w0 + t b]) for the npx <=
    TILE pixels p of a tile (b = L.width channels of one block, lane by lane); shared: the
    filter's width when a filter row's loads are shared (3: _sum_rows3, 5: _sum_rows5; stride
    step / b of 1 or 2, undilated), else 0 (any filter, tap by tap). m0, m1, mr1, mr0: the
    masks of a filter row's first two and last two input vectors when its loads are shared
    (_edge_masks)."""
    if shared == 3:
        a0, a1, a2, a3, a4, a5, a6, a7 = _sum_rows3(L, src, x0, step // u(L.width), wf, w0,
                                                    taps, n_taps // 3, m0, m1, mr1,
                                                    mr0)  # fmt: skip
    elif shared == 5:
        a0, a1, a2, a3, a4, a5, a6, a7 = _sum_rows5(L, src, x0, step // u(L.width), wf, w0,
                                                    taps, n_taps // 5, m0, m1, mr1,
                                                    mr0)  # fmt: skip
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = _sum_taps(L, src, x0, step, wf, w0, taps, n_taps)
    b = u(L.width)
    # a row narrower than a tile: pixels past its end computed from padding, not stored
    yo = u(yo)
    # 8 or 7 stores (7-wide rows) with no test between them (a test per store, or finish's per
    # vector, cost 1.1-1.4x on 3x3 convs: bench/NOTES.md)
    if residual == NO_RESIDUAL and npx == TILE:
        _put_clip7(L, a0, a1, a2, a3, a4, a5, a6, bias, yf, yo, lo, hi)
        _put_clip(L, a7, bias, yf, yo + u(7) * b, lo, hi)
        return
    if residual == NO_RESIDUAL and npx == TILE - 1:
        _put_clip7(L, a0, a1, a2, a3, a4, a5, a6, bias, yf, yo, lo, hi)
        return
    _put(L, a0, bias, yf, yo, res, residual, lo, hi)
    if npx > 1:
        _put(L, a1, bias, yf, yo + b, res, residual, lo, hi)
    if npx > 2:
        _put(L, a2, bias, yf, yo + u(2) * b, res, residual, lo, hi)
    if npx > 3:
        _put(L, a3, bias, yf, yo + u(3) * b, res, residual, lo, hi)
    if npx > 4:
        _put(L, a4, bias, yf, yo + u(4) * b, res, residual, lo, hi)
    if npx > 5:
        _put(L, a5, bias, yf, yo + u(5) * b, res, residual, lo, hi)
    if npx > 6:
        _put(L, a6, bias, yf, yo + u(6) * b, res, residual, lo, hi)
    if npx > 7:
        _put(L, a7, bias, yf, yo + u(7) * b, res, residual, lo, hi)


@numba.jit(**INLINE_GEMM)
def _pixel(L, xf, row0, iw0, w, wf, w0, rows, kw, dh, dw):
    """One pixel's sum over filter rows 0 <= i < rows from x's row at row0 (the offset of its
    pixel 0) on, the taps left or right of x's w columns skipped (iw0: the pixel's first input
    column, maybe negative): a pixel at a left or right edge, read in place (PAD 2). The taps
    in the tiles' order, so a sum equals a tile's on zero padding."""
    b = L.width
    a = vzero(L)
    for i in range(rows):
        ro = row0 + i * dh * w * b
        for j in range(kw):
            iw = iw0 + j * dw
            if iw >= 0 and iw < w:
                a = vfma(vload(L, xf, u(ro + iw * b)), vload(L, wf, u(w0 + (i * kw + j) * b)), a)
    return a


def inner_columns(w, kw, sw, dw, pl, ow_len):
    """(a, b): the output columns a <= ow < b whose every tap lies inside a row of w pixels
    (a = b when none do)."""
    a = min(ow_len, (pl + sw - 1) // sw)
    last = w - 1 - (kw - 1) * dw + pl  # the last column a tile's first tap may start at, + pl
    b = min(ow_len, last // sw + 1) if last >= 0 else 0
    return a, max(a, b)


_inner_columns = numba.jit(**INLINE_GEMM)(inner_columns)


@numba.jit(**JIT_GEMM)
def _pad_rows(L, xf, g, n, cb, ih0, rows, iw0, wp, scr):
    """scr[r, q, :] = x[n, cb, ih0 + r, iw0 + q, :] for r < rows, q < wp; zero outside x. Each
    row is a run of zeros, a copy and a run of zeros, vector by vector: no test per pixel (a
    slice assignment would also check its operands for overlap, and copy through a temporary
    when it cannot tell)."""
    h, w, b = g[H], g[W], L.width
    first = min(max(0, -iw0), wp)  # zero columns left of the image
    count = max(0, min(w - max(0, iw0), wp - first))  # image columns the scratch holds
    zero = vzero(L)
    for r in range(rows):
        ih = ih0 + r
        d = u(r * wp * b)
        if ih < 0 or ih >= h:
            for q in range(wp):
                vstore(scr, d + u(q * b), zero)
            continue
        src = u((((n * g[CB] + cb) * h + ih) * w + max(0, iw0)) * b)
        for q in range(first):
            vstore(scr, d + u(q * b), zero)
        for q in range(count):
            vstore(scr, d + u((first + q) * b), vload(L, xf, src + u(q * b)))
        for q in range(first + count, wp):
            vstore(scr, d + u(q * b), zero)


@numba.jit(**INLINE_GEMM)
def _taps(g, row_stride, b, taps):
    """taps[i kw + j] = the offset of tap (i, j) from a tile's first pixel in a source whose
    rows are row_stride pixels apart; returns the tap count."""
    kh, kw, dh, dw = g[KH], g[KW], g[DH], g[DW]
    for i in range(kh):
        for j in range(kw):
            taps[i * kw + j] = (i * dh * row_stride + j * dw) * b
    return kh * kw


def tile_column(t, n_tiles, ow_len):
    """The first output column of tile t of a row's n_tiles: TILE apart, and the last ending
    at the row's end, overlapping the one before (its pixels recomputed, the same sums), rather
    than computing pixels past the row: past the row a tile reads padding, which in place (PAD
    0) means a copy; at the row's end it often reads only x (stride 2 on an even width)."""
    return t * TILE if t < n_tiles - 1 else max(0, ow_len - TILE)


_tile_column = numba.jit(**INLINE_GEMM)(tile_column)


def _widths(g):
    """(pixels of a padded item row, pixels of a tile's padded row) for geometry g (plain
    Python and Numba alike)."""
    n_tiles = (g[OW] + TILE - 1) // TILE
    wp = (n_tiles * TILE - 1) * g[SW] + (g[KW] - 1) * g[DW] + 1
    return wp, (TILE - 1) * g[SW] + (g[KW] - 1) * g[DW] + 1


_widths_jit = numba.jit(**INLINE_GEMM)(_widths)


@numba.jit(**INLINE_GEMM)
def _column_mask(L, c, w):
    """All lanes if column c lies in a row of w pixels, else none (a column of zero padding)."""
    return mask_all(L, c >= 0 and c < w)


@numba.jit(**INLINE_GEMM)
def _edge_masks(L, iw0, w, last):
    """The masks of a tile's first two and last two input vectors of a filter row (columns
    iw0, iw0 + 1, iw0 + last - 1, iw0 + last): at an edge of the row the columns outside it
    load as zeros, the padding, and nothing outside the row is read (a masked-off lane is not
    accessed)."""
    return (_column_mask(L, iw0, w), _column_mask(L, iw0 + 1, w),
            _column_mask(L, iw0 + last - 1, w), _column_mask(L, iw0 + last, w))  # fmt: skip


def shared_width(kw: int, sw: int, dw: int, width: int) -> int:
    """The filter width whose rows' loads a tile shares (_sum_rows3, _sum_rows5), else 0 (tap
    by tap): 3 wide, or 5 wide with 32 vector registers (16 lanes), undilated, stride 1 or 2."""
    rows_ok = dw == 1 and (sw == 1 or sw == 2)
    return kw if rows_ok and (kw == 3 or (kw == 5 and width >= 16)) else 0


_shared_width = numba.jit(**INLINE_GEMM)(shared_width)


def masked_edges(kw: int, sw: int, dw: int, pl: int, w: int, ow: int, width: int) -> bool:
    """Whether the in-place row may run every column as tiles, the columns outside the row
    masked (PAD 3): row-shared loads, of which only the first two and last two vectors are
    masked, so at most two columns of padding at the left, and the last tile's vectors but its
    last two inside the row (a row narrower than a tile too: one tile, its pixels past the row
    computed, not stored)."""
    if not shared_width(kw, sw, dw, width) or pl > 2:
        return False
    last = (TILE - 1) * sw + (kw - 1) * dw  # a tile's last input vector
    return max(0, ow - TILE) * sw - pl + last - 2 < w


@numba.jit(**INLINE_GEMM)
def _row_in_place(L, xf, wf, yp, rp, g, plane, ih0, w0, yo, col_a, col_b, taps, bias, early,
                  lo, hi, shared):  # fmt: skip
    """One output row read from x in place (PAD 2 and 3), as onnxruntime's NCHWc kernel does:
    the filter rows outside the image skipped (the tiles run on the rows inside), nothing
    copied (module docstring). PAD 3: tiles of TILE pixels over every column (the last ending
    at the row's end, overlapping the one before), the columns outside the row loaded through
    masks as zeros. PAD 2: tiles over the columns a <= ow < b whose taps are all inside the row,
    the pixels left of a and from b on one at a time with a test per tap (_pixel). Needs a row
    of at least TILE columns (PAD 3: masked_edges) or b - a >= TILE (conv_nchwc chooses them
    only then; with fewer, every pixel goes one at a time). yp, rp: y and the residual,
    borrowed (pointers)."""
    kh, kw, sw, dh, dw = g[KH], g[KW], g[SW], g[DH], g[DW]
    h, w, ow_len, pl, b = g[H], g[W], g[OW], g[PL], L.width
    i_lo = max(0, (dh - 1 - ih0) // dh)  # the first filter row inside the image
    i_hi = min(kh, (h - ih0 + dh - 1) // dh)  # past the last
    rows = max(0, i_hi - i_lo)
    row0 = plane + (ih0 + i_lo * dh) * w * b  # x's row of filter row i_lo, pixel 0
    wr = w0 + i_lo * kw * b
    step = u(sw * b)
    masked = g[PAD] == 3
    if masked:
        col_a, col_b = 0, ow_len
    inner = col_b - col_a
    last = (TILE - 1) * sw + (kw - 1) * dw  # a tile's last input vector of a filter row
    n_tiles = (inner + TILE - 1) // TILE if inner >= TILE or masked else 0
    for t in range(n_tiles):
        ow0 = col_a + (t * TILE if t < n_tiles - 1 else max(0, inner - TILE))
        iw0 = ow0 * sw - pl
        m0, m1, mr1, mr0 = _edge_masks(L, iw0, w, last)
        _tile(L, xf, row0 + iw0 * b, step, wf, wr, taps, rows * kw, min(TILE, ow_len - ow0),
              bias, yp, yo + ow0 * b, rp, early, lo, hi, shared, m0, m1, mr1,
              mr0)  # fmt: skip
    # the pixels left of the tiles, then right of them (without tiles: every pixel)
    left = col_a if n_tiles > 0 else ow_len
    right = col_b if n_tiles > 0 else ow_len
    for k in range(left + ow_len - right):
        ow = k if k < left else right + k - left
        a = _pixel(L, xf, row0, ow * sw - pl, w, wf, wr, rows, kw, dh, dw)
        _put(L, a, bias, yp, u(yo + ow * b), rp, early, lo, hi)


@numba.jit(**JIT_GEMM)
def item(L, xf, wf, bf, yf, res, g, n, cb, r0, r1, taps, scr, act_a, act_b):
    """Output rows r0 <= oh < r1 of block cb of image n: the serial work item of dwconv_nchwc,
    and of the depth-first block kernel (_inverted_residual_blocked) on its band scratch."""
    kh, kw, sh, sw, dh = g[KH], g[KW], g[SH], g[SW], g[DH]
    h, w, oh_len, ow_len, b = g[H], g[W], g[OH], g[OW], L.width
    pt, pl = g[PT], g[PL]
    wp, wt = _widths_jit(g)
    span = (kh - 1) * dh + 1  # input rows one output row reads
    residual, kind = g[RESIDUAL], g[ACT]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)  # -inf, inf when not a clip
    early = residual if simple or residual == BEFORE else NO_RESIDUAL  # what _tile adds
    ystride = oh_len * ow_len * b
    bias = vload(L, bf, u(cb * b))
    # y and the residual as pointers for the tiles' stores: _tile is inlined by LLVM, and
    # given the arrays it increfed and decrefed both per tile (bench/NOTES.md)
    yp, rp = borrow(yf), borrow(res)
    w0 = cb * kh * kw * b
    step = u(sw * b)
    shared = _shared_width(kw, sw, g[DW], L.width)
    padded, in_place = g[PAD] == 1, g[PAD] >= 2
    full = tail_mask(L, L.width)
    if padded:  # one padded copy of the item's rows; every tile reads it
        _pad_rows(L, xf, g, n, cb, r0 * sh - pt, (r1 - 1 - r0) * sh + span, -pl, wp, scr)
        k = _taps(g, wp, b, taps)
    else:  # x in place (taps[:k]), or a tile's own padded copy (taps[k:])
        k = _taps(g, w, b, taps)
        _taps(g, wt, b, taps[k:])
    plane = (n * g[CB] + cb) * h * w * b
    n_tiles = (ow_len + TILE - 1) // TILE
    col_a, col_b = _inner_columns(w, kw, sw, g[DW], pl, ow_len)
    for oh in range(r0, r1):
        yo = ((n * g[CB] + cb) * oh_len + oh - g[ROW0]) * ow_len * b
        ih0 = oh * sh - pt
        rows_in = ih0 >= 0 and ih0 + span <= h
        if in_place:
            _row_in_place(L, xf, wf, yp, rp, g, plane, ih0, w0, yo, col_a, col_b, taps, bias,
                          early, lo, hi, shared)  # fmt: skip
            if not simple:
                activate_rows(L, yf, res, yo, I64[1], ystride, ow_len * b, residual, kind, act_a,
                              act_b)  # fmt: skip
            continue
        for t in range(n_tiles):
            ow0 = _tile_column(t, n_tiles, ow_len)
            npx = min(TILE, ow_len - ow0)
            iw0 = ow0 * sw - pl
            if padded:
                x0 = ((oh - r0) * sh * wp + ow0 * sw) * b
                _tile(L, scr, x0, step, wf, w0, taps, k, npx, bias, yp, yo + ow0 * b, rp,
                      early, lo, hi, shared, full, full, full, full)  # fmt: skip
            elif rows_in and iw0 >= 0 and iw0 + wt <= w:
                # every tap of all TILE pixels inside x (the pixels past npx too: in the row)
                x0 = plane + (ih0 * w + iw0) * b
                _tile(L, xf, x0, step, wf, w0, taps, k, npx, bias, yp, yo + ow0 * b, rp,
                      early, lo, hi, shared, full, full, full, full)  # fmt: skip
            else:
                _pad_rows(L, xf, g, n, cb, ih0, span, iw0, wt, scr)
                _tile(L, scr, ZERO_I64, step, wf, w0, taps[k:], k, npx, bias, yp, yo + ow0 * b, rp,
                      early, lo, hi, shared, full, full, full, full)  # fmt: skip
        if not simple:
            activate_rows(L, yf, res, yo, I64[1], ystride, ow_len * b, residual, kind, act_a, act_b)


def scratch_size(g) -> int:
    """Floats of scratch one work item takes (padded input rows: the item's when g[PAD] is 1, a
    tile's when 0; none when 2, but the kernel's argument is an array all the same: 1), g[BI]
    being the block (a depthwise conv's input block is its output block, L.width of the
    call)."""
    wp, wt = _widths(g)
    span = (g[KH] - 1) * g[DH] + 1
    if g[PAD] >= 2:
        return 1
    if g[PAD] == 1:
        return ((g[ROWS] - 1) * g[SH] + span) * wp * g[BI]
    return span * wt * g[BI]


@numba.jit(**PARALLEL)
def dwconv_nchwc(L, xf, wf, bf, yf, res, g, act_a, act_b, work):
    """y = epilogue(depthwise conv(x)) on flat blocked arrays, x and y [N, CB, ., ., b],
    packed [CB, KH, KW, b], bias [CB b]; L: Lanes(b), g[BI] = b. g: the geometry (_direct_blocked's
    indices, CB the channel-block count, ROWS the output rows per item, PAD how tiles at an
    edge read, ACT the activation's kind, act_a and act_b its parameters); work: per-thread
    scratch [threads, scratch_size(g)]."""
    rows, cb_len, oh_len = g[ROWS], g[CB], g[OH]
    rb_len = (oh_len + rows - 1) // rows
    for it in numba.prange(g[N] * cb_len * rb_len):
        n, rest = it // (cb_len * rb_len), it % (cb_len * rb_len)
        cb, rb = rest // rb_len, rest % rb_len
        taps = np.empty(2 * g[KH] * g[KW], np.int64)
        r0 = rb * rows
        item(L, xf, wf, bf, yf, res, g, n, cb, r0, min(oh_len, r0 + rows), taps,
              work[numba.get_thread_id()], act_a, act_b)  # fmt: skip
