"""How each fused node may run (its tactics) and the policies that choose among them, per input
shape and machine, as TensorRT chooses tactics; the choosing is fusion/runtime/choice.py's.

A fused node's kernel may offer several ways to compute it (tactics): the blocked-layout kernel,
an NCHW kernel (Winograd, im2col), ... and onnxruntime running the node's own function body is
always one more. A tactic is what the rule's prepare() returned (one plain run function is one
tactic) or one of its `.tactics`:

    Tactic("blocked", run_blocked, blocked_inputs=(0,), blocked_outputs=(0,), out_channels=(64,))

takes input 0 and returns output 0 in the blocked layout (kernels/blocked.py); the session
converts at the borders of blocked regions (fusion/runtime/layout.py).

How a node's tactic is chosen, by the session's `tactics` setting:
- "fastest" (default): each candidate, onnxruntime included, timed on the node's input shapes
  (a few calls each, medians), the fastest kept. A node whose kernel is slower than onnxruntime
  on its own body runs in onnxruntime, merged into its neighbours' islands. A fallback tactic
  (Tactic.fallback: an NCHW kernel beside blocked ones) is a candidate only where every other
  tactic of its kernel failed (first_timed).
- "kernels": each node's fastest kernel tactic, timed as under "fastest" (and cached alike),
  onnxruntime only where every tactic failed, no whole-plan race: what the kernels can do (the
  race's "kernels" candidate; bench/convs.py and forced-kernel model figures).
- "kernel": the kernel's first tactic, no timing (tests, and users who want the kernels).
- "onnxruntime": every fused node through its body (a baseline).
Choices are cached on disk (fusion/runtime/timing_cache.py), keyed by the CPU, the kernels'
source, the thread count, the node's function body and its input shapes: a later process reuses
them for free.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from fusion.catalog import Tactic

ONNXRUNTIME = "onnxruntime"  # the tactic every node has: its function body in onnxruntime
POLICIES = ("fastest", "kernels", "kernel", ONNXRUNTIME)


def tactics_of(kernel) -> list[Tactic]:
    """The tactics a prepared kernel offers: its `.tactics`, or itself as the one NCHW tactic."""
    offered = getattr(kernel, "tactics", None)
    if offered:
        return list(offered)
    return [Tactic("kernel", kernel)]


def first_timed(tactics: list[Tactic]) -> list[Tactic]:
    """The tactics a node's timing tries first, and a cold start compiles before it: all but
    the fallbacks (Tactic.fallback), or all of them where every one is a fallback. The
    fallbacks are timed only where every one of these failed (choice.Chooser.time_tactics)."""
    first = [t for t in tactics if not t.fallback]
    return first or list(tactics)


def policy(value: str | None) -> str:
    """The tactic policy: the argument, else FUSION_TACTICS, else "fastest". Besides POLICIES,
    a tactic name (or its start, e.g. "nchw") means: that tactic wherever a kernel offers one,
    else the kernel's first."""
    chosen = value or os.environ.get("FUSION_TACTICS") or "fastest"
    if not isinstance(chosen, str) or not chosen:
        raise ValueError(f"tactics must be one of {POLICIES} or a tactic name, got {chosen!r}")
    return chosen


def preferred(tactics: list[Tactic], name: str) -> Tactic:
    """The tactic named `name`, else the first whose name starts with it, else the first that is
    not a fallback (first_timed)."""
    exact = next((t for t in tactics if t.name == name), None)
    return exact or next((t for t in tactics if t.name.startswith(name)), first_timed(tactics)[0])


# ---- timing ----------------------------------------------------------------------------------
MIN_CALLS, MAX_CALLS, BUDGET_S = 3, 25, 0.05  # per candidate: at least 3 calls, ~50 ms
TIMING_ROUNDS = 3  # a node's candidates timed in turn, 3 times over (choice.time_tactics)


def time_call(run: Callable[[], object], min_calls: int = MIN_CALLS,
              budget: float = BUDGET_S) -> float:  # fmt: skip
    """Median seconds of run() after one warm-up call: min_calls to MAX_CALLS calls, stopping
    once `budget` seconds have passed."""
    run()
    samples = []
    start = time.perf_counter()
    while len(samples) < MAX_CALLS and (
        len(samples) < min_calls or time.perf_counter() - start < budget
    ):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def tactic_inputs(tactic: Tactic, inputs: Sequence) -> list:
    """`inputs` (NCHW arrays, constants, None) as `tactic` reads them: those at its
    blocked_inputs converted to the blocked layout, at its in_blocks."""
    from fusion_kernels.blocked import to_blocked  # heavy (Numba): only with kernels

    args = list(inputs)
    for k, pos in enumerate(tactic.blocked_inputs):
        args[pos] = to_blocked(args[pos], block=tactic.in_blocks[k])
    return args


def random_inputs(shapes: Sequence, constants: Sequence, seed: int = 0) -> list:
    """Inputs to time a node on: its constants, and standard-normal float32 arrays of `shapes`
    for the rest (None for an absent input)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, const in zip(shapes, constants, strict=True):
        if const is not None:
            out.append(const)
        elif shape is None:
            out.append(None)
        else:
            out.append(rng.standard_normal(shape, dtype=np.float32))
    return out
