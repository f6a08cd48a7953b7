"""A fused node's kernel: built in one place (a session's steps, verify's per-node check), and
the thread settings applied before the first kernel runs.

Numba is imported here only when a session has kernels to run: it is heavy (about a second to
import) and a rewrite or an all-onnxruntime session never needs it.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

import onnx
from onnx import helper

from fusion.catalog import Rule
from fusion.errors import CatalogError
from fusion.graph import GraphView, node_label

Kernel = Callable[..., tuple]  # run(*inputs) -> a sequence of outputs


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
    constants = [view.constant(v) if v else None for v in node.input]
    return rule.prepare(node_attributes(node), constants)


# ---- threads ---------------------------------------------------------------------------------
_applied = threading.local()  # .threads: what this thread last gave Numba


def use_threads(threads: int) -> None:
    """Give Numba `threads` (at most the threads it started) for the calling thread. The first
    call also applies the kernels' thread settings, before Numba starts its thread pool."""
    import numba  # heavy: only once a session has kernels

    try:
        from kernels.config import apply_thread_settings, set_threads
    except ImportError:  # kernels/ is optional for models whose kernels live elsewhere
        apply_thread_settings, set_threads = (lambda: None), numba.set_num_threads
    apply_thread_settings()
    set_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
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


def serialized(kernel: Kernel, lock: threading.Lock | None) -> Kernel:
    """The kernel, run under `lock` when there is one."""
    if lock is None:
        return kernel

    def run(*inputs):
        with lock:
            return kernel(*inputs)

    return run
