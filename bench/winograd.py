"""The blocked 3x3 stride-1 kernels on one conv each: direct (conv_nchwc) against Winograd
F(2x2, 3x3) and F(4x4, 3x3) (winograd_nchwc), with onnxruntime's Conv + Relu beside them.

    .venv/bin/python bench/winograd.py [--shapes 64x56 128x28 256x14 512x7] [--rounds 15]
                                       [--threads 2] [--batch 1] [--block 16]

Per shape C=M x H=W (pads 1, bias, ReLU, He-scaled random weights): every runner interleaved
round by round in this process (fusion.bench.timing.interleave), so onnxruntime runs without
spinning (fusion.ort.DEFAULT_NO_SPIN: its spinning workers would steal the kernels' cores) and
pays its NCHW -> NCHWc reorders, which inside a model it pays once: its column is a reference
for the kernels' ratios to each other, not the rival's figure (that is bench/convs.py, each
runner in its own process, or bench/ingraph.py inside the model). Prints median ms, GFLOP/s of
the direct conv's 2 M C 9 H W, and each kernel's error relative to the output's scale against
onnxruntime without optimizations.
"""

import argparse

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from fusion.bench.machine import machine, machine_lines
from fusion.bench.timing import interleave
from fusion.ort import DEFAULT_NO_SPIN, REFERENCE, inference_session


def conv_model(w, b):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "conv3x3", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["64x56", "128x28", "256x14", "512x7"],
                    help="CxH: channels (in = out) and image size")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block", type=int, default=None, help="8 or 16 (default: the CPU's)")
    args = ap.parse_args(argv)

    import fusion_kernels  # heavy (Numba): after the arguments parse
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc
    from fusion_kernels.winograd_nchwc import prepare_winograd_nchwc, winograd_nchwc

    fusion_kernels.set_threads(args.threads)
    print("\n".join(machine_lines(machine())))
    print(f"batch {args.batch}, {args.threads} threads, {args.rounds} rounds interleaved in one "
          "process (onnxruntime not spinning, its reorders included)")  # fmt: skip
    print(f"{'shape':>10s} {'runner':>8s} {'ms':>8s} {'GFLOP/s':>8s} {'vs direct':>9s} "
          f"{'error':>8s}")  # fmt: skip
    rng = np.random.default_rng(0)
    for spec in args.shapes:
        c, s = (int(v) for v in spec.split("x"))
        w = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        x = rng.standard_normal((args.batch, c, s, s)).astype(np.float32)
        common = dict(pads=(1, 1, 1, 1), activation="relu", block=args.block)
        direct = prepare_conv_nchwc(w, b, **common)
        plans = {"direct": (conv_nchwc, direct)}
        for tile in (2, 4):
            plans[f"wino{tile}"] = (winograd_nchwc, prepare_winograd_nchwc(w, b, tile=tile,
                                                                           **common))  # fmt: skip
        model = conv_model(w, b)
        ort = inference_session(model, DEFAULT_NO_SPIN, args.threads)
        want = inference_session(model, REFERENCE, args.threads).run(None, {"x": x})[0]
        scale = float(np.abs(want).max()) or 1.0
        # (C below the block: the direct plan reads one block of C channels, Winograd a whole one)
        blocked = {k: to_blocked(x, block=p.in_block) for k, (_, p) in plans.items()}
        calls = {k: (lambda f=f, p=p, xb=blocked[k]: f(xb, p)) for k, (f, p) in plans.items()}
        calls["ort"] = lambda ort=ort, x=x: ort.run(None, {"x": x})
        errors = {k: float(np.abs(from_blocked(run(), c) - want).max()) / scale
                  for k, run in calls.items() if k != "ort"}  # fmt: skip
        timing = interleave(calls, args.rounds, warmup=2, threads=args.threads)
        flops = 2 * c * c * 9 * s * s * args.batch
        base = timing.median("direct")
        for k in calls:
            t = timing.median(k)
            err = f"{errors[k]:8.1e}" if k in errors else f"{'':8s}"
            print(f"{spec:>10s} {k:>8s} {t * 1e3:8.3f} {flops / t / 1e9:8.1f} "
                  f"{base / t:8.2f}x {err}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
