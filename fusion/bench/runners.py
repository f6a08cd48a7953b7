"""The runners: built, verified against the unfused run, then timed (fusion.bench.timing).

Runners, all on the same inputs and thread count (intra-op threads = Numba threads = `threads`;
onnxruntime's other settings are fusion.ort's named ones):

  ort-none    onnxruntime REFERENCE (ORT_DISABLE_ALL) on the original model (the unfused run)
  ort-all     onnxruntime DEFAULT (ORT_ENABLE_ALL, its workers spinning as they do by default)
              on the original: what a user runs today, the rival
  fusion      fusion.Session on the rewritten model (kernels + onnxruntime islands)
  ort-fused   onnxruntime DEFAULT on the rewritten model through its function bodies
              (portability: the rewritten file still runs anywhere)
  ort-native  onnxruntime DEFAULT on an equivalent model with a native op (LSTM)

Each runner normally lives in a process of its own (fusion.bench.workers), so onnxruntime keeps
its defaults. In the quick same-process mode the runners take turns in one process, where a
spinning onnxruntime worker would steal the cores of whichever runner comes next: there they
run with fusion.ort.DEFAULT_NO_SPIN instead, and every output says so.

A runner is a function feeds -> list of outputs, with its onnxruntime `settings` (None for
fusion's, whose islands choose their own) and fusion's `session`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx

from fusion.bench.timing import SAME_PROCESS, Timing, interleave
from fusion.catalog import Catalog
from fusion.numerics import compare_arrays
from fusion.ort import DEFAULT, DEFAULT_NO_SPIN, REFERENCE, inference_session
from fusion.runtime import Session

ORT_NONE, ORT_ALL, FUSED, ORT_FUSED, NATIVE = (
    "ort-none",
    "ort-all",
    "fusion",
    "ort-fused",
    "ort-native",
)
_AT_DEFAULTS = "at its defaults (ORT_ENABLE_ALL, spinning)"
_NOT_SPINNING = "ORT_ENABLE_ALL, workers not spinning (same-process mode)"
RUNNERS = {
    ORT_NONE: "onnxruntime ORT_DISABLE_ALL, original model",
    ORT_ALL: f"onnxruntime {_AT_DEFAULTS}, original model",
    FUSED: "fusion.Session, rewritten model",
    ORT_FUSED: f"onnxruntime {_AT_DEFAULTS}, rewritten model (function bodies)",
    NATIVE: f"onnxruntime {_AT_DEFAULTS}, native-op model",
}


def runner_label(name: str, mode: str) -> str:
    """What runner `name` is, in timing mode `mode`: in the quick same-process mode the
    ORT_ENABLE_ALL runners do not spin (DEFAULT_NO_SPIN), and their label says so."""
    label = RUNNERS[name]
    return label.replace(_AT_DEFAULTS, _NOT_SPINNING) if mode == SAME_PROCESS else label


def make_runner(
    name: str,
    model: onnx.ModelProto,
    catalog: Catalog,
    threads: int,
    alone: bool = False,
    progress=None,
):
    """A function feeds -> list of outputs for one runner, with its `settings` and `session`.

    alone: the runner has its process to itself, so onnxruntime keeps its default spinning
    (fusion.ort.DEFAULT); otherwise DEFAULT_NO_SPIN. progress(label, i, total): called before
    each of fusion's kernels is built (building may compile it).
    """
    if name == FUSED:
        session = Session(model, threads=threads, fuse=False, catalog=catalog, progress=progress)
        settings = None
    else:
        settings = REFERENCE if name == ORT_NONE else DEFAULT if alone else DEFAULT_NO_SPIN
        session = inference_session(model, settings, threads)

    def run(feeds):
        return session.run(None, feeds)

    run.session, run.settings = session, settings
    return run


@dataclass
class RunnerInfo:
    name: str
    ok: bool = False
    reason: str = ""  # why it was refused (wrong numbers, does not load)
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    peak_mb: float | None = None  # RSS high-water mark while building and running it, MB
    extra_mb: float | None = None  # that mark minus the RSS just before building it
    settings: str = ""  # fusion.ort settings of its onnxruntime session ("" for fusion's)
    spinning: str = ""  # its session's allow_spinning entry as onnxruntime reports it
    pid: int | None = None  # the process it ran in


def verify_runners(runners, infos, reference, rtol, atol, scaled: bool = False) -> None:
    """Refuse (drop) every runner whose outputs disagree with `reference` (fusion.numerics:
    |got - want| <= atol + rtol * |want|, atol scaled for accumulating kernels), recording why
    in its RunnerInfo. A runner here is anything with run() -> outputs on its feeds
    (fusion.bench.workers)."""
    for name in list(runners):
        info = infos[name]
        try:
            got = runners[name].run()
        except Exception as exc:
            info.ok, info.reason = False, f"fails to run: {first_line(exc)}"
            del runners[name]
            continue
        if len(got) != len(reference):
            info.ok, info.reason = False, f"{len(got)} outputs, expected {len(reference)}"
            del runners[name]
            continue
        pairs = enumerate(zip(got, reference, strict=True))
        outputs = [compare_arrays(f"#{i}", g, w, rtol, atol, scaled=scaled) for i, (g, w) in pairs]
        info.max_abs = max(c.max_abs for c in outputs)
        info.max_rel = max(c.max_rel for c in outputs)
        bad = [c for c in outputs if not c.ok]
        info.ok = not bad
        if bad:
            c = bad[0]
            info.reason = (
                f"wrong numbers: output {c.name} max abs error {c.max_abs:.3g}, max rel "
                f"{c.max_rel:.3g} (rtol {rtol:g}, atol {atol:g}) {c.note}".rstrip()
            )
            del runners[name]


def time_runners(runners: dict, feeds: dict, opts, mode: str = SAME_PROCESS) -> Timing:
    """The runners through the one timing loop, with opts' (fusion.bench.Options) warm-up,
    rounds, calls per turn, minimum rounds and time budget. A runner is feeds -> outputs (called
    here on `feeds`) or a worker with turn(n, warm, gap) (fusion.bench.workers: it holds its
    feeds)."""
    calls = {
        name: run if hasattr(run, "turn") else functools.partial(run, feeds)
        for name, run in runners.items()
    }
    return interleave(
        calls,
        opts.rounds,
        warmup=opts.warmup,
        min_rounds=opts.min_rounds,
        budget=opts.budget,
        repeat=opts.repeat,
        threads=opts.threads,
        mode=mode,
        warm=opts.warm,
        gap=opts.gap,
    )


def spinning_entry(session) -> str:
    """What an onnxruntime session says about its workers' spinning: "0", "1", or "default"
    when the entry is not set (onnxruntime's default: spinning on)."""
    options = getattr(session, "get_session_options", None)
    if options is None:
        return ""
    try:
        return options().get_session_config_entry("session.intra_op.allow_spinning")
    except Exception:  # onnxruntime raises for an entry that was never set
        return "default"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
