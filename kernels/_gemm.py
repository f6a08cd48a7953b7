"""Register-blocked SGEMM micro-kernel shared by the convolution paths and the LSTM's input
projection, on the SIMD layer's register tiles (kernels/simd/tile.py).

    tile[i, j] = sum_k A[k, i] B[k, j]     i < MR = T.rows,  j < NR = T.cols W

A is a packed panel [K, MR] (weights, packed once by pack_a), B a packed panel [K, NR] (input
pixels) or NR consecutive columns of a matrix read in place. Per k one rank-1 update
(tile_fma): MR broadcasts and T.cols vector loads for MR T.cols vector FMAs, the accumulators
in registers. The shape is the register file's (gemm_tile: 4 x 3 vectors at W = 8 on AVX2,
14 x 2 on AVX-512), the width the process's (simd.width()); `micro_tile` gives both, a plan
carries them and every kernel takes them as arguments (a Lanes L and a Tile T: types, so
MR and NR are constants in the machine code and each width and shape compiles on its own).

Two entry points: gemm_batch stores raw tiles (Winograd transforms them further, the LSTM adds
its gates); gemm_block applies bias + clip to each tile in registers and stores it to the
output (im2col and 1x1 convolutions). Operands are whole arrays indexed by flat offsets, never
sliced views: a view of an array that both threads use costs an atomic refcount update on a
shared cache line (Numba's NRT incref/decref), as slow per tile as the FMAs at K = 16
(bench/NOTES.md, GEMM micro-kernel).
"""

import functools

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .config import INLINE_GEMM, JIT, JIT_GEMM
from .simd import clip, gemm_tile, lanes, tail_mask, tile_fma, tile_store, tile_zeros
from .simd._types import (
    I32,
    Mask,
    Vec,
    array_arg,
    index_arg,
    lanes_arg,
    llvm_call,
    pointer,
    vector_type,
)
from .simd.tile import TileType, tile


def micro_tile(width=None):
    """(Lanes, Tile) of the micro-kernel: `width` lanes (None: the process's, simd.width())
    and the tile the register file holds at that width. A plan keeps both.

    >>> L, T = micro_tile()       # Lanes(8), Tile(4, 3) on AVX2: MR = 4, NR = 24
    """
    L = lanes(width)
    return L, _gemm_tile(L.width)


# Per width, once: gemm_shape walks the register file's options in Python (20 us, two thirds
# of a small attention's call when it ran per call).
_gemm_tile = functools.cache(gemm_tile)


@functools.lru_cache(maxsize=256)
def row_tile(m, T):
    """The tile for M rows: T's columns, and of the row counts whose rank-1 update still does
    1.5 FMAs per load (as gemm_shape asks; T.rows at most), the one that pads M the least,
    ties to more rows. Rows past M cost a whole tile's FMAs: at M = 128 the 14-row tile of
    AVX-512 computes 140 rows, and the 8-row one, within 2% of its speed, 128 (bench/NOTES.md,
    "The dense GEMM's row tile from M"). M: a GEMM's rows (dense_gemm), attention's queries.
    An M below every such count (a classifier head at batch 1, M = 1 ... 5 at AVX-512's 14 x 2)
    gets a tile of M rows: the padded rows were FMAs for nothing (5 of 6 at M = 1), and such a
    product is bound by streaming W, not by its FMAs."""
    best = T.rows
    for rows in range(T.rows - 1, 0, -1):
        if 2 * rows * T.cols < 3 * (rows + T.cols):
            if m < best:
                best = max(1, m)
            break
        if -(-m // rows) * rows < -(-m // best) * best:
            best = rows
    return T if best == T.rows else tile(best, T.cols)


def panel_width(T, L):
    """NR, the columns of a B panel: T.cols vectors of L.width lanes (jitted code writes
    T.cols * L.width, a constant there)."""
    return T.cols * L.width


@numba.jit(**INLINE_GEMM)
def panel_sum(L, T, a, ao, b, bo, bs, k_len):
    """The tile sum_k A[k, i] B[k, j], A[k, i] = a[ao + k MR + i] (a packed panel), B[k, j] =
    b[bo + k bs + j]: bs = NR for a packed panel, a matrix's row length for its columns read
    in place (flat offsets into C-contiguous arrays of any rank)."""
    t = tile_zeros(L, T)
    for k in range(k_len):
        t = tile_fma(t, a, ao + k * T.rows, 1, b, bo + k * bs)
    return t


@numba.jit(**JIT_GEMM)
def gemm_batch(L, T, a, a0, a_step, b, b0, b_step, n_b, k_len, mt):
    """mt[x, :MR, :NR] = A_x^T B_x for x < n_b: A_x the packed panel at a[a0 + x a_step ...],
    B_x the packed panel at b[b0 + x b_step ...] (flat offsets): the independent GEMMs of a
    Winograd transform, or one A against several B (a_step 0), in one call, so the call's
    argument refcounts are paid once. mt is [n_b, MR, NR] (C-contiguous)."""
    size = T.rows * T.cols * L.width
    nr = T.cols * L.width
    for x in range(n_b):
        t = panel_sum(L, T, a, a0 + x * a_step, b, b0 + x * b_step, nr, k_len)
        tile_store(mt, x * size, t)


# ---- stores into an output of any layout -----------------------------------------------------
# The output of a conv may be a channel slice of a bigger buffer (Fire, ConvConcat): Numba types
# it with layout "A", which the layer's vstore refuses (it takes flat offsets into C arrays).
# These store a vector at out[n, m, q ...] through the array's strides, its last axis of unit
# stride (conv2d._check_out makes sure of that).


def _row_pointer(context, builder, aty, a, idx, w):
    """<w x float>* to a[idx[0], ..., idx[-1]], the last axis taken to be contiguous."""
    arr = context.make_array(aty)(context, builder, a)
    strides = cgutils.unpack_tuple(builder, arr.strides, aty.ndim)
    offset = builder.mul(idx[-1], ir.Constant(idx[-1].type, 4))
    for i, s in zip(idx[:-1], strides[:-1], strict=True):
        offset = builder.add(offset, builder.mul(i, s))
    p = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [offset])
    return builder.bitcast(p, vector_type(w).as_pointer())


