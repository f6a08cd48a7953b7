"""The blocked channel layout (NCHWc) that fused convolutions, pools and adds pass between them.

    x[n, c, h, w]  ->  xb[n, c // b, h, w, c % b]        b = block(), or C when C < block()

A blocked tensor is float32 [N, ceil(C/b), H, W, b], C-contiguous; the channels past C in the
last block are zero, so a consumer may read whole blocks. With the b channels of a pixel side by
side, a convolution broadcasts one input value against a vector of b output channels and a
depthwise conv or a pool works on b channels per vector instruction: the layout onnxruntime's
NCHWc transformer and oneDNN use. The block is the width of the kernels' vectors
(kernels.simd.width()), so that one block fills one register with float32: NCHW16c with
AVX-512, NCHW8c with AVX2. An input with fewer channels than a block (an RGB image) is stored
with b = C (that is NHWC), so a stem conv does no work on padding channels.

The block is chosen per process, never per file: a rewritten model says nothing of it, and the
kernels read b from the last dimension of their arrays (compiled once per width), so a model
rewritten on one machine runs blocked at the width of another.

Conversions happen only where a blocked region of the graph meets the rest (graph inputs and
outputs, onnxruntime islands); both are one parallel pass over the tensor.

    >>> xb = to_blocked(x)                  # [1, 64, 56, 56] -> [1, 8, 56, 56, 8] with AVX2
    >>> np.array_equal(from_blocked(xb, 64), x)
    True
"""

import numba
import numpy as np

from .config import INLINE, PARALLEL, get_threads
from .simd import lanes, vtranspose, vtranspose_part, width
from .workspace import empty


def block() -> int:
    """Channels per block in this process: the SIMD width, 16 with AVX-512F, else 8
    (FUSION_SIMD_WIDTH forces it). Python side only: a jitted kernel takes its block from
    its Lanes argument or its arrays' shapes, never from a global (see kernels/simd)."""
    return width()


def block_size(channels: int, block: int | None = None) -> int:
    """The block of a tensor with `channels` channels: `block` (default block()), or the
    channel count below it."""
    b = width() if block is None else int(block)
    return b if channels >= b else max(1, int(channels))


