"""Squeeze-excitation on a blocked tensor in one call: the plane means, the gate, the scaling.

    m[n, c] = mean over the plane of x[n, c]     (float32 runs summed in float64, pool.block_sums)
    h[n, j] = act1(sum_c W1[j, c] m[n, c] + b1[j])              j < M (the squeeze)
    g[n, c] = act2(sum_j W2[c, j] h[n, j] + b2[c])              c < C
    y[n, c, p] = x[n, c, p] g[n, c]

EfficientNet's, MobileNetV3's and RegNetY's block (patterns/squeeze_excite.py). Made of separate
kernels (GlobalAveragePool's means, two dense products and their epilogues, a gated pointwise
pass), each Python call and parallel region cost a few microseconds: 37-94 us a block in
EfficientNet-B0 where onnxruntime's five nodes take ~30 (bench/NOTES.md). Here one jitted call
runs three phases: the means in parallel over (image, block, part of the plane) items (an early
block of 2 channel blocks at 112x112 split in parts: blocked.plane_parts), then every image's
gate in vectors over C (W1 by rows dotted with m; W2 stored transposed, [M, C], so that h[j]
scales a row of it into g; rows and vectors split between the threads), then the scaling in
parallel over the same items. Channels past C stay zero (their gate is 0).

Folded into the 1x1 conv after the gate (gated_weights): as conv(x g) = (W g) x, each image's
copy of the conv's packed weights is scaled along its input channels by g, and the conv reads
x itself (kernels/conv_nchwc.py `weights`), y never written; the same phases compute g.

A second form runs the block in one parallel region (squeeze_excite_one_region): each thread
takes an even share of the (image, channel block) pairs, computes the means and the squeeze of
every image its share touches (one image shared by two threads is computed by both), then the
gates and the scaling of its own blocks. Each region costs ~2 us here and the four regions
above were most of a small block's 11-22 us (bench/NOTES.md); one region pays for it with the
work it repeats, which at one image is the means and the squeeze. Which is faster is a
question of the shapes: the rule offers both as tactics and the session times them.

    >>> plan = prepare_squeeze_excite(w1, b1, w2, b2, act1=encode("relu"), act2=encode("sigmoid"))
    >>> yb = squeeze_excite_blocked(xb, plan)
"""

import dataclasses

import numba
import numpy as np

from .blocked import plane_part, plane_parts
from .config import INLINE, JIT, PARALLEL, ZERO_I64, entry_point, get_threads
from .pool import block_means, block_sums
from .simd import (
    hsum,
    lanes,
    tail_mask,
    vfma,
    vload,
    vload_masked,
    vstore,
    vstore_masked,
    vzero,
)
from .simd.activation import activate
from .workspace import allocator, empty, output


@dataclasses.dataclass(frozen=True)
class SqueezeExcitePlan:
    channels: int  # C
    w1: np.ndarray  # [M, C] float32
    b1: np.ndarray  # [M]
    w2t: np.ndarray  # [M, C]: W2 transposed
    b2: np.ndarray  # [C]
    acts: np.ndarray  # [2, 3] float32: (kind, a, b) of act1 and act2 (kernels/simd/activation)
    # (kernel, b, x writeable[, y writeable]) -> the kernel's compiled entry point
    entry: dict = dataclasses.field(default_factory=dict, compare=False)


def prepare_squeeze_excite(w1, b1, w2, b2, act1, act2) -> SqueezeExcitePlan:
    """The block's two 1x1 convs as matrices (W1 [M, C], W2 [C, M], biases [M], [C] or None)
    and activations, each an encode() triple."""
    w1 = np.asarray(w1, np.float32).reshape(w1.shape[0], -1)
    w2 = np.asarray(w2, np.float32).reshape(w2.shape[0], -1)
    m, c = w1.shape
    if w2.shape != (c, m):
        raise ValueError(f"W1 {w1.shape} and W2 {w2.shape} do not chain C -> M -> C")
    b1 = np.zeros(m, np.float32) if b1 is None else np.asarray(b1, np.float32).reshape(m)
    b2 = np.zeros(c, np.float32) if b2 is None else np.asarray(b2, np.float32).reshape(c)
    acts = np.array([list(act1), list(act2)], np.float32)
    return SqueezeExcitePlan(c, np.ascontiguousarray(w1), b1, np.ascontiguousarray(w2.T), b2,
                             acts)  # fmt: skip


