"""The inverted residual block, depth first, on blocked tensors (kernels/blocked.py): the serial
work item and the parallel driver behind kernels/inverted_residual.py.

    e = act_e(We x + be)            1x1 expand, C -> E channels (or e = x: expansion 1)
    d = act_d(dw_kxk(e) + bd)       depthwise, stride s, pads (pt, pl), zeros outside e
    y = act_p(Wp d + bp [+ x]) [+ x]  1x1 project, E -> M channels, the residual before or
                                     after its activation

A work item is a run of output rows of one image, walked in bands of ROWS output rows. A band
needs (ROWS - 1) s + k rows of e: the k - s rows it shares with the band before are moved to
the top of the per-thread scratch `ex` [EB, SPAN, W, b] (a copy of k - s rows, where
computing them again would cost their whole expand), the rest are computed there (rows outside
the image are zeros: the depthwise conv pads e, not x). Then the depthwise conv writes the
band's d into `dw` [EB, ROWS, OW, b] and the projection writes y's rows. Both scratches are
sized by the wrapper to a share of L2, so e and d never leave the core's cache; op by op each
goes to memory and back (4 E H W floats of traffic per block, most of a depthwise-heavy model's
time on a core with 1 MB of L2).

The three convs are the blocked conv family's own serial work items, on runs of rows of the
scratches: the direct kernel's `item` (register tiles, epilogue in registers) for both 1x1
convs, each run of rows described as one row of pixels (a 1x1 conv's pixel reads x at that
pixel alone, and a block holds a run of rows contiguously), with g[XBS] and g[YBS] the block
strides of the tensors it reads and writes; the depthwise kernel's `item` for the middle conv,
with the scratch as its image (its rows already padded, its columns read through masks or
padded by the item: the band's PAD), or at expansion 1 with x itself (its rows written to the
band's scratch from g[ROW0]: no copy of x into ex). One small image on more threads than it
has runs of rows worth cutting takes channel parts instead (inverted_residual_blocked's
docstring).

Without a projection (g[PROJECT] = 0: the expand and the depthwise conv alone, y = d, the
block that squeeze-excitation splits: its gate needs all of d), the depthwise conv writes the
band's rows straight into y (gd's OH is y's, ROW0 minus the band's first row) and channel
parts write their own blocks of y: no partial sums.
"""

import numba
import numpy as np

from . import _blocked_geometry as geo
from . import _depthwise_blocked as dwb
from ._direct_blocked import pointwise_pixels
from .config import JIT_GEMM, PARALLEL, ZERO_I64
from .epilogue import finish
from .simd import tail_mask, vload, vload_masked, vstore, vzero
from .simd.activation import clip_bounds, clips

# the block's own geometry, beside the three convs' (ge, gd, gp: _blocked_geometry)
(N, CB, BI, H, W, EB, K, S, PT, OH, OW, MB, ROWS, SPAN, PARTS, EXPAND, IN_PLACE, SPLIT, TAPS,
 FBMAX, PROJECT, N_GEO) = range(22)  # fmt: skip


@numba.jit(**JIT_GEMM)
def _zero_rows(L, ex, g, eb_a, eb_b, r0, r1):
    """ex[eb_a:eb_b, r0:r1] = 0: rows of e outside the image."""
    b, span, w = L.width, g[SPAN], g[W]
    zero = vzero(L)
    for eb in range(eb_a, eb_b):
        for q in range((eb * span + r0) * w * b, (eb * span + r1) * w * b, b):
            vstore(ex, q, zero)


@numba.jit(**JIT_GEMM)
def _move_rows(L, ex, g, eb_a, eb_b, src, count):
    """ex[eb_a:eb_b, 0:count] = ex[eb_a:eb_b, src:src + count] (src > 0): the rows a band shares
    with the one before, forward, vector by vector (the ranges may overlap, the source after
    the target)."""
    b, span, w = L.width, g[SPAN], g[W]
    for eb in range(eb_a, eb_b):
        d0, s0 = eb * span * w * b, (eb * span + src) * w * b
        for q in range(0, count * w * b, b):
            vstore(ex, d0 + q, vload(L, ex, s0 + q))


@numba.jit(**JIT_GEMM)
def _copy_rows(L, xf, g, n, ih0, ih1, r0, ex):
    """ex[0, r0 + i] = x[n, 0, ih0 + i] for ih0 + i < ih1: expansion 1 with C < b, x's one
    block of BI = C channels widened to b lanes (zeros past BI); x in blocks of b is read in
    place (g[IN_PLACE])."""
    b, bi, w, h = L.width, g[BI], g[W], g[H]
    mask = tail_mask(L, bi)
    x0 = (n * h + ih0) * w * bi  # one block per image
    e0 = r0 * w * b
    for p in range((ih1 - ih0) * w):
        vstore(ex, e0 + p * b, vload_masked(L, xf, x0 + p * bi, mask))


