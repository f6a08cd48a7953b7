"""A CNN's fixed cost per run: its image fed at a small size, so that what remains is per step.

    python bench/fixed_cost.py MODEL.onnx [MODEL2.onnx ...] [--size 32] [--rounds 4]
                               [--tactics kernels] [--profile]

The model's first input, [N, C, H, W], gets symbolic H and W (a copy in a temporary folder;
value_info dropped) and is fed one image of size x size: a classifier ending in a global pool
runs unchanged, with ~2% of its 224 x 224 work at 32. fusion.Session (tactics "kernels" by
default: every fused node on a kernel) and onnxruntime at its defaults (fusion.ort.DEFAULT,
spinning) each run in a process of their own, alternating, `--rounds` processes each; a
process takes the minimum of 5 medians of 300 runs; the figure is the minimum over its
processes. --profile adds fusion.Session.profile's step times summed by rule. On
mobilenet_v3_small at 32 x 32 (`--rounds 2 --profile`; AMD EPYC, family 25 model 17, Zen 4;
bench/NOTES.md) onnxruntime ran in 220.8 us and fusion in 482.3: most of what batch 1 loses
on the small models is per step, not per FLOP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import onnx

from fusion.bench.machine import machine, machine_lines


def any_size(path: str, folder: str) -> str:
    """A copy of the model whose first input's H and W are symbolic; its path."""
    model = onnx.load(path)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ValueError(f"{path}: the first input is not [N, C, H, W]")
    for dim, name in zip(dims[2:], ("height", "width"), strict=True):
        dim.ClearField("dim_value")
        dim.dim_param = name
    del model.graph.value_info[:]
    out = os.path.join(folder, os.path.basename(path))
    onnx.save(model, out)
    return out


def worker(path: str, runner: str, size: int, tactics: str, profile: bool) -> None:
    """One process: a run's time (min of 5 medians of 300), printed; its profile if asked."""
    import fusion
    from fusion.ort import DEFAULT, inference_session

    if runner == "onnxruntime":
        session = inference_session(path, DEFAULT)
    else:
        session = fusion.Session(path, tactics=tactics)
    first = session.get_inputs()[0]  # both sessions describe their inputs alike
    channels = first.shape[1] if isinstance(first.shape[1], int) else 3
    feeds = {first.name: np.random.default_rng(0).standard_normal(
        (1, channels, size, size), dtype=np.float32)}  # fmt: skip
    for _ in range(300):
        session.run(None, feeds)
    medians = []
    for _ in range(5):
        times = []
        for _ in range(300):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    print(f"run {min(medians)}")
    if profile and runner == "fusion":
        prof = min((session.profile(feeds, repeat=300) for _ in range(3)), key=lambda p: p.wall)
        by_rule: dict = defaultdict(lambda: [0, 0.0])
        for kind, name, seconds in prof.steps:
            key = name.split()[0] if kind == "kernel" else kind
            by_rule[key][0] += 1
            by_rule[key][1] += seconds
        for key, (count, seconds) in sorted(by_rule.items(), key=lambda kv: -kv[1][1]):
            print(f"step {key} {count} {seconds}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="processes per runner")
    parser.add_argument("--tactics", default="kernels")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # PATH RUNNER
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.size, args.tactics, args.profile)
        return 0
    if not args.models:
        parser.error("give at least one model file")
    for path in args.models:
        if not os.path.isfile(path):
            print(f"error: no such model file: {path}", file=sys.stderr)
            return 2
    print("\n".join(machine_lines(machine())))
    with tempfile.TemporaryDirectory() as folder:
        for path in args.models:
            copy = any_size(path, folder)
            best: dict = {}
            steps: list[str] = []
            for r in range(args.rounds):
                order = ("fusion", "onnxruntime") if r % 2 == 0 else ("onnxruntime", "fusion")
                for runner in order:
                    command = [sys.executable, __file__, "--worker", copy, runner,
                               "--size", str(args.size), "--tactics", args.tactics]  # fmt: skip
                    if args.profile and r == 0:
                        command.append("--profile")
                    out = subprocess.run(command, capture_output=True, text=True, check=True)
                    lines = out.stdout.splitlines()
                    run = float(next(x for x in lines if x.startswith("run ")).split()[1])
                    best[runner] = min(best.get(runner, run), run)
                    steps += [x for x in lines if x.startswith("step ")]
            name = os.path.basename(path)
            print(f"{name} at {args.size}x{args.size}: onnxruntime {best['onnxruntime'] * 1e6:.1f}"
                  f" us, fusion ({args.tactics}) {best['fusion'] * 1e6:.1f} us")  # fmt: skip
            for line in steps:
                _, key, count, seconds = line.split()
                print(f"  {key:24s} {count:>3s} steps {float(seconds) * 1e6:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
