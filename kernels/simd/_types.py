"""The width (chosen once per process, carried as a type) and the Numba types of the layer:
Vec(W) over LLVM's <W x float>, Mask(W) over <W x i1>, and the typing and code-generation
helpers the operations in _ops.py share."""

from __future__ import annotations

import functools
import os

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.core.typing.templates import AttributeTemplate
from numba.extending import (
    NativeValue,
    infer_getattr,
    lower_getattr,
    models,
    register_model,
    typeof_impl,
    unbox,
)

from ..machine import vector_isa

WIDTHS = (4, 8, 16)  # what a Lanes may hold; width() picks 8 or 16


@functools.cache
def width() -> int:
    """The lanes of the vectors kernels use in this process: FUSION_SIMD_WIDTH (8 or 16) when
    set, else 16 if the CPU Numba compiles for has AVX-512F, else 8 (AVX2, and anything older:
    LLVM splits a vector into the registers the CPU has). Read once, at the first call.

    The CPU is Numba's target: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, else this one.
    NUMBA_CPU_NAME alone keeps this CPU's features (Numba's rule); a named CPU with its
    features left empty has them unknown here, and gets 8.

    >>> width()   # 8 on an AVX2 CPU, 16 on AVX-512
    """
    forced = os.environ.get("FUSION_SIMD_WIDTH", "")
    if forced:
        if forced.strip() not in ("8", "16"):
            raise ValueError(f"FUSION_SIMD_WIDTH must be 8 or 16, got {forced!r}")
        return int(forced)
    return 16 if target_isa().startswith("avx512f") else 8


@functools.cache
def target_isa() -> str:
    """The vector ISA of the CPU Numba compiles for ("avx512f+fma", "avx2+fma", ...: the rule
    of kernels.machine.vector_isa), read from Numba's code generator."""
    from numba.core.registry import cpu_target  # Numba's codegen: the target it compiles for

    _, _, features = cpu_target.target_context.codegen().magic_tuple()
    return vector_isa({f[1:] for f in features.split(",") if f.startswith("+")})


class Lanes:
    """The width of a kernel's vectors, passed to it as an argument (typed `lanes{W}`).

    >>> Lanes(16).width
    16
    """

    __slots__ = ("_numba_type_", "width")

    def __init__(self, width: int):
        if width not in WIDTHS:
            raise ValueError(f"a vector has {' or '.join(map(str, WIDTHS))} lanes, got {width!r}")
        self.width = int(width)
        # Numba's dispatcher reads this attribute in C; an object without it is typed by a
        # call back into Python (typeof) on every call of a kernel from Python (bench/NOTES.md)
        self._numba_type_ = LanesType(self.width)

    def __repr__(self):
        return f"Lanes({self.width})"


def lanes(w: int | None = None) -> Lanes:
    """Lanes(w), or Lanes(width()) when w is None: what a kernel's wrapper passes (one object
    per width: building one, and its Numba type, costs microseconds a small call would pay)."""
    return _lanes(width() if w is None else w)


@functools.cache
def _lanes(w: int) -> Lanes:
    return Lanes(w)


class Vec(types.Type):
    """W float32 lanes, one LLVM <W x float> value."""

    def __init__(self, w):
        self.w = w
        super().__init__(name=f"f32x{w}")


class Mask(types.Type):
    """W booleans, one LLVM <W x i1> value (what a compare gives, what a select takes)."""

    def __init__(self, w):
        self.w = w
        super().__init__(name=f"mask{w}")


class LanesType(types.Type):
    def __init__(self, w):
        self.w = w
        super().__init__(name=f"lanes{w}")


F32, I32, I1 = ir.FloatType(), ir.IntType(32), ir.IntType(1)


def vector_type(w, element=F32):
    return ir.VectorType(element, w)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, vector_type(fe_type.w))


@register_model(Mask)
class _MaskModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, vector_type(fe_type.w, I1))


register_model(LanesType)(models.OpaqueModel)  # no data: the width is in the type


@typeof_impl.register(Lanes)
def _typeof_lanes(val, c):
    return LanesType(val.width)