def _store_typing(a, idx, v, op):
    ok = isinstance(a, types.Array) and a.dtype == types.float32 and a.mutable and a.ndim == 3
    if not ok:
        raise TypingError(f"{op} needs a writable 3-D float32 array, got {a}")
    if not all(isinstance(i, types.Integer) for i in idx) or not isinstance(v, Vec):
        raise TypingError(f"{op}(out, n, m, q, v): integer indices and a vector, got {idx}, {v}")
    return v.w


def _indices(context, builder, sig, args):
    """The indices n, m, q of a store as intp."""
    tys = sig.args[1:4]
    return [context.cast(builder, x, t, types.intp) for x, t in zip(args[1:4], tys, strict=True)]


@intrinsic
def store_at(typingctx, out, n, m, q, v):
    """out[n, m, q : q + W] = v."""
    w = _store_typing(out, (n, m, q), v, "store_at")

    def codegen(context, builder, sig, args):
        p = _row_pointer(context, builder, sig.args[0], args[0],
                         _indices(context, builder, sig, args), w)  # fmt: skip
        builder.store(args[4], p, align=4)
        return context.get_dummy_value()

    return types.void(out, n, m, q, v), codegen


@intrinsic
def store_at_masked(typingctx, out, n, m, q, v, mask):
    """out[n, m, q + i] = v[i] for the lanes i of mask; the others are neither written nor
    touched (no fault past the end)."""
    w = _store_typing(out, (n, m, q), v, "store_at_masked")
    if mask != Mask(w):
        raise TypingError(f"store_at_masked needs a mask{w}, got {mask}")

    def codegen(context, builder, sig, args):
        p = _row_pointer(context, builder, sig.args[0], args[0],
                         _indices(context, builder, sig, args), w)  # fmt: skip
        llvm_call(builder, f"llvm.masked.store.v{w}f32.p0", ir.VoidType(),
                  [args[4], p, I32(4), args[5]])  # fmt: skip
        return context.get_dummy_value()

    return types.void(out, n, m, q, v, mask), codegen


