"""Choosing how a model runs, per input shapes and machine: each fused node's tactic, then the
whole plan of those choices checked against simpler ones.

    chooser = Chooser(built, "fastest", retime=False, feeds=FeedCheck(view), base=known,
                      build=lambda choices: assemble(built, outputs, choices), run=RunPlan.run)
    plans = PlanTable(chooser)
    plans.default.plan, plans.default.race, plans.run(values)

- Per node (`Chooser.choose`, by the policy of fusion/runtime/tactics.py): under "fastest",
  each tactic of the node's kernel and onnxruntime on the node's body are timed on its input
  shapes (`Chooser.time_tactics`), the fastest kept; the timings are cached
  (fusion/runtime/timing_cache.py). The choices are then revised together for the layout
  conversions each costs its neighbours (fusion/runtime/borders.py), which a node timed alone
  never sees.
- Whole plan (`Chooser.settle`): the plan of per-node choices races the same choices kept to
  NCHW tactics (unless a fallback went untimed), each node's fastest kernel tactic (no
  onnxruntime islands: a node that loses to its body alone may still win once the conversions
  around it count), and the model in onnxruntime alone, judged by fusion/runtime/race.py. The
  verdict is cached; one raced under load is provisional and raced again once per process; a
  cached one is watched (`Watch`): its plan's first runs against the time the race recorded.
- Per input shapes (`PlanTable`): the plan of the shapes the model declares, settled when the
  table is made (float inputs of fixed shape) or on the first run; with symbolic input dims,
  one plan per new feed shape; a watched plan whose runs disagree is raced again and replaced.

Nothing here knows a Session: it gets a model's built kernels and two callables, build(choices)
-> a run plan and run(plan, values, times, keep_all) -> the values after one run
(fusion/runtime/steps.py: assemble, RunPlan.run).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from fusion.catalog import Catalog, Tactic
from fusion.errors import FusionWarning
from fusion.functions import single_node_model
from fusion.graph import GraphView, ValueType, node_label
from fusion.modelfile import shapes_from_a_run, weightless_copy
from fusion.ort import ISLAND, inference_session
from fusion.rewriter import rewrite
from fusion.runtime.borders import revise
from fusion.runtime.feed_checks import FeedCheck
from fusion.runtime.kernel import BuiltKernels, ensure_threads, is_built_in
from fusion.runtime.layout import out_block
from fusion.runtime.plan import is_fused
from fusion.runtime.race import BUSY_CORES, Machine, Verdict, agrees, race
from fusion.runtime.tactics import (
    BUDGET_S,
    ONNXRUNTIME,
    TIMING_ROUNDS,
    first_timed,
    preferred,
    random_inputs,
    tactic_inputs,
    time_call,
)
from fusion.runtime.timing_cache import (
    FROM_BLOCKED,
    PLAN,
    TO_BLOCKED,
    TimingCache,
    convert_key,
    node_key,
    plan_key,
    timing_version,
)

# What each whole-plan candidate (Chooser.settle) is, for people.
PLAN_NAMES = {"per-node": "each node's fastest", "nchw": "NCHW tactics only",
              "kernels": "each node's fastest kernel",
              ONNXRUNTIME: "onnxruntime alone"}  # fmt: skip
TIMED = ("fastest", "kernels")  # the policies that time each node's tactics on its shapes
WATCH_SKIP, WATCH_RUNS = 1, 5  # a cached plan's first run is not judged, the next 5 are
# ... and as many more as span WATCH_SPAN seconds: /proc/stat counts CPU time in ticks of 10 ms,
# so the load of a window of five 200 us runs reads 0 or several cores, by chance
WATCH_SPAN = 0.1
WATCH_WINDOWS = 20  # windows a watch may drop (loaded, or overlapped runs) before it stops
MAX_PLANS = 16  # feed shapes that get a plan of their own; later new shapes use the default
# Plan keys whose provisional verdict this process raced again (once per process: tests
# replace it to play a new process).
RERACED: set[str] = set()


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
    loaded = race.get("load") is not None and race["load"] > BUSY_CORES
    busy = "; raced under load" if loaded else "; a noisy race"
    busy = f"{busy}: provisional, raced again on a quiet run" if race.get("busy") else ""
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
    from fusion_kernels.machine import cpu_key  # heavy package: only with kernels

    cache = TimingCache(cpu_key(), version=timing_version()).load()
    start = PLAN
    if model is not None:
        fused = model if is_fused(model) else rewrite(model, catalog).model
        start += skeleton_digest(fused) + "|"
    found = [
        (key, race_dict(Verdict.from_entry(entry), cached=True), entry.get("written", 0))
        for key, entry in cache.entries.items()
        if key.startswith(start)
    ]
    return sorted(found, key=lambda row: -row[2])


def race_dict(verdict: Verdict, cached: bool = False) -> dict:
    """Session.race's form of a verdict: its cache entry's fields (race.Verdict.to_entry) with
    the candidates' times as "seconds", and whether it came from the timing cache."""
    entry = verdict.to_entry()
    return {"seconds": entry.pop("plans"), **entry, "cached": cached}


