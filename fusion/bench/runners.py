"""The runners and the one timing loop: build, verify, then time them interleaved.

Runners, all on the same inputs and thread count (intra-op threads = Numba threads = `threads`,
one inter-op thread, sequential execution, allow_spinning "0" everywhere: the settings
fusion.Session's islands use, so that idle onnxruntime workers never spin while another runner
or a Numba kernel needs the cores):

  ort-none    onnxruntime, ORT_DISABLE_ALL, on the original model (the unfused run)
  ort-all     onnxruntime, ORT_ENABLE_ALL, on the original (what a user runs today)
  fusion      fusion.Session on the rewritten model (kernels + onnxruntime islands)
  ort-fused   onnxruntime, ORT_ENABLE_ALL, on the rewritten model through its function bodies
              (portability: the rewritten file still runs anywhere)
  ort-native  onnxruntime, ORT_ENABLE_ALL, on an equivalent model with a native op (LSTM)

A runner is a function feeds -> list of outputs. Timed runs are interleaved (one call of each
runner per round, the order rotated each round) after warm-up, so a noisy shared machine slows
them alike. fusion.bench.measure and fusion.compare both time through `interleave`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import onnx
import onnxruntime as ort

from fusion.catalog import Catalog
from fusion.verify import compare

ORT_NONE, ORT_ALL, FUSED, ORT_FUSED, NATIVE = (
    "ort-none",
    "ort-all",
    "fusion",
    "ort-fused",
    "ort-native",
)
RUNNERS = {
    ORT_NONE: "onnxruntime ORT_DISABLE_ALL, original model",
    ORT_ALL: "onnxruntime ORT_ENABLE_ALL, original model",
    FUSED: "fusion.Session, rewritten model",
    ORT_FUSED: "onnxruntime ORT_ENABLE_ALL, rewritten model (function bodies)",
    NATIVE: "onnxruntime ORT_ENABLE_ALL, native-op model",
}


def make_runner(name: str, model: onnx.ModelProto, catalog: Catalog, threads: int):
    """A function feeds -> list of outputs for one runner (fusion's keeps its `session`)."""
    if name == FUSED:
        from fusion.runtime import Session

        session = Session(model, threads=threads, fuse=False, catalog=catalog)

        def run(feeds):
            return session.run(None, feeds)

        run.session = session
        return run
    level = ort.GraphOptimizationLevel
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        level.ORT_DISABLE_ALL if name == ORT_NONE else level.ORT_ENABLE_ALL
    )
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    data = model.SerializeToString()
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


@dataclass
class RunnerInfo:
    name: str
    ok: bool = False
    reason: str = ""  # why it was refused (wrong numbers, does not load)
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    peak_mb: float | None = None  # RSS high-water mark while building and running it, MB
    extra_mb: float | None = None  # that mark minus the RSS just before building it


def verify_runners(runners, infos, feeds, reference, rtol, atol) -> None:
    """Refuse (drop) every runner whose outputs disagree with `reference` (fusion.verify's
    `compare`: |got - want| <= atol + rtol * |want|), recording why in its RunnerInfo."""
    for name in list(runners):
        info = infos[name]
        try:
            got = runners[name](feeds)
        except Exception as exc:
            info.ok, info.reason = False, f"fails to run: {first_line(exc)}"
            del runners[name]
            continue
        if len(got) != len(reference):
            info.ok, info.reason = False, f"{len(got)} outputs, expected {len(reference)}"
            del runners[name]
            continue
        pairs = enumerate(zip(got, reference, strict=True))
        checks = [compare(f"#{i}", g, w, rtol, atol) for i, (g, w) in pairs]
        info.max_abs = max(c.max_abs for c in checks)
        info.max_rel = max(c.max_rel for c in checks)
        bad = [c for c in checks if not c.ok]
        info.ok = not bad
        if bad:
            c = bad[0]
            info.reason = (
                f"wrong numbers: output {c.name} max abs error {c.max_abs:.3g}, max rel "
                f"{c.max_rel:.3g} (rtol {rtol:g}, atol {atol:g}) {c.note}".rstrip()
            )
            del runners[name]


@dataclass
class Timing:
    """Seconds per call of each runner over interleaved rounds."""

    threads: int
    rounds: int
    times: dict[str, list[float]] = field(default_factory=dict)  # runner -> seconds per call

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def table(self, base: str | None = None) -> str:
        """Median and min per runner, and its speedup over `base` (default: the first runner)."""
        base_median = self.median(base or next(iter(self.times)))
        lines = [f"medians of {self.rounds} interleaved rounds, {self.threads} threads"]
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


def interleave(runners: dict, feeds: dict, opts) -> Timing:
    """Warm-up, then rounds of one call per runner, the order rotated each round.

    opts (fusion.bench.Options): `warmup` calls each first; then rounds until `rounds` are done
    or, past `min_rounds`, `budget` seconds have passed.
    """
    for _ in range(opts.warmup):
        for run in runners.values():
            run(feeds)
    names = list(runners)
    timing = Timing(opts.threads, 0, {name: [] for name in names})
    start = time.perf_counter()
    while timing.rounds < opts.rounds and (
        timing.rounds < opts.min_rounds or time.perf_counter() - start < opts.budget
    ):
        k = timing.rounds % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            runners[name](feeds)
            timing.times[name].append(time.perf_counter() - t0)
        timing.rounds += 1
    return timing


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
