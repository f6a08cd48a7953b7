"""The one place for Numba options used by every kernel in this package, and the thread
settings. Importing it changes no setting (apply_thread_settings does, when called); it gives
Numba the cache locator of this package's functions (kernels/_cache.py), before any of them is
decorated: a cached kernel is stale when any module it imports changes, not only its own.

fastmath is a named flag set: "nsz", "arcp", "contract", "afn", "reassoc" let LLVM fuse a*b+c
into one FMA and reorder sums, while leaving out "nnan"/"ninf" keeps NaN and inf honest (a NaN
input still gives a NaN output, as onnxruntime does). Register-tile kernels and sums whose
order matters use GEMM_FASTMATH / JIT_FIT, the same set without "reassoc" (with it LLVM
reorders what the kernel wrote: bench/NOTES.md); every kernel writes its vectors on the SIMD
layer (kernels/simd), none relies on an auto-vectorizer.
"""

import ctypes
import os
import platform
import threading

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import _cache

_cache.install()

# Numba's OpenMP workers: sleep when idle (spinning steals the cores onnxruntime and other
# processes need), but only after 10000 spins (about half a millisecond of one core), so that
# the parallel regions of a model's run, tens of microseconds of Python apart, do not each pay
# a wake-up: with 1000, runs after the process had slept took twice as long, run after run, on
# these virtual machines. Measurements in bench/NOTES.md (kernels/config.py).
THREAD_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def apply_thread_settings():
    """Set THREAD_SETTINGS in the environment unless the user set them. libgomp reads them once,
    when Numba starts its thread pool (the first parallel kernel call, or set_threads), so this
    must run before that: fusion.Session calls it before it builds its first kernel."""
    for name, value in THREAD_SETTINGS.items():
        os.environ.setdefault(name, value)


# glibc maps each allocation above its mmap threshold fresh from the kernel and unmaps it when
# freed. The threshold adapts to the sizes freed, but not past 32 MB: a larger tensor
# (EfficientNet-B0's first expanded map at batch 8, 38.5 MB) faulted in every page on every
# run, 13.3 ms for a 1x1 conv that takes 3.0 ms with its memory reused (bench/NOTES.md).
# onnxruntime keeps its tensors in an arena of its own; these ask glibc to serve sizes up to
# 1 GB from its heap and to keep what is freed for the next run (at the price of memory the
# process does not give back). FUSION_MALLOC=0, or any MALLOC_* tunable of the user's, leaves
# glibc as it is.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MEMORY_SETTINGS = {M_TRIM_THRESHOLD: 2**31 - 1, M_MMAP_THRESHOLD: 2**30}
MEMORY_SWITCH = "FUSION_MALLOC"
_memory = {"applied": False}


def memory_settings_wanted(env=os.environ) -> bool:
    """Whether apply_memory_settings should change glibc's: not when FUSION_MALLOC=0 or the
    user tuned malloc through its environment (MALLOC_*_ variables, GLIBC_TUNABLES)."""
    if env.get(MEMORY_SWITCH, "1") == "0":
        return False
    return not any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in env)


def apply_memory_settings() -> bool:
    """Set MEMORY_SETTINGS through glibc's mallopt, once per process, when wanted and the C
    library is glibc; returns whether they are in force."""
    if _memory["applied"]:
        return True
    if not memory_settings_wanted() or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _memory["applied"] = all(mallopt(k, v) == 1 for k, v in MEMORY_SETTINGS.items())
    return _memory["applied"]


FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})
GEMM_FASTMATH = FASTMATH - {"reassoc"}

# cache=True: a second process loads machine code from __pycache__ instead of recompiling (while
# the source of the kernel's module and of what it imports is unchanged: kernels/_cache.py).
JIT = dict(nopython=True, cache=True, fastmath=set(FASTMATH), error_model="numpy")
JIT_GEMM = dict(JIT, fastmath=set(GEMM_FASTMATH))
# The approximations (kernels/simd/approx.py) without "reassoc" either: it would fold the Cody-Waite
# reduction x - k ln2_hi - k ln2_lo into x - k ln2, the error it exists to avoid.
JIT_FIT = dict(JIT, fastmath=set(GEMM_FASTMATH))
INLINE_GEMM = dict(JIT_GEMM, inline="always")  # Numba-level inlining: tuples become registers
# LLVM-level inlining (the alwaysinline attribute): compiled once per signature and inlined by
# LLVM, where inline="always" copies and types the callee's Numba IR again at every call site
# (most of a register-tiled kernel's cold compile: bench/NOTES.md). As fast (timed A/B).
FORCE_GEMM = dict(JIT_GEMM, forceinline=True)
INLINE = dict(JIT, inline="always")  # a helper copied into its one caller (no call, no refcounts)
INLINE_FIT = dict(JIT_FIT, inline="always")  # a fit copied into a loop whose kind is fixed
PARALLEL = dict(JIT, parallel=True)