@unbox(LanesType)
def _unbox_lanes(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


@infer_getattr
class _LanesAttributes(AttributeTemplate):
    key = LanesType

    def resolve_width(self, ty):
        return types.intp


@lower_getattr(LanesType, "width")
def _lanes_width(context, builder, ty, val):
    return context.get_constant(types.intp, ty.w)


# ---- typing: checks with a message -----------------------------------------------------------
def lanes_arg(L, op):
    if not isinstance(L, LanesType):
        raise TypingError(f"{op}: the first argument is the width (a Lanes), got {L}")
    return L.w


def width_of(op, *tys):
    """The width of the vectors among tys, 0 when all are real numbers; an error otherwise."""
    ws = {t.w for t in tys if isinstance(t, Vec)}
    if len(ws) > 1 or not all(isinstance(t, (Vec, types.Integer, types.Float)) for t in tys):
        got = ", ".join(map(str, tys))
        raise TypingError(f"{op} takes vectors of one width and numbers, got {got}")
    return ws.pop() if ws else 0


def result_type(w):
    """Vec(w), or float32 for w = 0 (an operation on scalars)."""
    return Vec(w) if w else types.float32


# A float32 array's data as a raw pointer (_ops.borrow): no reference count, so a function it is
# passed to (and inlined) adds no NRT_incref/NRT_decref calls, as it does for an array argument.
FLOAT_PTR = types.CPointer(types.float32)


def array_arg(a, op, store=False):
    if a == FLOAT_PTR:
        return
    ok = isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C"
    if not ok or (store and not a.mutable):
        what = "a writable" if store else "a"
        raise TypingError(f"{op} needs {what} C-contiguous float32 array or borrow(), got {a}")


def index_arg(i, op):
    if not isinstance(i, types.Integer):
        raise TypingError(f"{op}: the index must be an integer, got {i}")


def vector_arg(v, op):
    if not isinstance(v, Vec):
        raise TypingError(f"{op} takes a vector, got {v}")
    return v.w


def mask_arg(m, w, op):
    if m != Mask(w):
        raise TypingError(f"{op} needs a mask{w}, got {m}")


# ---- code generation -------------------------------------------------------------------------
def splat(builder, x, w):
    """<w x T> with every lane x."""
    v = builder.insert_element(ir.Constant(vector_type(w, x.type), ir.Undefined), x, I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(vector_type(w, I32), [0] * w))


def operands(context, builder, tys, vals, w):
    """vals as float32 vectors of w lanes (numbers converted and broadcast; w = 0: scalars)."""
    out = []
    for ty, val in zip(tys, vals, strict=True):
        if not isinstance(ty, Vec):
            val = context.cast(builder, val, ty, types.float32)
            val = splat(builder, val, w) if w else val
        out.append(val)
    return out


def llvm_call(builder, name, ret, args):
    """A call of LLVM intrinsic `name` (declared on first use)."""
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def suffix(ty):
    """An intrinsic's type suffix: v8f32 for <8 x float>, f32 for float."""
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"


def pointer(context, builder, aty, a, ity, i, w):
    """<w x float>* to array a's element at flat offset i (no bounds check, no wraparound); a
    may be a borrowed pointer (FLOAT_PTR) to the array's data."""
    data = a if aty == FLOAT_PTR else context.make_array(aty)(context, builder, a).data
    p = builder.gep(data, [context.cast(builder, i, ity, types.intp)], inbounds=True)
    return builder.bitcast(p, vector_type(w).as_pointer())


def maximum(builder, a, b, smaller=False):
    """np.maximum (np.minimum) lane by lane: b where b > a (b < a) or b is NaN, else a. On x86
    one max instruction (it returns its second operand on NaN) plus the NaN test of b, which
    LLVM drops when b is a constant."""
    pick_b = builder.or_(builder.fcmp_ordered("<" if smaller else ">", b, a),
                         builder.fcmp_unordered("uno", b, b))  # fmt: skip
    return builder.select(pick_b, b, a)
