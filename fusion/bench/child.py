"""Measurements in child processes: peak memory per runner, Numba compile time, and the SGEMM
with its threads awake (warm_sgemm).

The models and inputs are written to a folder (write_inputs); each child rebuilds the catalog
from the workload's rule modules and plugins, and reports one line tagged RESULT_TAG.

Peak memory: the RSS high-water mark of a process that has imported everything and loaded the
models, while it builds one runner and runs it once (Linux /proc/self/clear_refs resets the mark
between runners; elsewhere one process per runner). Compile time: Session build + first run,
cold in a fresh NUMBA_CACHE_DIR, then cached in a second process on the same folder.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from fusion.bench.result import BenchResult
from fusion.bench.runners import FUSED, NATIVE, ORT_ALL, ORT_FUSED, ORT_NONE, make_runner
from fusion.bench.sgemm import busy_seconds
from fusion.bench.workload import Workload, catalog_with
from fusion.registry import load_plugin

RESULT_TAG = "FUSION-BENCH-RESULT "  # the line a child process reports on


def write_inputs(folder: Path, models: dict, feeds: dict) -> None:
    for name in (ORT_NONE, FUSED, NATIVE):
        if name in models:
            onnx.save(models[name], str(folder / f"{name}.onnx"))
    np.savez(folder / "feeds.npz", **feeds)


def _child(spec: dict, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "fusion.bench", "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    lines = done.stderr.strip().splitlines() or ["no output"]
    errors = [ln for ln in lines if "Error" in ln.split(":", 1)[0]]  # "numba...TypingError: ..."
    return {"error": f"child process failed ({done.returncode}): {(errors or lines)[-1][:300]}"}


def _spec(mode: str, folder: Path, workload: Workload, threads: int) -> dict:
    plugins = [str(Path(p).resolve()) for p in workload.plugins]
    return {"mode": mode, "dir": str(folder), "rules": list(workload.rules), "plugins": plugins,
            "threads": threads}  # fmt: skip


def peak_memory(result: BenchResult, folder: Path, workload: Workload, threads: int) -> None:
    names = [n for n, info in result.runners.items() if info.ok]
    spec = _spec("memory", folder, workload, threads)
    if _can_reset_peak():
        got = _child({**spec, "runners": names})
    else:  # one process per runner: the high-water mark cannot be reset in place
        got = {}
        for name in names:
            got.update(_child({**spec, "runners": [name]}))
    if "error" in got:
        result.notes.append(f"peak memory: {got['error']}")
        return
    for name, (peak, extra) in got.items():
        result.runners[name].peak_mb, result.runners[name].extra_mb = peak, extra


def compile_times(folder: Path, workload: Workload, threads: int) -> dict:
    spec = _spec("compile", folder, workload, threads)
    with tempfile.TemporaryDirectory(prefix="fusion-numba-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        cold = _child(spec, env)
        cached = _child(spec, env)
    if "error" in cold or "error" in cached:
        return {"error": cold.get("error") or cached.get("error")}
    return {"cold_s": cold["seconds"], "cached_s": cached["seconds"]}


def warm_sgemm(shape: tuple[int, int, int], threads: int) -> float:
    """Seconds per SGEMM of `shape` with OpenBLAS's threads awake (sgemm.busy_seconds), in a
    child process with OpenBLAS's default thread timeout and `threads` threads."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    got = _child({"mode": "sgemm", "shape": list(shape)}, env)
    if "error" in got:
        raise RuntimeError(got["error"])
    return got["seconds"]


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmHWM") is not None
    except OSError:
        return False


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_child(spec: dict) -> dict:
    """In a child process: time a cold/cached first run, the peak RSS of each runner, or the
    SGEMM with its threads awake."""
    if spec["mode"] == "sgemm":
        return {"seconds": busy_seconds(tuple(spec["shape"]))}
    folder, threads = Path(spec["dir"]), spec["threads"]
    for plugin in spec.get("plugins", ()):
        load_plugin(plugin)
    catalog = catalog_with(spec["rules"])
    with np.load(folder / "feeds.npz") as archive:
        feeds = {k: archive[k] for k in archive.files}
    if spec["mode"] == "compile":
        model = onnx.load(str(folder / f"{FUSED}.onnx"))
        start = time.perf_counter()  # building the Session loads or compiles the kernels
        make_runner(FUSED, model, catalog, threads)(feeds)
        return {"seconds": time.perf_counter() - start}
    import resource  # Unix only

    import numba  # noqa: F401  heavy, and imported here on purpose: before the RSS baseline

    files = {ORT_NONE: ORT_NONE, ORT_ALL: ORT_NONE, FUSED: FUSED, ORT_FUSED: FUSED, NATIVE: NATIVE}
    models = {name: onnx.load(str(folder / f"{files[name]}.onnx")) for name in spec["runners"]}
    peaks = {}
    for name in spec["runners"]:
        gc.collect()
        resettable = _can_reset_peak()
        base = _status_kb("VmRSS") or 0
        run = make_runner(name, models[name], catalog, threads)
        run(feeds)
        kb = _status_kb("VmHWM") if resettable else None
        kb = kb or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks[name] = (kb / 1024, (kb - base) / 1024)
        del run
    return peaks
