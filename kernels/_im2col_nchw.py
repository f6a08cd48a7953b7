"""General Conv2D path: im2col panels feeding the packed GEMM micro-kernel.

For group g, output channel m and output pixel p = oh * OW + ow:

    y[n, m, p] = act(bias[m] + sum_{c, i, j} w[m, c, i, j] * x[n, g*Cg + c, ih, iw])
    ih = oh * sh - pad_top + i * dh,   iw = ow * sw - pad_left + j * dw   (zero outside the image)

The reduction index k = (c * kh + i) * kw + j matches the weight layout, so the weights of a
group are one [Mg, K] matrix, packed once into MR-row panels (MR x NR: the micro-kernel's tile,
_gemm). Each work item packs a block of NR-pixel panels of the input, [K, NR] each, and sweeps
all channel panels of its group (or of its range of them, see n_ms) over them, so each input
panel is gathered once per range and reused by every channel panel of it. Handles any kernel,
stride, dilation, padding (also larger than the kernel), group and batch.
"""

import numba
import numpy as np

from ._gemm import gemm_block
from .config import INLINE, JIT, PARALLEL, ZERO_I64
from .simd import tail_mask, vload, vload_masked, vstore

# 1x1, stride-1, unpadded convolutions with K up to this read their input in place as the
# GEMM's B (no packing); above it a tile's K unaligned stretches no longer stay in L1 between
# channel panels and packing wins (bench/NOTES.md, convolutions).
IN_PLACE_MAX_K = 128


