"""The inputs of a run: given (a dict, a list, an .npy or .npz file) or seeded random ones
from the model's declared shapes.

    feeds, source = model_inputs(model, "inputs.npz", seed=0, dims=None)   # source: "inputs.npz"
"""

from __future__ import annotations

import contextlib
import math
import os
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


def model_inputs(
    model, inputs, seed: int, dims: Mapping[str, int] | None, batch: int | None = None
):
    """(feeds, description): the given inputs loaded, or random ones from declared shapes
    (dims: sizes of symbolic axes by name; batch: of every free first axis, see random_shapes)."""
    view = GraphView(model)
    names = view.graph_inputs
    if inputs is None:
        return random_inputs(view, seed, dims or {}, batch), f"random (seed {seed})"
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


def random_inputs(
    view: GraphView, seed: int, dims: Mapping[str, int], batch: int | None = None
) -> dict[str, np.ndarray]:
    """Standard normal floats, small non-negative ints (safe as indices), random booleans, of
    the shapes random_shapes gives; refused before anything is allocated when the memory
    cannot hold them (require_memory)."""
    shapes = random_shapes(view, dims, batch)
    require_memory(shapes)
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (shape, dtype) in shapes.items():
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, 4, shape).astype(dtype)
        else:
            feeds[name] = rng.random(shape) < 0.5
    return feeds


def random_shapes(
    view: GraphView, dims: Mapping[str, int] | None = None, batch: int | None = None
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of each random input: declared sizes kept, a symbolic size from
    `dims` (one size for every axis that names it), every other size free. A free first axis
    is `batch` (default BATCH_DIM: 1), any other OTHER_DIM. InputsNeeded for an input that no
    random values can be made for."""
    named = dict(dims or {})
    first = BATCH_DIM if batch is None else batch
    if batch is not None:  # a name on a first axis is the batch, wherever else it stands
        for name in batched_inputs(view):
            axis = view.type_of(name).shape[0]
            if isinstance(axis, str) and axis:
                named.setdefault(axis, batch)
    shapes = {}
    for name in view.graph_inputs:
        vt = view.type_of(name)
        if vt is None or not vt.elem_type or vt.shape is None:
            raise InputsNeeded(name, "has no declared type and shape")
        shape = []
        for axis, d in enumerate(vt.shape):
            size = first if axis == 0 else OTHER_DIM
            if not _free(d):
                shape.append(d)
            elif isinstance(d, str) and d:
                shape.append(named.setdefault(d, size))
            else:
                shape.append(size)
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vt.elem_type))
        except (KeyError, ValueError):
            raise InputsNeeded(name, f"has the unknown element type {vt.elem_type}") from None
        if dtype.kind not in "fiub":
            kind = TensorProto.DataType.Name(vt.elem_type).lower()
            raise InputsNeeded(name, f"is of type {kind}: no random values can be made")
        shapes[name] = (tuple(shape), dtype)
    return shapes


def batched_inputs(view: GraphView) -> list[str]:
    """The inputs whose first axis is free (symbolic or unknown): those `batch` sizes."""
    return [
        name
        for name in view.graph_inputs
        if (vt := view.type_of(name)) is not None and vt.shape and _free(vt.shape[0])
    ]


def _free(size) -> bool:
    """A declared size random inputs choose: anything but a positive integer."""
    return not (isinstance(size, int) and size > 0)


def require_memory(shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Refuse, before allocating, random inputs of these shapes that the memory cannot hold:
    each takes its own bytes, and making one a float64 (or int64) draw of as many elements."""
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (shape, dtype) in shapes.items()}
    need = sum(sizes.values()) + max((math.prod(s) * 8 for s, _ in shapes.values()), default=0)
    free = available_memory()
    if free is None or need <= free:
        return
    name = max(sizes, key=sizes.get)
    shape, dtype = shapes[name]
    raise FusionError(
        f"random inputs need {_size(need)} to make, more than the {_size(free)} of memory "
        f"available (input {name!r}, {dtype} {list(shape)}, is {_size(sizes[name])})"
    )


def available_memory() -> int | None:
    """Bytes this process can still allocate without swapping: the kernel's MemAvailable, at
    most what the cgroup's limit leaves (a container's memory.max); else the physical memory;
    None when unknown."""
    free = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    if free is None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            left = max(int(limit) - used, 0)
            free = left if free is None else min(free, left)
    return free


def _size(n: int) -> str:
    """Bytes in binary units, 3 significant digits: 512 B, 7.45 GiB, 2.91 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
