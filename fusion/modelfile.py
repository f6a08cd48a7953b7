"""Reading and writing model files: clear one-line errors, atomic writes, external data kept.

A file is refused, with one line naming the problem, when it cannot be read as an ONNX model
(missing, a directory, a device or pipe, empty, truncated, another protobuf, weights shorter
than their shape or stored outside the model's folder), when onnxruntime cannot load its IR
version or opsets, or when neither the ONNX checker nor onnxruntime accepts it (a model only
the checker rejects is used with a warning naming the checker's complaint).

Writes never leave a partial file, and a model with external data is replaced crash-safe: the
new data goes to a file named after its content (`OUT.<digest>.data`), which only the new model
names; then one rename replaces the model; then the data files the old model kept under OUT's
name are removed. An interruption at any point leaves the old pair or the new pair, each whole.

Large weights are never copied inside a protobuf message to write or check a model: Python's
protobuf (upb) keeps a message's memory in an arena that only grows, so setting weights aside
and back would cost their size again each time. A weightless skeleton is built instead.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import tempfile
import warnings
from pathlib import Path

import onnx
import onnxruntime
from google.protobuf.message import EncodeError
from onnx import helper
from onnx.external_data_helper import uses_external_data

from fusion.errors import FusionError, FusionWarning, one_line
from fusion.files import file_mode, same_file, sync_folder, synced, writable_folder, write_atomic
from fusion.ort import REFERENCE, inference_session, ort_error_line

TWO_GB = 2**31  # protobuf cannot serialize a message this large: weights go to external data
EXTERNAL_THRESHOLD = 1024  # bytes: smaller tensors stay inside the model file
ALIGN = 4096  # external tensors start on a page boundary, so onnxruntime can map them


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model with its external data; raise FusionError naming what is wrong."""
    return read_model(path)[0]


