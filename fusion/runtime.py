"""Running a fused model: kernels for fused nodes, onnxruntime for everything else.

    sess = Session("model.onnx", threads=4)      # an original model is fused in memory first
    (y,) = sess.run(None, {"x": x})
    print(sess.profile({"x": x}))                # time per island, per kernel, and in between

The model is cut into steps once, when the session is built (see fusion/islands.py): islands
(groups of standard nodes, one onnxruntime InferenceSession each) and kernel calls. A run is
then a loop over the steps reading and writing one dict of values; each value is dropped after
its last reader, as onnxruntime frees its activations.

Crossing cost, measured on the 2-core dev machine with `python tests/test_runtime.py` (Add ->
ScaledRelu kernel -> Neg on a 1x3 tensor, threads=1): onnxruntime alone on the function-body
model ~24 us per call; Session (island, kernel, island) ~80 us, of which the NumPy test kernel
~20 us. Each crossing costs ~18 us, nearly all of it the extra InferenceSession run of a tiny
island (~12 us through the binding). The Python bookkeeping of a run is ~3.5 us, of which the
feed checks ~2 us.

Session.run keeps no per-run state on the session, so it may be called from several threads.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from fusion.catalog import DOMAIN, Catalog
from fusion.graph import GraphView, ValueType
from fusion.io import FusionError, load_model
from fusion.islands import IslandPlan, IslandStep, KernelPlan, KernelStep, plan

__all__ = ["InvalidFeed", "NodeArg", "Profile", "Session"]

Progress = Callable[[str, int, int], None]  # (step name, index from 1, total)


_BLOCKED_LAYOUT_OPS = {"Conv", "ConvTranspose", "FusedConv"}  # ops NCHWc speeds up


def _may_hold_a_conv(node: onnx.NodeProto) -> bool:
    """A conv op, or a node whose function body or subgraphs (If, Loop, Scan) may hold one."""
    return (
        node.op_type in _BLOCKED_LAYOUT_OPS
        or node.domain not in ("", "ai.onnx")
        or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute
        )
    )


class InvalidFeed(FusionError, ValueError):
    """A run's feeds do not fit the model's inputs (missing, unknown, wrong dtype or rank)."""


@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, type ('tensor(float)') and shape (ints, strings, None)."""

    name: str
    type: str
    shape: list


