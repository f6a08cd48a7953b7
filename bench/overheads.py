"""Fixed costs of a kernel call, on inputs so small that the arithmetic is negligible: the
Python and Numba dispatch around a conv call, a Fire module in one compiled call vs conv by conv
(the path plans outside the usual ones take), how late a parallel region starts when its
worker thread has been idle (a busy main thread) or both cores have (a sleep), a chain of
calls as a model makes them, back to back and after the process slept, and what one
crossing between an onnxruntime island and a kernel costs in fusion.Session.

    .venv/bin/python bench/overheads.py [--rounds 2000] [--model FILE.onnx]

Medians in microseconds (fusion.bench.timing). The worker's spinning after a region is set by
GOMP_SPINCOUNT (kernels/config.py); run with GOMP_SPINCOUNT=0 to see the cost without it.
"""

import argparse
import os
import time

import numpy as np

import fusion
from fusion.bench.timing import interleave
from fusion.models.builder import GraphBuilder
from fusion.ort import DEFAULT, inference_session
from fusion_kernels import conv2d_bias_act, prepare_conv2d, set_threads, to_blocked
from fusion_kernels.conv_concat import conv_concat
from fusion_kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc
from fusion_kernels.fire import fire, prepare_fire


def median_us(call, rounds, before=None) -> float:
    return interleave({"call": call}, rounds, warmup=1, before=before).median("call") * 1e6


def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def kernel_calls(rounds: int) -> list[tuple[str, float]]:
    ones = np.ones
    x = ones((1, 16, 4, 4), np.float32)
    conv = prepare_conv2d(ones((8, 16, 1, 1), np.float32), activation="relu")
    squeeze = prepare_conv2d(ones((8, 16, 1, 1), np.float32), activation="relu")
    e1 = prepare_conv2d(ones((16, 8, 1, 1), np.float32), activation="relu")
    e3 = prepare_conv2d(ones((16, 8, 3, 3), np.float32), pads=(1,) * 4, activation="relu")
    plan = prepare_fire(squeeze, e1, e3)
    assert plan.one_call and e3.method == "winograd"

    def conv_by_conv():
        s = conv2d_bias_act(x, squeeze)
        return conv_concat([s, s], plan.expands)

    rows = []
    for threads in (1, 2):
        set_threads(threads)
        rows.append(
            (
                f"1x1 conv call, {threads} thread(s)",
                median_us(lambda: conv2d_bias_act(x, conv), rounds),
            )
        )
        rows.append(
            (
                f"Fire module in one call, {threads} thread(s)",
                median_us(lambda: fire(x, plan), rounds),
            )
        )
        rows.append(
            (f"Fire module conv by conv, {threads} thread(s)", median_us(conv_by_conv, rounds))
        )
    few = max(20, rounds // 20)
    run = lambda: conv2d_bias_act(x, conv)  # noqa: E731
    rows.append(("1x1 conv call after the worker idled 2 ms (main thread busy)",
                 median_us(run, few, lambda: busy(2e-3))))  # fmt: skip
    rows.append(("1x1 conv call after both cores idled 2 ms (sleep)",
                 median_us(run, few, lambda: time.sleep(2e-3))))  # fmt: skip
    # A model's run is such calls back to back, each a few microseconds of Python after the
    # last; after the process slept (a server between requests, a race's pause between turns)
    # the cores' idle states make every wake-up inside the chain slow unless the worker spins
    # through the gaps (GOMP_SPINCOUNT).
    chain = prepare_conv_nchwc(ones((64, 64, 1, 1), np.float32), activation="relu")
    xc = to_blocked(ones((1, 64, 14, 14), np.float32), block=chain.in_block)
    yc = conv_nchwc(xc, chain)

    def fifty():
        for _ in range(50):
            conv_nchwc(xc, chain, out=yc)

    rows.append(("50 blocked 1x1 convs 64->64 14x14 back to back, 2 threads",
                 median_us(fifty, few)))  # fmt: skip
    rows.append(("the same 50 after a 0.25 s sleep",
                 median_us(fifty, max(8, few // 10), lambda: time.sleep(0.25))))  # fmt: skip
    return rows


def crossing(rounds: int) -> list[tuple[str, float]]:
    """a -> Add -> relu(. * s) -> Neg on a 1x3 tensor, threads=1: onnxruntime alone on the
    rewritten model (the fused node through its function body) against fusion.Session, which
    runs island, NumPy kernel, island. Two crossings replace Mul + Relu inside one run."""
    catalog = fusion.Catalog()
    pattern = fusion.op.Relu(fusion.op.Mul(fusion.Var("x"), fusion.Const("s")))

    @fusion.register_pattern("ScaledRelu", pattern, inputs=("x", "s"), catalog=catalog)
    def scaled_relu(x, s):
        return np.maximum(x * s, 0)

    g = GraphBuilder(opset=18)
    y = g.node("Relu", [g.node("Mul", [g.node("Add", ["a", "a"]), g.const(np.float32(2.0))])])
    model = g.model({"a": ["N", 3]}, {g.node("Neg", [y]): None})
    fused = fusion.rewrite(model, catalog).model
    ours = fusion.Session(fused, threads=1, catalog=catalog)
    theirs = inference_session(fused, DEFAULT, threads=1)
    feeds = {"a": np.ones((1, 3), np.float32)}
    timing = interleave(
        {
            "onnxruntime": lambda: theirs.run(None, feeds),
            "fusion.Session": lambda: ours.run(None, feeds),
        },
        rounds,
        warmup=100,
    )
    prof = ours.profile(feeds, repeat=rounds)
    us = {name: timing.median(name) * 1e6 for name in timing.times}
    kernel = prof.total("kernel") * 1e6
    rows = [(f"{name} (island, kernel, island)" if name != "onnxruntime" else
             "onnxruntime alone, the same model", t) for name, t in us.items()]  # fmt: skip
    rows += [("  of which islands", prof.total("island") * 1e6), ("  of which the kernel", kernel),
             ("  of which between steps", prof.overhead * 1e6)]  # fmt: skip
    rows.append(("per crossing: (Session - onnxruntime - kernel) / 2",
                 (us["fusion.Session"] - us["onnxruntime"] - kernel) / 2))  # fmt: skip
    return rows


def model_runs(path: str, rounds: int) -> list[tuple[str, float]]:
    """fusion.Session on a model file, every fused node on its kernel (tactics="kernel"): a
    run back to back with the last, and a run after the process slept 0.25 s."""
    import onnx

    session = fusion.Session(fusion.rewrite(onnx.load(path)).model, tactics="kernel")
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():  # a symbolic dimension (the batch) as 1
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = rng.standard_normal(shape, dtype=np.float32)
    run = lambda: session.run(None, feeds)  # noqa: E731
    name = os.path.basename(path)
    return [(f"{name}: a run back to back", median_us(run, rounds)),
            (f"{name}: a run after a 0.25 s sleep",
             median_us(run, max(8, rounds // 10), lambda: time.sleep(0.25)))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--model", help="also time fusion.Session's runs of this ONNX file")
    args = parser.parse_args()
    rows = kernel_calls(args.rounds) + crossing(args.rounds)
    if args.model:
        rows += model_runs(args.model, max(20, args.rounds // 20))
    width = max(len(name) for name, _ in rows)
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.1f} us")
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(kernels/config.py default)')}")


if __name__ == "__main__":
    main()
