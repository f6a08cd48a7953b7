"""Does a whole-plan race taken under load stay wrong? (issue 26's targets)

For each model, three fresh processes, each a fusion.Session (tactics "fastest", --threads)
that races its plan at batch --batch on seeded random inputs and prints its verdict:
  loaded   while another process keeps one core busy, on an empty timing cache A;
  later    on the quiet machine, on cache A (what a user's next process gets);
  quiet    on the quiet machine, on an empty cache B (the reference: the best candidate).
It reports what each chose, whether the loaded race saw the load (provisional), whether the
later process corrected it, and the cost of the plan a user ends up running: the quiet race's
time of `later`'s choice over its best candidate's (1.00x: the best). No fused node time is
trusted from the loaded process; every figure in the table is a race's own (min over rounds of
per-round medians, fusion/runtime/race.py).

    python bench/race_under_load.py [MODEL.onnx ...] [--batch 1] [--threads 2]

Without models: bench/zoo.py's googlenet, resnet18 and mobilenet_v2 (ts17) from its cache
folder (export them first), fusion/models' SqueezeNet 1.1, and unrolled LSTM and GRU cells
(input 128, hidden 256, 16 steps, as torch.onnx.export writes an nn.LSTMCell loop).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from zoo import model_path, zoo_dir  # bench/zoo.py, beside this script

from fusion.bench.machine import command_line, cpu_line, machine
from fusion.modelfile import save_model
from fusion.models import GRUWeights, LSTMWeights, squeezenet, unrolled_gru, unrolled_lstm

CHILD = """
import json, sys
import numpy as np
import fusion
from fusion.feeds import model_inputs
from fusion.modelfile import read_model
model, _ = read_model(sys.argv[1])
session = fusion.Session(model, threads=int(sys.argv[3]), tactics="fastest")
feeds, _ = model_inputs(session.model, None, 0, None, int(sys.argv[2]))
session.run(None, feeds)
print(json.dumps(session.race_for(feeds)))
"""

BUSY = "while True: pass"


def verdict(path: Path, batch: int, threads: int, cache: Path) -> dict:
    env = dict(os.environ, FUSION_CACHE_DIR=str(cache), FUSION_TACTICS="fastest")
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(batch), str(threads)],
                         env=env, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def loaded_verdict(path: Path, batch: int, threads: int, cache: Path) -> dict:
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        return verdict(path, batch, threads, cache)
    finally:
        busy.kill()
        busy.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="race-under-load-"))
    models = list(args.models)
    if not models:
        models = [model_path(zoo_dir(), n, "ts17") for n in ("googlenet", "resnet18",
                                                               "mobilenet_v2")]  # fmt: skip
        models = [m for m in models if m.exists()]
        built = {
            "squeezenet1_1": squeezenet("1.1", size=224, batch="N"),
            # bench/lstm.py's workload: input 128, hidden 256, T = 16, as exporters unroll cells
            "lstm_cells": unrolled_lstm(LSTMWeights.random(128, 256), 16, "N"),
            "gru_cells": unrolled_gru(GRUWeights.random(128, 256), 16, "N"),
        }
        for name, model in built.items():
            save_model(model, scratch / f"{name}.onnx")
            models.append(scratch / f"{name}.onnx")
    print(f"CPU: {cpu_line(machine())}")
    print(f"command: {command_line()}")
    print(f"batch {args.batch}, {args.threads} threads; times are each race's own (ms)\n")
    print("| model | loaded: chose (provisional?) | later: chose (raced again?) | quiet: best "
          "| later's cost |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for path in models:
        name = path.name.removesuffix(".onnx")
        cache_a, cache_b = scratch / f"{name}.a", scratch / f"{name}.b"
        loaded = loaded_verdict(path, args.batch, args.threads, cache_a)
        later = verdict(path, args.batch, args.threads, cache_a)
        quiet = verdict(path, args.batch, args.threads, cache_b)
        if quiet is None or loaded is None:
            print(f"| {name} | no race (nothing fused runs a kernel) | | | |")
            continue
        best = min(quiet["seconds"], key=quiet["seconds"].get)
        cost = quiet["seconds"][later["chosen"]] / quiet["seconds"][best]

        def ms(race):
            return ", ".join(f"{k} {v * 1e3:.3g}" for k, v in race["seconds"].items())

        print(
            f"| {name} | {loaded['chosen']} ({'yes' if loaded['busy'] else 'no'}, load "
            f"{loaded['load'] or 0:.2f} cores; {ms(loaded)}) | {later['chosen']} "
            f"({'no, cached' if later['cached'] else 'yes'}) | {best} ({ms(quiet)}) "
            f"| {cost:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