class Watch:
    """The first runs of a plan chosen from the cache, against the time its race recorded
    (race.agrees). seen(seconds) -> None while watching, then once whether they agreed. A
    window of runs that cannot judge (other processes loaded the machine meanwhile, or runs
    overlapped in threads, each then slowing the other) is dropped and the next one watched,
    up to WATCH_WINDOWS of them. provisional: the plan comes from a race run under load in
    this process, whose every candidate's time the load may have moved; a window on a quiet
    machine then counts as a disagreement (False): race again while it is quiet.
    """

    def __init__(self, shapes: dict, recorded: float, noise: float, provisional: bool = False):
        self.shapes, self.recorded, self.noise = shapes, recorded, noise
        self.provisional = provisional
        self.times: list[float] = []
        self.open = True
        self.overlapped = False  # set by PlanTable.run when watched runs overlap
        self.windows = 0  # windows that could not judge
        self._skip = WATCH_SKIP
        self._machine = None  # the window's other processes' load, from its first judged run
        if WATCH_SKIP == 0:
            self._start()

    def _start(self) -> None:
        self.times, self.overlapped = [], False
        self._machine = Machine()
        self._machine.start()

    def seen(self, seconds: float) -> bool | None:
        if not self.open:
            return None
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._start()
            return None
        self.times.append(seconds)
        if len(self.times) < WATCH_RUNS or self._machine.elapsed() < WATCH_SPAN:
            return None
        load = self._machine.stop()
        if self.overlapped or (load is not None and load > BUSY_CORES):
            self.windows += 1
            if self.windows >= WATCH_WINDOWS:
                self.open = False
            else:
                self._start()
            return None
        self.open = False
        if self.provisional:
            return False if load is not None else None  # quiet now, as far as it can tell
        return agrees(self.recorded, self.times, self.noise)


@dataclass
class Settled:
    """A run plan and how it was chosen: race, Session.race's dict (None: not raced); watch,
    for a verdict from the cache or one raced under load, its first runs checked against it."""

    plan: Any  # what the chooser's build() made
    race: dict | None = None
    watch: Watch | None = None


