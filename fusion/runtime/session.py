"""Running a fused model: kernels for fused nodes, onnxruntime for everything else.

    sess = Session("model.onnx", threads=4)      # an original model is fused in memory first
    (y,) = sess.run(None, {"x": x})
    print(sess.profile({"x": x}))                # time per island, per kernel, and in between

The model is cut into steps once, when the session is built (fusion/runtime/plan.py, steps.py):
islands (groups of standard nodes, one onnxruntime session each) and kernel calls. A run is
then a loop over the steps reading and writing one dict of values; each value is dropped after
its last reader, as onnxruntime frees its activations. Each crossing between an island and a
kernel costs an extra onnxruntime run of a small island (`python bench/overheads.py`).

Session.run keeps no per-run state on the session, so it may be called from several threads.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from fusion.catalog import DOMAIN, Catalog, Tactic
from fusion.errors import FusionWarning
from fusion.functions import single_node_model
from fusion.graph import GraphView, ValueType, node_label
from fusion.modelfile import as_model, weightless_copy
from fusion.ort import ISLAND, inference_session
from fusion.registry import default_catalog
from fusion.rewriter import rewrite
from fusion.runtime.feed_checks import FeedCheck, InvalidFeed, NodeArg, node_arg
from fusion.runtime.kernel import (
    BuiltKernels,
    Progress,
    build_kernels,
    ensure_threads,
    is_built_in,
)
from fusion.runtime.race import Verdict, agrees, race
from fusion.runtime.steps import IslandStep, RunPlan, assemble, known_values
from fusion.runtime.tactics import (
    ONNXRUNTIME,
    policy,
    preferred,
    random_inputs,
    time_call,
)
from fusion.runtime.timing_cache import PLAN, TimingCache, node_key, plan_key, timing_version

__all__ = ["InvalidFeed", "NodeArg", "Profile", "Session"]


def is_fused(model: onnx.ModelProto) -> bool:
    return any(node.domain == DOMAIN for node in model.graph.node)


# What each whole-plan candidate (Session._settle) is, for people.
PLAN_NAMES = {"per-node": "each node's fastest", "nchw": "NCHW tactics only",
              ONNXRUNTIME: "onnxruntime alone"}  # fmt: skip


def describe_race(race: dict | None) -> str:
    """One line for a whole-plan race (Session.race): the plan run, why, every candidate's
    time, and whether the race ran under load (its answer then provisional)."""
    if race is None:
        return "no race (no fused node runs a kernel)"
    name = PLAN_NAMES.get
    times = ", ".join(f"{name(k, k)} {v * 1e3:.3g} ms" for k, v in race["seconds"].items())
    if race.get("decided", True):
        why = "the fastest"
    else:
        why = f"the simplest within the {race['noise']:.0%} noise of the fastest"
    load = "" if race.get("load") is None else f"; other processes used {race['load']:.2f} cores"
    busy = "; raced under load: provisional, raced again on a quiet run" if race.get("busy") else ""
    cached = "; from the timing cache" if race.get("cached") else ""
    return f"runs {name(race['chosen'], race['chosen'])}, {why} ({times}{load}{busy}{cached})"


def skeleton_digest(model: onnx.ModelProto) -> str:
    """What a whole-plan timing depends on in a fused model: its graph, fused nodes and islands
    without the weights' bytes (the first field of its plan_key)."""
    return hashlib.sha1(weightless_copy(model).SerializeToString()).hexdigest()[:16]


def cached_races(model: onnx.ModelProto | None = None, catalog: Catalog | None = None) -> list:
    """The whole-plan verdicts the timing cache holds on this CPU, for one model (fused here
    first if it is not) or all: (plan key, Session.race's dict, Unix time it was written),
    newest first. Builds no kernel."""
    from kernels.machine import cpu_key  # heavy package: only with kernels

    cache = TimingCache(cpu_key(), version=timing_version()).load()
    start = PLAN
    if model is not None:
        fused = model if is_fused(model) else rewrite(model, catalog).model
        start += skeleton_digest(fused) + "|"
    found = [
        (key, _race_dict(Verdict.from_entry(entry), cached=True), entry.get("written", 0))
        for key, entry in cache.entries.items()
        if key.startswith(start)
    ]
    return sorted(found, key=lambda row: -row[2])


