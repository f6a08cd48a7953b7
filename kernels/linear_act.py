"""Linear layer with its epilogue: y = act(x W + b) + r   (x [M, K], W [K, N], b [N], r [M, N])
and the gated feed-forward block: y = (act(x Wg + bg) * (x Wu + bu)) Wd + bd + r  (gated_mlp)

act: any activation of kernels/simd/activation.py, as its (kind, a, b) (encode: identity for
the projections, gelu or gelu_tanh after a transformer's first feed-forward product). The
residual r is optional (a transformer's skip connection).

The product is one BLAS call (numpy's matmul; SciPy, which Numba's np.dot needs, is not a
dependency); the epilogue is one pass over the rows of the product on vectors of the CPU's
width (the last columns of a row through a mask), the activation the SIMD layer's. The pass
runs in the calling thread unless the activation is one over more than SERIAL_GELU values: a
parallel region started right after OpenBLAS's call waits for cores its idle workers still
spin on, which cost more than a bias and residual add (bench/NOTES.md, transformers).
"""

import numba
import numpy as np

from .config import JIT, PARALLEL
from .epilogue import AFTER, BEFORE, NO_RESIDUAL, finish
from .simd import (
    activate,
    lanes,
    sigmoid,
    tail_mask,
    vload,
    vload_masked,
    vstore,
    vstore_masked,
)
from .simd.activation import (
    GELU,
    GELU_TANH,
    IDENTITY,
    KINDS,
    SILU,
    clip_bounds,
    clips,
    encode,
    gelu,
    gelu_tanh,
)

__all__ = ["SERIAL_GELU", "bias_act", "gated_mlp", "linear_act"]


@numba.jit(**JIT)
def bias_act_row(L, y, i, b, r, residual, kind, act_a, act_b):
    """y[i] = act(y[i] + b) (+ r[i]): one row, in place, a vector at a time. The GELU forms
    (every transformer MLP) get loops of their own with the fit inlined: the table's activate
    is a call that tests the kind once per vector, which cost as much as the erf."""
    n, w = y.shape[1], L.width
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)
    o = i * n
    j = 0
    if kind == GELU and residual != BEFORE:  # the residual, if any, after the activation
        while j + w <= n:
            v = gelu(vload(L, y, o + j) + vload(L, b, j))
            vstore(y, o + j, v + vload(L, r, o + j) if residual else v)
            j += w
    elif kind == GELU_TANH and residual != BEFORE:
        while j + w <= n:
            v = gelu_tanh(vload(L, y, o + j) + vload(L, b, j))
            vstore(y, o + j, v + vload(L, r, o + j) if residual else v)
            j += w
    while j + w <= n:
        v = vload(L, y, o + j) + vload(L, b, j)
        x = vload(L, r, o + j) if residual else v
        vstore(y, o + j, finish(v, x, residual, simple, lo, hi, kind, act_a, act_b))
        j += w
    if j < n:
        m = tail_mask(L, n - j)
        v = vload_masked(L, y, o + j, m) + vload_masked(L, b, j, m)
        x = vload_masked(L, r, o + j, m) if residual else v
        vstore_masked(y, o + j, finish(v, x, residual, simple, lo, hi, kind, act_a, act_b), m)


@numba.jit(**PARALLEL)
def _bias_act(L, y, b, r, residual, kind, act_a, act_b):
    for i in numba.prange(y.shape[0]):
        bias_act_row(L, y, i, b, r, residual, kind, act_a, act_b)


@numba.jit(**JIT)
def _bias_act_serial(L, y, b, r, residual, kind, act_a, act_b):
    for i in range(y.shape[0]):
        bias_act_row(L, y, i, b, r, residual, kind, act_a, act_b)


SERIAL_GELU = 1 << 15  # values; an activation over more runs in parallel


_NO_RESIDUAL = np.zeros((1, 1), np.float32)
_IDENTITY = encode()


def bias_act(y, b, act=_IDENTITY, residual=None):
    """y = act(y + b) (+ residual) in place; y [M, N] float32 C-contiguous, b [N], act the
    activation's (kind, a, b) (kernels.simd.activation.encode), residual [M, N] or None.
    Returns y.

    >>> bias_act(np.zeros((2, 3), np.float32), np.ones(3, np.float32), encode("gelu"))
    """
    if y.dtype != np.float32 or y.ndim != 2 or not y.flags.c_contiguous:
        raise ValueError(f"y must be a C-contiguous 2-D float32 array, got {y.dtype} {y.shape}")
    if b.shape != (y.shape[1],):
        raise ValueError(f"bias of shape {b.shape} does not match {y.shape[1]} columns")
    kind, a, c = act
    if not 0 <= kind < len(KINDS):
        raise ValueError(f"unknown activation kind {kind} (kernels.simd.activation.encode)")
    r = _NO_RESIDUAL
    if residual is not None:
        r = np.ascontiguousarray(np.broadcast_to(residual, y.shape), dtype=np.float32)
    parallel = kind != IDENTITY and y.size > SERIAL_GELU
    run = _bias_act if parallel else _bias_act_serial
    where = NO_RESIDUAL if residual is None else AFTER
    b = np.ascontiguousarray(b, np.float32)
    run(lanes(), y, b, r, where, int(kind), np.float32(a), np.float32(c))
    return y


