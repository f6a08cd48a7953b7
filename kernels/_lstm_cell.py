"""Serial inner kernels of the LSTM: one work item of the input projection or of one step.

Row by row (small batches): a block is 8 hidden units; its weights are two packed panels
[K, 16]: panel 0 holds gates i and f of the 8 units, panel 1 gates g and o. The input
projection of all T B rows runs the GEMM micro-kernel of _gemm.py over them (a tile of MR rows x
the panel's 16 columns in registers, see projection_tile); each step (memory-bound) is a GEMV per
row over the same panels.
Larger batches: step_cols (below).

    c' = sig(f) c + sig(i) tanh(g),   h' = sig(o) tanh(c')

Row by row, the step's GEMV (gemv) and the gate math (cell, gru_cell) run on the SIMD layer's
vectors at the kernel's width (a Lanes argument): W / 16 of a panel row per vector, the cell
min(W, 8) units per vector with the lanes past the block masked, sigmoid and tanh the layer's
fits on whole vectors. The batch tile (step_cols) too: batch rows broadcast against W units' gate
vectors.
"""

import functools

import numba

from ._gemm import gemm_batch
from .config import I64, INLINE_GEMM, JIT_GEMM, ZERO_I64
from .simd import (
    Tile,
    sigmoid,
    tail_mask,
    tanh,
    tile_fma,
    tile_zeros,
    vfma,
    vload,
    vload_masked,
    vstore,
    vstore_masked,
    vzero,
)
from .simd.tile import fit_rows

U = 8  # hidden units per block
BLOCK_COLS = 4 * U  # pre-activation columns per block and row: i, f, g, o of its 8 units
PANEL = 2 * U  # columns of one of a block's two weight panels: two gates of its 8 units


def projection_tile(w):
    """The micro-kernel's tile for the input projection at w lanes: BLOCK_COLS columns (a
    block's projection panel: BLOCK_COLS / w vectors) and as many rows as the register file
    holds beside them: 14 x 2 at 16 lanes, 3 x 4 at 8."""
    cols = BLOCK_COLS // w
    return Tile(fit_rows(cols, w), cols)


@numba.jit(**INLINE_GEMM)
def _pre(L, acc, gx, j, ga, gg, m):
    """Gate pre-activation acc[ga + j ...] + gx[gg + j ...] of the units at j (lanes m)."""
    return vload_masked(L, acc, ga + j, m) + vload_masked(L, gx, gg + j, m)


@numba.jit(**JIT_GEMM)
def cell(L, acc, gx, c, h_out, c_out):
    """The U units of one row on whole vectors of L's width (min(W, U) units at a time, the
    lanes past U masked): pre-activations acc + gx (i f | g o) -> c_out, h_out (views)."""
    for j in range(0, U, min(L.width, U)):
        m = tail_mask(L, U - j)
        i = sigmoid(_pre(L, acc, gx, j, 0, 0, m))
        f = sigmoid(_pre(L, acc, gx, j, U, U, m))
        g = tanh(_pre(L, acc, gx, j, PANEL, PANEL, m))
        o = sigmoid(_pre(L, acc, gx, j, PANEL + U, PANEL + U, m))
        cn = vfma(f, vload_masked(L, c, j, m), i * g)
        vstore_masked(c_out, j, cn, m)
        vstore_masked(h_out, j, o * tanh(cn), m)


@numba.jit(**JIT_GEMM)
def gru_cell(L, acc, gx, h, h_out, c_out):
    """The GRU cell on the same blocks (gates z, r, n_x, n_h in the places of i, f, g, o; the
    weights of n_x are zero on h and those of n_h zero on x, b_hn is n_h's bias):
    z, r = sig(.), n = tanh(n_x + r n_h), h' = n + z (h - n), into h_out and c_out."""
    for j in range(0, U, min(L.width, U)):
        m = tail_mask(L, U - j)
        z = sigmoid(_pre(L, acc, gx, j, 0, 0, m))
        r = sigmoid(_pre(L, acc, gx, j, U, U, m))
        n = tanh(vfma(r, _pre(L, acc, gx, j, PANEL + U, PANEL + U, m),
                      _pre(L, acc, gx, j, PANEL, PANEL, m)))  # fmt: skip
        hn = vfma(z, vload_masked(L, h, j, m) - n, n)
        vstore_masked(h_out, j, hn, m)
        vstore_masked(c_out, j, hn, m)


