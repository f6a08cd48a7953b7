"""The operations on Vec and Mask: Python's operators (typing templates and lowerings, emitted
straight into the caller) and the named operations (numba intrinsics, likewise inlined)."""

from __future__ import annotations

import operator

from llvmlite import ir
from numba.core import types
from numba.core.errors import TypingError
from numba.core.typing.templates import AbstractTemplate, infer_global, signature
from numba.extending import intrinsic, lower_builtin

from ._types import (
    FLOAT_PTR,
    I1,
    I32,
    WIDTHS,
    Mask,
    Vec,
    array_arg,
    index_arg,
    lanes_arg,
    llvm_call,
    mask_arg,
    maximum,
    operands,
    pointer,
    result_type,
    splat,
    suffix,
    target_isa,
    vector_arg,
    vector_type,
    width_of,
)


# ---- operators -------------------------------------------------------------------------------
def _binop(op, emit, result):
    """op(a, b) for a vector and a vector or a number (broadcast): emit(builder, a, b)."""

    class _Template(AbstractTemplate):
        key = op

        def generic(self, args, kws):
            if len(args) == 2 and not kws and any(isinstance(t, Vec) for t in args):
                args = tuple(types.unliteral(t) for t in args)
                return signature(result(width_of(op.__name__, *args)), *args)

    infer_global(op)(_Template)

    def lower(context, builder, sig, args):
        return emit(builder, *operands(context, builder, sig.args, args, sig.return_type.w))

    for tys in ((Vec, Vec), (Vec, types.Number), (types.Number, Vec)):
        lower_builtin(op, *tys)(lower)


def _unary(fn, emit, cls):
    class _Template(AbstractTemplate):
        key = fn

        def generic(self, args, kws):
            if len(args) == 1 and not kws and isinstance(args[0], cls):
                return signature(args[0], args[0])

    infer_global(fn)(_Template)
    lower_builtin(fn, cls)(lambda context, builder, sig, args: emit(builder, args[0]))


def _mask_binop(op, emit):
    class _Template(AbstractTemplate):
        key = op

        def generic(self, args, kws):
            if len(args) == 2 and isinstance(args[0], Mask) and args[0] == args[1]:
                return signature(args[0], *args)

    infer_global(op)(_Template)
    lower_builtin(op, Mask, Mask)(lambda context, builder, sig, args: emit(builder, *args))


def _arith(name):
    return lambda b, x, y: getattr(b, name)(x, y)


def _ordered(cmp):
    return lambda b, x, y: b.fcmp_ordered(cmp, x, y)


# v += w makes a new value, as it does for floats
for _op, _name in ((operator.add, "fadd"), (operator.sub, "fsub"), (operator.mul, "fmul"),
                   (operator.truediv, "fdiv"), (operator.iadd, "fadd"), (operator.isub, "fsub"),
                   (operator.imul, "fmul"), (operator.itruediv, "fdiv")):  # fmt: skip
    _binop(_op, _arith(_name), Vec)
for _op, _cmp in ((operator.lt, "<"), (operator.le, "<="), (operator.gt, ">"),
                  (operator.ge, ">="), (operator.eq, "==")):  # fmt: skip
    _binop(_op, _ordered(_cmp), Mask)
# != is true where a lane is NaN, as it is for floats
_binop(operator.ne, lambda b, x, y: b.fcmp_unordered("!=", x, y), Mask)
_unary(operator.neg, lambda b, v: b.fneg(v), Vec)
_unary(abs, lambda b, v: llvm_call(b, f"llvm.fabs.{suffix(v.type)}", v.type, [v]), Vec)
_unary(operator.invert, lambda b, m: b.not_(m), Mask)
for _op, _name in ((operator.and_, "and_"), (operator.or_, "or_"), (operator.xor, "xor")):
    _mask_binop(_op, _arith(_name))
del _op, _name, _cmp


# ---- constructors, loads and stores ----------------------------------------------------------
@intrinsic
def vzero(typingctx, L):
    w = lanes_arg(L, "vzero")
    return Vec(w)(L), lambda context, builder, sig, args: ir.Constant(vector_type(w), None)


@intrinsic
def vbroadcast(typingctx, L, s):
    w = lanes_arg(L, "vbroadcast")
    if not isinstance(s, types.Number):
        raise TypingError(f"vbroadcast takes a number, got {s}")
    s = types.unliteral(s)

    def codegen(context, builder, sig, args):
        return operands(context, builder, sig.args[1:], args[1:], w)[0]

    return Vec(w)(L, s), codegen


