"""The inputs of a run: given (a dict, a list, an .npy or .npz file) or seeded random ones
from the model's declared shapes.

    feeds, source = model_inputs(model, "inputs.npz", seed=0, dims=None)   # source: "inputs.npz"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from fusion.errors import FusionError, one_line
from fusion.graph import GraphView

BATCH_DIM = 1  # a symbolic first axis (batch) in random inputs
OTHER_DIM = 32  # any other symbolic axis in random inputs (override with dims={"name": n})


class InputsNeeded(FusionError):
    """No random values can be made for a model input: the caller has to give them. The
    message names the Python API's `inputs=`; the CLI names its --input option instead."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"input {name!r} {reason}; pass inputs=")
        self.name, self.reason = name, reason


def model_inputs(model, inputs, seed: int, dims: Mapping[str, int] | None):
    """(feeds, description): the given inputs loaded, or random ones from declared shapes."""
    view = GraphView(model)
    names = view.graph_inputs
    if inputs is None:
        return random_inputs(view, seed, dims or {}), f"random (seed {seed})"
    if isinstance(inputs, (str, Path)):
        path = Path(inputs)
        if path.suffix == ".npz":
            return _load_archive(path), str(path)
        if len(names) != 1:
            raise FusionError(f"{path}: one array, but the model has {len(names)} inputs; use .npz")
        return {names[0]: _load_array(path)}, str(path)
    if isinstance(inputs, Mapping):
        feeds = {k: _load_array(v) if isinstance(v, (str, Path)) else v for k, v in inputs.items()}
        return feeds, "given"
    if isinstance(inputs, Sequence):
        if len(inputs) != len(names):
            raise FusionError(f"{len(inputs)} inputs given, the model has {len(names)}")
        arrays = [_load_array(v) if isinstance(v, (str, Path)) else v for v in inputs]
        return dict(zip(names, arrays, strict=True)), "given"
    raise FusionError(f"inputs: expected a dict, a list or an .npy/.npz path, not {type(inputs)}")


def _load_array(path) -> np.ndarray:
    """One array: an .npy file (or an .npz archive holding exactly one)."""
    loaded = _load(path)
    if isinstance(loaded, np.ndarray):
        return loaded
    arrays = _arrays(path, loaded)
    if len(arrays) != 1:
        raise FusionError(
            f"{path}: an .npz archive of {len(arrays)} arrays where one array (.npy) is "
            "expected; pass the archive as --input FILE.npz, its arrays named as the inputs"
        )
    return next(iter(arrays.values()))


def _load_archive(path) -> dict[str, np.ndarray]:
    """The arrays of an .npz archive, by name."""
    loaded = _load(path)
    if isinstance(loaded, np.ndarray):
        raise FusionError(f"{path}: one array (.npy), not an .npz archive of named arrays")
    return _arrays(path, loaded)


def _arrays(path, archive) -> dict[str, np.ndarray]:
    try:
        with archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError) as exc:  # a damaged member, or a pickled one
        raise FusionError(f"{path}: cannot read it as .npz ({one_line(exc)})") from None


def _load(path):
    """np.load without pickles: an array, or an open .npz archive."""
    path = Path(path)
    if path.is_dir():
        raise FusionError(f"{path}: is a directory, not an .npy/.npz file")
    if path.exists() and not path.is_file():
        raise FusionError(f"{path}: not a regular file (a device, a pipe or a socket)")
    try:
        return np.load(path, allow_pickle=False)
    except EOFError:
        raise FusionError(f"{path}: cannot read it as .npy/.npz (the file is empty)") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise FusionError(f"{path}: cannot read it as .npy/.npz ({reason})") from None


def random_inputs(view: GraphView, seed: int, dims: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Standard normal floats, small non-negative ints (safe as indices), random booleans."""
    rng = np.random.default_rng(seed)
    feeds, named = {}, dict(dims)  # a symbolic dim gets one size in every input that names it
    for name in view.graph_inputs:
        vt = view.type_of(name)
        if vt is None or not vt.elem_type or vt.shape is None:
            raise InputsNeeded(name, "has no declared type and shape")
        shape = []
        for axis, d in enumerate(vt.shape):
            if isinstance(d, int) and d > 0:
                shape.append(d)
            elif isinstance(d, str) and d:
                shape.append(named.setdefault(d, BATCH_DIM if axis == 0 else OTHER_DIM))
            else:
                shape.append(BATCH_DIM if axis == 0 else OTHER_DIM)
        try:
            dtype = helper.tensor_dtype_to_np_dtype(vt.elem_type)
        except (KeyError, ValueError):
            raise InputsNeeded(name, f"has the unknown element type {vt.elem_type}") from None
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, 4, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.random(shape) < 0.5
        else:
            kind = TensorProto.DataType.Name(vt.elem_type).lower()
            raise InputsNeeded(name, f"is of type {kind}: no random values can be made")
    return feeds
