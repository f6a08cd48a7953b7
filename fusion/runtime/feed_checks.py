"""What a run's feeds must be, checked at the border as onnxruntime checks them: every input the
model declares (its initializers aside) present, of its dtype, rank and fixed sizes, and no name
the model does not take; the outputs asked for among the model's. A feed in another memory
layout (Fortran order, a strided view) is made C-contiguous here, once.

(Not to be confused with fusion/feeds.py, which makes a run's inputs: given or seeded random.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from fusion.errors import FusionError, one_line
from fusion.graph import GraphView, ValueType


class InvalidFeed(FusionError, ValueError):
    """A run's feeds do not fit the model's inputs (missing, unknown, wrong dtype or rank)."""


@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, type ('tensor(float)') and shape (ints, strings, None)."""

    name: str
    type: str
    shape: list


def node_arg(name: str, vt: ValueType | None) -> NodeArg:
    if vt is None or not vt.elem_type:
        return NodeArg(name, "unknown", [])
    type_name = onnx.TensorProto.DataType.Name(vt.elem_type).lower()
    return NodeArg(name, f"tensor({type_name})", list(vt.shape or []))


@dataclass(frozen=True)
class InputSpec:
    """One input a run must be fed: its declared dtype and shape."""

    name: str
    dtype: np.dtype | None
    shape: tuple | None
    node_arg: NodeArg
    fixed_dims: tuple  # (axis, size) for every axis of declared size

    @staticmethod
    def of(view: GraphView, name: str) -> InputSpec:
        vt = view.type_of(name)
        dtype = helper.tensor_dtype_to_np_dtype(vt.elem_type) if vt and vt.elem_type else None
        shape = vt.shape if vt else None
        fixed = tuple((k, d) for k, d in enumerate(shape or ()) if isinstance(d, int) and d > 0)
        return InputSpec(name, dtype, shape, node_arg(name, vt), fixed)

    def validated(self, value) -> np.ndarray:
        if type(value) is not np.ndarray:
            try:
                value = np.asarray(value, dtype=self.dtype)  # onnxruntime also accepts lists
            except (TypeError, ValueError, OverflowError) as exc:  # a string, a ragged list
                raise InvalidFeed(
                    f"Input {self.name} is a {type(value).__name__} that is no array of "
                    f"{self.dtype}: {one_line(exc)}"
                ) from None
        if self.dtype is not None and value.dtype != self.dtype:
            raise InvalidFeed(
                f"Unexpected input data type for input: {self.name}. "
                f"Actual: ({value.dtype}), expected: ({self.dtype})"
            )
        if not value.flags.c_contiguous:  # Fortran order, a strided view: one copy at the border
            value = np.ascontiguousarray(value)
        if self.shape is None:
            return value
        shape = value.shape
        if len(shape) != len(self.shape):
            raise InvalidFeed(
                f"Invalid rank for input: {self.name} Got: {value.ndim} "
                f"Expected: {len(self.shape)} (shape {list(shape)}, expected {list(self.shape)})"
            )
        for axis, want in self.fixed_dims:
            if shape[axis] != want:
                raise InvalidFeed(
                    f"Got invalid dimensions for input: {self.name} index: {axis} "
                    f"Got: {shape[axis]} Expected: {want} "
                    f"(shape {list(shape)}, expected {list(self.shape)})"
                )
        return value


class FeedCheck:
    """A model's inputs and outputs as a run sees them. inputs: what it must be fed (the graph
    inputs that are not initializers), in order; feedable: every name a feed may have (an
    initializer that is also a graph input may be overridden); outputs: the graph outputs."""

    def __init__(self, view: GraphView):
        graph = view.graph
        self.inputs = [InputSpec.of(view, vi.name) for vi in graph.input
                       if vi.name not in view.initializers]  # fmt: skip
        self.feedable = {vi.name for vi in graph.input}
        self.outputs = [o.name for o in graph.output]

    def validated(self, feeds: Mapping) -> dict[str, np.ndarray]:
        """The feeds, each checked against its input (InvalidFeed: why not)."""
        if not isinstance(feeds, dict) and not isinstance(feeds, Mapping):
            raise InvalidFeed(f"feeds must be a dict of input name -> array, not {type(feeds)}")
        checked = dict(feeds)
        for spec in self.inputs:
            value = checked.get(spec.name)
            if value is None:
                missing = [s.name for s in self.inputs if s.name not in feeds]
                if not missing:
                    raise InvalidFeed(f"Input {spec.name} is None: expected {spec.node_arg.type}")
                raise InvalidFeed(
                    f"Required inputs ({missing}) are missing from input feed ({list(feeds)})."
                )
            checked[spec.name] = spec.validated(value)
        if len(checked) > len(self.inputs):
            unknown = [name for name in feeds if name not in self.feedable]
            if unknown:
                known = ", ".join(spec.name for spec in self.inputs)
                raise InvalidFeed(f"Invalid input name: {unknown[0]} (the model's inputs: {known})")
        return checked

    def output_list(self, output_names) -> list[str]:
        """The outputs a run returns: all (None) or those named, each one of the model's."""
        if output_names is None:
            return self.outputs
        for name in output_names:
            if name not in self.outputs:
                raise InvalidFeed(
                    f"Invalid output name: {name} (the model's outputs: {', '.join(self.outputs)})"
                )
        return list(output_names)
