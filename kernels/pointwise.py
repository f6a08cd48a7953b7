"""Per-channel elementwise ops with the fused epilogue, on blocked or NCHW tensors.

    y[n, c, p] = epilogue(x[n, c, p] * scale[c] * gate[n, c] + shift[c])

with the epilogue of kernels/epilogue.py (a tensor r of x's shape added before or after the
activation, any activation of kernels/simd/activation.py). One kernel serves:
- BatchNormalization (+ activation): scale = s / sqrt(var + eps), shift = b - mean scale;
- a residual Add (+ activation): scale 1, shift 0, r the other tensor;
- the multiply by a per-image channel gate (squeeze-excitation): gate [N, C];
- the rest of a conv's epilogue after a kernel that only clips (kernels/conv2d).

Blocked tensors ([N, CB, H, W, b], kernels/blocked.py, b = 8 or 16) run a pixel's b channels
as one vector of b lanes (the kernel compiled for that width); NCHW ones a channel plane at a
time, in vectors of this process's width. Work items are (image, channel
block) or (image, channel): disjoint outputs. The loops index arrays in place (no per-row
views, see kernels/_gemm.py).

    >>> plan = prepare_pointwise(64, scale=s, shift=t, activation="relu")
    >>> yb = pointwise_blocked(xb, plan)          # blocked in and out; pointwise(x, plan): NCHW
"""

import dataclasses
import math

import numba
import numpy as np

from .config import INLINE, PARALLEL
from .epilogue import RESIDUALS, finish
from .simd import WIDTHS, lanes, tail_mask, vfma, vload, vload_masked, vstore, vstore_masked
from .simd.activation import clip_bounds, clips, encode

_NONE = np.zeros(1, np.float32)  # an absent operand (the kernel does not read it)
# A plan's per-channel vectors are padded to whole blocks of the widest vector: one plan then
# serves a blocked tensor of any block (a block's vector load reads within the padding).
PAD = max(WIDTHS)
u = np.uint64


@dataclasses.dataclass(frozen=True)
class PointwisePlan:
    channels: int
    scale: np.ndarray  # [C padded to whole blocks of PAD] float32 (zeros past C)
    shift: np.ndarray
    act: tuple  # (kind, a, b): kernels/simd/activation.py
    residual: int  # epilogue.NO_RESIDUAL / BEFORE / AFTER
    gated: bool  # multiplied by a per-image channel gate [N, C]