@numba.jit(**INLINE)
def _dot(L, a, a0, b, b0, n):
    """sum_k a[a0 + k] b[b0 + k] for k < n, in vectors of L.width (flat float32 arrays); copied
    into its callers (no call and no reference counts per dot product)."""
    w = L.width
    acc = vzero(L)
    k = 0
    while k + w <= n:
        acc = vfma(vload(L, a, a0 + k), vload(L, b, b0 + k), acc)
        k += w
    m = tail_mask(L, n - k)
    acc = vfma(vload_masked(L, a, a0 + k, m), vload_masked(L, b, b0 + k, m), acc)
    return hsum(acc)


@numba.jit(**JIT)
def _hidden(L, means, w1f, b1, acts, j, c_len):
    """act1(W1[j] . means + b1[j]): the squeeze's output j."""
    t = _dot(L, means, 0, w1f, j * c_len, c_len) + b1[j]
    return activate(np.int64(acts[0, 0]), acts[0, 1], acts[0, 2], np.float32(t))


@numba.jit(**JIT)
def _squeeze(L, means, w1f, b1, acts, h):
    """h = act1(W1 means + b1), the whole squeeze of one image in one call: its rows dotted
    with the means (_dot, copied in), then the activation on vectors of h, where _hidden made
    three calls per output (a 576 -> 144 block on one thread 24.2 -> 21.0 us,
    bench/NOTES.md)."""
    w = L.width
    m_len, c_len = h.shape[0], means.shape[0]
    for j in range(m_len):
        h[j] = _dot(L, means, 0, w1f, j * c_len, c_len) + b1[j]
    kind, a, b = np.int64(acts[0, 0]), acts[0, 1], acts[0, 2]
    for j in range(0, m_len, w):
        m = tail_mask(L, m_len - j)
        vstore_masked(h, j, activate(kind, a, b, vload_masked(L, h, j, m)), m)


@numba.jit(**JIT)
def _excite(L, h, w2f, b2, acts, g, c0, c_len):
    """g[c0 : c0 + W] = act2(sum_j h[j] W2[c, j] + b2[c]) for the channels below c_len."""
    m = tail_mask(L, c_len - c0)
    acc = vload_masked(L, b2, c0, m)
    for j in range(h.shape[0]):
        acc = vfma(vload_masked(L, w2f, j * c_len + c0, m), h[j], acc)
    acc = activate(np.int64(acts[1, 0]), acts[1, 1], acts[1, 2], acc)
    vstore_masked(g, c0, acc, m)


@numba.jit(**JIT)
def _image_gates(L, xf, x0, cb_len, p_len, w1f, b1, w2f, b2, acts, c0, c1, gates):
    """gates[c0 : c1] of the image whose blocks start at xf[x0]: all its plane means and the
    whole squeeze (every gate needs them), the excitation for channels c0 <= c < c1 only
    (multiples of L.width; those past C are left as they are)."""
    b = L.width
    m_len, c_len = b1.shape[0], b2.shape[0]
    means = np.zeros(cb_len * b, np.float32)
    s = np.empty(b, np.float64)
    for cb in range(cb_len):
        s[:] = 0.0
        block_sums(L, xf, x0 + cb * p_len * b, 0, p_len, s)
        for lane in range(b):
            means[cb * b + lane] = s[lane] / p_len
    h = np.empty(m_len, np.float32)
    _squeeze(L, means[:c_len], w1f, b1, acts, h)
    for c in range(c0, min(c1, c_len), b):
        _excite(L, h, w2f, b2, acts, gates, c, c_len)


