"""A fused node's kernel: whether a node gets one (`binds_kernel`), building it in one place (a
session's steps, verify's per-node check; a plugin's kernel sees read-only inputs), a model's
kernels built once for the sessions that share them (`build_kernels`), the cache Numba compiles
them into, and the thread settings applied before the first kernel runs.

A kernel is bound only to the node its rule writes: the node's function body is unchanged since
the rewrite (its content hash is still its `overload`) and the node has the inputs, outputs and
attributes that body declares. Any other `fusion`-domain node (a hand-edited body, another
tool's function that happens to share a rule's name, an attribute removed) runs its body in
onnxruntime, which is what plain onnxruntime would run, with a warning naming the node and why.

Numba is imported here only when a session has kernels to run: it is heavy (about a second to
import) and a rewrite or an all-onnxruntime session never needs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from fusion.catalog import DOMAIN, Catalog, Rule, Tactic
from fusion.errors import CatalogError, FusionError, FusionWarning, KernelError, one_line
from fusion.functions import content_hash
from fusion.graph import GraphView, node_label
from fusion.runtime.placement import place
from fusion.runtime.tactics import tactics_of

Kernel = Callable[..., tuple]  # run(*inputs) -> a sequence of outputs
# the packages of the built-in catalog and its kernels
BUILT_IN = ("fusion_kernels", "fusion_patterns")


def binds_kernel(rule: Rule | None, node: onnx.NodeProto, body: onnx.FunctionProto | None) -> bool:
    """Whether a fused node runs its rule's kernel (True) or its function body in onnxruntime
    (False; a FusionWarning says why when the rule has a kernel). FusionError when neither
    can run it."""
    label = node_label(node)
    if rule is None or rule.prepare is None:
        if body is None:
            raise FusionError(
                f"fused node {node.name or node.output[0]!r} ({node.op_type}) has no kernel in the "
                "catalog and no function body in the model, so nothing can run it"
            )
        return False
    reason = binding_refusal(rule, node, body)
    if reason is None:
        return True
    if body is None:
        raise FusionError(f"{label}: {reason}, and it has no function body: nothing can run it")
    warnings.warn(
        f"{label} runs its function body in onnxruntime, not the {rule.name} kernel: {reason}",
        FusionWarning,
        stacklevel=2,
    )
    return False


def binding_refusal(
    rule: Rule, node: onnx.NodeProto, body: onnx.FunctionProto | None
) -> str | None:
    """Why `rule`'s kernel must not run `node` (None: it may): its body's content hash is not
    its overload, or the node's inputs, outputs or attributes are not the body's. Without a
    body (onnxruntime could not run the node either) only the count of inputs is checked."""
    if body is None:
        if len(node.input) > len(rule.inputs):  # fewer: trailing optional inputs left out
            return f"it has {len(node.input)} inputs where the kernel takes {len(rule.inputs)}"
        return None
    if content_hash(body) != body.overload:
        return (
            f"its function body is not the one the rule writes (content hash "
            f"{content_hash(body)}, overload {body.overload or 'none'}): edited, or another "
            "tool's function"
        )
    if len(node.input) > len(body.input) or len(node.output) != len(body.output):
        return (
            f"it has {len(node.input)} inputs and {len(node.output)} outputs where its body "
            f"declares {len(body.input)} and {len(body.output)}"
        )
    declared, given = set(body.attribute), {a.name for a in node.attribute}
    if declared - given:
        return f"it lacks the attribute(s) {', '.join(sorted(declared - given))}"
    if given - declared:
        return f"its body does not declare the attribute(s) {', '.join(sorted(given - declared))}"
    return None


def node_attributes(node: onnx.NodeProto) -> dict:
    """A fused node's attributes as Python values (strings decoded): what its kernel gets."""
    attrs = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        attrs[a.name] = value.decode() if isinstance(value, bytes) else value
    return attrs


def build_kernel(rule: Rule | None, node: onnx.NodeProto, view: GraphView) -> Kernel:
    """The kernel of one fused node: its rule's prepare(attributes, constants), where constants
    holds, per input, the value of a constant input (None otherwise)."""
    if rule is None or rule.prepare is None:
        raise CatalogError(f"{node_label(node)}: no kernel registered for {node.op_type}")
    prepare_kernel_cache()
    constants = [view.constant(v) if v else None for v in node.input]
    try:
        # NaN/Inf in weights (a signalling NaN widened to float64, an overflow when a BatchNorm
        # is folded) are computed with as onnxruntime computes with them, not warned about.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            kernel = rule.prepare(node_attributes(node), constants)
    except Exception as exc:  # the factory validates what the pattern did not (a corrupt file)
        label = node_label(node)
        raise KernelError(
            f"{kernel_name(rule)} cannot be built for {label}: {type(exc).__name__}: "
            f"{one_line(exc)}",
            node=label,
            name=node.name,
        ) from exc
    return kernel if is_built_in(rule) else read_only_inputs(kernel)