def linear_act(x, w, b, act=_IDENTITY, residual=None):
    """act(x W + b) (+ residual) for x [M, K] float32, w [K, N], b [N], act a (kind, a, b):
    [M, N] float32.

    >>> x, w = np.ones((4, 8), np.float32), np.ones((8, 2), np.float32)
    >>> linear_act(x, w, np.zeros(2, np.float32), encode("gelu_tanh"))
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"cannot multiply x {x.shape} by W {w.shape}")
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as in onnxruntime
        y = np.matmul(x, w)  # BLAS
    return bias_act(y, b, act, residual)


@numba.jit(**JIT)
def gate_row(L, gu, i, b, h, kind, act_a, act_b):
    """h[i, j] = act(gu[i, j] + b[j]) * (gu[i, n + j] + b[n + j]) for j < n = h.shape[1]: the
    gate (first n columns of the product) times the up product (the next n), a vector at a
    time. SiLU, the common gate (Llama), has its loop with the sigmoid inlined."""
    n, w = h.shape[1], L.width
    g0, h0 = i * 2 * n, i * n
    j = 0
    if kind == SILU:
        while j + w <= n:
            g = vload(L, gu, g0 + j) + vload(L, b, j)
            u = vload(L, gu, g0 + n + j) + vload(L, b, n + j)
            vstore(h, h0 + j, g * sigmoid(g) * u)
            j += w
    while j + w <= n:
        g = activate(kind, act_a, act_b, vload(L, gu, g0 + j) + vload(L, b, j))
        vstore(h, h0 + j, g * (vload(L, gu, g0 + n + j) + vload(L, b, n + j)))
        j += w
    if j < n:
        m = tail_mask(L, n - j)
        g = activate(kind, act_a, act_b, vload_masked(L, gu, g0 + j, m) + vload_masked(L, b, j, m))
        u = vload_masked(L, gu, g0 + n + j, m) + vload_masked(L, b, n + j, m)
        vstore_masked(h, h0 + j, g * u, m)


@numba.jit(**PARALLEL)
def _gate(L, gu, b, h, kind, act_a, act_b):
    for i in numba.prange(h.shape[0]):
        gate_row(L, gu, i, b, h, kind, act_a, act_b)


def gated_mlp(x, w_gate_up, b_gate_up, act, w_down, b_down, residual=None):
    """(act(x Wg + bg) * (x Wu + bu)) Wd + bd (+ residual) for x [M, E] float32, w_gate_up
    [E, 2 I] (Wg's columns, then Wu's), b_gate_up [2 I], act a (kind, a, b), w_down [I, N],
    b_down [N], residual [M, N] or None: [M, N] float32. One product for the gate and the up
    projection, the gating in one parallel pass, then the down product with its epilogue.

    >>> y = gated_mlp(x, np.hstack([wg, wu]), np.zeros(2 * i, np.float32), encode("silu"), wd, bd)
    """
    if x.ndim != 2 or w_gate_up.ndim != 2 or x.shape[1] != w_gate_up.shape[0]:
        raise ValueError(
            f"cannot multiply x {x.shape} by the gate and up weights {w_gate_up.shape}"
        )
    width = w_gate_up.shape[1] // 2
    if w_gate_up.shape[1] % 2 or w_down.shape[0] != width or b_gate_up.shape != (2 * width,):
        raise ValueError(f"gate and up weights {w_gate_up.shape} (bias {b_gate_up.shape}) do not "
                         f"feed the down weights {w_down.shape}")  # fmt: skip
    kind, a, c = act
    if not 0 <= kind < len(KINDS):
        raise ValueError(f"unknown activation kind {kind} (kernels.simd.activation.encode)")
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as in onnxruntime
        gu = np.matmul(x, w_gate_up)  # BLAS
    h = np.empty((x.shape[0], width), np.float32)
    b = np.ascontiguousarray(b_gate_up, np.float32)
    if h.size:
        _gate(lanes(), gu, b, h, int(kind), np.float32(a), np.float32(c))
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.matmul(h, w_down)
    return bias_act(y, b_down, residual=residual)
