"""Direct convolution on blocked tensors (NCHWc in, NCHWc out), on register tiles at the SIMD
width W (L.width: 8 with AVX2, 16 with AVX-512).

For output pixel (oh, ow) of output block ob (W channels) in group g:

    y[n, ob, oh, ow, :] = epilogue(sum_{cb, i, j, ci} x[n, cb, ih, iw, ci] Wt[ob, cb, i, j, ci, :])
    ih = oh sh - pt + i dh,   iw = ow sw - pl + j dw        (taps outside the image add nothing)

cb runs over the group's input blocks, ci over a block's BI channels (W, or C for a small
input). One input value times a vector of W output channels is one FMA. A register tile
T = Tile(PW, FB) holds PW pixels x FB output blocks: per (tap, ci) one rank-1 update
(simd.tile_fma) broadcasts the PW pixels' x (rows, SW BI apart in x) against the FB weight
vectors (columns, contiguous in the packed layout), PW FB independent FMA chains for PW + FB
loads. The shape is a type chosen in Python (conv_nchwc: from the register file, and narrower
for narrow rows), so inside the kernel PW and FB are constants: one source compiles per (W,
shape), the tile is a nest of LLVM vectors, and its offsets fold.

Taps are listed per output row (the rows inside the image, every column) as pairs of offsets
(input, packed weights); a tile is one loop over the list. Columns whose every tap is inside the
row [COL_A, COL_B) run in whole tiles along the row, reading the input in place; what is left
after whole tiles runs as one more tile ending at the row's end, recomputing a few pixels rather
than taking them one at a time: a tile of half the rows (rounded up) when what is left fits it,
else a whole one overlapping the last. The other columns (at a padded edge, or all of a row
narrower than a tile) run as the same tiles (and tails) down the rows, where every vertical tap
is inside the image [ROW_A, ROW_B): a column's pixels there share their taps, SH rows of x
apart, so a weight vector loaded feeds PW FMAs there too. What remains (the corners, the edges
of a work item with fewer rows than a tile) runs one pixel at a time, a 1 x FB tile on that
pixel's own taps, split over two tiles (FB chains alone wait on FMA latency): there each weight
vector feeds one FMA, and a narrow image's edges run that way waited on the weights' traffic
from L2. No loop tests a bound.
When a group's weights do not fit in half of L2, K is cut into chunks of input blocks, and a
work item sweeps all its rows per chunk with the accumulators parked in a small buffer between
chunks (overlapping tiles in slots of their own).

Work items are (image, group, filter group of FB blocks, block of rows): disjoint outputs.
The geometry comes in one int64 array (see conv_nchwc), one argument to unbox per call.
"""

import functools

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic, overload

from ._blocked_geometry import (
    ACT,
    BI,
    CB,
    CBG,
    CHUNK,
    COL_A,
    COL_B,
    DH,
    DW,
    FB,
    HALF,
    KH,
    KW,
    MBG,
    OGG,
    OH,
    OW,
    PARTS,
    PL,
    PT,
    PW,
    RESIDUAL,
    ROW_A,
    ROW_B,
    ROWS,
    SH,
    SW,
    WN,
    XBS,
    YBS,
    YMB,
    G,
    H,
    N,
    W,
)  # fmt: skip
from ._first_class import call
from .config import FORCE_GEMM, I64, INLINE_GEMM, JIT_GEMM, PARALLEL, ZERO_I64
from .epilogue import BEFORE, NO_RESIDUAL, activate_rows
from .simd import borrow, tile_fma, tile_load, tile_store, tile_zeros, vload, vstore
from .simd import tile as tiles
from .simd.activation import clip, clip_bounds, clips

ONE = np.ones(1, np.float32)  # a rank-1 update of ones adds a row of vectors to every row