# ---- a model's kernels -----------------------------------------------------------------------
Progress = Callable[[str, int, int], None]  # (node label, index from 1, total)


@dataclasses.dataclass(frozen=True, eq=False)
class BuiltKernels:
    """A fused model's kernels, each built once (building packs its weights), and what running
    them needs: the model, its graph view and functions, the catalog that made them, the
    thread count. Sessions on the same kernels under other policies share one
    (Session.with_tactics)."""

    model: onnx.ModelProto
    view: GraphView
    catalog: Catalog
    threads: int
    tactics: dict[int, list[Tactic]]  # per fused node a kernel runs (its index in view.nodes)
    functions: dict  # (domain, name, overload) -> the model's FunctionProto


def build_kernels(
    model: onnx.ModelProto, catalog: Catalog, threads: int, progress: Progress | None = None
) -> BuiltKernels:
    """The kernels of every fused node its rule's kernel may run (binds_kernel), each with its
    tactics, under the workqueue lock where Numba needs one. progress(node label, i, total) is
    called before kernel i of total is built (building may compile it: seconds on first use)."""
    view = GraphView(model)
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    fused = [
        i
        for i, node in enumerate(view.nodes)
        if node.domain == DOMAIN
        and binds_kernel(
            catalog.get(node.op_type),
            node,
            functions.get((node.domain, node.op_type, node.overload)),
        )
    ]
    tactics = {}
    if fused:
        use_threads(threads)  # before the first kernel is built (or compiled)
        lock = workqueue_lock()
    for built, i in enumerate(fused, 1):
        node = view.nodes[i]
        if progress is not None:
            progress(node_label(node), built, len(fused))
        kernel = build_kernel(catalog.get(node.op_type), node, view)
        tactics[i] = [dataclasses.replace(t, run=serialized(t.run, lock),
                                          bind=serialized_bind(t.bind, lock))
                      for t in tactics_of(kernel)]  # fmt: skip
    return BuiltKernels(model, view, catalog, threads, tactics, functions)


def is_built_in(rule: Rule) -> bool:
    """Whether a rule's kernel is one of this project's (patterns/ and kernels/), not a plugin's."""
    return rule.prepare.__module__.split(".")[0] in BUILT_IN


def read_only_inputs(kernel: Kernel) -> Kernel:
    """The kernel, and each tactic it offers, called with read-only views of its array inputs.

    A run's inputs are the caller's feeds, the session's constants and values that other steps
    still read, and timing calls a kernel many times on the same arrays: a kernel that wrote
    into one (`np.maximum(x * s, 0, out=x)`) would change the caller's data and compound. A
    view is O(1), and a write into it raises ValueError. Plugin kernels get this; the built-in
    ones (BUILT_IN) write only their own arrays, and Numba would compile each of them a second
    time for read-only arguments (another type)."""
    guarded = _guarded(kernel)
    offered = getattr(kernel, "tactics", None)
    if offered:
        # bound calls skip the guard: a plugin's tactic runs checked, every call
        guarded.tactics = [dataclasses.replace(t, run=_guarded(t.run), bind=None) for t in offered]
    return guarded


def _guarded(run: Kernel) -> Kernel:
    def guarded(*inputs):
        views = [_read_only(a) for a in inputs]
        try:
            return run(*views)
        except ValueError as exc:
            if "read-only" in str(exc):  # NumPy's words for a write into one of the views
                raise ValueError(f"{exc} (a kernel's inputs are read-only)") from exc
            raise

    return guarded


def _read_only(value):
    if type(value) is not np.ndarray:
        return value  # None for an absent input
    view = value.view()
    view.flags.writeable = False
    return view


def kernel_name(rule: Rule) -> str:
    """How messages name a rule's kernel: its module and function."""
    return f"{rule.prepare.__module__}.{rule.prepare.__qualname__}"


# ---- the kernel cache ------------------------------------------------------------------------
_cache_lock = threading.Lock()
_cache_ready = False


