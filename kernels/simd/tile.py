"""Register tiles: rows x cols vectors of accumulators that stay in registers, the core of every
product kernel (the GEMM micro-kernel, the direct blocked convolution).

    t[r][c] += a[ao + r astep] * b[bo + c W]        r < rows, c < cols     (tile_fma)

One step is a rank-1 update: `rows` scalars of a broadcast against `cols` vectors of b, rows x
cols FMAs for rows + cols loads. A tile's shape lives in its type, as a vector's width does:
`Tile(rows, cols)` is typed `tile{rows}x{cols}`, so one kernel source compiles at any shape, the
shape is chosen in Python (from the register file, below, or by timing), and inside the kernel
`T.rows`, `T.cols` are constants and the tile is a nest of LLVM vectors, never memory.

    @numba.jit(**JIT_GEMM)
    def panel(L, T, a, b, k_len, out):          # out[:rows, :cols W] = A^T B
        t = tile_zeros(L, T)
        for k in range(k_len):
            t = tile_fma(t, a, k * T.rows, 1, b, k * T.cols * L.width)
        tile_store(out, 0, t)

    panel(lanes(), gemm_tile(), a, b, k, out)

Operations (t a tile, L a Lanes, T a Tile; offsets are flat element offsets into C-contiguous
float32 arrays of any rank, not bounds-checked, as vload's):
    tile_zeros(L, T)                  the zero tile of T's shape and L's width
    tile_fma(t, a, ao, astep, b, bo)  the rank-1 update above (fused multiply-adds)
    tile_load(L, T, m, off)           t[r][c] = m[off + (r cols + c) W ...], row-major vectors
    tile_store(m, off, t)             the inverse
    t[r][c]                           one accumulator (a Vec)

How many accumulators fit: `fit_rows(cols, w)` and `gemm_tile(w)` work it out from the register
file of the CPU the code is compiled for (`registers()`: 32 vector registers with AVX-512, 16
with AVX2, each of 16 or 8 float32 lanes; a Vec wider than a register takes several).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba.core import types
from numba.core.errors import TypingError
from numba.core.imputils import lower_constant
from numba.core.typing.templates import AttributeTemplate
from numba.extending import (
    NativeValue,
    infer_getattr,
    intrinsic,
    lower_getattr,
    models,
    register_model,
    typeof_impl,
    unbox,
)

from ._types import (
    Vec,
    array_arg,
    index_arg,
    lanes_arg,
    llvm_call,
    pointer,
    splat,
    target_isa,
    vector_type,
)

# ---- the register file -----------------------------------------------------------------------


@functools.cache
def registers() -> tuple[int, int]:
    """(vector registers, float32 lanes per register) of the CPU Numba compiles for: AVX-512F
    32 of 16, AVX 16 of 8, SSE and other 16 of 4 (aarch64's NEON: 32 of 4)."""
    isa = target_isa()
    if isa.startswith("avx512f"):
        return 32, 16
    if isa.startswith("avx"):
        return 16, 8
    return (32, 4) if isa in ("neon", "asimd") else (16, 4)


def _cost(rows: int, cols: int, w: int) -> int:
    """Registers a rows x cols tile of w-lane vectors needs while it runs: its accumulators, the
    operands of one rank-1 update done the cheaper way round (tile_fma emits it column by
    column when rows < cols: `rows` broadcasts and one column vector live, else one broadcast
    and `cols` column vectors), and one spare."""
    v = -(-w // registers()[1])  # registers per vector
    return v * (rows * cols + min(rows, cols) + 1)


def fit_rows(cols: int, w: int) -> int:
    """The most rows of a tile of `cols` vectors of w lanes whose registers fit the register
    file (at least 1: on a CPU with too few, LLVM spills, and the code stays correct)."""
    count = registers()[0]
    rows = 1
    while _cost(rows + 1, cols, w) <= count:
        rows += 1
    return rows


def tallest(cols: int, w: int) -> int:
    """The rows of the tallest tile of `cols` vectors worth running: fit_rows, but a one-column
    tile at most half as many rows as vector registers. Each FMA of a one-column tile waits on
    a broadcast of its own, so height adds no FMAs per load past a few rows, and at the full
    register file LLVM kept no register to load ahead: on AVX2, 14x1 ran RegNet's grouped 3x3
    convs (8 channels a group) 1.4-1.8x slower than 7x1 or 8x1 (104 x 28 x 28 in 13 groups,
    one thread: 409-491 us against 260-272), and a stem's 30x1 on AVX-512 1.4x slower than
    16x1. On AVX-512 the whole RegNet (its 8-channel groups block-diagonal there, one column)
    ran as fast with the cap as without it, 0.98-1.07x in one process (bench/NOTES.md)."""
    rows = fit_rows(cols, w)
    return min(rows, max(1, registers()[0] // 2)) if cols == 1 else rows


def gemm_shape(w: int) -> tuple[int, int]:
    """(rows, cols) of the GEMM micro-kernel's tile at w lanes: the most accumulators that fit
    the register file while each rank-1 update does at least 1.5 FMAs per load (rows + cols
    loads for rows x cols FMAs: fewer and the loads, not the FMAs, bound it); ties to fewer
    loads, then fewer columns (narrower panels pad less). 4 x 3 on AVX2 (12 of 16 registers),
    14 x 2 on AVX-512 (28 of 32)."""
    best = None
    for cols in range(1, 9):
        rows = fit_rows(cols, w)
        acc, loads = rows * cols, rows + cols
        key = (2 * acc >= 3 * loads, acc, -loads, -cols)
        if _cost(rows, cols, w) <= registers()[0] and (best is None or key > best[0]):
            best = (key, rows, cols)
    if best is None:  # not even one column fits: one accumulator, and LLVM spills the rest
        return 1, 1
    return best[1], best[2]


# ---- the Tile shape, a type ------------------------------------------------------------------
class Tile:
    """The shape of a register tile, passed to a kernel as an argument (typed `tile{R}x{C}`).

    >>> Tile(4, 3).rows, Tile(4, 3).cols
    (4, 3)
    """

    __slots__ = ("_numba_type_", "cols", "rows")

    def __init__(self, rows: int, cols: int):
        if not (isinstance(rows, int) and isinstance(cols, int) and 1 <= rows <= 64
                and 1 <= cols <= 16):  # fmt: skip
            raise ValueError(f"a tile has 1-64 rows of 1-16 vectors, got {rows!r} x {cols!r}")
        self.rows, self.cols = rows, cols
        self._numba_type_ = TileType(rows, cols)  # typed in C by Numba's dispatcher (as Lanes)

    def __repr__(self):
        return f"Tile({self.rows}, {self.cols})"

    def __reduce__(self):
        # By shape alone: Numba's cache keys a kernel that closes over a Tile by its pickle, and
        # the type's pickle holds a number that differs between processes
        return tile, (self.rows, self.cols)


@functools.cache
def tile(rows: int, cols: int) -> Tile:
    """One Tile object per shape (building one and its type costs microseconds per call)."""
    return Tile(rows, cols)


def gemm_tile(w: int) -> Tile:
    """The GEMM micro-kernel's tile at w lanes (gemm_shape)."""
    return tile(*gemm_shape(w))


class TileType(types.Type):
    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols
        super().__init__(name=f"tile{rows}x{cols}")


register_model(TileType)(models.OpaqueModel)  # no data: the shape is in the type


@typeof_impl.register(Tile)
def _typeof_tile(val, c):
    return TileType(val.rows, val.cols)


@unbox(TileType)
def _unbox_tile(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


@lower_constant(TileType)
def _constant_tile(context, builder, ty, pyval):
    """A Tile a kernel closes over (a function made per shape: kernels/_direct_blocked
    tile_item): no data either."""
    return context.get_dummy_value()


@infer_getattr
class _TileAttributes(AttributeTemplate):
    key = TileType

    def resolve_rows(self, ty):
        return types.intp

    def resolve_cols(self, ty):
        return types.intp


@lower_getattr(TileType, "rows")
def _tile_rows(context, builder, ty, val):
    return context.get_constant(types.intp, ty.rows)


@lower_getattr(TileType, "cols")
def _tile_cols(context, builder, ty, val):
    return context.get_constant(types.intp, ty.cols)


def value_type(w: int, rows: int, cols: int):
    """The Numba type of a tile's value: rows tuples of cols Vec(w)."""
    return types.UniTuple(types.UniTuple(Vec(w), cols), rows)


def _shape_of(t, op):
    """(rows, cols, w) of a tile value's type; a TypingError otherwise."""
    ok = (isinstance(t, types.UniTuple) and isinstance(t.dtype, types.UniTuple)
          and isinstance(t.dtype.dtype, Vec))  # fmt: skip
    if not ok:
        raise TypingError(f"{op} takes a tile (a tuple of tuples of vectors), got {t}")
    return t.count, t.dtype.count, t.dtype.dtype.w


def _shape_arg(T, op):
    if not isinstance(T, TileType):
        raise TypingError(f"{op}: the shape must be a Tile, got {T}")
    return T.rows, T.cols


def _flat(context, builder, ty, val):
    return context.cast(builder, val, ty, types.intp)


# ---- operations ------------------------------------------------------------------------------
@intrinsic
def tile_zeros(typingctx, L, T):
    w = lanes_arg(L, "tile_zeros")
    rows, cols = _shape_arg(T, "tile_zeros")
    ty = value_type(w, rows, cols)

    def codegen(context, builder, sig, args):
        return context.get_constant_null(ty)

    return ty(L, T), codegen


@intrinsic
def tile_fma(typingctx, t, a, ao, astep, b, bo):
    rows, cols, w = _shape_of(t, "tile_fma")
    array_arg(a, "tile_fma")
    array_arg(b, "tile_fma")
    for i in (ao, astep, bo):
        index_arg(i, "tile_fma")

    def codegen(context, builder, sig, args):
        tv, av, aov, asv, bv, bov = args
        ta, aa, aot, ast, ba, bot = sig.args
        a_data = context.make_array(aa)(context, builder, av).data
        a0, a_step = _flat(context, builder, aot, aov), _flat(context, builder, ast, asv)
        b0 = _flat(context, builder, bot, bov)

        def broadcast(r):
            off = builder.add(a0, builder.mul(a_step, ir.Constant(a0.type, r)))
            return splat(builder, builder.load(builder.gep(a_data, [off], inbounds=True)), w)

        def column(c):
            off = builder.add(b0, ir.Constant(b0.type, c * w))
            return builder.load(pointer(context, builder, ba, bv, types.intp, off, w), align=4)

        acc = [[builder.extract_value(tv, [r, c]) for c in range(cols)] for r in range(rows)]
        fma_name, vty = f"llvm.fmuladd.v{w}f32", vector_type(w)
        # The cheaper way round (see _cost): with rows < cols all broadcasts first and one
        # column at a time, else all columns first and one broadcast at a time.
        if rows < cols:
            s = [broadcast(r) for r in range(rows)]
            for c in range(cols):
                v = column(c)
                for r in range(rows):
                    acc[r][c] = llvm_call(builder, fma_name, vty, [s[r], v, acc[r][c]])
        else:
            v = [column(c) for c in range(cols)]
            for r in range(rows):
                s = broadcast(r)
                for c in range(cols):
                    acc[r][c] = llvm_call(builder, fma_name, vty, [s, v[c], acc[r][c]])
        out = tv
        for r in range(rows):
            for c in range(cols):
                out = builder.insert_value(out, acc[r][c], [r, c])
        return out

    return t(t, a, ao, astep, b, bo), codegen


@intrinsic
def tile_load(typingctx, L, T, m, off):
    w = lanes_arg(L, "tile_load")
    rows, cols = _shape_arg(T, "tile_load")
    array_arg(m, "tile_load")
    index_arg(off, "tile_load")
    ty = value_type(w, rows, cols)

    def codegen(context, builder, sig, args):
        base = _flat(context, builder, sig.args[3], args[3])
        out = context.get_constant_undef(ty)
        for r in range(rows):
            for c in range(cols):
                o = builder.add(base, ir.Constant(base.type, (r * cols + c) * w))
                p = pointer(context, builder, sig.args[2], args[2], types.intp, o, w)
                out = builder.insert_value(out, builder.load(p, align=4), [r, c])
        return out

    return ty(L, T, m, off), codegen


@intrinsic
def tile_store(typingctx, m, off, t):
    rows, cols, w = _shape_of(t, "tile_store")
    array_arg(m, "tile_store", store=True)
    index_arg(off, "tile_store")

    def codegen(context, builder, sig, args):
        base = _flat(context, builder, sig.args[1], args[1])
        for r in range(rows):
            for c in range(cols):
                o = builder.add(base, ir.Constant(base.type, (r * cols + c) * w))
                p = pointer(context, builder, sig.args[0], args[0], types.intp, o, w)
                builder.store(builder.extract_value(args[2], [r, c]), p, align=4)
        return context.get_dummy_value()

    return types.void(m, off, t), codegen


__all__ = ["Tile", "TileType", "fit_rows", "gemm_shape", "gemm_tile", "registers", "tallest",
           "tile", "tile_fma", "tile_load", "tile_store", "tile_zeros", "value_type"]  # fmt: skip
