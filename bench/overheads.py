"""Fixed costs of a kernel call, on inputs so small that the arithmetic is negligible: the
Python and Numba dispatch around a conv call, a Fire module in one compiled call vs conv by conv
(the path plans outside the usual ones take), and how late a parallel region starts when its
worker thread has been idle (a busy main thread) or both cores have (a sleep).

    .venv/bin/python bench/overheads.py [--rounds 2000]

Medians in microseconds. The worker's spinning after a region is set by GOMP_SPINCOUNT (see
kernels/config.py); run with GOMP_SPINCOUNT=0 to see the cost without it.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402

from kernels import conv2d_bias_act, prepare_conv2d, set_threads  # noqa: E402
from kernels.conv_concat import conv_concat  # noqa: E402
from kernels.fire import fire, prepare_fire  # noqa: E402


def median_us(call, rounds, before=None):
    call()
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
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
                median_us(lambda: conv2d_bias_act(x, conv), args.rounds),
            )
        )
        rows.append(
            (
                f"Fire module in one call, {threads} thread(s)",
                median_us(lambda: fire(x, plan), args.rounds),
            )
        )
        rows.append(
            (f"Fire module conv by conv, {threads} thread(s)", median_us(conv_by_conv, args.rounds))
        )
    few = max(20, args.rounds // 20)
    run = lambda: conv2d_bias_act(x, conv)  # noqa: E731
    rows.append(("1x1 conv call after the worker idled 2 ms (main thread busy)",
                 median_us(run, few, lambda: busy(2e-3))))  # fmt: skip
    rows.append(("1x1 conv call after both cores idled 2 ms (sleep)",
                 median_us(run, few, lambda: time.sleep(2e-3))))  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.1f} us")
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(kernels/config.py default)')}")


if __name__ == "__main__":
    main()
