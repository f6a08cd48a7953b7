"""Depthwise convolution on blocked tensors (group == C == M): one filter per channel, so the 8
channels of a block are 8 independent convolutions, one vector lane each.

    y[n, cb, oh, ow, :] = epilogue(sum_{i, j} x[n, cb, ih, iw, :] * W[cb, i, j, :])
    ih = oh sh - pt + i dh,   iw = ow sw - pl + j dw        (taps outside the image add nothing)

A work item (image, block, rows) first copies the input rows its outputs read into a
zero-padded scratch (padding rows and columns are zeros, and columns past the image reach as
far as the last whole tile reads): then every output pixel is a tile pixel, with no bound test
and no pixel-by-pixel edge path, which for the small images of late layers (7x7, 14x14) would
be most of the work. A tile holds TILE = 8 pixels of one block: 8 vector accumulators; per
tap one weight vector and 8 input vectors. The copy reads each input value once per item;
the epilogue is the direct kernel's (_direct.py).
"""

import numba
import numpy as np

from ._direct import (
    ACT,
    CB,
    DH,
    DW,
    KH,
    KW,
    OH,
    OW,
    PL,
    PT,
    RESIDUAL,
    ROWS,
    SH,
    SW,
    B,
    H,
    N,
    W,
    _activate,
    _finish,
    load8,
    store8,
)
from .config import INLINE_GEMM, JIT_GEMM, PARALLEL
from .epilogue import BEFORE, NO_RESIDUAL
from .simd.activation import clip_bounds, clips

u = np.uint64
TILE = 8  # pixels per tile


@numba.jit(**INLINE_GEMM)
def _vfma(a, xs, q, w):
    """a + x[q : q + 8] * w, lane by lane (the blocked channels of one pixel)."""
    return (
        a[0] + xs[q] * w[0], a[1] + xs[q + u(1)] * w[1], a[2] + xs[q + u(2)] * w[2],
        a[3] + xs[q + u(3)] * w[3], a[4] + xs[q + u(4)] * w[4], a[5] + xs[q + u(5)] * w[5],
        a[6] + xs[q + u(6)] * w[6], a[7] + xs[q + u(7)] * w[7],
    )  # fmt: skip


