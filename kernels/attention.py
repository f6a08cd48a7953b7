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
Both products run on the project's 4x16 register-blocked micro-kernel (_gemm.tile_sum): the
packed queries against K^T (transposed once per call), the packed probabilities against V read
in place. exp is the SIMD layer's (kernels/simd/approx.py), on vectors of the CPU's width
along a row of scores. A key block whose mask entries are all below -1e30 for every query
of the block is skipped when every query row has some key above it (then exp underflows to
exactly 0 there, as in onnxruntime's Softmax): a causal mask costs half the work.
The driver is parallel over (batch, head, query block); each task has its own scratch.
The two projections are kernels/dense_gemm.py's GEMM on weights packed once (the caller's
plans), their biases and the residual applied in its epilogue; the QKV product is stored
straight into the buffer the core reads.
"""

import numba
import numpy as np

from ._gemm import tile_sum
from .config import INLINE_GEMM, JIT, JIT_GEMM, PARALLEL, slp_vectorize
from .dense_gemm import dense_gemm
from .simd import (
    exp,
    hsum,
    lanes,
    tail_mask,
    vload,
    vload_masked,
    vselect,
    vstore,
    vstore_masked,
    vzero,
)

__all__ = ["BK", "BQ", "attention", "attention_core", "rotate"]

BQ, BK = 32, 64  # queries and keys per tile
MASKED = np.float32(-1e30)  # a mask value below this is "not attended"
f32 = np.float32
ONE, ZERO = f32(1.0), f32(0.0)
NEG_INF = f32(-np.inf)


@numba.jit(**INLINE_GEMM)
def _add8(m, x, i, q, r):
    """m[x, i, q : q + 8] += r."""
    m[x, i, q] += r[0]
    m[x, i, q + 1] += r[1]
    m[x, i, q + 2] += r[2]
    m[x, i, q + 3] += r[3]
    m[x, i, q + 4] += r[4]
    m[x, i, q + 5] += r[5]
    m[x, i, q + 6] += r[6]
    m[x, i, q + 7] += r[7]


@numba.jit(**INLINE_GEMM)
def _put8(m, x, i, q, r):
    """m[x, i, q : q + 8] = r."""
    m[x, i, q], m[x, i, q + 1], m[x, i, q + 2], m[x, i, q + 3] = r[0], r[1], r[2], r[3]
    m[x, i, q + 4], m[x, i, q + 5], m[x, i, q + 6], m[x, i, q + 7] = r[4], r[5], r[6], r[7]


@numba.jit(**JIT_GEMM)
def scores_tile(qp, n_quads, kt, kr, k0, sp, d_len, n_tiles, s):
    """s[0, 4 c + i, 16 t + j] = sum_d qp[c, 4 d + i] kt[kr, d sp + k0 + 16 t + j]: the scores
    of n_quads packed query quads against n_tiles x 16 keys from k0."""
    u = np.uint64
    for c in range(n_quads):
        for t in range(n_tiles):
            r0, r1, r2, r3, s0, s1, s2, s3 = tile_sum(qp, c, kt, kr, u(k0 + 16 * t), u(sp), d_len)
            row, col = 4 * c, 16 * t
            _put8(s, 0, row, col, r0)
            _put8(s, 0, row, col + 8, s0)
            _put8(s, 0, row + 1, col, r1)
            _put8(s, 0, row + 1, col + 8, s1)
            _put8(s, 0, row + 2, col, r2)
            _put8(s, 0, row + 2, col + 8, s2)
            _put8(s, 0, row + 3, col, r3)
            _put8(s, 0, row + 3, col + 8, s3)


@numba.jit(**JIT_GEMM)
def pv_tile(pp, n_quads, flat, v0, w, k_len, n_dtiles, acc):
    """acc[0, 4 c + i, 16 t + j] += sum_k pp[c, 4 k + i] V[k, 16 t + j], V[k, d] read in place
    as flat[0, v0 + k w + d]."""
    u = np.uint64
    for c in range(n_quads):
        for t in range(n_dtiles):
            r0, r1, r2, r3, s0, s1, s2, s3 = tile_sum(pp, c, flat, 0, u(v0 + 16 * t), u(w), k_len)
            row, col = 4 * c, 16 * t
            _add8(acc, 0, row, col, r0)
            _add8(acc, 0, row, col + 8, s0)
            _add8(acc, 0, row + 1, col, r1)
            _add8(acc, 0, row + 1, col + 8, s1)
            _add8(acc, 0, row + 2, col, r2)
            _add8(acc, 0, row + 2, col + 8, s2)
            _add8(acc, 0, row + 3, col, r3)
            _add8(acc, 0, row + 3, col + 8, s3)


@numba.jit(**JIT)
def softmax_rows(L, s, mask, has_mask, mb, mh, mq0, mq_step, q_base, k0, nq, nk, m, lsum, acc,
                 d_len, pp):  # fmt: skip
    """The online-softmax update of rows i < nq by keys k0 .. k0 + nk: adds the mask, moves the
    running maximum, rescales l and acc, and packs p into pp (zeros for rows nq .. 4 ceil(nq/4))."""
    w = L.width
    for i in range(nq):
        mq = mq0 + (q_base + i) * mq_step
        rowmax = m[i]
        if has_mask:
            for j in range(nk):
                v = s[0, i, j] + mask[mb, mh, mq, k0 + j]
                s[0, i, j] = v
                rowmax = v if v > rowmax else rowmax
        else:
            for j in range(nk):
                v = s[0, i, j]
                rowmax = v if v > rowmax else rowmax
        c, ii = i // 4, i % 4
        if rowmax == NEG_INF:  # every key so far is -inf: nothing to add yet
            for j in range(nk):
                pp[c, 4 * j + ii] = ZERO
            continue
        corr = exp(m[i] - rowmax)
        o = i * s.shape[2]  # s[0, i, j] = p = e^(s - m'), a vector of keys at a time
        sums = vzero(L)
        j = 0
        while j + w <= nk:
            e = exp(vload(L, s, o + j) - rowmax)
            vstore(s, o + j, e)
            sums += e
            j += w
        total = hsum(sums)
        if j < nk:
            tail = tail_mask(L, nk - j)
            e = vselect(tail, exp(vload_masked(L, s, o + j, tail) - rowmax), ZERO)
            vstore_masked(s, o + j, e, tail)
            total += hsum(e)
        for j in range(nk):
            pp[c, 4 * j + ii] = s[0, i, j]
        lsum[i] = lsum[i] * corr + total
        m[i] = rowmax
        for d in range(d_len):
            acc[0, i, d] *= corr
    for i in range(nq, 4 * ((nq + 3) // 4)):
        c, ii = i // 4, i % 4
        for j in range(nk):
            pp[c, 4 * j + ii] = ZERO


@numba.jit(**JIT)
def attend_block(L, qkv, flat, kt, mask, has_mask, out, b, h, q0, s_len, sp, heads, kv_heads,
                 d_len, scale, qp, pp, s, acc, m, lsum, nan_to_zero):  # fmt: skip
    """Queries q0 .. q0 + BQ of head h, batch b, against every key: out's rows of them. A row
    whose softmax is NaN (every key -inf, or a NaN score) is NaN, or 0 with nan_to_zero."""
    w = qkv.shape[1]
    g = h // (heads // kv_heads)
    nq = min(BQ, s_len - q0)
    n_quads = (nq + 3) // 4
    row0 = b * s_len
    for c in range(n_quads):
        for d in range(d_len):
            for ii in range(4):
                i = 4 * c + ii
                qp[c, 4 * d + ii] = qkv[row0 + q0 + i, h * d_len + d] * scale if i < nq else ZERO
    for i in range(BQ):
        m[i] = NEG_INF
        lsum[i] = ZERO
        for d in range(acc.shape[2]):
            acc[0, i, d] = ZERO
    mb = b if mask.shape[0] > 1 else 0
    mh = h if mask.shape[1] > 1 else 0
    mq_step = 1 if mask.shape[2] > 1 else 0
    # Skipping a fully masked key block is exact only if every query row attends to some key.
    skip = has_mask
    if has_mask:
        for i in range(nq):
            seen = False
            for j in range(s_len):
                if mask[mb, mh, (q0 + i) * mq_step, j] >= MASKED:
                    seen = True
                    break
            skip = skip and seen
    v_col = (heads + kv_heads) * d_len + g * d_len
    n_dtiles = (d_len + 15) // 16
    for k0 in range(0, s_len, BK):
        nk = min(BK, s_len - k0)
        if skip:
            masked = True
            for i in range(nq):
                for j in range(nk):
                    if mask[mb, mh, (q0 + i) * mq_step, k0 + j] >= MASKED:
                        masked = False
                        break
                if not masked:
                    break
            if masked:
                continue
        scores_tile(qp, n_quads, kt, b * kv_heads + g, k0, sp, d_len, (nk + 15) // 16, s)
        softmax_rows(L, s, mask, has_mask, mb, mh, 0, mq_step, q0, k0, nq, nk, m, lsum, acc,
                     d_len, pp)  # fmt: skip
        pv_tile(pp, n_quads, flat, (row0 + k0) * w + v_col, w, nk, n_dtiles, acc)
    for i in range(nq):
        inv = ONE / lsum[i]
        zero = nan_to_zero and not lsum[i] > ZERO  # 0 (no key) or NaN: the row's p is NaN
        for d in range(d_len):
            out[row0 + q0 + i, h * d_len + d] = ZERO if zero else acc[0, i, d] * inv


@numba.jit(**PARALLEL)
def _attention(L, qkv, flat, kt, mask, has_mask, out, batch, s_len, sp, heads, kv_heads, d_len,
               scale, nan_to_zero):  # fmt: skip
    k_col = heads * d_len
    for t in numba.prange(batch * kv_heads):  # K^T, zero-padded to sp keys
        b, g = t // kv_heads, t % kv_heads
        for d in range(d_len):
            base = d * sp
            for j in range(s_len):
                kt[t, base + j] = qkv[b * s_len + j, k_col + g * d_len + d]
            for j in range(s_len, sp):
                kt[t, base + j] = ZERO
    n_qb = (s_len + BQ - 1) // BQ
    dp = 16 * ((d_len + 15) // 16)
    for t in numba.prange(batch * heads * n_qb):
        b = t // (heads * n_qb)
        h = (t // n_qb) % heads
        q0 = (t % n_qb) * BQ
        qp = np.empty((BQ // 4, 4 * d_len), np.float32)
        pp = np.empty((BQ // 4, 4 * BK), np.float32)
        s = np.empty((1, BQ, BK), np.float32)
        acc = np.empty((1, BQ, dp), np.float32)
        m = np.empty(BQ, np.float32)
        lsum = np.empty(BQ, np.float32)
        attend_block(L, qkv, flat, kt, mask, has_mask, out, b, h, q0, s_len, sp, heads, kv_heads,
                     d_len, scale, qp, pp, s, acc, m, lsum, nan_to_zero)  # fmt: skip


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


_NO_MASK = np.zeros((1, 1, 1, 1), np.float32)


def qkv_buffer(rows: int, width: int):
    """(qkv [rows, width], flat [1, rows * width + 16]): the same memory; the padding lets the
    last head's 16-wide V tiles read past a head dimension below 16."""
    flat = np.empty((1, rows * width + 16), np.float32)
    flat[0, rows * width :] = 0.0
    return flat[0, : rows * width].reshape(rows, width), flat


