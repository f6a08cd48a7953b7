"""The dense GEMM (kernels/dense_gemm.py) against onnxruntime's MatMul + Add, one linear layer:

    python bench/linear.py [--shapes 128x768x768 128x768x2304 ...] [--threads 1 2]
                           [--rounds 10] [--budget 4] [--json FILE]

Per shape M x K x N a model y = x W + b (x [M, K] its input, W [K, N] and b initializers, so
onnxruntime pre-packs W as for a real model) goes through fusion.bench.measure with the
DenseLinear rule below (this file, importable as `linear` by the harness's worker processes:
the script's folder is on their path): every runner in a process of its own, onnxruntime at
its defaults (ORT_ENABLE_ALL, spinning), round robin, medians. Two comparisons per shape and
thread count: fusion.Session on the fused model against onnxruntime on the original ("whole",
medians [min-max]); and the fused node's kernel alone on its inputs against onnxruntime on
the node's own body alone ("kernel alone": the GEMM with its plan built, against MatMul + Add
with W pre-packed), the figure bench/NOTES.md keeps. The defaults are a BERT-base layer's
products at sequence 128 (QKV 2304, feed-forward 3072 and back) and bert_small's (hidden 256).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from fusion import bench
from fusion.bench import FUSED, ORT_ALL, PROCESSES, Options, Workload
from fusion.catalog import Rule
from fusion.pattern import Var
from fusion_patterns.linear import (
    check_linear,
    linear,
    linear_attributes,
    linear_inputs,
    linear_params,
)

SHAPES = ("128x768x768", "128x768x2304", "128x768x3072", "128x3072x768", "128x256x1024")


def make_kernel(attrs: dict, constants: list):
    from fusion_kernels.dense_gemm import dense_gemm, prepare_dense  # heavy (Numba): at build time

    plan = prepare_dense(*linear_params(attrs["fc_linear"], *(list(constants) + [None] * 3)[1:4]))
    return lambda x, *_constants: (dense_gemm(x, plan),)


def attributes(m) -> dict:  # functions of this module, not lambdas: the catalog pickles
    return linear_attributes(m, "fc")


def check(m) -> str | None:
    return check_linear(m, "W", "fc")


RULE = Rule(
    "DenseLinear",
    linear(Var("x", dtype="float32", rank=2), "W", "fc"),
    inputs=("x", *linear_inputs("W", "fc")),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,
    priority=2,  # after the catalog's own linear rules (LinearAct takes classifier heads)
    from_last=True,  # the Add first: a match rooted at the MatMul would leave the bias out
    description="bench only: a 2-D MatMul/Gemm + bias on the dense GEMM",
)


def linear_model(m: int, k: int, n: int, seed: int = 0):
    """(y = x W + b as MatMul + Add, feeds {x}), W and b random initializers."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": rng.standard_normal((m, k)).astype(np.float32)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxKxN")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timing per workload")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("FUSION_TACTICS", "kernel")  # the kernel, not the race's choice
    info = bench.machine()
    for line in bench.machine_lines(info):
        print(line)
    results, rows = [], []
    for threads in args.threads:
        opts = Options(threads=threads, rounds=args.rounds, min_rounds=min(5, args.rounds),
                       budget=args.budget, repeat=args.repeat, runners=(ORT_ALL, FUSED),
                       mode=PROCESSES, node_rounds=args.rounds, memory=False, compile=False,
                       sgemm=False, profile=False)  # fmt: skip
        for shape in args.shapes:
            m, k, n = (int(v) for v in shape.lower().split("x"))
            model, feeds = linear_model(m, k, n)
            workload = Workload(f"linear {m}x{k}x{n}", model, feeds, rules=("linear",), batch=1)
            r = bench.measure(workload, opts)
            results.append(r)
            if r.refused or not r.nodes:
                print(f"{r.workload}, {threads} threads: not measured ({r.refused or 'no node'})")
                continue
            node, t = r.nodes[0], r.timing
            whole = {name: t.stats(name) for name in (FUSED, ORT_ALL)}
            gflops = 2 * m * k * n / node["kernel_ms"] / 1e6
            rows.append([shape, str(threads), f"{node['kernel_ms']:.3f}",
                         f"{node['onnxruntime_ms']:.3f}", f"{node['speedup']:.2f}x",
                         f"{gflops:.0f}",
                         "{median_ms:.3f} [{min_ms:.3f}-{max_ms:.3f}]".format(**whole[FUSED]),
                         "{median_ms:.3f} [{min_ms:.3f}-{max_ms:.3f}]".format(**whole[ORT_ALL]),
                         f"{r.speedup(ORT_ALL) or 0:.2f}x"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    head = ["M x K x N", "threads", "kernel ms", "ort MatMul+Add ms", "kernel vs ort",
            "kernel GFLOP/s", "fusion whole ms", "ort whole ms", "whole vs ort"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for line in bench.notes(results):
        print(line)
    if args.json:
        bench.write_json(results, args.json, info, command=info["command"])
    return 1 if any(r.refused for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
