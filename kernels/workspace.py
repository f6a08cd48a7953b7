"""Scratch memory for the blocked kernels, reused between calls: one float32 area per Python
thread, cut into one row per Numba thread.

Allocating a kernel's scratch per work item costs a malloc each time, and past 128 KiB glibc
maps fresh pages that fault on first touch; both show at the small images of late CNN layers.
A kernel takes a [threads, n] array and picks its row with numba.get_thread_id() inside its
parallel loop: one worker runs one item at a time, so its row is free.

    >>> rows = per_thread(4096)     # [Numba threads, 4096] float32
"""

import threading

import numba
import numpy as np

_AREA = threading.local()  # .floats: the calling thread's area
KEEP_MAX = 64 << 20  # bytes kept per Python thread; a larger scratch is allocated per call


def per_thread(n: int) -> np.ndarray:
    """A [Numba threads, n] float32 scratch for one call from this Python thread (uninitialized:
    a kernel writes what it reads)."""
    threads = numba.config.NUMBA_NUM_THREADS
    need = threads * max(1, int(n))
    area = getattr(_AREA, "floats", None)
    if area is None or area.size < need:
        area = np.empty(need, np.float32)
        if 4 * need <= KEEP_MAX:
            _AREA.floats = area
    return area[:need].reshape(threads, -1)


def shared(n: int) -> np.ndarray:
    """A float32 scratch of n values for one call from this Python thread, shared by its Numba
    threads (uninitialized), reused between calls like per_thread's area (a separate one: a
    kernel may take both)."""
    need = max(1, int(n))
    area = getattr(_AREA, "shared", None)
    if area is None or area.size < need:
        area = np.empty(need, np.float32)
        if 4 * need <= KEEP_MAX:
            _AREA.shared = area
    return area[:need]
