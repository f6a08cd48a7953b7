"""Winograd F(m x m, 3x3) on blocked tensors [N, C/b, H, W, b]: the driver F(2x2) and F(4x4) share.

Each m x m output tile comes from an a x a input patch d (a = m + 2, Lavin & Gray 2015):

    Y = A^T [ sum_c U_c * (B^T d_c B) ] A,   U_c = G g_c G^T     (* elementwise over a x a)

In the blocked layout a pixel is a vector of b channels, so B^T d B and A^T M A are lane-
parallel vector sums over a block's channels (no transposes), and the channel sum becomes a*a
independent GEMMs, M[xi] [tiles, M] = V[xi] [tiles, C] U[xi] [C, M], run on the register tile
(simd.tile: rows = tiles, each a broadcast of V; cols = output blocks, vectors of U). U is
transformed in float64 and packed once ([OGG, a*a, K, FB b], K = C padded to blocks).

A work item is (image, group of P tiles, range of output-block groups): it transforms its
tiles' patches for every input block into a private V [a*a, P, K] (sized to half of L2 by the
wrapper), then per FB output blocks and PR tiles (the register tile) runs the a*a GEMMs into
mt [a*a, PR, FB b] (L1) and transforms them back, the epilogue (bias, residual, activation:
epilogue.finish) applied to each output vector before it is stored. No shared buffer, no
barrier.

NaN/inf: a transform mixes a patch's pixels, so one NaN would reach outputs that a direct conv
leaves finite. Every transformed value is checked (v * 0 is NaN exactly for inf and NaN); an
item that saw one sets bad[0] and the caller runs the direct kernel instead.
"""

import numba

from .config import JIT_GEMM, PARALLEL
from .epilogue import finish
from .simd import hsum, tile_fma, tile_store, tile_zeros, vbroadcast, vfma, vload, vstore, vzero
from .simd.activation import clip_bounds, clips

# geometry fields (int64 array g)
N, CB, H, W, PT, PL, OH, OW, MB, M, TW, T_LEN, P, N_TG, OGG, FB, N_MS, RESIDUAL, KIND = range(19)
N_GEO = 19


