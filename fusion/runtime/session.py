"""Running a fused model: kernels for fused nodes, onnxruntime for everything else.

    sess = Session("model.onnx", threads=4)      # an original model is fused in memory first
    (y,) = sess.run(None, {"x": x})
    print(sess.profile({"x": x}))                # time per island, per kernel, and in between

The model is cut into steps once, when the session is built (see fusion/runtime/plan.py):
islands (groups of standard nodes, one onnxruntime session each) and kernel calls. A run is
then a loop over the steps reading and writing one dict of values; each value is dropped after
its last reader, as onnxruntime frees its activations. Each crossing between an island and a
kernel costs an extra onnxruntime run of a small island (`python bench/overheads.py`).

Session.run keeps no per-run state on the session, so it may be called from several threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusion.catalog import DOMAIN, Catalog
from fusion.errors import FusionError
from fusion.graph import GraphView, ValueType
from fusion.modelfile import as_model
from fusion.ort import ISLAND
from fusion.registry import default_catalog
from fusion.rewriter import rewrite
from fusion.runtime.kernel import (
    binds_kernel,
    build_kernel,
    ensure_threads,
    kernel_name,
    serialized,
    use_threads,
    workqueue_lock,
)
from fusion.runtime.plan import (
    IslandPlan,
    IslandStep,
    KernelPlan,
    KernelStep,
    OutputCheck,
    island_settings,
    plan,
    releases,
    run_body,
)

__all__ = ["InvalidFeed", "NodeArg", "Profile", "Session"]

Progress = Callable[[str, int, int], None]  # (step name, index from 1, total)


class InvalidFeed(FusionError, ValueError):
    """A run's feeds do not fit the model's inputs (missing, unknown, wrong dtype or rank)."""


@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, type ('tensor(float)') and shape (ints, strings, None)."""

    name: str
    type: str
    shape: list


def is_fused(model: onnx.ModelProto) -> bool:
    return any(node.domain == DOMAIN for node in model.graph.node)


