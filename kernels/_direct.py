"""Direct convolution on blocked tensors (NCHWc in, NCHWc out), register-tiled.

For output pixel (oh, ow) of output block ob (8 channels) in group g:

    y[n, ob, oh, ow, :] = epilogue(sum_{cb, i, j, ci} x[n, cb, ih, iw, ci] W[ob, cb, i, j, ci, :])
    ih = oh sh - pt + i dh,   iw = ow sw - pl + j dw        (taps outside the image add nothing)

cb runs over the group's input blocks, ci over a block's BI channels (8, or C for a small
input). One input value times a vector of 8 output channels is one FMA. A tile holds PW pixels
x FB output blocks = 12 vector accumulators (3 x 4, 6 x 2 or 12 x 1): twelve independent FMA
chains hide the FMA latency on two FMA ports, and 12 accumulators + the operands fit AVX2's 16
registers. Per (tap, ci) a tile loads PW broadcasts and FB weight vectors for its 12 FMAs. One
source serves the three shapes: FB is a compile-time constant in each entry point, so the
pixel and block offsets of accumulator k (k // FB, k % FB) fold to constants and repeated loads
merge.

Taps are listed per output row (the rows inside the image, every column) as pairs of offsets
(input, packed weights); a tile is one loop over the list. Columns whose every tap is inside the
row [COL_A, COL_B) run in whole tiles, reading the input in place (what is left of the interior
after whole tiles runs as one more tile overlapping the last, recomputing a few pixels rather
than taking them one at a time, on a chain of FB accumulators that waits on FMA latency); the
others (at a padded edge, or in a row narrower than a tile) run one pixel at a time with that
pixel's own taps, so no loop tests a bound. When a group's weights do not fit in half of L2, K
is cut into chunks of input blocks, and a work item sweeps all its rows per chunk with the
accumulators parked in a small buffer between chunks (the overlapping tile in slots of its own).

Work items are (image, group, filter group of FB blocks, block of rows): disjoint outputs.
The geometry comes in one int64 array (see conv_nchwc), one argument to unbox per call.
"""

import numba
import numpy as np

from ._gemm import fma8
from .config import INLINE_GEMM, JIT, JIT_GEMM, PARALLEL
from .epilogue import AFTER, BEFORE, NO_RESIDUAL, finish
from .simd import activate, vload, vstore
from .simd.activation import IDENTITY, clip_bounds, clips

u = np.uint64
ZERO = np.float32(0.0)
B = 8  # output block: channels per vector
ACC = 12  # vector accumulators per tile

# Indices into the geometry array.
(N, CB, BI, H, W, KH, KW, SH, SW, DH, DW, PT, PL, MB, OH, OW, G, CBG, MBG, FB, PW, OGG, COL_A,
 COL_B, CHUNK, ROWS, RESIDUAL, ACT, N_GEO) = range(29)  # fmt: skip


@numba.jit(**INLINE_GEMM)
def load8(v, q):
    return (v[q], v[q + u(1)], v[q + u(2)], v[q + u(3)], v[q + u(4)], v[q + u(5)], v[q + u(6)],
            v[q + u(7)])  # fmt: skip


@numba.jit(**INLINE_GEMM)
def store8(v, q, r):
    v[q], v[q + u(1)], v[q + u(2)], v[q + u(3)] = r[0], r[1], r[2], r[3]
    v[q + u(4)], v[q + u(5)], v[q + u(6)], v[q + u(7)] = r[4], r[5], r[6], r[7]


@numba.jit(**INLINE_GEMM)
def _load12(acc, ao):
    return (load8(acc, ao), load8(acc, ao + u(8)), load8(acc, ao + u(16)), load8(acc, ao + u(24)),
            load8(acc, ao + u(32)), load8(acc, ao + u(40)), load8(acc, ao + u(48)),
            load8(acc, ao + u(56)), load8(acc, ao + u(64)), load8(acc, ao + u(72)),
            load8(acc, ao + u(80)), load8(acc, ao + u(88)))  # fmt: skip


@numba.jit(**INLINE_GEMM)
def _store12(a, acc, ao):
    store8(acc, ao, a[0])
    store8(acc, ao + u(8), a[1])
    store8(acc, ao + u(16), a[2])
    store8(acc, ao + u(24), a[3])
    store8(acc, ao + u(32), a[4])
    store8(acc, ao + u(40), a[5])
    store8(acc, ao + u(48), a[6])
    store8(acc, ao + u(56), a[7])
    store8(acc, ao + u(64), a[8])
    store8(acc, ao + u(72), a[9])
    store8(acc, ao + u(80), a[10])
    store8(acc, ao + u(88), a[11])


