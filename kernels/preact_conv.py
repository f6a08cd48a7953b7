"""A 1x1 conv of a per-channel affine map and activation of its input, depth first.

    t = act_n(x s + t0)                 per channel (BatchNormalization + activation)
    y = act_c(conv1x1(t, W) + b)        C -> M, its own epilogue (a BatchNorm after it folded)

DenseNet's layers and transitions start this way (pre-activation: BN and ReLU of the
concatenated features, then the 1x1 conv). Op by op, t is written to memory and read back by
the conv: on densenet121 at batch 1 those passes took 2.48 ms of the plan's 29.0 ms (AMD EPYC
family 25 model 17, 2 cores), 2.6 times what the same passes took called alone
(bench/NOTES.md). Here a work item walks a run of pixels of one image in bands: the band's t,
for every input block, is computed into a per-thread scratch sized to a share of L2, and the
conv's register tiles (the direct conv family's item, _direct_blocked.pointwise_pixels) read it
from there. Each tensor touching memory is x, the weights and y.

    >>> plan = prepare_preact_conv(s, t0, w, b, norm_act={"activation": "relu"},
    ...                            conv_act={"activation": "relu"})
    >>> yb = preact_conv(to_blocked(x), plan)          # [N, ceil(M/b), H, W, b]

s, t0: float32 [C]; w: float32 [M, C, 1, 1]; b: [M] or None; norm_act, conv_act: keywords of
kernels.simd.activation.encode (None: identity). x and y are blocked at b =
kernels.simd.width() (x's padding lanes, past C, are multiplied by zero weights).
"""

import dataclasses
import math

import numba
import numpy as np

from . import _blocked_geometry as geo
from ._direct_blocked import pointwise_pixels
from .config import JIT_GEMM, PARALLEL, ZERO_I64, entry_point, get_threads
from .conv_nchwc import ConvPlan, busiest, pixels_geometry, prepare_conv_nchwc, tile_item
from .epilogue import NO_RESIDUAL, finish
from .machine import cache_bytes
from .pointwise import PointwisePlan, prepare_pointwise
from .simd import lanes, vfma, vload, vstore, width
from .simd.activation import clip_bounds, clips
from .workspace import allocator, cached_launch, output, per_thread

L2_SHARE = 2  # the band's scratch takes at most 1 / L2_SHARE of L2 (x, y, weights: the rest)
# the kernel's own geometry, beside the conv's
N, CB, PIXELS, PARTS, BAND, MB, TAPS, FB, EX, N_GEO = range(10)


@dataclasses.dataclass(frozen=True)
class PreActConvPlan:
    channels: int  # C
    out_channels: int  # M
    block: int
    norm: PointwisePlan  # x s + t0 and act_n (the op-by-op plan runs it as its own pass)
    conv: ConvPlan  # the 1x1 conv and its epilogue
    launches: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def prepare_preact_conv(scale, shift, w, bias=None, *, norm_act=None, conv_act=None,
                        block=None, tile=None) -> PreActConvPlan:  # fmt: skip
    """Pack the pair for preact_conv (ValueError on shapes it cannot run); tile: the conv's
    output blocks per register tile (conv_nchwc.tile_options; default its first)."""
    b = width() if block is None else int(block)
    if b not in (8, 16):
        raise ValueError(f"block must be 8 or 16 channels, got {block!r}")
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 4:
        raise ValueError(f"w must be a float32 [M, C, 1, 1] array, got {w!r:.60}")
    m, c = w.shape[:2]
    if w.shape[2:] != (1, 1):
        raise ValueError(f"w {w.shape} is not a 1x1 conv")
    norm = prepare_pointwise(c, scale, shift, **(norm_act or {}))
    conv = prepare_conv_nchwc(w, bias, strides=(1, 1), pads=(0,) * 4, block=b, in_block=b,
                              tile=tile, **(conv_act or {}))  # fmt: skip
    return PreActConvPlan(c, m, b, norm, conv)


