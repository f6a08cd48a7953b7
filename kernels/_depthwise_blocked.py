"""Depthwise convolution on blocked tensors (group == C == M): one filter per channel, so the b
channels of a block (b = L.width, 8 or 16) are b independent convolutions, one vector lane each.

    y[n, cb, oh, ow, :] = epilogue(sum_{i, j} x[n, cb, ih, iw, :] * W[cb, i, j, :])
    ih = oh sh - pt + i dh,   iw = ow sw - pl + j dw        (taps outside the image add nothing)

A work item (image, block, rows) first copies the input rows its outputs read into a
zero-padded scratch (padding rows and columns are zeros, and columns past the image reach as
far as the last whole tile reads): then every output pixel is a tile pixel, with no bound test
and no pixel-by-pixel edge path, which for the small images of late layers (7x7, 14x14) would
be most of the work. A tile holds TILE = 8 pixels of one block: 8 vector accumulators; per
tap one weight vector and 8 input vectors (8 independent FMA chains, 10 registers of AVX2's
16 or AVX-512's 32). The copy reads each input value once per item; the epilogue is the
direct kernel's (kernels/epilogue.py). x, y and the packed weights ([CB, KH, KW, b]) share the
block b, which the kernel takes from L, compiled once per width.
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
    PL,
    PT,
    RESIDUAL,
    ROWS,
    SH,
    SW,
    H,
    N,
    W,
)  # fmt: skip
from .config import INLINE_GEMM, JIT_GEMM, PARALLEL
from .epilogue import BEFORE, NO_RESIDUAL, activate_rows, finish
from .simd import vfma, vload, vstore, vzero
from .simd.activation import IDENTITY, clip_bounds, clips

ZERO = np.float32(0.0)

u = np.uint64
TILE = 8  # pixels per tile


@numba.jit(**INLINE_GEMM)
def _finish(L, tbuf, npx, fb, nb, yf, yo, ystride, res, bf, bo, residual, lo, hi):
    """Accumulators parked in tbuf (vector k = p fb + f,
    for pixels p < npx and blocks f < nb) into y, one vector of a block's W = L.width channels
    at a time: the bias of its block, the residual (kernels/epilogue.py), the clip [lo, hi];
    the whole epilogue when the activation is a clip, else its part before the activation
    (epilogue.activate_rows does the rest). Offsets are flat element offsets, signed or not."""
    w = L.width
    yo, ystride, bo = np.int64(yo), np.int64(ystride), np.int64(bo)
    for k in range(npx * fb):
        p, f = k // fb, k % fb
        if f >= nb:
            continue
        q = yo + p * w + f * ystride
        v = vload(L, tbuf, k * w) + vload(L, bf, bo + f * w)
        r = vload(L, res, q) if residual else v
        vstore(yf, q, finish(v, r, residual, True, lo, hi, IDENTITY, ZERO, ZERO))


@numba.jit(**INLINE_GEMM)
def _tile(L, xs, x0, xstep, wf, tx, tw, n_taps, tbuf):
    """tbuf[p b : p b + b] = sum over the taps of x[pixel p] * w, lane by lane (b = L.width
    channels of one block), for the TILE pixels p of a tile."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(L)
    for t in range(n_taps):
        q = u(tx[t] + x0)
        w = vload(L, wf, u(tw[t]))
        a0 = vfma(vload(L, xs, q), w, a0)
        a1 = vfma(vload(L, xs, q + xstep), w, a1)
        a2 = vfma(vload(L, xs, q + u(2) * xstep), w, a2)
        a3 = vfma(vload(L, xs, q + u(3) * xstep), w, a3)
        a4 = vfma(vload(L, xs, q + u(4) * xstep), w, a4)
        a5 = vfma(vload(L, xs, q + u(5) * xstep), w, a5)
        a6 = vfma(vload(L, xs, q + u(6) * xstep), w, a6)
        a7 = vfma(vload(L, xs, q + u(7) * xstep), w, a7)
    b = u(L.width)
    vstore(tbuf, u(0), a0)
    vstore(tbuf, b, a1)
    vstore(tbuf, u(2) * b, a2)
    vstore(tbuf, u(3) * b, a3)
    vstore(tbuf, u(4) * b, a4)
    vstore(tbuf, u(5) * b, a5)
    vstore(tbuf, u(6) * b, a6)
    vstore(tbuf, u(7) * b, a7)