def attention_core(qkv, flat, batch, seq, heads, kv_heads, head_dim, scale, mask=None,
                   nan_to_zero=False):  # fmt: skip
    """The attention of the projected qkv [batch * seq, (heads + 2 kv_heads) head_dim] (Q, then
    K, then V columns, head by head; from qkv_buffer), with an additive mask broadcastable to
    [batch, heads, seq, seq]: [batch * seq, heads * head_dim], heads merged. nan_to_zero: the
    rows whose softmax is NaN (a query with every key masked by -inf) are 0, as sdpa's export
    guards them (Where(IsNaN(p), 0, p)); else NaN, as onnxruntime's Softmax gives."""
    width = (heads + 2 * kv_heads) * head_dim
    if qkv.shape != (batch * seq, width) or heads % kv_heads:
        raise ValueError(f"qkv of shape {qkv.shape} is not [{batch * seq}, {width}] "
                         f"({heads} heads, {kv_heads} key/value heads of {head_dim})")  # fmt: skip
    m = _NO_MASK
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
        m = np.ascontiguousarray(np.broadcast_to(m4, (*m4.shape[:3], seq)))
    sp = 16 * ((seq + 15) // 16)
    kt = np.empty((batch * kv_heads, head_dim * sp), np.float32)
    out = np.empty((batch * seq, heads * head_dim), np.float32)
    with slp_vectorize():
        _attention(lanes(), qkv, flat, kt, m, mask is not None, out, batch, seq, sp, heads,
                   kv_heads, head_dim, np.float32(scale), bool(nan_to_zero))  # fmt: skip
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
    qkv, flat = qkv_buffer(batch * seq, width)
    dense_gemm(x.reshape(batch * seq, emb), qkv_plan, out=qkv)
    if rotary is not None:
        rotate(qkv, *rotary, batch, seq, heads, kv_heads, head_dim)
    o = attention_core(qkv, flat, batch, seq, heads, kv_heads, head_dim, scale, mask, nan_to_zero)
    r = None if residual is None else np.broadcast_to(residual, shape).reshape(-1, n)
    return dense_gemm(o, out_plan, r).reshape(shape)