@numba.jit(**JIT_GEMM)
def _normalize(L, xf, sc, sh, ex, x0, xbs, cb_len, count, stride, kind, a, b):
    """ex[cb, p] = act(x[cb, p] s_cb + t_cb) for the `count` pixels of each of cb_len blocks
    from x's flat offset x0 (x's blocks xbs pixels apart, ex's `stride`)."""
    w = L.width
    simple = clips(kind)
    lo, hi = clip_bounds(kind, a, b)
    for cb in range(cb_len):
        s, t = vload(L, sc, cb * w), vload(L, sh, cb * w)
        src, dst = x0 + cb * xbs * w, cb * stride * w
        for p in range(count):
            v = vfma(vload(L, xf, src + p * w), s, t)
            vstore(ex, dst + p * w, finish(v, v, NO_RESIDUAL, simple, lo, hi, kind, a, b))


@numba.jit(**PARALLEL)
def preact_conv_blocked(L, run, xf, xs, sc, sh, wf, bf, yf, g, gc, acts, work):
    """y = the pair on flat blocked arrays x [N, CB, P, b] (images xs floats apart: a channel
    prefix of a longer buffer has them further apart than CB P b), y [N, MB, P, b] (P = H W);
    run: the conv's work item on its register tile (an Item: conv_nchwc.tile_item); sc, sh
    the norm's per-channel vectors; wf, bf the conv's packed weights and bias; gc its geometry
    on a band (pixels_geometry); acts [2, 3] float32: (kind, a, b) of the norm's activation
    and the conv's; work [threads, g[EX] + parking]. Parallel over (image, run of pixels)
    items, each walked in bands of g[BAND] pixels."""
    w, pixels, band = L.width, g[PIXELS], g[BAND]
    per = (pixels + g[PARTS] - 1) // g[PARTS]
    kind, a, b = np.int64(acts[0, 0]), acts[0, 1], acts[0, 2]
    for it in numba.prange(g[N] * g[PARTS]):
        n, part = np.int64(it // g[PARTS]), np.int64(it % g[PARTS])
        p_a = part * per
        p_b = min(pixels, p_a + per)
        mine = work[numba.get_thread_id()]
        ex, acc = mine[: g[EX]], mine[g[EX] :]
        tbuf = np.empty(g[FB] * w, np.float32)
        tx, tw = np.empty(g[TAPS], np.int64), np.empty(g[TAPS], np.int64)
        sx, sw_ = np.empty(g[TAPS], np.int64), np.empty(g[TAPS], np.int64)
        gc_ = gc.copy()  # this thread's: its pixel count set per band
        for p0 in range(p_a, p_b, band):
            count = min(band, p_b - p0)
            _normalize(L, xf, sc, sh, ex, n * xs + p0 * w, pixels, g[CB], count, band, kind,
                       a, b)  # fmt: skip
            y0 = (n * g[MB] * pixels + p0) * w
            pointwise_pixels(L, run, ex, wf, bf, yf[y0:], yf[y0:], gc_, count, ZERO_I64,
                             gc[geo.OGG], acc, tbuf, tx, tw, sx, sw_, acts[1, 1], acts[1, 2],
                             L)  # fmt: skip


def band_pixels(cb: int, b: int, pixels: int) -> int:
    """Pixels per band: the most whose t (every input block) fits in L2 / L2_SHARE."""
    return max(1, min(pixels, cache_bytes(2) // L2_SHARE // (cb * b * 4)))


@dataclasses.dataclass
class _Launch:
    shape: tuple  # the output's
    args: tuple  # the kernel's arguments but for x, y and the scratch
    scratch: int  # floats of per-thread scratch
    run: object  # the dispatcher, then the compiled entry point
    bound: bool = False


def _launch(xb, plan: PreActConvPlan, threads: int) -> _Launch:
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    n, cb, h, w, bi = xb.shape
    b, conv = plan.block, plan.conv
    if bi != b or cb != -(-plan.channels // b):
        raise ValueError(f"x has {cb} blocks of {bi} channels; the conv reads {plan.channels} "
                         f"channels ({-(-plan.channels // b)} blocks of {b})")  # fmt: skip
    mb = -(-plan.out_channels // b)
    shape = (n, mb, h, w, b)
    pixels = h * w
    parts = min(range(1, max(1, min(pixels, threads)) + 1),
                key=lambda p: (busiest(max(1, n * p), threads), p))  # fmt: skip
    band = band_pixels(cb, b, -(-pixels // parts))
    gc = pixels_geometry(conv, (1, cb, 1, band, b), threads, pixels=band, XBS=band,
                         YBS=pixels)  # fmt: skip
    park = (band + int(gc[geo.PW])) * conv.fb * b if gc[geo.CHUNK] < gc[geo.CBG] else b
    g = np.zeros(N_GEO, np.int64)
    for key, v in {N: n, CB: cb, PIXELS: pixels, PARTS: parts, BAND: band, MB: mb,
                   TAPS: int(gc[geo.CHUNK]), FB: conv.fb, EX: cb * band * b}.items():  # fmt: skip
        g[key] = v
    norm = plan.norm
    acts = np.array([norm.act, conv.act], np.float32)
    L = lanes(b)
    run = tile_item(L, int(gc[geo.PW]), conv.fb, L)
    args = (L, run, norm.scale, norm.shift, conv.packed, conv.bias, g, gc, acts)
    return _Launch(shape, args, cb * band * b + park, preact_conv_blocked)


def _images(xb) -> tuple[np.ndarray, int]:
    """x as a flat array and its images' distance in floats: read in place when each image is
    contiguous (a channel prefix of a longer buffer, kernels/concat.py, with N > 1), else a
    contiguous copy."""
    per_image = xb[0].size if xb.shape[0] else 0
    if xb.flags.c_contiguous:
        return xb.reshape(-1), per_image
    step = xb.strides[0] // 4
    if xb[0].flags.c_contiguous and xb.strides[0] % 4 == 0 and step >= per_image:
        span = (xb.shape[0] - 1) * step + per_image
        return np.lib.stride_tricks.as_strided(xb, shape=(span,), strides=(4,)), step
    return np.ascontiguousarray(xb).reshape(-1), per_image


def preact_conv(xb, plan: PreActConvPlan, out=None):
    """y = act_c(conv1x1(act_n(x s + t0))) for a blocked float32 x [N, ceil(C/b), H, W, b];
    returns y blocked at plan.block. The per-shape work is done on a shape's first call."""
    launch = cached_launch(plan.launches, xb, lambda x, threads: _launch(x, plan, threads))
    shape = launch.shape
    out = output(shape, out, {"x": xb})
    if 0 in shape:
        return out
    xf, xs = _images(xb)
    L, run, sc, sh, wf, bf, g, gc, acts = launch.args
    args = (L, run, xf, xs, sc, sh, wf, bf, out.reshape(-1), g, gc, acts,
            per_thread(launch.scratch))  # fmt: skip
    launch.run(*args)
    if not launch.bound:  # the same types on every call of this launch: skip the dispatcher
        launch.run, launch.bound = entry_point(launch.run, args), True
    return out


def bind_preact_conv(xb, plan: PreActConvPlan):
    """preact_conv(xb, plan) specialized for arrays of xb's shape at the calling thread's
    thread count: f(xb) -> y, as kernels/conv_nchwc.bind_conv_nchwc (x still read in place or
    copied per call, as its strides say: _images)."""
    preact_conv(xb, plan)  # checks it; binds the kernel
    launch = plan.launches[(xb.shape, get_threads())]
    shape, size, alloc = launch.shape, math.prod(launch.shape), allocator()
    if 0 in shape:
        return lambda xb: output(shape)
    L, item, sc, sh, wf, bf, g, gc, acts = launch.args
    run, scratch = launch.run, launch.scratch

    def call(xb):
        xf, xs = _images(xb)
        yf = alloc(size)
        run(L, item, xf, xs, sc, sh, wf, bf, yf, g, gc, acts, per_thread(scratch))
        return yf.reshape(shape)

    return call
