"""Pooling (NCHW, float32): MaxPool 2-D with onnxruntime's semantics, GlobalAveragePool.

    y[n, c, oh, ow] = max over the taps (i, j) inside the image of
                      x[n, c, oh * sh - pt + i * dh, ow * sw - pl + j * dw]

Padding never wins (it is not a value), as in ONNX. The output size follows onnxruntime, and
prepare_maxpool checks the attributes as it does (both in windows.py, which a rewrite uses).

The maximum is separable: per output row, the column-wise maximum of its kh input rows is one
contiguous vector loop per row, then the windows along that row (constant-stride loops for the
common 3-wide ones), with tests only at the columns where a tap falls outside the image. One
work item is one channel plane; x and y are indexed, never sliced (a view of a shared array
costs an atomic refcount update per call).

NaN: outputs whose window holds no NaN are exact. For a window with a NaN, onnxruntime itself
answers NaN or a value of the window depending on its code path (vector or scalar lanes, with or
without dilation); this kernel gives NaN when the NaN is in the window's last column after the
column-wise pass, and a value of the window otherwise. Not guaranteed to agree.
"""

import numba
import numpy as np

from .config import INLINE, PARALLEL, entry_point
from .conv2d import cached_launch
from .simd import WIDTHS, lanes, vbroadcast, vget, vload, vselect, vstore, vzero
from .windows import MaxPoolPlan, prepare_maxpool
from .windows import maxpool_output_shape as output_shape
from .workspace import allocator, empty, output

__all__ = [
    "MaxPoolPlan",
    "global_average_pool",
    "global_average_pool_blocked",
    "maxpool2d",
    "maxpool_blocked",
    "output_shape",
    "prepare_maxpool",
    "tiled_average_pool",
]

# onnxruntime starts every window at the lowest float (a window with no tap inside the image,
# possible with dilation, gives that, not -inf)
LOWEST = np.float32(np.finfo(np.float32).min)


