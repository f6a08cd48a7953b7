"""Reading and writing model files: clear one-line errors, atomic writes, external data kept."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import uses_external_data

TWO_GB = 2**31  # protobuf cannot serialize a message this large: weights go to external data


class FusionError(Exception):
    """A problem with the user's input, reported as one line (exit code 2 on the CLI)."""


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model with its external data; raise FusionError naming what is wrong."""
    return read_model(path)[0]


def read_model(path: str | os.PathLike) -> tuple[onnx.ModelProto, bool]:
    """The model, and whether its weights were stored as external data."""
    path = Path(path)
    if not path.exists():
        raise FusionError(f"{path}: no such file")
    if path.is_dir():
        raise FusionError(f"{path}: is a directory, not an ONNX file")
    if path.stat().st_size == 0:
        raise FusionError(f"{path}: the file is empty")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise FusionError(f"{path}: not an ONNX model ({_first_line(exc)})") from None
    if not model.HasField("graph") or not model.opset_import:
        raise FusionError(f"{path}: a protobuf message, but not an ONNX model (no graph or opset)")
    external = any(uses_external_data(t) for t in _all_tensors(model))
    if external:
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError) as exc:
            raise FusionError(
                f"{path}: cannot read its external data ({_first_line(exc)})"
            ) from None
    return model, external


def check_model(model: onnx.ModelProto, full: bool, what: str) -> None:
    try:
        if model.ByteSize() < TWO_GB:
            onnx.checker.check_model(model, full_check=full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise FusionError(f"{what} fails the ONNX checker: {_first_line(exc)}") from None


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external: bool = False) -> None:
    """Write atomically: a temporary file beside `path`, renamed over it when complete.

    With `external` (or a model over 2 GB), weights go to `<name>.data` beside the model.
    """
    path = Path(path)
    if not (external or model.ByteSize() >= TWO_GB):
        write_atomic(path, model.SerializeToString(deterministic=True))
        return
    data_path = _output_folder(path) / f"{path.name}.data"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    try:
        with _atomic_temp(path) as tmp:
            onnx.save_model(
                copy, tmp, save_as_external_data=True, location=data_path.name, size_threshold=1024
            )
    except BaseException:
        data_path.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    with _atomic_temp(Path(path)) as tmp, open(tmp, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def _atomic_temp(path: Path):
    """A temporary file name beside `path`, renamed to `path` if the block succeeds."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=_output_folder(path))
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _output_folder(path: Path) -> Path:
    folder = path.parent
    if not folder.is_dir():
        raise FusionError(f"{path}: the output directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise FusionError(f"{path}: the output directory {folder} is not writable")
    return folder


def _all_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
