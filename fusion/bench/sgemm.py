"""The SGEMM reference: what the machine's BLAS does on the workload's heaviest GEMM shape.

numpy float32 matmul of [M, K] x [K, N] on `threads` OpenBLAS threads. OpenBLAS's idle workers
spin for a while after each call (2^28 cycles by default), which slows whatever runs next
(bench/NOTES.md, the bench harness). With
OPENBLAS_THREAD_TIMEOUT set to at most 8 before Python starts (bench/run.py sets 4), the SGEMM
is interleaved in the rounds like a runner; otherwise it is timed in its own blocks just before
and just after the runners.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time

import numpy as np

from fusion.bench.timing import interleave


class Sgemm:
    """numpy float32 [M, K] x [K, N] on `threads` OpenBLAS threads, timed in short blocks."""

    def __init__(self, shape: tuple[int, int, int], threads: int):
        self.interleaved = _short_blas_spin()
        rng = np.random.default_rng(0)
        m, k, n = self.shape = tuple(int(d) for d in shape)
        self.a = rng.standard_normal((m, k), dtype=np.float32)
        self.b = rng.standard_normal((k, n), dtype=np.float32)
        self.threads = threads if _blas_threads(threads) else "library default"
        self.times: list[float] = []
        self.a @ self.b

    def __call__(self, _feeds=None) -> None:
        self.a @ self.b

    def block(self, budget: float = 0.25) -> None:
        """5 to 200 calls back to back, within `budget` seconds."""
        timing = interleave({"sgemm": self}, 200, warmup=0, min_rounds=5, budget=budget)
        self.times += timing.times["sgemm"]
        time.sleep(0.1)  # let OpenBLAS's workers stop spinning before anything else is timed


def sgemm_figures(shape, times: list[float], threads, interleaved: bool) -> dict:
    """The reference's figures from its seconds per call; interleaved: timed in the rounds
    with the runners (else in blocks just before and after them)."""
    m, k, n = shape
    med, best = statistics.median(times), min(times)
    return {
        "shape_mkn": [m, k, n],
        "median_ms": med * 1e3,
        "min_ms": best * 1e3,
        "max_ms": max(times) * 1e3,
        "gflops": 2 * m * k * n / med / 1e9,
        "gflops_best": 2 * m * k * n / best / 1e9,
        "blas_threads": threads,
        "interleaved": interleaved,
    }


def busy_seconds(shape: tuple[int, int, int]) -> float:
    """Median seconds of numpy's [M, K] x [K, N] back to back, threads awake and the CPU busy:
    a few 2048^3 products first (cold, the first products ran ~1.5x slower), then 150 calls
    after 50. Meant for a child process with OpenBLAS's own thread timeout (child.warm_sgemm)."""
    rng = np.random.default_rng(1)
    big = rng.standard_normal((2048, 2048)).astype(np.float32)
    for _ in range(5):
        big @ big
    m, k, n = shape
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n)))
    return interleave({"sgemm": lambda: a @ b}, 150, warmup=50).median("sgemm")


def _short_blas_spin() -> bool:
    """OpenBLAS's workers stop spinning at once (OPENBLAS_THREAD_TIMEOUT <= 8, read at load)."""
    value = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")
    return value.isdigit() and int(value) <= 8


def _blas_threads(n: int) -> bool:
    """Set numpy's OpenBLAS thread count through the library itself (numpy has no API)."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return False
    names = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
             "openblas_set_num_threads")  # fmt: skip
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            if hasattr(lib, name):
                getattr(lib, name)(int(n))
                return True
    return False
