"""The inverted residual block, depth first, on blocked tensors (kernels/blocked.py): the serial
work item and the parallel driver behind kernels/inverted_residual.py.

    e = act_e(We x + be)            1x1 expand, C -> E channels (or e = x: expansion 1)
    d = act_d(dw_kxk(e) + bd)       depthwise, stride s, pads (pt, pl), zeros outside e
    y = act_p(Wp d + bp) [+ x]      1x1 project, E -> M channels, the residual after it

A work item is one image's band of output rows oh0 <= oh < oh1 (every output block): it
computes the (oh1 - oh0 - 1) s + k expanded rows the band's depthwise taps read (the halo
rows are computed again by the next band: the price of never writing e to memory) into a
per-thread scratch `ex` [span, WP, EB, b] whose columns outside the image are zeros, then the
depthwise into `dw` [rows, OW, EB, b], then the projection into y. Both scratches are sized by
the wrapper to stay within a share of L2, so e and d never leave the core's cache.

Packed weights (b = L.width lanes, channels past the count zero): we [C, EB, b] (a row of E
expanded channels per input channel: one broadcast of x against EB vectors), wd [EB, k, k, b],
wp [E, MB, b]; biases [EB b], [EB b], [MB b]. An expanded channel past E has weight 0 in wp, so
whatever its activation makes of 0 never reaches y.
"""

import numba
import numpy as np

from .config import JIT_GEMM, PARALLEL
from .simd import tail_mask, vbroadcast, vfma, vload, vload_masked, vstore, vzero
from .simd.activation import activate

# geometry indices
N, C, BI, CB, H, W, E, EB, K, S, PT, PL, OH, OW, M, MB, ROWS, WP, EXPAND, RESIDUAL = range(20)
N_GEO = 20


