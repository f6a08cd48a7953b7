"""`measure`: rewrite, verify and time one workload, with its FLOPs, SGEMM reference, profile
and (in child processes) peak memory and compile time.

Every runner's outputs are compared with ort-none's before and after timing (fusion.numerics,
the fused rules' tolerance); a runner that disagrees is refused: no time is reported for it.
Figures are medians with min and max over interleaved rounds (fusion.bench.timing).
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from pathlib import Path

from fusion.bench.child import compile_times, peak_memory, write_inputs
from fusion.bench.flops import count_flops
from fusion.bench.result import BenchResult
from fusion.bench.runners import (
    FUSED,
    NATIVE,
    ORT_ALL,
    ORT_FUSED,
    ORT_NONE,
    RunnerInfo,
    first_line,
    make_runner,
    time_runners,
    verify_runners,
)
from fusion.bench.sgemm import Sgemm
from fusion.bench.workload import Options, Workload
from fusion.errors import FusionError
from fusion.numerics import tolerance
from fusion.rewriter import rewrite


def measure(
    workload: Workload,
    options: Options | None = None,
    progress: Callable[[str], None] | None = None,
    compile_cache: dict | None = None,
) -> BenchResult:
    """Rewrite, verify and time one workload; see fusion.bench for what is measured.

    compile_cache: shared across calls, so compile time is measured once per set of fused ops.

        result = measure(Workload("conv", model, feeds), Options(threads=2))
        result.speedup("ort-all")    # median ort-all time / median fusion time
    """
    opts = options or Options()
    say = progress or (lambda _: None)
    catalog = workload.resolved_catalog()
    say("rewriting")
    rewritten = rewrite(workload.model, catalog)
    fused_model = rewritten.model
    counts = {k: v for k, v in rewritten.counts().items() if v}
    flops = count_flops(workload.model, workload.feeds)
    models = {ORT_NONE: workload.model, ORT_ALL: workload.model}
    models |= {FUSED: fused_model, ORT_FUSED: fused_model}
    if workload.native is not None:
        models[NATIVE] = workload.native
    rtol, atol = tolerance(catalog.rules_in(fused_model), opts.rtol, opts.atol)
    notes = list(flops.notes)
    if not counts:
        notes.append("no catalog pattern matched: the fused run is onnxruntime in one island")

    say("building runners")
    runners, infos = {}, {name: RunnerInfo(name) for name in models}
    for name, model in models.items():
        try:
            runners[name] = make_runner(name, model, catalog, opts.threads)
        except Exception as exc:  # a runner that cannot load is refused, not fatal
            infos[name].reason = f"does not load: {first_line(exc)}"
    if ORT_NONE not in runners:
        raise FusionError(
            f"{workload.name}: onnxruntime cannot run the original model: {infos[ORT_NONE].reason}"
        )

    say("verifying outputs")
    reference = runners[ORT_NONE](workload.feeds)
    verify_runners(runners, infos, workload.feeds, reference, rtol, atol)
    sgemm = Sgemm(flops.gemm_shape, opts.threads) if flops.gemm_shape else None
    say("timing")
    together = sgemm is not None and sgemm.interleaved
    if sgemm and not together:
        sgemm.block()  # before and after the runners: the machine's load drifts
    timing = time_runners(
        {**runners, "sgemm": sgemm} if together else runners, workload.feeds, opts
    )
    if together:
        sgemm.times = timing.times.pop("sgemm")
    elif sgemm:
        sgemm.block()
    verify_runners(runners, infos, workload.feeds, reference, rtol, atol)  # still right after
    timing.times = {k: v for k, v in timing.times.items() if infos[k].ok}

    result = BenchResult(
        workload.name,
        workload.description,
        opts.threads,
        counts,
        flops.total,
        timing,
        infos,
        sgemm.to_dict() if sgemm else {},
        notes=notes,
    )
    session = getattr(runners.get(FUSED), "session", None)
    if opts.profile and session is not None and infos[FUSED].ok:
        say("profiling the fused run")
        result.profile = _profile(session, workload.feeds, timing.rounds)
    runners.clear()
    gc.collect()
    if (opts.memory or opts.compile) and workload.catalog is not None:
        notes.append("explicit catalog object: memory and compile time not measured")
    elif opts.memory or opts.compile:
        with tempfile.TemporaryDirectory(prefix="fusion-bench-") as folder:
            write_inputs(Path(folder), models, workload.feeds)
            if opts.memory:
                say("peak memory (child process)")
                peak_memory(result, Path(folder), workload, opts.threads)
            if opts.compile and infos[FUSED].ok and counts:
                _compile(result, Path(folder), workload, opts.threads, compile_cache, say)
    return result


def _profile(session, feeds: dict, rounds: int) -> dict:
    """Where the fused run's time goes: kernels, onnxruntime islands, between them."""
    prof = session.profile(feeds, repeat=max(3, min(10, rounds)))
    return {
        "kernel_s": prof.total("kernel"),
        "island_s": prof.total("island"),
        "between_s": prof.overhead,
        "wall_s": prof.wall,
        "kernels": sum(1 for s in session.steps if s.kind == "kernel"),
        "islands": len(session.islands),
    }


def _compile(result, folder: Path, workload, threads: int, cache: dict | None, say) -> None:
    """Numba compile time, measured once per set of fused ops (shared through `cache`)."""
    key = ",".join(sorted(result.fused))
    cache = cache if cache is not None else {}
    if key not in cache:
        say("Numba compile time, cold and cached (child processes)")
        cache[key] = compile_times(folder, workload, threads)
        cache[key]["measured_on"] = workload.name
    result.compile = dict(cache[key], fused_ops=key)
    if "error" in result.compile:
        result.notes.append(f"compile time: {result.compile['error']}")