def _load(op, aligned):
    def typer(typingctx, L, a, i):
        w = lanes_arg(L, op)
        array_arg(a, op)
        index_arg(i, op)

        def codegen(context, builder, sig, args):
            p = pointer(context, builder, sig.args[1], args[1], sig.args[2], args[2], w)
            return builder.load(p, align=4 * (w if aligned else 1))

        return Vec(w)(L, a, i), codegen

    typer.__name__ = op
    return intrinsic(typer)


def _store(op, aligned):
    def typer(typingctx, a, i, v):
        array_arg(a, op, store=True)
        index_arg(i, op)
        w = vector_arg(v, op)

        def codegen(context, builder, sig, args):
            p = pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], w)
            builder.store(args[2], p, align=4 * (w if aligned else 1))
            return context.get_dummy_value()

        return types.void(a, i, v), codegen

    typer.__name__ = op
    return intrinsic(typer)


vload, vload_aligned = _load("vload", False), _load("vload_aligned", True)
vstore, vstore_aligned = _store("vstore", False), _store("vstore_aligned", True)


@intrinsic
def borrow(typingctx, a):
    """A C-contiguous float32 array's data as a raw pointer, for vload/vstore (and the tile
    operations) in place of the array, valid while the array lives. A jitted function given
    an array increfs it on entry and decrefs it on exit; inlined into a loop, those are two
    atomic calls per iteration that Numba's reference-count pruning does not always remove (a
    register tile's store in the direct conv's item: bench/NOTES.md). A pointer has no count."""
    array_arg(a, "borrow")
    if a == FLOAT_PTR:
        raise TypingError("borrow: already a pointer")

    def codegen(context, builder, sig, args):
        return context.make_array(sig.args[0])(context, builder, args[0]).data

    return FLOAT_PTR(a), codegen


@intrinsic
def tail_mask(typingctx, L, n):
    w = lanes_arg(L, "tail_mask")
    index_arg(n, "tail_mask")

    def codegen(context, builder, sig, args):
        k = context.cast(builder, args[1], sig.args[1], types.intp)
        zero, full = ir.Constant(k.type, 0), ir.Constant(k.type, w)
        k = builder.select(builder.icmp_signed("<", k, zero), zero, k)
        k = builder.trunc(builder.select(builder.icmp_signed(">", k, full), full, k), I32)
        iota = ir.Constant(vector_type(w, I32), list(range(w)))
        return builder.icmp_signed("<", iota, splat(builder, k, w))

    return Mask(w)(L, n), codegen


@intrinsic
def mask_all(typingctx, L, flag):
    w = lanes_arg(L, "mask_all")
    if not isinstance(flag, types.Boolean):
        raise TypingError(f"mask_all: the flag must be a boolean, got {flag}")

    def codegen(context, builder, sig, args):
        # one i1 splat: a whole-vector mask from a scalar test (a k-register move from a
        # general one), where tail_mask(L, 0 or W) compares a lane index vector
        return splat(builder, args[1], w)

    return Mask(w)(L, flag), codegen


@intrinsic
def vload_masked(typingctx, L, a, i, m):
    w = lanes_arg(L, "vload_masked")
    array_arg(a, "vload_masked")
    index_arg(i, "vload_masked")
    mask_arg(m, w, "vload_masked")

    def codegen(context, builder, sig, args):
        p = pointer(context, builder, sig.args[1], args[1], sig.args[2], args[2], w)
        zeros = ir.Constant(vector_type(w), None)
        return llvm_call(builder, f"llvm.masked.load.v{w}f32.p0", vector_type(w),
                         [p, I32(4), args[3], zeros])  # fmt: skip

    return Vec(w)(L, a, i, m), codegen


@intrinsic
def vstore_masked(typingctx, a, i, v, m):
    array_arg(a, "vstore_masked", store=True)
    index_arg(i, "vstore_masked")
    w = vector_arg(v, "vstore_masked")
    mask_arg(m, w, "vstore_masked")

    def codegen(context, builder, sig, args):
        p = pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], w)
        llvm_call(builder, f"llvm.masked.store.v{w}f32.p0", ir.VoidType(),
                  [args[2], p, I32(4), args[3]])  # fmt: skip
        return context.get_dummy_value()

    return types.void(a, i, v, m), codegen