def load(model_or_path: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    return load_model(model_or_path)


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
        model = load(model_or_path)
        if fuse and not is_fused(model):
            from fusion.rewriter import rewrite

            model = rewrite(model, catalog).model
        if catalog is None and is_fused(model):
            from fusion.catalog import default_catalog

            catalog = default_catalog()
        self.model, self.catalog = model, catalog or Catalog()
        self.threads = max(1, threads or os.cpu_count() or 1)
        self.view = view = GraphView(model)
        self._inputs = [
            _input_spec(view, vi) for vi in model.graph.input if vi.name not in view.initializers
        ]
        self._feedable = {vi.name for vi in model.graph.input}
        self._output_names = [o.name for o in model.graph.output]

        self._functions = {(f.domain, f.name, f.overload) for f in model.functions}
        plans = plan(view, self._has_kernel)
        self._base = _known_values(view, plans)
        kernels = [p for p in plans if isinstance(p, KernelPlan)]
        lock = None
        if kernels:
            _apply_threads(self.threads)
            lock = _workqueue_lock()
        self.steps: list[IslandStep | KernelStep] = []
        built = 0
        for p in plans:
            if isinstance(p, IslandPlan):
                self.steps.append(IslandStep(p, view, self._session_options(p)))
                continue
            built += 1
            if progress is not None:
                progress(p.name, built, len(kernels))
            self.steps.append(KernelStep(p, _serialized(self._make_kernel(p.node), lock)))
        self._uses_numba = bool(kernels)
        self._release = _last_uses(self.steps, set(self._output_names))
        for i, step in enumerate(self.steps):
            if isinstance(step, KernelStep):  # outputs nobody reads are not even stored
                dead = set(self._release[i]).intersection(step.outputs)
                step.live = tuple(k for k, n in enumerate(step.outputs) if n and n not in dead)
                self._release[i] = tuple(n for n in self._release[i] if n not in dead)

    # ---- building ----------------------------------------------------------------------------
    def _has_kernel(self, node: onnx.NodeProto) -> bool:
        if node.domain != DOMAIN:
            return False
        rule = self.catalog.get(node.op_type)
        if rule is not None and rule.kernel is not None:
            return True
        if (node.domain, node.op_type, node.overload) not in self._functions:
            raise FusionError(
                f"fused node {node.name or node.output[0]!r} ({node.op_type}) has no kernel in the "
                "catalog and no function body in the model, so nothing can run it"
            )
        return False  # runs in onnxruntime through its function body

    def _make_kernel(self, node: onnx.NodeProto) -> Callable[..., tuple]:
        attrs = {}
        for a in node.attribute:
            value = helper.get_attribute_value(a)
            attrs[a.name] = value.decode() if isinstance(value, bytes) else value
        constants = [self.view.constant(v) if v else None for v in node.input]
        return self.catalog.get(node.op_type).make_kernel(attrs, constants)

    def _session_options(self, island: IslandPlan | None = None) -> ort.SessionOptions:
        options = ort.SessionOptions()
        if island is not None and not any(_may_hold_a_conv(n) for n in island.nodes):
            # onnxruntime's default level also converts to its blocked NCHWc layout, which pays
            # for itself across convolutions; an island without one (pools between conv
            # kernels) only gets the reorders at its borders. Measured in a scratch
            # Session.profile of SqueezeNet 1.1 before the MaxPool2D rule, when its MaxPools
            # were such islands (2 threads): the four islands 1.55 -> 1.1 ms.
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.log_severity_level = 3  # errors only: warnings would break one-line stderr
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle onnxruntime workers must not spin while Numba's threads run a kernel.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        return options

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
        names = self._check_outputs(output_names)
        values = self._execute(feeds, None, keep_all=False)
        return [_fresh(values[n], n in self._base) for n in names]

    def run_with_intermediates(self, feeds: Mapping) -> dict[str, np.ndarray]:
        """Every value passed between steps (so every fused node's inputs and outputs), the feeds,
        constants and graph outputs, by name; values inside an island are not seen."""
        return self._execute(feeds, None, keep_all=True)

    def profile(self, feeds: Mapping, repeat: int = 10, warmup: int = 1) -> Profile:
        """Mean time per step over `repeat` runs, and the time spent between steps."""
        for _ in range(warmup):
            self._execute(feeds, None, keep_all=False)
        step_times = [0.0] * len(self.steps)
        wall = 0.0
        for _ in range(repeat):
            times: list[float] = []
            start = time.perf_counter()
            self._execute(feeds, times, keep_all=False)
            wall += time.perf_counter() - start
            step_times = [a + b for a, b in zip(step_times, times, strict=True)]
        rows = [(s.kind, s.name, t / repeat) for s, t in zip(self.steps, step_times, strict=True)]
        return Profile(rows, wall / repeat)

    # ---- running -----------------------------------------------------------------------------
    def _execute(self, feeds: Mapping, times: list | None, keep_all: bool) -> dict:
        values = dict(self._base)
        values.update(self._check_feeds(feeds))
        if self._uses_numba and getattr(_applied, "threads", None) != self.threads:
            _apply_threads(self.threads)  # Numba's thread count is per calling thread
        for step, release in zip(self.steps, self._release, strict=True):
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

    def _check_feeds(self, feeds: Mapping) -> dict[str, np.ndarray]:
        if not isinstance(feeds, dict) and not isinstance(feeds, Mapping):
            raise InvalidFeed(f"feeds must be a dict of input name -> array, not {type(feeds)}")
        checked = dict(feeds)
        for spec in self._inputs:
            value = checked.get(spec.name)
            if value is None:
                missing = [s.name for s in self._inputs if s.name not in feeds]
                raise InvalidFeed(
                    f"Required inputs ({missing}) are missing from input feed ({list(feeds)})."
                )
            checked[spec.name] = spec.check(value)
        if len(checked) > len(self._inputs):
            unknown = [name for name in feeds if name not in self._feedable]
            if unknown:
                known = ", ".join(spec.name for spec in self._inputs)
                raise InvalidFeed(f"Invalid input name: {unknown[0]} (the model's inputs: {known})")
        return checked

    def _check_outputs(self, output_names) -> list[str]:
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

    def check(self, value) -> np.ndarray:
        if type(value) is not np.ndarray:
            value = np.asarray(value, dtype=self.dtype)  # onnxruntime also accepts lists
        if self.dtype is not None and value.dtype != self.dtype:
            raise InvalidFeed(
                f"Unexpected input data type for input: {self.name}. "
                f"Actual: ({value.dtype}), expected: ({self.dtype})"
            )
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


def _last_uses(steps: list, keep: set[str]) -> list[tuple[str, ...]]:
    """Per step, the values no later step reads (graph outputs excepted): freed after it."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in (*step.inputs, *step.outputs):
            if name and name not in keep:
                last[name] = i
    release: list[list[str]] = [[] for _ in steps]
    for name, i in last.items():
        release[i].append(name)
    return [tuple(names) for names in release]


def _fresh(value: np.ndarray, shared: bool) -> np.ndarray:
    """Build-time values are shared between runs: hand the caller a copy it may modify."""
    return value.copy() if shared else value


# ---- threads ---------------------------------------------------------------------------------
_applied = threading.local()  # .threads: what this thread last gave Numba


def _apply_threads(threads: int) -> None:
    """Set Numba's thread count for the calling thread (at most the threads Numba started)."""
    import numba

    try:
        from kernels.config import set_threads
    except ImportError:  # kernels/ is optional for models whose kernels live elsewhere
        set_threads = numba.set_num_threads
    set_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    _applied.threads = threads


_WORKQUEUE_LOCK = threading.Lock()


def _workqueue_lock() -> threading.Lock | None:
    """Numba's fallback threading layer (workqueue, used when neither TBB nor OpenMP loads) must
    not run parallel kernels from two threads at once; the others may."""
    import numba

    if numba.config.THREADING_LAYER == "workqueue":
        return _WORKQUEUE_LOCK
    for pool in ("tbbpool", "omppool"):
        try:
            importlib.import_module(f"numba.np.ufunc.{pool}")
            return None
        except ImportError:
            continue
    return _WORKQUEUE_LOCK


def _serialized(kernel: Callable[..., tuple], lock: threading.Lock | None) -> Callable[..., tuple]:
    if lock is None:
        return kernel

    def run(*inputs):
        with lock:
            return kernel(*inputs)

    return run