def _launch(plan, x_shape, threads):
    """(output shape, the kernel's arguments after y) for an input of shape x_shape."""
    shape, (pt, pl, _, _) = output_shape(x_shape, plan)
    if min(shape) < 1:
        raise ValueError(f"MaxPool output shape {shape} is empty for input {x_shape}")
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    w, ow_len = x_shape[3], shape[3]
    # Output columns a <= ow < b have every tap column inside [0, W): no tests there. Both
    # within [0, OW]: a left padding wider than the output must not move a past it.
    a = min(ow_len, max(0, -(-pl // sw)))
    last = w - 1 - (kw - 1) * dw + pl  # ow * sw <= last: the window's last tap is inside
    b = min(ow_len, last // sw + 1) if last >= 0 else 0
    planes = shape[0] * shape[1]
    per_item = max(1, -(-planes // (8 * threads)))  # ~8 items per thread: few allocations
    return shape, (kh, kw, sh, sw, dh, dw, pt, pl, a, max(a, b), per_item)


@numba.jit(**INLINE)
def _max(m, v):
    return m if m > v else v  # one vmaxps (a NaN in v wins, a NaN in m does not: see above)


@numba.jit(**INLINE)
def _row(col, y, n, c, oh, a, b, pl, sw, kw, dw):
    """y[n, c, oh, ow] = max_j col[ow * sw - pl + j * dw] for a <= ow < b (every tap inside).
    The 3-wide windows of stride 1 and 2 get loops with constant strides, which LLVM
    vectorizes (stride 2 as interleaved loads); a runtime stride or tap count stays scalar."""
    u = np.uint64
    base, o = u(a * sw - pl), u(a)
    if kw == 3 and dw == 1 and sw == 2:
        for t in range(b - a):
            q = base + u(2 * t)
            y[n, c, oh, o + u(t)] = _max(_max(col[q], col[q + u(1)]), col[q + u(2)])
    elif kw == 3 and dw == 1 and sw == 1:
        for t in range(b - a):
            q = base + u(t)
            y[n, c, oh, o + u(t)] = _max(_max(col[q], col[q + u(1)]), col[q + u(2)])
    else:
        for t in range(b - a):
            q = base + u(t * sw)
            m = col[q]
            for j in range(1, kw):
                m = _max(m, col[q + u(j * dw)])
            y[n, c, oh, o + u(t)] = m


@numba.jit(**INLINE)
def _edge(col, y, n, c, oh, ow, pl, sw, kw, dw):
    """y[n, c, oh, ow] for an output column with a tap outside the image."""
    m = LOWEST
    for j in range(kw):
        iw = ow * sw - pl + j * dw
        if 0 <= iw < col.shape[0]:
            m = _max(m, col[iw])
    y[n, c, oh, ow] = m


@numba.jit(**INLINE)
def _plane(x, n, c, y, kh, kw, sh, sw, dh, dw, pt, pl, a, b, col):
    """Plane (n, c), row by row: the column-wise maximum of the row's valid input rows into
    col, then the windows along it (_row, _edge)."""
    h, w = x.shape[2], x.shape[3]
    ow_len = y.shape[3]
    for oh in range(y.shape[2]):
        # Ping-pong between col[0] and col[1]: an in-place col[iw] = max(col[iw], v) becomes a
        # masked store (vmaskmovps, microcoded on Zen1).
        valid = p = first = 0
        for i in range(kh):
            ih = oh * sh - pt + i * dh
            if ih < 0 or ih >= h:
                continue
            if valid == 1:
                for iw in range(w):
                    col[0, iw] = _max(x[n, c, first, iw], x[n, c, ih, iw])
            elif valid > 1:
                for iw in range(w):
                    col[1 - p, iw] = _max(col[p, iw], x[n, c, ih, iw])
                p = 1 - p
            first = ih if valid == 0 else first
            valid += 1
        if valid == 0:
            for ow in range(ow_len):
                y[n, c, oh, ow] = LOWEST
            continue
        if valid == 1:
            for iw in range(w):
                col[0, iw] = x[n, c, first, iw]
        cp = col[p]
        _row(cp, y, n, c, oh, a, b, pl, sw, kw, dw)
        for ow in range(a):
            _edge(cp, y, n, c, oh, ow, pl, sw, kw, dw)
        for ow in range(b, ow_len):
            _edge(cp, y, n, c, oh, ow, pl, sw, kw, dw)


@numba.jit(**PARALLEL)
def maxpool_nchw(x, y, kh, kw, sh, sw, dh, dw, pt, pl, a, b, per_item):
    """y[N, C, OH, OW] = MaxPool(x); arguments as _launch makes them. An item is per_item
    consecutive channel planes."""
    c_len = x.shape[1]
    planes = x.shape[0] * c_len
    for item in numba.prange(-(-planes // per_item)):
        col = np.empty((2, x.shape[3]), np.float32)
        for q in range(item * per_item, min(planes, (item + 1) * per_item)):
            _plane(x, q // c_len, q % c_len, y, kh, kw, sh, sw, dh, dw, pt, pl, a, b, col)


def maxpool2d(x, plan, out=None):
    """MaxPool of x float32 C-contiguous [N, C, H, W]; returns `out` (made if None)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 4:
        raise ValueError(f"x must be a float32 [N, C, H, W] array, got {getattr(x, 'shape', x)!r}")
    x = np.ascontiguousarray(x)
    shape, args = cached_launch(_launch, plan, x.shape)
    if out is None:
        out = np.empty(shape, np.float32)
    elif not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != np.float32:
        raise ValueError(f"out must be a float32 array of shape {shape}")
    elif not out.flags.writeable or np.may_share_memory(out, x):
        raise ValueError("out must be writeable and must not overlap x")
    maxpool_nchw(x, out, *args)
    return out


@numba.jit(**INLINE)
def _window_max(L, xf, m, r, kw, dw, iw0, w):
    """m and the taps of one window row that fall inside the image: xf's vectors at r +
    iw b for iw = iw0 + j dw, j < kw, 0 <= iw < w (b = L.width); a NaN in a tap wins."""
    b = L.width
    for j in range(kw):
        iw = iw0 + j * dw
        if 0 <= iw < w:
            v = vload(L, xf, np.uint64(r + iw * b))
            m = vselect(m > v, m, v)
    return m


@numba.jit(**PARALLEL)
def maxpool_nchwc(L, xf, yf, n_len, cb_len, h, w, oh_len, ow_len, kh, kw, sh, sw, dh, dw, pt,
                  pl):  # fmt: skip
    """y[n, cb, oh, ow, :] = max over the taps inside the image of x[n, cb, ih, iw, :], on
    flat blocked arrays ([N, CB, H, W, b], b = L.width): the b channels of a block are the
    vector lanes, so a window is kh kw vector maxima, no column-wise pass needed. An item is
    one output row of one block: its taps' rows inside the image are found once, and the
    columns c0 <= ow < c1 whose windows lie inside the image (all but a padded edge's) run
    with no test per tap (with a test per tap the kernel took 1.2-2.4x as long at batch 1:
    bench/NOTES.md). The maximum is _max's, lane by lane (one vmaxps: a NaN in the new value
    wins, one in the running maximum does not)."""
    u = np.uint64
    b = L.width
    lo = vbroadcast(L, LOWEST)
    c0 = min(ow_len, -(-pl // sw))  # ow sw - pl >= 0 ...
    last = w - 1 - (kw - 1) * dw + pl  # ... and ow sw - pl + (kw - 1) dw <= w - 1
    c1 = max(c0, min(ow_len, last // sw + 1)) if last >= 0 else c0
    for item in numba.prange(n_len * cb_len * oh_len):
        plane, oh = item // oh_len, item % oh_len
        x0 = plane * h * w * b
        yo = ((plane * oh_len) + oh) * ow_len * b
        top = oh * sh - pt
        i0 = -(top // dh) if top < 0 else 0  # the tap rows inside the image: i0 <= i < i1
        i1 = min(kh, (h - 1 - top) // dh + 1) if h - 1 - top >= 0 else 0
        for ow in range(c0):
            m = lo
            for i in range(i0, i1):
                m = _window_max(L, xf, m, x0 + (top + i * dh) * w * b, kw, dw, ow * sw - pl, w)
            vstore(yf, u(yo + ow * b), m)
        for ow in range(c0, c1):
            m = lo
            for i in range(i0, i1):
                r = x0 + ((top + i * dh) * w + ow * sw - pl) * b
                if kw == 3:  # most pools: the row's three taps as straight code
                    v = vload(L, xf, u(r))
                    m = vselect(m > v, m, v)
                    v = vload(L, xf, u(r + dw * b))
                    m = vselect(m > v, m, v)
                    v = vload(L, xf, u(r + 2 * dw * b))
                    m = vselect(m > v, m, v)
                else:
                    for j in range(kw):
                        v = vload(L, xf, u(r + j * dw * b))
                        m = vselect(m > v, m, v)
            vstore(yf, u(yo + ow * b), m)
        for ow in range(c1, ow_len):
            m = lo
            for i in range(i0, i1):
                m = _window_max(L, xf, m, x0 + (top + i * dh) * w * b, kw, dw, ow * sw - pl, w)
            vstore(yf, u(yo + ow * b), m)


def _blocks(xb) -> int:
    """The block b of a blocked float32 array [N, CB, H, W, b], b a vector width, or ValueError."""
    if (
        not isinstance(xb, np.ndarray)
        or xb.dtype != np.float32
        or xb.ndim != 5
        or xb.shape[4] not in WIDTHS
    ):
        raise ValueError(f"x must be a blocked float32 [N, CB, H, W, b] array, b one of "
                         f"{WIDTHS}, got {getattr(xb, 'shape', xb)!r}")  # fmt: skip
    return xb.shape[4]


def maxpool_blocked(xb, plan, out=None):
    """MaxPool of a blocked float32 x [N, CB, H, W, b] (kernels/blocked.py, b = 8 or 16);
    returns the blocked output [N, CB, OH, OW, b] (`out` if given)."""
    b = _blocks(xb)
    n, cb, h, w, _ = xb.shape
    (_, _, oh, ow), (pt, pl, _, _) = output_shape((n, cb * b, h, w), plan)
    if min(oh, ow) < 1:
        raise ValueError(f"MaxPool output is empty for input {xb.shape}")
    out = output((n, cb, oh, ow, b), out, {"x": xb})
    if n == 0:
        return out
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    xf = np.ascontiguousarray(xb).reshape(-1)
    maxpool_nchwc(lanes(b), xf, out.reshape(-1), n, cb, h, w, oh, ow, kh, kw, sh, sw, dh, dw, pt,
                  pl)  # fmt: skip
    return out


def bind_maxpool_blocked(xb, plan):
    """maxpool_blocked(xb, plan) specialized for arrays of xb's shape: f(xb) -> y, the output
    shape and the kernel's arguments worked out once and the kernel called through its
    compiled entry point (as kernels/conv_nchwc.bind_conv_nchwc)."""
    y = maxpool_blocked(xb, plan)  # checks it
    shape, b = y.shape, xb.shape[4]
    if shape[0] == 0:
        return lambda xb: empty(shape)
    n, cb, h, w, _ = xb.shape
    (_, _, oh, ow), (pt, pl, _, _) = output_shape((n, cb * b, h, w), plan)
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    L, size, alloc = lanes(b), y.size, allocator()
    sizes = (n, cb, h, w, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl)
    run = entry_point(maxpool_nchwc, (L, xb.reshape(-1), y.reshape(-1), *sizes))

    def call(xb):
        yf = alloc(size)
        run(L, xb.reshape(-1), yf, *sizes)
        return yf.reshape(shape)

    return call


@numba.jit(**PARALLEL)
def _plane_means(x3, y):
    """y[n, c] = mean of x3[n, c, :], summed in float64."""
    c_len, p_len = x3.shape[1], x3.shape[2]
    for item in numba.prange(x3.shape[0] * c_len):
        n, c = item // c_len, item % c_len
        s = 0.0
        for p in range(p_len):
            s += x3[n, c, p]
        y[n, c] = s / p_len


def global_average_pool(x):
    """GlobalAveragePool of x float32 [N, C, H, W], flattened: [N, C]."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 4 or x.size == 0:
        raise ValueError(f"x must be a non-empty float32 [N, C, H, W] array, got {x!r:.60}")
    x = np.ascontiguousarray(x)
    y = np.empty(x.shape[:2], np.float32)
    _plane_means(x.reshape(x.shape[0], x.shape[1], -1), y)
    return y


RUN = 64  # pixels summed in float32 before their sums join the float64 ones


@numba.jit(**INLINE)
def block_sums(L, xf, q0, p0, p1, s):
    """s[lane] += the sum of the vectors xf[q0 + p W : q0 + p W + W] for p0 <= p < p1 (a
    blocked plane's pixels, W = L.width): float32 runs of RUN pixels, each added into the
    float64 lanes s. The plane means of GlobalAveragePool's blocked kernel and of
    squeeze-excitation's (kernels/squeeze_excite.py): a scalar float64 sum per lane ran at
    half the speed of the pass that scales x after it. A run's pixels go to four
    accumulators in turn (its last len % 4 to the first): one chain waited on the add's
    latency (the sums of 8 images of 96 channels at 56 x 56 on one thread in
    squeeze-excitation's gates, 175 -> 127 us; bench/NOTES.md)."""
    w = L.width
    for r0 in range(p0, p1, RUN):
        end = min(r0 + RUN, p1)
        a0, a1, a2, a3 = vzero(L), vzero(L), vzero(L), vzero(L)
        p = r0
        while p + 4 <= end:
            q = q0 + p * w
            a0 += vload(L, xf, q)
            a1 += vload(L, xf, q + w)
            a2 += vload(L, xf, q + 2 * w)
            a3 += vload(L, xf, q + 3 * w)
            p += 4
        while p < end:
            a0 += vload(L, xf, q0 + p * w)
            p += 1
        acc = (a0 + a1) + (a2 + a3)
        for lane in range(w):
            s[lane] += vget(acc, lane)


@numba.jit(**PARALLEL)
def block_means(L, x4, y):
    """y[n, cb * b + l] = mean of x4[n, cb, :, l] for the channels y has (b = x4's last
    dimension, L's width), summed in float64, one work item per plane: GlobalAveragePool's,
    and squeeze-excitation's means where its planes are not cut in parts."""
    cb_len, p_len, b, c_len = x4.shape[1], x4.shape[2], x4.shape[3], y.shape[1]
    xf = x4.reshape(-1)
    for item in numba.prange(x4.shape[0] * cb_len):
        t = np.int64(item)  # prange's index is unsigned
        n, cb = t // cb_len, t % cb_len
        s = np.zeros(b, np.float64)
        block_sums(L, xf, t * p_len * b, 0, p_len, s)
        for lane in range(min(b, c_len - cb * b)):
            y[n, cb * b + lane] = s[lane] / p_len


def global_average_pool_blocked(xb, channels: int):
    """GlobalAveragePool of a blocked float32 x [N, CB, H, W, b] holding `channels` channels,
    flattened: [N, channels], plain (a classifier's input)."""
    b = _blocks(xb)
    n, cb, h, w, _ = xb.shape
    if h * w == 0 or -(-channels // b) != cb:
        raise ValueError(f"x must be a non-empty blocked float32 [N, CB, H, W, b] array of "
                         f"{channels} channels, got {xb.shape!r}")  # fmt: skip
    y = np.empty((n, channels), np.float32)
    block_means(lanes(b), np.ascontiguousarray(xb).reshape(n, cb, h * w, b), y)
    return y


def bind_global_average_pool_blocked(xb, channels: int):
    """global_average_pool_blocked(xb, channels) specialized for arrays of xb's shape: f(xb)
    -> y [N, channels] (as bind_maxpool_blocked)."""
    y = global_average_pool_blocked(xb, channels)  # checks it
    n, cb, h, w, b = xb.shape
    if n == 0:
        return lambda xb: np.empty((0, channels), np.float32)
    L, x4 = lanes(b), (n, cb, h * w, b)
    run = entry_point(block_means, (L, np.ascontiguousarray(xb).reshape(x4), y))

    def call(xb):  # x contiguous as the general call makes it (a view into a longer concat)
        y = np.empty((n, channels), np.float32)
        run(L, np.ascontiguousarray(xb).reshape(x4), y)
        return y

    return call


# ---- AveragePool with windows that tile the image (DenseNet's transitions) -----------------
@numba.jit(**PARALLEL)
def _tiled_means(x4, y4, kh, kw):
    """y4[q, i, j, l] = mean of x4[q, i kh + a, j kw + c, l] over the kh x kw window, for
    planes q of [H, W, b] pixels (b = 1: NCHW planes; a block of another width than the
    vectors'). Summed row by row of the window, then divided by its size (onnxruntime's order
    for an AveragePool without padding). One work item: one output row of one plane."""
    q_len, oh_len, ow_len, b = y4.shape
    count = np.float32(kh * kw)
    for item in numba.prange(q_len * oh_len):
        t = np.int64(item)  # prange's index is unsigned
        q, i = t // oh_len, t % oh_len
        for j in range(ow_len):
            for lane in range(b):
                s = np.float32(0.0)
                for a in range(kh):
                    for c in range(kw):
                        s += x4[q, i * kh + a, j * kw + c, lane]
                y4[q, i, j, lane] = s / count


@numba.jit(**PARALLEL)
def _tiled_means_blocked(L, x4, y4, kh, kw):
    """_tiled_means for blocks of the vectors' width: each output pixel one vector, the sum of
    the window's kh x kw input vectors (in the same order), divided by its size."""
    q_len, h, w = x4.shape[0], x4.shape[1], x4.shape[2]
    oh_len, ow_len, b = y4.shape[1], y4.shape[2], L.width
    xf, yf = x4.reshape(-1), y4.reshape(-1)
    count = np.float32(kh * kw)
    for item in numba.prange(q_len * oh_len):
        t = np.int64(item)  # prange's index is unsigned
        q, i = t // oh_len, t % oh_len
        for j in range(ow_len):
            s = vzero(L)
            for a in range(kh):
                row = ((q * h + i * kh + a) * w + j * kw) * b
                for c in range(kw):
                    s += vload(L, xf, row + c * b)
            vstore(yf, ((q * oh_len + i) * ow_len + j) * b, s / count)


def tiled_average_pool(x, kh: int, kw: int):
    """AveragePool with kh x kw windows, strides the window, no padding (a remainder row or
    column dropped, as ONNX's floor does) of a float32 NCHW [N, C, H, W] or blocked [N, CB, H,
    W, b] array; the output in the same layout."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim not in (4, 5):
        raise ValueError(f"x must be a float32 NCHW or blocked array, got {x!r:.60}")
    if kh < 1 or kw < 1:
        raise ValueError(f"the window must be at least 1 x 1, got {kh} x {kw}")
    n, c, h, w = x.shape[:4]
    b = x.shape[4] if x.ndim == 5 else 1
    oh, ow = h // kh, w // kw
    y = empty((n, c, oh, ow, b)) if x.ndim == 5 else np.empty((n, c, oh, ow), np.float32)
    if y.size:
        x4, y4 = np.ascontiguousarray(x).reshape(n * c, h, w, b), y.reshape(n * c, oh, ow, b)
        if b in WIDTHS and b > 1:
            _tiled_means_blocked(lanes(b), x4, y4, kh, kw)
        else:
            _tiled_means(x4, y4, kh, kw)
    return y