def _padded(v, channels, name, default):
    """v (1 or C values, or None: `default`) as float32 padded with zeros to whole PADs."""
    v = np.asarray(default if v is None else v, np.float32).reshape(-1)
    if v.size not in (1, channels):
        raise ValueError(f"{name} must have 1 or {channels} values, got {v.size}")
    out = np.zeros(-(-channels // PAD) * PAD, np.float32)
    out[:channels] = np.broadcast_to(v, channels)
    return out


def prepare_pointwise(channels, scale=None, shift=None, *, activation=None, alpha=None,
                      beta=None, clip_min=-math.inf, clip_max=math.inf, residual=None,
                      gated=False):  # fmt: skip
    """The plan of one fused elementwise node on tensors of `channels` channels. scale,
    shift: per-channel float32 vectors (1 or C values) or None; activation, alpha, beta,
    clip_min, clip_max: as kernels.simd.activation's encode takes them; residual: None,
    "before" or "after"."""
    channels = int(channels)
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {list(RESIDUALS)}, got {residual!r}")
    return PointwisePlan(
        channels, _padded(scale, channels, "scale", 1.0), _padded(shift, channels, "shift", 0.0),
        encode(activation, alpha, beta, clip_min, clip_max), RESIDUALS[residual],
        bool(gated),
    )  # fmt: skip


@numba.jit(**INLINE)
def _span(L, xf, yf, rf, q, n, s, t, residual, simple, lo, hi, kind, a, b):
    """y = epilogue(x s + t) on the n values from flat offset q, a vector at a time (the last
    n % W through a mask); s, t: the scales and shifts, vectors (a blocked pixel's channels) or
    numbers (one NCHW plane's)."""
    w = L.width
    end = q + u(n - n % w)
    while q < end:
        v = vfma(vload(L, xf, q), s, t)
        r = vload(L, rf, q) if residual else v
        vstore(yf, q, finish(v, r, residual, simple, lo, hi, kind, a, b))
        q += u(w)
    if n % w:
        m = tail_mask(L, n % w)
        v = vfma(vload_masked(L, xf, q, m), s, t)
        r = vload_masked(L, rf, q, m) if residual else v
        vstore_masked(yf, q, finish(v, r, residual, simple, lo, hi, kind, a, b), m)


@numba.jit(**PARALLEL)
def _pointwise(L, xf, yf, rf, sc, s_stride, sh, n_len, c_len, p_len, per, residual, kind, a, b):
    """y = epilogue(x sc + sh) over every (image, channel block) of a flat x: [N, C/per, P,
    per] (blocked: per = L.width, a pixel's W channels side by side, one vector; NCHW: per =
    1, a plane of P pixels in vectors). Image n's channel scales start at sc[n s_stride] (0:
    shared; C: a gated scale per image). The activation is (kind, a, b)."""
    simple = clips(kind)
    lo, hi = clip_bounds(kind, a, b)
    cb_len = c_len // per
    for item in numba.prange(n_len * cb_len):
        n, cb = item // cb_len, item % cb_len
        c0 = u(cb * per)
        s0 = u(n * s_stride) + c0
        q = u(item * p_len * per)
        if per == 1:
            _span(L, xf, yf, rf, q, p_len, sc[s0], sh[c0], residual, simple, lo, hi, kind, a, b)
        else:
            s, t = vload(L, sc, s0), vload(L, sh, c0)
            _span(L, xf, yf, rf, q, p_len * per, s, t, residual, simple, lo, hi, kind, a, b)


def _run(x, plan: PointwisePlan, residual, gate, out, block: int):
    """Validate, allocate and run one layout's kernel; x is [N, CB, ..., block] (blocked) or
    [N, C, ...] (block 0)."""
    want = -(-plan.channels // block) if block else plan.channels
    if x.shape[1] != want:
        raise ValueError(f"x has {x.shape[1]} channel {'blocks' if block else 'planes'}, "
                         f"the plan is for {plan.channels} channels")  # fmt: skip
    x = np.ascontiguousarray(x)
    if out is None:
        out = np.empty_like(x)
    elif out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {x.shape}")
    per = block or 1  # channels side by side in a pixel: a block, or 1 (NCHW planes)
    n = x.shape[0]

    res = _NONE
    if plan.residual:
        if not isinstance(residual, np.ndarray) or residual.shape != x.shape:
            raise ValueError(f"the residual must be an array of shape {x.shape}")
        res = np.ascontiguousarray(residual, dtype=np.float32).reshape(-1)
    c_len = want * per
    sc, s_stride = plan.scale, 0
    if plan.gated:  # the per-image channel scale: scale times gate (zero past C)
        g = np.asarray(gate, np.float32)
        if g.size != n * plan.channels:
            raise ValueError(f"the gate must be [{n}, {plan.channels}], got {g.shape}")
        sc = np.zeros((n, c_len), np.float32)
        sc[:, : plan.channels] = plan.scale[: plan.channels] * g.reshape(n, plan.channels)
        sc, s_stride = sc.reshape(-1), c_len
    if x.size:
        _pointwise(lanes(block or None), x.reshape(-1), out.reshape(-1), res, sc, s_stride,
                   plan.shift, n, c_len, x.size // (n * c_len), per, plan.residual,
                   *plan.act)  # fmt: skip
    return out


def pointwise_blocked(xb, plan: PointwisePlan, residual=None, gate=None, out=None):
    """The op on a blocked float32 x [N, CB, H, W, b] (b = 8 or 16); returns the blocked
    result. residual: blocked, x's shape, when the plan adds one; gate: [N, C] when the plan
    is gated."""
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    if xb.shape[-1] not in WIDTHS:
        raise ValueError(f"x has blocks of {xb.shape[-1]} channels, the kernel reads blocks of "
                         f"a vector's width ({', '.join(map(str, WIDTHS))})")  # fmt: skip
    return _run(xb, plan, residual, gate, out, xb.shape[-1])


def pointwise(x, plan: PointwisePlan, residual=None, gate=None, out=None):
    """The op on a float32 x [N, C, ...] (NCHW, or [N, C, L]); returns the same layout.
    out may be x itself (in place)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim < 2:
        raise ValueError(f"x must be a float32 [N, C, ...] array, got {getattr(x, 'shape', x)!r}")
    return _run(x, plan, residual, gate, out, 0)
