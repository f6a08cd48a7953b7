"""`fusion.compare`: one model timed in onnxruntime (unfused and default) and in fusion.Session.

A light front on fusion.bench's runners and its timing loop: the same runners as `fusion
bench` (`threads` for onnxruntime and Numba alike), outputs compared with the unfused run
first (no speed is reported for wrong numbers), then warm-up and rounds of one call of each
runner, the order rotated each round, so that a noisy, shared machine slows all of them alike;
the figures are medians over rounds. No FLOPs, profile, memory or compile time: `fusion bench
MODEL.onnx` measures those.

    print(fusion.compare(model, feeds, threads=2, rounds=10).table())
"""

from __future__ import annotations

import os

from fusion.bench.runners import (
    FUSED,
    ORT_ALL,
    ORT_NONE,
    RunnerInfo,
    make_runner,
    time_runners,
    verify_runners,
)
from fusion.bench.timing import Timing
from fusion.bench.workload import Options
from fusion.errors import FusionError
from fusion.feeds import model_inputs
from fusion.modelfile import as_model
from fusion.registry import default_catalog
from fusion.rewriter import rewrite
from fusion.runtime import is_fused

LABELS = {  # the rows of Timing.table(), the first being the base of the speedups
    ORT_NONE: "onnxruntime, optimizations disabled",
    ORT_ALL: "onnxruntime, ORT_ENABLE_ALL",
    FUSED: "fusion.Session (fused)",
}


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
    """Time the original model in onnxruntime (both levels) and fused in fusion.Session.

    model: a ModelProto or a path; feeds: random inputs from the declared shapes if None;
    threads: os.cpu_count() if None. Raises FusionError if a runner's outputs disagree with
    onnxruntime's unfused run beyond rtol / atol. Times are keyed by LABELS' values.
    """
    model = as_model(model)
    threads = threads or os.cpu_count() or 1
    if feeds is None:
        feeds, _ = model_inputs(model, None, 0, None)
    catalog = default_catalog() if catalog is None else catalog
    fused = model if is_fused(model) else rewrite(model, catalog).model
    models = {ORT_NONE: model, ORT_ALL: model, FUSED: fused}
    runners = {name: make_runner(name, m, catalog, threads) for name, m in models.items()}
    infos = {name: RunnerInfo(name) for name in runners}
    verify_runners(runners, infos, feeds, runners[ORT_NONE](feeds), rtol, atol)
    for name, info in infos.items():
        if not info.ok:
            raise FusionError(f"{LABELS[name]} disagrees with onnxruntime: {info.reason}")
    opts = Options(threads=threads, rounds=rounds, min_rounds=rounds, warmup=warmup)
    timing = time_runners(runners, feeds, opts)
    timing.times = {LABELS[name]: times for name, times in timing.times.items()}
    return timing
