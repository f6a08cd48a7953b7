"""Recurrent layers: fusion vs onnxruntime at its defaults, every runner in its own process.

Workload: input 128, hidden 256, T = 16 (options), 2 threads everywhere. Runners:
  fused            fusion.Session on the unrolled graph (as torch.onnx.export writes an
                   nn.LSTMCell / nn.GRUCell loop), rewritten: one LSTMSequence / GRUSequence
  ort-unrolled     onnxruntime (fusion.ort.DEFAULT: ORT_ENABLE_ALL, spinning workers) on it
  ort-native       onnxruntime DEFAULT on the native ONNX op with the same weights
  fused-native     fusion.Session on that native-op model (LSTMOp / GRUOp on the same kernel)
  ort-standard     onnxruntime DEFAULT on `fusion rewrite --rnn-as-standard-op` of the unrolled
                   graph (the portable output)

On fusion.bench's harness (fusion/bench/workers.py, timing.py), as `fusion bench` times: each
runner a worker process of its own, its outputs checked against ort-unrolled first
(fusion.numerics' default tolerance), then rounds of one turn per runner, in a new order
each round (a runner that always followed the same spinning onnxruntime ran up to 1.8x slower
than its twin, bench/NOTES.md), a turn being --warm seconds of untimed calls and then the
calls of about --turn seconds, each timed; after its turn a worker waits until its threads
stop spinning. Medians with min and max per runner, and the ratios. `--compile` instead times
the fused runner's build + first run in a new process with a fresh Numba cache, then again
from that cache.

    python bench/lstm.py [--cell lstm gru] [--batch 1 16] [--rounds 30] [--steps 16]
    python bench/lstm.py --compile
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

import fusion
from fusion import models
from fusion.bench.machine import command_line, machine, machine_lines
from fusion.bench.runners import FUSED, ORT_ALL
from fusion.bench.timing import PROCESSES, interleave
from fusion.bench.workers import close_workers, start_workers, worker_spec
from fusion.numerics import DEFAULT_ATOL, DEFAULT_RTOL, compare_arrays

RUNNERS = ("fused", "ort-unrolled", "ort-native", "fused-native", "ort-standard")
# runner -> (fusion.bench's runner kind, the model file it runs)
KINDS = {"fused": (FUSED, "fused"), "ort-unrolled": (ORT_ALL, "unrolled"),
         "ort-native": (ORT_ALL, "native"), "fused-native": (FUSED, "fused-native"),
         "ort-standard": (ORT_ALL, "standard")}  # fmt: skip
RATIOS = (("fused", "ort-native"), ("fused", "ort-unrolled"), ("fused-native", "ort-native"),
          ("ort-standard", "ort-unrolled"), ("ort-standard", "ort-native"))  # fmt: skip
THREADS, INPUT, HIDDEN = 2, 128, 256


def write_models(folder: Path, cell: str, batch: int, steps: int) -> None:
    """The five runners' models and their feeds (feeds.npz) into `folder`."""
    if cell == "lstm":
        weights = models.LSTMWeights.random(INPUT, HIDDEN, seed=0)
        unrolled = models.unrolled_lstm(weights, steps, batch)
        native = models.native_lstm(weights, steps, batch)
    else:
        weights = models.GRUWeights.random(INPUT, HIDDEN, seed=0)
        unrolled = models.unrolled_gru(weights, steps, batch)
        native = models.native_gru(weights, steps, batch)
    files = {
        "unrolled": unrolled,
        "native": native,
        "fused": fusion.rewrite(unrolled).model,
        "fused-native": fusion.rewrite(native).model,
        "standard": fusion.rewrite(unrolled, standard_ops=True).model,
    }
    for name, model in files.items():
        onnx.save(model, str(folder / f"{name}.onnx"))
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
             .astype(np.float32) for i in unrolled.graph.input}  # fmt: skip
    np.savez(folder / "feeds.npz", **feeds)


def specs(folder: Path, runners) -> dict:
    return {name: worker_spec(KINDS[name][0], folder, THREADS, f"{KINDS[name][1]}.onnx")
            for name in runners}  # fmt: skip


def start(folder: Path, runners, envs=None) -> dict:
    workers, failed = start_workers(
        specs(folder, runners), envs=envs, last=("fused", "fused-native")
    )  # race when the rest is built
    if failed:
        close_workers(workers)
        raise SystemExit(f"a runner failed: {next(iter(failed.items()))}")
    return workers


def bench(cell, batch, steps, rounds, runners, turn: float, warm: float) -> None:
    with tempfile.TemporaryDirectory(prefix="fusion-lstm-") as tmp:
        folder = Path(tmp)
        write_models(folder, cell, batch, steps)
        workers = start(folder, ["ort-unrolled", *(r for r in runners if r != "ort-unrolled")])
        try:
            want = workers["ort-unrolled"].run()
            for name, w in workers.items():
                for k, (g, ref) in enumerate(zip(w.run(), want, strict=True)):
                    same = compare_arrays(f"{name} output {k}", g, ref, DEFAULT_RTOL, DEFAULT_ATOL)
                    if not same.ok:  # no speed for wrong numbers
                        raise SystemExit(f"{same} against ort-unrolled")
            per_call = min(workers["ort-unrolled"].turn(8))
            repeat = max(4, round(turn / per_call))  # about `turn` s of calls per turn
            timing = interleave({n: workers[n] for n in runners}, rounds, warmup=2,
                                repeat=repeat, threads=THREADS, mode=PROCESSES,
                                warm=warm)  # fmt: skip
        finally:
            close_workers(workers)
    print(f"\n{cell} batch {batch}, T {steps}, input {INPUT}, hidden {HIDDEN}, {THREADS} threads;"
          f" {timing.describe()}; us per call")  # fmt: skip
    print(f"{'runner':<14} {'median':>9} {'min':>9} {'max':>9}")
    med = {}
    for name in runners:
        s = timing.stats(name)
        med[name] = s["median_ms"]
        print(f"{name:<14} {s['median_ms'] * 1e3:>9.1f} {s['min_ms'] * 1e3:>9.1f} "
              f"{s['max_ms'] * 1e3:>9.1f}")  # fmt: skip
    for a, b in RATIOS:
        if a in med and b in med:
            print(f"{a} vs {b}: {med[b] / med[a]:.2f}x (above 1: {a} is faster)")


def compile_time(cell: str) -> None:
    """The fused runner's build + first run (batch 1 and 16), cold then cached."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        folders = {batch: Path(tmp) / f"b{batch}" for batch in (1, 16)}
        for batch, folder in folders.items():
            folder.mkdir()
            write_models(folder, cell, batch, 16)
        for label in ("cold", "cached"):
            start_time = time.perf_counter()
            for folder in folders.values():
                workers = start(folder, ["fused"], envs={"fused": env})
                workers["fused"].run()
                close_workers(workers)
            print(f"{cell} compile, {label}: {time.perf_counter() - start_time:.1f} s "
                  "(two processes: build and first run each)")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", nargs="+", default=["lstm"], choices=["lstm", "gru"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    ap.add_argument("--turn", type=float, default=0.2, help="s of timed calls per turn")
    ap.add_argument("--warm", type=float, default=0.05, help="s of untimed calls per turn")
    ap.add_argument("--compile", action="store_true", help="time the kernels' compile instead")
    args = ap.parse_args(argv)
    print("\n".join(machine_lines(machine(command_line()))))
    for cell in args.cell:
        if args.compile:
            compile_time(cell)
            continue
        for batch in args.batch:
            bench(cell, batch, args.steps, args.rounds, args.runners, args.turn, args.warm)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