# ---- lane by lane, on vectors or float32 scalars ---------------------------------------------
def _lanewise(op, arity, emit, doc):
    """An intrinsic op(x1, ..., xn) on vectors of one width and numbers (broadcast), or on
    numbers alone (float32): emit(builder, *operands)."""

    def build(*tys):
        tys = tuple(types.unliteral(t) for t in tys)
        w = width_of(op, *tys)

        def codegen(context, builder, sig, args):
            return emit(builder, *operands(context, builder, sig.args, args, w))

        return result_type(w)(*tys), codegen

    typer = {1: lambda typingctx, x: build(x), 2: lambda typingctx, a, b: build(a, b),
             3: lambda typingctx, a, b, c: build(a, b, c)}[arity]  # fmt: skip
    typer.__name__, typer.__doc__ = op, doc
    return intrinsic(typer)


def _fmuladd(builder, a, b, c):
    return llvm_call(builder, f"llvm.fmuladd.{suffix(a.type)}", a.type, [a, b, c])


def _roundeven(builder, x):
    return llvm_call(builder, f"llvm.roundeven.{suffix(x.type)}", x.type, [x])


def _ldexp(builder, p, k):
    w = p.type.count if isinstance(p.type, ir.VectorType) else 0
    if w == 16 and target_isa().startswith("avx512f"):
        # AVX-512's vscalefps: p 2^floor(k) in one instruction, one rounding, through the
        # denormals and to inf as one multiply would (the integer route below: 11 operations)
        return llvm_call(builder, "llvm.x86.avx512.mask.scalef.ps.512", p.type,
                         [p, k, p, ir.Constant(ir.IntType(16), -1), I32(4)])  # fmt: skip
    k = builder.select(builder.fcmp_unordered("uno", k, k), ir.Constant(k.type, None), k)
    it = vector_type(w, I32) if w else I32
    ki = builder.fptosi(k, it)
    k1 = builder.ashr(ki, ir.Constant(it, [1] * w if w else 1))

    def pow2(e):  # the float whose exponent field is e + 127
        biased = builder.add(e, ir.Constant(it, [127] * w if w else 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(it, [23] * w if w else 23)), p.type)

    return builder.fmul(builder.fmul(p, pow2(k1)), pow2(builder.sub(ki, k1)))


vfma = _lanewise("vfma", 3, _fmuladd, "a b + c, fused (one rounding) where the CPU has FMA.")
vmax = _lanewise("vmax", 2, maximum, "np.maximum(a, b): NaN if either is NaN, else a on ties.")
vmin = _lanewise("vmin", 2, lambda b, x, y: maximum(b, x, y, smaller=True), "np.minimum(a, b).")
roundeven = _lanewise("roundeven", 1, _roundeven, "x to the nearest integer, ties to even.")
ldexp_small = _lanewise("ldexp_small", 2, _ldexp, """p 2^k, k an integer-valued float in
    [-252, 254] (NaN taken as 0): p 2^(k >> 1) 2^(k - k >> 1), two factors of normal exponent,
    so that the product overflows to inf, or underflows through the denormals to 0, as one
    multiply by 2^k would; on 16 lanes compiled for AVX-512, that one vscalefps (exp 5.1 ->
    3.6 ns a vector on Zen 4: bench/NOTES.md).""")  # fmt: skip


@intrinsic
def vselect(typingctx, m, a, b):
    a, b = types.unliteral(a), types.unliteral(b)
    w = width_of("vselect", a, b)
    if isinstance(m, Mask) and w in (0, m.w):
        w = m.w
    elif not isinstance(m, types.Boolean):
        raise TypingError(f"vselect takes a mask (or a boolean) and two values, got {m}, {a}, {b}")

    def codegen(context, builder, sig, args):
        return builder.select(args[0], *operands(context, builder, sig.args[1:], args[1:], w))

    return result_type(w)(m, a, b), codegen


# ---- lanes -----------------------------------------------------------------------------------
def _reduction(op, step):
    """A pairwise tree over the lanes: step(low half, high half) down to one lane."""

    def typer(typingctx, v):
        vector_arg(v, op)

        def codegen(context, builder, sig, args):
            x = args[0]
            n = x.type.count
            while n > 1:
                n //= 2
                lo = builder.shuffle_vector(x, x, ir.Constant(vector_type(n, I32), list(range(n))))
                hi = builder.shuffle_vector(
                    x, x, ir.Constant(vector_type(n, I32), list(range(n, 2 * n)))
                )
                x = step(builder, lo, hi)
            return builder.extract_element(x, I32(0))

        return types.float32(v), codegen

    typer.__name__ = op
    return intrinsic(typer)


