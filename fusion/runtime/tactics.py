"""Choosing how each fused node runs, per input shape and machine, as TensorRT chooses tactics.

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
  on its own body runs in onnxruntime, merged into its neighbours' islands.
- "kernel": the kernel's first tactic, no timing (tests, and users who want the kernels).
- "onnxruntime": every fused node through its body (a baseline).
Choices are cached on disk (TimingCache), keyed by the CPU, the kernels' source, the thread
count, the node's function body and its input shapes: a later process reuses them for free.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from fusion.catalog import Tactic
from fusion.errors import FusionWarning

ONNXRUNTIME = "onnxruntime"  # the tactic every node has: its function body in onnxruntime
POLICIES = ("fastest", "kernel", ONNXRUNTIME)


def tactics_of(kernel) -> list[Tactic]:
    """The tactics a prepared kernel offers: its `.tactics`, or itself as the one NCHW tactic."""
    offered = getattr(kernel, "tactics", None)
    if offered:
        return list(offered)
    return [Tactic("kernel", kernel)]


def policy(value: str | None) -> str:
    """The tactic policy: the argument, else FUSION_TACTICS, else "fastest". Besides POLICIES,
    a tactic name (or its start, e.g. "nchw") means: that tactic wherever a kernel offers one,
    else the kernel's first."""
    chosen = value or os.environ.get("FUSION_TACTICS") or "fastest"
    if not isinstance(chosen, str) or not chosen:
        raise ValueError(f"tactics must be one of {POLICIES} or a tactic name, got {chosen!r}")
    return chosen


def preferred(tactics: list[Tactic], name: str) -> Tactic:
    """The tactic named `name`, else the first whose name starts with it, else the first."""
    exact = next((t for t in tactics if t.name == name), None)
    return exact or next((t for t in tactics if t.name.startswith(name)), tactics[0])


# ---- timing ----------------------------------------------------------------------------------
MIN_CALLS, MAX_CALLS, BUDGET_S = 3, 25, 0.05  # per candidate: at least 3 calls, ~50 ms


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


# ---- the timing cache ------------------------------------------------------------------------
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """FUSION_CACHE_DIR, else $XDG_CACHE_HOME/fusion, else ~/.cache/fusion."""
    if os.environ.get("FUSION_CACHE_DIR"):
        return Path(os.environ["FUSION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusion"


@functools.cache
def source_version(*modules: str) -> str:
    """A hash of the source files of the given packages or modules (a plugin's too): a kernel
    change makes every cached timing of it stale."""
    digest = hashlib.sha1()
    paths = []
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        if getattr(module, "__path__", None):
            paths += [str(p) for d in module.__path__ for p in sorted(Path(d).glob("*.py"))]
        elif module.__file__:
            paths.append(module.__file__)
    for path in paths:
        with contextlib.suppress(OSError):
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class TimingCache:
    """Tactic timings on disk, one JSON file per CPU; safe against concurrent writers (a lock
    file, then read-merge-write and an atomic rename), ignored with a warning when unreadable
    or written on another CPU."""

    cpu: str
    folder: Path = field(default_factory=cache_dir)
    entries: dict = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.folder / f"tactics-{hashlib.sha1(self.cpu.encode()).hexdigest()[:12]}.json"

    def load(self) -> TimingCache:
        self.entries = self._read() or {}
        return self

    def _read(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            warnings.warn(
                f"timing cache {self.path} unreadable ({exc}); ignored", FusionWarning, stacklevel=3
            )
            return None
        try:
            data = json.loads(text)
            if data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError("unknown format")
        except (ValueError, AttributeError) as exc:
            warnings.warn(
                f"timing cache {self.path} is corrupt ({exc}); ignored", FusionWarning, stacklevel=3
            )
            return None
        if data.get("cpu") != self.cpu:
            warnings.warn(
                f"timing cache {self.path} was written on another CPU "
                f"({data.get('cpu')!r}); ignored",
                FusionWarning,
                stacklevel=3,
            )
            return None
        return data["entries"]

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, new: dict) -> None:
        """Add entries and write them, merged with what other processes wrote meanwhile. A
        cache that cannot be written is skipped silently: it only saves time."""
        self.entries.update(new)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / ".tactics.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**(self._read() or {}), **new}
                data = {"format": CACHE_FORMAT, "cpu": self.cpu, "entries": merged}
                fd, tmp = tempfile.mkstemp(prefix=".tactics-", dir=self.folder)
                with os.fdopen(fd, "w") as out:
                    json.dump(data, out, indent=0, sort_keys=True)
                os.replace(tmp, self.path)
                self.entries = merged
        except OSError:
            pass


def plan_key(model_digest: str, shapes: Sequence, threads: int, version: str) -> str:
    """What a whole-plan timing depends on: the fused model without its weights' bytes (a
    digest of its graph, fused nodes and islands), its input shapes, threads, the kernels'
    source."""
    dims = ";".join("-" if s is None else "x".join(map(str, s)) for s in shapes)
    return f"plan:{model_digest}|{dims}|t{threads}|{version}"


def node_key(node: onnx.NodeProto, shapes: Sequence, threads: int, version: str) -> str:
    """What a tactic timing depends on: the node's computation (its function's content hash
    names its body, attributes included), its input shapes, threads, the kernels' source."""
    dims = ";".join("-" if s is None else "x".join(map(str, s)) for s in shapes)
    return f"{node.domain}.{node.op_type}:{node.overload}|{dims}|t{threads}|{version}"
