"""What several subcommands read from their arguments (model files, --input, pattern names),
and the check every subcommand makes before it writes anything."""

from __future__ import annotations

import argparse
import contextlib
import math
import warnings
from collections.abc import Mapping
from pathlib import Path

import onnx

from fusion.errors import CatalogError, FusionError, FusionWarning, one_line
from fusion.feeds import batched_inputs
from fusion.files import check_outputs
from fusion.graph import GraphView
from fusion.modelfile import named_as_data_of, read_model, require_valid
from fusion.ort import is_ort_error
from fusion.registry import loaded_plugins


def add_input_argument(parser, help: str = "NAME=FILE.npy (repeatable) or FILE.npz") -> None:
    parser.add_argument("--input", action="append", help=help)


def input_files(items: list[str] | None):
    """--input NAME=FILE.npy (repeatable) or one FILE.npz / FILE.npy, as fusion.feeds takes it."""
    if not items:
        return None
    if len(items) == 1 and "=" not in items[0]:
        return items[0]
    feeds = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise FusionError(f"--input {item}: expected NAME=FILE.npy")
        feeds[name] = path
    return feeds


def batch_sizes(model: onnx.ModelProto, requested: list[int] | None) -> list[int | None]:
    """The batch sizes a command runs for --batch `requested` (None: not given): each one, once,
    when some input's first axis is free (fusion.feeds.batched_inputs); else only the model's
    own (None when no input has an axis), with one warning naming the requested ones ignored."""
    view = GraphView(model)
    wanted = list(dict.fromkeys(requested or [1]))
    if batched_inputs(view):
        return wanted
    own = next(((n, vt.shape) for n in view.graph_inputs if (vt := view.type_of(n)) and vt.shape),
               None)  # fmt: skip
    batch = own[1][0] if own else None
    ignored = [b for b in requested or () if b != batch]
    if ignored:
        why = (f"the model's batch is fixed at {batch} (input {own[0]!r} is {list(own[1])})"
               if own else "the model's inputs have no batch axis")  # fmt: skip
        warnings.warn(f"{why}: --batch {' '.join(map(str, ignored))} ignored", FusionWarning,
                      stacklevel=2)  # fmt: skip
    return [batch]


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (--threads, --rounds, --repeat, --batch)."""
    return _at_least(text, int, 1, "an integer")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0 (--seed)."""
    return _at_least(text, int, 0, "an integer")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0 (--budget, --rtol, --atol)."""
    return _at_least(text, float, 0, "a finite number")


def _at_least(text: str, kind, low, what: str):
    """Checked in the parser, so that a value out of range is one line (exit 2) before any work,
    not a traceback from deep in the run (statistics of zero rounds, a pool of -3 threads)."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (kind is float and not math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected {what} of at least {low}, got {text!r}")
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
    return value


def pattern_names(text: str) -> list[str]:
    """--only / --exclude: comma-separated pattern names."""
    return [n.strip() for n in text.split(",") if n.strip()]


def load_checked(path) -> tuple[onnx.ModelProto, tuple[Path, ...], bool]:
    """A model file read and checked (fused or not: it may be run or verified), the external
    data files it was read from, and whether the ONNX checker passed it (False: only
    onnxruntime accepts it; refused when neither does; see fusion.modelfile.require_valid)."""
    model, data_files = read_model(path)
    return model, data_files, require_valid(model, str(path), source=path)


@contextlib.contextmanager
def beyond_the_checker(path, checked: bool):
    """Work on a model: when the ONNX checker rejected it (onnxruntime loads it), an error the
    work meets in it is the input's fault, one line (exit 2), not a crash of ours."""
    try:
        yield
    except (FusionError, CatalogError, MemoryError):  # the CLI's own one line (cli/main.py)
        raise
    except Exception as exc:
        if checked or is_ort_error(exc):
            raise
        raise FusionError(
            f"{path}: cannot work on this model, which the ONNX checker rejects "
            f"({type(exc).__name__}: {one_line(exc)})"
        ) from exc


def check_writes(
    writes: Mapping[str, object],
    model=None,
    data_files=(),
    inputs: list[str] | None = None,
    replacing: Mapping[str, object] | None = None,
    models: tuple[str, ...] = (),
) -> None:
    """Before any work: each file a command writes (label -> path) can be written and is none
    of the files it reads: the model, its external data, the --input files, the plugins.

    models: the labels of the writes that are model files. Their external data goes beside
    them as `OUT.<digest>.data` (fusion.modelfile.save_model), so no other write may have a
    name of that form (it would be overwritten, or removed as the old model's data)."""
    reads = {}
    if model is not None:
        reads[model] = f"the input file {model}"
        reads.update({f: f"{Path(f).name}, where {model} keeps its weights" for f in data_files})
    feeds = input_files(inputs)
    for path in [feeds] if isinstance(feeds, str) else (feeds or {}).values():
        reads[path] = f"the --input file {path}"
    for plugin in loaded_plugins():
        reads[plugin] = f"the plugin {plugin}"
    check_outputs(writes, reads, replacing)
    for label in models:
        out = writes[label]
        for other_label, other in writes.items():
            if other_label == label or not other or not named_as_data_of(out, other):
                continue
            name = Path(out).name
            raise FusionError(
                f"{other}: {other_label} has a name kept for the weights of {label} "
                f"({name}.data or {name}.*.data); choose another name"
            )
