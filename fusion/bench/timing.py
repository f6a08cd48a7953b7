"""The one timing loop: turns interleaved round by round, statistics over every timed call.

    timing = interleave({"fusion": run_fused, "ort-all": run_ort}, rounds=20, budget=6.0)
    timing.median("fusion"), timing.stats("fusion")["p90_ms"], timing.table()

Every benchmark here and in bench/ times through `interleave`: warm-up first, then rounds of
one turn per runner, in a new order each round, so that load from other processes (a shared,
noisy machine) slows all of them alike and no runner always follows the same one (whatever a
runner leaves behind, spinning threads or a flushed cache, would always fall on one
neighbour: bench/NOTES.md, recurrent nets). The orders are the rows of a Williams design: over
n rounds (2n for an odd number n of runners) each runner follows each other equally often. A turn
is a burst of calls back to back, each timed on its own, after `warm` seconds of untimed
calls: a process that idled while the others took their turns gets slow CPUs on these virtual
machines for its first tens of milliseconds (bench/NOTES.md, the bench harness), and every
runner gets the same allowance. With `gap`, each timed call also follows that many seconds
of sleep (a service whose requests come apart, a camera's frames: threads that went to sleep,
cold caches). A runner is either a plain callable, timed here (`burst`), or an object
with `turn(calls, warm, gap) -> seconds per call` that times its burst where it lives (a
runner in a process of its own, fusion.bench.workers, which times with the same `burst`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fusion.runtime.race import balanced_orders, burst

SAME_PROCESS = "same process"  # every runner in the measuring process, taking turns
PROCESSES = "own processes"  # every runner in a long-lived process of its own (workers.py)


def percentile(samples, q: float) -> float:
    """The q-th percentile (0-100) of `samples`, linear between order statistics."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


@dataclass
class Timing:
    """Seconds per call of each runner over interleaved rounds of bursts."""

    threads: int | None
    rounds: int
    times: dict[str, list[float]] = field(default_factory=dict)  # runner -> seconds per call
    mode: str = SAME_PROCESS  # where the runners lived: SAME_PROCESS or PROCESSES
    repeat: int = 1  # calls per turn
    warm: float = 0.0  # seconds of untimed calls at the start of each turn
    gap: float = 0.0  # seconds of sleep before each timed call

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def stats(self, name: str) -> dict:
        """Median, min, max, p90 and p99 of one runner's calls, in ms, and how many calls."""
        s = self.times[name]
        return {
            "median_ms": statistics.median(s) * 1e3,
            "min_ms": min(s) * 1e3,
            "max_ms": max(s) * 1e3,
            "p90_ms": percentile(s, 90) * 1e3,
            "p99_ms": percentile(s, 99) * 1e3,
            "calls": len(s),
        }

    def describe(self) -> str:
        """How the figures were taken, in words (heads every table of them)."""
        where = (
            "each runner in its own process"
            if self.mode == PROCESSES
            else "all runners in one process (quick mode)"
        )
        threads = f", {self.threads} threads" if self.threads else ""
        warm = f" after {self.warm * 1e3:.0f} ms of untimed calls" if self.warm else ""
        gap = f", each after {self.gap * 1e3:g} ms asleep" if self.gap else ""
        return (
            f"{where}{threads}; {self.rounds} rounds round robin, orders balanced, "
            f"{self.repeat} timed call{'s' if self.repeat != 1 else ''} per turn{warm}{gap}"
        )

    def table(self, base: str | None = None) -> str:
        """Median, min and p90 per runner, and its speedup over `base` (default: the first)."""
        base_median = self.median(base or next(iter(self.times)))
        width = max([len(n) for n in self.times] + [6])
        lines = [self.describe()]
        lines.append(f"{'runner':<{width}} {'median ms':>10} {'min ms':>9} {'p90 ms':>9} "
                     f"{'speedup':>8}")  # fmt: skip
        for name in self.times:
            s = self.stats(name)
            lines.append(
                f"{name:<{width}} {s['median_ms']:>10.3f} {s['min_ms']:>9.3f} "
                f"{s['p90_ms']:>9.3f} {base_median / self.median(name):>7.2f}x"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "threads": self.threads,
            "rounds": self.rounds,
            "calls_per_turn": self.repeat,
            "warm_s": self.warm,
            "gap_s": self.gap,
            "runners": {k: self.stats(k) for k in self.times},
        }


def interleave(
    calls: Mapping[str, object],
    rounds: int,
    *,
    warmup: int = 2,
    min_rounds: int | None = None,
    budget: float = math.inf,
    repeat: int = 1,
    pause: float = 0.0,
    before: Callable[[], object] | None = None,
    threads: int | None = None,
    mode: str = SAME_PROCESS,
    warm: float = 0.0,
    gap: float = 0.0,
) -> Timing:
    """Each runner `warmup` calls, then rounds of one turn per runner in a new order each.

    calls: name -> a callable (timed here) or an object with turn(n, warm, gap) -> seconds per
    call (timed where it runs). A turn is `repeat` calls back to back, each timed, after `warm`
    seconds of untimed calls (with `gap`, each timed call after that many seconds of sleep).
    `pause`: seconds of idling
    before each round (a machine coming back from idle); `before()`: untimed work before each
    local call. Rounds stop after `rounds`, or, past `min_rounds` (default: all of them), once
    `budget` seconds have passed.
    """

    def turn(name: str, n: int, warm: float, gap: float = 0.0) -> list[float]:
        call = calls[name]
        if hasattr(call, "turn"):
            return call.turn(n, warm, gap) if gap else call.turn(n, warm)
        return burst(call, n, asleep(before, gap), warm)

    names = list(calls)
    orders = balanced_orders(len(names))
    if warmup:
        for name in names:
            turn(name, warmup, 0.0)
    least = rounds if min_rounds is None else min_rounds
    timing = Timing(threads, 0, {name: [] for name in names}, mode, repeat, warm, gap)
    start = time.perf_counter()
    while timing.rounds < rounds and (
        timing.rounds < least or time.perf_counter() - start < budget
    ):
        if pause:
            time.sleep(pause)
        for k in orders[timing.rounds % len(orders)]:
            name = names[k]
            timing.times[name] += turn(name, repeat, warm, gap)
        timing.rounds += 1
    return timing


def asleep(before: Callable[[], object] | None, gap: float) -> Callable[[], object] | None:
    """`before` (untimed work ahead of each timed call), then `gap` seconds of sleep."""
    if not gap:
        return before

    def then_sleep():
        if before is not None:
            before()
        time.sleep(gap)

    return then_sleep
