"""Conv kernel vs onnxruntime on a stack of 3x3, 64-channel, pad-1 convs at 56x56 (batch 1 or N).

Runs, interleaved round by round after warm-up, with 2 threads everywhere:
  sgemm      numpy matmul [64, 576] x [576, N*3136], the im2col GEMM of one conv (SGEMM reference)
  kernels    conv2d_bias_act with bias and relu fused, chained 4 times
  ort-none   onnxruntime ORT_DISABLE_ALL on Conv + Add(bias [1,64,1,1]) + Relu x 4
  ort-all    onnxruntime ORT_ENABLE_ALL on the same graph (fuses and uses NCHWc layouts)
and prints medians: ms, GFLOP/s (of the direct 2*M*C*9*OH*OW per conv) and fraction of sgemm.

    .venv/bin/python bench/conv_kernel.py [--rounds 30] [--layers 4] [--size 56] [--channels 64]
                                          [--batch 1] [--winograd-tile 2]

The kernel's plan method is printed: "winograd" is F(2x2, 3x3) (the default), "winograd4"
F(4x4, 3x3) (--winograd-tile 4, opt-in: faster, ~10x the rounding error).
On a shared machine compare the ratios (columns x sgemm, and kernels vs ort-all), not the ms.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kernels  # noqa: E402

THREADS = 2


def conv_stack_model(weights, biases, shape):
    nodes, inits, prev = [], [], "x"
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1] * 4, kernel_shape=[3, 3]),
            helper.make_node("Add", [f"c{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        prev = f"r{i}"
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", prev)]
    graph = helper.make_graph(nodes, "conv_stack", io[:1], io[1:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def ort_session(model, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", type=int, default=56)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--winograd-tile", type=int, default=2, choices=(2, 4))
    args = ap.parse_args()
    kernels.set_threads(THREADS)
    c, s = args.channels, args.size
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((c, c, 3, 3)) * (2 / (9 * c)) ** 0.5).astype(np.float32)
          for _ in range(args.layers)]  # fmt: skip
    bs = [rng.standard_normal((1, c, 1, 1)).astype(np.float32) * 0.1 for _ in ws]
    nb = args.batch
    x = rng.standard_normal((nb, c, s, s)).astype(np.float32)
    kw = dict(pads=(1, 1, 1, 1), activation="relu", winograd_tile=args.winograd_tile)
    plans = [kernels.prepare_conv2d(w, b, **kw) for w, b in zip(ws, bs, strict=True)]
    bufs = [np.empty((nb, c, s, s), np.float32) for _ in range(2)]

    def run_kernels():
        h = x
        for i, plan in enumerate(plans):
            h = kernels.conv2d_bias_act(h, plan, out=bufs[i % 2])
        return h

    model = conv_stack_model(ws, bs, [nb, c, s, s])
    onnx.checker.check_model(model)
    sess = {
        "ort-none": ort_session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        "ort-all": ort_session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    }
    a = rng.standard_normal((c, 9 * c)).astype(np.float32)
    b = rng.standard_normal((9 * c, nb * s * s)).astype(np.float32)
    cases = {
        "sgemm": lambda: a @ b,
        "kernels": run_kernels,
        "ort-none": lambda: sess["ort-none"].run(None, {"x": x}),
        "ort-all": lambda: sess["ort-all"].run(None, {"x": x}),
    }
    ref = sess["ort-none"].run(None, {"x": x})[0]
    got = run_kernels()
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    for f in cases.values():  # warm-up (compile / load the Numba cache, ORT first-run)
        for _ in range(3):
            f()
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, f in cases.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    flops = {"sgemm": 2 * c * 9 * c * s * s * nb}
    flops.update(dict.fromkeys(("kernels", "ort-none", "ort-all"), args.layers * flops["sgemm"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    gf_sgemm = flops["sgemm"] / med["sgemm"] / 1e9
    print(f"{args.layers} x conv3x3 {c}ch {s}x{s} batch {nb}, {THREADS} threads,"
          f" {args.rounds} rounds,"
          f" plan method {plans[0].method}, max|err|/max|y| vs ort = {err:.2e}")  # fmt: skip
    print(f"{'case':10s} {'ms':>8s} {'GFLOP/s':>8s} {'x sgemm':>8s}")
    for name, t in med.items():
        gf = flops[name] / t / 1e9
        print(f"{name:10s} {t * 1e3:8.3f} {gf:8.1f} {gf / gf_sgemm:8.2f}")


if __name__ == "__main__":
    main()
