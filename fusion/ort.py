"""The one place that builds onnxruntime sessions; their settings are named here.

    inference_session(model, REFERENCE)            # the oracle: verify, check_pattern, the tests
    inference_session(model, DEFAULT, threads=2)   # what users run (the rival in a process of
                                                   # its own)
    inference_session(model, ISLAND, threads=2)    # fusion.Session's islands between kernels

Every session runs on the CPU provider and logs nothing below fatal (a warning or a logged error
would break the CLI's one-line stderr; errors arrive as exceptions), unless `warnings` asks for
the warnings plain onnxruntime prints (the tests' check that a model loads cleanly); `threads`
sets the intra-op threads (None: onnxruntime's choice, one per core).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import onnx
import onnxruntime as ort

from fusion.errors import one_line

Level = ort.GraphOptimizationLevel


@dataclass(frozen=True)
class Settings:
    """How a session optimizes the graph and whether its idle workers spin."""

    name: str
    optimization: ort.GraphOptimizationLevel
    spinning: bool  # idle intra-op workers spin for a while (onnxruntime's default) or sleep


# The model as written: nothing fused or reordered, so it is the unfused graph's own result.
REFERENCE = Settings("reference", Level.ORT_DISABLE_ALL, spinning=False)
# onnxruntime as a user runs it (all optimizations, NCHWc layouts, spinning workers).
DEFAULT = Settings("default", Level.ORT_ENABLE_ALL, spinning=True)
# The same optimizations with workers that sleep: the rival when runners take turns in one
# process (fusion.bench's interleaved rounds), where DEFAULT's spinning workers would steal the
# cores of whichever runner comes next (bench/NOTES.md, suite figures).
DEFAULT_NO_SPIN = Settings("default-no-spin", Level.ORT_ENABLE_ALL, spinning=False)
# Islands between kernels: idle workers must not spin while Numba's threads run a kernel.
ISLAND = Settings("island", Level.ORT_ENABLE_ALL, spinning=False)
# An island without a conv: ORT_ENABLE_ALL would add NCHWc reorders at its borders and win
# nothing inside (see fusion.runtime.plan.may_hold_a_conv).
ISLAND_WITHOUT_CONV = Settings("island-without-conv", Level.ORT_ENABLE_EXTENDED, spinning=False)

ModelSource = onnx.ModelProto | bytes | str | os.PathLike


def inference_session(
    model: ModelSource,
    settings: Settings = REFERENCE,
    threads: int | None = None,
    profiling: bool = False,
    warnings: bool = False,
) -> ort.InferenceSession:
    """An InferenceSession for a ModelProto, its bytes, or a file (external data read beside it).

    >>> inference_session(model, DEFAULT, threads=2).run(None, {"x": x})
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = settings.optimization
    options.log_severity_level = 2 if warnings else 4  # fatal: errors come as exceptions, once
    if threads is not None:
        options.intra_op_num_threads = threads
    if not settings.spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.enable_profiling = profiling
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif not isinstance(model, bytes):
        model = os.fspath(model)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def ort_error_line(exc: BaseException) -> str:
    """onnxruntime's error as one readable line, without its C++ source location."""
    text = one_line(exc, limit=2000)
    if m := re.search(r"model IR version: (\d+), max supported IR version: (\d+)", text):
        return f"IR version {m[1]} (it supports up to {m[2]})"
    if m := re.search(r"Opset (\d+) is under development.*domain (\S+) is till opset (\d+)", text):
        return f"opset {m[1]} of domain {m[2]} (it supports up to {m[3]})"
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^/\S+:\d+ .*?\) ", "", text)  # "/src/model.cc:256 onnxruntime::Model(...) "
    return text[:300]


def is_ort_error(exc: BaseException) -> bool:
    """An exception raised by onnxruntime's C++ side (its classes derive from Exception only)."""
    return type(exc).__module__.startswith("onnxruntime")