@numba.jit(**INLINE_GEMM)
def _tile8(xs, x0, xstep, wf, tx, tw, n_taps, tbuf):
    """tbuf[p * 8 : p * 8 + 8] = sum over the taps of x[pixel p] * w, 8 pixels."""
    z = np.float32(0.0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = (z, z, z, z, z, z, z, z)
    for t in range(n_taps):
        q = u(tx[t] + x0)
        w = load8(wf, u(tw[t]))
        a0 = _vfma(a0, xs, q, w)
        a1 = _vfma(a1, xs, q + xstep, w)
        a2 = _vfma(a2, xs, q + u(2) * xstep, w)
        a3 = _vfma(a3, xs, q + u(3) * xstep, w)
        a4 = _vfma(a4, xs, q + u(4) * xstep, w)
        a5 = _vfma(a5, xs, q + u(5) * xstep, w)
        a6 = _vfma(a6, xs, q + u(6) * xstep, w)
        a7 = _vfma(a7, xs, q + u(7) * xstep, w)
    store8(tbuf, u(0), a0)
    store8(tbuf, u(8), a1)
    store8(tbuf, u(16), a2)
    store8(tbuf, u(24), a3)
    store8(tbuf, u(32), a4)
    store8(tbuf, u(40), a5)
    store8(tbuf, u(48), a6)
    store8(tbuf, u(56), a7)


@numba.jit(**JIT_GEMM)
def _pad_rows(xf, g, n, cb, ih0, rows, wp, scr):
    """scr[r, q, :] = x[n, cb, ih0 + r, q - pl, :] for r < rows, q < wp; zero outside x. Each
    row is one contiguous copy and two runs of zeros (vector loops, no test per pixel)."""
    h, w, pl = g[H], g[W], g[PL]
    stride = wp * B
    for r in range(rows):
        ih = ih0 + r
        d = r * stride
        if ih < 0 or ih >= h:
            scr[d : d + stride] = 0.0
            continue
        src = ((n * g[CB] + cb) * h + ih) * w * B
        first = min(pl, wp)  # zero columns left of the image
        scr[d : d + first * B] = 0.0
        count = max(0, min(w, wp - pl))  # image columns the scratch holds
        scr[d + first * B : d + (first + count) * B] = xf[src : src + count * B]
        scr[d + (first + count) * B : d + stride] = 0.0


@numba.jit(**JIT_GEMM)
def _item(L, xf, wf, bf, yf, res, g, n, cb, r0, r1, tx, tw, scr, tbuf, act_a, act_b):
    """Output rows r0 <= oh < r1 of block cb of image n."""
    kh, kw, sh, sw, dh, dw = g[KH], g[KW], g[SH], g[SW], g[DH], g[DW]
    oh_len, ow_len = g[OH], g[OW]
    n_tiles = (ow_len + TILE - 1) // TILE
    wp = (n_tiles * TILE - 1) * sw + (kw - 1) * dw + 1
    ih0 = r0 * sh - g[PT]
    _pad_rows(xf, g, n, cb, ih0, (r1 - 1 - r0) * sh + (kh - 1) * dh + 1, wp, scr)
    residual, kind = g[RESIDUAL], g[ACT]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)  # -inf, inf when not a clip
    early = residual if simple or residual == BEFORE else NO_RESIDUAL  # what _finish adds
    ystride = u(oh_len * ow_len * B)
    bo = u(cb * B)
    for oh in range(r0, r1):
        k = 0
        for i in range(kh):
            r = (oh - r0) * sh + i * dh  # the scratch row of tap row i
            for j in range(kw):
                tx[k] = (r * wp + j * dw) * B
                tw[k] = ((cb * kh + i) * kw + j) * B
                k += 1
        yo = u(((n * g[CB] + cb) * oh_len + oh) * ow_len * B)
        for t in range(n_tiles):
            ow0 = t * TILE
            _tile8(scr, ow0 * sw * B, u(sw * B), wf, tx, tw, k, tbuf)
            npx = min(TILE, ow_len - ow0)
            yt = yo + u(ow0 * B)
            _finish(L, tbuf, npx, 1, 1, yf, yt, ystride, res, bf, bo, early, lo, hi)
        if not simple:
            _activate(L, yf, res, yo, 1, ystride, ow_len * B, residual, kind, act_a, act_b)


def scratch_size(g) -> int:
    """Floats of scratch one work item takes (the padded input rows, a tile, the taps)."""
    n_tiles = (g[OW] + TILE - 1) // TILE
    wp = (n_tiles * TILE - 1) * g[SW] + (g[KW] - 1) * g[DW] + 1
    span = (g[ROWS] - 1) * g[SH] + (g[KH] - 1) * g[DH] + 1
    return span * wp * B + TILE * B


@numba.jit(**PARALLEL)
def dwconv_nchwc(L, xf, wf, bf, yf, res, g, act_a, act_b, work):
    """y = epilogue(depthwise conv(x)) on flat blocked arrays; g: the geometry (_direct's
    indices, CB the channel-block count, ROWS the output rows per item, ACT the activation's
    kind, act_a and act_b its parameters); work: per-thread scratch [threads,
    scratch_size(g)]; L: Lanes(B)."""
    rows, cb_len, oh_len = g[ROWS], g[CB], g[OH]
    rb_len = (oh_len + rows - 1) // rows
    n_tiles = (g[OW] + TILE - 1) // TILE
    wp = (n_tiles * TILE - 1) * g[SW] + (g[KW] - 1) * g[DW] + 1
    span = (rows - 1) * g[SH] + (g[KH] - 1) * g[DH] + 1
    for item in numba.prange(g[N] * cb_len * rb_len):
        n, rest = item // (cb_len * rb_len), item % (cb_len * rb_len)
        cb, rb = rest // rb_len, rest % rb_len
        tx = np.empty(g[KH] * g[KW], np.int64)
        tw = np.empty(g[KH] * g[KW], np.int64)
        mine = work[numba.get_thread_id()]
        scr, tbuf = mine[: span * wp * B], mine[span * wp * B : span * wp * B + TILE * B]
        r0 = rb * rows
        _item(L, xf, wf, bf, yf, res, g, n, cb, r0, min(oh_len, r0 + rows), tx, tw, scr, tbuf,
              act_a, act_b)  # fmt: skip
