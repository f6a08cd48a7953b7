"""The built-in benchmark suite: fused against unfused and against onnxruntime, side by side.

    .venv/bin/python bench/run.py                      # default run, about 3 minutes on 2 cores
    .venv/bin/python bench/run.py --quick              # batch 1, short, all in one process
    .venv/bin/python bench/run.py --json b.json --markdown b.md --plot b.png --only lstm

Workloads (generated, no download), each measured by fusion.bench.measure: every runner in a
worker process of its own, onnxruntime at its defaults (see fusion/bench/: runners.py for the
runners and verification, workers.py for the processes, report.py for the columns; --quick and
--same-process time them all in this process instead, and every output says so):

  conv-stack   4 x (3x3 Conv 64 ch, 56x56, no bias) + Add([1,C,1,1]) + Relu, TensorFlow form
  fire         SqueezeNet 1.1's first Fire module (64 -> 16 -> 64 + 64 ch, 55x55), cut out
  squeezenet   SqueezeNet 1.0 and 1.1 at 224x224
  lstm         16 unrolled PyTorch LSTMCell steps, input 128, hidden 256; plus onnxruntime's
               native LSTM op on the same weights (ort-native)
  no-pattern   an MLP (MatMul, Add, Tanh, Softmax) the catalog has nothing for: the fused run
               must cost nothing there
  --zoo NAMES  real CNNs that bench/zoo.py exported (torchvision, random weights), e.g.
               resnet18,mobilenet_v2: in the same run, so one command gives the whole table

CNNs at batch 1 and 8, LSTM at batch 1 and 16. Exit code 1 when any runner's numbers were
refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

# Read by OpenBLAS when numpy loads it: idle workers sleep at once instead of spinning for 2^28
# cycles after each call, so the SGEMM reference can be interleaved with the runners.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from models import workload as file_workload  # noqa: E402 (bench/models.py, beside this)
from zoo import EXPORTERS, model_path, zoo_dir  # noqa: E402 (bench/zoo.py)

from fusion import bench  # noqa: E402
from fusion.bench import FUSED, ORT_ALL, PROCESSES, SAME_PROCESS, Options, Workload  # noqa: E402
from fusion.cli.progress import progress_bar  # noqa: E402
from fusion.modelfile import read_model  # noqa: E402
from fusion.models import LSTMWeights, conv_stack, native_lstm, squeezenet, unrolled_lstm  # noqa: E402
from fusion.models.builder import GraphBuilder  # noqa: E402

LSTM_RULES = ("fusion_patterns.lstm", "fusion_patterns.lstm_sequence")
# Numba compile time (cold and cached; a cold child takes 20-50 s under load) is measured on the
# first workload of each kernel family only, and shown for the rest of the family: SqueezeNet
# runs first, as its kernels (ConvBiasRelu and FireModule) include the conv stack's and the
# Fire module's.
FAMILY = {"conv-stack": "cnn", "squeezenet1.1": "cnn", "squeezenet1.0": "cnn", "fire": "cnn"}
CNN_BATCHES = (1, 8)
COST_NOTHING = 1.05  # a fused run of a model with no match may be at most 5 % slower


def _normal(shape, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# ---- workloads: (name, builder) where builder() -> Workload ----------------------------------
def conv_stack_workload(batch: int):
    model = conv_stack(blocks=4, channels=64, size=56, batch=batch, form="tf")
    return Workload(
        f"conv-stack b{batch}",
        model,
        {"input": _normal((batch, 64, 56, 56), 1)},
        description="4 x (3x3 Conv 64ch 56x56 + Add bias + Relu), TensorFlow form",
    )


def fire_workload(batch: int):
    model = squeezenet("1.1", size=224, batch=batch)
    start, end = "/features/features.2/MaxPool_output_0", "/features/features.3/Concat_output_0"
    model = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(model)).extract_model(
        [start], [end]
    )
    return Workload(
        f"fire b{batch}",
        model,
        {start: np.abs(_normal((batch, 64, 55, 55), 2))},  # it follows a Relu + MaxPool
        rules=("fusion_patterns.fire",),
        description="SqueezeNet 1.1 features.3: 64 -> squeeze 16 -> 64 (1x1) + 64 (3x3), 55x55",
    )


def squeezenet_workload(version: str, batch: int):
    return Workload(
        f"squeezenet{version} b{batch}",
        squeezenet(version, size=224, batch=batch),
        {"input": _normal((batch, 3, 224, 224), 3)},
        rules=("fusion_patterns.fire",),
        description=f"SqueezeNet {version}, 3x224x224",
    )


def lstm_workload(batch: int, steps: int = 16, size: int = 128, hidden: int = 256):
    w = LSTMWeights.random(size, hidden, seed=0)
    feeds = {
        "X": _normal((steps, batch, size), 4),
        "h0": _normal((batch, hidden), 5, 0.5),
        "c0": _normal((batch, hidden), 6, 0.5),
    }
    return Workload(
        f"lstm b{batch}",
        unrolled_lstm(w, steps, batch=batch, form="gemm"),
        feeds,
        rules=LSTM_RULES,
        native=native_lstm(w, steps, batch=batch),
        batch=batch,
        description=f"{steps} unrolled LSTMCell steps (PyTorch Gemm form), {size} -> {hidden}",
    )


def no_pattern(batch: int = 64, size: int = 512, hidden: int = 1024, classes: int = 256):
    """softmax(tanh(x W1 + b1) W2 + b2): nothing in the catalog matches it."""
    g = GraphBuilder()
    w1, b1 = g.const(_normal((size, hidden), 7, size**-0.5)), g.const(_normal((hidden,), 8, 0.1))
    w2 = g.const(_normal((hidden, classes), 9, hidden**-0.5))
    b2 = g.const(_normal((classes,), 10, 0.1))
    t1 = g.node("Tanh", [g.node("Add", [g.node("MatMul", ["x", w1]), b1])])
    y = g.node("Softmax", [g.node("Add", [g.node("MatMul", [t1, w2]), b2])])
    model = g.model({"x": [batch, size]}, {y: [batch, classes]}, name="mlp")
    return Workload(
        f"no-pattern b{batch}",
        model,
        {"x": _normal((batch, size), 11)},
        description=f"MLP {size} -> {hidden} (Tanh) -> {classes} (Softmax): nothing to fuse",
    )


def zoo_workloads(names: list[str], exporter: str, batches) -> list[tuple[str, object]]:
    """(name, builder) of each exported CNN at each batch; a file not exported yet stops here."""
    out = []
    for name in names:
        path = model_path(zoo_dir(), name, exporter)
        if not path.is_file():
            raise SystemExit(f"{path}: not exported yet (run bench/zoo.py in its venv)")
        for b in batches:
            out.append((f"{name} b{b}", lambda p=path, n=name, b=b: file_workload(
                n, read_model(p)[0], b)))  # fmt: skip
    return out


def suite(quick: bool) -> list[tuple[str, object]]:
    """(name, builder) in run order; quick: batch 1 only."""
    cnn, rnn = CNN_BATCHES[:1] if quick else CNN_BATCHES, (1,) if quick else (1, 16)
    out = [(f"squeezenet{v} b{b}", lambda v=v, b=b: squeezenet_workload(v, b))
           for v in ("1.1", "1.0") for b in cnn]  # fmt: skip
    out += [(f"conv-stack b{b}", lambda b=b: conv_stack_workload(b)) for b in cnn]
    out += [(f"fire b{b}", lambda b=b: fire_workload(b)) for b in cnn]
    out += [(f"lstm b{b}", lambda b=b: lstm_workload(b)) for b in rnn]
    out.append(("no-pattern b64", no_pattern))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1, short, all in one process")
    ap.add_argument("--same-process", action="store_true", help="all runners in this process")
    ap.add_argument("--repeat", type=int, default=3, help="calls per runner and round")
    ap.add_argument("--no-nodes", action="store_true", help="skip timing fused nodes alone")
    ap.add_argument("--threads", type=int, default=None, help="threads for every runner")
    ap.add_argument("--rounds", type=int, default=None, help="at most this many timed rounds")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per workload")
    ap.add_argument("--only", help="comma-separated substrings of workload names to run")
    ap.add_argument("--zoo", default="", help="comma-separated bench/zoo.py exports to add")
    ap.add_argument("--exporter", default="ts17", choices=sorted(EXPORTERS),
                    help="which of bench/zoo.py's exports (--zoo)")  # fmt: skip
    ap.add_argument("--no-memory", action="store_true", help="skip peak memory (child process)")
    ap.add_argument("--no-compile", action="store_true", help="skip Numba compile time")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--markdown", help="write a Markdown table to this file")
    ap.add_argument("--plot", help="write a PNG bar chart of speedups to this file")
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    info = bench.machine()  # before anything runs: the load, the command as typed
    threads = args.threads or os.cpu_count() or 1
    quick = args.quick
    opts = Options(
        threads=threads,
        rounds=args.rounds or (10 if quick else 20),
        min_rounds=3 if quick else 5,
        budget=args.budget if args.budget is not None else (1.5 if quick else 2.5),
        warmup=1,
        repeat=args.repeat,
        mode=SAME_PROCESS if quick or args.same_process else PROCESSES,
        nodes=not (quick or args.no_nodes),
        memory=not (quick or args.no_memory),
        compile=not (quick or args.no_compile),
    )
    todo = suite(quick)
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        todo = [(n, b) for n, b in todo if any(k in n for k in keys)]
    zoo_names = [n.strip() for n in args.zoo.split(",") if n.strip()]
    todo += zoo_workloads(zoo_names, args.exporter, CNN_BATCHES[:1] if quick else CNN_BATCHES)
    families = FAMILY | dict.fromkeys(zoo_names, "cnn")  # one compile measurement per family
    console = Console(highlight=False)
    if argv is not None:
        info["command"] = bench.command_line(["bench/run.py", *argv])
    for line in bench.machine_lines(info):
        console.print(line, markup=False)
    results, compile_cache, compiled = [], {}, {}
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn())  # fmt: skip
    with progress_bar(console, *columns) as bar:
        task = bar.add_task("", total=len(todo))
        for name, build in todo:
            bar.update(task, description=f"{name}: building")
            workload = build()

            def say(phase, name=name):
                bar.update(task, description=f"{name}: {phase}")

            family = families.get(name.split()[0], name.split()[0])
            first = family not in compiled
            todo_opts = dataclasses.replace(opts, compile=opts.compile and first)
            result = bench.measure(workload, todo_opts, say, compile_cache)
            if result.compile:
                compiled[family] = result.compile
            elif opts.compile and family in compiled and not result.refused and result.fused:
                result.compile = compiled[family]  # carries measured_on
            _annotate(result)
            results.append(result)
            bar.advance(task)
    elapsed = time.perf_counter() - start
    title = f"fusion bench: {threads} threads"
    if results:
        console.print(f"timing: {results[0].timing.describe()}", markup=False)
    for table in bench.rich_tables(results, width=console.width):
        console.print(table)
    for line in bench.notes(results):
        console.print(line, markup=False)
    console.print(f"{len(results)} workloads in {elapsed:.0f} s", markup=False)
    extra = {"command": info["command"], "elapsed_s": elapsed, "quick": quick}
    if args.json:
        bench.write_json(results, args.json, info, **extra)
    if args.markdown:
        text = bench.markdown(results, info)
        Path(args.markdown).write_text(text + f"\nRun time: {elapsed:.0f} s.\n")
    if args.plot:
        bench.write_plot(results, args.plot, title=title, info=info)
    return 1 if any(r.refused for r in results) else 0


def _annotate(result) -> None:
    """Flag a fused run that costs something on a model where nothing was fused."""
    if result.fused:
        return
    cost = result.speedup(FUSED, of=ORT_ALL)  # fusion median / ort-all median
    if cost is None:
        return
    best = min(result.timing.times[FUSED]) / min(result.timing.times[ORT_ALL])
    verdict = "ok" if min(cost, best) <= COST_NOTHING else "TOO SLOW"
    result.notes.append(
        f"nothing fused: fusion / ort-all = {cost:.3f} by medians, {best:.3f} by minima "
        f"({verdict}: limit {COST_NOTHING})"
    )


if __name__ == "__main__":
    sys.exit(main())