hsum = _reduction("hsum", lambda b, lo, hi: b.fadd(lo, hi))
hmax = _reduction("hmax", maximum)
hmin = _reduction("hmin", lambda b, lo, hi: maximum(b, lo, hi, smaller=True))


@intrinsic
def vget(typingctx, v, k):
    vector_arg(v, "vget")
    index_arg(k, "vget")

    def codegen(context, builder, sig, args):
        k = context.cast(builder, args[1], sig.args[1], types.int32)
        return builder.extract_element(args[0], k)

    return types.float32(v, k), codegen


@intrinsic
def vset(typingctx, v, k, s):
    vector_arg(v, "vset")
    index_arg(k, "vset")
    if not isinstance(s, types.Number):
        raise TypingError(f"vset puts a number in a lane, got {s}")
    s = types.unliteral(s)

    def codegen(context, builder, sig, args):
        k = context.cast(builder, args[1], sig.args[1], types.int32)
        x = context.cast(builder, args[2], s, types.float32)
        return builder.insert_element(args[0], x, k)

    return v(v, k, s), codegen


@intrinsic
def vpermute(typingctx, v, idx, i):
    """Lane k of the result is lane idx[i + k] & (W - 1) of v: a lane permutation read from an
    int32 table (the & keeps an index in range; LLVM's extract of a lane past W is poison).
    LLVM turns the W extracts by index into one variable permute (vpermps, on AVX2 and
    AVX-512 alike); a channel gather in the blocked layout is one per source vector."""
    w = vector_arg(v, "vpermute")
    index_arg(i, "vpermute")
    if not (isinstance(idx, types.Array) and idx.dtype == types.int32 and idx.layout == "C"):
        raise TypingError(f"vpermute takes its lanes from a C-contiguous int32 array, got {idx}")

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        at = builder.gep(data, [context.cast(builder, args[2], sig.args[2], types.intp)],
                         inbounds=True)  # fmt: skip
        lanes = builder.load(builder.bitcast(at, vector_type(w, I32).as_pointer()), align=4)
        lanes = builder.and_(lanes, ir.Constant(vector_type(w, I32), [w - 1] * w))
        out = ir.Constant(vector_type(w), ir.Undefined)
        for k in range(w):
            picked = builder.extract_element(args[0], builder.extract_element(lanes, I32(k)))
            out = builder.insert_element(out, picked, I32(k))
        return out

    return v(v, idx, i), codegen


def _transpose_rows(builder, rows, w):
    """The W vectors `rows` (row r, lane c) transposed: log2(W) rounds of two-source shuffles
    (vpermt2ps on AVX-512, vshufps / vperm2f128 on AVX2). Round t swaps bit t of the row index
    with bit t of the lane index: lane c of rows r and r + 2^t (bit t of r clear) is exchanged
    where their bits t differ; after every bit, row k holds what column k was."""
    rows, bit = list(rows), 1
    while bit < w:
        # of rows r (bit clear) and r | bit, the first keeps its lanes c with the bit clear and
        # takes lane c - bit of the second for the others; the second the mirror image
        low = ir.Constant(
            vector_type(w, I32), [c if not c & bit else w + (c ^ bit) for c in range(w)]
        )
        high = ir.Constant(
            vector_type(w, I32), [c | bit if not c & bit else w + c for c in range(w)]
        )
        for r in range(w):
            if not r & bit:
                a, b = rows[r], rows[r | bit]
                rows[r], rows[r | bit] = (builder.shuffle_vector(a, b, low),
                                          builder.shuffle_vector(a, b, high))  # fmt: skip
        bit *= 2
    return rows