# int64 constants for the int arguments of calls between kernels. A literal int there is typed
# Literal[int](value), not int64, and Numba compiles the callee (and what it calls) once more
# per value: the depthwise conv's item three times in mobilenet_v3_small, ~7 s of its cold start,
# the blocked Winograd's row helper ten times (bench/NOTES.md). A NumPy scalar global, or an
# item of a tuple of them, is typed int64 (and np.bool_(True) bool, not Literal[bool](True)).
# I64[k] for the small ints the calls need (row indices of F(4x4)'s 6 x 6 patch, counts, 1),
# ZERO_I64 for I64[0]; a module's larger constants are np.int64 globals of its own.
# tests/test_warmup.py checks the kernels' source for literal arguments.
I64 = tuple(np.int64(k) for k in range(8))
ZERO_I64 = I64[0]
TRUE = np.bool_(True)


def set_threads(n):
    """Set how many threads the parallel kernels use (in the calling thread). Starts Numba's
    thread pool if it has not started, with the thread settings applied first.

    >>> set_threads(2)
    """
    apply_thread_settings()
    n = int(n)
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], got {n}")
    numba.set_num_threads(n)
    _threads.n = n


_threads = threading.local()  # .n: what set_threads last gave Numba in this thread


def get_threads():
    """Number of threads the parallel kernels use (in the calling thread): what set_threads
    recorded, else Numba's own count. numba.get_num_threads() costs 0.7 us a call, and every
    conv call keys its launch on the count (so set the count through set_threads, not
    numba.set_num_threads, or this reads the older value)."""
    n = getattr(_threads, "n", None)
    return numba.get_num_threads() if n is None else n


def entry_point(dispatcher, args):
    """The machine code of a jitted function for the types of `args`, once a call through the
    dispatcher has compiled it (or loaded it from the cache): calling it skips the dispatcher's
    typing of each argument and its look-up of the overload, about 3 us of a small conv's 5
    (the SIMD layer's Lanes and Tile arguments are typed in Python; bench/NOTES.md). Only for
    a wrapper whose calls cannot change the argument types (arrays it made contiguous, 1-D and
    float32 itself, the same plan); the dispatcher itself when no overload matches."""
    types = tuple(dispatcher.typeof_pyval(a) for a in args)
    compiled = dispatcher.overloads.get(types)
    return dispatcher if compiled is None else compiled.entry_point


# ---- which OS threads run the kernels --------------------------------------------------------
@intrinsic
def _native_id(typingctx):
    """The calling OS thread's id (Linux gettid, glibc 2.30 or later), as an int64."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "gettid"
        )
        return builder.sext(builder.call(fn, []), ir.IntType(64))

    return sig, codegen


@numba.jit(**PARALLEL)
def _record_ids(ids):
    for i in numba.prange(ids.size):
        ids[i] = _native_id()


def worker_ids() -> set[int]:
    """The OS thread ids of the Numba workers that run the calling thread's parallel kernels at
    its current thread count (set_threads): each worker writes its id into a few items of a
    parallel loop, the calling thread's own id left out. For fusion's placement of threads
    (fusion/runtime/placement.py). Linux with glibc 2.30 or later only: where the C library has
    no gettid, compiling this ends the process (LLVM cannot link it), so check first."""
    n = get_threads()
    found: set[int] = set()
    for _ in range(8):  # a static schedule gives every thread items; retried in case it did not
        ids = np.zeros(4 * n, np.int64)
        _record_ids(ids)
        found |= {int(t) for t in ids}
        found.discard(threading.get_native_id())
        if len(found) >= n - 1:
            break
    return found