def blocked_shape(shape, block: int | None = None) -> tuple:
    """[N, ceil(C/b), H, W, b] for an NCHW shape; b = block_size(C) unless given."""
    n, c, h, w = shape
    b = block_size(c) if block is None else block
    return (n, -(-c // b), h, w, b)


ITEMS_PER_THREAD = 4  # work items a thread gets when planes are cut in parts (load balance)


def plane_parts(items: int, pixels: int) -> int:
    """In how many parts to cut each of `items` planes of `pixels` so that every thread of
    this process gets a few work items: a model's input has one block (an RGB image) and an
    early layer's few, and one thread did all of a plane (a 3x224x224 image's conversion took
    47 us, 25 cut in parts on two threads, Zen 4)."""
    want = ITEMS_PER_THREAD * get_threads()
    return max(1, min(-(-want // max(items, 1)), pixels))


@numba.jit(**INLINE)
def plane_part(task, parts, pixels):
    """(item, p0, p1): work item `task` of a prange over items x parts is pixels [p0, p1) of
    plane `item`. Loops over the part run over slices of it: indexed from an unknown start p0,
    every access kept Numba's negative-index check and LLVM's loop stayed scalar (3x slower
    than a whole plane)."""
    t = np.int64(task)  # prange's index is unsigned: mixed with int64 it would be a float
    chunk = -(-pixels // parts)
    p0 = (t % parts) * chunk
    return t // parts, p0, min(p0 + chunk, pixels)


@numba.jit(**PARALLEL)
def _to_blocked(L, x3, y4, parts):
    """y4[n * CB + cb, p, k] = x3[n, cb * b + k, p] (0 past C). At b = L.width (the process's:
    one compile serves every b) a block moves W pixels at a time as W x W transposes
    (vtranspose; a last block of fewer channels with its missing rows read as zeros); a plane
    part's last pixels, and other b (an RGB image's 3), element by element."""
    n_len, c_len, p_len = x3.shape
    cb_len, b = y4.shape[0] // n_len, y4.shape[2]
    xf, yf = x3.reshape(-1), y4.reshape(-1)
    for task in numba.prange(n_len * cb_len * parts):
        item, p0, p1 = plane_part(task, parts, p_len)
        n, cb = item // cb_len, item % cb_len
        q = p0
        if b == L.width:
            xo, yo, nc = (n * c_len + cb * b) * p_len, item * p_len * b, c_len - cb * b
            for q in range(p0, p1 - b + 1, b):
                if nc >= b:
                    vtranspose(L, xf, xo + q, p_len, yf, yo + q * b, b)
                else:
                    vtranspose_part(L, xf, xo + q, p_len, nc, yf, yo + q * b, b, b)
            q = p0 + max(0, p1 - p0) // b * b  # past the last part p0 may exceed p1
        ys = y4[item, q:p1]
        for k in range(b):
            c = cb * b + k
            if c < c_len:
                xs = x3[n, c, q:p1]
                for p in range(p1 - q):
                    ys[p, k] = xs[p]
            else:
                for p in range(p1 - q):
                    ys[p, k] = 0.0


@numba.jit(**PARALLEL)
def _from_blocked(L, x4, y3, parts):
    """y3[n, c, p] = x4[n * CB + c // b, p, c % b] for c < C, transposed W x W at a time as
    _to_blocked's."""
    n_len, c_len, p_len = y3.shape
    cb_len, b = x4.shape[0] // n_len, x4.shape[2]
    xf, yf = x4.reshape(-1), y3.reshape(-1)
    for task in numba.prange(n_len * cb_len * parts):
        item, p0, p1 = plane_part(task, parts, p_len)
        n, cb = item // cb_len, item % cb_len
        q = p0
        if b == L.width:
            xo, yo, nc = item * p_len * b, (n * c_len + cb * b) * p_len, c_len - cb * b
            for q in range(p0, p1 - b + 1, b):
                if nc >= b:
                    vtranspose(L, xf, xo + q * b, b, yf, yo + q, p_len)
                else:
                    vtranspose_part(L, xf, xo + q * b, b, b, yf, yo + q, p_len, nc)
            q = p0 + max(0, p1 - p0) // b * b  # past the last part p0 may exceed p1
        xs = x4[item, q:p1]
        for k in range(min(b, c_len - cb * b)):
            ys = y3[n, cb * b + k, q:p1]
            for p in range(p1 - q):
                ys[p] = xs[p, k]


def to_blocked(x, block: int | None = None, out=None):
    """The blocked copy of a float32 NCHW array (any strides); `out` if given."""
    if not isinstance(x, np.ndarray) or x.ndim != 4 or x.dtype != np.float32:
        raise ValueError(f"x must be a float32 NCHW array, got {getattr(x, 'shape', x)!r}")
    shape = blocked_shape(x.shape, block)
    out = empty(shape) if out is None else _checked(out, shape)
    n, c, h, w = x.shape
    if x.size:
        x3 = np.ascontiguousarray(x).reshape(n, c, h * w)
        _to_blocked(
            lanes(),
            x3,
            out.reshape(n * shape[1], h * w, shape[4]),
            plane_parts(n * shape[1], h * w),
        )
    return out


def from_blocked(xb, channels: int, out=None):
    """The NCHW array of a blocked tensor holding `channels` channels; `out` if given."""
    if not isinstance(xb, np.ndarray) or xb.ndim != 5 or xb.dtype != np.float32:
        raise ValueError(f"xb must be a float32 blocked array, got {getattr(xb, 'shape', xb)!r}")
    n, cb, h, w, b = xb.shape
    if not (cb - 1) * b < channels <= cb * b and channels > 0:
        raise ValueError(f"{cb} blocks of {b} cannot hold {channels} channels")
    shape = (n, channels, h, w)
    out = np.empty(shape, np.float32) if out is None else _checked(out, shape)
    if out.size:
        xb = np.ascontiguousarray(xb)
        _from_blocked(
            lanes(),
            xb.reshape(n * cb, h * w, b),
            out.reshape(n, channels, h * w),
            plane_parts(n * cb, h * w),
        )
    return out


def _checked(out, shape):
    if (
        not isinstance(out, np.ndarray)
        or out.shape != tuple(shape)
        or out.dtype != np.float32
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {shape}")
    return out
