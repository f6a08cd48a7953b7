"""What to measure (a Workload) and how (Options)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import numpy as np
import onnx

from fusion.bench.timing import PROCESSES
from fusion.catalog import Catalog
from fusion.registry import default_catalog


@dataclass
class Workload:
    """A model, its inputs, and where its rules come from.

    rules: modules (e.g. "fusion_patterns.fire") whose RULE / RULES join the default catalog; child
    processes rebuild the catalog from these names. catalog: an explicit Catalog instead (child
    measurements, which cannot rebuild it, are then skipped). native: an equivalent model using
    a native onnxruntime op (same inputs and outputs), timed as ort-native.
    """

    name: str
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    rules: tuple[str, ...] = ()
    catalog: Catalog | None = None
    native: onnx.ModelProto | None = None
    description: str = ""
    plugins: tuple[str, ...] = ()  # `--plugin` files, loaded again in child processes
    batch: int | None = None  # items per run, for throughput (None: the first input's axis 0)

    def resolved_catalog(self) -> Catalog:
        return self.catalog if self.catalog is not None else catalog_with(self.rules)

    def items(self) -> int:
        """Items per run: `batch`, else the first input's first axis (1 for a scalar)."""
        if self.batch is not None:
            return self.batch
        first = next(iter(self.feeds.values()), None)
        return int(first.shape[0]) if first is not None and first.ndim else 1


@dataclass
class Options:
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    rounds: int = 20  # at most this many timed rounds
    min_rounds: int = 5  # at least this many, even past the budget
    budget: float = 6.0  # seconds of timed rounds, after which no new round starts
    warmup: int = 2  # untimed calls per runner first
    repeat: int = 3  # calls per turn, back to back, each timed
    warm: float = 0.05  # seconds of untimed calls first in each turn (fusion.bench.timing)
    gap: float = 0.0  # seconds of sleep before each timed call (0: back to back)
    mode: str = PROCESSES  # PROCESSES (each runner in its own process) or SAME_PROCESS (quick)
    profile: bool = True  # the fused run step by step: kernels, islands, between
    nodes: bool = True  # each fused node alone against its function body in onnxruntime
    node_rounds: int = 5  # rounds of that comparison
    runners: tuple[str, ...] | None = None  # which runners (None: all that apply)
    sgemm: bool = True  # numpy's SGEMM on the heaviest GEMM shape, the GFLOP/s reference
    memory: bool = True  # peak RSS per runner, in a child process
    compile: bool = True  # Numba compile time, cold and cached, in child processes
    rtol: float | None = None  # None: the loosest of the fused rules' tolerances
    atol: float | None = None


def catalog_with(modules=()) -> Catalog:
    """The default catalog plus the RULE / RULES of each named module not already in it."""
    catalog = default_catalog()
    for module in modules:
        mod = importlib.import_module(module)
        for rule in getattr(mod, "RULES", None) or [mod.RULE]:
            if rule.name not in catalog:
                catalog.add(rule)
    return catalog