@intrinsic
def _count(typingctx, ci):
    """The channels of an input block, from the kernel's `ci` argument: an integer (a small
    input's C) as it is, or a Lanes (whole blocks of its width) as a compile-time constant, so
    that the loop over a block's channels unrolls."""
    if isinstance(ci, types.Integer):
        return types.intp(ci), lambda context, builder, sig, args: context.cast(
            builder, args[0], sig.args[0], types.intp
        )
    w = getattr(ci, "w", None)
    if w is None:
        raise numba.core.errors.TypingError(f"ci: an integer or a Lanes, got {ci}")
    return types.intp(ci), lambda context, builder, sig, args: context.get_constant(types.intp, w)


@numba.jit(**INLINE_GEMM)
def _run(t, xs, x0, xstep, wf, tx, tw, k0, k1, bi, wstep):
    """t plus the products of taps k0 <= k < k1: for tap k and channel ci < bi, the rank-1
    update of pixel r's x[tx[k] + x0 + r xstep + ci] against the weight vectors from tw[k] +
    ci wstep."""
    for k in range(k0, k1):
        xo = tx[k] + x0
        wo = tw[k]
        for ci in range(bi):
            t = tile_fma(t, xs, xo + ci, xstep, wf, wo + ci * wstep)
    return t


@numba.jit(**INLINE_GEMM)
def _run_all(t, xs, x0, xstep, wf, tx, tw, n_head, n_taps, bi, wstep):
    """t plus the products of all n_taps taps, the taps from n_head on (a group's last input
    block, g[HALF]) on the first bi / 2 channels only: the rest of that block is zeros in x
    and in the weights. bi // 2 is a constant where bi is (the loop unrolls)."""
    t = _run(t, xs, x0, xstep, wf, tx, tw, 0, n_head, bi, wstep)
    return _run(t, xs, x0, xstep, wf, tx, tw, n_head, n_taps, bi // 2, wstep)


@numba.jit(**INLINE_GEMM)
def _run_split(t, t2, xs, wf, tx, tw, n_taps, bi, wstep):
    """One pixel's 1 x FB tile plus its taps, on two independent tiles (even taps into t, odd
    into t2, summed by the caller): FB chains of FMAs alone would wait on FMA latency."""
    for k in range(0, n_taps - 1, 2):
        xo, xo2, wo, wo2 = tx[k], tx[k + 1], tw[k], tw[k + 1]
        for ci in range(bi):
            t = tile_fma(t, xs, xo + ci, 0, wf, wo + ci * wstep)
            t2 = tile_fma(t2, xs, xo2 + ci, 0, wf, wo2 + ci * wstep)
    if n_taps % 2:
        xo, wo = tx[n_taps - 1], tw[n_taps - 1]
        for ci in range(bi):
            t = tile_fma(t, xs, xo + ci, 0, wf, wo + ci * wstep)
    return t, t2


def _store(L, T, t, nb, yf, yo, ps, ystride, res, residual, lo, hi):
    """Tile t (its shape T, the bias included) into y: accumulator (r, f) to pixel r (ps floats
    apart in y) of block f < nb, with the epilogue's clip and residual (the bias is in t).
    Straight from the registers: one statement per accumulator, its (r, f) constants
    (_store_source), where a loop over t[r][f] that LLVM does not unroll in full (past about
    10 rows, or 6x4) would pick each vector through a switch; the stores without a residual
    apart. The residual's statements are written out too: through a jitted helper called per
    accumulator (epilogue.finish inside) each vector cost ~8 ns, as a call would, and the residual
    took 45% of a 1x1 expand conv (ResNet-50's conv3, bench/NOTES.md); inlining that helper at
    Numba's level instead trips an IR check ("variable not in scope").
    The store itself is inlined by LLVM (forceinline): compiled once per tile shape and types.
    At Numba's level (inline="always") its IR, with a jitted clip inlined per accumulator, was
    copied and typed again at each of item's four call sites: 30 of a 6x4 tile's 33 s of cold
    compile, 9 s now, the machine code as fast (bench/NOTES.md)."""


@functools.cache
def _store_source(rows: int, cols: int):
    """_store at one tile shape: Python source generated with t[r][f] written out (the
    overload below compiles it, LLVM inlines it where it is called). Missing from
    kernels.simd.tile: a way to apply a function to each accumulator of a tile with its (r, c)
    known."""
    clip_lines = [line for r in range(rows) for f in range(cols) for line in (
        f"        if {f} < nb:",
        f"            vstore(yf, yo + {r} * ps + {f} * ystride, clip(t[{r}][{f}], lo, hi))",
    )]  # fmt: skip

    def residual_lines(before: bool) -> list[str]:  # y = clip(v + s), or clip(v) + s
        put = "clip(v + s, lo, hi)" if before else "clip(v, lo, hi) + s"
        return [line for r in range(rows) for f in range(cols) for line in (
            f"        if {f} < nb:",
            f"            q = yo + {r} * ps + {f} * ystride",
            f"            v, s = t[{r}][{f}], vload(L, res, q)",
            f"            vstore(yf, q, {put})",
        )]  # fmt: skip

    source = "\n".join([
        "def store(L, T, t, nb, yf, yo, ps, ystride, res, residual, lo, hi):",
        "    if residual == NO_RESIDUAL:", *clip_lines,
        "    elif residual == BEFORE:", *residual_lines(True),
        "    else:", *residual_lines(False),
    ])  # fmt: skip
    # __name__: the module compile reports name (bench/cold_start.py), not None
    names = {"NO_RESIDUAL": NO_RESIDUAL, "BEFORE": BEFORE, "vload": vload, "vstore": vstore,
             "clip": clip, "__name__": __name__}  # fmt: skip
    exec(compile(source, f"<_direct_blocked._store {rows}x{cols}>", "exec"), names)
    return names["store"]


@overload(_store, jit_options={k: FORCE_GEMM[k] for k in ("fastmath", "error_model",
                                                         "forceinline")})  # fmt: skip
def _store_overload(L, T, t, nb, yf, yo, ps, ystride, res, residual, lo, hi):
    return _store_source(T.rows, T.cols)


@numba.jit(**JIT_GEMM)
def _taps(g, n, grp, og, oh, c0, c1, tx, tw, wstep):
    """The taps of output row oh for input blocks c0 <= cb < c1 of group grp: input offsets of
    column 0 of the row, packed-weight offsets (wstep = FB W floats per input channel), in
    block order. Returns (their count, the count before the group's last block's when g[HALF]
    says that block runs half its channels, else their count: _run_all)."""
    bi, h, w, kh, kw = g[BI], g[H], g[W], g[KH], g[KW]
    cbg = g[CBG]
    k = 0
    head = -1
    for cb in range(c0, c1):
        if cb == cbg - 1 and g[HALF]:
            head = k
        for i in range(kh):
            ih = oh * g[SH] - g[PT] + i * g[DH]
            if ih < 0 or ih >= h:
                continue
            row = (n * g[CB] + grp * cbg + cb) * g[XBS] + ih * w
            for j in range(kw):
                tx[k] = (row + j * g[DW] - g[PL]) * bi
                tw[k] = ((((grp * g[OGG] + og) * cbg + cb) * kh + i) * kw + j) * bi * wstep
                k += 1
    return k, k if head < 0 else head


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


def half_rows(pw: int) -> int:
    """Rows of the tile that takes what is left of a row after its whole tiles, when that is
    no more than it: half the tile's, rounded up (a 49-pixel plane in tiles of 9 ran as 54
    pixels: 576 -> 96 1x1 on one Zen 4 thread took 55.5 us at 49 pixels as at 54, 47.1 at 45;
    with the half tile, 50: bench/NOTES.md)."""
    return (pw + 1) // 2


@numba.jit(**JIT_GEMM)
def _cover(a, b, pw):
    """Tiles of pw over [a, b): (whole tiles from a, 1 if one more ends at b overlapping the
    last, the end of what they cover). The overlap recomputes a few pixels rather than leave
    them to the one-pixel path: the pixels both tiles hold get the same whole sum twice (the
    one more is a half-height tile where what is left fits it: half_rows)."""
    n_whole = (b - a) // pw if b > a else 0
    extra = 1 if n_whole > 0 and a + n_whole * pw < b else 0
    return n_whole, extra, b if extra else a + n_whole * pw


@functools.cache
def tile_item(T, T1, step: int = 0):
    """The serial work item on register tiles T (and T1, the one-pixel path's), closed over: one
    function per tile, compiled for tile_signature and called through an Item
    (kernels/_first_class.py) by conv_direct and by the depth-first block
    (_inverted_residual_blocked): the parallel drivers compile once per width, the serial work
    once per tile, shared by both (cached on disk by the tiles' shapes).

    step: the x floats from a row tile's pixel to the next (SW BI) as a constant of the code,
    for a small-C conv (a stem on NCHW planes, BI 1); 0: read from the geometry. Given at run
    time, a tile's PW pixels are PW pointers, and a 16-pixel stem tile kept them on the stack,
    reloaded before each FMA (two thirds of the FMA peak); a constant step makes them one
    base and displacements (bench/NOTES.md).

    Each closure is named by its tiles before it is compiled: Numba names a function's machine
    code by its qualified name and a counter of the process that compiled it, so the first
    tile two processes compiled into one cache had one symbol name. A W = 8 cache where two
    tiles had met that way ran a conv into NaN, and ran right once the names differed (which
    lookup went to the wrong code was not found: bench/NOTES.md)."""

    Th = tiles.tile(half_rows(T.rows), T.cols)  # what is left of a row after whole tiles
    ph = Th.rows

    def item(L, xf, wf, bf, yf, res, g, n, grp, og, r0, r1, acc, tbuf, tx, tw, sx, sw_, act_a,
             act_b, ci):  # fmt: skip
        """Output rows r0 <= oh < r1 of filter group og in group grp of image n: the serial work
        item of conv_direct, and of the depth-first block kernel (_inverted_residual_blocked),
        which runs it on runs of rows of its band scratches (g[XBS], g[YBS]: the block strides).

        Row tiles cover the interior columns [col_a, c_end) of every row. The other columns (the
        edges, or every column of a row narrower than a tile) run as column tiles down the rows
        [cr0, r_end) whose vertical taps are all inside the image, [ROW_A, ROW_B): those pixels
        of a column share their taps, SH W BI floats of x apart from row to row. What is left
        (the top and bottom rows' edges, and columns of an item with fewer rows than a tile) runs
        one pixel at a time."""
        w, pw, fb = L.width, T.rows, T.cols
        bi = _count(ci)
        ow_len, cbg = g[OW], g[CBG]
        col_a = g[COL_A]
        n_whole, extra, c_end = _cover(col_a, g[COL_B], pw)
        short = extra > 0 and c_end - (col_a + n_whole * pw) <= ph
        cr0 = max(r0, g[ROW_A])
        n_down, down_extra, r_end = _cover(cr0, min(r1, g[ROW_B]), pw)
        short_down = down_extra > 0 and r_end - (cr0 + n_down * pw) <= ph
        wstep = fb * w  # floats of packed weights per (tap, input channel)
        # The parking buffer (K in chunks): [rows, OW, FB, W] for the row tiles' and single
        # pixels' accumulators, then slots of their own for tiles that overlap (so no parked sum
        # is added to twice): each row's overlapping tile, [rows, PW, FB, W]; each edge column's
        # column tiles, [edges, tiles, PW, FB, W].
        extra_slots = g[ROWS] * ow_len * wstep
        col_slots = extra_slots + g[ROWS] * pw * wstep
        nb = min(fb, g[MBG] - og * fb)
        ob0 = grp * g[MBG] + og * fb
        ystride = g[YBS] * w
        bo = (grp * g[OGG] + og) * wstep
        residual, kind = g[RESIDUAL], g[ACT]
        simple = clips(kind)
        lo, hi = clip_bounds(kind, act_a, act_b)  # -inf, inf when not a clip
        early = residual if simple or residual == BEFORE else NO_RESIDUAL  # what _store adds
        xstep = step if step else g[SW] * bi  # x floats from pixel to pixel (a constant, or)
        down = g[SH] * g[W] * bi  # and from row to row
        y0 = (n * g[YMB] + ob0) * ystride
        yp, rp = borrow(yf), borrow(res)  # for _store: pointers, not arrays, carry no refcount
        for c0 in range(0, cbg, g[CHUNK]):
            c1 = min(cbg, c0 + g[CHUNK])
            carry, last = c0 > 0, c1 == cbg
            # The first chunk starts from the bias (each column's block of it, in every row).
            zero, zero1 = tile_fma(tile_zeros(L, T), ONE, 0, 0, bf, bo), tile_zeros(L, T1)
            zero_h = tile_fma(tile_zeros(L, Th), ONE, 0, 0, bf, bo)
            bias1 = tile_fma(zero1, ONE, 0, 0, bf, bo)
            for oh in range(r0, r1):
                n_taps, n_head = _taps(g, n, grp, og, oh, c0, c1, tx, tw, wstep)
                yo = y0 + oh * ow_len * w
                ao_row = (oh - r0) * ow_len * wstep
                for t in range(n_whole + extra):
                    if t == n_whole and short:  # the columns left fit the half-height tile
                        ow0 = c_end - ph
                        ao = extra_slots + (oh - r0) * pw * wstep
                        ah = tile_load(L, Th, acc, ao) if carry else zero_h
                        ah = _run_all(ah, xf, ow0 * xstep, xstep, wf, tx, tw, n_head, n_taps,
                                      bi, wstep)  # fmt: skip
                        if last:
                            _store(L, Th, ah, nb, yp, yo + ow0 * w, w, ystride, rp, early, lo,
                                   hi)  # fmt: skip
                        else:
                            tile_store(acc, ao, ah)
                        continue
                    ow0 = col_a + t * pw if t < n_whole else c_end - pw
                    ao = (
                        ao_row + ow0 * wstep
                        if t < n_whole
                        else extra_slots + (oh - r0) * pw * wstep
                    )
                    a = tile_load(L, T, acc, ao) if carry else zero
                    a = _run_all(a, xf, ow0 * xstep, xstep, wf, tx, tw, n_head, n_taps, bi,
                                 wstep)  # fmt: skip
                    if last:
                        _store(L, T, a, nb, yp, yo + ow0 * w, w, ystride, rp, early, lo, hi)
                    else:
                        tile_store(acc, ao, a)
                if n_down > 0 and cr0 <= oh < r_end:
                    continue  # its edges are in column tiles, its activation after them
                for ow in range(ow_len):
                    if col_a <= ow < c_end:
                        continue
                    m = _pixel_taps(g, tx, tw, n_taps, ow, sx, sw_)
                    ao = ao_row + ow * wstep
                    p = tile_load(L, T1, acc, ao) if carry else bias1
                    p, p2 = _run_split(p, zero1, xf, wf, sx, sw_, m, bi, wstep)
                    tile_store(tbuf, 0, p2)
                    p = tile_fma(p, ONE, 0, 0, tbuf, 0)  # p + p2
                    if last:
                        _store(L, T1, p, nb, yp, yo + ow * w, w, ystride, rp, early, lo, hi)
                    else:
                        tile_store(acc, ao, p)
                if last and not simple:  # while the row is in cache
                    activate_rows(
                        L, yf, res, yo, nb, ystride, ow_len * w, residual, kind, act_a, act_b
                    )
            if n_down > 0:
                n_taps, _ = _taps(g, n, grp, og, cr0, c0, c1, tx, tw, wstep)  # every vertical tap
                e = 0
                for ow in range(ow_len):
                    if col_a <= ow < c_end:
                        continue
                    m = _pixel_taps(g, tx, tw, n_taps, ow, sx, sw_)  # for pixel (cr0, ow)
                    for t in range(n_down + down_extra):
                        ao = col_slots + (e * (n_down + 1) + t) * pw * wstep
                        if t == n_down and short_down:  # the rows left fit the half tile
                            oh0 = r_end - ph
                            ah = tile_load(L, Th, acc, ao) if carry else zero_h
                            ah = _run(ah, xf, (oh0 - cr0) * down, down, wf, sx, sw_, 0, m, bi,
                                      wstep)  # fmt: skip
                            if last:
                                yt = y0 + (oh0 * ow_len + ow) * w
                                _store(L, Th, ah, nb, yp, yt, ow_len * w, ystride, rp, early,
                                       lo, hi)  # fmt: skip
                            else:
                                tile_store(acc, ao, ah)
                            continue
                        oh0 = cr0 + t * pw if t < n_down else r_end - pw
                        a = tile_load(L, T, acc, ao) if carry else zero
                        a = _run(a, xf, (oh0 - cr0) * down, down, wf, sx, sw_, 0, m, bi, wstep)
                        if last:
                            yt = y0 + (oh0 * ow_len + ow) * w
                            _store(L, T, a, nb, yp, yt, ow_len * w, ystride, rp, early, lo, hi)
                        else:
                            tile_store(acc, ao, a)
                    e += 1
            if last and not simple and n_down > 0:
                for oh in range(cr0, r_end):
                    yo = y0 + oh * ow_len * w
                    activate_rows(
                        L, yf, res, yo, nb, ystride, ow_len * w, residual, kind, act_a, act_b
                    )

    shape = f"{T.rows}x{T.cols}_{T1.rows}x{T1.cols}" + (f"_s{step}" if step else "")
    item.__name__, item.__qualname__ = f"item_{shape}", f"tile_item.<locals>.item_{shape}"
    return numba.jit(**JIT_GEMM)(item)


@functools.cache
def tile_signature(L, ci):
    """The one signature tile_item's functions are compiled for, whoever calls them: what they
    only read (x, the weights, the bias, the residual) as read-only arrays (a writable one
    converts), the rest writable, the indices int64, the activation's parameters float32
    (ConvPlan.act); L and ci (L, or an integer) as given."""
    ro = types.Array(types.float32, 1, "C", readonly=True)
    f1, i1, i, f = types.float32[::1], types.int64[::1], types.int64, types.float32
    return types.none(numba.typeof(L), ro, ro, ro, f1, ro, i1, i, i, i, i, i, f1, f1, i1, i1, i1,
                      i1, f, f, numba.typeof(ci))  # fmt: skip


@numba.jit(**PARALLEL)
def conv_direct(L, run, xf, wf, bf, yf, res, g, act_a, act_b, ci):
    """y = epilogue(conv(x)) on flat blocked arrays, x [N, CB, H, W, BI], y [N, YMB, OH, OW, W]
    (its first MB blocks written: YMB = MB but in a concatenation's part), W = L.width; run:
    tile_item's function of the register tile Tile(g[PW], g[FB]), an Item
    (kernels/_first_class.py, tile_signature); packed weights [G, OGG, CBG, KH, KW, BI, FB W],
    or N of them g[WN] floats apart (each image's own), bias [G OGG FB W]; ci: BI, or L when
    BI = W (the channel loop unrolled); g: the geometry (the indices above), its ACT the
    activation's kind, act_a and act_b its parameters."""
    ogg, rows, w, fb, pw = g[OGG], g[ROWS], L.width, g[FB], g[PW]
    rb_len = (g[OH] + rows - 1) // rows
    per_image = g[G] * ogg * rb_len
    chunk_taps = g[CHUNK] * g[KH] * g[KW]
    multi = g[CHUNK] < g[CBG]
    _, _, c_end = _cover(g[COL_A], g[COL_B], pw)
    n_edges = g[OW] - (c_end - g[COL_A])
    # item's parking buffer: rows and their overlapping tiles, and column tiles
    park = (rows * (g[OW] + pw) + n_edges * (rows + pw)) * fb * w if multi else 1
    # g[PARTS] > 1: a 1x1 conv's pixels, one row (H = OH = 1, G = 1), cut in runs, each
    # (image, filter group, run) an item run by pointwise_pixels from the run's first pixel
    # (x's and y's block strides XBS and YBS the row's): where a 7 x 7 image's 49 pixels are
    # one row, bands cannot split its filter groups between the threads (9 ran 5 and 4)
    parts = g[PARTS]
    chunk = (g[OW] + parts - 1) // max(1, parts)
    # (a conditional in prange's bound leaves no parallel loop: arithmetic instead)
    items = g[N] * (per_image + np.int64(parts > 1) * (ogg * parts - per_image))
    for it in numba.prange(items):
        acc = np.empty(park, np.float32)
        tbuf = np.empty(fb * w, np.float32)  # the one-pixel path's second tile
        tx = np.empty(chunk_taps, np.int64)
        tw = np.empty(chunk_taps, np.int64)
        sx = np.empty(chunk_taps, np.int64)
        sw_ = np.empty(chunk_taps, np.int64)
        if parts > 1:
            t = np.int64(it)
            n, og, part = t // (ogg * parts), (t // parts) % ogg, t % parts
            p0 = part * chunk
            p1 = min(g[OW], p0 + chunk)
            if p0 < p1:
                x0, y0 = (n * g[CB] * g[XBS] + p0) * g[BI], (n * g[YMB] * g[YBS] + p0) * w
                pointwise_pixels(L, run, xf[x0:], wf[n * g[WN] :], bf, yf[y0:], res[y0:],
                                 g.copy(), p1 - p0, og, og + 1, acc, tbuf, tx, tw, sx, sw_,
                                 act_a, act_b, ci)  # fmt: skip
            continue
        # (prange's index is unsigned: run takes int64)
        n, rest = np.int64(it // per_image), np.int64(it % per_image)
        grp, rest = rest // (ogg * rb_len), rest % (ogg * rb_len)
        og, rb = rest // rb_len, rest % rb_len
        r0 = rb * rows
        r1 = min(g[OH], r0 + rows)
        call(run, L, xf, wf[n * g[WN] :], bf, yf, res, g, n, grp, og, r0, r1, acc, tbuf, tx,
             tw, sx, sw_, act_a, act_b, ci)  # fmt: skip


@numba.jit(**JIT_GEMM)
def pointwise_pixels(L, run, xv, wf, bf, yv, rv, g, pixels, og_a, og_b, acc, tbuf, tx, tw, sx,
                     sw_, a, b, ci):  # fmt: skip
    """A 1x1 conv over `pixels` contiguous pixels of each block (x from xv, y to yv, the residual
    from rv at y's offsets), filter groups og_a <= og < og_b of g: the direct kernel's item on
    one row (run: its tile's, an Item), g's block strides XBS and YBS those of xv and yv (a
    1x1 conv's pixel reads x at that pixel alone, so any run of pixels is one row). The
    depth-first kernels' convs on their scratches (inverted residual, pre-activated conv)."""
    g[W] = g[OW] = g[COL_B] = pixels
    for og in range(og_a, og_b):
        call(run, L, xv, wf, bf, yv, rv, g, ZERO_I64, ZERO_I64, np.int64(og), ZERO_I64, I64[1],
             acc, tbuf, tx, tw, sx, sw_, a, b, ci)  # fmt: skip
