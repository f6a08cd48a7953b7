"""GRU sequence kernels, float32, on the LSTM kernels' blocks (kernels/lstm.py).

    z, r = sig(x Wz + h Rz + bz), sig(x Wr + h Rr + br),   h' = (1 - z) n + z h
    reset after the product  (linear_before_reset = 1, PyTorch, Keras reset_after=True):
        n = tanh(x Wn + bxn + r (h Rn + bhn))
    reset before the product (linear_before_reset = 0, Keras reset_after=False, ONNX's default):
        n = tanh(x Wn + (r h) Rn + bxn + bhn)

The gates are packed as four blocks where the LSTM has i, f, g, o: z, r, n_x, n_h (x's weights
z, r, n, 0; h's z, r, 0, n). Reset after the product is then the LSTM kernel itself with the
GRU cell (_lstm_cell.gru_cell, step_cols; h kept where the LSTM keeps c), whose row-by-row
GEMV skips h's zero block (gru_panels, _lstm_cell.gemv_gru). Reset before it needs
r of every unit before any unit's n, so each step is two stages over the blocks (row by row,
every batch): A computes z and r of a block from h (a GEMV over its [H, 16] panel z | r) and r h
of its units; B computes n from r h of all units (a GEMV over Rn's [H, 8] panel) and h'. The
stages share the LSTM kernel's input projection, done flags and runs per thread (1 + 2 T
stages, one call). Both run on the SIMD layer's vectors at the plan's width, as _lstm_cell.gemv
and cell do.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
from numba import prange

from ._lstm_cell import BLOCK_COLS, PANEL, U, gemv_units, project
from ._lstm_sync import atomic_load, atomic_store
from .config import I64, JIT_GEMM, PARALLEL, TRUE, ZERO_I64
from .lstm import (
    DONE,
    SERIAL_MACS_PER_STEP,
    STARTED,
    LSTMPlan,
    _nth,
    _start_row,
    _workspace,
    lstm_sequence,
    prepare_lstm,
)  # fmt: skip
from .simd import (
    sigmoid,
    tail_mask,
    tanh,
    vfma,
    vload,
    vload_masked,
    vstore,
    vstore_masked,
    vzero,
)


def prepare_gru(wx, wh, bias_x=None, bias_h=None, linear_before_reset: int = 1, *,
                width=None) -> LSTMPlan:  # fmt: skip
    """Pack a GRU: wx [I, 3H], wh [H, 3H], biases [3H], gate order z, r, n; width as
    prepare_lstm's.

    >>> plan = prepare_gru(np.zeros((3, 6), np.float32), np.zeros((2, 6), np.float32))
    """
    size, hidden = wx.shape[0], wh.shape[0]
    if wh.shape != (hidden, 3 * hidden) or wx.ndim != 2 or wx.shape[1] != 3 * hidden:
        raise ValueError(f"weights [I, 3H] and [H, 3H] expected, got {wx.shape} and {wh.shape}")
    bx = np.zeros(3 * hidden, np.float32) if bias_x is None else bias_x.reshape(3 * hidden)
    bh = np.zeros(3 * hidden, np.float32) if bias_h is None else bias_h.reshape(3 * hidden)
    w4, r4 = np.zeros((size, 4 * hidden), np.float32), np.zeros((hidden, 4 * hidden), np.float32)
    w4[:, : 3 * hidden], r4[:, : 2 * hidden] = wx, wh[:, : 2 * hidden]
    r4[:, 3 * hidden :] = wh[:, 2 * hidden :]
    zr, bn, bhn = bx[: 2 * hidden] + bh[: 2 * hidden], bx[2 * hidden :], bh[2 * hidden :]
    before = not linear_before_reset  # both n biases outside the reset: on n_x's block
    b4 = np.concatenate([zr, bn + bhn if before else bn, 0 * bhn if before else bhn])
    plan = prepare_lstm(w4, r4, b4, width=width)
    return dataclasses.replace(plan, wh=gru_panels(plan.wh), gru=True, reset_before=before)


def gru_panels(wh: np.ndarray) -> np.ndarray:
    """The LSTM's recurrent panels [blocks, 2, K PANEL] of a GRU (panel 1: n_x | n_h per k,
    n_x's weights on h all zero) with panel 1 holding n_h's U columns alone, [K, U], at its
    start (the rest zero, never read): the step's GEMV (_lstm_cell.gemv_gru, gemv_units)
    streams 3/4 of the bytes, the GRU's own weights."""
    blocks, _, size = wh.shape
    k = size // PANEL
    out = wh.copy()
    out[:, 1] = 0
    out[:, 1, : k * U] = wh[:, 1].reshape(blocks, k, 2, U)[:, :, 1, :].reshape(blocks, k * U)
    return out