@numba.jit(**PARALLEL)
def squeeze_excite_one_region(L, x4, y4, w1, b1, w2t, b2, acts, threads):
    """squeeze_excite_nchwc in one parallel region (module docstring): item t of `threads`
    takes the (image, block) pairs [t P / threads, (t + 1) P / threads) of P = N CB, and for
    each image among them its gates (_image_gates: that image's means and squeeze, the
    excitation of the item's blocks), then scales those blocks."""
    n_len, cb_len, p_len, b = x4.shape
    xf, yf = x4.reshape(-1), y4.reshape(-1)
    w1f, w2f = w1.reshape(-1), w2t.reshape(-1)
    pairs = n_len * cb_len
    for t in numba.prange(threads):
        first, end = np.int64(t) * pairs // threads, (np.int64(t) + 1) * pairs // threads
        gates = np.zeros(cb_len * b, np.float32)  # 0 past C: the padding stays 0
        pair = first
        while pair < end:
            n = pair // cb_len
            cb0, cb1 = pair % cb_len, min(cb_len, end - n * cb_len)  # this image's blocks
            _image_gates(L, xf, n * cb_len * p_len * b, cb_len, p_len, w1f, b1, w2f, b2, acts,
                         cb0 * b, cb1 * b, gates)  # fmt: skip
            for cb in range(cb0, cb1):
                gv = vload(L, gates, cb * b)
                base = (n * cb_len + cb) * p_len * b
                for p in range(p_len):
                    q = base + p * b
                    vstore(yf, q, vload(L, xf, q) * gv)
            pair = (n + 1) * cb_len


@numba.jit(**INLINE)
def _means(L, x4, parts, means):
    """means[n, cb b + l] = the mean of lane l of x4's plane (n, cb) (blocked [N, CB, P, b],
    b = L.width): pool.block_means, one item per plane, where planes are not cut; else in
    parallel over (plane, part) items, each plane cut in `parts` runs of pixels
    (blocked.plane_part), then the parts summed. Uncut planes write their means from their
    items: summing them afterwards in one thread took as long as the sums at eight images of
    576 channels at 7 x 7 (11 of 24 us, bench/NOTES.md)."""
    if parts == 1:
        block_means(L, x4, means)
        return
    n_len, cb_len, p_len, b = x4.shape
    planes = n_len * cb_len
    xf, mf = x4.reshape(-1), means.reshape(-1)
    sums = np.empty((planes * parts, b), np.float64)
    for task in numba.prange(planes * parts):
        item, p0, p1 = plane_part(task, parts, p_len)
        s = np.zeros(b, np.float64)
        block_sums(L, xf, item * p_len * b, p0, p1, s)
        sums[np.int64(task)] = s
    for i in range(planes):
        for lane in range(b):
            total = 0.0
            for k in range(parts):
                total += sums[i * parts + k, lane]
            mf[i * b + lane] = total / p_len