@numba.jit(**JIT_GEMM)
def _expand_rows(L, xf, we, be, g, n, ih0, span, ex, act):
    """ex[r, q, eb, :] = act_e(We x[n, :, ih0 + r, q - pl] + be), zeros where the pixel is
    outside the image (the depthwise conv's zero padding is of e, not of x)."""
    b, c_len, bi, cb_len = L.width, g[C], g[BI], g[CB]
    h, w, wp, eb_len, pl = g[H], g[W], g[WP], g[EB], g[PL]
    kind, a0, a1 = act
    for r in range(span):
        ih = ih0 + r
        for q in range(wp):
            iw = q - pl
            base = (r * wp + q) * eb_len * b
            if ih < 0 or ih >= h or iw < 0 or iw >= w:
                for eb in range(eb_len):
                    vstore(ex, base + eb * b, vzero(L))
                continue
            if not g[EXPAND]:  # e = x, whose blocks are b wide (or one block of bi = C < b)
                for eb in range(eb_len):
                    xo = ((n * cb_len + eb) * h + ih) * w * bi + iw * bi
                    if bi == b:
                        vstore(ex, base + eb * b, vload(L, xf, xo))
                    else:
                        vstore(ex, base + eb * b, vload_masked(L, xf, xo, tail_mask(L, bi)))
                continue
            for eb in range(eb_len):
                acc = vload(L, be, eb * b)
                for c in range(c_len):
                    xo = ((n * cb_len + c // bi) * h + ih) * w * bi + iw * bi + c % bi
                    acc = vfma(vbroadcast(L, xf[xo]), vload(L, we, (c * eb_len + eb) * b), acc)
                vstore(ex, base + eb * b, activate(kind, a0, a1, acc))


@numba.jit(**JIT_GEMM)
def _depthwise_rows(L, ex, wd, bd, g, rows, dw, act):
    """dw[r, ow, eb, :] = act_d(bd + sum_{i, j} ex[r s + i, ow s + j, eb, :] wd[eb, i, j, :])."""
    b, k, s, wp, ow_len, eb_len = L.width, g[K], g[S], g[WP], g[OW], g[EB]
    kind, a0, a1 = act
    for r in range(rows):
        for ow in range(ow_len):
            for eb in range(eb_len):
                acc = vload(L, bd, eb * b)
                for i in range(k):
                    row = ((r * s + i) * wp + ow * s) * eb_len * b + eb * b
                    for j in range(k):
                        v = vload(L, ex, row + j * eb_len * b)
                        acc = vfma(v, vload(L, wd, ((eb * k + i) * k + j) * b), acc)
                vstore(dw, ((r * ow_len + ow) * eb_len + eb) * b, activate(kind, a0, a1, acc))


@numba.jit(**JIT_GEMM)
def _project_rows(L, dw, wp_, bp, xf, yf, g, n, oh0, rows, act):
    """y[n, mb, oh0 + r, ow, :] = act_p(bp + sum_c dw[r, ow, c] wp[c, mb, :]) (+ x there)."""
    b, e_len, eb_len, mb_len = L.width, g[E], g[EB], g[MB]
    oh_len, ow_len, bi = g[OH], g[OW], g[BI]
    kind, a0, a1 = act
    for r in range(rows):
        oh = oh0 + r
        for ow in range(ow_len):
            d0 = (r * ow_len + ow) * eb_len * b
            for mb in range(mb_len):
                acc = vload(L, bp, mb * b)
                for c in range(e_len):
                    dv = vbroadcast(L, dw[d0 + (c // b) * b + c % b])
                    acc = vfma(dv, vload(L, wp_, (c * mb_len + mb) * b), acc)
                acc = activate(kind, a0, a1, acc)
                if g[RESIDUAL]:  # x has the output's channels and pixels (stride 1)
                    xo = ((n * g[CB] + mb) * oh_len + oh) * ow_len * bi + ow * bi
                    if bi == b:
                        acc = acc + vload(L, xf, xo)
                    else:
                        acc = acc + vload_masked(L, xf, xo, tail_mask(L, bi))
                vstore(yf, ((n * mb_len + mb) * oh_len + oh) * ow_len * b + ow * b, acc)


def scratch_size(g, b: int) -> int:
    """Floats of per-thread scratch for bands of g[ROWS] rows: ex, then dw."""
    span = (g[ROWS] - 1) * g[S] + g[K]
    return (span * g[WP] + g[ROWS] * g[OW]) * g[EB] * b


@numba.jit(**PARALLEL)
def inverted_residual_blocked(L, xf, we, be, wd, bd, wp_, bp, yf, g, acts, work):
    """The block on flat blocked arrays: x [N, CB, H, W, bi], y [N, MB, OH, OW, b]; packed
    weights as the module says; acts [3, 3] (kind, a, b) of the expand, depthwise and project
    activations; work [threads, scratch_size(g)]. Parallel over (image, band) items."""
    b, rows, oh_len = L.width, g[ROWS], g[OH]
    bands = (oh_len + rows - 1) // rows
    span_max = (rows - 1) * g[S] + g[K]
    ex_len = span_max * g[WP] * g[EB] * b
    act_e = (np.int64(acts[0, 0]), np.float32(acts[0, 1]), np.float32(acts[0, 2]))
    act_d = (np.int64(acts[1, 0]), np.float32(acts[1, 1]), np.float32(acts[1, 2]))
    act_p = (np.int64(acts[2, 0]), np.float32(acts[2, 1]), np.float32(acts[2, 2]))
    for item in numba.prange(g[N] * bands):
        n, band = item // bands, item % bands
        oh0 = band * rows
        used = min(oh_len, oh0 + rows) - oh0
        mine = work[numba.get_thread_id()]
        ex, dw = mine[:ex_len], mine[ex_len:]
        span = (used - 1) * g[S] + g[K]
        _expand_rows(L, xf, we, be, g, n, oh0 * g[S] - g[PT], span, ex, act_e)
        _depthwise_rows(L, ex, wd, bd, g, used, dw, act_d)
        _project_rows(L, dw, wp_, bp, xf, yf, g, n, oh0, used, act_p)
