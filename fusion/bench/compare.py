"""`fusion.compare`: one model timed in onnxruntime (unfused and default) and in fusion.Session.

A light front on fusion.bench.measure: the same runners as `fusion bench` (`threads` for
onnxruntime and Numba alike), each in a process of its own by default, outputs compared with
the unfused run first (no speed is reported for wrong numbers), then warm-up and rounds of a
burst of calls per runner, in a new order each round, so that a noisy, shared machine slows
all of them alike; the figures are medians over every timed call. No FLOPs, profile, memory or
compile time: `fusion bench MODEL.onnx` measures those. same_process=True is the quick mode
(one process, onnxruntime's workers not spinning), and the table says so.

    print(fusion.compare(model, feeds, threads=2, rounds=10).table())
"""

from __future__ import annotations

import os

from fusion.bench.measure import measure
from fusion.bench.runners import FUSED, ORT_ALL, ORT_NONE
from fusion.bench.timing import PROCESSES, SAME_PROCESS, Timing
from fusion.bench.workload import Options, Workload
from fusion.errors import FusionError
from fusion.feeds import model_inputs
from fusion.modelfile import as_model
from fusion.registry import default_catalog

LABELS = {  # the rows of Timing.table(), the first being the base of the speedups
    ORT_NONE: "onnxruntime, optimizations disabled",
    ORT_ALL: "onnxruntime, ORT_ENABLE_ALL (defaults)",
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
    same_process: bool = False,
) -> Timing:
    """Time the original model in onnxruntime (both levels) and fused in fusion.Session.

    model: a ModelProto or a path; feeds: random inputs from the declared shapes if None;
    threads: os.cpu_count() if None. Raises FusionError if a runner's outputs disagree with
    onnxruntime's unfused run beyond rtol / atol. Times are keyed by LABELS' values.
    """
    model = as_model(model)
    if feeds is None:
        feeds, _ = model_inputs(model, None, 0, None)
    catalog = default_catalog() if catalog is None else catalog
    opts = Options(
        threads=threads or os.cpu_count() or 1,
        rounds=rounds,
        min_rounds=rounds,
        warmup=warmup,
        repeat=1,
        mode=SAME_PROCESS if same_process else PROCESSES,
        runners=tuple(LABELS),
        sgemm=False,
        profile=False,
        nodes=False,
        memory=False,
        compile=False,
        rtol=rtol,
        atol=atol,
    )
    result = measure(Workload("compare", model, feeds, catalog=catalog), opts)
    for name in result.refused:
        reason = result.runners[name].reason
        raise FusionError(f"{LABELS[name]} disagrees with onnxruntime: {reason}")
    timing = result.timing
    timing.times = {LABELS[name]: timing.times[name] for name in LABELS}
    return timing
