"""This machine's float32 FMA peak per core, as the kernels' register tiles reach it.

Ten independent chains of 8-wide FMAs (ymm after SLP, as in kernels/_gemm.py), no memory
traffic: what a perfect micro-kernel would do. One process per core, run at once, so the
figure is the per-core peak with every core busy (turbo may differ with one).

    .venv/bin/python bench/fma_peak.py [--seconds 1.5] [--cores 2]
"""

import argparse
import multiprocessing as mp
import os

import numba
import numpy as np

from fusion.bench.timing import interleave
from kernels._gemm import fma8, load8
from kernels.config import GEMM_FASTMATH, slp_vectorize

CHAINS = 10  # FMA latency x FMA units on this machine is below 10: the chains keep them busy


@numba.jit(nopython=True, fastmath=set(GEMM_FASTMATH))
def _chains(n, s, init, add):
    a0, a1, a2, a3, a4 = (
        load8(init, 0),
        load8(init, 8),
        load8(init, 16),
        load8(init, 24),
        load8(init, 32),
    )
    a5, a6, a7, a8, a9 = (
        load8(init, 40),
        load8(init, 48),
        load8(init, 56),
        load8(init, 64),
        load8(init, 72),
    )
    b = load8(add, 0)
    for _ in range(n):  # a_i = b + s a_i: ten dependent chains, one ymm FMA each per trip
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9 = (
            fma8(b, s, a0),
            fma8(b, s, a1),
            fma8(b, s, a2),
            fma8(b, s, a3),
            fma8(b, s, a4),
            fma8(b, s, a5),
            fma8(b, s, a6),
            fma8(b, s, a7),
            fma8(b, s, a8),
            fma8(b, s, a9),
        )
    out = np.zeros(8, np.float32)
    for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):  # every lane used: nothing is dead code
        for j in range(8):
            out[j] += a[j]
    return out


def _core(seconds, queue, start_line):
    rng = np.random.default_rng(0)
    init, add = rng.random(8 * CHAINS, np.float32), rng.random(8, np.float32)
    s = np.float32(0.999)
    with slp_vectorize():
        _chains(10, s, init, add)
    start_line.wait()  # every process compiled: the timed windows overlap
    n = 2_000_000
    run = {"fma": lambda: _chains(n, s, init, add)}
    timing = interleave(run, 1 << 30, warmup=0, min_rounds=1, budget=seconds)
    queue.put(n * CHAINS * 16 / min(timing.times["fma"]) / 1e9)  # the fastest window


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    queue, start_line = ctx.Queue(), ctx.Barrier(args.cores)
    procs = [
        ctx.Process(target=_core, args=(args.seconds, queue, start_line)) for _ in range(args.cores)
    ]
    for p in procs:
        p.start()
    peaks = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"float32 FMA peak per core, {args.cores} cores busy: "
          + ", ".join(f"{g:.1f}" for g in peaks) + f" GFLOP/s (sum {sum(peaks):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