class Session:
    """An InferenceSession look-alike that runs fused nodes with their kernels.

    threads: used by both onnxruntime (intra-op) and Numba; None means os.cpu_count().
    fuse: rewrite an original model (one without fused nodes) in memory first.
    progress: called as progress(node label, i, total) before kernel i of total is built
    (building a kernel may compile it, which can take seconds on first use).
    tactics: how each fused node runs (fusion/runtime/tactics.py): "fastest" (default, or the
    FUSION_TACTICS environment variable): its kernel's tactics and onnxruntime timed on the
    node's shapes, the fastest kept (cached on disk); "kernel": the kernel, untimed;
    "onnxruntime": every node through its function body.
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
        """The session's plans on these kernels under this policy (the default one timed and
        raced, under "fastest")."""
        self._built = built
        self.model, self.view, self.catalog = built.model, built.view, built.catalog
        self.threads = built.threads
        view = self.view
        self._feeds = FeedCheck(view)
        self._inputs, self._output_names = self._feeds.inputs, self._feeds.outputs
        self._functions = built.functions
        self.tactics = tactics
        self._retime = retime
        self._kernels = built.tactics
        self._lock = threading.Lock()
        self._cache: TimingCache | None = None
        # The plan for the shapes the model declares; with symbolic input dims (a batch axis)
        # and timed choices, each new feed shape gets its own plan on its first run.
        shapes = {v: s for v in view.producer | dict.fromkeys(view.graph_inputs)
                  if (s := _static_shape(view.type_of(v))) is not None}  # fmt: skip
        self._dynamic = self.tactics == "fastest" and any(
            _static_shape(view.type_of(v)) is None for v in view.graph_inputs
        )
        self._plans: dict[tuple, RunPlan] = {}
        self._base = known_values(view, self._output_names)
        self._shapes = shapes
        self._unsettled = False  # the default plan waits for a first run's feeds to be raced
        if self._dynamic:
            self._default = self._plan(self._choose({}))  # kernels until shapes are known
        elif self.tactics != "fastest" or not self._kernels:
            self._default = self._plan(self._choose(shapes))
        else:
            feeds = self._random_feeds(shapes)
            self._unsettled = feeds is None
            self._default = (
                self._plan(self._choose(shapes)) if feeds is None else self._settle(shapes, feeds)
            )

    def _choose(self, shapes: dict, nchw_only: bool = False) -> dict[int, Tactic | None]:
        """Per fused node with a kernel, the tactic it runs (None: its body in onnxruntime):
        by the session's policy, timing each candidate where the node's input shapes are known
        (`shapes`: value -> shape) and the timing cache has no answer yet. nchw_only: among
        the tactics that read and write plain NCHW arrays (no layout conversions)."""
        if self.tactics == ONNXRUNTIME:
            return dict.fromkeys(self._kernels)
        if self.tactics != "fastest":  # "kernel", or a tactic name
            return {i: preferred(tactics, self.tactics) for i, tactics in self._kernels.items()}
        choices, fresh = {}, {}
        for i, tactics in self._kernels.items():
            node = self.view.nodes[i]
            ins = [shapes.get(v) if v else None for v in node.input]
            consts = [self.view.constant(v) if v else None for v in node.input]
            unknown = [
                v
                for v, s, c in zip(node.input, ins, consts, strict=True)
                if v and s is None and c is None
            ]
            if unknown:
                choices[i] = tactics[0]  # shapes unknown until a run: the kernel meanwhile
                continue
            if any(s is not None and 0 in s for s in ins):
                choices[i] = tactics[0]  # an empty input: nothing to time, nothing to compute
                continue
            if any(
                c is None and not self._is_float(v)
                for v, c in zip(node.input, consts, strict=True)
                if v
            ):
                # integer or boolean inputs (shapes, ids, masks): random values would mean
                # nothing (a shape of random numbers fails); the whole-plan race still checks
                choices[i] = tactics[0]
                continue
            if self._cache is None:
                from kernels.machine import cpu_key  # heavy package: only with kernels

                self._cache = TimingCache(cpu_key(), version=timing_version()).load()
            key = node_key(node, ins, self.threads, self._source_version)
            entry = None if self._retime else self._cache.get(key)
            if entry is None:
                entry = {"times": self._time(node, tactics, ins, consts)}
                fresh[key] = entry
            times = entry["times"]
            if nchw_only:
                blocked = {t.name for t in tactics if t.blocked_inputs or t.blocked_outputs}
                times = {k: v for k, v in times.items() if k not in blocked}
            best = min(times, key=times.get)
            choices[i] = next((t for t in tactics if t.name == best), None)
        if fresh:
            self._cache.put(fresh)
        return choices

    def _time(self, node, tactics: list[Tactic], shapes, consts) -> dict[str, float]:
        """Median seconds of each tactic and of onnxruntime on the node's body, on random
        inputs of the node's shapes. A tactic that fails, or returns outputs of another number,
        dtype or shape than the body's, is never chosen (and is reported)."""
        from kernels.blocked import to_blocked  # heavy: Numba

        ensure_threads(self.threads)
        inputs = random_inputs(shapes, consts)
        # The body with the node's constants as initializers, as onnxruntime would run it inside
        # an island (weights pre-packed), on the same inputs.
        constants = {v for v, c in zip(node.input, consts, strict=True) if v and c is not None}
        single, feeds = single_node_model(self.model, node, inputs, constants)
        body = inference_session(single, ISLAND, self.threads)
        expected = body.run(None, feeds)
        times = {}
        for tactic in tactics:
            args = list(inputs)
            try:
                for k, pos in enumerate(tactic.blocked_inputs):
                    args[pos] = to_blocked(args[pos], block=tactic.in_blocks[k])
                _check_against_body(node, tactic, tactic.run(*args), expected)
                times[tactic.name] = time_call(lambda t=tactic, a=args: t.run(*a))
            except Exception as exc:  # noqa: BLE001 (any failure rules the tactic out)
                warnings.warn(f"{node_label(node)}: tactic {tactic.name} failed: {exc}",
                              FusionWarning, stacklevel=2)  # fmt: skip
                times[tactic.name] = float("inf")
        times[ONNXRUNTIME] = time_call(lambda: body.run(None, feeds))
        return times

    def _is_float(self, value: str) -> bool:
        vt = self.view.type_of(value)
        return vt is None or not vt.elem_type or vt.elem_type == onnx.TensorProto.FLOAT

    def _random_feeds(self, shapes: dict) -> dict | None:
        """Standard-normal feeds of the declared shapes, if every input is a float32 tensor of
        a fixed shape (else a plan is raced on a first run's own feeds)."""
        if any(spec.dtype != np.float32 or spec.name not in shapes for spec in self._inputs):
            return None
        names = [spec.name for spec in self._inputs]
        arrays = random_inputs([shapes[n] for n in names], [None] * len(names))
        return dict(self._base) | dict(zip(names, arrays, strict=True))

    def _settle(self, shapes: dict, values: dict, again: bool = False) -> RunPlan:
        """The plan for these shapes, checked whole. Per-node timings miss what a node costs
        its neighbours (layout conversions at the borders of a blocked region, an island cut
        in two), so the plan of per-node choices races, on `values`, the same choices kept to
        NCHW tactics and the model in onnxruntime alone (its defaults), judged as
        fusion/runtime/race.py says: the simplest plan is kept unless another is faster by
        more than the race's noise. The verdict is cached; one raced under load is provisional
        (raced again, here or in a later process), and a cached one is watched: the chosen
        plan's first runs are compared with the time the race recorded, and the plan is raced
        again when they disagree. again: race whatever the cache says."""
        per_node = self._choose(shapes)
        if all(t is None for t in per_node.values()):
            return self._plan(per_node)
        candidates = {  # simplest first: the race keeps the first it cannot tell from the best
            ONNXRUNTIME: dict.fromkeys(self._kernels),
            "nchw": self._choose(shapes, nchw_only=True),
            "per-node": per_node,
        }
        if candidates["nchw"] == per_node:
            del candidates["nchw"]
        signature = [np.shape(values[spec.name]) for spec in self._inputs]
        key = plan_key(self._skeleton_digest, signature, self.threads, self._source_version)
        cached = None if again or self._retime else self._cached_verdict(key, candidates)
        if cached is not None:
            chosen = self._plan(candidates[cached.chosen])
            chosen.race = _race_dict(cached, cached=True)
            chosen.watch = _Watch(shapes, cached.seconds[cached.chosen], cached.noise)
            return chosen
        plans = {name: self._plan(c) for name, c in candidates.items()}
        verdict = self._race(plans, values)
        if self._cache is not None:
            self._cache.put({key: verdict.to_entry()})
        chosen = plans[verdict.chosen]
        chosen.race = _race_dict(verdict)
        return chosen

    def _cached_verdict(self, key: str, candidates: dict) -> Verdict | None:
        """The cache's verdict for this plan key, if it judged these candidates on a quiet
        machine. A provisional one is raced again once per process: the machine may be quiet
        now, and if it is not, the new verdict is as good as the old."""
        entry = self._cache.get(key) if self._cache is not None else None
        if entry is None:
            return None
        verdict = Verdict.from_entry(entry)
        if not set(candidates) <= set(verdict.seconds) or verdict.chosen not in candidates:
            return None
        if verdict.busy and key not in _RERACED:
            _RERACED.add(key)
            return None
        return verdict

    def _race(self, plans: dict[str, RunPlan], values: dict) -> Verdict:
        """Race whole runs of the plans (fusion/runtime/race.py). Each plan runs on one copy of
        the feeds, never on the caller's arrays, whatever a kernel does to its inputs; a plan
        that fails is ruled out, with a warning."""
        full = self._base | {
            k: v.copy() if k in self._feeds.feedable else v for k, v in values.items()
        }
        calls = {name: functools.partial(self._run_copy, p, full) for name, p in plans.items()}
        verdict = race(calls)
        for name, error in verdict.failed.items():
            message = f"the {PLAN_NAMES.get(name, name)} plan failed while timed: {error}"
            warnings.warn(message, FusionWarning, stacklevel=3)
        return verdict

    def _run_copy(self, run_plan: RunPlan, values: dict) -> None:
        run_plan.run(dict(values))

    @functools.cached_property
    def _source_version(self) -> str:
        """What cached timings depend on in code: the kernels, the built-in patterns, and the
        module of every other rule's kernel here (a plugin's), hashed once."""
        rules = [self.catalog.get(self.view.nodes[i].op_type) for i in self._kernels]
        plugins = sorted({r.prepare.__module__ for r in rules if not is_built_in(r)})
        return timing_version(plugins)

    @functools.cached_property
    def _skeleton_digest(self) -> str:
        return skeleton_digest(self.model)

    def _plan(self, choices: dict[int, Tactic | None]) -> RunPlan:
        return assemble(self._built, self._output_names, choices)

    def _plan_for(self, feeds: dict) -> RunPlan:
        """The plan for these feeds' shapes: the default one, or (dynamic shapes, timed
        choices) the one made for this shape on its first run."""
        if not self._dynamic:
            if self._unsettled:
                with self._lock:
                    if self._unsettled:
                        self._default = self._settle(self._shapes, dict(feeds))
                        self._unsettled = False
            return self._default
        signature = tuple(np.shape(feeds[spec.name]) for spec in self._inputs)
        found = self._plans.get(signature)
        if found is not None:
            return found
        with self._lock:
            if signature not in self._plans and len(self._plans) < MAX_PLANS:
                names = [spec.name for spec in self._inputs]
                shapes = _concrete_shapes(self.model, dict(zip(names, signature, strict=True)))
                self._plans[signature] = self._settle(shapes, dict(feeds))
            return self._plans.get(signature, self._default)

    @property
    def steps(self) -> list:
        """The run steps of the default plan (islands, kernels, conversions)."""
        return self._default.steps

    @property
    def releases(self) -> list:
        return self._default.releases

    @property
    def choices(self) -> dict[str, str]:
        """Per fused node (its label), the tactic it runs in the default plan."""
        return dict(self._default.choices)

    def with_tactics(self, tactics: str) -> Session:
        """A Session on this one's kernels (built once, weights packed once) that runs them
        under another untimed policy: "kernel", "onnxruntime" or a tactic name. fusion.verify
        runs each tactic a kernel offers this way."""
        chosen = policy(tactics)
        if chosen == "fastest":
            raise ValueError("with_tactics takes an untimed policy, not 'fastest'")
        other = object.__new__(type(self))
        other._start(self._built, chosen, retime=False)
        return other

    @property
    def offered(self) -> dict[str, list[str]]:
        """Per fused node that a kernel runs (its label), the names of its kernel's tactics,
        first the one tactics="kernel" takes."""
        return {node_label(self.view.nodes[i]): [t.name for t in tactics]
                for i, tactics in self._kernels.items()}  # fmt: skip

    @property
    def race(self) -> dict | None:
        """How the default plan was chosen: {"chosen": "per-node" | "nchw" | "onnxruntime",
        "seconds": each candidate's time (the least disturbed of its rounds), "noise", "decided"
        (False: the simplest plan within the noise was kept), "load" (other processes' cores),
        "busy" (raced under load: provisional), "cached"}; None when not raced (tactics other
        than "fastest", nothing to fuse, or no run yet on a model with non-float inputs)."""
        return self._default.race

    def choices_for(self, feeds: Mapping) -> dict[str, str]:
        """Per fused node (its label), the tactic a run on these feeds uses."""
        return dict(self._plan_for(self._feeds.validated(feeds)).choices)

    # ---- building ----------------------------------------------------------------------------
    # ---- the InferenceSession interface ------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [spec.node_arg for spec in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [node_arg(o.name, self.view.type_of(o.name)) for o in self.model.graph.output]

    @property
    def islands(self) -> list[IslandStep]:
        return [s for s in self.steps if s.kind == "island"]

    def run(self, output_names, feeds: Mapping, run_options=None) -> list[np.ndarray]:
        """Like InferenceSession.run (run_options is accepted and ignored)."""
        names = self._feeds.output_list(output_names)
        values = self.execute(feeds)
        return [_fresh(values[n], n in self._base) for n in names]

    def run_with_intermediates(self, feeds: Mapping) -> dict[str, np.ndarray]:
        """Every value passed between steps (so every fused node's inputs and outputs), the feeds,
        constants and graph outputs, by name; values inside an island are not seen."""
        return self.execute(feeds, keep_all=True)

    def profile(self, feeds: Mapping, repeat: int = 10, warmup: int = 1) -> Profile:
        """Mean time per step over `repeat` runs, and the time spent between steps."""
        for _ in range(warmup):
            self.execute(feeds)
        steps = self.steps_for(feeds)
        step_times = [0.0] * len(steps)
        wall = 0.0
        for _ in range(repeat):
            times: list[float] = []
            start = time.perf_counter()
            self.execute(feeds, times)
            wall += time.perf_counter() - start
            step_times = [a + b for a, b in zip(step_times, times, strict=True)]
        rows = [(s.kind, s.name, t / repeat) for s, t in zip(steps, step_times, strict=True)]
        return Profile(rows, wall / repeat)

    def race_for(self, feeds: Mapping) -> dict | None:
        """How the plan for these feeds' shapes was chosen (see `race`)."""
        return self._plan_for(self._feeds.validated(feeds)).race

    def steps_for(self, feeds: Mapping) -> list:
        """The steps a run on these feeds takes (their shapes may have a plan of their own)."""
        return self._plan_for(self._feeds.validated(feeds)).steps

    # ---- running -----------------------------------------------------------------------------
    def execute(self, feeds: Mapping, times: list | None = None, keep_all: bool = False) -> dict:
        """One run; returns the values it holds at the end: the graph outputs and whatever no
        step released (keep_all: every value, each also in NCHW under its own name). times,
        when given, gets each step's seconds."""
        values = dict(self._base)
        values.update(self._feeds.validated(feeds))
        run_plan = self._plan_for(values)
        watch = run_plan.watch
        if watch is None or not watch.open:
            return run_plan.run(values, times, keep_all)
        feeds = dict(values)  # the run releases values from `values`
        start = time.perf_counter()
        out = run_plan.run(values, times, keep_all)
        if watch.seen(time.perf_counter() - start) is False:
            self._race_again(run_plan, feeds)
        return out

    def _race_again(self, stale: RunPlan, feeds: dict) -> None:
        """A cached plan whose runs disagree with the time its race recorded (that race ran on
        a machine unlike this one now): race its shapes again, here, and use the new verdict."""
        with self._lock:
            if stale.watch is None:  # another thread did it
                return
            fresh = self._settle(stale.watch.shapes, feeds, again=True)
            stale.watch = None
            if self._default is stale:
                self._default = fresh
            for signature, other in list(self._plans.items()):
                if other is stale:
                    self._plans[signature] = fresh


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


