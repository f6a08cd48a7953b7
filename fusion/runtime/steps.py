"""The steps a run executes, each reading and writing the run's dict of values: an island's
onnxruntime session (IslandStep), one fused node's kernel with its outputs checked against the
node's type (KernelStep, OutputCheck), and the layout conversions between them (ConvertStep, in
fusion/runtime/layout.py). `releases` says which values each step leaves for no one: a run
drops them there, as onnxruntime frees its activations. Which nodes form the islands is pure
graph planning (fusion/runtime/plan.py); `assemble` turns it and each fused node's tactic into
a RunPlan, converting layouts where a blocked tactic meets the rest, and `RunPlan.run` is the
run loop.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime
from onnx import helper, numpy_helper

from fusion.catalog import DOMAIN, Tactic
from fusion.errors import FusionWarning, KernelError, one_line
from fusion.graph import GraphView, ValueType, node_label
from fusion.ort import ISLAND, Settings, inference_session
from fusion.runtime import placement
from fusion.runtime.kernel import BuiltKernels, ensure_threads, kernel_name
from fusion.runtime.layout import NCHW, Layouts, convert, out_block
from fusion.runtime.plan import (
    IslandPlan,
    KernelPlan,
    island_model,
    island_settings,
    plan,
    run_body,
)
from fusion.runtime.tactics import ONNXRUNTIME

# Ops whose outputs are a function of their inputs' shapes alone, and ops that are not a
# function of their inputs at all (an island holding one is never answered from memory).
_SHAPE_OPS = frozenset({"Shape", "Size"})
_RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform",
                         "RandomUniformLike", "Multinomial", "Bernoulli"})  # fmt: skip
_MEMO_KEYS = 16  # keys remembered per island before the memory starts afresh
_MEMO_BYTES = 1 << 20  # outputs kept up to this size (shapes, masks): a copy beats the call
_KEY_VALUES = 1 << 12  # integers an input read by value may hold to be part of a memo key
_BOUND_SHAPES = 16  # input shapes a kernel step keeps its tactic bound for
BOUND = object()  # what a kernel step returns from the call that bound its tactic


def memo_inputs(island: IslandPlan) -> list[str] | None:
    """The inputs whose values (not only shapes) an island reads, if its outputs depend on
    nothing else: no node draws random numbers or holds a subgraph (None: they may). An input
    read only by Shape or Size nodes counts by its shape and dtype alone. Transformer exports
    compute each layer's Reshape targets from the previous layer's output so (Shape, Gather,
    Unsqueeze, Concat: ~50 us of onnxruntime a layer), and their masks from small integer
    tensors."""
    inputs, read = set(island.inputs), set()
    for node in island.nodes:
        if node.op_type in _RANDOM_OPS or node.domain not in ("", "ai.onnx"):
            return None
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):  # fmt: skip
            return None
        if node.op_type not in _SHAPE_OPS:
            read.update(inputs.intersection(node.input))
    return [v for v in island.inputs if v in read] if island.nodes else None


def same_values(island: IslandPlan, view: GraphView) -> np.dtype | None:
    """The dtype an island of one Identity or one Cast passes its input through unchanged when
    the input already has it (None: not such an island). Llama exports
    cast each residual sum to float32 before its RMSNorm, a float32 already: an island of its
    own between two kernels, 30-35 us of onnxruntime each. Not when the output is a graph
    output (the caller would get one array under two names)."""
    if len(island.nodes) != 1 or len(island.inputs) != 1 or len(island.outputs) != 1:
        return None
    node = island.nodes[0]
    if node.domain not in ("", "ai.onnx") or view.is_graph_output(island.outputs[0]):
        return None
    if node.op_type == "Identity":
        vt = view.type_of(node.input[0])
        to = vt.elem_type if vt is not None else 0
    elif node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), 0)
    else:
        return None
    if to in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
        return None
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(to))
    except (KeyError, TypeError, ValueError):  # a type NumPy has no dtype for (float8, ...)
        return None


class IslandStep:
    """Runs one island's onnxruntime session on values from the run's dict. An island whose
    outputs depend only on its inputs' shapes and on the values of small integer inputs that
    are not the model's feeds (memo_inputs: a mask built from attention_mask, yes; embeddings
    of the token ids, no), and are at most _MEMO_BYTES, runs once per such key after the key
    has come twice: its outputs are kept, and copies of them handed out to later runs of the
    same key (a copy: a step downstream may own and write what it is given). An island of one
    Identity or same-dtype Cast passes its input on (same_values)."""

    kind = "island"

    def __init__(self, island: IslandPlan, view: GraphView, settings: Settings, threads: int):
        self.name, self.inputs, self.outputs = island.name, island.inputs, island.outputs
        self.nodes = [n.name or n.output[0] for n in island.nodes]
        self._read = memo_inputs(island)  # inputs read by value (small integers: in the key)
        if self._read is not None and set(self._read) & set(view.graph_inputs):
            self._read = None  # the feeds themselves (token ids): new on every call in use
        self._memo: dict | None = None if self._read is None else {}
        self._seen: set = set()  # keys met once: their outputs are kept when they come again
        self._same = same_values(island, view)
        self.settings, self.threads = settings, threads
        self._island, self._view = island, view
        self._lock = threading.Lock()
        self.session: onnxruntime.InferenceSession | None = None
        self._run: Callable | None = None
        types = {v: view.type_of(v) for v in island.inputs}
        if all(t is not None and t.elem_type for t in types.values()):
            self.session = self._build(types)
        # else: an input's dtype is only known from the first run's actual value

    def _build(self, types: dict) -> onnxruntime.InferenceSession:
        self.model = island_model(self._view, self._island, types)
        with placement.released():  # its pool's threads get the CPUs of the caller, not of a run
            built = inference_session(self.model, self.settings, self.threads)
        # InferenceSession.run re-validates the feeds in Python (a third of a crossing's cost);
        # the steps already pass exactly the island's inputs, so call the binding.
        self._run = getattr(built, "_sess", built).run
        return built

    def _build_from(self, values: dict) -> Callable:
        with self._lock:
            if self.session is None:
                types = {}
                for v in self.inputs:
                    declared = self._view.type_of(v)
                    elem = helper.np_dtype_to_tensor_dtype(values[v].dtype)
                    shape = declared.shape if declared and declared.elem_type == elem else None
                    types[v] = ValueType(elem, shape)
                self.session = self._build(types)
        return self._run

    def _key(self, feeds: dict) -> tuple | None:
        """The memo's key for these feeds: every input's shape and dtype, and the bytes of
        those read by value when they are small integer or boolean arrays (None: an input read
        by value is a float or large tensor: this call is not answered from memory)."""
        for name in self._read:
            v = feeds[name]
            if type(v) is not np.ndarray or v.dtype.kind not in "biu" or v.size > _KEY_VALUES:
                return None
        shapes = tuple((v.shape, v.dtype.str) for v in feeds.values())
        return shapes + tuple(feeds[name].tobytes() for name in self._read)

    def __call__(self, values: dict, keep_all: bool = True) -> None:
        if self._same is not None:
            value = values[self.inputs[0]]
            if type(value) is np.ndarray and value.dtype == self._same:
                values[self.outputs[0]] = value  # onnxruntime would copy it, and take 30 us
                return
        feeds = {name: values[name] for name in self.inputs}
        key, memo = None, self._memo  # one reference: another thread's run may drop the memo
        if memo is not None:
            key = self._key(feeds)
            known = None if key is None else memo.get(key)
            if known is not None:
                values.update(zip(self.outputs, [r.copy() for r in known], strict=True))
                return
        run = self._run or self._build_from(values)
        results = run(self.outputs, feeds, None)
        if key is not None:
            if (
                not all(type(r) is np.ndarray for r in results)
                or sum(r.nbytes for r in results) > _MEMO_BYTES
            ):
                self._memo = None  # a tensor, not shapes: copying it is no cheaper than this
            elif key in self._seen:  # a second time: kept (a key met once costs its hash)
                if len(memo) >= _MEMO_KEYS:
                    memo.clear()
                memo[key] = [r.copy() for r in results]
            else:
                if len(self._seen) >= 4 * _MEMO_KEYS:
                    self._seen.clear()
                self._seen.add(key)
        values.update(zip(self.outputs, results, strict=True))


@dataclass(frozen=True)
class OutputCheck:
    """What a kernel output must be, from the node's declared or inferred type: its dtype and,
    when known, its rank and fixed sizes; a symbolic size (N) takes any value. Where an island
    reads the value the sizes are `fixed` (the island's session declares them and would refuse
    another size, naming the island instead of the kernel). Elsewhere (graph outputs, values
    between kernels) they are `claimed`: onnx's shape inference and onnxruntime disagree on some
    pooling sizes, and onnxruntime does not enforce a graph output's declared shape, so a size
    that differs is checked against the node's function body in onnxruntime before it is
    called wrong (KernelStep). `declared` is the shape as written, for messages."""

    name: str
    dtype: np.dtype | None
    rank: int | None
    fixed: tuple[tuple[int, int], ...]  # (axis, size) for every axis of declared size
    claimed: tuple[tuple[int, int], ...] = ()  # declared sizes a second opinion must confirm
    declared: tuple | None = None  # ints, and names (or None) for the sizes not fixed

    @staticmethod
    def of(name: str, vt: ValueType | None, sizes: bool = True) -> OutputCheck:
        if vt is None or not vt.elem_type:
            return OutputCheck(name, None, None, ())
        dtype = helper.tensor_dtype_to_np_dtype(vt.elem_type)
        shape = vt.shape
        fixed = tuple((k, d) for k, d in enumerate(shape or ()) if isinstance(d, int) and d > 0)
        rank = None if shape is None else len(shape)
        declared = None if shape is None else tuple(shape)
        if sizes:
            return OutputCheck(name, dtype, rank, fixed, (), declared)
        return OutputCheck(name, dtype, rank, (), fixed, declared)

    def mismatch(self, value) -> str | None:
        """Why `value` is not what the node declares, its claimed sizes aside (None: it fits)."""
        if type(value) is not np.ndarray:
            return f"a {type(value).__name__}, not a NumPy array"
        if self.dtype is not None and value.dtype != self.dtype:
            return f"dtype {value.dtype} where the node declares {self.dtype}"
        if self.rank is not None and value.ndim != self.rank:
            return f"shape {list(value.shape)} where the node declares rank {self.rank}"
        return _sizes_differ(value.shape, self.fixed)

    def shape_words(self) -> str:
        """The declared shape as a user reads it: [N, 5] (? for a size not declared)."""
        dims = ", ".join("?" if d is None or d == "" else str(d) for d in self.declared or ())
        return f"[{dims}]"


def _sizes_differ(shape: tuple, sizes) -> str | None:
    """Which of the (axis, size) pairs `shape` does not have, in words (None: it has them)."""
    for axis, size in sizes:
        if shape[axis] != size:
            return f"shape {list(shape)} where the node declares size {size} on axis {axis}"
    return None


class KernelStep:
    """Calls one fused node's kernel; absent optional inputs are passed as None.

    A kernel returns a sequence of outputs, a tuple or any Sequence. `live` (set by the session)
    lists the positions that later steps read: a run stores only those, unless it keeps every
    value, so a kernel whose outputs are views made on demand makes only those (an unrolled
    LSTM's fused node has an output per step, and a run reads three of them).

    Each stored output is checked against the node's type (OutputCheck); a kernel that raises
    or returns what the node does not declare is a KernelError naming the kernel and the node.
    A run with an empty input (batch 0) does not call the kernel: `body` (the node's function
    body in onnxruntime) computes the empty outputs and their shapes."""

    kind = "kernel"

    def __init__(
        self,
        kernel: KernelPlan,
        run: Callable[..., tuple],
        checks: Sequence[OutputCheck] = (),
        body: Callable[[list], list] | None = None,
        kernel_name: str = "",
        varying: Sequence[int] | None = None,
    ):
        self.name, self.node = kernel.name, kernel.node
        self.inputs, self.outputs = kernel.inputs, kernel.outputs
        self.kernel = run
        self.checks = tuple(checks) or tuple(OutputCheck.of(v, None) for v in self.outputs)
        self.body = body
        # the inputs a run may make empty (not build-time constants); default: every given one
        self.varying = (
            tuple(k for k, v in enumerate(self.inputs) if v) if varying is None else tuple(varying)
        )
        self.kernel_name = kernel_name or "the kernel"
        self.live: tuple[int, ...] | None = None  # None: every output
        self._body_shapes: dict = {}  # (output, input shapes) -> the shape the body gave
        # Per output, the last shape that had every declared size: a run whose shapes repeat
        # checks each output with one tuple comparison (and its type and dtype).
        self._passed: list[tuple | None] = [None] * len(self.outputs)
        self.bind: Callable | None = None  # the tactic's (Tactic.bind), set by assemble
        self._bound: dict = {}  # (threads, varying inputs' shapes) -> bound run, or False
        self._threads: Callable[[], int] | None = None  # kernels.config.get_threads

    def __call__(self, values: dict, keep_all: bool = True) -> Callable | object | None:
        """The step on `values`. Returns the bound run it took, BOUND where this call bound
        the tactic for these shapes, else None (RunPlan._record reads it)."""
        args = [values[name] if name else None for name in self.inputs]
        if self._bound:  # the tactic bound for these input shapes: no checks, no look-ups
            key = (self._threads(), *[args[k].shape for k in self.varying])
            fast = self._bound.get(key)
            if fast:
                try:
                    results = fast(*args)
                except Exception as exc:
                    raise self._failed(exc) from exc
                stored = range(len(self.outputs)) if keep_all or self.live is None else self.live
                for i in stored:
                    values[self.outputs[i]] = results[i]
                return fast
        for k in self.varying:
            if args[k].size == 0 and self.body is not None:
                results = self.body(args)  # nothing to compute: onnxruntime gives the shapes
                break
        else:
            try:
                results = self.kernel(*args)
            except Exception as exc:
                raise self._failed(exc) from exc
        if type(results) is not tuple and not isinstance(results, Sequence):  # (ABC: 0.3 us)
            results = tuple(results)  # a generator, say
        if len(results) != len(self.outputs):
            raise self._error(f"returned {len(results)} outputs; the node has {len(self.outputs)}")
        stored = range(len(self.outputs)) if keep_all or self.live is None else self.live
        checks, passed = self.checks, self._passed
        for i in stored:
            value = results[i]
            if (  # the common case in three comparisons
                type(value) is not np.ndarray
                or value.shape != passed[i]
                or value.dtype != checks[i].dtype
            ):
                self._check(args, i, value)
            values[self.outputs[i]] = value
        if self.bind is not None and not any(args[k].size == 0 for k in self.varying):
            return self._bind(args)
        return None

    def _bind(self, args: list) -> object | None:
        """After a checked call on these input shapes, the tactic's run specialized for them
        (Tactic.bind), which later calls with the same shapes (and thread count) take: their
        outputs have the shapes and types this call's passed with. False where the tactic
        declines, or fails to bind (a FusionWarning): those calls stay on this path. Returns
        BOUND when it bound the tactic."""
        if self._threads is None:
            from fusion_kernels.config import get_threads  # heavy (Numba): a kernel has run

            self._threads = get_threads
        key = (self._threads(), *[args[k].shape for k in self.varying])
        if key in self._bound or len(self._bound) >= _BOUND_SHAPES:
            return None
        try:
            self._bound[key] = self.bind(*args) or False
            return BOUND if self._bound[key] else None
        except Exception as exc:  # noqa: BLE001 (the checked path still runs it: a warning)
            self._bound[key] = False
            warnings.warn(f"{self.kernel_name} of {self.name}: its tactic could not be bound to "
                          f"these shapes ({type(exc).__name__}: {one_line(exc)}); its calls "
                          "stay on the checked path", FusionWarning, stacklevel=3)  # fmt: skip

    def _check(self, args: list, i: int, value) -> None:
        """Output i against its OutputCheck; a shape with every declared size is remembered."""
        check = self.checks[i]
        reason = check.mismatch(value)
        if reason is not None:
            declared = f" (declared {check.shape_words()})" if check.declared is not None else ""
            raise self._error(f"returned {reason} for {self.outputs[i]}{declared}")
        if _sizes_differ(value.shape, check.claimed) is None:
            self._passed[i] = value.shape
        else:
            self._confirm_sizes(args, i, value)  # right for these input shapes only

    def _confirm_sizes(self, args: list, i: int, value: np.ndarray) -> None:
        """Output i's sizes differ from the declared ones: right only if the node's function
        body gives the same sizes on these inputs (asked once per input shapes). Without a
        body to ask (a tactic reading the blocked layout), as onnxruntime, not enforced."""
        if self.body is None:
            return
        key = (i, *(None if a is None else a.shape for a in args))
        want = self._body_shapes.get(key)
        if want is None:
            k = sum(1 for v in self.node.output[:i] if v)  # the body has no "" outputs
            want = self.body(args)[k].shape
            if len(self._body_shapes) < 64:  # a few input shapes in practice; bounded anyway
                self._body_shapes[key] = want
        if want != value.shape:
            raise self._error(
                f"returned shape {list(value.shape)} for {self.outputs[i]} where the node's "
                f"function body gives {list(want)} (declared {self.checks[i].shape_words()})"
            )

    def _failed(self, exc: Exception) -> KernelError:
        """The KernelError of a kernel (checked or bound) that raised `exc`."""
        return self._error(f"failed: {type(exc).__name__}: {one_line(exc)}")

    def _error(self, what: str) -> KernelError:
        return KernelError(
            f"{self.kernel_name} of {self.name} {what}", node=self.name, name=self.node.name
        )


def releases(steps: list[IslandStep | KernelStep], keep: set[str]) -> list[tuple[str, ...]]:
    """Per step, the values no later step reads (those in `keep`, the graph outputs, excepted):
    a run drops them after that step. Also sets each kernel step's `live`: a kernel output that
    nothing reads is not even stored."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in (*step.inputs, *step.outputs):
            if name and name not in keep:
                last[name] = i
    dropped: list[list[str]] = [[] for _ in steps]
    for name, i in last.items():
        dropped[i].append(name)
    for i, step in enumerate(steps):
        if isinstance(step, KernelStep):
            dead = set(dropped[i]).intersection(step.outputs)
            step.live = tuple(k for k, n in enumerate(step.outputs) if n and n not in dead)
            dropped[i] = [n for n in dropped[i] if n not in dead]
    return [tuple(names) for names in dropped]


# ---- a run's plan: the steps for some choices -------------------------------------------------
@dataclass
class RunPlan:
    """The steps of a run in order, and what its loop needs besides them."""

    steps: list  # IslandStep | KernelStep | ConvertStep, in run order
    releases: list  # per step, the values dropped after it
    layouts: Layouts  # the blocked values and what they hold
    uses_numba: bool
    choices: dict  # fused node label -> tactic name
    threads: int
    ran: int = 0  # runs finished: the first one's threads are left unplaced (see run)
    # key -> the run's calls for inputs of those shapes, once each kernel step has bound its
    # tactic (`_record`, `_replay`; up to _BOUND_SHAPES keys); see `_key`
    programs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # the values no step writes (None: not listed yet; empty: the plan does not replay)
    _entries: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def run(self, values: dict, times: list | None = None, keep_all: bool = False) -> dict:
        """One run on `values` (feeds and known values, by name), which it updates and returns:
        the graph outputs and whatever no step released (keep_all: every value, each also in
        NCHW under its own name). times, when given, gets each step's seconds."""
        if self.uses_numba:
            ensure_threads(self.threads)  # Numba's thread count is per calling thread
        key = self._key(values) if times is None and not keep_all else None
        placed = None
        try:
            # From the second run: the first may compile kernels, seconds of one thread that a
            # CPU held for the run would keep beside another process's (fusion/runtime/placement)
            if self.uses_numba and self.ran:
                placed = placement.enter()
            calls = None if key is None else self.programs.get(key)
            if calls is not None:
                _replay(calls, values)
            else:
                took = []  # what each step returned: the bound run it took, if any
                for step, release in zip(self.steps, self.releases, strict=True):
                    if key is not None:
                        took.append(step(values, keep_all))
                    elif times is None:
                        step(values, keep_all)
                    else:
                        start = time.perf_counter()
                        step(values, keep_all)
                        times.append(time.perf_counter() - start)
                    if not keep_all:
                        for name in release:  # an activation is freed after its last reader
                            del values[name]
                if key is not None:
                    self._record(key, took)
        finally:
            if self.uses_numba:
                placement.leave(placed)
        self.ran += 1
        if keep_all:
            from fusion_kernels.blocked import from_blocked  # heavy: Numba (blocked values exist)

            for name, (plain, channels) in self.layouts.blocked.items():
                if name in values and plain not in values:
                    values[plain] = from_blocked(values[name], channels)
        return values

    def _key(self, values: dict) -> tuple | None:
        """The thread count and the shapes of the values no step writes, when a run of this
        plan may replay its calls: every step a kernel or a layout conversion, and those values
        float arrays. A kernel's output shapes then follow from its inputs' shapes (what its
        bound run is keyed on, with the thread count: KernelStep._bind). Not so where a value
        may set a shape: an island may compute one (a Reshape's target from a mask), and a
        kernel may take an integer input that does (LinearGelu's Reshape targets, when the
        model feeds them); there the steps keep their own checks."""
        if self._entries is None:
            written: set[str] = set()
            entries: dict[str, None] = {}
            for step in self.steps:
                if getattr(step, "kind", None) not in ("kernel", "convert"):
                    entries = {}
                    break
                read = [step.inputs[k] for k in getattr(step, "varying", range(len(step.inputs)))]
                entries.update((n, None) for n in read if n and n not in written)  # no constants
                written.update(n for n in step.outputs if n)
            self._entries = tuple(entries)
        if not self._entries:
            return None
        key = [0]
        if self.uses_numba:
            from fusion_kernels.config import get_threads  # loaded: the plan has run kernels

            key[0] = get_threads()
        for name in self._entries:
            value = values[name]
            if type(value) is not np.ndarray or value.dtype.kind != "f":
                return None
            key.append(value.shape)
        return tuple(key)

    def _record(self, key: tuple, took: list) -> None:
        """After a run on inputs of shapes `key`, the bound runs its kernel steps took (`took`,
        what each step returned in that run), as the plan's program for that key: later runs
        on the same shapes call them in order, without each step's look-ups (~1 us a step:
        110.7 -> 90.1 us of mobilenet_v3_small's run at batch 1 with its kernels stubbed,
        bench/NOTES.md). A step that took no bound run (its tactic declined to bind, a layout
        conversion) is called as a step, with its own checks. A run in which a step bound its
        tactic records nothing: the next run takes that bound run, and records."""
        if len(self.programs) >= _BOUND_SHAPES or any(run is BOUND for run in took):
            return
        calls = []
        for step, release, run in zip(self.steps, self.releases, took, strict=True):
            if not isinstance(step, KernelStep) or run is None:
                calls.append((None, step, (), (), release))
                continue
            live = range(len(step.outputs)) if step.live is None else step.live
            stored = tuple((k, step.outputs[k]) for k in live)
            calls.append((run, step, tuple(step.inputs), stored, release))
        self.programs[key] = calls


def _replay(calls: list, values: dict) -> None:
    """A RunPlan's program on `values`: each kernel's bound run on the values it reads, its
    outputs stored and the values no later step reads released, as the steps would (a
    kernel that raises: the step's KernelError, naming it and its node)."""
    for run, step, inputs, stored, release in calls:
        if run is None:
            step(values, False)  # called as a step
        else:
            try:
                results = run(*[values[n] if n else None for n in inputs])
            except Exception as exc:
                raise step._failed(exc) from exc
            for k, name in stored:
                values[name] = results[k]
        for name in release:
            del values[name]


def assemble(
    built: BuiltKernels, outputs: Sequence[str], choices: dict[int, Tactic | None]
) -> RunPlan:
    """The run steps for these choices (per fused node a kernel runs, its tactic, or None for
    its body in onnxruntime): islands, kernels, and layout conversions."""
    view = built.view
    chosen = {id(view.nodes[i]): t for i, t in choices.items() if t is not None}
    plans = plan(view, lambda node: id(node) in chosen)
    island_inputs = {v for p in plans if isinstance(p, IslandPlan) for v in p.inputs}
    layouts = Layouts()
    # the block of every blocked output (the process's: asked only when a kernel writes one)
    written = out_block() if any(t.blocked_outputs for t in chosen.values()) else None
    steps: list = []
    for p in plans:
        if isinstance(p, IslandPlan):
            for value in p.inputs:
                steps += convert(layouts, value, NCHW)
            settings = island_settings(p, alone=not chosen)
            steps.append(IslandStep(p, view, settings, built.threads))
            for value in p.outputs:
                layouts.made(value, NCHW)
            continue
        tactic = chosen[id(p.node)]
        checks = [
            OutputCheck(v, np.dtype(np.float32), 5, ())  # blocked: [N, C/b, H, W, b]
            if k in tactic.blocked_outputs
            else OutputCheck.of(v, view.type_of(v) if v else None, sizes=v in island_inputs)
            for k, v in enumerate(p.outputs)
        ]
        rule = built.catalog.get(p.node.op_type)
        varying = [k for k, v in enumerate(p.inputs) if v and view.constant(v) is None]
        # An empty input (batch 0) runs the node's body for its output shapes; a blocked
        # tactic's inputs are not the body's, and its kernels return empty outputs.
        body = None if tactic.blocked_inputs else _body_runner(built, p.node)
        step = KernelStep(p, tactic.run, checks, body, kernel_name(rule), varying)
        step.inputs, step.outputs, step.choice = list(p.inputs), list(p.outputs), tactic.name
        step.depth_first, step.bind = tactic.depth_first, tactic.bind
        blocked_in = dict(zip(tactic.blocked_inputs, tactic.in_blocks, strict=True))
        for pos, value in enumerate(p.inputs):
            if value:
                form = blocked_in.get(pos, NCHW)
                steps += convert(layouts, value, form)
                step.inputs[pos] = layouts.made(value, form) if form != NCHW else value
        out_channels = dict(zip(tactic.blocked_outputs, tactic.out_channels, strict=True))
        for pos, value in enumerate(p.outputs):
            if value:
                form = written if pos in out_channels else NCHW
                step.outputs[pos] = layouts.made(value, form, out_channels.get(pos))
        steps.append(step)
    for value in outputs:
        steps += convert(layouts, value, NCHW)
    uses_numba = any(s.kind != "island" for s in steps)
    choice = {s.name: s.choice for s in steps if s.kind == "kernel"}
    for i, t in choices.items():
        if t is None:
            choice[node_label(view.nodes[i])] = ONNXRUNTIME
    return RunPlan(steps, releases(steps, set(outputs)), layouts, uses_numba, choice,
                   built.threads)  # fmt: skip


def _body_runner(built: BuiltKernels, node: onnx.NodeProto) -> Callable[[list], list] | None:
    """The node's function body in onnxruntime (for runs a kernel is not called on)."""
    if (node.domain, node.op_type, node.overload) not in built.functions:
        return None
    return lambda args: run_body(built.model, node, args, ISLAND)


def known_values(view: GraphView, outputs: Sequence[str]) -> dict[str, np.ndarray]:
    """Values known at build time that a run reads from its dict: constants read by fused
    nodes (whatever runs them) or returned as graph outputs, and the defaults of initializers
    that a feed may override. Constants only islands read live inside their islands."""
    wanted = set(outputs) | (set(view.initializers) & {i.name for i in view.graph.input})
    for node in view.nodes:
        if node.domain == DOMAIN:
            wanted.update(node.input)
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
