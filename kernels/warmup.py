"""Compile every kernel path ahead of use, several at once, into Numba's on-disk cache.

Numba compiles a kernel on its first call and, with cache=True, stores the machine code in
kernels/__pycache__ (or NUMBA_CACHE_DIR) for later processes. A first call costs seconds of CPU
per path (bench/NOTES.md), and a process compiles its paths one after another.
Here each group of paths compiles in its own process, `jobs` at a time, by calling the public
wrappers on tiny inputs: the same argument types as real use, so the cached signatures are the
ones later calls look up (a fresh output array and a channel slice of a bigger one differ, but
with batch 1 a channel slice is contiguous: the slice case runs at batch 2).

    python -m fusion_kernels.warmup [--jobs 2]      # e.g. in a deployment image, or before tests

A group that fails prints its error and makes the command exit non-zero. Concurrent saves into
Numba's cache are serialized by a file lock (kernels/_cache.py, serialize_saves), as in every
process that imports the kernels. Each group imports its kernel modules itself: the parent
process that starts the groups compiles nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _conv(weight_shape, x_shape, **kwargs):
    from .conv2d import conv2d_bias_act, output_shape, prepare_conv2d

    rng = np.random.default_rng(0)
    plan = prepare_conv2d(rng.standard_normal(weight_shape, dtype=np.float32), **kwargs)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    conv2d_bias_act(x, plan)  # a fresh output array
    x2 = rng.standard_normal((2, *x_shape[1:]), dtype=np.float32)
    n, m, oh, ow = output_shape(x2.shape, plan)[0]  # a channel slice (Fire's branch outputs)
    conv2d_bias_act(x2, plan, out=np.empty((n, m + 2, oh, ow), np.float32)[:, 1 : m + 1])


def _im2col():
    _conv((8, 16, 1, 1), (1, 16, 9, 9))  # 1x1: panels copied
    _conv((8, 16, 3, 3), (1, 16, 9, 9), strides=(2, 2))  # general: panels gathered


def _winograd():
    _conv((8, 16, 3, 3), (1, 16, 9, 9), pads=(1, 1, 1, 1))


def _winograd4():
    _conv((8, 16, 3, 3), (1, 16, 9, 9), pads=(1, 1, 1, 1), winograd_tile=4)


def _depthwise():
    _conv((16, 1, 3, 3), (1, 16, 9, 9), pads=(1, 1, 1, 1), group=16)


def _fire():
    from .conv2d import prepare_conv2d
    from .fire import fire, prepare_fire

    rng = np.random.default_rng(0)
    for squeeze in (8, 4):  # the 3x3 expand by Winograd (>= 8 channels), by im2col
        sq, e1 = (
            rng.standard_normal(s, dtype=np.float32)
            for s in [(squeeze, 6, 1, 1), (5, squeeze, 1, 1)]
        )
        e3 = rng.standard_normal((7, squeeze, 3, 3), dtype=np.float32)
        plan = prepare_fire(prepare_conv2d(sq), prepare_conv2d(e1),
                            prepare_conv2d(e3, pads=(1, 1, 1, 1)))  # fmt: skip
        for batch in (1, 2):  # at batch 2 the expands' outputs are non-contiguous slices
            x = rng.standard_normal((batch, 6, 7, 7), dtype=np.float32)
            fire(x, plan)
            fire(x, plan, out=np.empty((batch, 14, 7, 7), np.float32)[:, 1:-1])


def _lstm():
    from .lstm import lstm_cell, lstm_sequence, prepare_lstm

    rng = np.random.default_rng(0)
    # Serial and parallel (above SERIAL_MACS_PER_STEP) forms, batch 1 and the batched layout.
    for batch, size, hidden in ((1, 12, 20), (1, 200, 64), (3, 12, 20), (16, 12, 20), (16, 32, 64)):
        x = rng.standard_normal((4, batch, size), dtype=np.float32)
        h = rng.standard_normal((batch, hidden), dtype=np.float32)
        plan = prepare_lstm(
            rng.standard_normal((size, 4 * hidden), dtype=np.float32),  # x W: [I, 4H]
            rng.standard_normal((hidden, 4 * hidden), dtype=np.float32),  # h R: [H, 4H]
            rng.standard_normal(4 * hidden, dtype=np.float32),
        )
        lstm_sequence(x, h, h.copy(), plan)
        lstm_cell(x[0], h, h.copy(), plan)


def _gru():
    """The GRU with the reset before the recurrent product (two stages per step); with it
    after, the GRU runs the LSTM group's kernels."""
    from .gru import gru_sequence, prepare_gru

    rng = np.random.default_rng(0)
    for batch, size, hidden in ((1, 12, 20), (1, 200, 64), (3, 12, 20)):
        x = rng.standard_normal((4, batch, size), dtype=np.float32)
        h = rng.standard_normal((batch, hidden), dtype=np.float32)
        wx = rng.standard_normal((size, 3 * hidden), dtype=np.float32)
        wh = rng.standard_normal((hidden, 3 * hidden), dtype=np.float32)
        gru_sequence(x, h, prepare_gru(wx, wh, None, None, linear_before_reset=0))