def _check_against_body(node: onnx.NodeProto, tactic: Tactic, results, expected: list) -> None:
    """Raise ValueError if a tactic's outputs are not the body's in number, dtype or shape
    (outputs in the blocked layout aside): a timed tactic must be one a run would accept."""
    outputs = [k for k, v in enumerate(node.output) if v]  # the body has no "" outputs
    if not isinstance(results, Sequence):
        results = tuple(results)
    if len(results) != len(node.output):
        raise ValueError(f"returned {len(results)} outputs; the node has {len(node.output)}")
    for k, want in zip(outputs, expected, strict=True):
        got = results[k]
        if k in tactic.blocked_outputs:
            continue
        if type(got) is not np.ndarray or got.dtype != want.dtype or got.shape != want.shape:
            what = f"{getattr(got, 'dtype', type(got).__name__)} {list(np.shape(got))}"
            raise ValueError(f"returned {what} for {node.output[k]} where the node's function "
                             f"body gives {want.dtype} {list(want.shape)}")  # fmt: skip


def _fresh(value: np.ndarray, shared: bool) -> np.ndarray:
    """Build-time values are shared between runs: hand the caller a copy it may modify."""
    return value.copy() if shared else value


MAX_PLANS = 16  # feed shapes that get a plan of their own; later new shapes use the default


