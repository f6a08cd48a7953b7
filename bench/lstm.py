"""LSTM: fusion.Session on the unrolled graph vs onnxruntime, input 128, hidden 256, T = 16.

Per batch size, interleaved round by round after warm-up, 2 threads everywhere:
  fused       fusion.Session (LSTMCell + LSTMSequence) on the unrolled PyTorch-style graph
  ort-unroll  onnxruntime ORT_ENABLE_ALL on the same unrolled graph
  ort-lstm    onnxruntime ORT_ENABLE_ALL on the native ONNX LSTM op with the same weights
and, in the same run (in its own phase: OpenBLAS threads spin after a call and would slow the
others down), the machine's SGEMM: numpy (OpenBLAS) matmul of 512 x 512 x 512. It prints
medians (us), GFLOP/s (2 T B (I + H) 4H per run) and ratios, and checks that the outputs
agree within 1e-5.

    .venv/bin/python bench/lstm.py [--rounds 30] [--steps 16] [--batch 1 16]
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fusion  # noqa: E402
from fusion.lstm_models import LSTMWeights, native_lstm, unrolled_lstm  # noqa: E402
from fusion.runtime import Session  # noqa: E402

THREADS, INPUT, HIDDEN = 2, 128, 256


def ort_session(model):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timed(fn, repeat):
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def sgemm_gflops(rounds):
    a = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    timed(lambda: a @ a, 5)
    return 2 * 512**3 / statistics.median(timed(lambda: a @ a, 5) for _ in range(rounds)) / 1e9


def bench_batch(batch, steps, rounds, weights, catalog, sgemm):
    unrolled = unrolled_lstm(weights, steps, batch)
    rng = np.random.default_rng(0)
    feeds = {
        "X": rng.standard_normal((steps, batch, INPUT)).astype(np.float32),
        "h0": rng.standard_normal((batch, HIDDEN)).astype(np.float32),
        "c0": rng.standard_normal((batch, HIDDEN)).astype(np.float32),
    }
    fused = Session(unrolled, threads=THREADS, catalog=catalog)
    assert [s.kind for s in fused.steps] == ["kernel"], fused.steps  # Gather/Concat folded
    ort_unroll, ort_lstm = ort_session(unrolled), ort_session(native_lstm(weights, steps, batch))
    runs = {
        "fused": lambda: fused.run(None, feeds),
        "ort-unroll": lambda: ort_unroll.run(None, feeds),
        "ort-lstm": lambda: ort_lstm.run(None, feeds),
    }
    want = ort_unroll.run(None, feeds)
    for name in ("fused", "ort-lstm"):
        err = max(float(np.abs(g - w).max()) for g, w in zip(runs[name](), want, strict=True))
        assert err <= 1e-5, f"{name}: max abs error {err:.2e} vs onnxruntime"
    for fn in runs.values():  # warm-up
        timed(fn, 5)
    times = {name: [] for name in runs}
    repeat = 20 if batch == 1 else 5
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(timed(fn, repeat))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    flops = 2 * steps * batch * (INPUT + HIDDEN) * 4 * HIDDEN
    print(f"\nbatch {batch}, T {steps}, input {INPUT}, hidden {HIDDEN}, {THREADS} threads")
    print(f"{'':<11} {'median us':>10} {'GFLOP/s':>8} {'x sgemm':>8}")
    for name in ("fused", "ort-unroll", "ort-lstm"):
        gf = flops / med[name] / 1e9
        print(f"{name:<11} {med[name] * 1e6:>10.1f} {gf:>8.2f} {gf / sgemm:>8.2f}")
    print(f"{'sgemm':<11} {'':>10} {sgemm:>8.2f} {1:>8.2f}")
    print(f"fused vs ort-unroll: {med['ort-unroll'] / med['fused']:.2f}x faster")
    print(f"fused vs ort-lstm:   {med['ort-lstm'] / med['fused']:.2f}x faster")
    print("fused profile (us):\n" + str(fused.profile(feeds, repeat=50)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    weights = LSTMWeights.random(INPUT, HIDDEN, seed=0)
    catalog = fusion.default_catalog()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    sgemm = sgemm_gflops(args.rounds)
    print(f"sgemm 512^3, {THREADS} OpenBLAS threads: {sgemm:.1f} GFLOP/s")
    for batch in args.batch:
        bench_batch(batch, args.steps, args.rounds, weights, catalog, sgemm)


if __name__ == "__main__":
    main()