@numba.jit(**INLINE)
def _pack_panel(L, T, x, n, c0, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len, p0, dst,
                off):  # fmt: skip
    """dst[off + k NR + q] = x[n, c0 + c, ih, iw] for pixel p0 + q, or 0 outside image /
    past P (NR = T.cols L.width, a constant here). x is indexed directly, never sliced: a view
    of the shared input would cost an atomic refcount update per view (see _gemm)."""
    u = np.uint64
    nr = T.cols * L.width
    h, w = x.shape[2], x.shape[3]
    oh, ow0 = p0 // ow_len, p0 % ow_len
    iw0 = ow0 * sw - pl
    if (
        p0 + nr <= p_len
        and ow0 + nr <= ow_len
        and iw0 >= 0
        and iw0 + (nr - 1) * sw + (kw - 1) * dw < w
    ):
        # Fast path: the NR pixels are one stretch of one output row and every tap column is
        # inside the image, so only whole tap rows can fall outside (no per-value tests). At
        # stride 1 a tap row's NR inputs are contiguous too: T.cols vector copies.
        k = 0
        for c in range(cg):
            for i in range(kh):
                ih = oh * sh - pt + i * dh
                row = ((n * x.shape[1] + c0 + c) * h + ih) * w  # x[n, c0 + c, ih, 0], flat
                for j in range(kw):
                    d = u(off + k * nr)
                    if 0 <= ih < h and sw == 1:
                        s = row + iw0 + j * dw
                        for v in range(T.cols):
                            vstore(dst, d + u(v * L.width), vload(L, x, s + v * L.width))
                    elif 0 <= ih < h:
                        s = u(iw0 + j * dw)
                        for q in range(nr):
                            dst[d + u(q)] = x[n, c0 + c, ih, s + u(q * sw)]
                    else:
                        for q in range(nr):
                            dst[d + u(q)] = 0.0
                    k += 1
        return
    # General path (a panel across output rows, at an image edge, or past P): the panel cut
    # into runs of one output row each, found once per panel; per tap, the columns of a run
    # whose input lies inside the image are one range (from the tap's column, no per-value
    # tests), zeros on either side, and whole runs of zeros for tap rows outside the image.
    runs = np.empty((3, nr), np.int64)  # per run: first pixel in the panel, output row, column
    n_runs, q = 0, 0
    while q < nr and p0 + q < p_len:
        p = p0 + q
        runs[0, n_runs], runs[1, n_runs], runs[2, n_runs] = q, p // ow_len, p % ow_len
        q += min(nr - q, ow_len - p % ow_len)
        n_runs += 1
    end = q  # pixels past it are past P: zero
    k = 0
    for c in range(cg):
        for i in range(kh):
            for j in range(kw):
                base = off + k * nr
                shift = j * dw - pl  # input column of output column ow: ow sw + shift
                first = -(shift // sw)  # the first output column whose input is inside
                last = (w - 1 - shift) // sw + 1  # past the last one
                for r in range(n_runs):
                    q0, ow = runs[0, r], runs[2, r]
                    q1 = runs[0, r + 1] if r + 1 < n_runs else end
                    ih = runs[1, r] * sh - pt + i * dh
                    lo, hi = q0, q0  # dst[base + lo : base + hi] comes from x, the rest is 0
                    if 0 <= ih < h:
                        lo = min(q1, max(q0, q0 + first - ow))
                        hi = max(lo, min(q1, q0 + last - ow))
                    for t in range(q0, lo):
                        dst[base + t] = 0.0
                    col = (ow - q0) * sw + shift  # the input column of pixel t: col + t sw
                    for t in range(lo, hi):
                        dst[u(base + t)] = x[n, c0 + c, ih, u(col + t * sw)]
                    for t in range(hi, q1):
                        dst[base + t] = 0.0
                for t in range(end, nr):
                    dst[base + t] = 0.0
                k += 1


@numba.jit(**INLINE)
def _copy_panel(L, T, x, src, p_len, p0, k_len, dst, off):
    """dst[off + k NR + q] = x.flat[src + k P + p0 + q], zero past P: the B panel of a 1x1,
    stride-1, unpadded convolution, whose input [C, H*W] (from flat src) already is the GEMM's
    B matrix (a copy of contiguous rows, the last panel's through masked loads)."""
    w = L.width
    nr = T.cols * w
    cols = min(nr, p_len - p0)
    for k in range(k_len):
        s, d = src + k * p_len + p0, off + k * nr
        if cols == nr:
            for c in range(T.cols):
                vstore(dst, d + c * w, vload(L, x, s + c * w))
        else:  # masked lanes load as 0: the padding
            for c in range(T.cols):
                vstore(dst, d + c * w, vload_masked(L, x, s + c * w, tail_mask(L, cols - c * w)))


@numba.jit(**JIT)
def _pack_panels(L, T, x, n, c0, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len, pan0, pan1,
                 direct, dst):  # fmt: skip
    """Panels pan0 .. pan1 - 1 of image n into dst ([K, NR] each, one after another): one
    call per work item, not per panel (a call pays refcounts on its array arguments)."""
    nr = T.cols * L.width
    size = cg * kh * kw * nr
    src = (n * x.shape[1] + c0) * p_len  # direct: the first channel's row, flat
    for j in range(pan1 - pan0):
        p0 = (pan0 + j) * nr
        if direct:
            _copy_panel(L, T, x, src, p_len, p0, cg, dst, j * size)
        else:
            _pack_panel(L, T, x, n, c0, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len, p0,
                        dst, j * size)  # fmt: skip


@numba.jit(**PARALLEL)
def im2col_conv(x, a_packed, bias, out3, L, T, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, group,
                lo, hi, n_blk, n_ms, direct):  # fmt: skip
    """out3[N, M, OH*OW] = clip(conv(x) + bias, lo, hi); a_packed is [group, ceil(Mg/MR), K, MR]
    flat (_gemm.pack_a), L and T the micro-kernel's width and tile (MR = T.rows, NR = T.cols W).

    n_blk: pixel-panel blocks per image and group (one work item each). A work item packs its
    block of input panels, then sweeps every channel panel of weights over all of them: each
    input panel is gathered once and reused Mg / MR times, and the weights are read once per
    block (from L3 when they do not fit in L2: 512 -> 1000 channels is 2 MB). The wrapper sizes
    the blocks so that they stay within half of L2 (see conv2d._panel_blocks).
    n_ms: ranges the channel panels are cut into, range-major, so that with n_ms = threads each
    thread takes every pixel block for one range (equal work when the blocks alone cannot be
    shared evenly, see conv2d._launch); each range packs its blocks again.
    direct: a 1x1, stride-1, unpadded convolution: the input is the B matrix; with K up to
    IN_PLACE_MAX_K its full panels are read in place (a full panel's rows end inside the
    input, so nothing past its end is read), otherwise copied (no gather).
    """
    n_len, c_len = x.shape[0], x.shape[1]
    m_len, p_len = out3.shape[1], out3.shape[2]
    mr, nr = T.rows, T.cols * L.width
    cg, mg = c_len // group, m_len // group
    k_len = cg * kh * kw
    n_pan = (p_len + nr - 1) // nr
    per_blk = (n_pan + n_blk - 1) // n_blk
    n_mb = (mg + mr - 1) // mr
    size = k_len * nr
    mb_per = (n_mb + n_ms - 1) // n_ms
    # Items are (image, group, panel block, channel range): disjoint outputs, so no two threads
    # write one cell.
    blocks = n_len * group * n_blk
    for item in numba.prange(blocks * n_ms):
        ms, blk = item // blocks, item % blocks
        n = blk // (group * n_blk)
        g = (blk // n_blk) % group
        pan0 = (blk % n_blk) * per_blk
        pan1 = min(n_pan, pan0 + per_blk)
        mb0 = ms * mb_per
        n_mbs = min(n_mb, mb0 + mb_per) - mb0
        if n_mbs <= 0:
            continue
        a0, m0, c0 = (g * n_mb + mb0) * k_len * mr, g * mg + mb0 * mr, g * cg
        m_cnt = min(mg - mb0 * mr, n_mbs * mr)  # this range's channels
        if direct and k_len <= IN_PLACE_MAX_K:
            full = min(pan1, p_len // nr) - pan0
            src = (n * c_len + c0) * p_len + pan0 * nr
            gemm_block(L, T, a_packed, a0, n_mbs, x, src, nr, p_len, full, k_len, out3, n, m0,
                       m_cnt, pan0 * nr, p_len, bias, lo, hi)  # fmt: skip
            pan0 += full  # what is left: the last, partial panel (packed, zero-padded)
        if pan0 < pan1:
            panels = np.empty((pan1 - pan0) * size, np.float32)
            _pack_panels(L, T, x, n, c0, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len,
                         pan0, pan1, direct, panels)  # fmt: skip
            gemm_block(L, T, a_packed, a0, n_mbs, panels, ZERO_I64, size, nr, pan1 - pan0, k_len,
                       out3, n, m0, m_cnt, pan0 * nr, p_len, bias, lo, hi)  # fmt: skip