@numba.jit(**JIT_GEMM)
def _transform_tile(L, xf, g, n, cb, t, bt, v, do, eo, vo):
    """v[vo + xi P K] (xi < a*a) = (B^T d B)[xi] for tile t's patch d of input block cb (b lanes
    each), zero outside the image; returns sum v * 0 (NaN when an inf or NaN was transformed).
    d and e (B^T d) are a*a vectors of scratch at v[do], v[eo]."""
    b = L.width
    m = g[M]
    a = m + 2
    h, w = g[H], g[W]
    r0 = m * (t // g[TW]) - g[PT]
    s0 = m * (t % g[TW]) - g[PL]
    base = (n * g[CB] + cb) * h
    for i in range(a):
        y = r0 + i
        for j in range(a):
            xx = s0 + j
            if 0 <= y < h and 0 <= xx < w:
                vstore(v, do + (i * a + j) * b, vload(L, xf, ((base + y) * w + xx) * b))
            else:
                vstore(v, do + (i * a + j) * b, vzero(L))
    # e = B^T d: row k is sum_i bt[k, i] d[i, :]
    for k in range(a):
        for j in range(a):
            acc = vzero(L)
            for i in range(a):
                c = bt[k, i]
                if c != 0:
                    acc = vfma(vbroadcast(L, c), vload(L, v, do + (i * a + j) * b), acc)
            vstore(v, eo + (k * a + j) * b, acc)
    # (B^T d) B: element (k, u_) is sum_j e[k, j] bt[u_, j]
    stride = g[P] * (g[CB] * b)
    probe = vzero(L)
    zero = vzero(L)
    for k in range(a):
        for u_ in range(a):
            acc = vzero(L)
            for j in range(a):
                c = bt[u_, j]
                if c != 0:
                    acc = vfma(vbroadcast(L, c), vload(L, v, eo + (k * a + j) * b), acc)
            vstore(v, vo + (k * a + u_) * stride, acc)
            probe = vfma(acc, zero, probe)
    return probe


@numba.jit(**JIT_GEMM)
def _output_tiles(L, T, s, mo, eo, rows, n, og, t0, g, at, bias, yf, res, act_a, act_b, lo,
                  hi, simple):  # fmt: skip
    """Y = A^T M A for the `rows` tiles t0 .. of mt [a*a, PR, FB b], each of the FB blocks of
    output group og (mt at s[mo], e = A^T M scratch at s[eo]), plus the bias and the
    epilogue, stored where the tile lies inside the output (the last row and column of tiles
    may hang over it)."""
    b = L.width
    m = g[M]
    a = m + 2
    fb, pr = T.cols, T.rows
    oh, ow = g[OH], g[OW]
    xs = pr * fb * b  # one xi's stride in mt
    for f in range(fb):
        mb = og * fb + f
        if mb >= g[MB]:
            break
        bv = vload(L, bias, mb * b)
        for r in range(rows):
            o = (r * fb + f) * b
            for i in range(m):  # e = A^T M: row i is sum_k at[i, k] M[k, :]
                for u_ in range(a):
                    acc = vzero(L)
                    for k in range(a):
                        c = at[i, k]
                        if c != 0:
                            acc = vfma(
                                vbroadcast(L, c), vload(L, s, mo + o + (k * a + u_) * xs), acc
                            )
                    vstore(s, eo + (i * a + u_) * b, acc)
            t = t0 + r
            y0, x0 = m * (t // g[TW]), m * (t % g[TW])
            for i in range(min(m, oh - y0)):
                for j in range(min(m, ow - x0)):
                    acc = bv  # (A^T M) A: element (i, j) is sum_l e[i, u_] at[j, u_]
                    for u_ in range(a):
                        c = at[j, u_]
                        if c != 0:
                            acc = vfma(vbroadcast(L, c), vload(L, s, eo + (i * a + u_) * b), acc)
                    q = (((n * g[MB] + mb) * oh + y0 + i) * ow + x0 + j) * b
                    vstore(yf, q, finish(acc, vload(L, res, q), g[RESIDUAL], simple, lo, hi,
                                         g[KIND], act_a, act_b))  # fmt: skip


@numba.jit(**PARALLEL)
def winograd_blocked(L, T, xf, u, bias, yf, res, g, bt, at, act_a, act_b, scratch, bad):
    """yf = epilogue(conv3x3(xf)) with F(m x m, 3x3), m = g[M], on blocked flat arrays: xf
    [N, CB, H, W, b], yf and res [N, MB, OH, OW, b]; u the packed transformed weights
    [OGG, a*a, K, FB b]; bias [OGG FB b]; bt [a, a] = B^T, at [m, a] = A^T (float32); scratch
    [threads, a*a P K + a*a PR FB b + 2 a*a b] (kernels.workspace.per_thread). Sets bad[0]
    when a transformed value was inf or NaN (the caller then runs the direct conv)."""
    b = L.width
    a = g[M] + 2
    a2 = a * a
    k_len = g[CB] * b
    p_len, n_tg, n_ms, ogg = g[P], g[N_TG], g[N_MS], g[OGG]
    pr, fb = T.rows, T.cols
    kind = g[KIND]
    simple = clips(kind)
    lo, hi = clip_bounds(kind, act_a, act_b)
    og_per = (ogg + n_ms - 1) // n_ms
    v_size = a2 * p_len * k_len
    mt_off = v_size
    d_off = mt_off + a2 * pr * fb * b
    e_off = d_off + a2 * b
    for item in numba.prange(g[N] * n_tg * n_ms):
        n, tg, ms = item // (n_tg * n_ms), (item // n_ms) % n_tg, item % n_ms
        s = scratch[numba.get_thread_id()]
        t_first = tg * p_len
        tiles = min(p_len, g[T_LEN] - t_first)
        probe = vzero(L)
        for cb in range(g[CB]):
            for p in range(tiles):
                probe = probe + _transform_tile(L, xf, g, n, cb, t_first + p, bt, s, d_off,
                                                e_off, p * k_len + cb * b)  # fmt: skip
        if hsum(probe) != 0:  # NaN != 0 too
            bad[0] = 1  # any item may set it; all set the same value
        for og in range(ms * og_per, min(ogg, (ms + 1) * og_per)):
            for p0 in range(0, tiles, pr):
                for xi in range(a2):
                    acc = tile_zeros(L, T)
                    vo = (xi * p_len + p0) * k_len
                    uo = (og * a2 + xi) * k_len * fb * b
                    for c in range(k_len):
                        acc = tile_fma(acc, s, vo + c, k_len, u, uo + c * fb * b)
                    tile_store(s, mt_off + xi * pr * fb * b, acc)
                _output_tiles(L, T, s, mt_off, e_off, min(pr, tiles - p0), n, og, t_first + p0,
                              g, at, bias, yf, res, act_a, act_b, lo, hi, simple)  # fmt: skip
