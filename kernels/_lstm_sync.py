"""Atomic int32 operations for Numba kernels, written as LLVM atomics (Numba exposes none).

The LSTM recurrence needs threads to agree that step t is finished before step t + 1 reads h_t,
once per step. A fork/join per step costs more than the step itself, and a spin barrier stalls
everyone when one thread is descheduled (bench/NOTES.md, LSTM). These atomics let threads
publish and read "item done" flags instead, so no thread waits for another longer than a
bounded spin (see lstm.py).

Each is an `@intrinsic`: the atomic instruction is emitted inline in the caller, nothing is
called through a pointer, so functions using them still cache (cache=True).
"""

import platform

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
def atomic_cas(typingctx, arr, idx, expected, val):
    """If arr[idx] == expected, arr[idx] = val, atomically (acquire-release); returns the old
    value (so == expected means this call made the swap)."""
    sig = arr.dtype(arr, idx, expected, val)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _pointer(context, builder, aryty, args[0], args[1])
        old = context.cast(builder, args[2], sig.args[2], aryty.dtype)
        new = context.cast(builder, args[3], sig.args[3], aryty.dtype)
        pair = builder.cmpxchg(ptr, old, new, "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return sig, codegen


# A spin's clock: the time-stamp counter (rdtsc) on x86-64, where it runs at a constant rate.
# Elsewhere LLVM's cycle counter may read 0 or trap in user mode, so there is none: HAS_CLOCK is
# False, and wait_done gives up at once (a thread then computes the item itself).
HAS_CLOCK = platform.machine().lower() in ("x86_64", "amd64")
SPIN_MAX = 200_000  # cycles (~80 us at 2.5 GHz): the longest wait_done ever spins


@intrinsic
def cycles(typingctx):
    """The time-stamp counter, cheap enough to read per work item (0 without HAS_CLOCK)."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        if not HAS_CLOCK:
            return context.get_constant(types.int64, 0)
        fnty = ir.FunctionType(ir.IntType(64), [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.readcyclecounter")
        return builder.call(fn, [])

    return sig, codegen


@intrinsic
def spin_pause(typingctx):
    """x86 `pause`: a spin-wait hint that also saves the core power (nothing elsewhere)."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if HAS_CLOCK:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@numba.jit(**INLINE)
def wait_done(flags, i, done, limit):
    """Spin until flags[i] == done, at most min(limit, SPIN_MAX) cycles; whether it got there
    (False at once without HAS_CLOCK)."""
    if not HAS_CLOCK:
        return atomic_load(flags, i) == done
    limit = min(limit, SPIN_MAX)
    start = cycles()
    while atomic_load(flags, i) != done:
        if cycles() - start > limit:
            return False
        spin_pause()
    return True