def _pool():
    from .blocked import block, to_blocked
    from .conv_nchwc import prepare_conv_nchwc
    from .pool import global_average_pool, maxpool2d, maxpool_blocked, prepare_maxpool
    from .simd.activation import encode
    from .squeeze_excite import gated_weights, prepare_squeeze_excite, squeeze_excite_blocked

    x = np.random.default_rng(0).standard_normal((1, 3, 9, 9), dtype=np.float32)
    maxpool2d(x, prepare_maxpool((3, 3), (2, 2), ceil_mode=True))
    maxpool_blocked(to_blocked(x, block=block()), prepare_maxpool((3, 3), (2, 2), ceil_mode=True))
    global_average_pool(x)
    w = np.ones((2, 3), np.float32)
    se = prepare_squeeze_excite(w, None, w.T, None, encode("relu"), encode("sigmoid"))
    conv = prepare_conv_nchwc(np.ones((4, 3, 1, 1), np.float32), in_block=block())
    for one_region in (False, True):
        squeeze_excite_blocked(to_blocked(x, block=block()), se, one_region=one_region)
        gated_weights(to_blocked(x, block=block()), se, conv, one_region)  # the gate folded


def _pointwise():
    from .blocked import block, to_blocked
    from .pointwise import pointwise, pointwise_blocked, prepare_pointwise

    x = np.random.default_rng(0).standard_normal((1, 8, 3, 3), dtype=np.float32)
    plan = prepare_pointwise(8, activation="silu", residual="after")  # one loop for every kind
    pointwise(x, plan, residual=x)
    xb = to_blocked(x, block=block())  # the process's block, as the runtime converts to
    pointwise_blocked(xb, plan, residual=xb)


def _blocked_conv(fb):
    """The blocked direct conv with fb output blocks per tile, at the tallest tile (rows wide
    enough for it: conv_nchwc.tile_rows), from whole input blocks and from a 3-channel input."""

    def compile_group():
        from .blocked import to_blocked
        from .conv_nchwc import conv_nchwc, prepare_conv_nchwc
        from .simd import width

        rng = np.random.default_rng(0)
        for c in (width(), 3):
            w = rng.standard_normal((fb * width(), c, 3, 3), dtype=np.float32)
            plan = prepare_conv_nchwc(w, pads=(1, 1, 1, 1), activation="relu", tile=fb)
            x = rng.standard_normal((1, c, 2, 62), dtype=np.float32)
            conv_nchwc(to_blocked(x, block=plan.in_block), plan)

    return compile_group


