"""Multi-head attention as one kernel, scores never materialized beyond one tile:

    Q, K, V = x Wq + bq, x Wk + bk, x Wv + bv      (one GEMM on the concatenated weights)
    O_h = softmax(scale Q_h K_g^T + M) V_g          g = h // (H / Hkv): grouped-query attention
    y = concat_h(O_h) Wo + bo (+ r)
    with a rotary embedding (Llama), before the scores: Q_h, K_g turned per position s
    t'[i] = t[i] cos[s, i] - t[i + D/2] sin[s, i],  t'[i + D/2] = t[i + D/2] cos[s, i + D/2]
    + t[i] sin[s, i + D/2]  (t cos + rotate_half(t) sin, the rotate-half form), i < D/2

x [B, S, E]; M an additive mask broadcastable to [B, H, S, S] (padding, causal, or both, as
exporters build it: 0 where attended, a large negative value elsewhere); r the residual.

The core is flash attention on the CPU: per (batch, head, block of BQ queries) a running row
maximum m, row sum l and output accumulator, updated one block of BK keys at a time:
    s = scale q k^T + M;  m' = max(m, max_j s);  p = exp(s - m')
    l = l e^(m - m') + sum_j p;  acc = acc e^(m - m') + p V;   O = acc / l
Both products are register-tile GEMMs on the SIMD layer (kernels/simd/tile.py: the GEMM
micro-kernel's MR x NR tile at the CPU's width, any head size): s = (scale Q) K^T with Q's rows
broadcast against K^T's rows (K transposed and V packed once per (batch, kv head), zero-padded
to whole tiles), then acc e^(m - m') + P V with P's rows broadcast against V's, the rescale
fused into the tile's store. The softmax runs along a row of scores in vectors (exp of
kernels/simd/approx.py), its tail and the head size's under lane masks. A key block outside
the span of keys the block's queries attend (mask entries at or above -1e30) is skipped when
every query row attends some key (then exp underflows to exactly 0 there, as in onnxruntime's
Softmax): a causal mask costs half the work.
The driver is parallel over (batch, head, query block); each task has its own scratch.
The two projections are kernels/dense_gemm.py's GEMM on weights packed once (the caller's
plans), their biases and the residual applied in its epilogue; the QKV product is stored
straight into the buffer the core reads.
"""

import numba
import numpy as np

from . import _gemm
from .config import INLINE, INLINE_FIT, JIT_GEMM, PARALLEL
from .dense_gemm import dense_gemm
from .machine import cache_bytes
from .simd import (
    exp,
    hmax,
    hsum,
    tail_mask,
    tile_fma,
    tile_zeros,
    vany,
    vbroadcast,
    vfma,
    vload,
    vload_masked,
    vmax,
    vselect,
    vstore,
    vstore_masked,
    vtranspose,
    vzero,
)
from .workspace import per_thread, shared

__all__ = ["attention", "attention_blocks", "attention_core", "rotate"]

MASKED = np.float32(-1e30)  # a mask value below this is "not attended"
f32 = np.float32
ONE, ZERO = f32(1.0), f32(0.0)
NEG_INF = f32(-np.inf)
EXP_NORMAL = f32(-87.0)  # e^-87 = 1.6e-38, above float32's least normal 1.2e-38


