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
fits on whole vectors. The column tile (step_cols) too: batch columns along the lanes.
"""

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

    A panel row is PANEL / W vectors at L's width (1 at 16 lanes, 2 at 8, 4 at 4); the
    branches on the constant n leave only the accumulators that width needs. Two k-chains
    hide the FMA latency (k and k + 1 into separate accumulators, summed at the end).
    """
    w, n = L.width, PANEL // L.width
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vzero(L)
    c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = vzero(L)
    if n == 1:  # a panel row is one vector: four k-chains, 8 FMAs in flight (2 chains, 4 in
        # flight, took 856 cycles for K = 256 at 16 lanes, 717 so: the panels' 32 KB from L2)
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
    for kk in range(k_len // 2):
        k = 2 * kk
        s, t, o, p = h[k], h[k + 1], PANEL * k, PANEL * k + PANEL
        a0, c0 = vfma(s, vload(L, w0, o), a0), vfma(t, vload(L, w0, p), c0)
        b0, d0 = vfma(s, vload(L, w1, o), b0), vfma(t, vload(L, w1, p), d0)
        if n > 1:
            a1, c1 = vfma(s, vload(L, w0, o + w), a1), vfma(t, vload(L, w0, p + w), c1)
            b1, d1 = vfma(s, vload(L, w1, o + w), b1), vfma(t, vload(L, w1, p + w), d1)
        if n > 2:
            a2, c2 = vfma(s, vload(L, w0, o + 2 * w), a2), vfma(t, vload(L, w0, p + 2 * w), c2)
            b2, d2 = vfma(s, vload(L, w1, o + 2 * w), b2), vfma(t, vload(L, w1, p + 2 * w), d2)
            a3, c3 = vfma(s, vload(L, w0, o + 3 * w), a3), vfma(t, vload(L, w0, p + 3 * w), c3)
            b3, d3 = vfma(s, vload(L, w1, o + 3 * w), b3), vfma(t, vload(L, w1, p + 3 * w), d3)
    if k_len % 2:
        s, o = h[k_len - 1], PANEL * (k_len - 1)
        a0, b0 = vfma(s, vload(L, w0, o), a0), vfma(s, vload(L, w1, o), b0)
        if n > 1:
            a1, b1 = vfma(s, vload(L, w0, o + w), a1), vfma(s, vload(L, w1, o + w), b1)
        if n > 2:
            a2, b2 = vfma(s, vload(L, w0, o + 2 * w), a2), vfma(s, vload(L, w1, o + 2 * w), b2)
            a3, b3 = vfma(s, vload(L, w0, o + 3 * w), a3), vfma(s, vload(L, w1, o + 3 * w), b3)
    vstore(out, 0, a0 + c0)
    vstore(out, PANEL, b0 + d0)
    if n > 1:
        vstore(out, w, a1 + c1)
        vstore(out, PANEL + w, b1 + d1)
    if n > 2:
        vstore(out, 2 * w, a2 + c2)
        vstore(out, PANEL + 2 * w, b2 + d2)
        vstore(out, 3 * w, a3 + c3)
        vstore(out, PANEL + 3 * w, b3 + d3)


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
    Batch > 1 runs step_cols (below). gru: the GRU cell (gru_cell), whose state is h alone.
    """
    j0, rows = b * U, hs.shape[1]
    for r in range(rows):
        gemv(L, hs[t, r], w[0], w[1], w.shape[1] // PANEL, acc)
        if gru:
            gru_cell(L, acc, gx[t * rows + r], hs[t, r, j0:], hs[t + 1, r, j0:],
                     cs[t + 1, r, j0:])  # fmt: skip
        else:
            cell(L, acc, gx[t * rows + r], cs[t, r, j0:], hs[t + 1, r, j0:], cs[t + 1, r, j0:])


# Batch > 1: the step as a GEMM turned around, gates^T [4 H, B] = [Wx; Wh]^T [x_t; h_{t-1}]^T.
# A unit's four gate columns (i f g o) are one [K, 4] weight panel, K = I + Hp, and the batch
# runs along the vector lanes in panels of COLS = 16 columns (one vector at 16 lanes, two at 8):
# a tile of 4 gates x the panel's vectors (simd.tile: the gates' weights broadcast, the panel's
# row loaded) holds everything the cell needs for one unit, so the gate math runs on the
# accumulators as they leave the k loop and h_t goes straight into the next step's panel. The
# weights are read once per step (4 floats per k), the [K, 16] panels of x_t and h_{t-1} (24 KB
# at I + H = 384) stay in L1, and the input projection is the first I rows of the same k loop.
COLS = 16  # batch columns per panel


@numba.jit(**INLINE_GEMM)
def _gates(L, T4, a, z, zo, k_len):
    """The LSTM's four gates of one unit over its panel at flat offset zo of z: sum_k a[4 k + g]
    z[zo + COLS k ...] for g < 4 (the bias is added after)."""
    acc = tile_zeros(L, T4)
    for k in range(k_len):
        acc = tile_fma(acc, a, 4 * k, 1, z, zo + COLS * k)
    return acc


@numba.jit(**INLINE_GEMM)
def _gates_gru(L, T3, T2, T1, a, z, zo, i_len, k_len):
    """The GRU's gates z, r, n_x over x's rows (k < i_len) and z, r, n_h over h's: n_x's
    weights are zero on h and n_h's on x, and are not multiplied there (a quarter fewer
    multiply-adds, and no 0 * inf turning an infinite input into NaN)."""
    zrx = tile_zeros(L, T3)
    for k in range(i_len):
        zrx = tile_fma(zrx, a, 4 * k, 1, z, zo + COLS * k)
    zr, nh = tile_zeros(L, T2), tile_zeros(L, T1)
    for k in range(i_len, k_len):
        zr = tile_fma(zr, a, 4 * k, 1, z, zo + COLS * k)
        nh = tile_fma(nh, a, 4 * k + 3, 1, z, zo + COLS * k)
    return zrx, zr, nh


@numba.jit(**JIT_GEMM)
def step_cols(L, T4, T3, T2, T1, t, b, q, w, bias, z, c, hidden, gru):
    """Units of block b at step t for batch panel q (COLS columns, T4.cols vectors of L's
    width; T3, T2, T1: the GRU's tiles of 3, 2 and 1 gates over the same vectors).

    z[t, q] is the [K, COLS] panel of batch columns COLS q ...: x_t in rows < I, h_{t-1} below;
    c[t, q] is c_{t-1} as [Hp, COLS]. Writes h_t into z[t + 1] and c_t into c[t + 1] (the
    outputs are unpacked from there once all steps are done, see lstm._unpack_step). Units past
    `hidden` (the last block's padding) are neither computed nor read: their zero weights
    would turn an infinite input into NaN (0 * inf), and the NaN would spread to every unit.
    gru: the GRU cell (gates z, r, n_x, n_h as gru_cell's), its state h kept in c.
    Flat offsets into z and c, no views: each view of a panel costs a reference count."""
    wd = L.width
    i_len = w.shape[1] // 4 - c.shape[2] // COLS
    k_len = i_len + hidden
    zf, cf = z.reshape(-1), c.reshape(-1)
    z_in, z_out = (t * z.shape[1] + q) * z.shape[2], ((t + 1) * z.shape[1] + q) * z.shape[2]
    c_in, c_out = (t * c.shape[1] + q) * c.shape[2], ((t + 1) * c.shape[1] + q) * c.shape[2]
    for u in range(min(U, hidden - b * U)):
        j = b * U + u
        a, bj = w[j], bias[j]
        h_at, c_at = COLS * (i_len + j), COLS * j
        if gru:
            zrx, zr, nh = _gates_gru(L, T3, T2, T1, a, zf, z_in, i_len, k_len)
            for v in range(T4.cols):
                o = v * wd
                zg = sigmoid(zrx[0][v] + zr[0][v] + bj[0])
                rg = sigmoid(zrx[1][v] + zr[1][v] + bj[1])
                n = tanh(vfma(rg, nh[0][v] + bj[3], zrx[2][v] + bj[2]))
                hn = vfma(zg, vload(L, cf, c_in + c_at + o) - n, n)
                vstore(zf, z_out + h_at + o, hn)
                vstore(cf, c_out + c_at + o, hn)
        else:
            acc = _gates(L, T4, a, zf, z_in, k_len)
            for v in range(T4.cols):
                o = v * wd
                gi, gf = sigmoid(acc[0][v] + bj[0]), sigmoid(acc[1][v] + bj[1])
                gg, go = tanh(acc[2][v] + bj[2]), sigmoid(acc[3][v] + bj[3])
                cn = vfma(gf, vload(L, cf, c_in + c_at + o), gi * gg)
                vstore(zf, z_out + h_at + o, go * tanh(cn))
                vstore(cf, c_out + c_at + o, cn)
