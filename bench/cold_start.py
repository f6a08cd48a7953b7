"""A model's cold start: `fusion.Session` and its first run with empty Numba and timing caches,
in a fresh process per model, and where the compile time went (Numba's `numba:compile`
events, each function's own time: the compiles nested in it subtracted).

    .venv/bin/python bench/cold_start.py MODEL.onnx [MODEL.onnx ...] [--batch 1]
        [--tactics kernel] [--top 8]

A second run of the same process would load everything from the cache; this measures what a
first user, or a deployment image without `python -m fusion_kernels.warmup`, waits. The inputs
are seeded random data of the model's input shapes (fusion.feeds: floats, small integers for
token ids and masks; batch --batch where the first size is symbolic).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
from numba.core import event

spec = json.loads(sys.argv[1])
recorder = event.RecordingListener()
event.register("numba:compile", recorder)
start = time.perf_counter()
import onnx
import fusion
from fusion.feeds import model_inputs

session = fusion.Session(spec["model"], threads=2, tactics=spec["tactics"])
built = time.perf_counter()
# seeded random inputs of every dtype (a transformer's token ids and mask: small integers),
# not counted
model = onnx.load(spec["model"], load_external_data=False)
feeds, _ = model_inputs(model, None, 0, None, batch=spec["batch"])
fed = time.perf_counter()
session.run(None, feeds)
done = time.perf_counter() - (fed - built)

own, stack = {}, []  # each function's own compile time, nested ones subtracted
for t, ev in recorder.buffer:
    f = ev.data["dispatcher"].py_func
    name = f"{f.__module__}.{f.__qualname__}"
    if ev.is_start:
        stack.append([name, t, 0.0])
    else:
        name, t0, nested = stack.pop()
        own[name] = own.get(name, 0.0) + (t - t0) - nested
        if stack:
            stack[-1][2] += t - t0
print(json.dumps({"build": built - start, "first_run": done - built, "total": done - start,
                  "compile": sum(own.values()), "own": own}))
"""


def cold_start(model: str, batch: int, tactics: str | None) -> dict:
    """One model's cold start, in a child process with empty caches of its own."""
    with tempfile.TemporaryDirectory(prefix="fusion-cold-") as folder:
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(folder, "numba"),
                   FUSION_CACHE_DIR=os.path.join(folder, "fusion"))  # fmt: skip
        spec = json.dumps({"model": model, "batch": batch, "tactics": tactics})
        done = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, capture_output=True,
                              text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"{model}: the child failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tactics", default=None, help="fusion.Session's tactics (default: its)")
    parser.add_argument("--top", type=int, default=8, help="functions listed per model")
    args = parser.parse_args(argv)
    for model in args.models:
        r = cold_start(model, args.batch, args.tactics)
        print(f"{os.path.basename(model)}: {r['total']:.1f} s (Session {r['build']:.1f} s, first "
              f"run {r['first_run']:.1f} s; compiling {r['compile']:.1f} s)")  # fmt: skip
        for name, seconds in sorted(r["own"].items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {seconds:6.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