@numba.jit(**JIT_GEMM)
def _combine(L, parts, yf, rf, bias, g, it, epi, acts):
    """y[n, mb] (it = n MB + mb) = the projection's epilogue of the channel parts' partial
    sums: bias, residual (epi[0]: before or after), activation (kind epi[1], acts[2, 1:])."""
    b, pixels = L.width, g[OH] * g[OW]
    part_len = g[N] * g[MB] * pixels * b
    n, mb = it // g[MB], it % g[MB]
    residual, kind, a, b_ = epi[0], np.int64(epi[1]), acts[2, 1], acts[2, 2]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, a, b_)
    bv = vload(L, bias, mb * b)
    y0 = (n * g[MB] + mb) * pixels * b
    for q in range(y0, y0 + pixels * b, b):
        v = bv
        for part in range(g[SPLIT]):
            v = v + vload(L, parts, part * part_len + q)
        vstore(yf, q, finish(v, vload(L, rf, q), residual, simple, lo, hi, kind, a, b_))


def scratch_size(g, ge, gd, gps, pw_e: int, pw_p: int) -> tuple[int, int, int, int]:
    """Floats of per-thread scratch: (ex, dw, the depthwise item's, the tiles' parking buffer:
    the largest conv's when K is cut into chunks); gps: the projection's geometries (whole,
    and its channel parts')."""
    b = gd[geo.BI]
    ex = 0 if g[IN_PLACE] else g[EB] * g[SPAN] * g[W] * b
    dw = g[EB] * g[ROWS] * g[OW] * b if g[PROJECT] else 0  # else the depthwise conv writes y
    park = b  # (a placeholder when none is cut)
    convs = [(ge, g[SPAN] * g[W], pw_e)] + [(gp, g[ROWS] * g[OW], pw_p) for gp in gps]
    for gc, pixels, pw in convs:
        if gc[geo.CHUNK] < gc[geo.CBG]:
            park = max(park, (pixels + pw) * gc[geo.FB] * b)
    return ex, dw, dwb.scratch_size(gd), park


@numba.jit(**JIT_GEMM)
def item(L, re, rp, xf, we, be, wd, bd, wp_, bp, yf, rf, g, ge, gd, gp, acts, ci, n, oh_a, oh_b,
         eb_a, eb_b, ex, dw, dscr, acc, tbuf, tx, tw, sx, sw_):  # fmt: skip
    """Output rows oh_a <= oh < oh_b of image n, band by band, through expanded blocks eb_a <=
    eb < eb_b (all of them, or a channel part's: then wp_, bp and gp are the part's projection,
    into its partial sums yf); re and rp: the expand's and the projection's direct work items
    on their register tiles (Items); ge, gd and gp this thread's copies (their pixel counts and
    first rows change per band). g[IN_PLACE] (expansion 1, x in blocks of b): gd is the
    depthwise conv's on x itself, its rows written to dw from ROW0."""
    b, s, k, pt, h, w = L.width, g[S], g[K], g[PT], g[H], g[W]
    ow, rows = g[OW], g[ROWS]
    taps = np.empty(2 * k * k, np.int64)
    og_a, og_b = eb_a // ge[geo.FB], (eb_b + ge[geo.FB] - 1) // ge[geo.FB]  # the expand's
    dv = dw[eb_a * rows * ow * b :]  # the projection reads d from block eb_a
    project = g[PROJECT] == 1
    if not project:  # d is y: the depthwise conv writes image n's rows oh0 + r of y
        dw = yf[n * g[MB] * g[OH] * ow * b :]
        gd[geo.OH] = g[OH]
    have_lo, have_hi = 0, 0  # rows of e in ex[:, 0 : have_hi - have_lo]
    for oh0 in range(oh_a, oh_b, rows):
        used = min(rows, oh_b - oh0)
        y0 = (n * g[MB] * g[OH] + oh0) * ow * b
        if not project:
            gd[geo.ROW0] = -oh0
        if g[IN_PLACE]:  # e = x in blocks of b: the depthwise conv reads x's rows where they are
            gd[geo.ROW0] = oh0
            xv = xf[n * g[CB] * h * w * b :]
            for eb in range(eb_a, eb_b):
                dwb.item(L, xv, wd, bd, dw, dw, gd, ZERO_I64, eb, oh0, oh0 + used, taps, dscr,
                         acts[1, 1], acts[1, 2])  # fmt: skip
        else:
            ih0 = oh0 * s - pt
            span = (used - 1) * s + k
            keep = 0
            if have_hi > have_lo and have_lo < ih0 < have_hi:
                keep = have_hi - ih0
                _move_rows(L, ex, g, eb_a, eb_b, ih0 - have_lo, keep)
            lo, hi = max(ih0 + keep, 0), min(ih0 + span, h)
            _zero_rows(L, ex, g, eb_a, eb_b, keep, max(keep, lo - ih0))
            _zero_rows(L, ex, g, eb_a, eb_b, max(keep, hi - ih0), span)
            if lo < hi:
                if g[EXPAND]:
                    xv = xf[((n * g[CB]) * h + lo) * w * g[BI] :]
                    ev = ex[(lo - ih0) * w * b :]
                    pointwise_pixels(L, re, xv, we, be, ev, ev, ge, (hi - lo) * w, og_a,
                                     og_b, acc, tbuf, tx, tw, sx, sw_, acts[0, 1], acts[0, 2],
                                     ci)  # fmt: skip
                else:
                    _copy_rows(L, xf, g, n, lo, hi, lo - ih0, ex)
            have_lo, have_hi = ih0, ih0 + span
            for eb in range(eb_a, eb_b):
                dwb.item(L, ex, wd, bd, dw, dw, gd, ZERO_I64, eb, ZERO_I64, used, taps, dscr,
                         acts[1, 1], acts[1, 2])  # fmt: skip
        if project:
            pointwise_pixels(L, rp, dv, wp_, bp, yf[y0:], rf[y0:], gp, used * ow, ZERO_I64,
                             gp[geo.OGG], acc, tbuf, tx, tw, sx, sw_, acts[2, 1], acts[2, 2],
                             L)  # fmt: skip