def _transpose_codegen(w, counts):
    """The lowering of vtranspose (counts False) and vtranspose_part (True: x's rows past nx
    load as zeros, y's rows past ny are not stored)."""

    def codegen(context, builder, sig, args):
        def flat(k):
            return context.cast(builder, args[k], sig.args[k], types.intp)

        xa, ya = 1, 5 if counts else 4  # argument positions of x and y
        x0, lx, nx = flat(2), flat(3), flat(4) if counts else None
        y0, ly, ny = flat(ya + 1), flat(ya + 2), flat(8) if counts else None

        def address(a, base, step, r):
            off = builder.add(base, builder.mul(step, ir.Constant(step.type, r)))
            return pointer(context, builder, sig.args[a], args[a], types.intp, off, w)

        def inside(n, r):  # every lane when row r < n, else none
            return splat(builder, builder.icmp_signed(">", n, ir.Constant(n.type, r)), w)

        zeros = ir.Constant(vector_type(w), None)
        rows = []
        for r in range(w):
            p = address(xa, x0, lx, r)
            if nx is None:
                rows.append(builder.load(p, align=4))
            else:
                rows.append(llvm_call(builder, f"llvm.masked.load.v{w}f32.p0", vector_type(w),
                                      [p, I32(4), inside(nx, r), zeros]))  # fmt: skip
        for k, row in enumerate(_transpose_rows(builder, rows, w)):
            p = address(ya, y0, ly, k)
            if ny is None:
                builder.store(row, p, align=4)
            else:
                llvm_call(builder, f"llvm.masked.store.v{w}f32.p0", ir.VoidType(),
                          [row, p, I32(4), inside(ny, k)])  # fmt: skip
        return context.get_dummy_value()

    return codegen


def _transpose_args(op, L, x, y, indices):
    w = lanes_arg(L, op)
    array_arg(x, op)
    array_arg(y, op, store=True)
    for i in indices:
        index_arg(i, op)
    return w


@intrinsic
def vtranspose(typingctx, L, x, xo, ldx, y, yo, ldy):
    """y[yo + k ldy + j] = x[xo + j ldx + k] for j, k < W: a W x W block moved transposed, W
    vector loads (rows of x, ldx apart), _transpose_rows, W vector stores (rows of y, ldy
    apart). Flat offsets, unchecked, as vload's. Element by element, the blocked layout's
    conversions moved 3-4x fewer bytes a second than a copy (bench/NOTES.md)."""
    w = _transpose_args("vtranspose", L, x, y, (xo, ldx, yo, ldy))
    return types.void(L, x, xo, ldx, y, yo, ldy), _transpose_codegen(w, counts=False)


@intrinsic
def vtranspose_part(typingctx, L, x, xo, ldx, nx, y, yo, ldy, ny):
    """vtranspose with x's rows j >= nx read as zeros (never touched) and y's rows k >= ny not
    written: a last block of fewer channels than W."""
    w = _transpose_args("vtranspose_part", L, x, y, (xo, ldx, nx, yo, ldy, ny))
    return types.void(L, x, xo, ldx, nx, y, yo, ldy, ny), _transpose_codegen(w, counts=True)


def _mask_reduction(op, name):
    def typer(typingctx, m):
        if not isinstance(m, Mask):
            raise TypingError(f"{op} takes a mask, got {m}")

        def codegen(context, builder, sig, args):
            return llvm_call(builder, f"llvm.vector.reduce.{name}.v{m.w}i1", I1, [args[0]])

        return types.boolean(m), codegen

    typer.__name__ = op
    return intrinsic(typer)


vany, vall = _mask_reduction("vany", "or"), _mask_reduction("vall", "and")


# ---- tuples ----------------------------------------------------------------------------------
@intrinsic
def vpack(typingctx, t):
    """The tuple t of W numbers as a vector (W in WIDTHS; each converted to float32): how code
    still written on tuples hands its values to the layer."""
    ok = isinstance(t, types.BaseTuple) and len(t) in WIDTHS
    if not ok or not all(isinstance(e, (types.Integer, types.Float)) for e in t):
        widths = " or ".join(map(str, WIDTHS))
        raise TypingError(f"vpack takes a tuple of {widths} numbers, got {t}")
    w = len(t)

    def codegen(context, builder, sig, args):
        v = ir.Constant(vector_type(w), ir.Undefined)
        for k, ty in enumerate(sig.args[0]):
            x = context.cast(builder, builder.extract_value(args[0], k), ty, types.float32)
            v = builder.insert_element(v, x, I32(k))
        return v

    return Vec(w)(t), codegen


@intrinsic
def vunpack(typingctx, v):
    """The lanes of v as a tuple of W float32 (vpack's inverse)."""
    w = vector_arg(v, "vunpack")
    tup = types.UniTuple(types.float32, w)

    def codegen(context, builder, sig, args):
        lanes = [builder.extract_element(args[0], I32(k)) for k in range(w)]
        return context.make_tuple(builder, tup, lanes)

    return tup(v), codegen
