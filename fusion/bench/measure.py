"""`measure`: rewrite, verify and time one workload, with its FLOPs, SGEMM reference, per-node
profile and (in child processes) peak memory and compile time.

By default every runner lives in a long-lived process of its own (fusion.bench.workers), built
from the model files, so onnxruntime keeps its defaults; the parent asks each in turn for a
burst of calls, round robin, in a new order each round, after warm-up. Options(mode=
SAME_PROCESS) is the quick mode: all runners take turns in this process (onnxruntime's workers
then must not spin, fusion.ort.DEFAULT_NO_SPIN), and every output says so.

Every runner's outputs are compared with ort-none's before and after timing (fusion.numerics,
the fused rules' tolerance); a runner that disagrees is refused: no time is reported for it.
Then fusion's run is profiled step by step, and each fused node is timed alone against its own
function body in onnxruntime on the inputs it received (a node slower than that is flagged).
"""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path

from fusion.bench.child import compile_times, peak_memory, write_inputs
from fusion.bench.flops import count_flops, inferred_shapes
from fusion.bench.result import BenchResult
from fusion.bench.runners import (
    FUSED,
    NATIVE,
    ORT_ALL,
    ORT_FUSED,
    ORT_NONE,
    RunnerInfo,
    time_runners,
    verify_runners,
)
from fusion.bench.sgemm import sgemm_figures
from fusion.bench.timing import PROCESSES, SAME_PROCESS, interleave
from fusion.bench.traffic import block_traffic, originals
from fusion.bench.workers import (
    BODIES,
    SGEMM,
    Host,
    Keyed,
    LocalWorker,
    WorkerError,
    close_workers,
    start_workers,
    worker_spec,
)
from fusion.bench.workload import Options, Workload
from fusion.errors import FusionError
from fusion.numerics import accumulating, tolerance
from fusion.rewriter import rewrite

FILES = {ORT_NONE: ORT_NONE, ORT_ALL: ORT_NONE, FUSED: FUSED, ORT_FUSED: FUSED, NATIVE: NATIVE}


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
    # once: where inference misses shapes, they come from an onnxruntime run of the model
    shapes = inferred_shapes(workload.model, workload.feeds, opts.threads)
    flops = count_flops(workload.model, workload.feeds, shapes)
    models = {ORT_NONE: workload.model, ORT_ALL: workload.model}
    models |= {FUSED: fused_model, ORT_FUSED: fused_model}
    if workload.native is not None:
        models[NATIVE] = workload.native
    if opts.runners is not None:
        models = {k: v for k, v in models.items() if k in opts.runners or k == ORT_NONE}
    rtol, atol = tolerance(catalog.rules_in(fused_model), opts.rtol, opts.atol)
    scaled = accumulating(catalog.rules_in(fused_model))
    notes = list(flops.notes)
    if not counts:
        notes.append("no catalog pattern matched: the fused run is onnxruntime in one island")

    with tempfile.TemporaryDirectory(prefix="fusion-bench-") as tmp:
        folder = Path(tmp)
        write_inputs(folder, models, workload.feeds)
        mode, blob = opts.mode, None
        if mode == PROCESSES:
            blob, why = _portable(catalog)
            if blob is None:
                mode = SAME_PROCESS
                notes.append(f"same-process mode: {why}")
        say("building runners")
        try:
            workers, infos = _start(mode, models, workload, catalog, blob, folder, flops, opts, say)
        except WorkerError as exc:  # the rules cannot be rebuilt in a process of their own
            mode = SAME_PROCESS
            notes.append(f"same-process mode: fusion's rules cannot be rebuilt in a worker "
                         f"process ({exc})")  # fmt: skip
            workers, infos = _start(mode, models, workload, catalog, blob, folder, flops, opts, say)
        try:
            result = _run(workers, infos, mode, workload, opts, counts, flops, notes, rtol, atol,
                          say, folder, scaled)  # fmt: skip
        finally:
            close_workers(workers)
        if result.profile:
            result.conv = conv_share(rewritten, flops, result.profile["steps"])
            result.traffic = block_traffic(workload.model, rewritten.fusions, shapes,
                                           result.profile["steps"])  # fmt: skip
        gc.collect()
        if (opts.memory or opts.compile) and workload.catalog is not None:
            notes.append("explicit catalog object: memory and compile time not measured")
        elif opts.memory or opts.compile:
            if opts.memory:
                say("peak memory (child process)")
                peak_memory(result, folder, workload, opts.threads)
            if opts.compile and FUSED in infos and infos[FUSED].ok and counts:
                _compile(result, folder, workload, opts.threads, compile_cache, say)
    return result