def _blocked_winograd(fb):
    """The blocked Winograd kernel (F(2x2) and F(4x4) share it) at this CPU's width, on the
    register tile of fb output blocks: a 3x3 stride-1 conv's race times it beside the direct
    kernel."""

    def compile_group():
        from .blocked import to_blocked
        from .simd import width
        from .winograd_nchwc import prepare_winograd_nchwc, winograd_nchwc

        rng = np.random.default_rng(0)
        w = rng.standard_normal((fb * width(), width(), 3, 3), dtype=np.float32)
        plan = prepare_winograd_nchwc(w, pads=(1, 1, 1, 1), activation="relu", fb=fb)
        x = rng.standard_normal((1, width(), 6, 6), dtype=np.float32)
        winograd_nchwc(to_blocked(x, block=plan.block), plan)

    return compile_group


def _transformer():
    """The dense GEMM with its epilogues (a clip kind, another, a residual), the gated block,
    (skip) LayerNorm and RMSNorm."""
    from .dense_gemm import prepare_dense
    from .layernorm import SERIAL_MAX, layer_norm
    from .linear_act import gated_mlp, linear_act, prepare_gated_mlp
    from .simd.activation import encode

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8), dtype=np.float32)
    w, b = rng.standard_normal((8, 16), dtype=np.float32), np.zeros(16, np.float32)
    for act in (encode(), encode("gelu")):  # every kind takes one of these two paths
        linear_act(x, prepare_dense(w, b, act), residual=np.ones((6, 16), np.float32))
    linear_act(x[:1], prepare_dense(w, b))  # one row (a CNN's head at batch 1): its own tile
    gated_mlp(x, prepare_gated_mlp(w, b, encode("silu"), w[:, :8].T.copy(), b[:8]))
    g = np.ones(8, np.float32)
    layer_norm(x, g, g, 1e-5)
    layer_norm(x, g, None, 1e-5, rms=True)
    layer_norm(x, g, g, 1e-5, residual=x, return_sum=True)
    long = np.zeros((1, SERIAL_MAX + 1), np.float32)  # the parallel driver
    layer_norm(long, long[0], long[0], 1e-5)


def _attention():
    from .attention import attention
    from .dense_gemm import prepare_dense

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 16), dtype=np.float32)
    w_qkv = rng.standard_normal((16, 48), dtype=np.float32)
    w_out, b = rng.standard_normal((16, 16), dtype=np.float32), np.zeros(48, np.float32)
    qkv, out = prepare_dense(w_qkv, b), prepare_dense(w_out, b[:16])
    mask = np.zeros((2, 1, 1, 5), np.float32)
    for m in (None, mask):
        attention(x, qkv, 2, 2, 0.25, out, m, x)


def _blocked_depthwise():
    from .blocked import to_blocked
    from .conv_nchwc import conv_nchwc, prepare_conv_nchwc

    rng = np.random.default_rng(0)
    plan = prepare_conv_nchwc(rng.standard_normal((8, 1, 3, 3), dtype=np.float32), group=8,
                              pads=(1, 1, 1, 1), activation="relu")  # fmt: skip
    x = rng.standard_normal((1, 8, 6, 7), dtype=np.float32)
    conv_nchwc(to_blocked(x, block=plan.in_block), plan)


def _inverted_residual():
    """The depth-first inverted residual at this CPU's width: its driver (compiled once) and the
    tallest tiles of its 1x1 convs, the direct kernel's own: expands of 4 and 2 output blocks
    per tile and none (expansion 1, the depthwise conv reading x), projections of 4, 2 and 1,
    and the block without its projection."""
    from .blocked import to_blocked
    from .inverted_residual import inverted_residual, prepare_inverted_residual
    from .simd import width

    rng = np.random.default_rng(0)
    b = width()

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    for fb_e in (4, 2, 0):
        c, e = (b, fb_e * b) if fb_e else (2 * b, 2 * b)  # E in fb_e blocks: tiles of fb_e
        for m in (4 * b, 2 * b, b):
            plan = prepare_inverted_residual(w(e, c, 1, 1) if fb_e else None, w(e),
                                             w(e, 1, 3, 3), w(e), w(m, e, 1, 1), w(m),
                                             acts=(("relu",), ("relu",), None))  # fmt: skip
            inverted_residual(to_blocked(w(1, c, 5, 5), block=b), plan)
        if fb_e:  # the block stopping at d (ExpandDepthwise): the same driver and expand tiles
            plan = prepare_inverted_residual(w(e, c, 1, 1), w(e), w(e, 1, 3, 3), w(e), None, None,
                                             acts=(("relu",), ("relu",)))  # fmt: skip
            inverted_residual(to_blocked(w(1, c, 5, 5), block=b), plan)