WATCH_SKIP, WATCH_RUNS = 1, 5  # a cached plan's first run is not judged, the next 5 are
_RERACED: set[str] = set()  # plan keys whose provisional verdict this process raced again


class _Watch:
    """The first runs of a plan chosen from the cache, against the time its race recorded
    (race.agrees). seen(seconds) -> None while watching, then whether they agreed, once."""

    def __init__(self, shapes: dict, recorded: float, noise: float):
        self.shapes, self.recorded, self.noise = shapes, recorded, noise
        self.times: list[float] = []
        self.open = True
        self._skip = WATCH_SKIP

    def seen(self, seconds: float) -> bool | None:
        if self._skip > 0:
            self._skip -= 1
            return None
        self.times.append(seconds)
        if len(self.times) < WATCH_RUNS or not self.open:
            return None
        self.open = False
        return agrees(self.recorded, self.times, self.noise)


def _race_dict(verdict: Verdict, cached: bool = False) -> dict:
    """Session.race's form of a verdict: what was chosen, every candidate's seconds, the noise,
    whether the race decided, other processes' load (cores), whether it ran under load, and
    whether it came from the timing cache."""
    return {"chosen": verdict.chosen, "seconds": dict(verdict.seconds), "noise": verdict.noise,
            "decided": verdict.decided, "load": verdict.load, "busy": verdict.busy,
            "cached": cached}  # fmt: skip


def _static_shape(vt: ValueType | None) -> tuple | None:
    if vt is None or vt.shape is None or not all(isinstance(d, int) and d >= 0 for d in vt.shape):
        return None
    return tuple(vt.shape)


def _concrete_shapes(model: onnx.ModelProto, inputs: dict[str, tuple]) -> dict[str, tuple]:
    """Every value's shape for these input shapes, by ONNX shape inference on the model
    without its weights' bytes (what inference cannot say is left out)."""
    skeleton = weightless_copy(model)
    for vi in skeleton.graph.input:
        if vi.name in inputs and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape.dim
            for d, size in zip(dims, inputs[vi.name], strict=False):
                d.Clear()
                d.dim_value = int(size)
    try:
        view = GraphView(skeleton)
    except Exception:  # noqa: BLE001 (inference is best effort)
        return {}
    out = {}
    for value in list(view.producer) + list(inputs):
        shape = _static_shape(view.type_of(value))
        if shape is not None:
            out[value] = shape
    return out