def gru_sequence(x: np.ndarray, h0: np.ndarray, plan: LSTMPlan) -> np.ndarray:
    """All steps of one GRU layer (plan from prepare_gru): x [T, B, I], h0 [B, H] -> h [T, B, H].

    >>> hs = gru_sequence(x, h0, prepare_gru(wx, wh, bx, bh))
    """
    if not plan.gru:
        raise ValueError("gru_sequence needs a plan from prepare_gru")
    if not plan.reset_before:
        return lstm_sequence(x, h0, h0, plan)[0]
    x = np.require(x, np.float32, ("C", "W"))
    if x.ndim != 3 or x.shape[2] != plan.input_size:
        raise ValueError(f"x must be [T, B, {plan.input_size}], got {list(x.shape)}")
    steps, batch, hidden = *x.shape[:2], plan.hidden
    if np.shape(h0) != (batch, hidden):
        raise ValueError(f"h0 must be [{batch}, {hidden}], got {list(np.shape(h0))}")
    h0 = np.require(h0, np.float32, ("C", "W"))
    units = plan.wh.shape[0] * U
    out = np.empty((3, steps + 1, batch, units), np.float32)  # hs, z, r h
    if steps > 0 and batch > 0:
        floats, ints, threads = _setup(x, plan, units)
        _sequence(plan.lanes, plan.tile, x, h0, plan.wx, plan.wh, plan.bias, floats, ints,
              out, threads)  # fmt: skip
    return np.ascontiguousarray(out[0, 1:, :, :hidden])