class Session:
    """An InferenceSession look-alike that runs fused nodes with their kernels.

    threads: used by both onnxruntime (intra-op) and Numba; None means os.cpu_count().
    fuse: rewrite an original model (one without fused nodes) in memory first.
    progress: called as progress(node label, i, total) before kernel i of total is built
    (building a kernel may compile it, which can take seconds on first use).
    """

    def __init__(
        self,
        model_or_path: onnx.ModelProto | str | Path,
        threads: int | None = None,
        fuse: bool = True,
        catalog: Catalog | None = None,
        progress: Progress | None = None,
    ):
        model = as_model(model_or_path)
        if fuse and not is_fused(model):
            model = rewrite(model, catalog).model
        if catalog is None and is_fused(model):
            catalog = default_catalog()
        self.model, self.catalog = model, catalog or Catalog()
        self.threads = max(1, threads or os.cpu_count() or 1)
        self.view = view = GraphView(model)
        self._inputs = [
            _input_spec(view, vi) for vi in model.graph.input if vi.name not in view.initializers
        ]
        self._feedable = {vi.name for vi in model.graph.input}
        self._output_names = [o.name for o in model.graph.output]

        self._functions = {(f.domain, f.name, f.overload): f for f in model.functions}
        plans = plan(view, self._has_kernel)
        self._base = _known_values(view, plans)
        kernels = [p for p in plans if isinstance(p, KernelPlan)]
        lock = None
        if kernels:
            use_threads(self.threads)  # before the first kernel is built (or compiled)
            lock = workqueue_lock()
        island_inputs = {v for p in plans if isinstance(p, IslandPlan) for v in p.inputs}
        self.steps: list[IslandStep | KernelStep] = []
        built = 0
        for p in plans:
            if isinstance(p, IslandPlan):
                self.steps.append(IslandStep(p, view, island_settings(p), self.threads))
                continue
            built += 1
            if progress is not None:
                progress(p.name, built, len(kernels))
            rule = self.catalog.get(p.node.op_type)
            kernel = serialized(build_kernel(rule, p.node, view), lock)
            checks = [
                OutputCheck.of(v, view.type_of(v) if v else None, sizes=v in island_inputs)
                for v in p.outputs
            ]
            body = self._body_runner(p.node)
            varying = [k for k, v in enumerate(p.inputs) if v and view.constant(v) is None]
            self.steps.append(KernelStep(p, kernel, checks, body, kernel_name(rule), varying))
        self._uses_numba = bool(kernels)
        # Per step, the values dropped after it (and the kernel outputs never stored at all).
        self.releases = releases(self.steps, set(self._output_names))

    # ---- building ----------------------------------------------------------------------------
    def _has_kernel(self, node: onnx.NodeProto) -> bool:
        if node.domain != DOMAIN:
            return False
        body = self._functions.get((node.domain, node.op_type, node.overload))
        return binds_kernel(self.catalog.get(node.op_type), node, body)

    def _body_runner(self, node: onnx.NodeProto) -> Callable[[list], list] | None:
        """The node's function body in onnxruntime (for runs a kernel is not called on)."""
        if (node.domain, node.op_type, node.overload) not in self._functions:
            return None
        return lambda args: run_body(self.model, node, args, ISLAND)

    # ---- the InferenceSession interface ------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [spec.node_arg for spec in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(o.name, self.view.type_of(o.name)) for o in self.model.graph.output]

    @property
    def islands(self) -> list[IslandStep]:
        return [s for s in self.steps if s.kind == "island"]

    def run(self, output_names, feeds: Mapping, run_options=None) -> list[np.ndarray]:
        """Like InferenceSession.run (run_options is accepted and ignored)."""
        names = self._output_list(output_names)
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
        step_times = [0.0] * len(self.steps)
        wall = 0.0
        for _ in range(repeat):
            times: list[float] = []
            start = time.perf_counter()
            self.execute(feeds, times)
            wall += time.perf_counter() - start
            step_times = [a + b for a, b in zip(step_times, times, strict=True)]
        rows = [(s.kind, s.name, t / repeat) for s, t in zip(self.steps, step_times, strict=True)]
        return Profile(rows, wall / repeat)

    # ---- running -----------------------------------------------------------------------------
    def execute(self, feeds: Mapping, times: list | None = None, keep_all: bool = False) -> dict:
        """One run; returns the values it holds at the end: the graph outputs and whatever no
        step released (keep_all: every value). times, when given, gets each step's seconds."""
        values = dict(self._base)
        values.update(self._validated_feeds(feeds))
        if self._uses_numba:
            ensure_threads(self.threads)  # Numba's thread count is per calling thread
        for step, release in zip(self.steps, self.releases, strict=True):
            if times is None:
                step(values, keep_all)
            else:
                start = time.perf_counter()
                step(values, keep_all)
                times.append(time.perf_counter() - start)
            if not keep_all:
                for name in release:  # an activation is freed after its last reader
                    del values[name]
        return values

    def _validated_feeds(self, feeds: Mapping) -> dict[str, np.ndarray]:
        if not isinstance(feeds, dict) and not isinstance(feeds, Mapping):
            raise InvalidFeed(f"feeds must be a dict of input name -> array, not {type(feeds)}")
        checked = dict(feeds)
        for spec in self._inputs:
            value = checked.get(spec.name)
            if value is None:
                missing = [s.name for s in self._inputs if s.name not in feeds]
                if not missing:
                    raise InvalidFeed(f"Input {spec.name} is None: expected {spec.node_arg.type}")
                raise InvalidFeed(
                    f"Required inputs ({missing}) are missing from input feed ({list(feeds)})."
                )
            checked[spec.name] = spec.validated(value)
        if len(checked) > len(self._inputs):
            unknown = [name for name in feeds if name not in self._feedable]
            if unknown:
                known = ", ".join(spec.name for spec in self._inputs)
                raise InvalidFeed(f"Invalid input name: {unknown[0]} (the model's inputs: {known})")
        return checked

    def _output_list(self, output_names) -> list[str]:
        if output_names is None:
            return self._output_names
        for name in output_names:
            if name not in self._output_names:
                raise InvalidFeed(
                    f"Invalid output name: {name} (the model's outputs: "
                    f"{', '.join(self._output_names)})"
                )
        return list(output_names)


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
        return self.wall - self.total("island") - self.total("kernel")

    def to_dict(self) -> dict:
        return {
            "steps": [{"kind": k, "name": n, "seconds": t} for k, n, t in self.steps],
            "island_seconds": self.total("island"),
            "kernel_seconds": self.total("kernel"),
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


# ---- feeds -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _InputSpec:
    name: str
    dtype: np.dtype | None
    shape: tuple | None
    node_arg: NodeArg
    fixed_dims: tuple  # (axis, size) for every axis of declared size

    def validated(self, value) -> np.ndarray:
        if type(value) is not np.ndarray:
            value = np.asarray(value, dtype=self.dtype)  # onnxruntime also accepts lists
        if self.dtype is not None and value.dtype != self.dtype:
            raise InvalidFeed(
                f"Unexpected input data type for input: {self.name}. "
                f"Actual: ({value.dtype}), expected: ({self.dtype})"
            )
        if not value.flags.c_contiguous:  # Fortran order, a strided view: one copy at the border
            value = np.ascontiguousarray(value)
        if self.shape is None:
            return value
        shape = value.shape
        if len(shape) != len(self.shape):
            raise InvalidFeed(
                f"Invalid rank for input: {self.name} Got: {value.ndim} "
                f"Expected: {len(self.shape)} (shape {list(shape)}, expected {list(self.shape)})"
            )
        for axis, want in self.fixed_dims:
            if shape[axis] != want:
                raise InvalidFeed(
                    f"Got invalid dimensions for input: {self.name} index: {axis} "
                    f"Got: {shape[axis]} Expected: {want} "
                    f"(shape {list(shape)}, expected {list(self.shape)})"
                )
        return value


def _input_spec(view: GraphView, vi: onnx.ValueInfoProto) -> _InputSpec:
    vt = view.type_of(vi.name)
    dtype = helper.tensor_dtype_to_np_dtype(vt.elem_type) if vt and vt.elem_type else None
    shape = vt.shape if vt else None
    fixed = tuple((k, d) for k, d in enumerate(shape or ()) if isinstance(d, int) and d > 0)
    return _InputSpec(vi.name, dtype, shape, _node_arg(vi.name, vt), fixed)


def _node_arg(name: str, vt: ValueType | None) -> NodeArg:
    if vt is None or not vt.elem_type:
        return NodeArg(name, "unknown", [])
    type_name = onnx.TensorProto.DataType.Name(vt.elem_type).lower()
    return NodeArg(name, f"tensor({type_name})", list(vt.shape or []))


def _known_values(view: GraphView, plans: list) -> dict[str, np.ndarray]:
    """Values known at build time that a run reads from its dict: constants read by kernels or
    returned as outputs, and defaults of initializers that a feed may override."""
    wanted = set(view.graph_outputs)
    for p in plans:
        wanted.update(p.inputs)
    known = {}
    for value in wanted:
        if not value:
            continue
        array = view.constant(value)
        if array is None and value in view.initializers:  # overridable default
            array = numpy_helper.to_array(view.initializers[value])
        if array is not None:
            known[value] = array
    return known


def _fresh(value: np.ndarray, shared: bool) -> np.ndarray:
    """Build-time values are shared between runs: hand the caller a copy it may modify."""
    return value.copy() if shared else value
