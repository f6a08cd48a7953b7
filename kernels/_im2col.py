"""General Conv2D path: im2col panels feeding the packed GEMM micro-kernel.

For group g, output channel m and output pixel p = oh * OW + ow:

    y[n, m, p] = act(bias[m] + sum_{c, i, j} w[m, c, i, j] * x[n, g*Cg + c, ih, iw])
    ih = oh * sh - pad_top + i * dh,   iw = ow * sw - pad_left + j * dw   (zero outside the image)

The reduction index k = (c * kh + i) * kw + j matches the weight layout, so the weights of a
group are one [Mg, K] matrix, packed once into MR-row panels. Each work item packs one NR-pixel
panel of the input, [K, NR], and sweeps all channel panels of its group over it, so the input
panel is gathered once and reused Mg / MR times. Handles any kernel, stride, dilation, padding
(also larger than the kernel), group and batch.
"""

import numba
import numpy as np

from ._gemm import MR, NR, microkernel, store_tile
from .config import JIT, PARALLEL

_FAR = -(1 << 40)  # row origin of a pixel past the end: every tap falls outside the image


@numba.jit(**JIT)
def _pack_panel(x, n, c0, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len, p0, ih0, iw0, dst):
    """dst[k * NR + q] = x[n, c0 + c, ih, iw] for pixel p0 + q, or 0 outside image / past P."""
    h, w = x.shape[2], x.shape[3]
    for q in range(NR):
        p = p0 + q
        if p < p_len:
            ih0[q] = (p // ow_len) * sh - pt
            iw0[q] = (p % ow_len) * sw - pl
        else:
            ih0[q] = _FAR
            iw0[q] = _FAR
    k = 0
    for c in range(cg):
        plane = x[n, c0 + c]
        for i in range(kh):
            for j in range(kw):
                base = k * NR
                for q in range(NR):
                    ih = ih0[q] + i * dh
                    iw = iw0[q] + j * dw
                    v = np.float32(0.0)
                    if 0 <= ih < h and 0 <= iw < w:
                        v = plane[ih, iw]
                    dst[base + q] = v
                k += 1


@numba.jit(**PARALLEL)
def im2col_conv(x, a_packed, bias, out3, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, group, lo, hi):
    """out3[N, M, OH*OW] = act(conv(x) + bias); a_packed is [group, ceil(Mg/MR), K, MR] flat."""
    n_len, c_len = x.shape[0], x.shape[1]
    m_len, p_len = out3.shape[1], out3.shape[2]
    cg, mg = c_len // group, m_len // group
    k_len = cg * kh * kw
    n_pan = (p_len + NR - 1) // NR
    n_mb = (mg + MR - 1) // MR
    # Items are (image, group, pixel panel): disjoint output, so no two threads write one cell.
    for item in numba.prange(n_len * group * n_pan):
        n = item // (group * n_pan)
        g = (item // n_pan) % group
        p0 = (item % n_pan) * NR
        panel = np.empty(k_len * NR, np.float32)
        ih0 = np.empty(NR, np.int64)
        iw0 = np.empty(NR, np.int64)
        tile = np.empty((MR, NR), np.float32)
        _pack_panel(x, n, g * cg, cg, kh, kw, sh, sw, dh, dw, pt, pl, ow_len, p_len, p0, ih0,
                    iw0, panel)  # fmt: skip
        cols = min(NR, p_len - p0)
        for mb in range(n_mb):
            microkernel(a_packed, (g * n_mb + mb) * k_len * MR, panel, 0, k_len, tile)
            m0 = mb * MR
            store_tile(tile, out3, n, g * mg + m0, min(MR, mg - m0), p0, cols, bias, lo, hi)
