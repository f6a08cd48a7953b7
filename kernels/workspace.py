"""Scratch memory for the blocked kernels, reused between calls: one float32 area per Python
thread, cut into one row per Numba thread.

Allocating a kernel's scratch per work item costs a malloc each time, and past 128 KiB glibc
maps fresh pages that fault on first touch; both show at the small images of late CNN layers.
A kernel takes a [threads, n] array and picks its row with numba.get_thread_id() inside its
parallel loop: one worker runs one item at a time, so its row is free.

    >>> rows = per_thread(4096)     # [Numba threads, 4096] float32

Every array from here, and the blocked tensors the kernels return (empty), starts on a
64-byte boundary, a cache line: a vector of 16 lanes loaded at a block's start then never
straddles two lines. NumPy aligns to 16 bytes, so with AVX-512 most vector loads of a
blocked tensor straddled, each costing two: 10-30% of the depthwise kernel's time on two
threads of a Zen 4 (bench/NOTES.md).
"""

import math
import threading

import numba
import numpy as np

from .config import JIT, entry_point, get_threads

_AREA = threading.local()  # .floats: the calling thread's area
KEEP_MAX = 64 << 20  # bytes kept per Python thread; a larger scratch is allocated per call
ALIGN = 64  # bytes
_LANES = ALIGN // 4  # float32s per ALIGN bytes


def empty(shape) -> np.ndarray:
    """An uninitialized C-contiguous float32 array of `shape` (a tuple, or a length) whose data
    starts on an ALIGN-byte boundary (a view into a slightly larger allocation)."""
    if isinstance(shape, tuple | list):
        return _ALIGNED[0](math.prod(shape)).reshape(shape)
    return _ALIGNED[0](int(shape))


@numba.jit(**JIT)
def _aligned(n):
    """n float32s from an ALIGN-byte boundary: in Python, reading an array's address
    (ndarray.ctypes.data) alone costs 2 us, a third of a small conv's call (kernel steps take
    an output each)."""
    raw = np.empty(n + _LANES, np.float32)
    k = (-raw.ctypes.data % ALIGN) // 4
    return raw[k : k + n]


def _bind(n):
    """_aligned's first call: compiles (or loads) it, then every later call skips the
    dispatcher (0.2 of its 1.1 us; `n` is always an int)."""
    out = _aligned(n)
    _ALIGNED[0] = entry_point(_aligned, (n,))
    return out


_ALIGNED = [_bind]  # the function empty() calls


def allocator():
    """The function empty() calls for a length, n -> n aligned float32s: a bound call (a
    kernel's call specialized for one shape, e.g. conv_nchwc.bind_conv_nchwc) allocates its
    output through it, without empty()'s test of the shape's type and its reshape."""
    if _ALIGNED[0] is _bind:
        empty(1)
    return _ALIGNED[0]


def per_thread(n: int) -> np.ndarray:
    """A [Numba threads, m] float32 scratch for one call from this Python thread, m >= n rounded
    up so that every row starts on an ALIGN-byte boundary (uninitialized: a kernel writes what
    it reads)."""
    views = getattr(_AREA, "views", None)
    view = None if views is None else views.get(n)  # the same view for the same n (0.5 us)
    if view is not None:
        return view
    threads = numba.config.NUMBA_NUM_THREADS
    m = -(-max(1, int(n)) // _LANES) * _LANES
    need = threads * m
    area = getattr(_AREA, "floats", None)
    if area is None or area.size < need:
        area = empty(need)
        if 4 * need > KEEP_MAX:
            return area.reshape(threads, m)
        _AREA.floats, _AREA.views = area, {}  # views of a replaced area are dropped
    view = area[:need].reshape(threads, m)
    if len(_AREA.views) < 256:
        _AREA.views[n] = view
    return view


def shared(n: int) -> np.ndarray:
    """A float32 scratch of n values for one call from this Python thread, shared by its Numba
    threads (uninitialized), reused between calls like per_thread's area (a separate one: a
    kernel may take both)."""
    need = max(1, int(n))
    area = getattr(_AREA, "shared", None)
    if area is None or area.size < need:
        area = empty(need)
        if 4 * need <= KEEP_MAX:
            _AREA.shared = area
    return area[:need]


def as_rows(a, shape) -> np.ndarray:
    """a broadcast to `shape` as C-contiguous float32 rows [-1, shape[-1]] (a scalar: [1, 1]);
    an array that already is that is reshaped, not copied: the broadcast and the copy's
    checks cost microseconds per kernel call (a third of a 128 x 256 LayerNorm)."""
    if type(a) is np.ndarray and a.shape == tuple(shape) and a.dtype == np.float32 and (
            a.flags.c_contiguous):  # fmt: skip
        return a.reshape(-1, shape[-1])
    a = np.ascontiguousarray(np.broadcast_to(a, shape), dtype=np.float32)
    return a.reshape(-1, shape[-1]) if a.ndim else a.reshape(1, 1)


def cached_launch(launches: dict, xb, build):
    """A depth-first kernel's launch for x's shape on this thread's thread count, built by
    build(xb, threads) on its first call (checks, geometry, tiles) and kept in `launches`."""
    key = (getattr(xb, "shape", None), get_threads())
    launch = launches.get(key)
    if launch is None or xb.dtype != np.float32:
        launch = launches[key] = build(xb, key[1])
    return launch


def output(shape, out=None, reads: dict | None = None) -> np.ndarray:
    """`out` checked to be a C-contiguous float32 array of `shape` that overlaps none of
    `reads` (disjoint), or a new one (empty)."""
    if out is None:
        return empty(shape)
    if (not isinstance(out, np.ndarray) or out.shape != tuple(shape) or out.dtype != np.float32
            or not out.flags.c_contiguous):  # fmt: skip
        raise ValueError(f"out must be a C-contiguous float32 array of shape {tuple(shape)}")
    disjoint(out, reads or {})
    return out


def disjoint(out: np.ndarray, reads: dict) -> None:
    """A ValueError where `out` may share memory with one of `reads` ({what: array or None}):
    a kernel reads those while it writes out, in tiles that other threads' reads may follow,
    and some tiles are written twice (the overlapping tile at a row's end adds a residual
    again), so out = x or out = residual gives wrong values, not an in-place result. The
    test is of the arrays' memory bounds (numpy.may_share_memory): cheap and never misses,
    but it also refuses an out that only interleaves with a strided view it does not touch
    (a separate array always passes). A residual the plan does not add is not read, nor
    tested. A concatenation's part (conv_nchwc's and winograd_nchwc's `at`) is not tested:
    there x may be another part of the same buffer."""
    for what, array in reads.items():
        if isinstance(array, np.ndarray) and np.may_share_memory(out, array):
            raise ValueError(f"out must not overlap {what}: the kernel reads it while it writes")
