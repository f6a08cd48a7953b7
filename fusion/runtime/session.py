"""Running a fused model: kernels for fused nodes, onnxruntime for everything else.

    sess = Session("model.onnx", threads=4)      # an original model is fused in memory first
    (y,) = sess.run(None, {"x": x})
    print(sess.profile({"x": x}))                # time per island, per kernel, and in between

The model is cut into steps once, when the session is built (fusion/runtime/plan.py, steps.py):
islands (groups of standard nodes, one onnxruntime session each) and kernel calls. A run is
then a loop over the steps reading and writing one dict of values; each value is dropped after
its last reader, as onnxruntime frees its activations. Each crossing between an island and a
kernel costs an extra onnxruntime run of a small island (`python bench/overheads.py`).

This module is the InferenceSession-style front: the kernels are built by
fusion/runtime/kernel.py, how each node and the whole plan run is chosen by
fusion/runtime/choice.py, the feeds are checked by fusion/runtime/feed_checks.py.

Session.run keeps no per-run state on the session, so it may be called from several threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from fusion.catalog import Catalog
from fusion.graph import node_label
from fusion.modelfile import as_model
from fusion.registry import default_catalog
from fusion.rewriter import rewrite
from fusion.runtime.choice import Chooser, PlanTable, cached_races, describe_race
from fusion.runtime.feed_checks import FeedCheck, InvalidFeed, NodeArg, node_arg
from fusion.runtime.kernel import BuiltKernels, Progress, build_kernels
from fusion.runtime.plan import is_fused
from fusion.runtime.steps import IslandStep, RunPlan, assemble, known_values
from fusion.runtime.tactics import policy

__all__ = ["InvalidFeed", "NodeArg", "Profile", "Session", "cached_races", "describe_race",
           "is_fused"]  # fmt: skip


class Session:
    """An InferenceSession look-alike that runs fused nodes with their kernels.

    threads: used by both onnxruntime (intra-op) and Numba; None means os.cpu_count().
    fuse: rewrite an original model (one without fused nodes) in memory first.
    progress: called as progress(node label, i, total) before kernel i of total is built
    (building a kernel may compile it, which can take seconds on first use).
    tactics: how each fused node runs (fusion/runtime/tactics.py): "fastest" (default, or the
    FUSION_TACTICS environment variable): its kernel's tactics and onnxruntime timed on the
    node's shapes, the fastest kept (cached on disk), the whole plan raced; "kernels": each
    node's fastest kernel tactic, timed alike, never onnxruntime, not raced; "kernel": the
    kernel's first tactic, untimed; "onnxruntime": every node through its function body.
    retime: time and race again what the timing cache already answers (fusion tune --force).
    """

    def __init__(
        self,
        model_or_path: onnx.ModelProto | str | Path,
        threads: int | None = None,
        fuse: bool = True,
        catalog: Catalog | None = None,
        progress: Progress | None = None,
        tactics: str | None = None,
        retime: bool = False,
    ):
        model = as_model(model_or_path)
        if fuse and not is_fused(model):
            model = rewrite(model, catalog).model
        if catalog is None and is_fused(model):
            catalog = default_catalog()
        chosen = policy(tactics)
        threads = max(1, threads or os.cpu_count() or 1)
        self._start(build_kernels(model, catalog or Catalog(), threads, progress), chosen, retime)

    def _start(self, built: BuiltKernels, tactics: str, retime: bool) -> None:
        """Open the session on these kernels under this policy: its default plan is made (timed
        and raced, under "fastest") here."""
        self._built, self.tactics = built, tactics
        self.model, self.view, self.catalog = built.model, built.view, built.catalog
        self.threads = built.threads
        self._feeds = feeds = FeedCheck(built.view)
        self._base = known_values(built.view, feeds.outputs)

        def build(choices: dict) -> RunPlan:
            return assemble(built, feeds.outputs, choices)

        chooser = Chooser(built, tactics, retime, feeds, self._base, build, RunPlan.run)
        self._plans = PlanTable(chooser)

    def with_tactics(self, tactics: str) -> Session:
        """A Session on this one's kernels (built once, weights packed once) that runs them
        under another untimed policy: "kernel", "onnxruntime" or a tactic name. fusion.verify
        runs each tactic a kernel offers this way."""
        chosen = policy(tactics)
        if chosen in ("fastest", "kernels"):
            raise ValueError(f"with_tactics takes an untimed policy, not {chosen!r}")
        other = object.__new__(type(self))
        other._start(self._built, chosen, retime=False)
        return other

    # ---- what runs ---------------------------------------------------------------------------
    @property
    def steps(self) -> list:
        """The run steps of the default plan (islands, kernels, conversions)."""
        return self._plans.default.plan.steps

    @property
    def releases(self) -> list:
        return self._plans.default.plan.releases

    @property
    def islands(self) -> list[IslandStep]:
        return [s for s in self.steps if s.kind == "island"]

    @property
    def choices(self) -> dict[str, str]:
        """Per fused node (its label), the tactic it runs in the default plan."""
        return dict(self._plans.default.plan.choices)

    @property
    def offered(self) -> dict[str, list[str]]:
        """Per fused node that a kernel runs (its label), the names of its kernel's tactics,
        first the one tactics="kernel" takes."""
        nodes = self.view.nodes
        return {node_label(nodes[i]): [t.name for t in tactics]
                for i, tactics in self._built.tactics.items()}  # fmt: skip

    @property
    def race(self) -> dict | None:
        """How the default plan was chosen: {"chosen": "per-node" | "kernels" | "nchw" |
        "onnxruntime", "seconds": each candidate's time (the least disturbed of its rounds),
        "noise", "decided" (False: the simplest plan within the noise was kept), "load" (other
        processes' cores), "busy" (raced under load: provisional), "cached"}; None when not raced
        (tactics other than "fastest", nothing to fuse, or no run yet on a model with non-float
        inputs)."""
        return self._plans.default.race

    def race_for(self, feeds: Mapping) -> dict | None:
        """How the plan for these feeds' shapes was chosen (see `race`)."""
        return self._plans.for_values(self._feeds.validated(feeds)).race

    def steps_for(self, feeds: Mapping) -> list:
        """The steps a run on these feeds takes (their shapes may have a plan of their own)."""
        return self._plans.for_values(self._feeds.validated(feeds)).plan.steps

    def choices_for(self, feeds: Mapping) -> dict[str, str]:
        """Per fused node (its label), the tactic a run on these feeds uses."""
        return dict(self._plans.for_values(self._feeds.validated(feeds)).plan.choices)

    # ---- the InferenceSession interface ------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [spec.node_arg for spec in self._feeds.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [node_arg(o.name, self.view.type_of(o.name)) for o in self.model.graph.output]

    def run(self, output_names, feeds: Mapping, run_options=None) -> list[np.ndarray]:
        """Like InferenceSession.run (run_options is accepted and ignored)."""
        names = self._feeds.output_list(output_names)
        values = self.execute(feeds)
        return [_fresh(values[n], n in self._base) for n in names]

    def run_with_intermediates(self, feeds: Mapping) -> dict[str, np.ndarray]:
        """Every value passed between steps (so every fused node's inputs and outputs), the feeds,
        constants and graph outputs, by name; values inside an island are not seen."""
        return self.execute(feeds, keep_all=True)

    def execute(self, feeds: Mapping, times: list | None = None, keep_all: bool = False) -> dict:
        """One run; returns the values it holds at the end: the graph outputs and whatever no
        step released (keep_all: every value, each also in NCHW under its own name). times,
        when given, gets each step's seconds."""
        values = dict(self._base)
        values.update(self._feeds.validated(feeds))
        return self._plans.run(values, times, keep_all)

    def profile(self, feeds: Mapping, repeat: int = 10, warmup: int = 1) -> Profile:
        """Mean time per step over `repeat` runs, and the time spent between steps. The runs
        call each step (a plain run of a kernel-only plan replays its steps' bound calls
        instead, ~1 us a step less: RunPlan._record)."""
        for _ in range(warmup):
            self.execute(feeds)
        checked = self._feeds.validated(feeds)
        plan = self._plans.for_values(checked).plan  # one plan throughout, whatever is re-raced
        steps = plan.steps
        step_times = [0.0] * len(steps)
        wall = 0.0
        for _ in range(repeat):
            times: list[float] = []
            values = self._base | checked
            start = time.perf_counter()
            self._plans.chooser.run(plan, values, times)
            wall += time.perf_counter() - start
            step_times = [a + b for a, b in zip(step_times, times, strict=True)]
        rows = [(s.kind, s.name, t / repeat) for s, t in zip(steps, step_times, strict=True)]
        return Profile(rows, wall / repeat)


@dataclass
class Profile:
    """Mean seconds per step of a run, and the run's wall time; the rest is crossing overhead."""

    steps: list[tuple[str, str, float]]  # (kind, name, seconds)
    wall: float

    def total(self, kind: str) -> float:
        return sum(t for k, _, t in self.steps if k == kind)

    @property
    def overhead(self) -> float:
        """Time between steps: feed checks, dict bookkeeping, Python calls."""
        return self.wall - self.total("island") - self.total("kernel") - self.total("convert")

    def to_dict(self) -> dict:
        return {
            "steps": [{"kind": k, "name": n, "seconds": t} for k, n, t in self.steps],
            "island_seconds": self.total("island"),
            "kernel_seconds": self.total("kernel"),
            "convert_seconds": self.total("convert"),
            "overhead_seconds": self.overhead,
            "wall_seconds": self.wall,
        }

    def __str__(self) -> str:
        width = max([len(n) for _, n, _ in self.steps] + [8])
        lines = [f"{'kind':<7} {'step':<{width}} {'us':>10}"]
        lines += [f"{k:<7} {n:<{width}} {t * 1e6:>10.1f}" for k, n, t in self.steps]
        lines.append(f"{'':<7} {'between':<{width}} {self.overhead * 1e6:>10.1f}")
        lines.append(f"{'':<7} {'total':<{width}} {self.wall * 1e6:>10.1f}")
        return "\n".join(lines)


def _fresh(value: np.ndarray, shared: bool) -> np.ndarray:
    """Build-time values are shared between runs: hand the caller a copy it may modify."""
    return value.copy() if shared else value