@intrinsic
def interleave_rows(typingctx, L, T, x, xo, ldx, xp, po):
    """xp[po + k MR + j] = x[xo + j ldx + k] for k < W, j < MR: W columns of MR rows of a
    row-major matrix into the micro-kernel's A panel layout ([K, MR], packing x for the dense
    GEMM), MR vector loads and MR vector stores (LLVM's shuffles in between) where element by
    element it took two cycles a value. Flat offsets into C-contiguous arrays, unchecked."""
    w = lanes_arg(L, "interleave_rows")
    if not isinstance(T, TileType):
        raise TypingError(f"interleave_rows: the shape must be a Tile, got {T}")
    mr = T.rows
    array_arg(x, "interleave_rows")
    array_arg(xp, "interleave_rows", store=True)
    for i in (xo, ldx, po):
        index_arg(i, "interleave_rows")

    def codegen(context, builder, sig, args):
        _, _, xty, xot, ldt, pty, pot = sig.args
        _, _, xv, xov, ldv, pv, pov = args
        x0 = context.cast(builder, xov, xot, types.intp)
        ld = context.cast(builder, ldv, ldt, types.intp)
        p0 = context.cast(builder, pov, pot, types.intp)
        rows = []
        for j in range(mr):
            off = builder.add(x0, builder.mul(ld, ir.Constant(ld.type, j)))
            rows.append(builder.load(pointer(context, builder, xty, xv, types.intp, off, w),
                                     align=4))  # fmt: skip
        for q in range(mr):
            vec = ir.Constant(vector_type(w), ir.Undefined)
            for lane in range(w):
                k, j = divmod(q * w + lane, mr)
                vec = builder.insert_element(vec, builder.extract_element(rows[j], I32(k)),
                                             I32(lane))  # fmt: skip
            off = builder.add(p0, ir.Constant(p0.type, q * w))
            builder.store(vec, pointer(context, builder, pty, pv, types.intp, off, w), align=4)
        return context.get_dummy_value()

    return types.void(L, T, x, xo, ldx, xp, po), codegen


@numba.jit(**JIT_GEMM)
def gemm_block(L, T, a, a0, n_mb, b, b0, b_step, bs, n_pan, k_len, out3, n, m0, m_len, p0,
               p_len, bias, lo, hi):  # fmt: skip
    """out3[n, m0 + m, p0 + p] = clip(sum_k A[k, m] B[k, p] + bias[m0 + m], lo, hi) for
    m < m_len and the n_pan input panels: every channel panel mb < n_mb (packed at flat
    a0 + mb K MR of a) against every input panel j (pixels p0 + j NR ..., up to p_len), all in
    one call. Panel j is B of panel_sum at flat offset b0 + j b_step of b, row stride bs.

    Each tile gets bias and clip in registers (compares, not min/max: a NaN passes through, as
    in onnxruntime) and goes straight to out3, a row at a time; the rows past m_len of the last
    channel panel are not stored, the columns past p_len of the last input panel are masked
    (a scalar epilogue cost as much as the FMAs at small K). One tile body for the whole
    block: inlined twice into the parallel im2col driver, it made that driver's compile take
    minutes."""
    w, mr = L.width, T.rows
    nr = T.cols * w
    for mb in range(n_mb):
        mm = mb * mr
        rows = min(mr, m_len - mm)
        m = m0 + mm
        ao = a0 + mb * k_len * mr
        for j in range(n_pan):
            q0 = p0 + j * nr
            cols = min(nr, p_len - q0)
            t = panel_sum(L, T, a, ao, b, b0 + j * b_step, bs, k_len)
            for r in range(mr):  # unrolled by LLVM: the tile's indices are constants
                if r < rows:
                    c_r = bias[m + r]
                    for c in range(T.cols):
                        v = clip(t[r][c] + c_r, lo, hi)
                        if cols == nr:
                            store_at(out3, n, m + r, q0 + c * w, v)
                        else:
                            store_at_masked(out3, n, m + r, q0 + c * w, v,
                                            tail_mask(L, cols - c * w))  # fmt: skip


def pack_a(w2d, mr):
    """Pack weights [M, K] into mr-row panels [ceil(M / mr), K, mr] (zero rows past M), flat."""
    m, k = w2d.shape
    mb = -(-m // mr)
    padded = np.zeros((mb * mr, k), np.float32)
    padded[:m] = w2d
    return np.ascontiguousarray(padded.reshape(mb, mr, k).transpose(0, 2, 1)).ravel()


@numba.jit(**JIT)
def act(v, lo, hi):
    """Bias-added value clipped to [lo, hi]; relu is lo = 0, no activation is (-inf, inf).

    Written as compares, not min/max, so a NaN passes through unchanged as in onnxruntime.
    """
    if v < lo:
        v = lo
    if v > hi:
        v = hi
    return v