@numba.jit(**JIT_GEMM)
def _pad_rows(L, xf, g, n, cb, ih0, rows, wp, scr):
    """scr[r, q, :] = x[n, cb, ih0 + r, q - pl, :] for r < rows, q < wp; zero outside x. Each
    row is one contiguous copy and two runs of zeros (vector loops, no test per pixel)."""
    h, w, pl, b = g[H], g[W], g[PL], L.width
    stride = wp * b
    for r in range(rows):
        ih = ih0 + r
        d = r * stride
        if ih < 0 or ih >= h:
            scr[d : d + stride] = 0.0
            continue
        src = ((n * g[CB] + cb) * h + ih) * w * b
        first = min(pl, wp)  # zero columns left of the image
        scr[d : d + first * b] = 0.0
        count = max(0, min(w, wp - pl))  # image columns the scratch holds
        scr[d + first * b : d + (first + count) * b] = xf[src : src + count * b]
        scr[d + (first + count) * b : d + stride] = 0.0


@numba.jit(**JIT_GEMM)
def _item(L, xf, wf, bf, yf, res, g, n, cb, r0, r1, tx, tw, scr, tbuf, act_a, act_b):
    """Output rows r0 <= oh < r1 of block cb of image n."""
    kh, kw, sh, sw, dh, dw = g[KH], g[KW], g[SH], g[SW], g[DH], g[DW]
    oh_len, ow_len, b = g[OH], g[OW], L.width
    n_tiles = (ow_len + TILE - 1) // TILE
    wp = (n_tiles * TILE - 1) * sw + (kw - 1) * dw + 1
    ih0 = r0 * sh - g[PT]
    _pad_rows(L, xf, g, n, cb, ih0, (r1 - 1 - r0) * sh + (kh - 1) * dh + 1, wp, scr)
    residual, kind = g[RESIDUAL], g[ACT]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)  # -inf, inf when not a clip
    early = residual if simple or residual == BEFORE else NO_RESIDUAL  # what _finish adds
    ystride = u(oh_len * ow_len * b)
    bo = u(cb * b)
    for oh in range(r0, r1):
        k = 0
        for i in range(kh):
            r = (oh - r0) * sh + i * dh  # the scratch row of tap row i
            for j in range(kw):
                tx[k] = (r * wp + j * dw) * b
                tw[k] = ((cb * kh + i) * kw + j) * b
                k += 1
        yo = u(((n * g[CB] + cb) * oh_len + oh) * ow_len * b)
        for t in range(n_tiles):
            ow0 = t * TILE
            _tile(L, scr, ow0 * sw * b, u(sw * b), wf, tx, tw, k, tbuf)
            npx = min(TILE, ow_len - ow0)
            yt = yo + u(ow0 * b)
            _finish(L, tbuf, npx, 1, 1, yf, yt, ystride, res, bf, bo, early, lo, hi)
        if not simple:
            activate_rows(L, yf, res, yo, 1, ystride, ow_len * b, residual, kind, act_a, act_b)


def scratch_size(g) -> int:
    """Floats of scratch one work item takes (the padded input rows, a tile), g[BI] being
    the block (a depthwise conv's input block is its output block, L.width of the call)."""
    n_tiles = (g[OW] + TILE - 1) // TILE
    wp = (n_tiles * TILE - 1) * g[SW] + (g[KW] - 1) * g[DW] + 1
    span = (g[ROWS] - 1) * g[SH] + (g[KH] - 1) * g[DH] + 1
    return (span * wp + TILE) * g[BI]


@numba.jit(**PARALLEL)
def dwconv_nchwc(L, xf, wf, bf, yf, res, g, act_a, act_b, work):
    """y = epilogue(depthwise conv(x)) on flat blocked arrays, x and y [N, CB, ., ., b],
    packed [CB, KH, KW, b], bias [CB b]; L: Lanes(b), g[BI] = b. g: the geometry (_direct_blocked's
    indices, CB the channel-block count, ROWS the output rows per item, ACT the activation's
    kind, act_a and act_b its parameters); work: per-thread scratch [threads,
    scratch_size(g)]."""
    rows, cb_len, oh_len, b = g[ROWS], g[CB], g[OH], L.width
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
        scr, tbuf = mine[: span * wp * b], mine[span * wp * b : (span * wp + TILE) * b]
        r0 = rb * rows
        _item(L, xf, wf, bf, yf, res, g, n, cb, r0, min(oh_len, r0 + rows), tx, tw, scr, tbuf,
              act_a, act_b)  # fmt: skip
