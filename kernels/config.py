"""The one place for Numba options used by every kernel in this package.

fastmath is a named flag set: "nsz", "arcp", "contract", "afn", "reassoc" let LLVM fuse a*b+c
into one FMA and reorder sums, while leaving out "nnan"/"ninf" keeps NaN and inf honest (a NaN
input still gives a NaN output, as onnxruntime does).

GEMM micro-kernels use GEMM_FASTMATH, the same set without "reassoc". Measured on this machine
(AMD EPYC Zen1, AVX2): with "reassoc" the loop vectorizer turns every register accumulator into a
strided reduction over k (about 9 GFLOP/s per core); without it the SLP vectorizer packs the 4x16
accumulator block into ymm registers (about 30-38 GFLOP/s per core, near peak).
"""

import os
import threading

# Numba's default "omp" threading layer spins idle workers after each parallel loop. On a busy
# machine, or between onnxruntime ops, that spinning steals the cores others need: measured on
# the 4-conv bench under load, 170 ms spinning vs 57 ms passive. libgomp reads this once when
# Numba first starts its thread pool, so it must be set before the first parallel kernel runs;
# setdefault keeps a user's own choice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but sleeping at once costs a futex wake-up at the start of every parallel region, and a
# fused model runs short ones back to back (convs a few tens of microseconds of Python apart).
# An explicit spin count overrides PASSIVE's zero: 1000 spins keep a worker awake for some tens
# of microseconds after a region, then it sleeps as before. A tiny 1x1 conv call, 2 threads:
# 40 us with GOMP_SPINCOUNT=0, 17 us with 1000 (`python bench/overheads.py`, with and without
# the variable). 3000 and 30000 spins were no faster in a scratch run and burnt more CPU.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import numba  # noqa: E402

FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})
GEMM_FASTMATH = FASTMATH - {"reassoc"}

# cache=True: a second process loads machine code from __pycache__ instead of recompiling.
JIT = dict(nopython=True, cache=True, fastmath=set(FASTMATH), error_model="numpy")
JIT_GEMM = dict(JIT, fastmath=set(GEMM_FASTMATH))
INLINE_GEMM = dict(JIT_GEMM, inline="always")  # Numba-level inlining: tuples become registers
INLINE = dict(JIT, inline="always")  # a helper copied into its one caller (no call, no refcounts)
PARALLEL = dict(JIT, parallel=True)


class slp_vectorize:  # noqa: N801 (used like a function: `with slp_vectorize():`)
    """Compile inside this block with LLVM's SLP vectorizer on (Numba turns it off by default).

    The register-blocked micro-kernel is straight-line code over tuples; only SLP turns it into
    vector FMAs. The flag is read when a function is compiled, so wrapping the first call is
    enough; later calls (and cache loads) do not depend on it. A compile running in another
    thread at the same moment would also get SLP, which is harmless. A class rather than
    contextlib.contextmanager: it is entered on every kernel call (1.6-1.8 us with the lock below,
    1.0 without; a contextmanager measured 2.9 us against the lock-free class's 0.3 earlier).

    The flag is one global: it stays on while any thread is inside a block (a count under a
    lock), so a thread leaving its block cannot switch SLP off under another thread's compile.

    Beware: calling a kernel's jitted function directly, outside this block, compiles it
    without SLP, and cache=True then stores that slow code under the same signature for every
    later process (seen: the 1x1 conv 4-5x slower until kernels/__pycache__ was cleared).
    Call kernels through their wrappers (conv2d_bias_act), or wrap the call in this block.
    """

    __slots__ = ()

    def __enter__(self):
        global _slp_inside, _slp_before
        _SLP_LOCK.acquire()
        if _slp_inside == 0:
            _slp_before = numba.config.SLP_VECTORIZE
            numba.config.SLP_VECTORIZE = 1
        _slp_inside += 1
        _SLP_LOCK.release()

    def __exit__(self, *exc):
        global _slp_inside
        _SLP_LOCK.acquire()
        _slp_inside -= 1
        if _slp_inside == 0:
            numba.config.SLP_VECTORIZE = _slp_before
        _SLP_LOCK.release()


_SLP_LOCK = threading.Lock()
_slp_inside = 0  # slp_vectorize blocks entered and not yet left, in all threads
_slp_before = 0  # the flag before the first of them


def set_threads(n):
    """Set how many threads the parallel kernels use (in the calling thread).

    >>> set_threads(2)
    """
    n = int(n)
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], got {n}")
    numba.set_num_threads(n)


def get_threads():
    """Number of threads the parallel kernels use (in the calling thread)."""
    return numba.get_num_threads()
