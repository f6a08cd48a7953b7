"""Conv kernel vs onnxruntime on a stack of 3x3, 64-channel, pad-1 convs at 56x56 (batch 1 or N).

Runs, interleaved round by round after warm-up (fusion.bench.timing), with 2 threads everywhere:
  sgemm      numpy matmul [64, 576] x [576, N*3136], the im2col GEMM of one conv (SGEMM reference)
  kernels    conv2d_bias_act with bias and relu fused, chained 4 times
  ort-none   onnxruntime (fusion.ort.REFERENCE) on Conv + Add(bias [1,64,1,1]) + Relu x 4
  ort-all    onnxruntime ORT_ENABLE_ALL (fusion.ort.DEFAULT_NO_SPIN: fuses, NCHWc layouts)
on fusion.models.conv_stack's TensorFlow form and weights, and prints medians: ms, GFLOP/s (of
the direct 2*M*C*9*OH*OW per conv) and fraction of sgemm.

    .venv/bin/python bench/conv_kernel.py [--rounds 30] [--layers 4] [--size 56] [--channels 64]
                                          [--batch 1] [--winograd-tile 2]

The kernel's plan method is printed: "winograd" is F(2x2, 3x3) (the default), "winograd4"
F(4x4, 3x3) (--winograd-tile 4, opt-in: faster, ~10x the rounding error).
On a shared machine compare the ratios (columns x sgemm, and kernels vs ort-all), not the ms.
"""

import argparse

import numpy as np
from onnx import numpy_helper

import fusion_kernels
from fusion.bench.timing import interleave
from fusion.models import conv_stack
from fusion.numerics import DEFAULT_ATOL, DEFAULT_RTOL, compare_arrays
from fusion.ort import DEFAULT_NO_SPIN, REFERENCE, inference_session

THREADS = 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", type=int, default=56)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--winograd-tile", type=int, default=2, choices=(2, 4))
    args = ap.parse_args()
    fusion_kernels.set_threads(THREADS)
    c, s, nb = args.channels, args.size, args.batch
    model = conv_stack(blocks=args.layers, channels=c, size=s, batch=nb, form="tf")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    kw = dict(pads=(1, 1, 1, 1), activation="relu", winograd_tile=args.winograd_tile)
    plans = [
        fusion_kernels.prepare_conv2d(inits[f"conv{i}.weight"], inits[f"conv{i}.bias"], **kw)
        for i in range(args.layers)
    ]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((nb, c, s, s)).astype(np.float32)
    bufs = [np.empty((nb, c, s, s), np.float32) for _ in range(2)]

    def run_kernels():
        h = x
        for i, plan in enumerate(plans):
            h = fusion_kernels.conv2d_bias_act(h, plan, out=bufs[i % 2])
        return h

    none = inference_session(model, REFERENCE, THREADS)
    full = inference_session(model, DEFAULT_NO_SPIN, THREADS)
    a = rng.standard_normal((c, 9 * c)).astype(np.float32)
    b = rng.standard_normal((9 * c, nb * s * s)).astype(np.float32)
    cases = {
        "sgemm": lambda: a @ b,
        "kernels": run_kernels,
        "ort-none": lambda: none.run(None, {"input": x}),
        "ort-all": lambda: full.run(None, {"input": x}),
    }
    ref = none.run(None, {"input": x})[0]
    check = compare_arrays("kernels' output", run_kernels(), ref, DEFAULT_RTOL, DEFAULT_ATOL)
    timing = interleave(cases, args.rounds, warmup=3, threads=THREADS)
    flops = {"sgemm": 2 * c * 9 * c * s * s * nb}
    flops.update(dict.fromkeys(("kernels", "ort-none", "ort-all"), args.layers * flops["sgemm"]))
    med = {k: timing.median(k) for k in cases}
    gf_sgemm = flops["sgemm"] / med["sgemm"] / 1e9
    print(f"{args.layers} x conv3x3 {c}ch {s}x{s} batch {nb}, {THREADS} threads,"
          f" {args.rounds} rounds, all in one process (onnxruntime not spinning),"
          f" plan method {plans[0].method}; against ort-none: {check}")  # fmt: skip
    print(f"{'case':10s} {'ms':>8s} {'GFLOP/s':>8s} {'x sgemm':>8s}")
    for name, t in med.items():
        gf = flops[name] / t / 1e9
        print(f"{name:10s} {t * 1e3:8.3f} {gf:8.1f} {gf / gf_sgemm:8.2f}")


if __name__ == "__main__":
    main()
