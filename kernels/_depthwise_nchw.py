"""Depthwise Conv2D (group == C == M, MobileNet-style): one kh x kw filter per channel.

    y[n, c, oh, ow] = act(bias[c] + sum_{i, j} w[c, i, j] * x[n, c, ih, iw])
    ih = oh * sh - pt + i * dh,   iw = ow * sw - pl + j * dw   (zero outside the image)

Through the GEMM this is M = 1 per group: 3 of the 4 micro-kernel rows are padding and every
pixel panel is gathered for one filter (many times onnxruntime's time). Here one work item is
one channel plane, computed row by row straight from the input (no copy), a vector loop per
tap (see _row).
"""

import numba
import numpy as np

from ._gemm import act
from .config import JIT, PARALLEL


@numba.jit(**JIT)
def _row(xp, wc, yrow, oh, sh, sw, dh, span, pt, b, lo, hi):
    """yrow[ow] = act(b + sum_{i, j} wc[i, j] * xp[oh sh - pt + i dh, ow sw - pl + j dw]);
    span[j] = (first, last output column whose tap j is inside the image, its input column).

    Tap by tap, the row accumulates in place over the columns where the tap is inside the
    image (no bounds test in the loop); bias and activation follow while it is in L1 (faster
    than the GEMM's 8-columns-per-register form, bench/NOTES.md)."""
    h = xp.shape[0]
    kh, kw = wc.shape
    ow_len = yrow.shape[0]
    for ow in range(ow_len):
        yrow[ow] = b
    for i in range(kh):
        ih = oh * sh - pt + i * dh
        if ih < 0 or ih >= h:
            continue
        xrow = xp[ih]
        for j in range(kw):
            first, last, col = span[j, 0], span[j, 1], span[j, 2]
            if last <= first:
                continue
            wv = wc[i, j]
            src = xrow[col:]  # views from 0: no wraparound test in the loop
            dst = yrow[first:]
            if sw == 1:  # a separate loop so LLVM vectorizes it (a symbolic stride blocks that)
                for t in range(last - first):
                    dst[t] += wv * src[t]
            else:
                for t in range(last - first):
                    dst[t] += wv * src[t * sw]
    for ow in range(ow_len):
        yrow[ow] = act(yrow[ow], lo, hi)


@numba.jit(**JIT)
def _plane(xp, wc, yp, ow_len, sh, sw, dh, span, pt, b, lo, hi):
    for oh in range(yp.shape[0] // ow_len):
        _row(xp, wc, yp[oh * ow_len : (oh + 1) * ow_len], oh, sh, sw, dh, span, pt, b, lo, hi)


@numba.jit(**PARALLEL)
def depthwise_conv(x, w3, bias, out3, sh, sw, dh, dw, pt, pl, ow_len, lo, hi):
    """out3[N, C, OH*OW] = act(depthwise_conv(x) + bias); w3 is the weight [C, kh, kw]."""
    n_len, c_len, w = x.shape[0], x.shape[1], x.shape[3]
    # Per tap column j, the output columns whose input column ow * sw + off is in [0, W):
    # worked out once here (two integer divisions per tap and row cost more than the tap).
    span = np.empty((w3.shape[2], 3), np.int64)
    for j in range(w3.shape[2]):
        off = j * dw - pl
        first = 0 if off >= 0 else (sw - 1 - off) // sw
        last = min(ow_len, (w - 1 - off) // sw + 1) if off <= w - 1 else 0
        span[j, 0], span[j, 1], span[j, 2] = first, last, first * sw + off
    # Items are (image, channel): disjoint output planes, no races.
    for item in numba.prange(n_len * c_len):
        n, c = item // c_len, item % c_len
        _plane(x[n, c], w3[c], out3[n, c], ow_len, sh, sw, dh, span, pt, bias[c], lo, hi)
