"""Several processes running one model at once, back to back: replicas of a service on one
machine, or a test suite run with `pytest -n 2`. Each runner (fusion.Session at the chosen
tactics, onnxruntime at its defaults: fusion.ort.DEFAULT, spinning) is timed alone, then in
`--processes` processes started together, each running for `--seconds` after a shared start;
the figures per process are its median and, in parentheses, its mean run (bimodal runs show
in the mean), beside the same runner's alone.

    python bench/concurrency.py MODEL.onnx [--batch 1] [--processes 2] [--seconds 4]
                               [--runners fusion ort-all] [--tactics kernels]

On mobilenet_v3_small batch 1, forced onto the kernels (`--tactics kernels --seconds 4
--runners fusion`), two Zen 4 vCPUs (AMD EPYC, family 25 model 17; bench/NOTES.md), median
(mean) ms: two at once 3.20-3.22 (3.25-3.28) and 1.89-2.11 (3.18) with the thread placement
of fusion/runtime/placement.py, 20.98-21.17 (20.5-21.6) with FUSION_PIN=0, where alone each
takes 1.16-1.46; onnxruntime (`--runners ort-all`) alone 1.02, two at once 4.88-5.71 (4.30).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from fusion.bench.machine import machine, machine_lines
from fusion.feeds import model_inputs
from fusion.modelfile import read_model


def runner(name: str, path: str, batch: int, threads: int, tactics: str):
    """A callable that runs the model once, for runner `name`, on seeded random inputs (free
    first axes `batch`, as bench/models.py feeds them)."""
    model = read_model(path)[0]
    feeds, _ = model_inputs(model, None, 0, None, batch=batch)
    if name == "fusion":
        from fusion.runtime.session import Session

        session = Session(model, threads=threads, tactics=tactics)
    else:
        from fusion.ort import DEFAULT, inference_session

        session = inference_session(model, DEFAULT, threads)
    return lambda: session.run(None, feeds)


def process(name, path, batch, threads, tactics, seconds, start, results) -> None:
    """One process: build, warm up, wait for the others, run for `seconds`; puts its median
    and mean run."""
    run = runner(name, path, batch, threads, tactics)
    for _ in range(5):
        run()
    start.wait()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    results.put((statistics.median(times), statistics.fmean(times)))


def per_process(name, path, batch, threads, tactics, seconds, count) -> list[tuple]:
    """(median, mean) run of each of `count` processes running the model at once."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(count), ctx.Queue()
    args = (name, path, batch, threads, tactics, seconds, start, results)
    procs = [ctx.Process(target=process, args=args) for _ in range(count)]
    for p in procs:
        p.start()
    out = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="an ONNX file (a symbolic first axis is the batch)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="timed seconds per process")
    ap.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="per process (default: the CPUs this process may use)",
    )
    ap.add_argument("--runners", nargs="+", default=["fusion", "ort-all"],
                    choices=["fusion", "ort-all"])  # fmt: skip
    ap.add_argument(
        "--tactics",
        default=os.environ.get("FUSION_TACTICS", "fastest"),
        help="fusion.Session's tactics (default: FUSION_TACTICS, else fastest)",
    )
    args = ap.parse_args()
    for line in machine_lines(machine()):
        print(line)
    print(f"{os.path.basename(args.model)} batch {args.batch}, {args.threads} threads a process,"
          f" {args.seconds:g} s of runs back to back; median (mean) ms")  # fmt: skip
    for name in args.runners:
        common = (name, args.model, args.batch, args.threads, args.tactics, args.seconds)
        alone = per_process(*common, 1)[0]
        together = per_process(*common, args.processes)
        each = ", ".join(f"{m * 1e3:.3f} ({a * 1e3:.3f})" for m, a in together)
        mean = statistics.fmean(a for _, a in together)
        print(f"{name:8} alone {alone[0] * 1e3:.3f} ({alone[1] * 1e3:.3f})   {args.processes} "
              f"at once: {each}   (means {mean / alone[1]:.1f}x alone)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