@numba.jit(**PARALLEL)
def gates_nchwc(L, x4, w1, b1, w2t, b2, acts, parts, gates):
    """gates[n, c] = g[n, c] of every image of x4, blocked [N, CB, P, b] (b = L.width), gates
    [N, CB b] float32 (left as they are past C): the plane means in parallel over (image,
    block, part of the plane) items, each plane cut in `parts` runs of pixels, then the
    squeeze's rows and the excitation's vectors of every image split between the threads.
    Three parallel regions whatever the batch (a pair per image was 2 N regions of ~3 us
    each: bench/NOTES.md)."""
    n_len, cb_len, p_len, b = x4.shape
    m_len, c_len = w1.shape
    means = np.empty((n_len, cb_len * b), np.float32)
    _means(L, x4, parts, means)
    # the gate: its weights (2 M C floats, 442 KB for EfficientNet's last blocks) read by both
    # threads, the squeeze's rows and then the channels' vectors of every image split
    h = np.empty((n_len, m_len), np.float32)
    w1f, w2f = w1.reshape(-1), w2t.reshape(-1)
    for t in numba.prange(n_len * m_len):
        n, j = np.int64(t) // m_len, np.int64(t) % m_len
        h[n, j] = _hidden(L, means[n], w1f, b1, acts, j, c_len)
    v_len = -(-c_len // b)
    for t in numba.prange(n_len * v_len):
        n, c0 = np.int64(t) // v_len, np.int64(t) % v_len
        _excite(L, h[n], w2f, b2, acts, gates[n], c0 * b, c_len)


@numba.jit(**PARALLEL)
def squeeze_excite_nchwc(L, x4, y4, w1, b1, w2t, b2, acts, parts):
    """y4 = x4 g (module docstring), x4 and y4 blocked [N, CB, P, b] (b = L.width): every
    image's gates (gates_nchwc), then the scaling in parallel over its items. Four parallel
    regions whatever the batch."""
    n_len, cb_len, p_len, b = x4.shape
    gates = np.zeros((n_len, cb_len * b), np.float32)  # 0 past C: the padding stays 0
    gates_nchwc(L, x4, w1, b1, w2t, b2, acts, parts, gates)
    xf, yf = x4.reshape(-1), y4.reshape(-1)
    for task in numba.prange(n_len * cb_len * parts):
        item, p0, p1 = plane_part(task, parts, p_len)
        n, cb = item // cb_len, item % cb_len
        gv = vload(L, gates[n], cb * b)
        base = item * p_len * b
        for p in range(p0, p1):
            q = base + p * b
            vstore(yf, q, vload(L, xf, q) * gv)


@numba.jit(**INLINE)
def _scale_rows(L, pf, of, g, n, o, cb, ogg, cp, r):
    """The rows of input block cb in filter group o of the packed weights pf [OGG, CP, R],
    times the gate g (one image's, [CP]), into image n's copy of them in of [N, OGG, CP, R];
    copied into its callers."""
    b = L.width
    for c in range(cb * b, cb * b + b):
        gc = g[c]
        src, dst = (o * cp + c) * r, ((n * ogg + o) * cp + c) * r
        for k in range(0, r, b):
            vstore(of, dst + k, vload(L, pf, src + k) * gc)


@numba.jit(**PARALLEL)
def gated_weights_nchwc(L, x4, w1, b1, w2t, b2, acts, parts, packed, out):
    """out[n, o, c, :] = packed[o, c, :] g[n, c]: a 1x1 conv's packed weights [OGG, CB b, R]
    (its filter groups, input channels, R = FB b outputs) scaled per image along the input
    channels by the gate of x4 (gates_nchwc), out [N, OGG, CB b, R]. Then conv(x g) = (W g)
    x: the conv after the gate reads x itself with these weights (conv_nchwc `weights`), and
    y = x g is never written. Rows in parallel over (image, filter group, input block)."""
    n_len, cb_len, _, b = x4.shape
    gates = np.zeros((n_len, cb_len * b), np.float32)  # 0 past C (packed rows there are 0)
    gates_nchwc(L, x4, w1, b1, w2t, b2, acts, parts, gates)
    ogg, cp, r = packed.shape
    pf, of = packed.reshape(-1), out.reshape(-1)
    for t in numba.prange(n_len * ogg * cb_len):
        n, rest = np.int64(t) // (ogg * cb_len), np.int64(t) % (ogg * cb_len)
        _scale_rows(L, pf, of, gates[n], n, rest // cb_len, rest % cb_len, ogg, cp, r)


@numba.jit(**PARALLEL)
def gated_weights_one_region(L, x4, w1, b1, w2t, b2, acts, threads, packed, out):
    """gated_weights_nchwc in one parallel region, as squeeze_excite_one_region: item t of
    `threads` takes an even share of the (image, filter group, input block) rows and, for
    each image among them, that image's gates (_image_gates: its means and squeeze, computed
    by every thread that takes rows of it), then scales its rows."""
    n_len, cb_len, p_len, b = x4.shape
    ogg, cp, r = packed.shape
    per_image = ogg * cb_len
    rows = n_len * per_image
    xf, pf, of = x4.reshape(-1), packed.reshape(-1), out.reshape(-1)
    w1f, w2f = w1.reshape(-1), w2t.reshape(-1)
    for t in numba.prange(threads):
        first, end = np.int64(t) * rows // threads, (np.int64(t) + 1) * rows // threads
        gates = np.zeros(cp, np.float32)  # 0 past C (packed rows there are 0)
        row = first
        while row < end:
            n = row // per_image
            _image_gates(L, xf, n * cb_len * p_len * b, cb_len, p_len, w1f, b1, w2f, b2, acts,
                         ZERO_I64, cp, gates)  # fmt: skip
            stop = min(end, (n + 1) * per_image)
            for q in range(row, stop):
                _scale_rows(L, pf, of, gates, n, (q % per_image) // cb_len, q % cb_len, ogg, cp,
                            r)  # fmt: skip
            row = stop


def squeeze_excite_blocked(xb, plan: SqueezeExcitePlan, out=None, one_region=False):
    """The block on a blocked float32 x [N, CB, H, W, b] of plan.channels channels; returns y
    (blocked, x's shape), into `out` if given. one_region: squeeze_excite_one_region, else
    squeeze_excite_nchwc (module docstring)."""
    n, cb, h, w, b = _blocked_shape(xb, plan)
    # out = x refused for both forms, though only the one-region form needs it (its threads
    # read an image's whole plane for their means while others scale theirs)
    out = output(xb.shape, out, {"x": xb})
    if n == 0:
        return out
    x4 = np.ascontiguousarray(xb).reshape(n, cb, h * w, b)
    kernel = squeeze_excite_one_region if one_region else squeeze_excite_nchwc
    last = get_threads() if one_region else plane_parts(n * cb, h * w)
    args = (lanes(b), x4, out.reshape(n, cb, h * w, b), plan.w1, plan.b1, plan.w2t, plan.b2,
            plan.acts, last)  # fmt: skip
    _call(plan, kernel, (kernel, b, x4.flags.writeable, out.flags.writeable), args)
    return out


def _blocked_shape(xb, plan: SqueezeExcitePlan) -> tuple:
    """xb's shape [N, CB, H, W, b], checked: a blocked float32 array of plan.channels."""
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    n, cb, h, w, b = xb.shape
    if -(-plan.channels // b) != cb or h * w == 0:
        raise ValueError(f"x of shape {xb.shape} does not hold {plan.channels} channels in "
                         f"blocks of {b}, or its plane is empty")  # fmt: skip
    return xb.shape


def _call(plan: SqueezeExcitePlan, kernel, key: tuple, args: tuple) -> None:
    """kernel(*args). The arguments' types are the same on every call of a kernel at a width
    (the arrays' writability aside, part of `key`): its compiled entry point, found on the
    first call, skips the dispatcher (~1 us)."""
    run = plan.entry.get(key)
    if run is None:
        kernel(*args)
        plan.entry[key] = entry_point(kernel, args)
    else:
        run(*args)


def gated_weights(xb, plan: SqueezeExcitePlan, conv, one_region=False) -> np.ndarray:
    """Each image's packed weights of `conv` (a kernels/conv_nchwc ConvPlan of a 1x1 conv of
    group 1 on plan.channels channels in blocks of xb's width) with the gate of xb (blocked
    [N, CB, H, W, b]) folded in along its input channels: [N, conv.packed.size], for
    conv_nchwc(xb, conv, weights=...), which then computes conv(squeeze_excite(xb)) without
    writing the gated tensor (gated_weights_nchwc). Worth it where a plane has more pixels
    than the conv has outputs: the weights scaled per image, N M C floats, against the
    gated tensor written and read back, N C H W. one_region: gated_weights_one_region, else
    gated_weights_nchwc (as squeeze_excite_blocked's)."""
    n, cb, h, w, b = _blocked_shape(xb, plan)
    if (conv.depthwise or conv.group != 1 or conv.kernel != (1, 1) or conv.in_block != b
            or conv.in_channels != plan.channels or conv.block != b):  # fmt: skip
        raise ValueError(f"the gate folds into a 1x1 conv of group 1 on {plan.channels} "
                         f"channels in blocks of {b}")  # fmt: skip
    ogg = -(-conv.out_blocks_per_group // conv.fb)  # filter groups of FB blocks
    packed = conv.packed.reshape(ogg, cb * b, conv.fb * b)
    out = empty((n, conv.packed.size))
    if n == 0:
        return out
    x4 = np.ascontiguousarray(xb).reshape(n, cb, h * w, b)
    kernel = gated_weights_one_region if one_region else gated_weights_nchwc
    last = get_threads() if one_region else plane_parts(n * cb, h * w)
    args = (lanes(b), x4, plan.w1, plan.b1, plan.w2t, plan.b2, plan.acts, last, packed,
            out.reshape(n, ogg, cb * b, conv.fb * b))  # fmt: skip
    _call(plan, kernel, (kernel, b, x4.flags.writeable), args)
    return out


def bind_squeeze_excite_blocked(xb, plan: SqueezeExcitePlan, one_region=False):
    """squeeze_excite_blocked(xb, plan, one_region=) specialized for arrays of xb's shape at
    the calling thread's thread count: f(xb) -> y (as conv_nchwc.bind_conv_nchwc: the checks
    and the arguments worked out once; f allocates and calls the compiled kernel)."""
    squeeze_excite_blocked(xb, plan, one_region=one_region)  # checks it; binds the kernel
    n, cb, h, w, b = xb.shape
    if n == 0:
        return lambda xb: empty(xb.shape)
    kernel = squeeze_excite_one_region if one_region else squeeze_excite_nchwc
    readable = np.ascontiguousarray(xb).flags.writeable  # as squeeze_excite_blocked keys it
    run = plan.entry[(kernel, b, readable, True)]
    last = get_threads() if one_region else plane_parts(n * cb, h * w)
    L, x4, size, alloc = lanes(b), (n, cb, h * w, b), xb.size, allocator()
    consts = (plan.w1, plan.b1, plan.w2t, plan.b2, plan.acts, last)

    def call(xb):  # x contiguous as the general call makes it (a view into a longer concat)
        out = alloc(size)
        run(L, np.ascontiguousarray(xb).reshape(x4), out.reshape(x4), *consts)
        return out.reshape(xb.shape)

    return call


def bind_gated_weights(xb, plan: SqueezeExcitePlan, conv, one_region=False):
    """gated_weights(xb, plan, conv, one_region) specialized for arrays of xb's shape at the
    calling thread's thread count: f(xb) -> each image's weights (as
    bind_squeeze_excite_blocked)."""
    gated_weights(xb, plan, conv, one_region)  # checks it; binds the kernel
    n, cb, h, w, b = xb.shape
    if n == 0:
        return lambda xb: empty((0, conv.packed.size))
    kernel = gated_weights_one_region if one_region else gated_weights_nchwc
    run = plan.entry[(kernel, b, np.ascontiguousarray(xb).flags.writeable)]  # as gated_weights
    last = get_threads() if one_region else plane_parts(n * cb, h * w)
    ogg = -(-conv.out_blocks_per_group // conv.fb)
    packed = conv.packed.reshape(ogg, cb * b, conv.fb * b)
    rows, size, alloc = (n, ogg, cb * b, conv.fb * b), conv.packed.size, allocator()
    L, x4 = lanes(b), (n, cb, h * w, b)
    consts = (plan.w1, plan.b1, plan.w2t, plan.b2, plan.acts, last, packed)

    def call(xb):  # x contiguous as the general call makes it
        out = alloc(n * size)
        run(L, np.ascontiguousarray(xb).reshape(x4), *consts, out.reshape(rows))
        return out.reshape(n, size)

    return call
