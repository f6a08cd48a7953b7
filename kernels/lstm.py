"""LSTM cell and sequence kernels, float32, gates in the canonical order i, f, g, o.

    G_t = x_t Wx + h_{t-1} Wh + b          [B, 4H]
    c_t = sig(G_f) * c_{t-1} + sig(G_i) * tanh(G_g),   h_t = sig(G_o) * tanh(c_t)

Layout: the hidden units are cut into blocks of U = 8; a block's weights are packed as
[K, 4, U] (its 8 units of all four gates side by side, 32 floats per k), so one block's tile of
pre-activations is 4 ymm registers per batch row, and the cell update for those 8 units needs
nothing from other blocks. Threads own contiguous runs of blocks: in the recurrence each thread
reads only its share of Wh, which stays in its core's L2 from step to step (H = 256: 512 KB per
thread of 1 MB). One parallel region per step is the only synchronisation (step t + 1 reads all
of h_t). The input projection for all T steps runs first, as one blocked GEMM over T * B rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from ._gemm import _fma8, _load8, _store8
from .config import INLINE_GEMM, JIT, JIT_GEMM, PARALLEL, slp_vectorize

U = 8  # hidden units per block
W = 4 * U  # packed floats per k: 4 gates x U units


@dataclass(frozen=True)
class LSTMPlan:
    """Weights packed once per fused node (see prepare_lstm)."""

    wx: np.ndarray  # [blocks, I * W] packed input weights
    wh: np.ndarray  # [blocks, H * W] packed recurrent weights
    bias: np.ndarray  # [blocks, W]
    input_size: int
    hidden: int


def _pack(w: np.ndarray, hidden: int) -> np.ndarray:
    """[K, 4H] (gate blocks i, f, g, o) -> [blocks, K * 4 * U], zero columns past H."""
    k = w.shape[0]
    blocks = -(-hidden // U)
    padded = np.zeros((k, 4, blocks * U), np.float32)
    padded[:, :, :hidden] = w.reshape(k, 4, hidden)
    packed = padded.reshape(k, 4, blocks, U).transpose(2, 0, 1, 3)
    return np.ascontiguousarray(packed).reshape(blocks, k * W)


def prepare_lstm(wx: np.ndarray, wh: np.ndarray, bias: np.ndarray | None = None) -> LSTMPlan:
    """Pack x Wx + h Wh + bias, with wx [I, 4H], wh [H, 4H], bias [4H], gates i, f, g, o.

    >>> plan = prepare_lstm(np.zeros((3, 8), np.float32), np.zeros((2, 8), np.float32))
    """
    hidden = wh.shape[0]
    if wh.shape != (hidden, 4 * hidden) or wx.ndim != 2 or wx.shape[1] != 4 * hidden:
        raise ValueError(f"weights [I, 4H] and [H, 4H] expected, got {wx.shape} and {wh.shape}")
    bias = np.zeros(4 * hidden, np.float32) if bias is None else bias.reshape(4 * hidden)
    wx32, wh32, b32 = (np.asarray(a, np.float32) for a in (wx, wh, bias[None]))
    return LSTMPlan(
        _pack(wx32, hidden), _pack(wh32, hidden), _pack(b32, hidden), wx.shape[0], hidden
    )


@numba.jit(**JIT_GEMM)
def _tile(a, r0, r1, w, k_len, tile):
    """tile[0] = a[r0] @ Wblock, tile[1] = a[r1] @ Wblock: 2 rows x 32 columns in registers."""
    z = np.float32(0.0)
    p0 = p1 = p2 = p3 = q0 = q1 = q2 = q3 = (z, z, z, z, z, z, z, z)
    for k in range(k_len):
        o = W * k
        w0, w1, w2, w3 = _load8(w, o), _load8(w, o + 8), _load8(w, o + 16), _load8(w, o + 24)
        s, t = a[r0, k], a[r1, k]
        p0, p1, p2, p3 = _fma8(p0, s, w0), _fma8(p1, s, w1), _fma8(p2, s, w2), _fma8(p3, s, w3)
        q0, q1, q2, q3 = _fma8(q0, t, w0), _fma8(q1, t, w1), _fma8(q2, t, w2), _fma8(q3, t, w3)
    _store8(tile, 0, 0, p0)
    _store8(tile, 0, 8, p1)
    _store8(tile, 0, 16, p2)
    _store8(tile, 0, 24, p3)
    _store8(tile, 1, 0, q0)
    _store8(tile, 1, 8, q1)
    _store8(tile, 1, 16, q2)
    _store8(tile, 1, 24, q3)


# tanh(x) ~ x P(x^2) / Q(x^2) on [-7.9, 7.9] (Eigen's float rational fit, abs error < 3e-7;
# beyond the clamp tanh is 1 in float32). Unlike libm's tanhf it has no call and no branch,
# so the gate loops vectorize; sigmoid(x) = (1 + tanh(x / 2)) / 2.
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
          5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
          4.89352455891786e-03)  # fmt: skip
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
CLAMP = np.float32(7.90531110763549805)


@numba.jit(**JIT)
def _tanh(x):
    if x > CLAMP:  # compares, not min/max: a NaN stays NaN
        x = CLAMP
    if x < -CLAMP:
        x = -CLAMP
    x2 = x * x
    p = np.float32(TANH_P[0])
    for a in TANH_P[1:]:
        p = p * x2 + np.float32(a)
    q = np.float32(TANH_Q[0])
    for b in TANH_Q[1:]:
        q = q * x2 + np.float32(b)
    return x * p / q


@numba.jit(**JIT)
def _sigmoid(x):
    half = np.float32(0.5)
    return half + half * _tanh(half * x)


@numba.jit(**JIT_GEMM)
def _tile1(a, r, w, k_len, tile):
    """tile[0] = a[r] @ Wblock for one row (batch 1: memory-bound, two chains per column)."""
    z = np.float32(0.0)
    p0 = p1 = p2 = p3 = q0 = q1 = q2 = q3 = (z, z, z, z, z, z, z, z)
    for k in range(0, k_len - 1, 2):
        o = W * k
        s, t = a[r, k], a[r, k + 1]
        p0, p1 = _fma8(p0, s, _load8(w, o)), _fma8(p1, s, _load8(w, o + 8))
        p2, p3 = _fma8(p2, s, _load8(w, o + 16)), _fma8(p3, s, _load8(w, o + 24))
        q0, q1 = _fma8(q0, t, _load8(w, o + 32)), _fma8(q1, t, _load8(w, o + 40))
        q2, q3 = _fma8(q2, t, _load8(w, o + 48)), _fma8(q3, t, _load8(w, o + 56))
    if k_len % 2:
        o, s = W * (k_len - 1), a[r, k_len - 1]
        p0, p1 = _fma8(p0, s, _load8(w, o)), _fma8(p1, s, _load8(w, o + 8))
        p2, p3 = _fma8(p2, s, _load8(w, o + 16)), _fma8(p3, s, _load8(w, o + 24))
    _store8(tile, 0, 0, _add8(p0, q0))
    _store8(tile, 0, 8, _add8(p1, q1))
    _store8(tile, 0, 16, _add8(p2, q2))
    _store8(tile, 0, 24, _add8(p3, q3))


@numba.jit(**INLINE_GEMM)
def _add8(a, b):
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3],
            a[4] + b[4], a[5] + b[5], a[6] + b[6], a[7] + b[7])  # fmt: skip


@numba.jit(**JIT)
def _rows(a, r, r1, w, tile):
    """Rows r .. r1 (one or two) of a @ Wblock into tile."""
    if r1 > r:
        _tile(a, r, r1, w, a.shape[1], tile)
    else:
        _tile1(a, r, w, a.shape[1], tile)


@numba.jit(**JIT)
def _project_block(x, w, bias, gx, tile):
    """gx[r] = x[r] @ Wx_block + bias_block for every row r (T * B rows)."""
    rows = x.shape[0]
    for r in range(0, rows, 2):
        r1 = min(r + 1, rows - 1)
        _rows(x, r, r1, w, tile)
        for s in range(r1 - r + 1):
            for q in range(W):
                gx[r + s, q] = tile[s, q] + bias[q]


@numba.jit(**JIT)
def _update(tile, s, g, c, h_out, c_out, row, j0, units):
    """c' and h' of units j0 .. j0 + units from the pre-activations tile[s] + g."""
    for q in range(W):  # fixed trip counts: these loops become vector code
        tile[s, q] += g[q]
    for u in range(U):
        tile[s, u] = _sigmoid(tile[s, u])
        tile[s, U + u] = _sigmoid(tile[s, U + u])
        tile[s, 2 * U + u] = _tanh(tile[s, 2 * U + u])
        tile[s, 3 * U + u] = _sigmoid(tile[s, 3 * U + u])
    if units == U:
        for u in range(U):
            cn = tile[s, U + u] * c[row, j0 + u] + tile[s, u] * tile[s, 2 * U + u]
            c_out[row, j0 + u] = cn
            h_out[row, j0 + u] = tile[s, 3 * U + u] * _tanh(cn)
    else:  # the last, partial block
        for u in range(units):
            cn = tile[s, U + u] * c[row, j0 + u] + tile[s, u] * tile[s, 2 * U + u]
            c_out[row, j0 + u] = cn
            h_out[row, j0 + u] = tile[s, 3 * U + u] * _tanh(cn)


@numba.jit(**JIT)
def _cell_block(gx, h, c, w, hidden, j0, h_out, c_out, tile):
    """Units j0 .. j0 + U of one step for every batch row: pre-activations, then c' and h'."""
    batch = h.shape[0]
    units = min(U, hidden - j0)
    for b in range(0, batch, 2):
        b1 = min(b + 1, batch - 1)
        _rows(h, b, b1, w, tile)
        for s in range(b1 - b + 1):
            _update(tile, s, gx[b + s], c, h_out, c_out, b + s, j0, units)


@numba.jit(**PARALLEL)
def _sequence(x, h0, c0, wx, wh, bias, hs, cs, gx, parts):
    """hs[t], cs[t] for t < T; x is [T * B, I]. Parts of blocks are owned by threads."""
    blocks, steps, batch, hidden = wx.shape[0], hs.shape[0], h0.shape[0], h0.shape[1]
    for p in prange(parts):  # the input projection of every step, each part its own blocks
        tile = np.empty((2, W), np.float32)
        for k in range(p * blocks // parts, (p + 1) * blocks // parts):
            _project_block(x, wx[k], bias[k], gx[k], tile)
    for t in range(steps):
        h, c = (h0, c0) if t == 0 else (hs[t - 1], cs[t - 1])
        for p in prange(parts):  # one region per step: step t + 1 needs all of h_t
            tile = np.empty((2, W), np.float32)
            for k in range(p * blocks // parts, (p + 1) * blocks // parts):
                g = gx[k, t * batch : (t + 1) * batch]
                _cell_block(g, h, c, wh[k], hidden, k * U, hs[t], cs[t], tile)


_compiled = False


def lstm_sequence(x: np.ndarray, h0: np.ndarray, c0: np.ndarray, plan: LSTMPlan):
    """All steps of one LSTM layer: x [T, B, I], h0, c0 [B, H] -> (h [T, B, H], c [T, B, H]).

    >>> hs, cs = lstm_sequence(x, h0, c0, prepare_lstm(wx, wh, bias))
    >>> hs[-1], cs[-1]          # the final state; hs is ONNX LSTM's Y without the direction axis
    """
    global _compiled
    x, h0, c0 = (np.ascontiguousarray(a, np.float32) for a in (x, h0, c0))
    if x.ndim != 3 or x.shape[2] != plan.input_size:
        raise ValueError(f"x must be [T, B, {plan.input_size}], got {list(x.shape)}")
    steps, batch = x.shape[:2]
    for name, a in (("h0", h0), ("c0", c0)):
        if a.shape != (batch, plan.hidden):
            raise ValueError(f"{name} must be [{batch}, {plan.hidden}], got {list(a.shape)}")
    hs = np.empty((steps, batch, plan.hidden), np.float32)
    cs = np.empty_like(hs)
    if steps == 0:
        return hs, cs
    gx = np.empty((plan.wx.shape[0], steps * batch, W), np.float32)
    parts = min(numba.get_num_threads(), plan.wx.shape[0])  # a part per thread
    args = (x.reshape(steps * batch, -1), h0, c0, plan.wx, plan.wh, plan.bias, hs, cs, gx, parts)
    if not _compiled:
        with slp_vectorize():  # the register tile needs LLVM's SLP vectorizer (see config)
            _sequence(*args)
        _compiled = True
    else:
        _sequence(*args)
    return hs, cs


def lstm_cell(x: np.ndarray, h: np.ndarray, c: np.ndarray, plan: LSTMPlan):
    """One step: x [B, I], h, c [B, H] -> (h', c')."""
    hs, cs = lstm_sequence(x[None], h, c, plan)
    return hs[0], cs[0]