def _sizes(x, units, mr):
    """(floats, ints) of the scratch: lstm._start_row's (x in mr-row panels), with 1 + 2 T
    stages of flags."""
    steps, batch, size = x.shape
    blocks = units // U
    n_floats = -(-steps * batch // mr) * size * mr + blocks * steps * batch * BLOCK_COLS
    return n_floats, blocks * (1 + 2 * steps)


def _setup(x, plan, units):
    """The calling thread's workspace and the threads to run on."""
    floats, ints = _workspace(*_sizes(x, units, plan.tile.rows))
    macs = x.shape[1] * 3 * plan.hidden * (plan.input_size + plan.hidden)
    return floats, ints, 1 if macs < SERIAL_MACS_PER_STEP else numba.get_num_threads()


@numba.jit(**JIT_GEMM)
def _gemv_panel(L, h, w, k_len, out):
    """out[:PANEL] = h @ panel w ([K, PANEL]) at L's width: PANEL / W vectors per panel row
    (the branches on the constant n keep those that width needs), k and k + 1 in separate
    accumulators against the FMA latency."""
    wd, n = L.width, PANEL // L.width
    a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = vzero(L)
    for kk in range(k_len // 2):
        k = 2 * kk
        s, t, o, p = h[k], h[k + 1], PANEL * k, PANEL * k + PANEL
        a0, c0 = vfma(s, vload(L, w, o), a0), vfma(t, vload(L, w, p), c0)
        if n > 1:
            a1, c1 = vfma(s, vload(L, w, o + wd), a1), vfma(t, vload(L, w, p + wd), c1)
        if n > 2:
            a2, c2 = vfma(s, vload(L, w, o + 2 * wd), a2), vfma(t, vload(L, w, p + 2 * wd), c2)
            a3, c3 = vfma(s, vload(L, w, o + 3 * wd), a3), vfma(t, vload(L, w, p + 3 * wd), c3)
    if k_len % 2:
        s, o = h[k_len - 1], PANEL * (k_len - 1)
        a0 = vfma(s, vload(L, w, o), a0)
        if n > 1:
            a1 = vfma(s, vload(L, w, o + wd), a1)
        if n > 2:
            a2, a3 = vfma(s, vload(L, w, o + 2 * wd), a2), vfma(s, vload(L, w, o + 3 * wd), a3)
    vstore(out, 0, a0 + c0)
    if n > 1:
        vstore(out, wd, a1 + c1)
    if n > 2:
        vstore(out, 2 * wd, a2 + c2)
        vstore(out, 3 * wd, a3 + c3)


@numba.jit(**JIT_GEMM)
def _reset(L, t, b, w, gx, hs, zs, rh, acc):
    """Stage A of step t, block b: z and r h of its units for every row (min(W, U) units per
    vector, lanes past the block masked)."""
    j0, rows = b * U, hs.shape[1]
    for r in range(rows):
        _gemv_panel(L, hs[t, r], w[0], w.shape[1] // PANEL, acc)
        g, h, z_out, rh_out = gx[t * rows + r], hs[t, r, j0:], zs[t, r, j0:], rh[t, r, j0:]
        for j in range(0, U, min(L.width, U)):
            m = tail_mask(L, U - j)
            z = sigmoid(vload_masked(L, acc, j, m) + vload_masked(L, g, j, m))
            rg = sigmoid(vload_masked(L, acc, U + j, m) + vload_masked(L, g, U + j, m))
            vstore_masked(z_out, j, z, m)
            vstore_masked(rh_out, j, rg * vload_masked(L, h, j, m), m)


@numba.jit(**JIT_GEMM)
def _update(L, t, b, w, gx, hs, zs, rh, acc):
    """Stage B of step t, block b: n from r h of all units (its compact panel: gru_panels),
    then h' = n + z (h - n) of its units."""
    j0, rows = b * U, hs.shape[1]
    for r in range(rows):
        gemv_units(L, rh[t, r], w[1], w.shape[1] // PANEL, acc, U)
        g, h, z_in, h_out = gx[t * rows + r], hs[t, r, j0:], zs[t, r, j0:], hs[t + 1, r, j0:]
        for j in range(0, U, min(L.width, U)):
            m = tail_mask(L, U - j)
            n = tanh(vload_masked(L, acc, U + j, m) + vload_masked(L, g, PANEL + j, m))
            hn = vfma(vload_masked(L, z_in, j, m), vload_masked(L, h, j, m) - n, n)
            vstore_masked(h_out, j, hn, m)


@numba.jit(**JIT_GEMM)
def _run(L, T, p, parts, xp, wx, wh, bias, gx, hs, zs, rh, done):
    """Thread p's part of the whole sequence, as lstm._run, with stages 2 t + 1 (A) and
    2 t + 2 (B) for step t; stage 0 (the projection) is made by whichever item needs it."""
    blocks, steps = wh.shape[0], hs.shape[0] - 1
    tiles = np.empty(T.rows * BLOCK_COLS, np.float32)
    acc = np.empty(PANEL, np.float32)
    for s in range(2 * steps + 1):
        first = blocks * s
        for k in range(parts if s > 0 else 1):
            for n in range(blocks):
                b = _nth(s, k, n, p, parts, blocks)
                if b < 0:
                    break
                if atomic_load(done, first + b) == DONE:
                    continue
                if atomic_load(done, b) != DONE:
                    project(L, T, xp, wx[b], bias[b], gx.shape[1], gx[b], tiles, TRUE)
                    atomic_store(done, b, DONE)
                if s > 0 and s % 2 == 1:
                    _reset(L, (s - 1) // 2, b, wh[b], gx[b], hs, zs, rh, acc)
                elif s > 0:
                    _update(L, (s - 1) // 2, b, wh[b], gx[b], hs, zs, rh, acc)
                atomic_store(done, first + b, DONE)


@numba.jit(**PARALLEL)
def _sequence(L, T, x, h0, wx, wh, bias, floats, ints, out, threads):
    """The whole sequence in one call: out[0] is hs [T + 1, B, Hp] (row 0 h0), out[1] z and
    out[2] r h per step (scratch)."""
    blocks, steps = wh.shape[0], x.shape[0]
    parts = min(threads, blocks)
    hs, zs, rh = out[0], out[1], out[2]
    xp, gx, _ = _start_row(T, x, h0, h0, floats, ints, hs, zs)
    n_done = blocks * (1 + 2 * steps)
    for i in range(n_done):
        ints[i] = 0
    done = ints[:n_done]
    if parts == 1:
        _run(L, T, ZERO_I64, I64[1], xp, wx, wh, bias, gx, hs, zs, rh, done)
    else:
        for p in prange(parts):
            _run(L, T, p, parts, xp, wx, wh, bias, gx, hs, zs, rh, done)


def run_part(x, h0, plan: LSTMPlan, part: int, parts: int, started=()):
    """Reset before the product: part `part` of `parts` alone, as its thread runs it in a call
    whose other threads marked the flags done[started] STARTED and were then descheduled for
    good (a hook for tests). (hs [T, B, H], done flags)."""
    units = plan.wh.shape[0] * U
    n_floats, n_ints = _sizes(x, units, plan.tile.rows)
    floats, ints = np.empty(n_floats, np.float32), np.empty(n_ints, np.int32)
    out = np.zeros((3, x.shape[0] + 1, x.shape[1], units), np.float32)
    xp, gx, _ = _start_row(plan.tile, x, h0, h0, floats, ints, out[0], out[1])
    done = ints[:n_ints]
    done[:] = 0
    done[started] = STARTED
    _run(plan.lanes, plan.tile, part, parts, xp, plan.wx, plan.wh, plan.bias, gx, out[0],
          out[1], out[2], done)  # fmt: skip
    return out[0, 1:, :, : plan.hidden], done
