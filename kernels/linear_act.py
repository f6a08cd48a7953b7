"""Linear layer with its epilogue: y = act(x W + b) + r   (x [M, K], W [K, N], b [N], r [M, N])
and the gated feed-forward block: y = (act(x Wg + bg) * (x Wu + bu)) Wd + bd + r  (gated_mlp)

act: any activation of kernels/simd/activation.py, as its (kind, a, b) (encode: identity for
the projections, gelu or gelu_tanh after a transformer's first feed-forward product). The
residual r is optional (a transformer's skip connection).

Every product is kernels/dense_gemm.py's GEMM, its weights packed once in a plan
(prepare_dense, prepare_gated_mlp: at Session build), bias, activation and residual applied to
each tile as it is stored. The gated block's first product takes Wg's and Wu's columns side by
side (one GEMM, both biases in its epilogue); the gating h = act(g) * u is one parallel pass
on vectors of the CPU's width, then the down product with its bias and residual.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np

from .config import JIT, PARALLEL
from .dense_gemm import DensePlan, dense_gemm, prepare_dense
from .simd import activate, tail_mask, vload, vload_masked, vstore, vstore_masked
from .simd.activation import KINDS, SILU, encode, silu

__all__ = ["GatedMLPPlan", "gated_mlp", "linear_act", "prepare_gated_mlp"]


def linear_act(x, plan: DensePlan, residual=None, out=None):
    """act(x W + b) (+ residual) for x [M, K] float32 and plan = prepare_dense(W, b, act):
    [M, N] float32 (into `out` if given).

    >>> plan = prepare_dense(np.ones((8, 2), np.float32), np.zeros(2), encode("gelu_tanh"))
    >>> linear_act(np.ones((4, 8), np.float32), plan)
    """
    return dense_gemm(x, plan, residual, out)


@numba.jit(**JIT)
def gate_row(L, gu, i, h, kind, act_a, act_b):
    """h[i, j] = act(gu[i, j]) * gu[i, n + j] for j < n = h.shape[1]: the gate (first n
    columns of the biased product) times the up product (the next n), a vector at a time.
    SiLU, the common gate (Llama), has its loop with silu inlined; the table's activate
    (a call that tests the kind per vector) serves the rest."""
    n, w = h.shape[1], L.width
    g0, h0 = i * 2 * n, i * n
    j = 0
    if kind == SILU:
        while j + w <= n:
            g = vload(L, gu, g0 + j)
            vstore(h, h0 + j, silu(g) * vload(L, gu, g0 + n + j))
            j += w
    while j + w <= n:
        g = activate(kind, act_a, act_b, vload(L, gu, g0 + j))
        vstore(h, h0 + j, g * vload(L, gu, g0 + n + j))
        j += w
    if j < n:
        m = tail_mask(L, n - j)
        g = activate(kind, act_a, act_b, vload_masked(L, gu, g0 + j, m))
        vstore_masked(h, h0 + j, g * vload_masked(L, gu, g0 + n + j, m), m)


@numba.jit(**PARALLEL)
def _gate(L, gu, h, kind, act_a, act_b):
    for i in numba.prange(h.shape[0]):
        gate_row(L, gu, i, h, kind, act_a, act_b)


@dataclasses.dataclass(frozen=True)
class GatedMLPPlan:
    """The gated block's two products, packed (prepare_gated_mlp), and the gate's activation."""

    gate_up: DensePlan  # x [Wg | Wu] + [bg | bu], no activation
    down: DensePlan  # h Wd + bd
    act: tuple  # (kind, a, b) of the gate


def prepare_gated_mlp(w_gate_up, b_gate_up, act, w_down, b_down=None, width=None):
    """Pack the gated block once: w_gate_up [E, 2 I] (Wg's columns, then Wu's), b_gate_up
    [2 I], act the gate's (kind, a, b), w_down [I, N], b_down [N] (None: zeros); width as
    prepare_dense's.

    >>> plan = prepare_gated_mlp(np.hstack([wg, wu]), np.zeros(2 * i), encode("silu"), wd, bd)
    """
    w_gate_up = np.asarray(w_gate_up, np.float32)
    w_down = np.asarray(w_down, np.float32)
    if w_gate_up.ndim != 2 or w_down.ndim != 2:
        raise ValueError(f"weights must be 2-D, got {w_gate_up.shape} and {w_down.shape}")
    inner = w_gate_up.shape[1] // 2
    b_gate_up = np.asarray(b_gate_up, np.float32)
    if w_gate_up.shape[1] % 2 or w_down.shape[0] != inner or b_gate_up.shape != (2 * inner,):
        raise ValueError(f"gate and up weights {w_gate_up.shape} (bias {b_gate_up.shape}) do not "
                         f"feed the down weights {w_down.shape}")  # fmt: skip
    kind, a, c = act
    if not 0 <= kind < len(KINDS):
        raise ValueError(f"unknown activation kind {kind} (fusion_kernels.simd.activation.encode)")
    gate_up = prepare_dense(w_gate_up, b_gate_up, encode(), width)
    down = prepare_dense(w_down, b_down, encode(), width)
    return GatedMLPPlan(gate_up, down, (int(kind), np.float32(a), np.float32(c)))


def gated_mlp(x, plan: GatedMLPPlan, residual=None):
    """(act(x Wg + bg) * (x Wu + bu)) Wd + bd (+ residual) for x [M, E] float32 and a plan
    from prepare_gated_mlp, residual [M, N] or None: [M, N] float32.

    >>> y = gated_mlp(x, prepare_gated_mlp(np.hstack([wg, wu]), b, encode("silu"), wd, bd))
    """
    gu = dense_gemm(x, plan.gate_up)  # validates x
    h = np.empty((gu.shape[0], plan.down.k), np.float32)
    if h.size:
        kind, a, c = plan.act
        _gate(plan.down.lanes, gu, h, kind, a, c)
    return dense_gemm(h, plan.down, residual)
