"""What a fused kernel applies to each output value before it is stored, in this order:

    v = acc + bias
    v = v + r            if residual == BEFORE   (ResNet: Add, then Relu)
    v = act(v)           the activation (kind, a, b) of kernels/simd/activation.py
    v = v + r            if residual == AFTER    (MobileNetV2: an Add after the activation)

The catalog's conv epilogues in one place, so that every kernel with one (the blocked direct
conv, the depthwise conv, the elementwise pass) applies it the same way, on whole vectors:
finish() takes the bias-added vector and the residual's. The clipping kinds (identity, relu,
clip: most of a CNN's epilogues) are a clip written inline; in finish() the others call the
SIMD layer's activate, one compiled function per vector type (a call per vector, no copy per
call site); activate_rows, one loop that every such kernel calls per row, has its own copy.
"""

import numba
import numpy as np

from .config import INLINE, INLINE_FIT, JIT
from .simd import vload, vstore
from .simd.activation import activate, clip

NO_RESIDUAL, BEFORE, AFTER = 0, 1, 2
RESIDUALS = {None: NO_RESIDUAL, "before": BEFORE, "after": AFTER}


@numba.jit(**INLINE)
def finish(v, r, residual, simple, lo, hi, kind, a, b):
    """The epilogue after the bias of v (a vector, or a float32), r the residual's values (read
    only when `residual`). simple: the kind is a clip (activation.clips), with bounds lo, hi
    (activation.clip_bounds)."""
    if residual == BEFORE:
        v = v + r
    v = clip(v, lo, hi) if simple else activate(kind, a, b, v)
    if residual == AFTER:
        v = v + r
    return v


# The table's activate copied into activate_rows' one loop (Numba-level inlining, one call
# site): called per vector it cost 2.5 ns a vector for hard_swish against 1.3 inlined, silu 8.2
# against 6.9 (one thread, a 1.6 MB loop; bench/NOTES.md). The fits it calls (exp, sigmoid,
# ...) stay calls, compiled once.
_activate_inlined = numba.jit(**INLINE_FIT)(activate.py_func)


@numba.jit(**JIT)
def activate_rows(L, yf, res, y0, n_blocks, ystride, count, residual, kind, act_a, act_b):
    """The rest of the epilogue when the activation is not a clip, in place on `count`
    values (whole vectors of L.width) from y0 in each of n_blocks output blocks: the
    activation (kind, act_a, act_b), then a residual added after it. Once per output row, not
    per tile: a call of activate inside the tile loop slowed every conv, clips included
    (bench/NOTES.md)."""
    w = L.width
    y0, ystride, count = np.int64(y0), np.int64(ystride), np.int64(count)
    for f in range(n_blocks):
        q0 = y0 + f * ystride
        for q in range(q0, q0 + count, w):
            v = _activate_inlined(kind, act_a, act_b, vload(L, yf, q))
            vstore(yf, q, v + vload(L, res, q) if residual == AFTER else v)
