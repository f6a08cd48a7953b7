"""LSTM: fusion.Session on the unrolled graph vs onnxruntime, input 128, hidden 256, T = 16.

Per batch size, interleaved round by round after warm-up, 2 threads everywhere:
  fused       fusion.Session (LSTMCell + LSTMSequence) on the unrolled PyTorch-style graph
  ort-unroll  onnxruntime ORT_ENABLE_ALL on the same unrolled graph
  ort-lstm    onnxruntime ORT_ENABLE_ALL on the native ONNX LSTM op with the same weights
  sgemm       the machine's SGEMM on the same work as one product: numpy (OpenBLAS, 2 threads)
              [T B, I + H] x [I + H, 4H], no recurrence in the way
all in the same rounds (the order rotating from round to round), so load from other processes
hits them alike; each runner's turn is a few calls back to back (20 at batch 1, 5 above).

Two regimes, each its own set of rounds:
  busy        rounds back to back: the CPU stays busy, as in a loop serving requests.
  after idle  a 0.25 s pause before every round (a process that is mostly idle gets slow CPUs
              on these virtual machines: bench/NOTES.md, LSTM).
OpenBLAS's idle workers would spin after each SGEMM and slow the next runner down; the
OPENBLAS_THREAD_TIMEOUT below puts them to sleep at once. "sgemm warm" times the same product
back to back in a child process with OpenBLAS's default thread timeout
(fusion.bench.child.warm_sgemm): the speed the SGEMM reaches with its threads awake and the CPU
busy, the yardstick for batch 16's target. It is measured before and after the rounds and the
faster one kept (load from other processes disturbs single measurements). It prints medians
(us), GFLOP/s (2 T B (I + H) 4H per run) and ratios, and checks that the outputs agree within
1e-5. onnxruntime runs with fusion.ort.DEFAULT_NO_SPIN (ORT_ENABLE_ALL, workers that do
not spin while the other runners take their turn).

    .venv/bin/python bench/lstm.py [--rounds 30] [--steps 16] [--batch 1 16] [--baseline DIR]

--baseline DIR adds "fused-base": the same Session with DIR's kernels/ package (for example a
`git archive HEAD | tar -x -C DIR` of the last commit) standing in for kernels.lstm while the
session is built, so an old and a new kernel are measured side by side in the same rounds.
"""

import argparse
import contextlib
import importlib.util
import os
import sys

# Read by OpenBLAS when numpy loads it: idle workers sleep at once instead of spinning after
# each call, so the interleaved SGEMM reference does not slow the other runners (as bench/run.py).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.bench.child import warm_sgemm  # noqa: E402
from fusion.bench.timing import interleave  # noqa: E402
from fusion.models import LSTMWeights, native_lstm, unrolled_lstm  # noqa: E402
from fusion.numerics import compare_arrays  # noqa: E402
from fusion.ort import DEFAULT_NO_SPIN, inference_session  # noqa: E402

THREADS, INPUT, HIDDEN = 2, 128, 256
IDLE_PAUSE = 0.25  # s before each round of the "after idle" regime


@contextlib.contextmanager
def baseline_kernels(directory):
    """Import DIR/kernels as package "baseline_kernels" and let `kernels.lstm` name its lstm."""
    name = "baseline_kernels"
    if name not in sys.modules:
        init = os.path.join(directory, "kernels", "__init__.py")
        spec = importlib.util.spec_from_file_location(name, init)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    base = importlib.import_module(f"{name}.lstm")
    current = sys.modules.get("kernels.lstm")
    sys.modules["kernels.lstm"] = base
    try:
        yield
    finally:
        sys.modules["kernels.lstm"] = current


def bench_batch(batch, steps, rounds, weights, catalog, baseline=None):
    unrolled = unrolled_lstm(weights, steps, batch)
    rng = np.random.default_rng(0)
    feeds = {
        "X": rng.standard_normal((steps, batch, INPUT)).astype(np.float32),
        "h0": rng.standard_normal((batch, HIDDEN)).astype(np.float32),
        "c0": rng.standard_normal((batch, HIDDEN)).astype(np.float32),
    }
    fused = fusion.Session(unrolled, threads=THREADS, catalog=catalog)
    assert [s.kind for s in fused.steps] == ["kernel"], fused.steps  # Gather/Concat folded
    ort_unroll = inference_session(unrolled, DEFAULT_NO_SPIN, THREADS)
    ort_lstm = inference_session(native_lstm(weights, steps, batch), DEFAULT_NO_SPIN, THREADS)
    runs = {
        "fused": lambda: fused.run(None, feeds),
        "ort-unroll": lambda: ort_unroll.run(None, feeds),
        "ort-lstm": lambda: ort_lstm.run(None, feeds),
    }
    if baseline:
        with baseline_kernels(baseline):
            base = fusion.Session(unrolled, threads=THREADS, catalog=catalog)
        runs["fused-base"] = lambda: base.run(None, feeds)
    rng_g = np.random.default_rng(1)
    a = rng_g.standard_normal((steps * batch, INPUT + HIDDEN)).astype(np.float32)
    b = rng_g.standard_normal((INPUT + HIDDEN, 4 * HIDDEN)).astype(np.float32)
    want = ort_unroll.run(None, feeds)
    for name in runs:
        for k, (g, w) in enumerate(zip(runs[name](), want, strict=True)):
            agree = compare_arrays(f"{name} output {k}", g, w, rtol=0, atol=1e-5)
            assert agree.ok, f"{agree} vs onnxruntime"
    runs["sgemm"] = lambda: a @ b
    flops = 2 * steps * batch * (INPUT + HIDDEN) * 4 * HIDDEN
    shape = (a.shape[0], a.shape[1], b.shape[1])
    warm_before = warm_sgemm(shape, THREADS)
    print(f"\nbatch {batch}, T {steps}, input {INPUT}, hidden {HIDDEN}, {THREADS} threads")
    repeat = 20 if batch == 1 else 5  # calls per turn
    meds = {}
    for regime, pause in (("busy", 0.0), ("after idle", IDLE_PAUSE)):
        timing = interleave(runs, rounds, warmup=5, repeat=repeat, pause=pause, threads=THREADS)
        meds[regime] = {name: timing.median(name) for name in runs}
    warm_s = min(warm_before, warm_sgemm(shape, THREADS))
    for regime, med in meds.items():
        print(f"\n{regime + ':':<15} {'median us':>10} {'GFLOP/s':>8} {'x sgemm':>8}")
        for name, t in med.items():
            print(f"{name:<15} {t * 1e6:>10.1f} {flops / t / 1e9:>8.2f} {med['sgemm'] / t:>8.2f}")
        print(f"fused at {warm_s / med['fused']:.0%} of warm SGEMM's speed")
        print(f"fused vs ort-unroll: {med['ort-unroll'] / med['fused']:.2f}x faster")
        print(f"fused vs ort-lstm:   {med['ort-lstm'] / med['fused']:.2f}x faster")
        if baseline:
            print(f"fused vs fused-base: {med['fused-base'] / med['fused']:.2f}x faster")
    print(f"sgemm warm      {warm_s * 1e6:>10.1f} {flops / warm_s / 1e9:>8.2f}")
    print("fused profile (us):\n" + str(fused.profile(feeds, repeat=50)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--baseline", help="a checkout whose kernels/ to compare against")
    args = ap.parse_args()
    weights = LSTMWeights.random(INPUT, HIDDEN, seed=0)
    catalog = fusion.default_catalog()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for batch in args.batch:
        bench_batch(batch, args.steps, args.rounds, weights, catalog, args.baseline)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
