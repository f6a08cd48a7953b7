"""Recurrent layers: fusion vs onnxruntime at its defaults, every runner in its own process.

Workload: input 128, hidden 256, T = 16 (options), 2 threads everywhere. Runners:
  fused            fusion.Session on the unrolled graph (as torch.onnx.export writes an
                   nn.LSTMCell / nn.GRUCell loop): one LSTMSequence / GRUSequence kernel
  ort-unrolled     onnxruntime (fusion.ort.DEFAULT: ORT_ENABLE_ALL, spinning workers) on it
  ort-native       onnxruntime DEFAULT on the native ONNX op with the same weights
  fused-native     fusion.Session on that native-op model (LSTMOp / GRUOp on the same kernel)
  ort-standard     onnxruntime DEFAULT on `fusion rewrite --rnn-as-standard-op` of the unrolled
                   graph (the portable output)

Each runner lives in its own process (a spinning onnxruntime would steal the CPU from the next
runner in a shared process). The parent runs rounds: in each, every runner in turn (in a new
random order each round: a runner that always followed the same spinning onnxruntime ran up to
1.8x slower than its twin, bench/NOTES.md) times `repeat` calls back to back in its own process
after N // 4 untimed ones, and reports seconds per
call, after a short gap (--gap) in which the previous runner's spinning workers settle. It
prints medians with min and max per runner and the ratios, after checking every
runner's outputs against onnxruntime on the unrolled graph (fusion.numerics' default
tolerance). `--compile` instead times a
Session build + first run with a fresh Numba cache, then again from that cache.

    python bench/lstm.py [--cell lstm gru] [--batch 1 16] [--rounds 30] [--steps 16]
    python bench/lstm.py --compile
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from fusion.numerics import DEFAULT_ATOL, DEFAULT_RTOL, compare_arrays

RUNNERS = ("fused", "ort-unrolled", "ort-native", "fused-native", "ort-standard")
THREADS, INPUT, HIDDEN = 2, 128, 256


def build(cell: str, runner: str, batch: int, steps: int):
    """(run, feeds) of one runner: run() returns the outputs."""
    import fusion
    from fusion import models
    from fusion.ort import DEFAULT, inference_session

    if cell == "lstm":
        weights = models.LSTMWeights.random(INPUT, HIDDEN, seed=0)
        unrolled = models.unrolled_lstm(weights, steps, batch)
        native = models.native_lstm(weights, steps, batch)
    else:
        weights = models.GRUWeights.random(INPUT, HIDDEN, seed=0)
        unrolled = models.unrolled_gru(weights, steps, batch)
        native = models.native_gru(weights, steps, batch)
    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for i in unrolled.graph.input
    }
    if runner in ("fused", "fused-native"):
        session = fusion.Session(unrolled if runner == "fused" else native, threads=THREADS)
        return (lambda: session.run(None, feeds)), feeds
    model = {"ort-unrolled": unrolled, "ort-native": native}.get(runner)
    if runner == "ort-standard":
        model = fusion.rewrite(unrolled, standard_ops=True).model
    session = inference_session(model, DEFAULT, THREADS)
    return (lambda: session.run(None, feeds)), feeds


def worker(spec: str) -> None:
    """A runner's process: build, warm up, then answer the parent's commands on stdin:
    "time N" (seconds per call over N calls, after N // 4 untimed ones: a process that has
    been idle runs slow at first on these virtual machines, bench/NOTES.md), "save PATH" (the
    outputs), "quit"."""
    cell, runner, batch, steps = json.loads(spec)
    run, _ = build(cell, runner, batch, steps)
    for _ in range(5):
        run()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "time":
            for _ in range(int(arg) // 4):
                run()
            start = time.perf_counter()
            for _ in range(int(arg)):
                run()
            print((time.perf_counter() - start) / int(arg), flush=True)
        elif cmd == "save":
            np.savez(arg, *run())
            print("saved", flush=True)
        else:
            return


class Worker:
    def __init__(self, cell, runner, batch, steps, env=None):
        spec = json.dumps([cell, runner, batch, steps])
        cmd = [sys.executable, __file__, "--worker", spec]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)  # fmt: skip
        self.name = runner
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"runner {runner} failed to start: {line!r}")

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self):
        self.ask("quit")
        self.proc.wait(timeout=30)


def _estimate(worker: Worker) -> float:
    """Seconds per call of a runner, roughly."""
    return float(worker.ask("time 8"))


def bench(cell, batch, steps, rounds, runners, gap: float, turn: float) -> None:
    workers = [Worker(cell, name, batch, steps) for name in runners]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            outs = {}
            for w in workers:
                w.ask(f"save {tmp}/{w.name}.npz")
                with np.load(f"{tmp}/{w.name}.npz") as f:
                    outs[w.name] = [f[k] for k in sorted(f.files, key=lambda s: int(s[4:]))]
        want = outs["ort-unrolled"]
        for name, got in outs.items():
            for k, (g, ref) in enumerate(zip(got, want, strict=True)):
                same = compare_arrays(f"{name} output {k}", g, ref, DEFAULT_RTOL, DEFAULT_ATOL)
                assert same.ok, f"{same} against ort-unrolled"
        repeat = max(4, round(turn / _estimate(workers[0])))  # `turn` s of calls per turn
        times = {w.name: [] for w in workers}
        shuffle = random.Random(0).shuffle
        for _ in range(rounds):
            order = list(workers)
            shuffle(order)  # each runner after a different one each round
            for w in order:
                time.sleep(gap)  # the last runner's spinning workers settle (not timed)
                times[w.name].append(float(w.ask(f"time {repeat}")))
    finally:
        for w in workers:
            w.close()
    print(f"\n{cell} batch {batch}, T {steps}, input {INPUT}, hidden {HIDDEN}, {THREADS} threads,"
          f" {rounds} rounds of {repeat} calls per runner, us per call")  # fmt: skip
    print(f"{'runner':<14} {'median':>9} {'min':>9} {'max':>9}")
    med = {}
    for name, t in times.items():
        med[name] = statistics.median(t)
        print(f"{name:<14} {med[name] * 1e6:>9.1f} {min(t) * 1e6:>9.1f} {max(t) * 1e6:>9.1f}")
    for a, b in (("fused", "ort-native"), ("fused", "ort-unrolled"), ("fused-native", "ort-native"),
                 ("ort-standard", "ort-unrolled"), ("ort-standard", "ort-native")):  # fmt: skip
        if a in med and b in med:
            print(f"{a} vs {b}: {med[b] / med[a]:.2f}x faster")


def compile_time(cell: str) -> None:
    """Session build + first run of the unrolled model (batch 1 and 16), cold then cached."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold", "cached"):
            start = time.perf_counter()
            for batch in (1, 16):
                Worker(cell, "fused", batch, 16, env=env).close()
            print(f"{cell} compile, {label}: {time.perf_counter() - start:.1f} s "
                  "(two processes: build, first run and 5 warm-up calls each)")  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cell", nargs="+", default=["lstm"], choices=["lstm", "gru"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    ap.add_argument("--gap", type=float, default=0.1, help="s between two runners' turns")
    ap.add_argument("--turn", type=float, default=0.2, help="s of timed calls per turn")
    ap.add_argument("--compile", action="store_true", help="time the kernels' compile instead")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"CPU {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    for cell in args.cell:
        if args.compile:
            compile_time(cell)
            continue
        for batch in args.batch:
            bench(cell, batch, args.steps, args.rounds, args.runners, args.gap, args.turn)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
