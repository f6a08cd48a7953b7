"""The activation table every kernel applies: a kind and two float32 parameters (a, b), and
one function, activate(kind, a, b, v), on a vector of kernels.simd or on a float32 scalar.

    kind          y                                      a, b (defaults)
    identity      v
    relu          max(v, 0)
    leaky_relu    v if v >= 0 else a v                   alpha (0.01)
    clip          min(max(v, a), b)                      min, max (-inf, inf); relu6 is (0, 6)
    sigmoid       1 / (1 + e^-v)
    tanh          tanh(v)
    hard_sigmoid  max(0, min(1, a v + b))                alpha, beta (0.2, 0.5)
    hard_swish    v max(0, min(1, v / 6 + 1/2))
    silu          v sigmoid(v), as v / (1 + e^-v)        (swish)
    gelu          v (1 + erf(v / sqrt 2)) / 2
    gelu_tanh     v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))) / 2
    elu           v if v >= 0 else a (e^v - 1)           alpha (1)
    selu          b v if v > 0 else b a (e^v - 1)        alpha, gamma (ONNX's)
    softplus      log(1 + e^v)
    softsign      v / (1 + |v|)

The formulas are onnxruntime's, and so is NaN: a NaN in gives NaN out (the bounds are
compares a NaN fails), and inf goes where the formula takes it (silu(-inf) = -inf * 0 = NaN,
as onnxruntime's Mul(x, Sigmoid(x))). `kind` is a runtime value, loop-invariant in a kernel:
its branch is predicted. encode() turns what fusion_patterns.activation reads from a graph into the
triple (Python side, checked); the kernels only take triples.

Three kinds, CLIPPING (identity, relu, clip), are each a clip: activate(kind, a, b, v) is
clip(v, *clip_bounds(kind, a, b)). A kernel whose epilogue is mostly one of them (a CNN's)
writes that clip inline and calls activate for the others: activate is one compiled function
per type, a call (compiled once, not per call site), best kept out of a register-tiled loop.

    >>> kind, a, b = encode("leaky_relu", alpha=0.1)
    >>> activate(kind, a, b, v)          # in a kernel, v a vector or a float32
"""

import math

import numba
import numpy as np

from ..config import INLINE, INLINE_FIT, JIT_FIT
from ._ops import _lanewise, vfma, vmax, vselect
from .approx import erf, exp, log1p01, sigmoid, tanh

__all__ = ["CLIPPING", "KINDS", "activate", "clip", "clip_bounds", "clips", "encode"]

KINDS = ("identity", "relu", "leaky_relu", "clip", "sigmoid", "tanh", "hard_sigmoid", "hard_swish",
         "silu", "gelu", "gelu_tanh", "elu", "selu", "softplus", "softsign")  # fmt: skip
(IDENTITY, RELU, LEAKY_RELU, CLIP, SIGMOID, TANH, HARD_SIGMOID, HARD_SWISH, SILU, GELU, GELU_TANH,
 ELU, SELU, SOFTPLUS, SOFTSIGN) = range(len(KINDS))  # fmt: skip
CLIPPING = (IDENTITY, RELU, CLIP)
DEFAULTS = {
    "leaky_relu": (0.01, 0.0),
    "clip": (-math.inf, math.inf),
    "hard_sigmoid": (0.2, 0.5),
    "elu": (1.0, 0.0),
    "selu": (1.67326319217681884765625, 1.05070102214813232421875),
}

f32 = np.float32
ZERO, HALF, ONE = f32(0.0), f32(0.5), f32(1.0)
SIXTH, INV_SQRT2 = f32(1 / 6), f32(1 / math.sqrt(2))
GELU_C, GELU_CUBIC = f32(math.sqrt(2 / math.pi)), f32(0.044715)
INF = f32(math.inf)


def _clip(builder, v, lo, hi):
    below = builder.select(builder.fcmp_ordered("<", v, lo), lo, v)
    return builder.select(builder.fcmp_ordered(">", v, hi), hi, below)


# An intrinsic, not an inlined jitted function: a CNN kernel's tile store writes one clip per
# accumulator, and Numba inlines a jitted function by copying and typing its IR at every call
# site, which was most of the direct conv's cold compile (bench/NOTES.md); an intrinsic is
# typed once per signature and emitted straight into the caller.
clip = _lanewise("clip", 3, _clip, """min(max(v, lo), hi), lo and hi float32, v a vector or a
    float32. Compares, not min/max: a NaN fails both and passes through, as in onnxruntime's
    Clip.""")  # fmt: skip


@numba.jit(**INLINE)
def clips(kind):
    """Whether `kind` is one of CLIPPING."""
    return kind in CLIPPING


