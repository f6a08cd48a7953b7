"""The runners: built, verified against the unfused run, then timed (fusion.bench.timing).

Runners, all on the same inputs and thread count (intra-op threads = Numba threads = `threads`;
onnxruntime's other settings are fusion.ort's named ones; all of them take turns in one process,
so no onnxruntime worker spins: fusion.ort.DEFAULT_NO_SPIN rather than DEFAULT):

  ort-none    onnxruntime REFERENCE (ORT_DISABLE_ALL) on the original model (the unfused run)
  ort-all     onnxruntime DEFAULT_NO_SPIN (ORT_ENABLE_ALL) on the original: what a user runs
              today, the rival
  fusion      fusion.Session on the rewritten model (kernels + onnxruntime islands)
  ort-fused   onnxruntime DEFAULT_NO_SPIN on the rewritten model through its function bodies
              (portability: the rewritten file still runs anywhere)
  ort-native  onnxruntime DEFAULT_NO_SPIN on an equivalent model with a native op (LSTM)

A runner is a function feeds -> list of outputs. fusion.bench.measure and fusion.compare both
time them through time_runners (the one loop, fusion.bench.timing.interleave).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx

from fusion.bench.timing import Timing, interleave
from fusion.catalog import Catalog
from fusion.numerics import compare_arrays
from fusion.ort import DEFAULT_NO_SPIN, REFERENCE, inference_session
from fusion.runtime import Session

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
        session = Session(model, threads=threads, fuse=False, catalog=catalog)

        def run(feeds):
            return session.run(None, feeds)

        run.session = session
        return run
    settings = REFERENCE if name == ORT_NONE else DEFAULT_NO_SPIN
    session = inference_session(model, settings, threads)
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
    """Refuse (drop) every runner whose outputs disagree with `reference` (fusion.numerics:
    |got - want| <= atol + rtol * |want|), recording why in its RunnerInfo."""
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
        outputs = [compare_arrays(f"#{i}", g, w, rtol, atol) for i, (g, w) in pairs]
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


def time_runners(runners: dict, feeds: dict, opts) -> Timing:
    """The runners (feeds -> outputs) on the same feeds through the one timing loop, with
    opts' (fusion.bench.Options) warm-up, rounds, minimum rounds and time budget."""
    calls = {name: functools.partial(run, feeds) for name, run in runners.items()}
    return interleave(
        calls,
        opts.rounds,
        warmup=opts.warmup,
        min_rounds=opts.min_rounds,
        budget=opts.budget,
        threads=opts.threads,
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