@numba.jit(**INLINE_GEMM)
def _fma(a, k, xs, xo, xstep, wf, wo, fb):
    """a + x[pixel k // fb] * w[block k % fb] (constant offsets once fb is a constant)."""
    return fma8(a, xs[xo + u(k // fb) * xstep], load8(wf, wo + u((k % fb) * B)))


@numba.jit(**INLINE_GEMM)
def _tile(xs, x0, xstep, wf, tx, tw, n_taps, bi, fb, a):
    """The 12 accumulators of a PW x FB tile plus its taps; accumulator k is pixel k // fb,
    block k % fb. Statements go block by block, so one weight vector is live at a time."""
    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11 = a
    for t in range(n_taps):
        xo = u(tx[t] + x0)
        wo = u(tw[t])
        for _ in range(bi):
            a0 = _fma(a0, 0, xs, xo, xstep, wf, wo, fb)
            a4 = _fma(a4, 4, xs, xo, xstep, wf, wo, fb)
            a8 = _fma(a8, 8, xs, xo, xstep, wf, wo, fb)
            a1 = _fma(a1, 1, xs, xo, xstep, wf, wo, fb)
            a5 = _fma(a5, 5, xs, xo, xstep, wf, wo, fb)
            a9 = _fma(a9, 9, xs, xo, xstep, wf, wo, fb)
            a2 = _fma(a2, 2, xs, xo, xstep, wf, wo, fb)
            a6 = _fma(a6, 6, xs, xo, xstep, wf, wo, fb)
            a10 = _fma(a10, 10, xs, xo, xstep, wf, wo, fb)
            a3 = _fma(a3, 3, xs, xo, xstep, wf, wo, fb)
            a7 = _fma(a7, 7, xs, xo, xstep, wf, wo, fb)
            a11 = _fma(a11, 11, xs, xo, xstep, wf, wo, fb)
            wo += u(fb * B)
            xo += u(1)
    return a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11


@numba.jit(**INLINE_GEMM)
def _pixel(xs, wf, tx, tw, n_taps, bi, fb, a):
    """One pixel x FB blocks (four accumulators, those past fb unused); taps absolute."""
    a0, a1, a2, a3 = a
    for t in range(n_taps):
        xo = u(tx[t])
        wo = u(tw[t])
        for _ in range(bi):
            v = xs[xo]
            a0 = fma8(a0, v, load8(wf, wo))
            if fb > 1:
                a1 = fma8(a1, v, load8(wf, wo + u(8)))
            if fb > 2:
                a2 = fma8(a2, v, load8(wf, wo + u(16)))
                a3 = fma8(a3, v, load8(wf, wo + u(24)))
            wo += u(fb * B)
            xo += u(1)
    return a0, a1, a2, a3


@numba.jit(**INLINE_GEMM)
def _finish(L, tbuf, npx, fb, nb, yf, yo, ystride, res, bf, bo, residual, lo, hi):
    """Accumulators parked in tbuf (k = p fb + f, for pixels p < npx and blocks f < nb) into
    y, one vector of a block's 8 channels at a time: the bias of its block, the residual
    (kernels/epilogue.py), the clip [lo, hi]; the whole epilogue when the activation is a
    clip, else its part before the activation (_activate does the rest)."""
    for k in range(npx * fb):
        p, f = k // fb, k % fb
        if f >= nb:
            continue
        q = yo + u(p * B) + u(f) * ystride
        v = vload(L, tbuf, u(k * B)) + vload(L, bf, bo + u(f * B))
        r = vload(L, res, q) if residual else v
        vstore(yf, q, finish(v, r, residual, True, lo, hi, IDENTITY, ZERO, ZERO))


@numba.jit(**JIT)
def _activate(L, yf, res, y0, n_blocks, ystride, count, residual, kind, act_a, act_b):
    """The rest of the epilogue when the activation is not a clip, in place on `count`
    values (whole vectors) from y0 in each of n_blocks output blocks: the activation (kind,
    act_a, act_b), then a residual added after it. Once per output row, not per tile: a call
    of activate inside the tile loop slowed every conv, clips included (bench/NOTES.md)."""
    for f in range(n_blocks):
        q0 = y0 + u(f) * ystride
        for q in range(q0, q0 + u(count), u(B)):
            v = activate(kind, act_a, act_b, vload(L, yf, q))
            vstore(yf, q, v + vload(L, res, q) if residual == AFTER else v)


@numba.jit(**JIT_GEMM)
def _taps(g, n, grp, og, oh, c0, c1, tx, tw, fb):
    """The taps of output row oh for input blocks c0 <= cb < c1 of group grp: input offsets of
    column 0 of the row, packed-weight offsets. Returns their count."""
    bi, h, w, kh, kw = g[BI], g[H], g[W], g[KH], g[KW]
    cbg = g[CBG]
    k = 0
    for cb in range(c0, c1):
        for i in range(kh):
            ih = oh * g[SH] - g[PT] + i * g[DH]
            if ih < 0 or ih >= h:
                continue
            row = ((n * g[CB] + grp * cbg + cb) * h + ih) * w
            for j in range(kw):
                tx[k] = (row + j * g[DW] - g[PL]) * bi
                tw[k] = ((((grp * g[OGG] + og) * cbg + cb) * kh + i) * kw + j) * bi * fb * B
                k += 1
    return k


@numba.jit(**JIT_GEMM)
def _pixel_taps(g, tx, tw, n_taps, ow, sx, sw_):
    """The taps of row tx/tw whose column is inside the image for output column ow, made
    absolute (sx, sw_). Returns their count."""
    kw, w, bi = g[KW], g[W], g[BI]
    iw0 = ow * g[SW] - g[PL]
    m = 0
    for t in range(n_taps):
        iw = iw0 + (t % kw) * g[DW]
        if 0 <= iw < w:
            sx[m] = tx[t] + ow * g[SW] * bi
            sw_[m] = tw[t]
            m += 1
    return m


@numba.jit(**JIT_GEMM)
def _item(L, xf, wf, bf, yf, res, g, n, grp, og, r0, r1, acc, tx, tw, sx, sw_, act_a, act_b, fb,
          bi):  # fmt: skip
    """Output rows r0 <= oh < r1 of filter group og in group grp of image n."""
    pw = ACC // fb
    oh_len, ow_len, cbg = g[OH], g[OW], g[CBG]
    col_a, col_b = g[COL_A], g[COL_B]
    n_whole = (col_b - col_a) // pw
    # The interior's remainder runs as one more tile ending at col_b, overlapping the one
    # before it: the pixels both hold get the same whole sum twice, stored twice. With K in
    # chunks its accumulators park in slots of their own past the row buffer (ACC vectors per
    # row), so no parked sum is added to twice.
    extra = 1 if n_whole > 0 and col_a + n_whole * pw < col_b else 0
    tiled_end = col_b if extra else col_a + n_whole * pw  # tiles cover [col_a, tiled_end)
    extra_slots = g[ROWS] * ow_len * fb * B
    nb = min(fb, g[MBG] - og * fb)
    ob0 = grp * g[MBG] + og * fb
    ystride = u(oh_len * ow_len * B)
    bo = u((grp * g[OGG] + og) * fb * B)
    residual, kind = g[RESIDUAL], g[ACT]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)  # -inf, inf when not a clip
    early = residual if simple or residual == BEFORE else NO_RESIDUAL  # what _finish adds
    xstep = u(g[SW] * bi)
    tbuf = np.empty(ACC * B, np.float32)
    z = np.float32(0.0)
    z8 = (z, z, z, z, z, z, z, z)
    zero = (z8, z8, z8, z8, z8, z8, z8, z8, z8, z8, z8, z8)
    for c0 in range(0, cbg, g[CHUNK]):
        c1 = min(cbg, c0 + g[CHUNK])
        carry, last = c0 > 0, c1 == cbg
        for oh in range(r0, r1):
            n_taps = _taps(g, n, grp, og, oh, c0, c1, tx, tw, fb)
            yo = u((((n * g[MB] + ob0) * oh_len + oh) * ow_len) * B)
            ao_row = (oh - r0) * ow_len * fb * B  # carry buffer: [rows, OW, fb, 8]
            for t in range(n_whole + extra):
                if t < n_whole:
                    ow0 = col_a + t * pw
                    ao = u(ao_row + ow0 * fb * B)
                else:
                    ow0 = col_b - pw
                    ao = u(extra_slots + (oh - r0) * ACC * B)
                a = _load12(acc, ao) if carry else zero
                a = _tile(xf, ow0 * g[SW] * bi, xstep, wf, tx, tw, n_taps, bi, fb, a)
                _store12(a, acc if not last else tbuf, ao if not last else u(0))
                if last:
                    yt = yo + u(ow0 * B)
                    _finish(L, tbuf, pw, fb, nb, yf, yt, ystride, res, bf, bo, early, lo, hi)
            for ow in range(ow_len):
                if col_a <= ow < tiled_end:
                    continue
                m = _pixel_taps(g, tx, tw, n_taps, ow, sx, sw_)
                ao = u(ao_row + ow * fb * B)
                if carry:
                    p = (load8(acc, ao), load8(acc, ao + u(8)), load8(acc, ao + u(16)),
                         load8(acc, ao + u(24)))  # fmt: skip
                else:
                    p = (z8, z8, z8, z8)
                p = _pixel(xf, wf, sx, sw_, m, bi, fb, p)
                dst, do = (acc, ao) if not last else (tbuf, u(0))
                store8(dst, do, p[0])
                if fb > 1:
                    store8(dst, do + u(8), p[1])
                if fb > 2:
                    store8(dst, do + u(16), p[2])
                    store8(dst, do + u(24), p[3])
                if last:
                    yt = yo + u(ow * B)
                    _finish(L, tbuf, 1, fb, nb, yf, yt, ystride, res, bf, bo, early, lo, hi)
            if last and not simple:
                _activate(L, yf, res, yo, nb, ystride, ow_len * B, residual, kind, act_a, act_b)


@numba.jit(**PARALLEL)
def _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, fb, bi):
    """y = epilogue(conv(x)) on flat blocked arrays; g: the geometry (see the indices above),
    its ACT the activation's kind, act_a and act_b its parameters; L: Lanes(B)."""
    ogg, rows = g[OGG], g[ROWS]
    rb_len = (g[OH] + rows - 1) // rows
    per_image = g[G] * ogg * rb_len
    chunk_taps = g[CHUNK] * g[KH] * g[KW]
    multi = g[CHUNK] < g[CBG]
    for item in numba.prange(g[N] * per_image):
        n, rest = item // per_image, item % per_image
        grp, rest = rest // (ogg * rb_len), rest % (ogg * rb_len)
        og, rb = rest // rb_len, rest % rb_len
        r0 = rb * rows
        r1 = min(g[OH], r0 + rows)
        acc = np.empty(rows * (g[OW] * fb + ACC) * B if multi else 1, np.float32)
        tx = np.empty(chunk_taps, np.int64)
        tw = np.empty(chunk_taps, np.int64)
        sx = np.empty(chunk_taps, np.int64)
        sw_ = np.empty(chunk_taps, np.int64)
        _item(L, xf, wf, bf, yf, res, g, n, grp, og, r0, r1, acc, tx, tw, sx, sw_, act_a, act_b,
              fb, bi)  # fmt: skip


# Entry points: fb (output blocks per tile) is a compile-time constant in each, so the tile
# compiles to its 3 x 4, 6 x 2 or 12 x 1 shape; with bi = 8 constant too, the loop over a
# block's channels is unrolled. (Constants passed from a jitted caller specialize the callee;
# numba.literally at the Python boundary would re-dispatch on every call.)


@numba.jit(**JIT)
def conv_f4_b8(L, xf, wf, bf, yf, res, g, act_a, act_b, bi):
    _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, 4, 8)


@numba.jit(**JIT)
def conv_f2_b8(L, xf, wf, bf, yf, res, g, act_a, act_b, bi):
    _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, 2, 8)


@numba.jit(**JIT)
def conv_f1_b8(L, xf, wf, bf, yf, res, g, act_a, act_b, bi):
    _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, 1, 8)


@numba.jit(**JIT)
def conv_f4(L, xf, wf, bf, yf, res, g, act_a, act_b, bi):
    _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, 4, bi)


@numba.jit(**JIT)
def conv_f2(L, xf, wf, bf, yf, res, g, act_a, act_b, bi):
    _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, 2, bi)


@numba.jit(**JIT)
def conv_f1(L, xf, wf, bf, yf, res, g, act_a, act_b, bi):
    _drive(L, xf, wf, bf, yf, res, g, act_a, act_b, 1, bi)


ENTRIES = {
    (4, True): conv_f4_b8,
    (2, True): conv_f2_b8,
    (1, True): conv_f1_b8,
    (4, False): conv_f4,
    (2, False): conv_f2,
    (1, False): conv_f1,
}


def entry(fb: int, bi: int):
    """The compiled entry point for fb output blocks per tile and bi channels per input block."""
    return ENTRIES[(fb, bi == B)]
