"""Each fused node against onnxruntime's own time for the same work inside the whole model.

bench/convs.py times every conv alone, as a one-conv model: onnxruntime's figure there
includes a session run and the layout reorders around an NCHWc conv, which inside a model it
pays once, so it flatters the kernels (mobilenet_v2 on Zen 4: its convs summed 5.7-6.0 ms
alone against 3.8-4.9 ms in its own run). This script compares inside the model instead:

- onnxruntime at its defaults (ORT_ENABLE_ALL, spinning workers) with its profiler on: each
  node's kernel time, the median over the runs;
- fusion.Session with every fused node on its kernel (tactics="kernel": the kernel's first
  tactic) through Session.profile: each step's time, the median over the runs, Python's call
  of the kernel included.

The k-th fused conv step is matched with onnxruntime's k-th Conv node (both run the model's
convs in graph order; the residual Adds and activations are inside the conv in both). One
process, the two runs one after the other (never at once). Printed per conv and summed.

    .venv/bin/python bench/ingraph.py ~/.cache/fusion/zoo/mobilenet_v2.ts17.onnx [--runs 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

import fusion
from fusion.bench.machine import machine, machine_lines

KERNEL_TIME = "_kernel_time"


def feeds_for(session) -> dict:
    """Seeded normal inputs for the model's float inputs, a symbolic dimension as 1."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


def onnxruntime_nodes(path: str, feeds: dict, runs: int, op: str) -> list[tuple[str, float]]:
    """(node name, median kernel seconds) of every `op` node in onnxruntime's run order."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    warm = max(5, runs // 5)
    for _ in range(warm + runs):
        session.run(None, feeds)
    profile = session.end_profiling()
    with open(profile) as f:
        events = json.load(f)
    os.remove(profile)
    times: dict[str, list[float]] = {}
    ops: dict[str, str] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "Node" and name.endswith(KERNEL_TIME):
            node = name[: -len(KERNEL_TIME)]
            times.setdefault(node, []).append(e["dur"] * 1e-6)
            ops[node] = e.get("args", {}).get("op_name", "")
    return [(n, statistics.median(t[warm:] or t)) for n, t in times.items() if ops[n] == op]


def fusion_steps(path: str, feeds: dict, runs: int, rule: str) -> list[tuple[str, float]]:
    """(step name, seconds) of every kernel step of `rule`, in run order (Session.profile)."""
    model = fusion.rewrite(onnx.load(path)).model
    session = fusion.Session(model, tactics="kernel")
    for _ in range(max(5, runs // 5)):
        session.run(None, feeds)
    profile = session.profile(feeds, repeat=runs)
    steps = zip(session.steps_for(feeds), profile.steps, strict=True)
    return [(name, s) for _, (kind, name, s) in steps if kind == "kernel" and name.startswith(rule)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an ONNX CNN (float input, a symbolic batch taken as 1)")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--op", default="Conv", help="onnxruntime's op to match (default Conv)")
    parser.add_argument("--rule", default="ConvBiasRelu", help="fusion's rule to match")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.model):
        print(f"error: no such model file: {args.model}", file=sys.stderr)
        return 2
    print("\n".join(machine_lines(machine())))
    probe = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    feeds = feeds_for(probe)
    theirs = onnxruntime_nodes(args.model, feeds, args.runs, args.op)
    ours = fusion_steps(args.model, feeds, args.runs, args.rule)
    if len(theirs) != len(ours):
        print(f"error: {len(ours)} {args.rule} steps against {len(theirs)} onnxruntime "
              f"{args.op} nodes: cannot match them in order", file=sys.stderr)  # fmt: skip
        return 1
    print(f"{'fusion us':>10} {'ort us':>8} {'ratio':>6}  fusion step | onnxruntime node")
    for (step, s), (node, t) in zip(ours, theirs, strict=True):
        print(f"{s * 1e6:10.1f} {t * 1e6:8.1f} {t / s:5.2f}x  {step} | {node}")
    total_ours, total_theirs = sum(s for _, s in ours), sum(t for _, t in theirs)
    print(f"sum: fusion {total_ours * 1e3:.3f} ms, onnxruntime {total_theirs * 1e3:.3f} ms, "
          f"ratio {total_theirs / total_ours:.2f}x over {len(ours)} nodes")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