@numba.jit(**JIT_GEMM)
def gemv(L, h, w0, w1, k_len, out):
    """out[:PANEL] = h @ panel w0, out[PANEL:] = h @ w1 (one batch row: each weight is used
    once, so the product is bound by streaming the panels, [K, PANEL] each, from memory).

    At the plans' widths (prepare_lstm takes 8 and 16 lanes only) a panel row is one vector
    at 16 lanes and two at 8; the branch on the constant width leaves that width's code.
    Several k-chains hide the FMA latency (k, k + 1, ... into separate accumulators, summed
    at the end).
    """
    w = L.width
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = vzero(L)
    if w == PANEL:  # a panel row is one vector: four k-chains, 8 FMAs in flight (2 chains, 4
        # in flight, took 856 cycles for K = 256 at 16 lanes, 717 so: the panels' 32 KB from L2)
        for kk in range(k_len // 4):
            k = 4 * kk
            o = PANEL * k
            a0, b0 = vfma(h[k], vload(L, w0, o), a0), vfma(h[k], vload(L, w1, o), b0)
            c0, d0 = (
                vfma(h[k + 1], vload(L, w0, o + PANEL), c0),
                vfma(h[k + 1], vload(L, w1, o + PANEL), d0),
            )
            a1, b1 = (
                vfma(h[k + 2], vload(L, w0, o + 2 * PANEL), a1),
                vfma(h[k + 2], vload(L, w1, o + 2 * PANEL), b1),
            )
            c1, d1 = (
                vfma(h[k + 3], vload(L, w0, o + 3 * PANEL), c1),
                vfma(h[k + 3], vload(L, w1, o + 3 * PANEL), d1),
            )
        for k in range(k_len - k_len % 4, k_len):
            o = PANEL * k
            a0, b0 = vfma(h[k], vload(L, w0, o), a0), vfma(h[k], vload(L, w1, o), b0)
        vstore(out, 0, (a0 + c0) + (a1 + c1))
        vstore(out, PANEL, (b0 + d0) + (b1 + d1))
        return
    for kk in range(k_len // 2):  # 8 lanes: a panel row is two vectors; two k-chains
        k = 2 * kk
        s, t, o, p = h[k], h[k + 1], PANEL * k, PANEL * k + PANEL
        a0, c0 = vfma(s, vload(L, w0, o), a0), vfma(t, vload(L, w0, p), c0)
        b0, d0 = vfma(s, vload(L, w1, o), b0), vfma(t, vload(L, w1, p), d0)
        a1, c1 = vfma(s, vload(L, w0, o + w), a1), vfma(t, vload(L, w0, p + w), c1)
        b1, d1 = vfma(s, vload(L, w1, o + w), b1), vfma(t, vload(L, w1, p + w), d1)
    if k_len % 2:
        s, o = h[k_len - 1], PANEL * (k_len - 1)
        a0, b0 = vfma(s, vload(L, w0, o), a0), vfma(s, vload(L, w1, o), b0)
        a1, b1 = vfma(s, vload(L, w0, o + w), a1), vfma(s, vload(L, w1, o + w), b1)
    vstore(out, 0, a0 + c0)
    vstore(out, PANEL, b0 + d0)
    vstore(out, w, a1 + c1)
    vstore(out, PANEL + w, b1 + d1)


@numba.jit(**INLINE_GEMM)
def _units(L, w, q, m):
    """n_h's U weights of one k, w[q : q + U] (a compact panel [K, U], see gru.gru_panels), as
    one vector: whole at 8 lanes, at 16 its first U lanes (mask m; the rest zero)."""
    if L.width > U:
        return vload_masked(L, w, q, m)
    return vload(L, w, q)


@numba.jit(**INLINE_GEMM)
def _store_units(L, v, out, oo, m):
    """out[oo : oo + U] = v's first U lanes."""
    if L.width > U:
        vstore_masked(out, oo, v, m)
    else:
        vstore(out, oo, v)


@numba.jit(**JIT_GEMM)
def gemv_units(L, h, w, k_len, out, oo):
    """out[oo : oo + U] = h @ w, w n_h's compact panel [K, U] (the reset-before GRU's second
    stage, kernels/gru.py): four k-chains, bound by streaming w."""
    m = tail_mask(L, U)
    a = b = c = d = vzero(L)
    for kk in range(k_len // 4):
        k = 4 * kk
        a = vfma(h[k], _units(L, w, U * k, m), a)
        b = vfma(h[k + 1], _units(L, w, U * (k + 1), m), b)
        c = vfma(h[k + 2], _units(L, w, U * (k + 2), m), c)
        d = vfma(h[k + 3], _units(L, w, U * (k + 3), m), d)
    for k in range(k_len - k_len % 4, k_len):
        a = vfma(h[k], _units(L, w, U * k, m), a)
    _store_units(L, (a + c) + (b + d), out, oo, m)


@numba.jit(**JIT_GEMM)
def gemv_gru(L, h, w0, w1, k_len, out):
    """The GRU's step GEMV at 8 or 16 lanes (the plans' widths): out[:PANEL] = h @ w0 (gates
    z | r of the block's U units), out[PANEL : PANEL + U] = 0 (n_x: x's alone), out[PANEL + U :
    BLOCK_COLS] = h @ w1, w1 n_h's compact panel [K, U] (gru.gru_panels). The LSTM's second
    panel [K, PANEL] would hold n_x's zeros beside n_h: a quarter of the bytes each step
    streams, for nothing (bench/NOTES.md). Four k-chains where a row of w0 is one vector (16
    lanes, as gemv), else two."""
    w = L.width
    m = tail_mask(L, U)
    a0 = a1 = c0 = c1 = b = d = e = f = vzero(L)
    if w > U:  # 16 lanes: a row of w0 is one vector
        for kk in range(k_len // 4):
            k = 4 * kk
            o = PANEL * k
            a0, b = vfma(h[k], vload(L, w0, o), a0), vfma(h[k], _units(L, w1, U * k, m), b)
            c0 = vfma(h[k + 1], vload(L, w0, o + PANEL), c0)
            d = vfma(h[k + 1], _units(L, w1, U * (k + 1), m), d)
            a1 = vfma(h[k + 2], vload(L, w0, o + 2 * PANEL), a1)
            e = vfma(h[k + 2], _units(L, w1, U * (k + 2), m), e)
            c1 = vfma(h[k + 3], vload(L, w0, o + 3 * PANEL), c1)
            f = vfma(h[k + 3], _units(L, w1, U * (k + 3), m), f)
        for k in range(k_len - k_len % 4, k_len):
            a0 = vfma(h[k], vload(L, w0, PANEL * k), a0)
            b = vfma(h[k], _units(L, w1, U * k, m), b)
        vstore(out, 0, (a0 + c0) + (a1 + c1))
    else:  # 8 lanes: a row of w0 is two vectors (z, r)
        for kk in range(k_len // 2):
            k = 2 * kk
            s, t, o, p = h[k], h[k + 1], PANEL * k, PANEL * k + PANEL
            a0, c0 = vfma(s, vload(L, w0, o), a0), vfma(t, vload(L, w0, p), c0)
            a1, c1 = vfma(s, vload(L, w0, o + w), a1), vfma(t, vload(L, w0, p + w), c1)
            b, d = vfma(s, _units(L, w1, U * k, m), b), vfma(t, _units(L, w1, U * (k + 1), m), d)
        if k_len % 2:
            s, o = h[k_len - 1], PANEL * (k_len - 1)
            a0, a1 = vfma(s, vload(L, w0, o), a0), vfma(s, vload(L, w0, o + w), a1)
            b = vfma(s, _units(L, w1, U * (k_len - 1), m), b)
        vstore(out, 0, a0 + c0)
        vstore(out, w, a1 + c1)
    _store_units(L, vzero(L), out, PANEL, m)
    _store_units(L, (b + e) + (d + f), out, PANEL + U, m)


@numba.jit(**INLINE_GEMM)
def _project_row(L, xp, o, stride, w, k_len, out, oo):
    """out[oo : oo + BLOCK_COLS] = sum_k xp[o + k stride] w[k BLOCK_COLS ...]: one row of x
    (strided in its packed panel) against the block's projection panel, a GEMV; two k-chains
    (k and k + 1 apart) beside the BLOCK_COLS / W column vectors."""
    wd, n = L.width, BLOCK_COLS // L.width
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vzero(L)
    for kk in range(k_len // 2):
        k = 2 * kk
        s, t = xp[o + k * stride], xp[o + (k + 1) * stride]
        p, q = BLOCK_COLS * k, BLOCK_COLS * (k + 1)
        a0, b0 = vfma(s, vload(L, w, p), a0), vfma(t, vload(L, w, q), b0)
        a1, b1 = vfma(s, vload(L, w, p + wd), a1), vfma(t, vload(L, w, q + wd), b1)
        if n > 2:
            a2, b2 = vfma(s, vload(L, w, p + 2 * wd), a2), vfma(t, vload(L, w, q + 2 * wd), b2)
            a3, b3 = vfma(s, vload(L, w, p + 3 * wd), a3), vfma(t, vload(L, w, q + 3 * wd), b3)
    if k_len % 2:
        s, p = xp[o + (k_len - 1) * stride], BLOCK_COLS * (k_len - 1)
        a0, a1 = vfma(s, vload(L, w, p), a0), vfma(s, vload(L, w, p + wd), a1)
        if n > 2:
            a2, a3 = vfma(s, vload(L, w, p + 2 * wd), a2), vfma(s, vload(L, w, p + 3 * wd), a3)
    vstore(out, oo, a0 + b0)
    vstore(out, oo + wd, a1 + b1)
    if n > 2:
        vstore(out, oo + 2 * wd, a2 + b2)
        vstore(out, oo + 3 * wd, a3 + b3)


@numba.jit(**JIT_GEMM)
def project(L, T, xp, w, bias, rows, gx, tiles, gru):
    """gx[r] = x[r] @ Wx_block + bias_block for all rows. xp holds x as [K, MR]-row panels (MR =
    T.rows), w the block's projection panel [K * BLOCK_COLS] (i f | g o side by side, one row
    per k: projection_panels); tiles is [MR * BLOCK_COLS] scratch. A group of MR rows runs on
    the micro-kernel (L, T: its width and tile, T.cols L.width = BLOCK_COLS); a last group of
    n < MR rows runs as n GEMVs when they load less (n (1 + cols) loads per k against the
    tile's MR + cols: the tile computes all MR rows, 30 for one at 16 lanes before the panels
    were joined, the whole fixed cost of a short sequence).
    gru: the n_h columns (x's weights all zero there) are b_hn alone, not x @ 0 + b_hn, which
    an infinite x would make NaN (0 * inf)."""
    k_len, mr = w.shape[0] // BLOCK_COLS, T.rows
    for g in range(xp.shape[0]):  # x panel g against the block's panel
        n = min(mr, rows - mr * g)
        if n == mr or n * (1 + T.cols) >= mr + T.cols:
            gemm_batch(L, T, xp, g * xp.shape[1], ZERO_I64, w, ZERO_I64, ZERO_I64, I64[1], k_len,
                       tiles)  # fmt: skip
        else:
            xf = xp.reshape(-1)
            for r in range(n):
                _project_row(L, xf, g * xp.shape[1] + r, mr, w, k_len, tiles, r * BLOCK_COLS)
        for r in range(n):
            dst = gx[mr * g + r]
            for q in range(BLOCK_COLS):
                dst[q] = tiles[r * BLOCK_COLS + q] + bias[q]
            if gru:
                for q in range(PANEL + U, BLOCK_COLS):
                    dst[q] = bias[q]


@numba.jit(**INLINE_GEMM)
def step(L, t, b, w, gx, hs, cs, acc, gru):
    """Units of block b at step t for each of the R batch rows, from hs[t] (hs, cs are
    [T + 1, R, Hp] with row 0 the initial state; gx row t R + r is row r's projected input);
    acc is [BLOCK_COLS] scratch for the gate pre-activations. The block's weights (32 KB at
    H = 256) come from L3 for the first row and from L1/L2 for the others.
    Inlined into the driver: a call costs an atomic reference-count increment and decrement
    per array argument, felt at batch 1. Its helpers stay calls: Numba inlines by
    copying IR, and nesting cell8's copies made compiles explode.
    Batches above lstm.ROWS_MAX run step_cols (below). gru: the GRU cell (gru_cell), whose
    state is h alone.
    """
    j0, rows = b * U, hs.shape[1]
    for r in range(rows):
        if gru:
            gemv_gru(L, hs[t, r], w[0], w[1], w.shape[1] // PANEL, acc)
            gru_cell(L, acc, gx[t * rows + r], hs[t, r, j0:], hs[t + 1, r, j0:],
                     cs[t + 1, r, j0:])  # fmt: skip
        else:
            gemv(L, hs[t, r], w[0], w[1], w.shape[1] // PANEL, acc)
            cell(L, acc, gx[t * rows + r], cs[t, r, j0:], hs[t + 1, r, j0:], cs[t + 1, r, j0:])


# Larger batches: the step as a GEMM, G [B, 4H] = [x_t, h_{t-1}] [Wx; Wh], in the orientation of the
# GEMM micro-kernel: batch rows broadcast, gate columns as vectors. A group of W hidden units
# (W the kernel's width) has one weight panel [K, 4 W], K = I + Hg: per k its four gates' W
# columns (i f g o), so a tile of R batch rows x 4 vectors holds everything the cell needs for
# R rows of those W units, and the gate math runs on the accumulators as they leave the k loop:
# R 4 FMAs per R broadcasts + 4 loads, R 4 independent chains (R from the register file:
# column_rows). The batch comes in panels of COLS rows, [COLS, K] per step ([x_t, h_{t-1}] of
# each row), so a group's h_t goes straight into the next step's panel, W contiguous floats.
# The input projection is the first I rows of the same k loop. The weights are read once per
# row tile from L2 (R rows of the panel share them), the [COLS, K] panel stays in L1. Against
# the batch along the lanes (a unit's 4 gates broadcast: 4 broadcasts + 1 load per 4 FMAs, on
# 4 chains; the GRU's 3, 2 and 1) the GRU ran 1.18-1.35x faster, the LSTM 0.98-1.17x
# (bench/NOTES.md, "The recurrent batch tile turned around").
COLS = 16  # batch rows per panel


@functools.cache
def column_rows(w: int) -> int:
    """R, the batch rows of the step's tile at w lanes: the most that fit the register file
    beside 4 gate vectors (simd.tile.fit_rows) among the divisors of COLS, so a panel is whole
    tiles (one tile shape per gate count is compiled): 4 with AVX-512's 32 registers (at 16
    lanes or 8), 2 with AVX2's 16 at 8 lanes."""
    fit = fit_rows(4, w)
    return max(r for r in range(1, COLS + 1) if COLS % r == 0 and r <= fit)


@numba.jit(**JIT_GEMM)
def step_cols(L, T4, T3, T2, T1, t, g, q, rows, w, bias, z, c, hidden, gru):
    """Units of group g (W = L.width of them) at step t for the first `rows` batch rows of
    panel q, in tiles of R = T4.rows rows (T4, T3, T2, T1: R x 4, 3, 2, 1 gate vectors): whole
    tiles, ceil(rows / R) R rows, inside the panel as R divides COLS; the rows past the batch
    read the zeros _pack_step put there and write only their own places.

    z[t, q] is the panel [COLS, K] of batch rows COLS q ...: row r holds x_t (I floats), then
    h_{t-1} (Hg floats: whole groups); c[t, q] is c_{t-1} as [COLS, Hg]. Writes h_t into
    z[t + 1] and c_t into c[t + 1] (the outputs are unpacked from there once all steps are
    done, see lstm._unpack_step). w[g] is the group's [K, 4 W] weight panel, bias[g] its [4 W]
    biases.
    The units past `hidden` (zero weights) compute garbage in their lanes
    (an infinite input times a zero weight is NaN), which lands only in their own places of h
    and c: the k loop stops at I + hidden, so no real unit reads them.
    gru: the GRU cell (gates z, r, n_x, n_h as gru_cell's, n_x's weights zero on h and n_h's
    on x, so neither is multiplied there), its state h kept in c.
    Flat offsets into z and c, no views: each view of a panel costs a reference count."""
    wd, gw = L.width, 4 * L.width
    units = c.shape[2] // COLS
    kz = z.shape[2] // COLS
    i_len = kz - units
    k_len = i_len + hidden
    zf, cf, a, bj = z.reshape(-1), c.reshape(-1), w[g], bias[g]
    z_in, z_out = (t * z.shape[1] + q) * z.shape[2], ((t + 1) * z.shape[1] + q) * z.shape[2]
    c_in, c_out = (t * c.shape[1] + q) * c.shape[2], ((t + 1) * c.shape[1] + q) * c.shape[2]
    j0 = g * wd
    b0, b1, b2, b3 = vload(L, bj, 0), vload(L, bj, wd), vload(L, bj, 2 * wd), vload(L, bj, 3 * wd)
    if gru:
        for r0 in range(0, rows, T4.rows):
            zo = z_in + r0 * kz
            zrx = tile_zeros(L, T3)
            for k in range(i_len):
                zrx = tile_fma(zrx, zf, zo + k, kz, a, gw * k)
            zr, nh = tile_zeros(L, T2), tile_zeros(L, T1)
            for k in range(i_len, k_len):
                zr = tile_fma(zr, zf, zo + k, kz, a, gw * k)
                nh = tile_fma(nh, zf, zo + k, kz, a, gw * k + 3 * wd)
            for r in range(T4.rows):
                zg = sigmoid(zrx[r][0] + zr[r][0] + b0)
                rg = sigmoid(zrx[r][1] + zr[r][1] + b1)
                n = tanh(vfma(rg, nh[r][0] + b3, zrx[r][2] + b2))
                cr = (r0 + r) * units + j0
                hn = vfma(zg, vload(L, cf, c_in + cr) - n, n)
                vstore(zf, z_out + (r0 + r) * kz + i_len + j0, hn)
                vstore(cf, c_out + cr, hn)
        return
    for r0 in range(0, rows, T4.rows):
        acc = tile_zeros(L, T4)
        for k in range(k_len):
            acc = tile_fma(acc, zf, z_in + r0 * kz + k, kz, a, gw * k)
        for r in range(T4.rows):
            gi, gf = sigmoid(acc[r][0] + b0), sigmoid(acc[r][1] + b1)
            gg, go = tanh(acc[r][2] + b2), sigmoid(acc[r][3] + b3)
            cr = (r0 + r) * units + j0
            cn = vfma(gf, vload(L, cf, c_in + cr), gi * gg)
            vstore(zf, z_out + (r0 + r) * kz + i_len + j0, go * tanh(cn))
            vstore(cf, c_out + cr, cn)