def attention_blocks(T, L):
    """(BQ, BK): queries and keys per block at tile T and width L: whole tiles of about 32
    queries (BQ a multiple of MR) and as many keys (a multiple of NR) as fill half of L1 with
    the block's scores, [BQ, BK] float32, beside the K^T and V rows streaming through: 128
    keys with a 32 KB L1. Each key block costs every query row a max, a sum and a rescale:
    64 keys ran 3-5% slower than 128 (bench/NOTES.md, "Attention's key blocks from L1")."""
    mr, nr = T.rows, _gemm.panel_width(T, L)
    bq = mr * -(-32 // mr)
    return bq, nr * max(1, cache_bytes(1) // 2 // (4 * bq * nr))


@numba.jit(**INLINE_FIT)
def _exp_normal(x):
    """e^x, 0 where it would be denormal (x < -87): the masked scores' e^(-inf) through the
    denormals took a microcode assist per lane, three times a block's arithmetic (bench/NOTES.md,
    attention on the SIMD layer); what is lost is below 1e-38 of a row sum of at least 1."""
    return vselect(x < EXP_NORMAL, ZERO, exp(vmax(x, EXP_NORMAL)))  # a NaN stays NaN


@numba.jit(**INLINE)
def _first_attended(L, mask, o, n):
    """The first j < n with mask[o + j] >= MASKED (not masked), else n: a vector at a time."""
    w = L.width
    for j in range(0, n, w):
        inside = tail_mask(L, n - j)  # the lanes past n load as 0, which is not a mask value
        if vany((vload_masked(L, mask, o + j, inside) >= MASKED) & inside):
            while not mask[o + j] >= MASKED:
                j += 1
            return j
    return n


@numba.jit(**INLINE)
def _last_attended(L, mask, o, n):
    """The last j < n with mask[o + j] >= MASKED, else -1: a vector at a time from the end."""
    w = L.width
    for e in range(n, 0, -w):
        j = max(e - w, 0)
        inside = tail_mask(L, e - j)
        if vany((vload_masked(L, mask, o + j, inside) >= MASKED) & inside):
            j = e - 1
            while not mask[o + j] >= MASKED:
                j -= 1
            return j
    return -1


@numba.jit(**JIT_GEMM)
def attend_block(L, T, qkv, kt, vp, mask, mshape, has_mask, out, b, h, q0, s_len, sp, dp,
                 heads, kv_heads, d_len, scale, bq, bk, qs, s, acc, m, lsum, corr,
                 nan_to_zero):  # fmt: skip
    """Queries q0 .. q0 + bq of head h, batch b, against every key: out's rows of them. A row
    whose softmax is NaN (every key -inf, or a NaN score) is NaN, or 0 with nan_to_zero.

    qs [bq, d_len]: the block's queries times scale (rows past the sequence 0); s [bq, bk]:
    the scores of one key block, then their e^(s - m'); acc [bq, dp]: the running P V."""
    w, mr = L.width, T.rows
    nr = T.cols * w
    g = h // (heads // kv_heads)
    bg = b * kv_heads + g
    nq = min(bq, s_len - q0)
    nt = -(-nq // mr) * mr  # the rows of the tiles that hold the block's queries
    row0 = b * s_len
    dw = d_len - d_len % w
    qtail = tail_mask(L, d_len - dw)
    for i in range(bq):  # the block's queries times scale, W at a time (0 past the sequence)
        qo, io = (row0 + q0 + i) * qkv.shape[1] + h * d_len, i * d_len
        if i < nq:
            for d in range(0, dw, w):
                vstore(qs, io + d, vload(L, qkv, qo + d) * scale)
            if dw < d_len:
                vstore_masked(qs, io + dw, vload_masked(L, qkv, qo + dw, qtail) * scale, qtail)
        else:
            for d in range(d_len):
                qs[io + d] = ZERO
        m[i], lsum[i], corr[i] = NEG_INF, ZERO, ONE
        for d in range(0, dp, w):
            vstore(acc, i * dp + d, vzero(L))
    n0, n1, n2 = mshape
    mq_step = 1 if n2 > 1 else 0
    mrow = ((b if n0 > 1 else 0) * n1 + (h if n1 > 1 else 0)) * n2  # query q's: mrow + q mq_step
    # The keys the block's queries attend lie in [lo, hi] (from each row's first and last key
    # not masked): the key blocks outside are skipped (a causal mask's upper blocks, a left
    # padding's first). Exact only if every query row attends to some key: then e^(s - m')
    # underflows to exactly 0 there, as in onnxruntime's Softmax.
    lo, hi = 0, s_len - 1
    if has_mask:
        lo, hi = s_len, -1
        for i in range(nq):
            o = (mrow + (q0 + i) * mq_step) * s_len
            first = _first_attended(L, mask, o, s_len)
            if first == s_len:  # a row that attends nothing: every block, as Softmax does
                lo, hi = 0, s_len - 1
                break
            lo, hi = min(lo, first), max(hi, _last_attended(L, mask, o, s_len))
    kto = bg * d_len * sp  # K^T [d_len, sp] of this (batch, kv head)
    for k0 in range(0, s_len, bk):
        nk = min(bk, s_len - k0)
        if k0 + nk <= lo or k0 > hi:
            continue
        # s = (scale Q) K^T + M: MR x NR register tiles, Q's rows broadcast, K^T's row read
        for i0 in range(0, nt, mr):
            for j0 in range(0, nk, nr):
                t = tile_zeros(L, T)
                for d in range(d_len):
                    t = tile_fma(t, qs, i0 * d_len + d, d_len, kt, kto + d * sp + k0 + j0)
                for r in range(mr):  # unrolled: the tile's indices are constants
                    mo = (mrow + (q0 + i0 + r) * mq_step) * s_len + k0 + j0
                    for c in range(T.cols):
                        v = t[r][c]
                        if has_mask and i0 + r < nq:
                            v += vload_masked(L, mask, mo + c * w, tail_mask(L, nk - j0 - c * w))
                        vstore(s, (i0 + r) * bk + j0 + c * w, v)
        # the online softmax of each row: m' = max(m, max_j s), p = e^(s - m'), l rescaled
        nkw = nk - nk % w
        tail = tail_mask(L, nk - nkw)
        for i in range(nq):
            o = i * bk
            top = vbroadcast(L, NEG_INF)
            for j in range(0, nkw, w):
                top = vmax(top, vload(L, s, o + j))
            if nkw < nk:
                top = vmax(top, vselect(tail, vload(L, s, o + nkw), NEG_INF))
            mx = vmax(m[i], hmax(top))  # NaN if any score is
            if mx == NEG_INF:  # every key so far is -inf: nothing to add yet
                for j in range(0, nk, w):
                    vstore(s, o + j, vzero(L))
                corr[i] = ONE
                continue
            sums = vzero(L)
            for j in range(0, nkw, w):
                e = _exp_normal(vload(L, s, o + j) - mx)
                vstore(s, o + j, e)
                sums += e
            if nkw < nk:
                e = vselect(tail, _exp_normal(vload(L, s, o + nkw) - mx), ZERO)
                vstore(s, o + nkw, e)
                sums += e
            c = _exp_normal(m[i] - mx)
            corr[i] = c
            lsum[i] = lsum[i] * c + hsum(sums)
            m[i] = mx
        # acc = acc e^(m - m') + P V: P's rows broadcast, V's packed rows read
        vo = (bg * sp + k0) * dp
        for i0 in range(0, nt, mr):
            for d0 in range(0, dp, nr):
                t = tile_zeros(L, T)
                for k in range(nk):
                    t = tile_fma(t, s, i0 * bk + k, bk, vp, vo + k * dp + d0)
                for r in range(mr):
                    cr = corr[i0 + r]
                    for c in range(T.cols):
                        q = (i0 + r) * dp + d0 + c * w
                        vstore(acc, q, vfma(vload(L, acc, q), cr, t[r][c]))
    ow = out.shape[1]
    dtail = qtail  # the head's last d_len % W columns
    for i in range(nq):
        inv = ONE / lsum[i]
        zero = nan_to_zero and not lsum[i] > ZERO  # 0 (no key) or NaN: the row's p is NaN
        oo = (row0 + q0 + i) * ow + h * d_len
        for d in range(0, dw, w):
            v = vload(L, acc, i * dp + d) * inv
            vstore(out, oo + d, vselect(zero, ZERO, v))
        if dw < d_len:
            v = vload(L, acc, i * dp + dw) * inv
            vstore_masked(out, oo + dw, vselect(zero, ZERO, v), dtail)


@numba.jit(**PARALLEL)
def _attention(L, T, qkv, kt, vp, work, mask, mshape, has_mask, out, batch, s_len, sp, dp,
               heads, kv_heads, d_len, scale, bq, bk, nan_to_zero):  # fmt: skip
    """K^T and V packed per (batch, kv head), then every (batch, head, query block) (work
    [threads, n]: each thread's scratch for a block, workspace.per_thread)."""
    k_col = heads * d_len
    v_col = (heads + kv_heads) * d_len
    w = L.width
    dw = d_len - d_len % w
    for t in numba.prange(batch * kv_heads):  # K^T [d, sp] and V [sp, dp], zero-padded, once
        b, g = t // kv_heads, t % kv_heads
        kto, vpo = t * d_len * sp, t * sp * dp
        # K^T in W x W blocks: W keys' rows (W of their columns each) transposed in registers
        # straight into K^T's rows (vtranspose); element by element, writing K^T's d_len rows
        # side by side, took 7 cycles a value (a third of the core at 128 queries); the keys
        # and columns past whole blocks so.
        jw, dw2 = s_len - s_len % w, d_len - d_len % w
        for j0 in range(0, jw, w):
            for d0 in range(0, dw2, w):
                vtranspose(L, qkv, (b * s_len + j0) * qkv.shape[1] + k_col + g * d_len + d0,
                           qkv.shape[1], kt, kto + d0 * sp + j0, sp)  # fmt: skip
        for j in range(s_len):
            row = b * s_len + j
            for d in range(dw2 if j < jw else 0, d_len):
                kt[kto + d * sp + j] = qkv[row, k_col + g * d_len + d]
        for j in range(s_len):
            row = b * s_len + j
            vo = row * qkv.shape[1] + v_col + g * d_len
            for d in range(0, dw, w):
                vstore(vp, vpo + j * dp + d, vload(L, qkv, vo + d))
            for d in range(dw, dp, w):  # lanes past d_len are 0 (not read)
                vstore(vp, vpo + j * dp + d, vload_masked(L, qkv, vo + d, tail_mask(L, d_len - d)))
        for d in range(d_len):
            for j in range(s_len, sp):
                kt[kto + d * sp + j] = ZERO
        for j in range(s_len * dp, sp * dp, w):
            vstore(vp, vpo + j, vzero(L))
    n_qb = (s_len + bq - 1) // bq
    dq = max(d_len, 1)
    for t in numba.prange(batch * heads * n_qb):
        b = t // (heads * n_qb)
        h = (t // n_qb) % heads
        q0 = (t % n_qb) * bq
        mine = work[numba.get_thread_id()]  # this thread's scratch: no malloc per task
        qs = mine[: bq * dq]
        s = mine[bq * dq : bq * (dq + bk)]
        acc = mine[bq * (dq + bk) : bq * (dq + bk + dp)]
        o = bq * (dq + bk + dp)
        m, lsum, corr = mine[o : o + bq], mine[o + bq : o + 2 * bq], mine[o + 2 * bq : o + 3 * bq]
        attend_block(L, T, qkv, kt, vp, mask, mshape, has_mask, out, b, h, q0, s_len, sp, dp,
                     heads, kv_heads, d_len, scale, bq, bk, qs, s, acc, m, lsum, corr,
                     nan_to_zero)  # fmt: skip


@numba.jit(**PARALLEL)
def _rotate(qkv, cos3, sin3, seq, turned, d_len):
    """The rotary embedding in place on the first `turned` heads of every row of qkv (Q's and
    K's, d_len columns each): row r is position r % seq of batch r // seq; cos3, sin3
    [1 or batch, seq, d_len]."""
    half = d_len // 2
    for r in numba.prange(qkv.shape[0]):
        b, p = r // seq, r % seq
        cb = b if cos3.shape[0] > 1 else 0
        for h in range(turned):
            c0 = h * d_len
            for i in range(half):
                x1, x2 = qkv[r, c0 + i], qkv[r, c0 + half + i]
                qkv[r, c0 + i] = x1 * cos3[cb, p, i] - x2 * sin3[cb, p, i]
                qkv[r, c0 + half + i] = x2 * cos3[cb, p, half + i] + x1 * sin3[cb, p, half + i]


def rotate(qkv, cos, sin, batch, seq, heads, kv_heads, head_dim):
    """The rotary embedding of Q's and K's heads of qkv [batch * seq, (heads + 2 kv_heads)
    head_dim] in place; cos and sin broadcastable to [batch, 1, seq, head_dim] (one angle per
    position and column, shared by the heads)."""
    if head_dim % 2:
        raise ValueError(f"a rotary embedding turns halves of the head; head size {head_dim}")
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        t = np.asarray(t, np.float32)
        t4 = t.reshape((1,) * (4 - t.ndim) + t.shape) if t.ndim <= 4 else None
        if t4 is None or t4.shape[1] != 1 or t4.shape[0] not in (1, batch):
            raise ValueError(f"{name} of shape {t.shape} is not [batch, 1, {seq}, {head_dim}]")
        try:
            t3 = np.broadcast_to(t4[:, 0], (t4.shape[0], seq, head_dim))
        except ValueError:
            raise ValueError(f"{name} of shape {t.shape} does not broadcast to [{batch}, 1, "
                             f"{seq}, {head_dim}]") from None  # fmt: skip
        tables.append(np.ascontiguousarray(t3))
    _rotate(qkv, tables[0], tables[1], seq, heads + kv_heads, head_dim)


_NO_MASK = np.zeros(1, np.float32)


def attention_core(qkv, batch, seq, heads, kv_heads, head_dim, scale, mask=None,
                   nan_to_zero=False, width=None):  # fmt: skip
    """The attention of the projected qkv [batch * seq, (heads + 2 kv_heads) head_dim] (Q, then
    K, then V columns, head by head), with an additive mask broadcastable to [batch, heads,
    seq, seq]: [batch * seq, heads * head_dim], heads merged. nan_to_zero: the rows whose
    softmax is NaN (a query with every key masked by -inf) are 0, as sdpa's export guards them
    (Where(IsNaN(p), 0, p)); else NaN, as onnxruntime's Softmax gives. width: the lanes, 8 or
    16 (None: the process's, kernels.simd.width()).

    >>> o = attention_core(qkv, 1, 128, 12, 12, 64, 0.125, mask)
    """
    qkv = np.ascontiguousarray(qkv, np.float32)
    width_ = (heads + 2 * kv_heads) * head_dim
    if (qkv.shape != (batch * seq, width_) or heads < 1 or kv_heads < 1 or heads % kv_heads
            or head_dim < 1):  # fmt: skip
        raise ValueError(f"qkv of shape {qkv.shape} is not [{batch * seq}, {width_}] "
                         f"({heads} heads, {kv_heads} key/value heads of {head_dim})")  # fmt: skip
    m = _NO_MASK
    mshape = (1, 1, 1)
    if mask is not None:
        mask = np.asarray(mask, np.float32)
        if mask.ndim > 4:
            raise ValueError(f"mask of shape {mask.shape} has more than 4 axes")
        m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        try:
            np.broadcast_shapes(m4.shape, (batch, heads, seq, seq))
        except ValueError:
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to "
                             f"[{batch}, {heads}, {seq}, {seq}]") from None  # fmt: skip
        m = np.ascontiguousarray(np.broadcast_to(m4, (*m4.shape[:3], seq))).reshape(-1)
        mshape = m4.shape[:3]
    out = np.empty((batch * seq, heads * head_dim), np.float32)
    if out.size == 0:
        return out
    L, T = _gemm.micro_tile(width)
    T = _gemm.row_tile(seq, T)  # the query tile that pads the sequence the least
    nr = _gemm.panel_width(T, L)
    bq, bk = attention_blocks(T, L)
    sp, dp = nr * -(-seq // nr), nr * -(-head_dim // nr)
    n_kt, n_vp = batch * kv_heads * head_dim * sp, batch * kv_heads * sp * dp
    packed = shared(n_kt + n_vp)  # reused: fresh pages fault (workspace)
    kt, vp = packed[:n_kt], packed[n_kt : n_kt + n_vp]
    work = per_thread(bq * (max(head_dim, 1) + bk + dp + 3))
    _attention(L, T, qkv, kt, vp, work, m, mshape, mask is not None, out, batch, seq, sp, dp,
               heads, kv_heads, head_dim, np.float32(scale), bq, bk,
               bool(nan_to_zero))  # fmt: skip
    return out


def attention(x, qkv_plan, heads, kv_heads, scale, out_plan, mask=None, residual=None,
              out_shape=None, nan_to_zero=False, rotary=None):  # fmt: skip
    """y = MHA(x) Wo + bo (+ residual) for x [B, S, E] float32; qkv_plan = prepare_dense(w_qkv,
    b_qkv) with w_qkv [E, (H + 2 Hkv) D] (Q, K, V columns), out_plan = prepare_dense(w_out,
    b_out) with w_out [H D, N] (kernels/dense_gemm.py: weights packed once): [B, S, N], or
    out_shape (the same values; the residual broadcasts to it); nan_to_zero as
    attention_core's; rotary: (cos, sin), the rotary embedding of Q and K (rotate).

    >>> y = attention(x, prepare_dense(w_qkv, b_qkv), 12, 12, 0.125,
    ...               prepare_dense(w_out, b_out), mask)
    """
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(f"x must be [batch, sequence, embedding] float32, got {x.dtype} {x.shape}")
    batch, seq, emb = x.shape
    width = qkv_plan.n
    head_dim = width // (heads + 2 * kv_heads)
    if qkv_plan.k != emb or head_dim * (heads + 2 * kv_heads) != width:
        raise ValueError(f"Q, K, V weights [{qkv_plan.k}, {width}] do not fit x {x.shape}")
    if out_plan.k != heads * head_dim:
        raise ValueError(f"output weights [{out_plan.k}, {out_plan.n}] do not take "
                         f"{heads * head_dim} inputs")  # fmt: skip
    n = out_plan.n
    shape = (batch, seq, n) if out_shape is None else tuple(out_shape)
    if int(np.prod(shape)) != batch * seq * n or shape[-1] != n:
        raise ValueError(f"out_shape {shape} does not hold [{batch * seq}, {n}]")
    qkv = np.empty((batch * seq, width), np.float32)
    if qkv.size:
        dense_gemm(x.reshape(batch * seq, emb), qkv_plan, out=qkv)
    if rotary is not None:
        rotate(qkv, *rotary, batch, seq, heads, kv_heads, head_dim)
    w = qkv_plan.lanes.width
    o = attention_core(qkv, batch, seq, heads, kv_heads, head_dim, scale, mask, nan_to_zero, w)
    r = None if residual is None else np.broadcast_to(residual, shape).reshape(-1, n)
    return dense_gemm(o, out_plan, r).reshape(shape)