class Chooser:
    """Each fused node's tactic and the whole plan, for a model's built kernels under a policy.

    feeds: the model's inputs (FeedCheck); base: the values a run knows before its feeds;
    build(choices) -> a run plan, choices being per fused node a kernel runs (its index) its
    Tactic or None (its body in onnxruntime); run(plan, values, times=None, keep_all=False):
    one run. retime: time and race again what the cache answers (fusion tune --force)."""

    def __init__(
        self,
        built: BuiltKernels,
        policy: str,
        retime: bool,
        feeds: FeedCheck,
        base: dict,
        build: Callable[[dict], Any],
        run: Callable[..., dict],
    ):
        self.built, self.view, self.model = built, built.view, built.model
        self.kernels, self.threads = built.tactics, built.threads
        self.policy, self.retime = policy, retime
        self.feeds, self.base = feeds, base
        self.build, self.run = build, run
        self._cache: TimingCache | None = None
        self._retimed: dict[str, dict] = {}  # node key -> entry timed here (retime: not reread)
        self.compiled: dict = {}  # what the last choose() compiled before timing (precompile.warm)

    # ---- per node ----------------------------------------------------------------------------
    def choose(self, shapes: dict, nchw_only: bool = False,
               kernels_only: bool = False) -> dict[int, Tactic | None] | None:  # fmt: skip
        """Per fused node with a kernel, the tactic it runs (None: its body in onnxruntime):
        by the policy, timing each candidate where the node's input shapes are known
        (`shapes`: value -> shape) and the timing cache has no answer yet. nchw_only: among
        the tactics that read and write plain NCHW arrays (no layout conversions), None if a
        node's NCHW tactic was not timed (a fallback); kernels_only: among the kernel's tactics
        (onnxruntime only where every one failed)."""
        if self.policy == ONNXRUNTIME:
            return dict.fromkeys(self.kernels)
        if self.policy not in TIMED:  # "kernel", or a tactic name
            return {i: preferred(tactics, self.policy) for i, tactics in self.kernels.items()}
        kernels_only = kernels_only or self.policy == "kernels"
        choices, fresh, timed = {}, {}, {}
        chosen = []  # (node index, its input shapes, constants, timing-cache key, entry)
        for i, tactics in self.kernels.items():
            node, first = self.view.nodes[i], first_timed(tactics)[0]
            ins = [shapes.get(v) if v else None for v in node.input]
            consts = [self.view.constant(v) if v else None for v in node.input]
            unknown = [
                v
                for v, s, c in zip(node.input, ins, consts, strict=True)
                if v and s is None and c is None
            ]
            if unknown:
                choices[i] = first  # shapes unknown until a run: the kernel meanwhile
                continue
            if any(s is not None and 0 in s for s in ins):
                choices[i] = first  # an empty input: nothing to time, nothing to compute
                continue
            if any(
                c is None and not self._is_float(v)
                for v, c in zip(node.input, consts, strict=True)
                if v
            ):
                # integer or boolean inputs (shapes, ids, masks): random values would mean
                # nothing (a shape of random numbers fails); the whole-plan race still checks
                choices[i] = first
                continue
            if self._cache is None:
                from fusion_kernels.machine import cpu_key  # heavy package: only with kernels

                self._cache = TimingCache(cpu_key(), version=timing_version()).load()
            key = node_key(node, ins, self.threads, self._source_version, consts)
            entry = self._retimed.get(key) if self.retime else self._cache.get(key)
            chosen.append((i, ins, consts, key, entry))
        todo = {i: ins for i, ins, _, _, entry in chosen if entry is None}
        if todo:  # (settle's later choose() calls, on the cache, keep what this one did)
            self.compiled = self._compile(todo, {i: consts for i, _, consts, _, _ in chosen})
        for i, ins, consts, key, entry in chosen:
            tactics, node = self.kernels[i], self.view.nodes[i]
            if entry is None:
                entry = {"times": self.time_tactics(node, tactics, ins, consts)}
                fresh[key] = self._retimed[key] = entry
            times = entry["times"]
            if nchw_only:
                blocked = {t.name for t in tactics if t.blocked_inputs or t.blocked_outputs}
                if any(t.name not in blocked | set(times) for t in tactics):
                    return None  # an NCHW tactic left untimed (a fallback): no NCHW plan
                times = {k: v for k, v in times.items() if k not in blocked}
            if kernels_only and any(v < float("inf") for k, v in times.items() if k != ONNXRUNTIME):
                times = {k: v for k, v in times.items() if k != ONNXRUNTIME}
            best = min(times, key=times.get)
            choices[i] = next((t for t in tactics if t.name == best), None)
            timed[i] = times
        if timed and not nchw_only:  # what each choice costs its neighbours in conversions
            options = {i: [t for t in self.kernels[i] if t.name in timed[i]]
                       + ([None] if ONNXRUNTIME in timed[i] else []) for i in timed}  # fmt: skip
            choices = revise(
                self.view,
                choices,
                options,
                timed,
                shapes,
                out_block(),
                lambda shape, block: self._convert_times(shape, block, fresh),
            )
        if fresh:
            self._cache.put(fresh)
        return choices

    def _compile(self, todo: dict, consts: dict) -> dict:
        """The nodes about to be timed (index -> input shapes), their tactics called once
        first, on this core and on another in a helper process (fusion/runtime/precompile.py):
        a cold start's compiling on two cores, and no compile inside a timing."""
        from fusion.runtime.precompile import call_once, warm

        def helped(i: int) -> bool:  # a built-in rule's node: a helper process can build it
            return is_built_in(self.built.catalog.get(self.view.nodes[i].op_type))

        ensure_threads(self.threads)
        return warm(self.model, todo, helped, self.threads,
                    lambda i: call_once(self.kernels[i], todo[i], consts[i]))  # fmt: skip

    def _convert_times(self, shape: tuple, block: int, fresh: dict) -> tuple[float, float]:
        """Seconds of converting a float32 array of NCHW `shape` to blocks of `block` channels
        and back, from the timing cache or timed now (and put in `fresh`)."""
        from fusion_kernels.blocked import from_blocked, to_blocked  # heavy: Numba

        key = convert_key(shape, block, self.threads, self._source_version)
        entry = fresh.get(key) or (self._retimed if self.retime else self._cache).get(key)
        if entry is None:
            ensure_threads(self.threads)
            x = random_inputs([shape], [None])[0]
            xb = to_blocked(x, block=block)
            budget = BUDGET_S / TIMING_ROUNDS
            times = {
                TO_BLOCKED: time_call(lambda: to_blocked(x, block=block), budget=budget),
                FROM_BLOCKED: time_call(lambda: from_blocked(xb, shape[1]), budget=budget),
            }
            entry = fresh[key] = self._retimed[key] = {"times": times}  # fmt: skip
        return entry["times"][TO_BLOCKED], entry["times"][FROM_BLOCKED]

    def time_tactics(self, node, tactics: list[Tactic], shapes, consts) -> dict[str, float]:
        """Median seconds of each tactic and of onnxruntime on the node's body, on random
        inputs of the node's shapes. A tactic that fails, or returns outputs of another number,
        dtype or shape than the body's, is never chosen (and is reported). The fallbacks
        (Tactic.fallback) are timed only if every other tactic failed; untimed, they are not
        in the result."""
        ensure_threads(self.threads)
        inputs = random_inputs(shapes, consts)
        # The body with the node's constants as initializers, as onnxruntime would run it inside
        # an island (weights pre-packed), on the same inputs.
        constants = {v for v, c in zip(node.input, consts, strict=True) if v and c is not None}
        single, feeds = single_node_model(self.model, node, inputs, constants)
        body = inference_session(single, ISLAND, self.threads)
        expected = body.run(None, feeds)
        times, runs = {}, {}
        first = first_timed(tactics)
        fallbacks = [t for t in tactics if all(t is not f for f in first)]
        for k, tactic in enumerate(first + fallbacks):
            if k == len(first) and runs:
                break  # a first tactic runs: the fallbacks stay untimed (not in times)
            try:
                args = tactic_inputs(tactic, inputs)
                _check_against_body(node, tactic, tactic.run(*args), expected)
                runs[tactic.name] = lambda t=tactic, a=args: t.run(*a)
            except Exception as exc:  # noqa: BLE001 (any failure rules the tactic out)
                warnings.warn(f"{node_label(node)}: tactic {tactic.name} failed: {exc}",
                              FusionWarning, stacklevel=2)  # fmt: skip
                times[tactic.name] = float("inf")
        runs[ONNXRUNTIME] = lambda: body.run(None, feeds)
        # In rounds, the candidates' order turning, each kept at its least disturbed round (the
        # race's rule): one after the other, a moment of load fell on one candidate alone and
        # kept a tactic 1.5x slower than its sibling (bench/NOTES.md, "Per-node timing in
        # rounds").
        names = list(runs)
        for r in range(TIMING_ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t = time_call(runs[name], min_calls=1, budget=BUDGET_S / TIMING_ROUNDS)
                times[name] = min(times.get(name, float("inf")), t)
        return times

    def _is_float(self, value: str) -> bool:
        vt = self.view.type_of(value)
        return vt is None or not vt.elem_type or vt.elem_type == onnx.TensorProto.FLOAT

    # ---- the whole plan ----------------------------------------------------------------------
    def settle(self, shapes: dict, values: dict, again: bool = False) -> Settled:
        """The plan for these shapes, checked whole. Per-node timings miss what a node costs
        its neighbours (layout conversions at the borders of a blocked region, an island cut
        in two), so the plan of per-node choices races, on `values`, the same choices kept to
        NCHW tactics (unless a node left one untimed: a fallback), each node's fastest kernel
        tactic, and the model in onnxruntime alone (its defaults), judged as
        fusion/runtime/race.py says: the simplest plan is kept unless another is faster by
        more than the race's noise. The verdict is cached; one raced under load is provisional
        (raced again, here or in a later process), and a cached one is watched: the chosen
        plan's first runs are compared with the time the race recorded, and the plan is raced
        again when they disagree. again: race whatever the cache says."""
        if self.policy in TIMED:
            shapes = self._shapes_from_a_run(shapes, values)
        per_node = self.choose(shapes)
        if self.policy != "fastest":  # "kernels": timed per node, not raced
            return Settled(self.build(per_node))
        alone = dict.fromkeys(self.kernels)
        candidates = {  # simplest first: the race keeps the first it cannot tell from the best
            ONNXRUNTIME: alone,
            "nchw": self.choose(shapes, nchw_only=True),
            "kernels": self.choose(shapes, kernels_only=True),
            "per-node": per_node,
        }
        for name in ("nchw", "kernels"):  # a candidate the same as per-node is raced once
            if candidates[name] is None or candidates[name] in (per_node, alone):
                del candidates[name]
        if per_node == alone:  # every node lost to its body: per-node is onnxruntime's plan
            del candidates["per-node"]
        if len(candidates) == 1:
            return Settled(self.build(alone))
        signature = [np.shape(values[spec.name]) for spec in self.feeds.inputs]
        key = plan_key(self._skeleton_digest, signature, self.threads, self._source_version)
        cached = None if again or self.retime else self._cached_verdict(key, candidates)
        if cached is not None:
            watch = Watch(shapes, cached.seconds[cached.chosen], cached.noise)
            return Settled(self.build(candidates[cached.chosen]), race_dict(cached, True), watch)
        plans = {name: self.build(c) for name, c in candidates.items()}
        verdict = self._race(plans, values)
        if self._cache is not None and not (again and verdict.busy):  # keep a quiet verdict
            self._cache.put({key: verdict.to_entry()})
        watch = None
        if verdict.busy and not again:  # raced under load: race again once the runs are quiet
            watch = Watch(shapes, verdict.seconds[verdict.chosen], verdict.noise, True)
        return Settled(plans[verdict.chosen], race_dict(verdict), watch)

    def _shapes_from_a_run(self, shapes: dict, values: dict) -> dict:
        """`shapes`, and the shapes of the fused nodes' float inputs it lacks (inference cannot
        follow Shape arithmetic through a fused node: ShuffleNet's channel split) from one run
        of the model in onnxruntime on `values`. Without them such a node is never timed (its
        first tactic runs) and its kernels compile in the first run, on one core: ShuffleNet
        left 35 of its 40 fused nodes untimed. Best effort: a run that fails leaves `shapes`."""
        nodes = self.view.nodes
        missing = sorted({
            v for i in self.kernels for v in nodes[i].input
            if v and v not in shapes and self.view.constant(v) is None and self._is_float(v)
        })  # fmt: skip
        feeds = {s.name: values[s.name] for s in self.feeds.inputs if s.name in values}
        if not missing or len(feeds) < len(self.feeds.inputs):
            return shapes
        got = shapes_from_a_run(self.model, missing, feeds, self.threads)
        return shapes | {v: shape for v, (shape, dtype) in got.items() if dtype == np.float32}

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
        if verdict.busy and key not in RERACED:
            RERACED.add(key)
            return None
        return verdict

    def _race(self, plans: dict[str, Any], values: dict) -> Verdict:
        """Race whole runs of the plans (fusion/runtime/race.py). Each plan runs on one copy of
        the feeds, never on the caller's arrays, whatever a kernel does to its inputs; a plan
        that fails is ruled out, with a warning."""
        feedable = self.feeds.feedable
        full = self.base | {k: v.copy() if k in feedable else v for k, v in values.items()}
        calls = {name: functools.partial(self._run_copy, p, full) for name, p in plans.items()}
        verdict = race(calls)
        for name, error in verdict.failed.items():
            message = f"the {PLAN_NAMES.get(name, name)} plan failed while timed: {error}"
            warnings.warn(message, FusionWarning, stacklevel=3)
        return verdict

    def _run_copy(self, run_plan, values: dict) -> None:
        self.run(run_plan, dict(values))

    @functools.cached_property
    def _source_version(self) -> str:
        """What cached timings depend on in code: the kernels, the built-in patterns, and the
        module of every other rule's kernel here (a plugin's), hashed once."""
        rules = [self.built.catalog.get(self.view.nodes[i].op_type) for i in self.kernels]
        plugins = sorted({r.prepare.__module__ for r in rules if not is_built_in(r)})
        return timing_version(plugins)

    @functools.cached_property
    def _skeleton_digest(self) -> str:
        return skeleton_digest(self.model)


class PlanTable:
    """A model's plans by input shapes. `default`: the plan for the shapes the model declares;
    with symbolic input dims (a batch axis) and timed choices, each new feed shape gets its own
    plan on its first run (at most MAX_PLANS). Safe to use from several threads."""

    def __init__(self, chooser: Chooser):
        self.chooser = chooser
        self._lock = threading.Lock()
        view = chooser.view
        self._shapes = {v: s for v in view.producer | dict.fromkeys(view.graph_inputs)
                        if (s := _static_shape(view.type_of(v))) is not None}  # fmt: skip
        self._dynamic = chooser.policy in TIMED and any(
            _static_shape(view.type_of(v)) is None for v in view.graph_inputs
        )
        self._plans: dict[tuple, Settled] = {}
        self._watched = 0  # runs of a watched plan under way (their overlap voids the watch)
        self._unsettled = False  # the default plan waits for a first run's feeds to be raced
        build, choose = chooser.build, chooser.choose
        if self._dynamic:
            self.default = Settled(build(choose({})))  # kernels until shapes are known
        elif chooser.policy not in TIMED or not chooser.kernels:
            self.default = Settled(build(choose(self._shapes)))
        else:
            feeds = self._random_feeds(self._shapes)
            self._unsettled = feeds is None
            self.default = (
                Settled(build(choose(self._shapes)))
                if feeds is None
                else chooser.settle(self._shapes, feeds)
            )

    def _random_feeds(self, shapes: dict) -> dict | None:
        """Standard-normal feeds of the declared shapes, if every input is a float32 tensor of
        a fixed shape (else a plan is raced on a first run's own feeds)."""
        inputs = self.chooser.feeds.inputs
        if any(spec.dtype != np.float32 or spec.name not in shapes for spec in inputs):
            return None
        names = [spec.name for spec in inputs]
        arrays = random_inputs([shapes[n] for n in names], [None] * len(names))
        return dict(self.chooser.base) | dict(zip(names, arrays, strict=True))

    def for_values(self, feeds: dict) -> Settled:
        """The plan for these feeds' shapes: the default one, or (dynamic shapes, timed
        choices) the one made for this shape on its first run."""
        if not self._dynamic:
            if self._unsettled:
                with self._lock:
                    if self._unsettled:
                        self.default = self.chooser.settle(self._shapes, dict(feeds))
                        self._unsettled = False
            return self.default
        inputs = self.chooser.feeds.inputs
        signature = tuple(np.shape(feeds[spec.name]) for spec in inputs)
        found = self._plans.get(signature)
        if found is not None:
            return found
        with self._lock:
            if signature not in self._plans and len(self._plans) < MAX_PLANS:
                names = [spec.name for spec in inputs]
                shapes = _concrete_shapes(self.chooser.model, dict(zip(names, signature,
                                                                       strict=True)))  # fmt: skip
                self._plans[signature] = self.chooser.settle(shapes, dict(feeds))
            return self._plans.get(signature, self.default)

    def run(self, values: dict, times: list | None = None, keep_all: bool = False) -> dict:
        """One run on `values` with the plan for their shapes (see the chooser's run). The
        plain runs of a watched plan are timed, and when they disagree with its race, on a
        quiet machine, the plan is raced again, once, at the end of the run that showed it (a
        race: about a second); a profile (`times`) is never watched."""
        settled = self.for_values(values)
        run, watch = self.chooser.run, settled.watch
        if watch is None or not watch.open or times is not None or keep_all:
            return run(settled.plan, values, times, keep_all)
        feeds = dict(values)  # the run releases values from `values`
        with self._lock:
            self._watched += 1
            watch.overlapped |= self._watched > 1
        start = time.perf_counter()
        try:
            out = run(settled.plan, values)
        finally:
            with self._lock:
                watch.overlapped |= self._watched > 1
                self._watched -= 1
        if watch.seen(time.perf_counter() - start) is False:
            self._race_again(settled, feeds)
        return out

    def _race_again(self, stale: Settled, feeds: dict) -> None:
        """A cached plan whose runs disagree with the time its race recorded (that race ran on
        a machine unlike this one now), or a plan raced under load whose runs found the machine
        quiet: race its shapes again and use the new verdict, unless this race too ran under
        load (then the plan and the cached verdict stay). A race that
        fails leaves the plan as it was, with a warning: the run it ends has succeeded."""
        with self._lock:
            if stale.watch is None:  # another thread did it
                return
            shapes, stale.watch = stale.watch.shapes, None
            try:
                fresh = self.chooser.settle(shapes, feeds, again=True)
            except Exception as exc:  # noqa: BLE001 (the plan it would replace still works)
                warnings.warn(f"racing a cached plan again failed: {exc}", FusionWarning,
                              stacklevel=3)  # fmt: skip
                return
            if fresh.race is not None and fresh.race["busy"]:
                return
            if self.default is stale:
                self.default = fresh
            for signature, other in list(self._plans.items()):
                if other is stale:
                    self._plans[signature] = fresh


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
