"""Vectors of W float32 lanes for the kernels, W a compile-time parameter: the base of kernels/.

A kernel takes the width as an argument, a `Lanes` value, and builds its vectors from it:

    @numba.jit(**JIT)
    def axpy(L, a, x, y):                  # y = a x + y, any length
        n, w = x.shape[0], L.width
        for i in range(0, n - n % w, w):
            vstore(y, i, vfma(a, vload(L, x, i), vload(L, y, i)))
        i = n - n % w
        m = tail_mask(L, n - i)            # the last n % w elements
        vstore_masked(y, i, vfma(a, vload_masked(L, x, i, m), vload_masked(L, y, i, m)), m)

    axpy(lanes(), np.float32(2), x, y)     # lanes(): this process's width(), 8 or 16

Why an argument: the width lives in the type. Lanes(8) is a `lanes8` in the signature, its
vectors `f32x8` (LLVM's <8 x float>), so one source compiles at either width, only the widths
called are compiled, each is a cache entry of its own, and a test runs both in one process. A
module-level W would be frozen into the machine code, and Numba's cache (keyed on signature
and source file, not on globals) would load the code of one width under a setting of another.

Operations (L a Lanes, v a vector, s a number, m a mask of the same width); every one is
emitted into the calling function, none is a call:
    vzero(L), vbroadcast(L, s), L.width
    vload(L, a, i), vload_aligned(L, a, i), vload_masked(L, a, i, m)       a[i : i + W]
    vstore(a, i, v), vstore_aligned(a, i, v), vstore_masked(a, i, v, m)
        a: a C-contiguous float32 array (any rank), or borrow(array): its data as a pointer,
        which a function it is passed to does not reference-count; i: a flat element offset,
        no bounds check and no wraparound; aligned: a[i] on a 4 W-byte boundary; masked:
        lanes outside m are neither read (they load as 0, and never fault) nor written
    tail_mask(L, n)                 lanes 0 .. n - 1 (n clamped to [0, W])
    mask_all(L, flag)               every lane, or none (flag a boolean)
    v + v, v - s, s * v, v / v, -v, abs(v), v += v     a number on either side is broadcast
    vfma(a, b, c) = a b + c         fused where the CPU has FMA (llvm.fmuladd)
    vmax(a, b), vmin(a, b)          as np.maximum / np.minimum, NaN if either lane is NaN (as
                                    onnxruntime's Max/Min); a on ties (under nsz a zero's sign
                                    may differ)
    v < v, <=, >, >=, ==, !=        a mask; false where a lane is NaN, but != is true there
    m & m, m | m, m ^ m, ~m, vany(m), vall(m)
    vselect(m, a, b)                a where m, else b (vectors or numbers)
    hsum(v), hmax(v), hmin(v)       a pairwise tree over the lanes; hmax/hmin NaN if any is
    vget(v, k), vset(v, k, s)       lane k
    vpermute(v, idx, i)             lane k is v's lane idx[i + k] (an int32 array; one permute)
    vtranspose(L, x, xo, ldx, y, yo, ldy)   a W x W block of x (rows ldx apart) into y transposed
    vtranspose_part(L, x, xo, ldx, nx, y, yo, ldy, ny)   rows past nx read as 0, past ny unwritten
    vpack(t), vunpack(v)            a tuple of W numbers as a vector, a vector as W float32s
    roundeven(x), ldexp_small(p, k)  the pieces of exp
    exp, sigmoid, tanh, erf, log1p01 (approx.py); activate(kind, a, b, v), clip(v, lo, hi)
    (activation.py)
    Tile(rows, cols), tile_zeros, tile_fma, tile_load, tile_store: register tiles of
    accumulators, their shapes from the register file (tile.py: registers, fit_rows, gemm_tile)
Those that work lane by lane (operators, vfma, vmax, vmin, vselect on a boolean, the fits,
activate) take float32 scalars too, so one source serves a kernel's vector body and its
scalar remainder.
"""

from . import activation, approx, tile
from ._ops import (
    borrow,
    hmax,
    hmin,
    hsum,
    ldexp_small,
    mask_all,
    roundeven,
    tail_mask,
    vall,
    vany,
    vbroadcast,
    vfma,
    vget,
    vload,
    vload_aligned,
    vload_masked,
    vmax,
    vmin,
    vpack,
    vpermute,
    vselect,
    vset,
    vstore,
    vstore_aligned,
    vstore_masked,
    vtranspose,
    vtranspose_part,
    vunpack,
    vzero,
)
from ._types import WIDTHS, Lanes, Mask, Vec, lanes, width
from .activation import activate, clip, encode
from .approx import erf, exp, log1p01, sigmoid, tanh
from .tile import Tile, gemm_tile, registers, tile_fma, tile_load, tile_store, tile_zeros

__all__ = ["Lanes", "Mask", "Tile", "Vec", "WIDTHS", "activate", "activation", "approx", "borrow",
           "clip", "encode", "erf", "exp", "gemm_tile", "hmax", "hmin", "hsum", "lanes",
           "ldexp_small", "log1p01", "mask_all", "registers", "roundeven", "sigmoid", "tail_mask",
           "tanh", "tile", "tile_fma", "tile_load", "tile_store", "tile_zeros", "vall",
           "vany", "vbroadcast", "vfma", "vget", "vload", "vload_aligned",
           "vload_masked", "vmax", "vmin", "vpack", "vpermute", "vselect", "vset", "vstore",
           "vstore_aligned", "vstore_masked", "vtranspose", "vtranspose_part", "vunpack", "vzero",
           "width"]  # fmt: skip
