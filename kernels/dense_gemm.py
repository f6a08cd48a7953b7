"""Dense GEMM with its epilogue, the transformer's linear layers on the micro-kernel:

    y[i, j] = act(sum_k x[i, k] W[k, j] + b[j]) (+ r[i, j])      x [M, K], W [K, N], r [M, N]

act any activation of kernels/simd/activation.py (a (kind, a, b) triple); the residual r is
added after it (a transformer's skip connection).

W is packed once, when the plan is built (prepare_dense), into the micro-kernel's column
panels [ceil(N / NR), K, NR] (zero columns past N); x is packed per call into its row panels
[ceil(M / MR), K, MR] (zero rows past M: one parallel pass, M K copies against M K N FMAs),
so that the micro-kernel (_gemm.panel_sum) reads both operands contiguously (x read in place,
MR rows at a time, was slower than packing it: bench/NOTES.md, "Dense GEMM"); a one-row tile
(M = 1, _gemm.row_tile) reads x as it is, its own packing. Blocking, BLIS's order:

    for each work item (a block of row tiles x a block of column panels), in parallel:
      for each block of kc of K:
        for each column panel of the item:     its kc x NR weights reused by every row tile
          for each row tile of the item:
            the tile in registers, + y's partial sums after the first K block, stored to y;
            after the last, the epilogue before the store

Work items are cut so that prange's equal split of them gives every thread the same number
of tiles (blocking()), column blocks outermost: each thread reads its own share of W once.
The epilogue: bias, a clip (identity, relu, clip) and the residual on the tile's registers;
another activation on the stored tile while it is in L1, GELU in both forms and SiLU with
their fits inlined, the rest through the table's activate (a call per vector costs as much
as the erf, bench/NOTES.md). Rows past M and columns past N are not stored (masked stores).
A NaN or inf in x reaches every column of its row (NaN * w and inf * 0 are NaN, inf * w is
inf), as onnxruntime's MLAS gives.

Why not NumPy's BLAS: OpenBLAS's idle workers spin on the cores the next kernel needs, it
cannot fuse the epilogue, and it packs W again on every call.

    >>> plan = prepare_dense(w, b, encode("gelu"))      # at Session build
    >>> y = dense_gemm(x, plan, residual=r)             # per call: [M, N] float32
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np

from . import _gemm
from .config import INLINE_FIT, JIT_GEMM, PARALLEL, entry_point, get_threads
from .machine import cache_bytes
from .simd import activate, clip, tail_mask, vload, vload_masked, vstore, vstore_masked
from .simd.activation import (
    GELU,
    GELU_TANH,
    KINDS,
    SILU,
    clip_bounds,
    clips,
    encode,
    gelu,
    gelu_tanh,
    silu,
)
from .workspace import as_rows, shared

__all__ = ["DensePlan", "blocking", "dense_gemm", "prepare_dense"]


@dataclasses.dataclass(frozen=True)
class DensePlan:
    """W packed for the micro-kernel, with its bias and activation: what a linear layer keeps
    between calls. Build it with prepare_dense."""

    k: int  # inputs (rows of W)
    n: int  # outputs (columns of W)
    lanes: object  # the micro-kernel's width (a simd.Lanes) and tile (a simd.Tile): W packed
    tile: (
        object  # in panels of NR = tile.cols * lanes.width columns; rows per call (_gemm.row_tile)
    )
    packed: np.ndarray  # [ceil(N / NR), K, NR] float32 flat, zero columns past N
    bias: np.ndarray  # [ceil(N / NR) NR] float32, zeros past N
    act: tuple  # (kind, a, b): kernels.simd.activation.encode
    # (M, threads) -> blocking(...): the split of the work, computed once per shape
    launches: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)
    # (row tile, x writeable) -> _dense's compiled entry point for those argument types
    entries: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)


def pack_panels(w, nr):
    """W [K, N] as nr-column panels [ceil(N / nr), K, nr] (zero columns past N), flat."""
    k, n = w.shape
    n_pan = -(-n // nr)
    padded = np.zeros((k, n_pan * nr), np.float32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, n_pan, nr).transpose(1, 0, 2)).ravel()


def prepare_dense(w, bias=None, act=None, width=None) -> DensePlan:
    """Pack W [K, N] (float32, or anything np.asarray makes float32) and its bias [N] (None:
    zeros) for dense_gemm; act: the activation's (kind, a, b) (None: identity); width: the
    lanes of the micro-kernel, 8 or 16 (None: the process's, kernels.simd.width()).

    >>> plan = prepare_dense(np.ones((768, 3072), np.float32), act=encode("gelu_tanh"))
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"W must be 2-D [K, N], got shape {w.shape}")
    k, n = w.shape
    act = encode() if act is None else act
    kind, a, c = act
    if not 0 <= int(kind) < len(KINDS):
        raise ValueError(f"unknown activation kind {kind} (fusion_kernels.simd.activation.encode)")
    L, T = _gemm.micro_tile(width)
    nr = _gemm.panel_width(T, L)
    b = np.zeros(-(-n // nr) * nr, np.float32)
    if bias is not None:
        bias = np.asarray(bias, np.float32)
        if bias.size != n:
            raise ValueError(f"bias of shape {bias.shape} does not match {n} outputs")
        b[:n] = bias.reshape(n)
    act = (int(kind), np.float32(a), np.float32(c))
    return DensePlan(k, n, L, T, pack_panels(w, nr), b, act)


# ---- the kernel ------------------------------------------------------------------------------
@numba.jit(**INLINE_FIT)
def act_vector(kind, act_a, act_b, v):
    """The activation of v (kernels/simd/activation.py) with the transformer's kinds (GELU in
    both forms, SiLU) inlined, the others through the table's activate (a call)."""
    if kind == GELU:
        return gelu(v)
    if kind == GELU_TANH:
        return gelu_tanh(v)
    if kind == SILU:
        return silu(v)
    return activate(kind, act_a, act_b, v)


@numba.jit(**JIT_GEMM)
def dense_item(L, T, xp, k_len, w, y, r, has_r, bias, kind, act_a, act_b, i0, i1, p0, p1, kc):
    """Row tiles i0 .. i1 (MR rows each) against column panels p0 .. p1 (NR columns each),
    K in blocks of kc: y's block [i0 MR, i1 MR) x [p0 NR, p1 NR) within [M, N]; x comes
    packed, xp its row panels [ceil(M / MR), K, MR] (zero rows past M), of K = k_len.

    Each tile, in registers: plus y's partial sums after the first K block; after the last,
    plus the bias, then a clip (identity, relu, clip: activation.clips) and the residual,
    and stored. Another activation goes over the stored tile while it is in L1, one copy of
    its code per kernel (in the registers' loop, unrolled per accumulator, LLVM left the loop
    rolled and picked each accumulator through a jump table). Everything per tile is in this
    one function: a callee taking the arrays increfed them on every call (an atomic on a line
    that both threads share; Numba prunes the pair only in simple functions)."""
    m_len, n_len = y.shape
    mr, wd = T.rows, L.width
    nr = T.cols * wd
    lo, hi = clip_bounds(kind, act_a, act_b)
    simple = clips(kind)
    n_kb = max(1, -(-k_len // kc))
    for kb in range(n_kb):
        k0 = kb * kc
        kl = min(kc, k_len - k0)
        first, last = kb == 0, kb == n_kb - 1
        for p in range(p0, p1):
            wo = (p * k_len + k0) * nr
            n0 = p * nr
            cols = min(nr, n_len - n0)
            for i in range(i0, i1):
                m0 = i * mr
                rows = min(mr, m_len - m0)
                t = _gemm.panel_sum(L, T, xp, (i * k_len + k0) * mr, w, wo, nr, kl)
                yo = m0 * n_len + n0
                if rows == mr and cols == nr and first and last:  # most tiles: fewer tests
                    for ir in range(mr):  # unrolled: the tile's indices are constants
                        for c in range(T.cols):
                            q = yo + ir * n_len + c * wd
                            v = t[ir][c] + vload(L, bias, n0 + c * wd)
                            if simple:
                                v = clip(v, lo, hi)
                                if has_r:
                                    v += vload(L, r, q)
                            vstore(y, q, v)
                else:  # an edge tile, or K in blocks (masked loads: rare, and cheap)
                    for ir in range(mr):
                        for c in range(T.cols):
                            left = cols - c * wd
                            if ir < rows and left > 0:
                                q = yo + ir * n_len + c * wd
                                m = tail_mask(L, left)
                                v = t[ir][c]
                                if not first:
                                    v += vload_masked(L, y, q, m)
                                if last:
                                    v += vload(L, bias, n0 + c * wd)
                                    if simple:
                                        v = clip(v, lo, hi)
                                        if has_r:
                                            v += vload_masked(L, r, q, m)
                                if left >= wd:  # a store under a mask costs more
                                    vstore(y, q, v)
                                else:
                                    vstore_masked(y, q, v, m)
                if last and not simple:
                    for ir in range(rows):
                        for c in range(T.cols):
                            left = cols - c * wd
                            if left > 0:
                                q = yo + ir * n_len + c * wd
                                if left >= wd:
                                    v = act_vector(kind, act_a, act_b, vload(L, y, q))
                                    if has_r:
                                        v += vload(L, r, q)
                                    vstore(y, q, v)
                                else:
                                    m = tail_mask(L, left)
                                    v = act_vector(kind, act_a, act_b, vload_masked(L, y, q, m))
                                    if has_r:
                                        v += vload_masked(L, r, q, m)
                                    vstore_masked(y, q, v, m)


@numba.jit(**PARALLEL)
def _dense(L, T, x, xp, w, y, r, has_r, bias, kind, act_a, act_b, n_rb, n_cb, kc):
    """x packed into xp by row tiles, then the items (column block, row block), column blocks
    outer: a thread's items share W."""
    m_len, k_len = x.shape
    mr = T.rows
    row_tiles = -(-m_len // mr)
    panels = -(-y.shape[1] // (T.cols * L.width))
    lw = L.width
    if mr > 1:  # a one-row tile reads x as it is (its packing is x): no parallel region for it
        for i in numba.prange(row_tiles):  # xp[(i K + k) MR + j] = x[i MR + j, k], 0 past M
            base, m0 = i * k_len * mr, i * mr
            k = 0
            if m0 + mr <= m_len:
                while k + lw <= k_len:
                    _gemm.interleave_rows(L, T, x, m0 * k_len + k, k_len, xp, base + k * mr)
                    k += lw
            for kk in range(k, k_len):
                for j in range(mr):
                    xp[base + kk * mr + j] = x[m0 + j, kk] if m0 + j < m_len else 0.0
    for item in numba.prange(n_rb * n_cb):
        cb, rb = item // n_rb, item % n_rb
        i0, i1 = rb * row_tiles // n_rb, (rb + 1) * row_tiles // n_rb
        p0, p1 = cb * panels // n_cb, (cb + 1) * panels // n_cb
        dense_item(L, T, xp, k_len, w, y, r, has_r, bias, kind, act_a, act_b, i0, i1, p0, p1,
                   kc)  # fmt: skip


# ---- the split of the work -------------------------------------------------------------------
def _chunks(n, threads):
    """How many consecutive items each thread gets of n (prange's static split: equal counts,
    the first n % threads threads one more)."""
    q, rem = divmod(n, threads)
    return [q + (t < rem) for t in range(threads)]


def _makespan(row_tiles, panels, n_rb, n_cb, threads):
    """Tiles of the busiest thread when (column block, row block) items, cut as _dense cuts
    them, are split as prange splits them."""
    rows = [(b + 1) * row_tiles // n_rb - b * row_tiles // n_rb for b in range(n_rb)]
    cols = [(b + 1) * panels // n_cb - b * panels // n_cb for b in range(n_cb)]
    sizes = [c * r for c in cols for r in rows]
    worst, start = 0, 0
    for count in _chunks(len(sizes), threads):
        worst = max(worst, sum(sizes[start : start + count]))
        start += count
    return worst


def blocking(m, k, n, mr, nr, threads):
    """(row blocks, column blocks, kc) for an [M, K] x [K, N] product on MR x NR tiles:

    kc   the K block, K cut into equal blocks of at most a quarter of L2 per panel's kc x NR
         weights: a panel stays in L2 while every row tile of the item passes, and K is
         rarely cut (each cut reloads and stores the partial sums; a panel sized for L1 did
         not pay for it: bench/NOTES.md, "Dense GEMM");
    rows blocks of row tiles whose packed kc x Mc of x fits L2 (it passes once per panel);
    the split with the least tiles on the busiest thread (prange's equal item counts), then
    the fewest items (each re-reads its x block), then the fewest row blocks (each re-reads
    its W block)."""
    l2 = cache_bytes(2)
    kc_max = max(16, l2 // 4 // (nr * 4))
    n_kb = max(1, -(-k // kc_max))
    kc = max(1, -(-k // n_kb))
    row_tiles, panels = max(1, -(-m // mr)), max(1, -(-n // nr))
    tiles_per_block = max(1, l2 // (kc * 4 * mr))
    least_rb = -(-row_tiles // tiles_per_block)
    best = None
    for n_rb in range(least_rb, min(row_tiles, max(4 * least_rb, 2 * threads)) + 1):
        for n_cb in range(1, min(panels, 16 * threads) + 1):
            key = (_makespan(row_tiles, panels, n_rb, n_cb, threads), n_rb * n_cb, n_rb)
            if best is None or key < best[0]:
                best = (key, n_rb, n_cb)
    return best[1], best[2], kc


def launch(plan, m):
    """(tile, row blocks, column blocks, kc) for M rows and the calling thread's thread count:
    row_tile and blocking(), cached on the plan."""
    key = (m, get_threads())
    found = plan.launches.get(key)
    if found is None:
        if len(plan.launches) > 64:  # a model fed ever new shapes: do not grow without bound
            plan.launches.clear()
        T = _gemm.row_tile(m, plan.tile)
        nr = _gemm.panel_width(T, plan.lanes)
        found = plan.launches[key] = (T, *blocking(m, plan.k, plan.n, T.rows, nr, key[1]))
    return found


_NO_RESIDUAL = np.zeros((1, 1), np.float32)


def _packing(x, T, k):
    """Where _dense packs x [M, k] by row tiles of T: x itself for one writable row (M = 1:
    row_tile), else this thread's shared scratch, a read-only row copied into it (the skipped
    packing loop still types xp as writable)."""
    if T.rows == 1 and x.flags.writeable:
        return x.reshape(-1)
    xp = shared(-(-x.shape[0] // T.rows) * T.rows * k)
    if T.rows == 1:
        xp[:] = x.reshape(-1)
    return xp


def dense_gemm(x, plan, residual=None, out=None):
    """act(x W + b) (+ residual) for x [M, K] float32 and a plan from prepare_dense: [M, N]
    float32, into `out` (C-contiguous [M, N] float32) if given. residual: [M, N], or anything
    that broadcasts to it.

    >>> y = dense_gemm(np.ones((4, 768), np.float32), prepare_dense(w, b, encode("gelu")))
    """
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != plan.k:
        raise ValueError(f"cannot multiply x {x.shape} by W [{plan.k}, {plan.n}]")
    if x.dtype != np.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    x = np.ascontiguousarray(x)
    m, n = x.shape[0], plan.n
    if out is None:
        out = np.empty((m, n), np.float32)
    elif (out.dtype != np.float32 or out.shape != (m, n) or not out.flags.c_contiguous
          or not out.flags.writeable):  # fmt: skip
        raise ValueError(f"out must be a writable C-contiguous float32 [{m}, {n}], got "
                         f"{out.dtype} {out.shape}")  # fmt: skip
    r = _NO_RESIDUAL
    if residual is not None:
        r = as_rows(residual, (m, n))
    if out.size == 0:
        return out
    L = plan.lanes
    T, n_rb, n_cb, kc = launch(plan, m)
    xp = _packing(x, T, plan.k)
    kind, a, b = plan.act
    args = (L, T, x, xp, plan.packed, out, r, residual is not None, plan.bias, kind, a, b, n_rb,
            n_cb, kc)  # fmt: skip
    key = (T, x.flags.writeable)  # the argument types that vary between calls of a plan
    run = plan.entries.get(key)
    if run is None:
        _dense(*args)
        plan.entries[key] = entry_point(_dense, args)  # later calls skip the dispatcher's typing
    else:
        run(*args)
    return out


def bind_dense_gemm(x, plan, residual=None):
    """dense_gemm(x, plan, residual) specialized for arrays of these shapes (x [M, K]; the
    residual given or not, and its shape) at the calling thread's thread count: the function
    f(x, residual=None) -> [M, N] for a caller whose shapes repeat call after call (a
    session's step), which has checked them; the checks, the launch's look-up and the entry
    point are worked out here, once (one row of 576 x 1024: 18.86 us a general call, 17.85
    bound; bench/NOTES.md). f allocates the output and calls the
    compiled kernel; its x must be C-contiguous float32 of the bound shape (one that is not
    contiguous is copied)."""
    dense_gemm(x, plan, residual)  # checks them; binds the entry point for these types
    x = np.ascontiguousarray(x)
    m, n = x.shape[0], plan.n
    if m == 0 or n == 0:
        return lambda x, residual=None: np.empty((m, n), np.float32)
    T, n_rb, n_cb, kc = launch(plan, m)
    run, has_r = plan.entries[(T, x.flags.writeable)], residual is not None
    head, tail = (plan.lanes, T), (plan.bias, *plan.act, n_rb, n_cb, kc)

    def call(x, residual=None):
        x = np.ascontiguousarray(x)
        out = np.empty((m, n), np.float32)
        r = as_rows(residual, (m, n)) if has_r else _NO_RESIDUAL
        run(*head, x, _packing(x, T, plan.k), plan.packed, out, r, has_r, *tail)
        return out

    return call
