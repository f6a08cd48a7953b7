"""The inputs of a run: given (a dict, a list, an .npy or .npz file) or seeded random ones
from the model's declared shapes.

    feeds, source = model_inputs(model, "inputs.npz", seed=0, dims=None)   # source: "inputs.npz"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from onnx import helper

from fusion.errors import FusionError
from fusion.graph import GraphView

BATCH_DIM = 1  # a symbolic first axis (batch) in random inputs
OTHER_DIM = 32  # any other symbolic axis in random inputs (override with dims={"name": n})


def model_inputs(model, inputs, seed: int, dims: Mapping[str, int] | None):
    """(feeds, description): the given inputs loaded, or random ones from declared shapes."""
    view = GraphView(model)
    names = view.graph_inputs
    if inputs is None:
        return random_inputs(view, seed, dims or {}), f"random (seed {seed})"
    if isinstance(inputs, (str, Path)):
        path = Path(inputs)
        if path.suffix == ".npz":
            with _load_npy(path) as archive:
                return {k: archive[k] for k in archive.files}, str(path)
        if len(names) != 1:
            raise FusionError(f"{path}: one array, but the model has {len(names)} inputs; use .npz")
        return {names[0]: _load_npy(path)}, str(path)
    if isinstance(inputs, Mapping):
        feeds = {k: _load_npy(v) if isinstance(v, (str, Path)) else v for k, v in inputs.items()}
        return feeds, "given"
    if isinstance(inputs, Sequence):
        if len(inputs) != len(names):
            raise FusionError(f"{len(inputs)} inputs given, the model has {len(names)}")
        arrays = [_load_npy(v) if isinstance(v, (str, Path)) else v for v in inputs]
        return dict(zip(names, arrays, strict=True)), "given"
    raise FusionError(f"inputs: expected a dict, a list or an .npy/.npz path, not {type(inputs)}")


def _load_npy(path):
    """An .npy array, or an .npz archive (a context manager of arrays)."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise FusionError(f"{path}: cannot read it as .npy/.npz ({exc})") from None


def random_inputs(view: GraphView, seed: int, dims: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Standard normal floats, small non-negative ints (safe as indices), random booleans."""
    rng = np.random.default_rng(seed)
    feeds, named = {}, dict(dims)  # a symbolic dim gets one size in every input that names it
    for name in view.graph_inputs:
        vt = view.type_of(name)
        if vt is None or not vt.elem_type or vt.shape is None:
            raise FusionError(f"input {name!r} has no declared type and shape; pass inputs=")
        shape = []
        for axis, d in enumerate(vt.shape):
            if isinstance(d, int) and d > 0:
                shape.append(d)
            elif isinstance(d, str) and d:
                shape.append(named.setdefault(d, BATCH_DIM if axis == 0 else OTHER_DIM))
            else:
                shape.append(BATCH_DIM if axis == 0 else OTHER_DIM)
        dtype = helper.tensor_dtype_to_np_dtype(vt.elem_type)
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, 4, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.random(shape) < 0.5
        else:
            raise FusionError(f"input {name!r}: cannot make random {dtype} values; pass inputs=")
    return feeds
