"""Side-by-side timing of one model: onnxruntime unfused, onnxruntime default, fusion.Session.

Runs are interleaved (one call of each per round) after warm-up, so that a noisy, shared
machine slows all of them alike; the figures are medians over rounds. Outputs are compared
first: no speed is reported for wrong numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from fusion.io import FusionError


@dataclass
class Timing:
    threads: int
    rounds: int
    times: dict[str, list[float]] = field(default_factory=dict)  # runner -> seconds per call

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def table(self) -> str:
        base = self.median(UNFUSED)
        lines = [f"medians of {self.rounds} interleaved rounds, {self.threads} threads"]
        lines.append(f"{'runner':<42} {'median ms':>10} {'min ms':>9} {'speedup':>8}")
        for name, samples in self.times.items():
            med = statistics.median(samples)
            lines.append(
                f"{name:<42} {med * 1e3:>10.3f} {min(samples) * 1e3:>9.3f} {base / med:>7.2f}x"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "threads": self.threads,
            "rounds": self.rounds,
            "median_ms": {k: self.median(k) * 1e3 for k in self.times},
        }


UNFUSED = "onnxruntime, optimizations disabled"
DEFAULT = "onnxruntime, ORT_ENABLE_ALL"
FUSED = "fusion.Session (fused)"


def ort_session(model, threads: int, optimize: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    data = model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def compare(
    model,
    feeds: dict | None = None,
    threads: int | None = None,
    rounds: int = 20,
    warmup: int = 3,
    catalog=None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
) -> Timing:
    """Time the original model in onnxruntime (both levels) and fused in fusion.Session."""
    import os

    from fusion.runtime import Session, load
    from fusion.verify import model_inputs

    model = load(model)
    threads = threads or os.cpu_count() or 1
    if feeds is None:
        feeds, _ = model_inputs(model, None, 0, None)
    runners = {
        UNFUSED: ort_session(model, threads, optimize=False).run,
        DEFAULT: ort_session(model, threads, optimize=True).run,
        FUSED: Session(model, threads=threads, catalog=catalog).run,
    }
    reference = runners[UNFUSED](None, feeds)
    for name, run in runners.items():
        for want, got in zip(reference, run(None, feeds), strict=True):
            if not np.allclose(got, want, rtol=rtol, atol=atol):
                err = float(np.abs(np.asarray(got, np.float64) - want).max())
                raise FusionError(f"{name} disagrees with onnxruntime (max abs error {err:.3g})")
    for _ in range(warmup):
        for run in runners.values():
            run(None, feeds)
    timing = Timing(threads, rounds, {name: [] for name in runners})
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run(None, feeds)
            timing.times[name].append(time.perf_counter() - start)
    return timing