@numba.jit(**PARALLEL)
def inverted_residual_blocked(L, re, rp, xf, we, be, wd, bd, wp_, bp, yf, rf, g, ge, gd, gp, acts,
                              ci, sizes, work, cuts, gps, wparts, woff, zero,
                              parts):  # fmt: skip
    """The block on flat blocked arrays: x [N, CB, H, W, BI], y [N, MB, OH, OW, b], rf the
    residual (x at block b) or y (none); re, rp: the expand's and the projection's direct
    work items on their register tiles (Items: conv_nchwc.tile_item); we, be, wp_, bp packed
    for the direct kernel, wd, bd for the depthwise one; g the block's geometry, ge, gd, gp the
    three convs' (templates); acts [3, 3] float32: (kind, a, b) per conv (the kinds are in ge,
    gd, gp); ci: the expand's input channels per block (L when BI = b); sizes: scratch_size's
    four; work [threads, sum(sizes)].

    g[SPLIT] = 1: parallel over (image, part) items, each part a run of output rows. g[SPLIT]
    = P > 1 (fewer images than threads, small ones: a run of rows would compute the k - s rows
    of e it shares with the next run again): parallel over (image, channel part) items, part p
    the expanded blocks cuts[p] <= eb < cuts[p + 1] of every row, its projection (gps[p],
    packed at wparts[woff[p]:], no bias or epilogue: `zero`) summed into parts[p] [N, MB, OH,
    OW, b]; then combine_parts makes y of their sum (a parallel loop of its own)."""
    oh_len, split = g[OH], g[SPLIT]
    e_len, d_len, s_len, p_len = sizes[0], sizes[1], sizes[2], sizes[3]
    parts_row = g[PARTS] if split == 1 else 1
    per = (oh_len + parts_row - 1) // parts_row
    part_len = g[N] * g[MB] * oh_len * g[OW] * L.width
    items = g[N] * parts_row * split  # (a conditional in prange's bound: no parallel loop)
    for it in numba.prange(items):
        n, part = np.int64(it // (parts_row * split)), np.int64(it % (parts_row * split))
        oh_a = part * per if split == 1 else ZERO_I64
        oh_b = min(oh_len, oh_a + per)
        mine = work[numba.get_thread_id()]
        ex = mine[:e_len]
        dw = mine[e_len : e_len + d_len]
        dscr = mine[e_len + d_len : e_len + d_len + s_len]
        acc = mine[e_len + d_len + s_len : e_len + d_len + s_len + p_len]
        tbuf = np.empty(g[FBMAX] * L.width, np.float32)
        tx, tw = np.empty(g[TAPS], np.int64), np.empty(g[TAPS], np.int64)
        sx, sw_ = np.empty(g[TAPS], np.int64), np.empty(g[TAPS], np.int64)
        ge_, gd_ = ge.copy(), gd.copy()  # this thread's: set per band
        if split == 1:
            if oh_a < oh_b:
                item(L, re, rp, xf, we, be, wd, bd, wp_, bp, yf, rf, g, ge_, gd_, gp.copy(),
                     acts, ci, n, oh_a, oh_b, ZERO_I64, g[EB], ex, dw, dscr, acc, tbuf, tx, tw,
                     sx, sw_)  # fmt: skip
        else:  # a channel part: its partial sums, or its own blocks of d without a projection
            pv = parts[part * part_len :] if g[PROJECT] else yf
            item(L, re, rp, xf, we, be, wd, bd, wparts[woff[part] :], zero, pv, pv, g, ge_,
                 gd_, gps[part].copy(), acts, ci, n, ZERO_I64, oh_len, cuts[part],
                 cuts[part + 1], ex, dw, dscr, acc, tbuf, tx, tw, sx, sw_)  # fmt: skip


@numba.jit(**PARALLEL)
def combine_parts(L, parts, yf, rf, bias, g, epi, acts):
    """y = the projection's epilogue (epi: residual, kind; acts[2, 1:]: its a, b) of the sum
    of the channel parts' partial outputs (inverted_residual_blocked with g[SPLIT] > 1)."""
    for it in numba.prange(g[N] * g[MB]):
        _combine(L, parts, yf, rf, bias, g, it, epi, acts)