@numba.jit(**INLINE)
def clip_bounds(kind, a, b):
    """(lo, hi), float32: the clip that `kind` is when clips(kind) (identity -inf, inf; relu
    0, inf; clip a, b); -inf, inf for another kind (called from Python: two floats).

    >>> lo, hi = clip_bounds(kind, a, b)      # in a kernel; relu: 0, inf
    """
    lo = f32(a) if kind == CLIP else (ZERO if kind == RELU else -INF)
    return lo, f32(b) if kind == CLIP else INF


@numba.jit(**INLINE_FIT)
def gelu(v):
    """x (1 + erf(x / sqrt 2)) / 2, inlined where a kernel calls it (a hot loop's fixed kind)."""
    return HALF * v * (ONE + erf(v * INV_SQRT2))


@numba.jit(**INLINE_FIT)
def gelu_tanh(v):
    """x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2, inlined like gelu."""
    return HALF * v * (ONE + tanh(GELU_C * vfma(GELU_CUBIC * v, v * v, v)))


@numba.jit(**INLINE_FIT)
def silu(v):
    """x sigmoid(x) as x / (1 + e^-x), inlined like gelu: no |x|, compare or select around the
    exp as sigmoid needs, 5.0 against 5.8 ns a 16-lane vector on Zen 4 (bench/NOTES.md), and
    2.3 ulp against 4.0 where the result is at least 3e-37 in magnitude. Below -88.7, e^-x is
    inf and the result -0 where x e^x is a float under 3e-37; -inf gives NaN, as x sigmoid(x)
    does."""
    return v / (ONE + exp(-v))


@numba.jit(**JIT_FIT)
def activate(kind, a, b, v):
    """The activation `kind` with parameters a, b (float32) of v (a vector or a float32)."""
    a, b = f32(a), f32(b)
    if kind == IDENTITY:
        return v
    if kind == RELU:
        return vselect(v < ZERO, ZERO, v)
    if kind == LEAKY_RELU:
        return vselect(v < ZERO, a * v, v)
    if kind == CLIP:
        return clip(v, a, b)
    if kind == SIGMOID:
        return sigmoid(v)
    if kind == TANH:
        return tanh(v)
    if kind == HARD_SIGMOID:
        t = vfma(a, v, b)
        return vselect(t < ZERO, ZERO, vselect(t > ONE, ONE, t))
    if kind == HARD_SWISH:
        t = vfma(SIXTH, v, HALF)
        return v * vselect(t < ZERO, ZERO, vselect(t > ONE, ONE, t))
    if kind == SILU:
        return silu(v)
    if kind == GELU:
        return gelu(v)
    if kind == GELU_TANH:
        return gelu_tanh(v)
    if kind == ELU:
        return vselect(v < ZERO, a * (exp(v) - ONE), v)
    if kind == SELU:
        return b * vselect(v > ZERO, v, a * exp(v) - a)
    if kind == SOFTPLUS:
        return vmax(v, ZERO) + log1p01(exp(-abs(v)))
    return v / (ONE + abs(v))  # SOFTSIGN


def encode(activation=None, alpha=None, beta=None, clip_min=-math.inf, clip_max=math.inf):
    """(kind, a, b) as the kernels take them, from an activation's name and parameters (the
    keywords fusion_patterns.activation.activation_attributes gives). alpha, beta: a and b
    (None: the defaults above); the clip's bounds are clip_min, clip_max. A bound on identity or
    relu makes a clip ("relu6" is a name for clip 0, 6); one on another kind has no entry.

    >>> encode("clip", clip_min=0.0, clip_max=6.0)
    (3, np.float32(0.0), np.float32(6.0))
    """
    name = "identity" if activation is None else activation
    lo, hi = float(clip_min), float(clip_max)
    if name == "relu6":
        name, lo, hi = "clip", max(lo, 0.0), min(hi, 6.0)
    if name not in KINDS:
        raise ValueError(f"activation must be one of {', '.join(KINDS)} or relu6, got {name!r}")
    bounded = (lo, hi) != (-math.inf, math.inf)
    if bounded and name in ("identity", "relu"):
        name, lo = "clip", max(lo, 0.0) if name == "relu" else lo
    elif bounded and name != "clip":
        raise ValueError(f"{name} takes no clip bounds, got [{lo}, {hi}]")
    a, b = DEFAULTS.get(name, (0.0, 0.0))
    if name == "clip":
        a, b = lo, hi
        if not a <= b:
            raise ValueError(f"clip_min must be <= clip_max, got {a} > {b}")
    a = a if alpha is None or name == "clip" else float(alpha)
    b = b if beta is None or name == "clip" else float(beta)
    if math.isnan(a) or math.isnan(b):
        raise ValueError(f"{name}'s parameters must be numbers, got {a}, {b}")
    return KINDS.index(name), f32(a), f32(b)
