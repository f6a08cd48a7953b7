"""General Conv2D path: im2col panels feeding the packed GEMM micro-kernel.

For group g, output channel m and output pixel p = oh * OW + ow:

    y[n, m, p] = act(bias[m] + sum_{c, i, j} w[m, c, i, j] * x[n, g*Cg + c, ih, iw])
    ih = oh * sh - pad_top + i * dh,   iw = ow * sw - pad_left + j * dw   (zero outside the image)

The reduction index k = (c * kh + i) * kw + j matches the weight layout, so the weights of a
group are one [Mg, K] matrix, packed once into MR-row panels. Each work item packs a block of
NR-pixel panels of the input, [K, NR] each, and sweeps all channel panels of its group over
them, so each input panel is gathered once and reused Mg / MR times. Handles any kernel,
stride, dilation, padding (also larger than the kernel), group and batch.
"""

import numba
import numpy as np

from ._gemm import MR, NR, gemm_panels
from .config import JIT, PARALLEL


@numba.jit(**JIT)
def _pack_panel(x, n, c0, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len, p0, dst):
    """dst[k * NR + q] = x[n, c0 + c, ih, iw] for pixel p0 + q, or 0 outside image / past P."""
    h, w = x.shape[2], x.shape[3]
    oh, ow0 = p0 // ow_len, p0 % ow_len
    iw0 = ow0 * sw - pl
    if (
        p0 + NR <= p_len
        and ow0 + NR <= ow_len
        and iw0 >= 0
        and iw0 + (NR - 1) * sw + (kw - 1) * dw < w
    ):
        # Fast path: the 16 pixels are one stretch of one output row and every tap column is
        # inside the image, so only whole tap rows can fall outside (no per-value tests).
        k = 0
        for c in range(cg):
            plane = x[n, c0 + c]
            for i in range(kh):
                ih = oh * sh - pt + i * dh
                for j in range(kw):
                    d = dst[k * NR : (k + 1) * NR]
                    if 0 <= ih < h:
                        src = plane[ih, iw0 + j * dw :]
                        for q in range(NR):
                            d[q] = src[q * sw]
                    else:
                        d[:] = 0.0
                    k += 1
        return
    # General path (a panel across two output rows, at an image edge, or past P): each
    # pixel's window origin once per panel, not two integer divisions per value (at 111
    # output columns, about one panel in seven crosses a row).
    ih0 = np.empty(NR, np.int64)
    iw0s = np.empty(NR, np.int64)
    for q in range(NR):
        p = p0 + q
        ih0[q] = (p // ow_len) * sh - pt if p < p_len else -(1 << 40)  # past P: outside
        iw0s[q] = (p % ow_len) * sw - pl
    k = 0
    for c in range(cg):
        plane = x[n, c0 + c]
        for i in range(kh):
            for j in range(kw):
                base = k * NR
                for q in range(NR):
                    ih = ih0[q] + i * dh
                    iw = iw0s[q] + j * dw
                    v = np.float32(0.0)
                    if 0 <= ih < h and 0 <= iw < w:
                        v = plane[ih, iw]
                    dst[base + q] = v
                k += 1


@numba.jit(**JIT)
def _copy_panel(src, p_len, p0, k_len, dst):
    """dst[k * NR + q] = src[k * p_len + p0 + q], zero past P: the B panel of a 1x1, stride-1,
    unpadded convolution, whose input [C, H*W] already is the GEMM's B matrix (a copy of
    contiguous rows, no index arithmetic per value)."""
    cols = min(NR, p_len - p0)
    for k in range(k_len):
        s = src[k * p_len + p0 :]
        d = dst[k * NR : (k + 1) * NR]
        for q in range(cols):
            d[q] = s[q]
        for q in range(cols, NR):
            d[q] = 0.0


@numba.jit(**PARALLEL)
def im2col_conv(x, a_packed, bias, out3, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, group, lo, hi,
                n_blk, direct):  # fmt: skip
    """out3[N, M, OH*OW] = act(conv(x) + bias); a_packed is [group, ceil(Mg/MR), K, MR] flat.

    n_blk: pixel-panel blocks per image and group (one work item each). A work item packs its
    block of input panels, then sweeps every channel panel of weights over all of them: each
    input panel is gathered once and reused Mg / MR times, and the weights are read once per
    block (from L3 when they do not fit in L2: 512 -> 1000 channels is 2 MB). The wrapper sizes
    the blocks so that they stay within half of L2 (see conv2d._panel_blocks).
    direct: a 1x1, stride-1, unpadded convolution: panels are plain row copies (_copy_panel).
    """
    n_len, c_len, h, w = x.shape
    m_len, p_len = out3.shape[1], out3.shape[2]
    cg, mg = c_len // group, m_len // group
    k_len = cg * kh * kw
    n_pan = (p_len + NR - 1) // NR
    per_blk = (n_pan + n_blk - 1) // n_blk
    n_mb = (mg + MR - 1) // MR
    xf = x.reshape(n_len, c_len * h * w)
    # Items are (image, group, panel block): disjoint output, so no two threads write one cell.
    for item in numba.prange(n_len * group * n_blk):
        n = item // (group * n_blk)
        g = (item // n_blk) % group
        pan0 = (item % n_blk) * per_blk
        pan1 = min(n_pan, pan0 + per_blk)
        tile = np.empty((MR, NR), np.float32)
        panels = np.empty((max(1, pan1 - pan0), k_len * NR), np.float32)
        for pn in range(pan0, pan1):
            if direct:
                _copy_panel(xf[n, g * cg * p_len :], p_len, pn * NR, k_len, panels[pn - pan0])
            else:
                _pack_panel(x, n, g * cg, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len,
                            pn * NR, panels[pn - pan0])  # fmt: skip
        for mb in range(n_mb):
            m0 = mb * MR
            a_mb = a_packed[(g * n_mb + mb) * k_len * MR : (g * n_mb + mb + 1) * k_len * MR]
            gemm_panels(a_mb, panels[: pan1 - pan0], k_len, out3, n, g * mg + m0,
                        min(MR, mg - m0), pan0 * NR, p_len, bias, lo, hi, tile)  # fmt: skip