def _preact_conv():
    """The pre-activated 1x1 conv at this CPU's width: its driver (compiled once) and the
    tallest tiles of 4, 2 and 1 output blocks (the inverted residual's projections share them)."""
    from .blocked import to_blocked
    from .preact_conv import preact_conv, prepare_preact_conv
    from .simd import width

    rng = np.random.default_rng(0)
    b = width()
    s, t = rng.standard_normal((2, 2 * b), dtype=np.float32)
    for m in (4 * b, 2 * b, b):
        w = rng.standard_normal((m, 2 * b, 1, 1), dtype=np.float32)
        plan = prepare_preact_conv(s, t, w, None, norm_act={"activation": "relu"})
        preact_conv(to_blocked(rng.standard_normal((1, 2 * b, 5, 5), dtype=np.float32)), plan)


def _blocked_layout():
    from .blocked import from_blocked, to_blocked

    x = np.random.default_rng(0).standard_normal((1, 3, 5, 5), dtype=np.float32)
    from_blocked(to_blocked(x), 3)


TIMEOUT_S = 1800  # per group: a compile that hangs must not hang the test run

GROUPS = {
    "im2col": _im2col,
    "winograd": _winograd,
    "winograd4": _winograd4,
    "depthwise": _depthwise,
    "lstm": _lstm,
    "gru": _gru,
    "pool": _pool,
    "pointwise": _pointwise,
    "blocked_layout": _blocked_layout,
    "blocked_conv_f4": _blocked_conv(4),
    "blocked_conv_f2": _blocked_conv(2),
    "blocked_conv_f1": _blocked_conv(1),
    "blocked_winograd_f4": _blocked_winograd(4),
    "blocked_winograd_f2": _blocked_winograd(2),
    "blocked_winograd_f1": _blocked_winograd(1),
    "transformer": _transformer,
    "attention": _attention,
    "blocked_depthwise": _blocked_depthwise,
    "inverted_residual": _inverted_residual,
    "preact_conv": _preact_conv,
    "fire": _fire,  # last: with 2 jobs, im2col and winograd are usually cached by then
}


def warm_up(jobs: int = 2, groups=None) -> dict[str, float]:
    """Compile the given groups (all by default), `jobs` processes at a time; returns each
    group's wall seconds. Raises RuntimeError naming the groups that failed."""
    names = list(GROUPS) if groups is None else list(groups)
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown warm-up groups {unknown}; known: {sorted(GROUPS)}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")

    def one(name):
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "fusion_kernels.warmup", "--group", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
            code, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired:
            code, err = -1, f"no result after {TIMEOUT_S} s"
        return name, time.perf_counter() - start, code, err

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(one, names))
    failed = [(name, err) for name, _, code, err in results if code]
    if failed:
        # the whole error (a Numba typing error ends in a line that says nothing by itself)
        tails = ["\n".join(err.strip().splitlines()[-40:]) for _, err in failed]
        raise RuntimeError(
            f"kernel warm-up failed in {', '.join(name for name, _ in failed)}:\n"
            + "\n\n".join(tails)
        )
    return {name: seconds for name, seconds, _, _ in results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion_kernels.warmup", description=__doc__)
    parser.add_argument("--jobs", type=int, default=2, help="processes at once (default 2)")
    parser.add_argument("--group", choices=sorted(GROUPS), help="compile one group, here")
    args = parser.parse_args(argv)
    if args.group:
        GROUPS[args.group]()
        return 0
    try:
        times = warm_up(args.jobs)
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