def as_model(model_or_path: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """A ModelProto as it is, or the model in that file (load_model)."""
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    return load_model(model_or_path)


def read_model(path: str | os.PathLike) -> tuple[onnx.ModelProto, tuple[Path, ...]]:
    """The model, and the external data files its weights were read from (resolved paths).

    >>> model, data_files = read_model("model.onnx")   # data_files: () when self-contained
    """
    path = Path(path)
    if not path.exists():
        raise FusionError(f"{path}: no such file")
    if path.is_dir():
        raise FusionError(f"{path}: is a directory, not an ONNX file")
    if not path.is_file():
        raise FusionError(f"{path}: not a regular file (a device, a pipe or a socket)")
    if path.stat().st_size == 0:
        raise FusionError(f"{path}: the file is empty")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except OSError as exc:
        raise FusionError(f"{path}: cannot read it ({exc.strerror or one_line(exc)})") from None
    except Exception as exc:  # DecodeError, or a text-format parse error: the bytes are not ONNX
        reason = one_line(exc)
        raise FusionError(f"{path}: not an ONNX model, or a truncated one ({reason})") from None
    if not model.HasField("graph") or not model.opset_import:
        missing = "a graph" if not model.HasField("graph") else "opset_import"
        raise FusionError(
            f"{path}: not an ONNX model, or a truncated one (a protobuf message without {missing})"
        )
    _require_utf8(model, path)
    require_runtime_support(model, str(path))
    external = [t for t in all_tensors(model) if uses_external_data(t)]
    for tensor in all_tensors(model):
        _require_known_type(tensor, path)
        if not uses_external_data(tensor):
            _require_size(tensor, len(tensor.raw_data), path)
    if not external:
        return model, ()
    places = [(tensor, _data_file(path, tensor)) for tensor in external]
    for tensor, (file, offset, length) in places:  # before reading: onnx reads a short file
        if not file.is_file():
            continue  # missing: onnx's own message below
        available = file.stat().st_size - offset
        _require_size(tensor, min(available, length if length >= 0 else available), path)
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # OSError, or the checker refusing a location
        raise FusionError(f"{path}: cannot read its external data ({one_line(exc)})") from None
    return model, tuple(sorted({file for _, (file, _, _) in places}))


def run_checker(model: onnx.ModelProto, full: bool, what: str) -> None:
    """The ONNX checker (full: with strict shape inference), as a FusionError naming `what`.

    A model over 2 GB is checked as a file without its weights (protobuf cannot serialize it
    whole), so the checker sees its structure but not its weights' bytes.
    """
    try:
        if not over_2gb(model):
            onnx.checker.check_model(model, full_check=full)
            return
        skeleton, large = _skeleton(model)
        offset = 0
        for _, placeholder in large:
            length = _byte_size(placeholder, 0)
            _point_to(placeholder, "weights", offset, length)
            offset += length
        with tempfile.TemporaryDirectory(prefix="fusion-check-") as folder:
            # The checker wants the data file to exist, not to hold the bytes.
            Path(folder, "weights").touch()
            Path(folder, "model.onnx").write_bytes(skeleton.SerializeToString())
            onnx.checker.check_model(str(Path(folder, "model.onnx")), full_check=full)
    except Exception as exc:  # ValidationError, InferenceError, or a name that is not UTF-8
        raise FusionError(f"{what} fails the ONNX checker: {one_line(exc)}") from None


def require_valid(model: onnx.ModelProto, what: str, source=None) -> bool:
    """The ONNX checker passes (True); or it does not, but onnxruntime loads the model
    (False, with a FusionWarning naming the checker's complaint: exporters and hand edits leave
    harmless things the checker rejects, such as an output declared without a type). Refused
    (FusionError, the checker's message) when neither accepts it.

    The checker is asked with strict shape inference (its full check): only that looks at the
    element types of declared inputs and outputs, and onnxruntime refuses an unknown one too.
    A model that passes the checker's structural check and fails only the full one is treated
    as passing (True, no warning) when onnxruntime loads it: strict inference minds more than a
    runtime does.

    source: what onnxruntime loads (the file, which holds the external data's location), else
    the model itself.
    """
    try:
        run_checker(model, full=True, what=what)
        return True
    except FusionError as exc:
        complaint = exc
    try:
        run_checker(model, full=False, what=what)
        structure_passes = True
    except FusionError as exc:
        complaint, structure_passes = exc, False
    try:
        inference_session(model if source is None else source, REFERENCE, threads=1)
    except Exception:
        raise complaint from None
    if structure_passes:
        return True
    warnings.warn(f"{complaint}; onnxruntime loads it, so going on", FusionWarning, stacklevel=2)
    return False


def require_runtime_support(model: onnx.ModelProto, what: str) -> None:
    """Refuse a model whose IR version or opsets this onnxruntime cannot load."""
    opsets = tuple(sorted((o.domain or "", o.version) for o in model.opset_import))
    reason = _runtime_refusal(model.ir_version, opsets)
    if reason:
        raise FusionError(f"{what}: onnxruntime {onnxruntime.__version__} cannot load it: {reason}")


@functools.lru_cache(maxsize=64)
def _runtime_refusal(ir_version: int, opsets: tuple) -> str | None:
    """Why onnxruntime refuses an empty model with this IR version and these opsets, if it does.

    An empty model loads in a millisecond, where the real one may take seconds, and it tells a
    version problem apart from anything wrong with the graph."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    probe = helper.make_model(
        helper.make_graph([], "probe", [x], [x]),
        opset_imports=[helper.make_opsetid(d, v) for d, v in opsets],
    )
    probe.ir_version = ir_version
    try:
        inference_session(probe, REFERENCE, threads=1)
    except Exception as exc:
        return ort_error_line(exc)
    return None


def save_model(
    model: onnx.ModelProto, path: str | os.PathLike, external: bool = False, keep=()
) -> None:
    """Write atomically; `model` is not modified.

    With `external` (or a model over 2 GB), tensors of 1 KB or more go to a data file beside
    the model, `<name>.<digest>.data` (named after its bytes, so the same model gives the same
    files), written whole before the model names it. Replacing a model and its data is
    crash-safe (see the module doc); data files the old model at `path` kept under its name are
    removed afterwards, except those in `keep` (files the caller still reads).
    """
    path = Path(path)
    skeleton, large = _skeleton(model) if external or over_2gb(model) else (model, [])
    if not large:
        write_model_bytes(path, model.SerializeToString(deterministic=True), keep)
        return
    folder = writable_folder(path)
    stale = _own_data_files(path)
    fd, data_tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    model_tmp, published = None, None
    try:
        os.fchmod(fd, file_mode(path))
        with os.fdopen(fd, "wb") as data:
            fd, digest, offset, spans = None, hashlib.sha256(), 0, []
            for tensor, placeholder in large:
                pad = b"\0" * (-offset % ALIGN)
                raw = tensor.raw_data  # one tensor's bytes at a time
                for chunk in (pad, raw):
                    digest.update(chunk)
                    offset += data.write(chunk)
                spans.append((placeholder, offset - len(raw), len(raw)))
                del raw
            synced(data)
        data_path = folder / f"{path.name}.{digest.hexdigest()[:16]}.data"
        for placeholder, start, length in spans:
            _point_to(placeholder, data_path.name, start, length)
        fd, model_tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.fchmod(fd, file_mode(path))
        with os.fdopen(fd, "wb") as f:
            fd = None
            f.write(skeleton.SerializeToString(deterministic=True))
            synced(f)
        # 1. the new data under a name no model uses yet (or the same bytes under their name)
        published = None if data_path.exists() else data_path
        os.replace(data_tmp, data_path)
        # 2. the model, in one step: the old pair or the new one, never a mix
        os.replace(model_tmp, path)
        published = None
        sync_folder(folder)
    finally:
        if fd is not None:
            os.close(fd)
        for tmp in (data_tmp, model_tmp, published):
            if tmp:
                Path(tmp).unlink(missing_ok=True)
    # 3. the old data, now named by no model
    _remove_stale(stale, [data_path, *keep])


def write_model_bytes(path: str | os.PathLike, data: bytes, keep=()) -> None:
    """A self-contained model file, atomically; then the data files the model it replaced kept
    under its name (except those in `keep`) are removed."""
    path = Path(path)
    stale = _own_data_files(path)
    write_atomic(path, data)
    _remove_stale(stale, keep)


def named_as_data_of(model_path: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether `path` has a name kept for the external data of a model written at `model_path`:
    `<name>.data` or `<name>.<digest>.data` in the same folder (_data_names). save_model
    writes the data there and removes what the model it replaces kept there, so no other file
    may be written under such a name.

    >>> named_as_data_of("out.onnx", "out.onnx.3f2a9c4e1b7d5a60.data")
    True
    """
    model_path, path = Path(model_path), Path(path)
    if path.parent.resolve() != model_path.parent.resolve():
        return False
    return _data_names(model_path.name).fullmatch(path.name) is not None


def _data_names(model_name: str) -> re.Pattern:
    """The names save_model gives a model's external data: `<name>.data`, `<name>.<digest>.data`
    (16 hex digits of the data's hash)."""
    return re.compile(re.escape(model_name) + r"(\.[0-9a-f]{16})?\.data")


def _own_data_files(path: Path) -> list[Path]:
    """The data files the model at `path` names under its own name (`<name>.data`, or
    `<name>.<digest>.data` as save_model writes them): the ones a new model there replaces."""
    own = _data_names(path.name)
    if not path.is_file() or not any(own.fullmatch(p.name) for p in path.parent.iterdir()):
        return []
    try:
        old = onnx.load(str(path), load_external_data=False)
    except Exception:  # not a model: it names nothing
        return []
    names = {
        e.value
        for t in all_tensors(old)
        if uses_external_data(t)
        for e in t.external_data
        if e.key == "location"
    }
    return [path.parent / name for name in sorted(names) if own.fullmatch(name)]


def _remove_stale(stale: list[Path], keep) -> None:
    for file in stale:
        if not any(same_file(file, k) for k in keep):
            file.unlink(missing_ok=True)


def over_2gb(model: onnx.ModelProto) -> bool:
    """Too large for one protobuf message (ByteSize itself fails beyond 2 GB)."""
    try:
        return model.ByteSize() >= TWO_GB
    except EncodeError:
        return True


def shapes_from_a_run(model: onnx.ModelProto, names, feeds: dict, threads: int | None = None
                      ) -> dict[str, tuple[tuple[int, ...], object]]:  # fmt: skip
    """(shape, dtype) of each value in `names` after one run of the model in onnxruntime (no
    optimizations) on `feeds`: what shape inference cannot follow (TorchScript's Shape
    arithmetic, a fused node's function). Best effort: {} when the run fails or the model is
    past protobuf's 2 GB (it cannot be handed over whole). The outputs are untyped: a value
    whose type inference did not give may be of any type. It runs a copy of the model, weights
    included: once per Session build (its timing) or bench workload, not per write or check."""
    names = list(dict.fromkeys(names))
    if not names or over_2gb(model):
        return {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.output[:]
    copy.graph.output.extend(onnx.ValueInfoProto(name=v) for v in names)
    try:
        got = inference_session(copy, REFERENCE, threads).run(names, feeds)
    except Exception:  # noqa: BLE001 (best effort: the caller keeps what it has)
        return {}
    return {v: (tuple(a.shape), a.dtype) for v, a in zip(names, got, strict=True)
            if hasattr(a, "shape") and hasattr(a, "dtype")}  # fmt: skip


def weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without the bytes of its large tensors (shapes and dtypes kept): what shape
    inference needs, for a model too large to serialize."""
    return _skeleton(model)[0]


# ---- tensors ---------------------------------------------------------------------------------
def all_tensors(model: onnx.ModelProto):
    """Every TensorProto that can hold weights: initializers, sparse ones, tensor attributes,
    in the graph, its subgraphs (If/Loop/Scan) and the model's functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)


def _graph_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensors(graph.node)


def _node_tensors(nodes):
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for g in attr.graphs:
                yield from _graph_tensors(g)


# Strings vary in size; 4- and 2-bit types pack several elements per byte.
_NOT_SIZED = {
    getattr(onnx.TensorProto, name)
    for name in ("UNDEFINED", "STRING", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
}


def _byte_size(tensor: onnx.TensorProto, default: int) -> int:
    """The bytes a tensor's shape and element type need (`default` when that cannot be said)."""
    if tensor.data_type in _NOT_SIZED:
        return default
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return default
    return itemsize * math.prod(tensor.dims)


def _require_utf8(message, path: Path, where: str = "") -> None:
    """Every string field is UTF-8 (protobuf hands an invalid one over as bytes, which no
    name comparison, message or checker call expects). Fields are read by descriptor, so a
    tensor's bytes are never touched (reading raw_data would copy the weights)."""
    for field in message.DESCRIPTOR.fields:
        if field.type not in (field.TYPE_STRING, field.TYPE_MESSAGE):
            continue
        if _is_repeated(field):
            values = getattr(message, field.name)
        elif message.HasField(field.name):
            values = [getattr(message, field.name)]
        else:
            continue
        for value in values:
            if field.type == field.TYPE_MESSAGE:
                _require_utf8(value, path, f"{where}{field.name}.")
            elif isinstance(value, bytes):
                raise FusionError(
                    f"{path}: {where}{field.name} is not valid UTF-8 (a corrupt file?)"
                )


_TENSOR_TYPES = frozenset(helper.get_all_tensor_dtypes())


def _require_known_type(tensor: onnx.TensorProto, path: Path) -> None:
    if tensor.data_type not in _TENSOR_TYPES:
        raise FusionError(
            f"{path}: tensor {tensor.name!r} has the unknown data type {tensor.data_type} "
            "(a corrupt file?)"
        )


def _require_size(tensor: onnx.TensorProto, got: int, path: Path) -> None:
    """Raw bytes (in the file or in its data file) must fill the tensor's shape."""
    if not (tensor.HasField("raw_data") or uses_external_data(tensor)):
        return
    want = _byte_size(tensor, got)
    if got < want or (got > want and not uses_external_data(tensor)):
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        raise FusionError(
            f"{path}: tensor {tensor.name!r} has {got} bytes, but shape {list(tensor.dims)} of "
            f"{dtype} needs {want} (a corrupt or truncated file?)"
        )


def _data_file(model_path: Path, tensor: onnx.TensorProto) -> tuple[Path, int, int]:
    """Where an external tensor's bytes are: (resolved file, offset, length or -1). A location
    outside the model's folder is refused before anything is learnt about that path."""
    entries = {e.key: e.value for e in tensor.external_data}
    if not entries.get("location"):
        raise FusionError(f"{model_path}: tensor {tensor.name!r}: external, with no location")
    folder = model_path.parent.resolve()
    file = (folder / entries["location"]).resolve()
    if not file.is_relative_to(folder) or file == folder:
        raise FusionError(
            f"{model_path}: tensor {tensor.name!r}: its external data location "
            f"{entries['location']!r} points outside the directory of the model"
        )
    try:
        return file, int(entries.get("offset") or 0), int(entries.get("length") or -1)
    except ValueError:
        raise FusionError(
            f"{model_path}: tensor {tensor.name!r}: its external data offset or length is not "
            "a number (a corrupt file?)"
        ) from None


def _point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        tensor.external_data.add(key=key, value=str(value))


_HOLDERS = (
    onnx.ModelProto,
    onnx.GraphProto,
    onnx.NodeProto,
    onnx.AttributeProto,
    onnx.FunctionProto,
    onnx.SparseTensorProto,
    onnx.TrainingInfoProto,
)


def _skeleton(model: onnx.ModelProto):
    """A copy of `model` without the bytes of tensors of EXTERNAL_THRESHOLD bytes or more, and
    the (tensor, placeholder) pairs, in a fixed order; the weights themselves are not copied."""
    skeleton, large = onnx.ModelProto(), []
    _copy(model, skeleton, large)
    return skeleton, large


def _copy(src, dst, large: list, skip: str = "") -> None:
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        repeated = _is_repeated(field)
        if field.type != field.TYPE_MESSAGE:
            if repeated:
                getattr(dst, field.name).extend(value)
            else:
                setattr(dst, field.name, value)
            continue
        for item in value if repeated else [value]:
            target = getattr(dst, field.name).add() if repeated else getattr(dst, field.name)
            if isinstance(item, onnx.TensorProto) and _is_large(item):
                _copy(item, target, large, skip="raw_data")
                large.append((item, target))
            elif isinstance(item, _HOLDERS):
                _copy(item, target, large)
            else:
                target.CopyFrom(item)


def _is_repeated(field) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 5.29; `label` is gone in 7
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def _is_large(tensor: onnx.TensorProto) -> bool:
    if not tensor.HasField("raw_data"):
        return False
    size = _byte_size(tensor, -1)
    return (size if size >= 0 else len(tensor.raw_data)) >= EXTERNAL_THRESHOLD