def _portable(catalog) -> tuple[bytes | None, str]:
    """The catalog pickled for a worker process, or None and why it cannot be."""
    try:
        return pickle.dumps(catalog), ""
    except Exception as exc:
        return None, f"the catalog cannot be sent to a worker process ({type(exc).__name__})"


def _start(mode, models, workload, catalog, blob, folder, flops, opts, say):
    """Every runner's worker, built; RunnerInfo per runner (a runner that cannot load is
    refused, not fatal). Raises WorkerError when fusion's rules cannot be rebuilt."""
    infos = {name: RunnerInfo(name) for name in models}
    shape = flops.gemm_shape if opts.sgemm else None
    if mode == SAME_PROCESS:
        workers, failed = {}, {}
        for name, model in models.items():
            try:
                host = Host(name, model, workload.feeds, opts.threads, catalog)
                workers[name] = LocalWorker(name, host)
            except Exception as exc:
                failed[name] = WorkerError(f"{type(exc).__name__}: {exc}".splitlines()[0])
        if shape:
            workers[SGEMM] = LocalWorker(SGEMM, Host(SGEMM, None, {}, opts.threads, shape=shape))
    else:
        specs = {
            name: worker_spec(name, folder, opts.threads, f"{FILES[name]}.onnx",
                              blob if name == FUSED else None, workload.plugins)
            for name in models
        }  # fmt: skip
        envs = {}
        if shape:
            specs[SGEMM] = worker_spec(SGEMM, folder, opts.threads, shape=shape)
            # OpenBLAS's idle workers sleep at once, not spinning on the cores of the next
            # runner (read when numpy loads it: set for that process only)
            envs[SGEMM] = dict(os.environ, OPENBLAS_THREAD_TIMEOUT="4")
        workers, failed = start_workers(specs, say, envs, last=(FUSED,))
        if FUSED in failed and failed[FUSED].stage == "catalog":
            close_workers(workers)
            raise failed[FUSED]
    for name, exc in failed.items():
        if name in infos:
            infos[name].reason = f"does not load: {exc}"
    for name, w in workers.items():
        if name in infos:
            info = infos[name]
            info.settings, info.spinning, info.pid = (w.info.get(k) for k in
                                                      ("settings", "spinning", "pid"))  # fmt: skip
    if ORT_NONE not in workers:
        close_workers(workers)
        raise FusionError(
            f"{workload.name}: onnxruntime cannot run the original model: {infos[ORT_NONE].reason}"
        )
    return workers, infos


def _run(workers, infos, mode, workload, opts, counts, flops, notes, rtol, atol, say, folder,
         scaled=False):  # fmt: skip
    runners = {n: w for n, w in workers.items() if n in infos}
    sgemm = workers.get(SGEMM)
    say("verifying outputs")
    reference = runners[ORT_NONE].run()
    verify_runners(runners, infos, reference, rtol, atol, scaled)
    say("warming up and timing")
    blocks = mode == SAME_PROCESS and sgemm is not None and not sgemm.host.calls[None].interleaved
    if blocks:  # OpenBLAS's workers would spin into the next runner's turn: apart, before, after
        sgemm.host.calls[None].block()
    timed = dict(runners)
    if sgemm is not None and not blocks:
        timed[SGEMM] = sgemm
    timing = time_runners(timed, workload.feeds, opts, mode)
    sgemm_times = timing.times.pop(SGEMM, None)
    if blocks:
        sgemm.host.calls[None].block()
        sgemm_times = sgemm.host.calls[None].times
    verify_runners(runners, infos, reference, rtol, atol, scaled)  # still right after
    timing.times = {k: v for k, v in timing.times.items() if infos[k].ok}

    result = BenchResult(
        workload.name,
        workload.description,
        opts.threads,
        counts,
        flops.total,
        timing,
        infos,
        sgemm_figures(flops.gemm_shape, sgemm_times, opts.threads, not blocks)
        if sgemm_times
        else {},
        notes=notes,
        batch=workload.items(),
    )
    fused = runners.get(FUSED)
    if opts.profile and fused is not None:
        say("profiling the fused run")
        result.profile = _profile(fused.ask("profile", max(3, min(10, timing.rounds)), opts.warm))
        result.profile["race"] = fused.ask("race")
    if opts.nodes and fused is not None and counts:
        say("each fused node alone against its function body")
        result.nodes = _node_check(fused, mode, workload, opts, folder, say)
        for row in result.nodes:
            if row["slower"]:
                notes.append(
                    f"fused node {row['name']} ({row['runs']}) is slower than onnxruntime on "
                    f"its own body: {row['kernel_ms']:.3f} vs {row['onnxruntime_ms']:.3f} ms"
                )
    return result


