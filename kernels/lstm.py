"""LSTM cell and sequence kernels, float32, gates in the canonical order i, f, g, o (the GRU
runs on the same blocks with its own cell: kernels/gru.py).

    G_t = x_t Wx + h_{t-1} Wh + b          [B, 4H]
    c_t = sig(G_f) * c_{t-1} + sig(G_i) * tanh(G_g),   h_t = sig(G_o) * tanh(c_t)

Row by row, batch up to ROWS_MAX (a GEMV per row and step, memory-bound): hidden units in
blocks of U = 8; a block's weights are two [K, 16] panels (i f | g o, see _lstm_cell), so a
block's 8 units need nothing from other blocks. Work is cut into items: stage 0 projects the
input of all T B rows for one block (one blocked GEMM); stage t + 1 runs step t of every row
for one block.

Larger batches (a GEMM per step): R batch rows x the four gates of W units (W the kernel's
width) are one register tile over K = I + Hg ([x_t, h_{t-1}] packed as [16, K] row panels), so
the input projection is part of each step and the gate math runs on the tile
(_lstm_cell.step_cols). Stages: 0 packs x_t (item t), 1 .. T run the steps (an item is one
group of W units for a panel of 16 batch rows), T + 1 unpacks h_t and c_t into the [T, B, H]
outputs (item t), all in one call from Python. The panels live in a per-thread workspace
reused between calls (_workspace).

Parallelism without waiting: one parallel region for the whole sequence. Each stage's items are
shared out in contiguous runs, one per thread (thread p reads the same share of Wh every step:
512 KB of 1 MB at H = 256, about its core's L2). A thread does its own run, then walks the
others' runs from the end their owners reach last and computes every item not yet marked
DONE; so it moves to step t + 1 only when all of step t is done, by whoever. Items are
idempotent (they read step t - 1 and write only their own slice of step t; nothing is ever
overwritten), so an item two threads happen to compute at once gets the same numbers twice. A
thread the OS has descheduled thus never holds up the others for long (at most a bounded spin
per item it had started, below), where a fork/join or a barrier per step would (see
_lstm_sync). The row path claims nothing: its items are ~1 us, and claiming cost more than it
saved.

Two threads finishing a step together would compute one item twice in every step (the first
one done finds the other's last item open). So the batch tile claims an item before computing
it (compare-and-swap OPEN -> STARTED), and a thread that finds only STARTED items left waits
for them up to twice its own items' mean time (the time-stamp counter; see
_lstm_sync.wait_done), then computes them too. Measurements: bench/NOTES.md, LSTM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from ._lstm_cell import (
    BLOCK_COLS,
    COLS,
    PANEL,
    U,
    column_rows,
    project,
    projection_tile,
    step,
    step_cols,
)
from ._lstm_sync import atomic_cas, atomic_load, atomic_store, cycles, wait_done
from .config import I64, INLINE_GEMM, JIT_GEMM, PARALLEL, ZERO_I64
from .simd import lanes as lanes_of
from .simd.tile import tile

# Below this much work per step (a few us on one core) one thread does it all (a guess; at
# batch 1, I = 128, H = 256, 0.4M per step, two threads win).
SERIAL_MACS_PER_STEP = 1 << 16
# Batches up to this size run row by row: each step's GEMV per row streams the block's weights
# again, where the batch tile reads them once per R rows (padding the batch to whole tiles).
# From batch 3 the tile won at 16 lanes and on the AVX2 code path alike (I 128, H 256, two
# threads: 1.37x and 1.21x at batch 3, 0.95x and 0.86x at 2; bench/NOTES.md, "The recurrent
# batch tile turned around").
ROWS_MAX = 2
OPEN, STARTED, DONE = 0, 1, 2  # an item's flag


@dataclass(frozen=True)
class LSTMPlan:
    """Weights packed once per fused node (see prepare_lstm)."""

    wx: np.ndarray  # [blocks, I * 32] input weight panels (projection_panels)
    wh: np.ndarray  # [blocks, 2, H * 16] recurrent weight panels (a GRU's panel 1: gru_panels)
    bias: np.ndarray  # [blocks, BLOCK_COLS], i f g o of each block's units
    input_size: int
    hidden: int
    wg: np.ndarray  # [groups, (I + Hg) * 4 W]: per group of W units, gates i f g o per k
    bg: np.ndarray  # [groups, 4 W] the same units' biases (wg, bg: batches above ROWS_MAX)
    lanes: object  # the input projection's micro-kernel: width (a simd.Lanes) and tile (a
    tile: object  # simd.Tile, _lstm_cell.projection_tile): x is packed in tile.rows-row panels
    gru: bool = False  # the GRU cell on the same blocks (kernels/gru.py)
    reset_before: bool = False  # the GRU with linear_before_reset = 0 (kernels/gru.py)


def _panels(w: np.ndarray, hidden: int) -> np.ndarray:
    """[K, 4H] (gate blocks i, f, g, o) -> [blocks, 2, K * 16], zero columns past H."""
    k, blocks = w.shape[0], -(-hidden // U)
    padded = np.zeros((k, 4, blocks * U), np.float32)
    padded[:, :, :hidden] = w.reshape(k, 4, hidden)
    panels = padded.reshape(k, 2, 2, blocks, U).transpose(3, 1, 0, 2, 4)  # block, panel, k, gate
    return np.ascontiguousarray(panels).reshape(blocks, 2, k * PANEL)


def projection_panels(w: np.ndarray, hidden: int) -> np.ndarray:
    """[K, 4H] -> [blocks, K * 32]: a block's two panels side by side, one row of 32 columns
    (i f | g o of its 8 units) per k, the input projection's B operand."""
    k, blocks = w.shape[0], -(-hidden // U)
    two = _panels(w, hidden).reshape(blocks, 2, k, PANEL).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(two).reshape(blocks, k * BLOCK_COLS)


def prepare_lstm(wx: np.ndarray, wh: np.ndarray, bias: np.ndarray | None = None, *,
                 width=None) -> LSTMPlan:  # fmt: skip
    """Pack x Wx + h Wh + bias, with wx [I, 4H], wh [H, 4H], bias [4H], gates i, f, g, o;
    width: the lanes of the kernels' vectors, 8 or 16 (None: the process's,
    kernels.simd.width()): the input projection's micro-kernel, the row path's cells and the
    batch tile's unit groups (W units each).

    >>> plan = prepare_lstm(np.zeros((3, 8), np.float32), np.zeros((2, 8), np.float32))
    """
    hidden = wh.shape[0]
    if wh.shape != (hidden, 4 * hidden) or wx.ndim != 2 or wx.shape[1] != 4 * hidden:
        raise ValueError(f"weights [I, 4H] and [H, 4H] expected, got {wx.shape} and {wh.shape}")
    bias = np.zeros(4 * hidden, np.float32) if bias is None else bias.reshape(4 * hidden)
    wx32, wh32, b32 = (np.asarray(a, np.float32) for a in (wx, wh, bias[None]))
    b = _panels(b32, hidden).reshape(-1, BLOCK_COLS)
    lanes = lanes_of(width)
    if lanes.width not in (8, 16):  # the process widths; at 4 lanes a one-row projection
        # (_project_row: up to 4 vectors of a block's 32 columns) left half of them unset
        raise ValueError(f"width: 8 or 16 lanes, got {lanes.width}")
    wg, bg = _group_panels(wx32, wh32, b32, hidden, lanes.width)
    return LSTMPlan(projection_panels(wx32, hidden), _panels(wh32, hidden), b, wx.shape[0],
                    hidden, wg, bg, lanes, projection_tile(lanes.width))  # fmt: skip


def _group_panels(wx, wh, bias, hidden, w):
    """[I, 4H], [H, 4H], [1, 4H] -> per group of w units a [I + Hg, 4, w] panel (flat; Hg =
    whole groups) and its [4, w] biases: gate g of unit j at column g w + j % w; padded units
    and the rows of padded h are zero."""
    groups = -(-hidden // w)
    units = groups * w
    k = wx.shape[0] + units
    full = np.zeros((k, 4, units), np.float32)
    full[: wx.shape[0], :, :hidden] = wx.reshape(-1, 4, hidden)
    full[wx.shape[0] : wx.shape[0] + hidden, :, :hidden] = wh.reshape(hidden, 4, hidden)
    b = np.zeros((4, units), np.float32)
    b[:, :hidden] = bias.reshape(4, hidden)
    wg = full.reshape(k, 4, groups, w).transpose(2, 0, 1, 3)
    bg = b.reshape(4, groups, w).transpose(1, 0, 2)
    return (np.ascontiguousarray(wg).reshape(groups, k * 4 * w),
            np.ascontiguousarray(bg).reshape(groups, 4 * w))  # fmt: skip


@numba.jit(**INLINE_GEMM)
def _nth(s, k, n, p, parts, items):
    """The n-th item thread p visits in run (p + k) % parts of stage s, or -1 past the run's
    end. Its own run (k = 0) changes direction every stage, so the blocks it touched last
    (still in L2) come first; another's run is walked from the end its owner reaches last."""
    q = (p + k) % parts
    lo, hi = q * items // parts, (q + 1) * items // parts
    if lo + n >= hi:
        return -1
    return lo + n if (s % 2 == 1) == (k == 0) else hi - 1 - n


@numba.jit(**INLINE_GEMM)
def _item(L, T, s, b, xp, wx, wh, bias, gx, hs, cs, done, tiles, acc, gru):
    """Item b of stage s (block b), then its flag DONE (release: its writes are visible to
    whoever sees the flag). A step item first makes sure its block's input projection exists."""
    if atomic_load(done, b) != DONE:
        project(L, T, xp, wx[b], bias[b], gx.shape[1], gx[b], tiles, gru)
        atomic_store(done, b, DONE)
    if s > 0:
        step(L, s - 1, b, wh[b], gx[b], hs, cs, acc, gru)
        atomic_store(done, wh.shape[0] * s + b, DONE)


@numba.jit(**JIT_GEMM)
def _run(L, T, p, parts, xp, wx, wh, bias, gx, hs, cs, done, gru):
    """Thread p's part of the whole sequence (any subset of parts may run, in any order).
    Stage 0 (the projection, on the micro-kernel L, T) is not waited for: a step item projects
    its block if need be."""
    blocks, steps = wh.shape[0], hs.shape[0] - 1
    tiles = np.empty(T.rows * BLOCK_COLS, np.float32)
    acc = tiles
    for s in range(steps + 1):
        first = blocks * s  # stage s's flags (stage 0's: the projections')
        for k in range(parts if s > 0 else 1):
            for n in range(blocks):
                b = _nth(s, k, n, p, parts, blocks)
                if b < 0:
                    break
                if atomic_load(done, first + b) != DONE:
                    _item(L, T, s, b, xp, wx, wh, bias, gx, hs, cs, done, tiles, acc, gru)


@numba.jit(**JIT_GEMM)
def _start_row(T, x, h0, c0, floats, ints, hs, cs):
    """Row by row (batch B <= ROWS_MAX): hs[0], cs[0] = h0, c0 (zero past H), and _run's
    scratch from the workspace: x's T B rows (row t B + r is x[t, r]) as [I, MR]-row panels xp
    [ceil(T B / MR), I * MR] (MR = T.rows of the projection's tile T; zero rows past T B), gx
    [blocks, T B, BLOCK_COLS], and the done flags, zeroed."""
    steps, batch, size, hidden = x.shape[0], x.shape[1], x.shape[2], h0.shape[1]
    blocks, n_rows = hs.shape[2] // U, x.shape[0] * x.shape[1]
    for r in range(batch):
        for k in range(hs.shape[2]):
            hs[0, r, k] = h0[r, k] if k < hidden else 0
            cs[0, r, k] = c0[r, k] if k < hidden else 0
    mr = T.rows
    groups = (n_rows + mr - 1) // mr
    xp = floats[: groups * size * mr].reshape((groups, size * mr))
    for g in range(groups):
        for m in range(mr):
            n = mr * g + m
            for k in range(size):
                xp[g, mr * k + m] = x[n // batch, n % batch, k] if n < n_rows else 0
    n_xp, n_gx = groups * size * mr, blocks * n_rows * BLOCK_COLS
    gx = floats[n_xp : n_xp + n_gx].reshape((blocks, n_rows, BLOCK_COLS))
    n_done = blocks * (1 + steps)
    for i in range(n_done):
        ints[i] = 0
    return xp, gx, ints[:n_done]


@numba.jit(**PARALLEL)
def _sequence(L, T, x, h0, c0, wx, wh, bias, floats, ints, out, threads, gru):
    """Row by row, all in one call from Python (as _sequence_cols): out[0], out[1] are hs, cs
    [T + 1, B, Hp] with row 0 the initial state."""
    parts = min(threads, wh.shape[0])
    hs, cs = out[0], out[1]
    xp, gx, done = _start_row(T, x, h0, c0, floats, ints, hs, cs)
    if parts == 1:
        _run(L, T, ZERO_I64, I64[1], xp, wx, wh, bias, gx, hs, cs, done, gru)
    else:
        for p in prange(parts):
            _run(L, T, p, parts, xp, wx, wh, bias, gx, hs, cs, done, gru)


@numba.jit(**JIT_GEMM)
def _pack_step(t, x, h0, c0, z, c):
    """Stage 0, item t: x_t into the x part of each row of z[t]'s [COLS, I + Hg] row panels
    (zero past the batch); item 0 also packs h0 and c0 (zero past the batch and past H)."""
    batch, size, hidden = x.shape[1], x.shape[2], h0.shape[1]
    units = c.shape[2] // COLS
    kz = size + units
    for q in range(z.shape[1]):
        zt = z[t, q]
        for r in range(COLS):
            n, o = COLS * q + r, kz * r
            if n < batch:
                for k in range(size):
                    zt[o + k] = x[t, n, k]
            else:
                for k in range(size):
                    zt[o + k] = 0
            if t == 0:
                c0q = c[0, q]
                for k in range(units):
                    inside = n < batch and k < hidden
                    zt[o + size + k] = h0[n, k] if inside else 0
                    c0q[units * r + k] = c0[n, k] if inside else 0


@numba.jit(**JIT_GEMM)
def _unpack_step(t, z, c, hs, cs):
    """Last stage, item t: h_t and c_t from the panels z[t + 1], c[t + 1] into the rows of
    hs[t], cs[t] (whole cache lines from one thread)."""
    batch, hidden = hs.shape[1], hs.shape[2]
    units = c.shape[2] // COLS
    kz = z.shape[2] // COLS
    h_at = kz - units
    for n in range(batch):
        q, r = n // COLS, n % COLS
        hz, cz, h_row, c_row = z[t + 1, q], c[t + 1, q], hs[t, n], cs[t, n]
        for k in range(hidden):
            h_row[k] = hz[kz * r + h_at + k]
            c_row[k] = cz[units * r + k]


@numba.jit(**INLINE_GEMM)
def _item_cols(L, T4, T3, T2, T1, s, i, x, h0, c0, w, bias, z, c, hs, cs, gru):
    """Item i of stage s: packing x_t (s = 0), step s - 1 for one group of units and panel, or
    unpacking step t's outputs (s = T + 1)."""
    steps, panels = x.shape[0], z.shape[1]
    if s == 0:
        _pack_step(i, x, h0, c0, z, c)
    elif s == steps + 1:
        _unpack_step(i, z, c, hs, cs)
    else:
        q = i % panels
        rows = min(COLS, x.shape[1] - COLS * q)
        step_cols(L, T4, T3, T2, T1, s - 1, i // panels, q, rows, w, bias, z, c, hs.shape[2],
                  gru)  # fmt: skip


@numba.jit(**JIT_GEMM)
def _run_cols(L, T4, T3, T2, T1, p, parts, x, h0, c0, w, bias, z, c, hs, cs, done, gru):
    """Batch > ROWS_MAX: thread p's part of stage 0 (packing x_t, item t), of the T steps (an
    item is one group of W units for one panel of COLS batch rows, see _lstm_cell.step_cols)
    and of stage T + 1 (unpacking step t's outputs, item t). Runs and flags as in _run; every
    stage is waited for (step 1 reads the packed x_0 and h0)."""
    steps, panels = x.shape[0], z.shape[1]
    groups = w.shape[0]
    span = 0  # cycles an item took this thread lately
    for s in range(steps + 2):
        items = steps if s == 0 or s == steps + 1 else groups * panels
        first = 0 if s == 0 else steps + (s - 1) * groups * panels
        start, count = cycles(), 0
        for k in range(parts):
            for n in range(items):
                i = _nth(s, k, n, p, parts, items)
                if i < 0:
                    break
                if parts == 1 or atomic_cas(done, first + i, OPEN, STARTED) == OPEN:
                    _item_cols(L, T4, T3, T2, T1, s, i, x, h0, c0, w, bias, z, c, hs, cs, gru)
                    atomic_store(done, first + i, DONE)
                    count += 1
        if count > 0:
            span = (cycles() - start) // count
        # Items another thread started: wait up to twice this thread's mean item time, then
        # compute them too (that thread may have been descheduled).
        for i in range(items if parts > 1 else 0):
            if not wait_done(done, first + i, DONE, 2 * span):
                _item_cols(L, T4, T3, T2, T1, s, i, x, h0, c0, w, bias, z, c, hs, cs, gru)
                atomic_store(done, first + i, DONE)


@numba.jit(**JIT_GEMM)
def _carve(x, groups, units, floats, ints):
    """_run_cols's scratch from the workspace: z [T + 1, panels, COLS (I + Hg)] holds x_t and
    h_{t-1} of each row of a panel of COLS batch rows, c [T + 1, panels, COLS Hg] holds c_{t-1}
    (Hg = units: whole groups); the done flags, zeroed (T + 2 stages: packing, the steps, the
    outputs)."""
    steps, batch, size = x.shape
    panels = (batch + COLS - 1) // COLS
    n_z = (steps + 1) * panels * (size + units) * COLS
    n_c = (steps + 1) * panels * units * COLS
    n_done = 2 * steps + steps * groups * panels
    for i in range(n_done):
        ints[i] = 0
    z = floats[:n_z].reshape((steps + 1, panels, (size + units) * COLS))
    c = floats[n_z : n_z + n_c].reshape((steps + 1, panels, units * COLS))
    return z, c, ints[:n_done]


@numba.jit(**PARALLEL)
def _sequence_cols(L, T4, T3, T2, T1, x, h0, c0, w, bias, floats, ints, out, threads, gru):
    """Batch > ROWS_MAX, all of it in one call from Python (each call from Python costs tens of us
    once the kernel has flushed the interpreter's data from the caches): carve the scratch,
    then run the stages on up to `threads` threads (numba.get_num_threads() inside a kernel
    would stop it from caching)."""
    parts = min(threads, w.shape[0] * ((x.shape[1] + COLS - 1) // COLS))
    z, c, done = _carve(x, w.shape[0], bias.shape[1] // 4 * w.shape[0], floats, ints)
    if parts == 1:
        _run_cols(L, T4, T3, T2, T1, ZERO_I64, I64[1], x, h0, c0, w, bias, z, c, out[0], out[1],
                  done, gru)  # fmt: skip
    else:
        for p in prange(parts):
            _run_cols(L, T4, T3, T2, T1, p, parts, x, h0, c0, w, bias, z, c, out[0], out[1],
                      done, gru)  # fmt: skip


def column_tiles(lanes):
    """The batch tile's shapes at these lanes: R batch rows (_lstm_cell.column_rows) x 4, 3, 2
    and 1 gate vectors."""
    rows = column_rows(lanes.width)
    return tuple(tile(rows, gates) for gates in (4, 3, 2, 1))


_WORKSPACE = threading.local()  # .floats, .ints: one thread's scratch, reused between calls
WORKSPACE_MAX = 16 << 20  # bytes kept per thread; larger scratch is allocated per call


def _workspace(n_floats, n_ints):
    """Scratch arrays for one call, kept for the calling thread's later calls (up to
    WORKSPACE_MAX), so that a call allocates only its outputs. Safe to reuse: the kernels
    write all scratch they read before reading it, and a thread runs one call at a time."""
    floats, ints = getattr(_WORKSPACE, "floats", None), getattr(_WORKSPACE, "ints", None)
    if floats is None or floats.size < n_floats or ints.size < n_ints:
        floats = np.empty(max(n_floats, 0 if floats is None else floats.size), np.float32)
        ints = np.empty(max(n_ints, 0 if ints is None else ints.size), np.int32)
        if 4 * (floats.size + ints.size) <= WORKSPACE_MAX:
            _WORKSPACE.floats, _WORKSPACE.ints = floats, ints
    return floats, ints


def _workspace_size(x, plan):
    """(floats, ints) that _carve (batch tile) or _start_row (row by row, x in MR-row panels)
    takes for x [T, B, I]."""
    steps, batch, size = x.shape
    if batch <= ROWS_MAX:
        mr, blocks = plan.tile.rows, plan.wh.shape[0]
        floats = -(-steps * batch // mr) * size * mr + blocks * steps * batch * BLOCK_COLS
        return floats, blocks * (1 + steps)
    groups, panels = plan.wg.shape[0], -(-batch // COLS)
    units = groups * plan.lanes.width
    floats = (steps + 1) * panels * (size + 2 * units) * COLS
    ints = 2 * steps + steps * groups * panels
    return floats, ints


def lstm_sequence(x: np.ndarray, h0: np.ndarray, c0: np.ndarray, plan: LSTMPlan):
    """All steps of one LSTM layer: x [T, B, I], h0, c0 [B, H] -> (h [T, B, H], c [T, B, H]).

    >>> hs, cs = lstm_sequence(x, h0, c0, prepare_lstm(wx, wh, bias))
    >>> hs[-1], cs[-1]          # the final state; hs is ONNX LSTM's Y without the direction axis
    """
    # Writable too: Numba types read-only arrays (constants from the model) apart, and would
    # compile the whole kernel a second time for them (seconds).
    x = np.require(x, np.float32, ("C", "W"))
    if x.ndim != 3 or x.shape[2] != plan.input_size:
        raise ValueError(f"x must be [T, B, {plan.input_size}], got {list(x.shape)}")
    steps, batch = x.shape[:2]
    hidden = plan.hidden
    for name, a in (("h0", h0), ("c0", c0)):
        if np.shape(a) != (batch, hidden):
            raise ValueError(f"{name} must be [{batch}, {hidden}], got {list(np.shape(a))}")
    h0, c0 = (np.require(a, np.float32, ("C", "W")) for a in (h0, c0))
    if 0 < batch <= ROWS_MAX:
        return _sequence_row(x, h0, c0, plan)
    return _sequence_batch(x, h0, c0, plan)


def _sequence_row(x, h0, c0, plan):
    """lstm_sequence row by row (batch <= ROWS_MAX): one call into Numba; hs, cs
    [T + 1, B, Hp] with row 0 the initial state, the outputs their rows from 1."""
    steps, batch, hidden, units = *x.shape[:2], plan.hidden, plan.wh.shape[0] * U
    out = np.empty((2, steps + 1, batch, units), np.float32)
    if steps > 0:
        floats, ints, threads = _setup(x, plan)
        _sequence(plan.lanes, plan.tile, x, h0, c0, plan.wx, plan.wh, plan.bias, floats,
              ints, out, threads, plan.gru)  # fmt: skip
    if units != hidden:
        return tuple(np.ascontiguousarray(a[1:, :, :hidden]) for a in out)
    return out[0, 1:], out[1, 1:]


def _sequence_batch(x, h0, c0, plan):
    """lstm_sequence with the batch tile (batch above ROWS_MAX, or 0): one call into Numba
    packs, runs and writes the outputs, [T, B, H] like ONNX (one allocation for both)."""
    steps, batch = x.shape[:2]
    out = np.empty((2, steps, batch, plan.hidden), np.float32)
    if steps > 0 and batch > 0:
        floats, ints, threads = _setup(x, plan)
        _sequence_cols(plan.lanes, *column_tiles(plan.lanes), x, h0, c0, plan.wg, plan.bg,
              floats, ints, out, threads, plan.gru)  # fmt: skip
    return out[0], out[1]


def _setup(x, plan):
    """The calling thread's workspace for x and the threads to run on: one below
    SERIAL_MACS_PER_STEP."""
    floats, ints = _workspace(*_workspace_size(x, plan))
    macs = x.shape[1] * 4 * plan.hidden * (plan.input_size + plan.hidden)
    return floats, ints, 1 if macs < SERIAL_MACS_PER_STEP else numba.get_num_threads()


def lstm_cell(x: np.ndarray, h: np.ndarray, c: np.ndarray, plan: LSTMPlan):
    """One step: x [B, I], h, c [B, H] -> (h', c')."""
    hs, cs = lstm_sequence(x[None], h, c, plan)
    return hs[0], cs[0]


# ---- hooks for tests: a call's scratch, one thread's part run alone ------------------------------
def workspace(x: np.ndarray, plan: LSTMPlan):
    """The calling thread's scratch (floats, ints) that the next call on x will reuse."""
    return _workspace(*_workspace_size(x, plan))


def carve(x, h0, c0, plan: LSTMPlan):
    """A fresh workspace of _workspace_size's size, carved as a call on x carves it: (scratch,
    done flags, n_floats, n_ints); scratch is (xp, gx, hs, cs) row by row (hs, cs holding the
    initial state in row 0), (z, c) for the batch tile."""
    steps, batch = x.shape[:2]
    n_floats, n_ints = _workspace_size(x, plan)
    floats, ints = np.empty(n_floats, np.float32), np.empty(n_ints, np.int32)
    if batch <= ROWS_MAX:
        hs, cs = np.zeros((2, steps + 1, batch, plan.wh.shape[0] * U), np.float32)
        xp, gx, done = _start_row(plan.tile, x, h0, c0, floats, ints, hs, cs)
        return (xp, gx, hs, cs), done, n_floats, n_ints
    groups = plan.wg.shape[0]
    z, c, done = _carve(x, groups, groups * plan.lanes.width, floats, ints)
    return (z, c), done, n_floats, n_ints


def run_part(x, h0, c0, plan: LSTMPlan, part: int, parts: int, started=()):
    """Part `part` of `parts` alone, as its thread runs it in a call whose other threads marked
    the flags done[started] STARTED and were then descheduled for good. (hs, cs, done flags)."""
    steps, batch, hidden = x.shape[0], x.shape[1], plan.hidden
    scratch, done, _, _ = carve(x, h0, c0, plan)
    done[started] = STARTED
    if batch <= ROWS_MAX:
        xp, gx, hs, cs = scratch
        _run(plan.lanes, plan.tile, part, parts, xp, plan.wx, plan.wh, plan.bias, gx, hs,
              cs, done, plan.gru)  # fmt: skip
        return hs[1:, :, :hidden], cs[1:, :, :hidden], done
    z, c = scratch
    hs, cs = np.zeros((2, steps, batch, hidden), np.float32)
    _run_cols(plan.lanes, *column_tiles(plan.lanes), part, parts, x, h0, c0, plan.wg,
          plan.bg, z, c, hs, cs, done, plan.gru)  # fmt: skip
    return hs, cs, done


def compiled_signatures() -> list:
    """The signatures the two sequence kernels have been compiled for in this process."""
    return [*_sequence.signatures, *_sequence_cols.signatures]
