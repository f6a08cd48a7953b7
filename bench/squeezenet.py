"""SqueezeNet 1.1, batch 1, 3x224x224, 2 threads: fusion.Session vs onnxruntime, side by side.

The whole model first, through fusion.compare (each runner in a worker process of its own,
round robin after warm-up, medians):
  ort-none   onnxruntime ORT_DISABLE_ALL on the original model
  ort-all    onnxruntime at its defaults (ORT_ENABLE_ALL: Conv+Relu fusion, NCHWc layouts;
             its idle workers spinning)
  fusion     fusion.Session on the rewritten model (8 FireModule + 2 ConvBiasRelu kernels)
  sgemm      numpy matmul [512, 576] x [576, 3136] (the machine's SGEMM reference, here)
then, per Fire module: the fused kernel's time and GFLOP/s, the same split into its squeeze,
1x1 and 3x3 convs (with the method each runs), numpy SGEMM on each conv's GEMM shape
(weights [M, K] x im2col [K, OH*OW]), and onnxruntime ORT_ENABLE_ALL's time for the same nodes
from its profiler (its layout reorders counted separately). Finally where the Session's time
goes: kernels, onnxruntime islands (MaxPool, pooling head) and the steps in between.

    .venv/bin/python bench/squeezenet.py [--rounds 30] [--version 1.1] [--size 224]

The per-module part runs in this process (kernels called directly; onnxruntime's profiler with
fusion.ort.DEFAULT_NO_SPIN, so that its workers do not spin into the kernels' time).
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")  # numpy's SGEMM on the same 2 cores

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.bench.timing import interleave  # noqa: E402
from fusion.models import squeezenet, squeezenet_flops  # noqa: E402
from fusion.numerics import compare_arrays, tolerance  # noqa: E402
from fusion.ort import DEFAULT_NO_SPIN, REFERENCE, inference_session  # noqa: E402
from fusion.runtime import Session  # noqa: E402
from fusion.runtime.kernel import node_attributes  # noqa: E402
from fusion_kernels.conv2d import conv2d_bias_act, output_shape  # noqa: E402
from fusion_patterns.fire import fire_plan  # noqa: E402

THREADS = 2
CATALOG = fusion.default_catalog()


def interleaved(cases: dict, rounds: int) -> dict:
    """Median seconds per case over interleaved rounds (fusion.bench.timing)."""
    timing = interleave(cases, rounds, warmup=3, threads=THREADS)
    return {name: timing.median(name) for name in cases}


def scope(name: str) -> str:
    """A node's module: "/features/features.2/MaxPool" -> "features.2", "/Flatten" -> "Flatten"
    (onnxruntime keeps the scope when it renames fused and NCHWc nodes)."""
    parts = name.split("/")
    return parts[2] if len(parts) > 3 else parts[-1]


def ort_fire_times(model, x, runs: int) -> tuple[dict, float, float]:
    """From onnxruntime ORT_ENABLE_ALL's profiler, medians per run in µs: per module scope (a
    Fire module: its convs and Concat, in NCHWc), of all that the Concats, and the layout
    reorders (NCHW <-> NCHWc)."""
    sess = inference_session(model, DEFAULT_NO_SPIN, THREADS, profiling=True)
    for _ in range(runs + 3):
        sess.run(None, {"input": x})
    path = sess.end_profiling()
    with open(path) as f:
        events = [e for e in json.load(f) if e.get("cat") == "Node"]
    os.remove(path)
    events = [e for e in events if e["name"].endswith("_kernel_time")]
    per_run = defaultdict(lambda: defaultdict(float))  # run -> key -> µs
    run = -1
    for e in events:
        run += e["name"] == events[0]["name"]  # the first node of the graph starts a run
        op = e.get("args", {}).get("op_name", "")
        if op.startswith("Reorder"):
            per_run[run]["reorder"] += e["dur"]
            continue
        per_run[run][scope(e["name"][: -len("_kernel_time")])] += e["dur"]
        if op == "Concat":
            per_run[run]["concat"] += e["dur"]
    runs_seen = [per_run[r] for r in sorted(per_run)[3:]]  # without the warm-up runs
    keys = {k for r in runs_seen for k in r}
    med = {k: statistics.median(r.get(k, 0.0) for r in runs_seen) for k in keys}
    return med, med.pop("concat", 0.0), med.pop("reorder", 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--version", default="1.1")
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    model = squeezenet(args.version, size=args.size)
    x = np.random.default_rng(0).standard_normal((1, 3, args.size, args.size)).astype(np.float32)
    fused = fusion.rewrite(model, CATALOG)
    kinds = {"FireModule": 8, "ConvBiasRelu": 2, "MaxPool2D": 3, "GlobalAvgPoolFlatten": 1}
    assert fused.counts() == kinds, fused.explain()
    session = Session(fused.model, threads=THREADS, fuse=False, catalog=CATALOG)
    none = inference_session(model, REFERENCE, THREADS)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((512, 576), np.float32), rng.standard_normal((576, 3136), np.float32)
    want = none.run(None, {"input": x})[0]
    check = compare_arrays("fusion's output", session.run(None, {"input": x})[0], want,
                           *tolerance(CATALOG.rules_in(fused.model)))  # fmt: skip

    timing = fusion.compare(model, {"input": x}, threads=THREADS, rounds=args.rounds)
    labels = dict(zip(("ort-none", "ort-all", "fusion"), timing.times, strict=True))
    med = {name: timing.median(label) for name, label in labels.items()}
    print(timing.describe())
    # Apart: OpenBLAS's threads spin after each call and, interleaved with the Numba kernels,
    # slow fusion.Session down (bench/NOTES.md, the bench harness).
    med.update(interleaved({"sgemm": lambda: a @ b}, args.rounds))
    flops = squeezenet_flops(args.version, args.size)
    sgemm = 2 * a.shape[0] * a.shape[1] * b.shape[1] / med["sgemm"] / 1e9
    print(f"SqueezeNet {args.version}, 1x3x{args.size}x{args.size}, {THREADS} threads, "
          f"{args.rounds} interleaved rounds; {flops['total'] / 1e9:.3f} GFLOP per run; "
          f"against ort-none: {check}")  # fmt: skip
    print(f"{'case':9s} {'ms':>8s} {'GFLOP/s':>8s} {'x sgemm':>8s} {'vs ort-all':>10s}")
    for name in ("ort-none", "ort-all", "fusion", "sgemm"):
        gf = (flops["total"] if name != "sgemm" else 2 * 512 * 576 * 3136) / med[name] / 1e9
        print(f"{name:9s} {med[name] * 1e3:8.2f} {gf:8.1f} {gf / sgemm:8.2f} "
              f"{med['ort-all'] / med[name]:10.2f}")  # fmt: skip

    # Per Fire module: the fused kernel, its three convs, SGEMM on their shapes, and ORT.
    values = session.run_with_intermediates({"input": x})
    steps = [s for s in session.steps if s.kind == "kernel" and s.node.op_type == "FireModule"]
    cases, shapes = {}, {}
    for step in steps:
        key = step.name.split("/")[2]
        xin = values[step.inputs[0]]
        cases[key] = lambda k=step.kernel, v=xin: k(v)
        plan = _fire_plan(session, step)
        s = conv2d_bias_act(xin, plan.squeeze)
        convs = [("squeeze", plan.squeeze, xin)] + [("expand", e, s) for e in plan.expands]
        for j, (label, p, inp) in enumerate(convs):
            (_, m, oh, ow), _ = output_shape(inp.shape, p)
            k_len = p.in_channels * p.kernel[0] * p.kernel[1]
            tag = f"{key}:{j}"
            cases[tag] = lambda p=p, v=inp: conv2d_bias_act(v, p)
            w = rng.standard_normal((m, k_len), np.float32)
            col = rng.standard_normal((k_len, oh * ow), np.float32)
            cases[tag + ":gemm"] = lambda w=w, col=col: w @ col
            shapes[tag] = (label, p, m, k_len, oh * ow)
    # numpy's OpenBLAS threads spin after each call; timed apart from the Numba kernels
    others = [s for s in session.steps if s.kind == "kernel" and s.node.op_type != "FireModule"]
    for step in others:
        cases[step.name] = lambda k=step.kernel, v=values[step.inputs[0]]: k(v)
    kmed = interleaved({k: f for k, f in cases.items() if not k.endswith(":gemm")}, args.rounds)
    kmed.update(interleaved({k: f for k, f in cases.items() if k.endswith(":gemm")}, args.rounds))
    ort_med, concat, reorder = ort_fire_times(model, x, args.rounds)
    print("\nper Fire module (median us; GFLOP/s; sgemm = numpy on the same [M,K]x[K,P]; "
          "ort-all from its profiler: convs + Concat in NCHWc)")  # fmt: skip
    print(f"{'module':12s} {'conv':22s} {'us':>8s} {'GFLOP/s':>8s} {'sgemm GF/s':>10s} "
          f"{'ort-all us':>10s}")  # fmt: skip
    for step in steps:
        key = step.name.split("/")[2]
        f = flops[key]
        print(f"{key:12s} {'FireModule':22s} {kmed[key] * 1e6:8.0f} {f / kmed[key] / 1e9:8.1f} "
              f"{'':>10s} {ort_med.get(key, float('nan')):10.0f}")  # fmt: skip
        for j in range(3):
            label, p, m, k_len, pix = shapes[f"{key}:{j}"]
            gf = 2 * m * k_len * pix / 1e9
            kh, kw = p.kernel
            desc = f"{label} {kh}x{kw} {p.method} {m}x{k_len}x{pix}"
            t, t_gemm = kmed[f"{key}:{j}"], kmed[f"{key}:{j}:gemm"]
            print(f"{'':12s} {desc:22s} {t * 1e6:8.0f} {gf / t:8.1f} {gf / t_gemm:10.1f}")
    replaced = {f.node: [label.split(" ", 1)[1] for label in f.replaced] for f in fused.fusions}
    for step in others:  # onnxruntime's time for the nodes this one replaced
        ort_t = sum(ort_med.get(k, 0.0) for k in {scope(n) for n in replaced[step.node.name]})
        print(f"{scope(step.node.name):12s} {step.node.op_type:22s} {kmed[step.name] * 1e6:8.0f} "
              f"{'':>8s} {'':>10s} {ort_t:10.0f}")  # fmt: skip
    split = defaultdict(lambda: [0.0, 0.0])  # conv kind -> [seconds, FLOPs]
    for tag, (_, p, m, k_len, pix) in shapes.items():
        kind = f"{p.kernel[0]}x{p.kernel[1]} {p.method}"
        split[kind][0] += kmed[tag]
        split[kind][1] += 2 * m * k_len * pix
    total_s, total_f = (sum(v[i] for v in split.values()) for i in (0, 1))
    print("convs of all Fire modules: " + "; ".join(
        f"{kind}: {t * 1e3:.2f} ms ({t / total_s:.0%} of time, {f / total_f:.0%} of FLOPs, "
        f"{f / t / 1e9:.1f} GFLOP/s)" for kind, (t, f) in split.items()))  # fmt: skip
    prof = session.profile({"input": x}, repeat=args.rounds)
    fire_total = sum(kmed[k.name.split("/")[2]] for k in steps)
    print(f"\nfusion.Session: {prof.wall * 1e3:.2f} ms per run = kernels "
          f"{prof.total('kernel') * 1e3:.2f} (Fire modules {fire_total * 1e3:.2f}) + islands "
          f"{prof.total('island') * 1e3:.2f} ({len(session.islands)} islands) + between "
          f"{prof.overhead * 1e3:.2f}; ort-all Fire modules "
          f"{sum(ort_med.get(scope(s.node.name), 0.0) for s in steps) / 1e3:.2f} ms (Concat copies "
          f"{concat / 1e3:.2f} of it), "
          f"NCHWc reorders {reorder / 1e3:.2f} ms")  # fmt: skip


def _fire_plan(session, step):
    """The FirePlan of a fused node, prepared again as its kernel's was."""
    constants = [session.view.constant(v) if v else None for v in step.node.input]
    return fire_plan(node_attributes(step.node), constants)


if __name__ == "__main__":
    main()
