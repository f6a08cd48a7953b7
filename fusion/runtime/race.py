"""The whole-plan race: which of a few ways to run a model is fastest, judged so that the answer
holds on a quiet machine and is not taken at all where the difference is noise.

    verdict = race({"onnxruntime": run_ort, "nchw": run_nchw, "per-node": run_per_node})
    verdict.chosen, verdict.decided, verdict.busy, verdict.to_entry()

Candidates are given simplest first: the first is kept whenever the race cannot tell it from the
fastest (for Session: onnxruntime alone, then kernels in NCHW, then each node's fastest
kernel, then per-node choices).

How a race is run and judged:
- warm-up, then rounds of one turn per candidate, in balanced orders (each candidate follows each
  other equally often, so whatever one leaves behind falls on all alike; the rounds are whole sets
  of those orders); a turn is a burst of calls sized to about `turn_s` seconds (MIN_CALLS at
  least), after as long of untimed calls, and its median is that round's figure: each candidate is
  timed as it runs when called again and again, not as it starts after the pause below (a plan of
  parallel kernels whose threads slept while another candidate ran takes two or three runs to get
  back to speed on some machines, where onnxruntime's spinning workers do not: timed cold,
  mobilenet_v2's kernels raced at 7.4-8.7 ms against their 5.7-6 ms run after run,
  bench/NOTES.md);
- after every turn the process waits until its own threads go idle (onnxruntime's workers
  spin for tens of milliseconds after a run at its defaults, which would slow the next
  candidate: the candidate runs with the settings it will run with, only its leftovers go);
- each candidate's figure is the minimum over rounds of its per-round medians: load from other
  processes only ever adds time, so the least-disturbed round is the closest to a quiet machine;
- each candidate's spread is how far its per-round medians sit above its best one (their
  median relative to the minimum);
- the fastest wins only when it beats every simpler candidate by more than the noise of that
  pair (the smaller of their two spreads: only where both spread can they have swapped; never
  below MIN_MARGIN); else the simplest candidate within the noise of the fastest is kept, and
  the verdict says so;
- the race watches the machine: other processes' CPU use during the race (from /proc/stat,
  steal included, less this process's own time), in cores. A race that saw more than
  BUSY_CORES of it (or, where /proc cannot say, whose deciding pair spread beyond BUSY_NOISE)
  is `busy`: its verdict may serve this process, but a cache should keep it as provisional
  and race again when the machine is quiet.

Nothing here knows a Session: callers pass run callables (fusion/runtime/choice.py builds
them from a session's plans; the tests pass clocks and fake machines).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

MIN_MARGIN = 0.03  # below 3% apart, two plans are called equal whatever the race measured
BUSY_CORES = 0.25  # other processes' CPU use, in cores, above which a race is "under load"
BUSY_NOISE = 0.25  # a spread this large says the machine was disturbed, whatever /proc says
ROUNDS, TURN_S, MAX_CALLS = 6, 0.02, 50  # per candidate: 6 turns of ~20 ms (at most 50 calls)
# ... and at least 3 timed calls a turn: a turn of one call of a 13 ms model (GoogLeNet) took
# its jitter whole, and the race measured 21% of noise between plans 19% apart (bench/NOTES.md)
MIN_CALLS = 3
IDLE_WAIT_S, IDLE_STEP_S, IDLE_SHARE = 0.25, 0.005, 0.2  # waiting for spinning workers to stop


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of 0..n-1 in which every ordered pair (a, b), a != b, stands side by side equally
    often: the rows of a Williams design, 0, 1, n-1, 2, n-2, ... shifted by each k mod n, and
    their reverses too when n is odd."""
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    rows = [[(x + k) % n for x in base] for k in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def burst(
    call: Callable[[], object],
    calls: int,
    before: Callable[[], object] | None = None,
    warm: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """`calls` calls back to back (`before()` untimed ahead of each); seconds per call. With
    `warm`, untimed calls first until that many seconds have passed (at least one)."""
    if warm > 0:
        end = clock() + warm
        call()
        while clock() < end:
            call()
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = clock()
        call()
        times.append(clock() - t0)
    return times


# ---- the machine -----------------------------------------------------------------------------
def _cpu_seconds() -> tuple[float, float] | None:
    """(busy seconds of all CPUs, steal included; this process's CPU seconds, all threads), or
    None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10]) if len(ticks) > 9 else 0  # already counted in user/nice
    return (sum(ticks) - idle - guest) / os.sysconf("SC_CLK_TCK"), time.process_time()


class Machine:
    """How busy the rest of the machine is, measured between start() and stop(): other
    processes' CPU seconds per wall second (cores), and this process's own CPU use per wall
    second (to see its threads go idle)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._start: tuple | None = None

    def start(self) -> None:
        self._start = (self.clock(), _cpu_seconds())

    def elapsed(self) -> float:
        """Wall seconds since start() (0 before it)."""
        return 0.0 if self._start is None else self.clock() - self._start[0]

    def stop(self) -> float | None:
        """Other processes' CPU use since start(), in cores (None where unknown)."""
        if self._start is None:
            return None
        t0, before = self._start
        after, wall = _cpu_seconds(), self.clock() - t0
        if before is None or after is None or wall <= 0:
            return None
        others = (after[0] - before[0]) - (after[1] - before[1])
        return max(0.0, others / wall)

    def wait_idle(self) -> None:
        """Until this process's threads use less than IDLE_SHARE of a core over IDLE_STEP_S
        (onnxruntime's workers stop spinning, bench/NOTES.md), at most IDLE_WAIT_S.
        process_time counts every thread, to the nanosecond."""
        end = self.clock() + IDLE_WAIT_S
        last = time.process_time()
        while self.clock() < end:
            time.sleep(IDLE_STEP_S)
            now = time.process_time()
            if now - last < IDLE_SHARE * IDLE_STEP_S:
                return
            last = now


# ---- the race --------------------------------------------------------------------------------
@dataclass
class Verdict:
    """The outcome of a race. seconds: each candidate's figure (min over rounds of per-round
    medians); noise: the relative spread the race measured (at least MIN_MARGIN); decided:
    whether the chosen candidate is faster than every simpler one by more than the noise
    (False: the race could not tell, and the simplest within noise was kept); load: other
    processes' CPU use during the race in cores (None: unknown); busy: the race ran under
    load, or its conditions are unknown: it should not be trusted beyond this process."""

    chosen: str
    seconds: dict[str, float]
    noise: float
    decided: bool
    load: float | None
    busy: bool
    rounds: int
    failed: dict[str, str] = field(default_factory=dict)  # candidate -> its error, in words

    def to_entry(self) -> dict:
        """What a timing cache keeps (the figures under "plans", the name older entries use)."""
        entry = {k: v for k, v in asdict(self).items() if k not in ("seconds", "failed")}
        return {"plans": dict(self.seconds), **entry}

    @classmethod
    def from_entry(cls, entry: dict) -> Verdict:
        """The verdict a cache entry holds. An entry written before races were judged (only
        "plans", medians of back-to-back calls) is taken as provisional: nothing says the
        machine was quiet when it was timed."""
        seconds = dict(entry["plans"])
        if "chosen" not in entry:
            return cls(min(seconds, key=seconds.get), seconds, MIN_MARGIN, True, None, True, 0)
        fields = {k: entry[k] for k in ("chosen", "noise", "decided", "load", "busy", "rounds")}
        return cls(seconds=seconds, **fields)


def spread(rounds: list[float]) -> float:
    """How far a candidate's per-round medians sit above its best one: their median over their
    minimum, less one (0 for fewer than two finite rounds)."""
    finite = [r for r in rounds if 0 < r < float("inf")]
    return statistics.median(finite) / min(finite) - 1.0 if len(finite) > 1 else 0.0


def judge(figures: Mapping[str, list[float]]) -> tuple[str, dict[str, float], float, bool]:
    """(chosen, per-candidate figure, noise, decided) from each candidate's per-round medians,
    candidates simplest first (see the module docstring). Each simpler candidate is weighed
    against the fastest with the noise of that pair: the smaller of their two spreads, at least
    MIN_MARGIN. Load only adds time, so one candidate's jitter leaves its least disturbed round
    near its quiet time; only where both spread can their figures have swapped (and a jittery
    third candidate blurs nothing). `noise` is the margin that decided (the chosen and the
    fastest). A candidate with no finite round (it failed) is never chosen; with none at all,
    ValueError."""
    seconds = {name: min(rounds) if rounds else float("inf") for name, rounds in figures.items()}
    spreads = {name: spread(rounds) for name, rounds in figures.items()}
    finite = {k: v for k, v in seconds.items() if v < float("inf")}
    if not finite:
        raise ValueError("no candidate ran to the end of the race")
    best = min(finite, key=finite.get)

    def margin(name: str) -> float:
        return max(MIN_MARGIN, min(spreads[name], spreads[best]))

    within = [k for k, v in finite.items() if v <= finite[best] * (1.0 + margin(k))]
    chosen = within[0]  # candidates are simplest first
    return chosen, seconds, margin(chosen), chosen == best and len(within) == 1


def race(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int = ROUNDS,
    turn_s: float = TURN_S,
    clock: Callable[[], float] = time.perf_counter,
    machine: Machine | None = None,
) -> Verdict:
    """Race `candidates` (name -> a call running that plan once, simplest first). A call that
    raises rules its candidate out (its figure is inf, its error in `Verdict.failed`); when
    every candidate fails, the first failure is raised."""
    if not candidates:
        raise ValueError("a race needs at least one candidate")
    machine = machine or Machine(clock)
    names = list(candidates)
    per_call: dict[str, float] = {}
    failed: dict[str, BaseException] = {}
    machine.start()
    for name in names:  # warm-up (compiles, allocations), then one timed call to size turns
        try:
            (per_call[name],) = burst(candidates[name], 1, warm=1e-9, clock=clock)
        except Exception as exc:  # noqa: BLE001 (any failure rules the candidate out)
            failed[name] = exc
        machine.wait_idle()
    if len(failed) == len(names):
        raise next(iter(failed.values()))
    figures: dict[str, list[float]] = {name: [] for name in names}
    orders = balanced_orders(len(names))
    rounds = -(-rounds // len(orders)) * len(orders)  # whole sets of balanced orders
    for r in range(rounds):
        for k in orders[r % len(orders)]:
            name = names[k]
            if name in failed:
                continue
            calls = max(MIN_CALLS, min(MAX_CALLS, int(turn_s / max(per_call[name], 1e-9))))
            try:
                times = burst(candidates[name], calls, warm=turn_s, clock=clock)
                figures[name].append(statistics.median(times))
            except Exception as exc:  # noqa: BLE001
                failed[name] = exc
                figures[name] = []
            machine.wait_idle()
    load = machine.stop()
    if not any(figures.values()):  # every candidate failed after its warm-up
        raise next(iter(failed.values()))
    chosen, seconds, noise, decided = judge(figures)
    # Under load: other processes took more than BUSY_CORES (where /proc says); where it cannot
    # say, a spread of the deciding pair above BUSY_NOISE says the machine was disturbed.
    busy = load > BUSY_CORES if load is not None else noise > BUSY_NOISE
    errors = {name: f"{type(exc).__name__}: {exc}" for name, exc in failed.items()}
    return Verdict(chosen, seconds, noise, decided, load, busy, rounds, errors)


def agrees(recorded: float, observed: list[float], noise: float) -> bool:
    """Whether run times seen later (`observed`, seconds of the chosen plan's runs) agree with
    the figure the race recorded for it: their median within the race's noise of it, either
    way, with a floor of 3x MIN_MARGIN (a plan running much faster than recorded means the race
    ran on a disturbed machine too: every figure it took is suspect)."""
    if not observed or not recorded or recorded == float("inf"):
        return True
    tolerance = max(3 * MIN_MARGIN, 2 * noise)
    ratio = statistics.median(observed) / recorded
    return 1.0 / (1.0 + tolerance) <= ratio <= 1.0 + tolerance
