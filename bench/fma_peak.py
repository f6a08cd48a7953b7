"""This machine's float32 FMA peak per core at the kernels' SIMD width, and the GEMM
micro-kernel's rate beside it.

Peak: independent chains t_i = t_i + a b of W-lane FMAs (the SIMD layer's register tiles,
a and b loop-invariant, so nothing but FMAs in the loop): as many chains as the register file
holds, past latency x FMA ports on every x86 core (4-5 cycles x 2 ports), so the FMA units,
not a chain's latency, bound it. What a perfect micro-kernel would do.

Micro-kernel: kernels/_gemm.py's gemm_batch, the path Winograd and the LSTM take (im2col's
gemm_block runs the same tile body), on one packed A panel [K, MR] and one packed B panel
[K, NR] that stay in L1, K = 256: 2 MR NR K FLOPs per tile. Its share of the peak is what the
tile shape (gemm_tile, from the register file) and the loads of each rank-1 update leave.

One process per core, run at once, so the figures are per core with every core busy (turbo
may differ with one). The width is the process's (kernels.simd.width(), FUSION_SIMD_WIDTH) or
--width.

    .venv/bin/python bench/fma_peak.py [--seconds 1.5] [--cores 2] [--width 8|16]
"""

import argparse
import multiprocessing as mp
import os

import numba
import numpy as np

from fusion.bench.timing import interleave
from fusion_kernels import _gemm, simd
from fusion_kernels.config import JIT_GEMM
from fusion_kernels.machine import cpu_identity
from fusion_kernels.simd import Tile, tile_fma, tile_store, tile_zeros
from fusion_kernels.simd.tile import registers

K = 256  # the micro-kernel's depth: A and B panels of K rows, both in L1
SPARE = 4  # registers the chains leave: the two operands, the loop, one spare
BATCH = 4  # tiles per gemm_batch call (its output, BATCH MR NR floats, stays in L1 too)

HARNESS = dict(JIT_GEMM, cache=False)  # a bench: nothing for the kernels' cache


def chain_tile(w):
    """Tile(chains, 1): a chain per accumulator, as many as the registers hold at w lanes."""
    count, per_register = registers()
    v = -(-w // per_register)  # registers per vector
    return Tile(max(1, (count - SPARE) // v), 1)


@numba.jit(**HARNESS)
def _chains(L, T, n, a, b, out):
    """n rank-1 updates of one operand pair: T.rows independent chains t_r = t_r + a[0] b (a
    stride-0 broadcast, so one register; LLVM hoists both loads out of the loop)."""
    t = tile_zeros(L, T)
    for _ in range(n):
        t = tile_fma(t, a, 0, 0, b, 0)
    tile_store(out, 0, t)  # every accumulator used: nothing is dead code


@numba.jit(**HARNESS)
def _micro_kernel(L, T, n, a, b, mt):
    """n calls of the micro-kernel on the same L1-resident panels, BATCH tiles each."""
    for _ in range(n):
        _gemm.gemm_batch(L, T, a, 0, 0, b, 0, 0, BATCH, K, mt)


def _core(width, seconds, queue, start_line):
    L, T = _gemm.micro_tile(width)
    w = L.width
    chains = chain_tile(w)
    rng = np.random.default_rng(0)
    # Operands that keep every value finite and normal through the whole run.
    a, b = np.full(1, 1e-3, np.float32), rng.random(w, np.float32)
    out = np.empty(chains.rows * w, np.float32)
    mr, nr = T.rows, T.cols * w
    pa, pb = rng.random(K * mr, np.float32), rng.random(K * nr, np.float32)
    mt = np.empty((BATCH, mr, nr), np.float32)
    _chains(L, chains, 10, a, b, out)
    _micro_kernel(L, T, 1, pa, pb, mt)
    start_line.wait()  # every process compiled: the timed windows overlap
    n_fma, n_gemm = 2_000_000, 2_000
    run = {"fma": lambda: _chains(L, chains, n_fma, a, b, out),
           "gemm": lambda: _micro_kernel(L, T, n_gemm, pa, pb, mt)}  # fmt: skip
    timing = interleave(run, 1 << 30, warmup=1, min_rounds=1, budget=seconds)
    peak = n_fma * chains.rows * w * 2 / min(timing.times["fma"]) / 1e9  # the fastest window
    gemm = n_gemm * BATCH * 2 * mr * nr * K / min(timing.times["gemm"]) / 1e9
    queue.put((peak, gemm))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--width", type=int, choices=(8, 16), default=None,
                    help="vector lanes (default: the process's, kernels.simd.width())")  # fmt: skip
    args = ap.parse_args()
    width = args.width or simd.width()
    ctx = mp.get_context("fork")
    queue, start_line = ctx.Queue(), ctx.Barrier(args.cores)
    procs = [ctx.Process(target=_core, args=(width, args.seconds, queue, start_line))
             for _ in range(args.cores)]  # fmt: skip
    for p in procs:
        p.start()
    figures = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    cpu = cpu_identity()
    L, T = _gemm.micro_tile(width)
    chains = chain_tile(width)
    print(f"CPU: {cpu['model_name']} (family {cpu['family']} model {cpu['model']}), "
          f"{cpu['isa']}; W = {width}, {args.cores} cores busy")  # fmt: skip
    peaks, gemms = [f[0] for f in figures], [f[1] for f in figures]
    print(f"float32 FMA peak per core ({chains.rows} chains of {width} lanes): "
          + ", ".join(f"{g:.1f}" for g in peaks) + f" GFLOP/s (sum {sum(peaks):.1f})")  # fmt: skip
    share = 100 * sum(gemms) / sum(peaks)
    print(f"GEMM micro-kernel per core ({T.rows}x{T.cols * width} tile, K = {K}, L1): "
          + ", ".join(f"{g:.1f} ({100 * g / p:.0f}%)" for p, g in figures)
          + f" GFLOP/s (sum {sum(gemms):.1f}, {share:.0f}% of peak)")  # fmt: skip


if __name__ == "__main__":
    main()
