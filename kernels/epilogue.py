"""What a fused kernel applies to each output value before it is stored: bias, an optional
residual, an activation, a clip. The catalog's conv epilogues in one place, so every blocked
kernel (direct conv, depthwise, pools, adds) applies them the same way.

    v = acc + bias
    v = v + res           if residual == BEFORE   (ResNet: Add, then Relu)
    v = act(v)
    v = min(max(v, lo), hi)                       (Relu is lo = 0; Clip any bounds)
    v = v + res           if residual == AFTER    (Add after the activation)

act, by code: IDENTITY; LEAKY_RELU (v if v >= 0 else alpha v); SIGMOID 1 / (1 + e^-v);
SILU v sigmoid(v); HARD_SIGMOID max(0, min(1, alpha v + beta)); HARD_SWISH
v max(0, min(1, v / 6 + 1/2)); TANH; GELU v (1 + erf(v / sqrt 2)) / 2.
The clip is written with compares, not min/max, so a NaN passes through as in onnxruntime.

The helpers work on one value (act1) or on an 8-tuple (act8: one vector register once the SLP
vectorizer has packed it); `code`, `alpha`, `beta` are loop-invariant, so the branch is
predicted and costs next to nothing beside the memory traffic of the store.
"""

import math

import numba
import numpy as np

from .config import INLINE_GEMM

IDENTITY, LEAKY_RELU, SIGMOID, SILU, HARD_SIGMOID, HARD_SWISH, TANH, GELU = range(8)
ACTIVATIONS = {
    "identity": IDENTITY,
    "leaky_relu": LEAKY_RELU,
    "sigmoid": SIGMOID,
    "silu": SILU,
    "hard_sigmoid": HARD_SIGMOID,
    "hard_swish": HARD_SWISH,
    "tanh": TANH,
    "gelu": GELU,
}
NO_RESIDUAL, BEFORE, AFTER = 0, 1, 2
RESIDUALS = {None: NO_RESIDUAL, "before": BEFORE, "after": AFTER}


@numba.jit(**INLINE_GEMM)
def act1(v, code, alpha, beta, lo, hi):
    """The activation, then the clip, of one float32 value."""
    f1 = np.float32(1.0)
    f0 = np.float32(0.0)
    if code == LEAKY_RELU:
        v = v if v >= f0 else alpha * v
    elif code == SIGMOID:
        v = f1 / (f1 + np.float32(math.exp(-v)))
    elif code == SILU:
        v = v / (f1 + np.float32(math.exp(-v)))
    elif code == HARD_SIGMOID:
        t = alpha * v + beta
        t = f0 if t < f0 else t
        v = f1 if t > f1 else t
    elif code == HARD_SWISH:
        t = v * np.float32(1.0 / 6.0) + np.float32(0.5)
        t = f0 if t < f0 else t
        v = v * (f1 if t > f1 else t)
    elif code == TANH:
        v = np.float32(math.tanh(v))
    elif code == GELU:
        v = np.float32(0.5) * v * (f1 + np.float32(math.erf(v * np.float32(0.7071067811865476))))
    v = lo if v < lo else v
    return hi if v > hi else v


@numba.jit(**INLINE_GEMM)
def finish1(v, b, res, residual, code, alpha, beta, lo, hi):
    """The whole epilogue of one value: v + b, the residual before or after, act, clip."""
    v = v + b
    if residual == BEFORE:
        v = v + res
    v = act1(v, code, alpha, beta, lo, hi)
    if residual == AFTER:
        v = v + res
    return v


@numba.jit(**INLINE_GEMM)
def finish8(r, b, res, residual, code, alpha, beta, lo, hi):
    """finish1 on each lane of the 8-tuples r (accumulators), b (bias), res (residual)."""
    return (
        finish1(r[0], b[0], res[0], residual, code, alpha, beta, lo, hi),
        finish1(r[1], b[1], res[1], residual, code, alpha, beta, lo, hi),
        finish1(r[2], b[2], res[2], residual, code, alpha, beta, lo, hi),
        finish1(r[3], b[3], res[3], residual, code, alpha, beta, lo, hi),
        finish1(r[4], b[4], res[4], residual, code, alpha, beta, lo, hi),
        finish1(r[5], b[5], res[5], residual, code, alpha, beta, lo, hi),
        finish1(r[6], b[6], res[6], residual, code, alpha, beta, lo, hi),
        finish1(r[7], b[7], res[7], residual, code, alpha, beta, lo, hi),
    )


def activation_params(activation=None, alpha=None, beta=None, clip_min=-math.inf,
                      clip_max=math.inf):  # fmt: skip
    """(code, alpha, beta, lo, hi) as the kernels take them, checked. activation: None or a
    name of ACTIVATIONS, or "relu" / "clip" (identity with the bounds)."""
    lo, hi = float(clip_min), float(clip_max)
    if activation == "relu":
        activation, lo, hi = None, max(lo, 0.0), hi
    elif activation == "clip":
        activation = None
    name = activation or "identity"
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)} or relu/clip, got {name!r}"
        )
    if not lo <= hi:
        raise ValueError(f"clip_min must be <= clip_max, got {lo} > {hi}")
    defaults = {LEAKY_RELU: (0.01, 0.0), HARD_SIGMOID: (0.2, 0.5)}
    code = ACTIVATIONS[name]
    a, b = defaults.get(code, (0.0, 0.0))
    a = a if alpha is None else float(alpha)
    b = b if beta is None else float(beta)
    f32 = np.float32
    return code, f32(a), f32(b), f32(lo), f32(hi)
