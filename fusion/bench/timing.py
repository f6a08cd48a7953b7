"""The one timing loop: calls interleaved round by round, medians over rounds.

    timing = interleave({"fusion": run_fused, "ort-all": run_ort}, rounds=20, budget=6.0)
    timing.median("fusion"), timing.table()

Every benchmark here and in bench/ times through `interleave`: warm-up first, then rounds of
one turn per call with the order rotated each round, so that load from other processes (a
shared, noisy machine) slows all of them alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass
class Timing:
    """Seconds per call of each runner over interleaved rounds."""

    threads: int | None
    rounds: int
    times: dict[str, list[float]] = field(default_factory=dict)  # runner -> seconds per call

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def table(self, base: str | None = None) -> str:
        """Median and min per runner, and its speedup over `base` (default: the first runner)."""
        base_median = self.median(base or next(iter(self.times)))
        threads = f", {self.threads} threads" if self.threads else ""
        lines = [f"medians of {self.rounds} interleaved rounds{threads}"]
        lines.append(f"{'runner':<42} {'median ms':>10} {'min ms':>9} {'speedup':>8}")
        for name, samples in self.times.items():
            med = statistics.median(samples)
            lines.append(
                f"{name:<42} {med * 1e3:>10.3f} {min(samples) * 1e3:>9.3f} "
                f"{base_median / med:>7.2f}x"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "threads": self.threads,
            "rounds": self.rounds,
            "median_ms": {k: self.median(k) * 1e3 for k in self.times},
        }


def interleave(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 2,
    min_rounds: int | None = None,
    budget: float = math.inf,
    repeat: int = 1,
    pause: float = 0.0,
    before: Callable[[], object] | None = None,
    threads: int | None = None,
) -> Timing:
    """Each call `warmup` times, then rounds of one turn per call, the order rotated each round.

    A turn is `repeat` calls back to back, timed together (the time per call is kept). `pause`:
    seconds of idling before each round (a machine coming back from idle); `before()`: untimed
    work before each turn. Rounds stop after `rounds`, or, past `min_rounds` (default: all of
    them), once `budget` seconds have passed.
    """
    for _ in range(warmup):
        for call in calls.values():
            call()
    names = list(calls)
    least = rounds if min_rounds is None else min_rounds
    timing = Timing(threads, 0, {name: [] for name in names})
    start = time.perf_counter()
    while timing.rounds < rounds and (
        timing.rounds < least or time.perf_counter() - start < budget
    ):
        if pause:
            time.sleep(pause)
        k = timing.rounds % len(names)
        for name in names[k:] + names[:k]:
            call = calls[name]
            if before is not None:
                before()
            t0 = time.perf_counter()
            for _ in range(repeat):
                call()
            timing.times[name].append((time.perf_counter() - t0) / repeat)
        timing.rounds += 1
    return timing