def prepare_kernel_cache() -> None:
    """Give Numba a writable cache before it is first imported (it reads NUMBA_CACHE_DIR then).

    Numba caches a kernel in __pycache__ beside its source, else in ~/.cache/numba, and fails
    when it can write neither: a wheel installed by root and run by a user without a writable
    home (a container, a service). Then the cache goes to a private folder in the temp
    directory, with one warning; with none writable, a FusionError says so."""
    global _cache_ready
    with _cache_lock:
        if _cache_ready:
            return
        reason = _unwritable_cache()
        if reason:
            folder = Path(tempfile.gettempdir()) / f"fusion-numba-cache-{os.getuid()}"
            if not _private_folder(folder):
                raise FusionError(
                    f"no writable folder for the kernel cache ({reason}, and neither is {folder}); "
                    "set NUMBA_CACHE_DIR to one"
                )
            os.environ["NUMBA_CACHE_DIR"] = str(folder)
            if "numba" in sys.modules:  # imported already (by a plugin): tell its config too
                sys.modules["numba"].config.CACHE_DIR = str(folder)
            warnings.warn(
                f"{reason}: compiled kernels are cached in {folder}", FusionWarning, stacklevel=3
            )
        _cache_ready = True


def _unwritable_cache() -> str | None:
    """Why Numba could not cache the kernels package's functions (None: it can)."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    if chosen:
        return None if _writable(Path(chosen)) else f"NUMBA_CACHE_DIR {chosen} is not writable"
    spec = importlib.util.find_spec("fusion_kernels")
    if spec is None or not spec.submodule_search_locations:
        return None  # no kernels package: nothing of ours to cache
    in_tree = Path(next(iter(spec.submodule_search_locations))) / "__pycache__"
    if _writable(in_tree):
        return None
    try:
        user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba"
    except (RuntimeError, KeyError):  # no home directory at all
        return f"{in_tree} is not writable and there is no home directory"
    if _writable(user):
        return None
    return f"neither {in_tree} nor {user} is writable"


def _writable(folder: Path) -> bool:
    """Numba's own test: the folder can be made and a file created in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        return True
    except OSError:
        return False


def _private_folder(folder: Path) -> bool:
    """`folder` exists (made if need be), is a real directory of this user that no one else
    can write (a shared temp directory must not let another user plant cache files), and is
    writable."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return False
    own = st.st_uid == os.getuid() and not st.st_mode & 0o022
    return folder.is_dir() and not folder.is_symlink() and own and _writable(folder)


# ---- threads ---------------------------------------------------------------------------------
_applied = threading.local()  # .threads: what this thread last gave Numba


def use_threads(threads: int) -> None:
    """Give Numba `threads` (at most the threads it started) for the calling thread. The first
    call also applies the kernels' thread settings, before Numba starts its thread pool, and
    their memory settings (kernels/config.py: large tensors reused, not mapped per run)."""
    prepare_kernel_cache()  # before Numba is imported: it reads NUMBA_CACHE_DIR then
    import numba  # heavy: only once a session has kernels

    try:
        from fusion_kernels.config import apply_memory_settings, apply_thread_settings, set_threads
    except ImportError:  # kernels/ is optional for models whose kernels live elsewhere
        apply_thread_settings, set_threads = (lambda: None), numba.set_num_threads
        apply_memory_settings = lambda: None  # noqa: E731
    apply_thread_settings()
    apply_memory_settings()
    given = min(threads, numba.config.NUMBA_NUM_THREADS)
    set_threads(given)
    place(given)  # each worker on a CPU of its own, the runs' thread on another
    _applied.threads = threads


def ensure_threads(threads: int) -> None:
    """use_threads, unless the calling thread already gave Numba this count (it is per thread)."""
    if getattr(_applied, "threads", None) != threads:
        use_threads(threads)


_WORKQUEUE_LOCK = threading.Lock()


def workqueue_lock() -> threading.Lock | None:
    """Numba's fallback threading layer (workqueue, used when neither TBB nor OpenMP loads) must
    not run parallel kernels from two threads at once; the others may."""
    import numba  # heavy: only once a session has kernels

    if numba.config.THREADING_LAYER == "workqueue":
        return _WORKQUEUE_LOCK
    for pool in ("tbbpool", "omppool"):
        try:
            importlib.import_module(f"numba.np.ufunc.{pool}")
            return None
        except ImportError:
            continue
    return _WORKQUEUE_LOCK


def serialized_bind(bind, lock: threading.Lock | None):
    """A tactic's bind (Tactic.bind) and the calls it binds, run under `lock` when there is
    one (None stays None)."""
    if bind is None or lock is None:
        return bind

    def bound(*inputs):
        with lock:
            call = bind(*inputs)
        return None if call is None else serialized(call, lock)

    return bound


def serialized(kernel: Kernel, lock: threading.Lock | None) -> Kernel:
    """The kernel, run under `lock` when there is one."""
    if lock is None:
        return kernel

    def run(*inputs):
        with lock:
            return kernel(*inputs)

    return run
