"""Atomic int32 operations for Numba kernels, written as LLVM atomics (Numba exposes none).

The LSTM recurrence needs threads to agree that step t is finished before step t + 1 reads h_t,
once per step. A fork/join per step (one prange region per step) was measured at 40-90 us per
step on this shared machine with OMP_WAIT_POLICY=PASSIVE, more than the step itself (~20 us);
a spin barrier was ~1 us when both threads ran but a disaster when the other thread was
descheduled (18 ms instead of 0.8 ms for T = 16). These atomics let threads publish and read
"item done" flags instead, so no thread waits for another longer than a bounded spin (see
lstm.py).

Each is an `@intrinsic`: the atomic instruction is emitted inline in the caller, nothing is
called through a pointer, so functions using them still cache (cache=True).
"""

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .config import INLINE


def _pointer(context, builder, aryty, ary, idx):
    return cgutils.get_item_pointer(
        context, builder, aryty, context.make_array(aryty)(context, builder, ary), [idx]
    )


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx] with acquire order: writes published before the matching store are visible."""
    sig = arr.dtype(arr, idx)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _pointer(context, builder, aryty, args[0], args[1])
        return builder.load_atomic(ptr, "acquire", aryty.dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """arr[idx] = val with release order: publishes every earlier write of this thread."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _pointer(context, builder, aryty, args[0], args[1])
        v = context.cast(builder, args[2], sig.args[2], aryty.dtype)
        builder.store_atomic(v, ptr, "release", aryty.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (rdtsc; constant rate on this machine's CPUs): a clock for
    bounding a spin, cheap enough to read per work item."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(64), [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.readcyclecounter")
        return builder.call(fn, [])

    return sig, codegen


@numba.jit(**INLINE)
def wait_done(flags, i, done, limit):
    """Spin until flags[i] == done, at most `limit` cycles; whether it got there."""
    start = cycles()
    while atomic_load(flags, i) != done:
        if cycles() - start > limit:
            return False
    return True
