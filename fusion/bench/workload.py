"""What to measure (a Workload) and how (Options)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import numpy as np
import onnx

from fusion.catalog import Catalog
from fusion.registry import default_catalog


@dataclass
class Workload:
    """A model, its inputs, and where its rules come from.

    rules: modules (e.g. "patterns.fire") whose RULE / RULES join the default catalog; child
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

    def resolved_catalog(self) -> Catalog:
        return self.catalog if self.catalog is not None else catalog_with(self.rules)


@dataclass
class Options:
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    rounds: int = 20  # at most this many timed rounds
    min_rounds: int = 5  # at least this many, even past the budget
    budget: float = 6.0  # seconds of timed rounds, after which no new round starts
    warmup: int = 2
    profile: bool = True  # kernel / island / crossing split of the fused run
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