def conv_share(rewritten, flops, steps: list[dict]) -> dict:
    """How much of the model's conv FLOPs fusion's own kernels run (the rest runs in
    onnxruntime: islands, or fused nodes left to their function bodies), and of all its counted
    FLOPs (Conv, MatMul, Gemm, LSTM: a transformer's are its MatMuls)."""
    counted = flops.by_node
    conv = {label: f for label, f in counted.items() if label.startswith("Conv ")}
    inside = originals(rewritten.fusions)  # fused node label -> the original nodes it replaced
    kernels = {s["name"] for s in steps if s["kind"] == "kernel"}
    ours = {c for label in kernels for c in inside.get(label, ()) if c in counted}
    total, total_all = sum(conv.values()), sum(counted.values())
    in_conv = sum(conv[c] for c in ours if c in conv)
    in_all = sum(counted[c] for c in ours)
    return {
        "convs": len(conv),
        "convs_in_kernels": len(ours & conv.keys()),
        "gflop": total / 1e9,
        "gflop_in_kernels": in_conv / 1e9,
        "share_in_kernels": in_conv / total if total else None,
        "gflop_counted": total_all / 1e9,
        "share_all_in_kernels": in_all / total_all if total_all else None,
    }


def _profile(rows: list[dict]) -> dict:
    """Where the fused run's time goes: every step, and totals per kind."""
    total = sum(r["seconds"] for r in rows)
    per_kind = {k: sum(r["seconds"] for r in rows if r["kind"] == k) for k in
                ("kernel", "island", "between")}  # fmt: skip
    return {
        "kernel_s": per_kind["kernel"],
        "island_s": per_kind["island"],
        "between_s": per_kind["between"],
        "wall_s": total,
        "kernels": sum(r["kind"] == "kernel" for r in rows),
        "islands": sum(r["kind"] == "island" for r in rows),
        "steps": sorted(
            ({**r, "share": r["seconds"] / total if total else 0.0} for r in rows),
            key=lambda r: -r["seconds"],
        ),
    }


def _node_check(fused, mode, workload, opts, folder, say) -> list[dict]:
    """Each fused node's kernel alone (in fusion's worker) against its function body alone in
    onnxruntime (in a worker of its own, DEFAULT settings), same inputs, round robin."""
    nodes = fused.ask("nodes")
    if not nodes:  # no kernel runs (the session's race kept onnxruntime alone)
        return []
    if mode == SAME_PROCESS:
        host = Host(BODIES, fused.host.model, {}, opts.threads)
        bodies = LocalWorker(BODIES, host)
    else:
        spec = worker_spec(BODIES, folder, opts.threads, f"{FUSED}.onnx")
        started, failed = start_workers({BODIES: spec}, say)
        if failed:
            raise failed[BODIES]
        bodies = started[BODIES]
    try:
        bodies.ask("bodies", nodes)
        calls = {}
        for name, *_ in nodes:
            calls[(name, "kernel")] = Keyed(fused, name)
            calls[(name, "onnxruntime")] = Keyed(bodies, name)
        timing = interleave(calls, opts.node_rounds, warmup=max(1, opts.warmup),
                            repeat=opts.repeat, threads=opts.threads, mode=mode,
                            warm=opts.warm)  # fmt: skip
    finally:
        bodies.close()
    rows = []
    for name, *_, runs in nodes:
        kernel, body = timing.median((name, "kernel")), timing.median((name, "onnxruntime"))
        rows.append({
            "name": name,
            "runs": runs,
            "kernel_ms": kernel * 1e3,
            "onnxruntime_ms": body * 1e3,
            "speedup": body / kernel,
            "slower": kernel > body,
            "onnxruntime_settings": bodies.info.get("settings", ""),
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["kernel_ms"])


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
