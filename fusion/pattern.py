"""The pattern language: patterns are data written with ONNX op names.

    x, w, b = Var("x", dtype="float32", rank=4), Const("W"), Const("B")
    conv = op.Conv(x, w, Opt(b), _name="conv")
    root = Alt(op.Relu(conv), op.Clip(conv, Opt(Const("lo")), Opt(Const("hi"))))

- `Var` matches any value, `Const` an initializer or Constant node (seen through Identity).
- `op.<OpType>(*inputs, **attribute_constraints)` matches one node. Keyword constraints are
  literals (compared after ONNX defaults are applied) or predicates `value -> None | reason`.
  Options start with an underscore: `_name` captures the node, `_where(m, node)` checks anything,
  `_commute` (default on for Add and Mul) tries both input orders, `_domain` sets the domain.
- `Alt(*patterns)` matches the first alternative that fits (all are tried on backtracking).
- `Opt(p)` matches an absent optional input, or `p`.
- `node[k]` refers to output k of a multi-output node (Split), `node.any_output()` to any.
  One pattern object used in several places must match the same value there (a value
  feeding two nodes of the pattern).
- Patterns compose: a function that returns a pattern for given input patterns is a sub-pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

Reason = str | None  # None: accepted; a string: why not
COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Xor", "Equal"}


class Pattern:
    """Base class; every pattern matches one value of the graph."""

    name: str | None = None

    def op_types(self) -> set[str]:
        """Op types a value matched by this pattern can be produced by (empty: any)."""
        return set()


@dataclass(eq=False)
class Var(Pattern):
    """Any value. Optional constraints: dtype ('float32' or a TensorProto enum), rank, where."""

    name: str
    dtype: str | int | None = None
    rank: int | None = None
    where: Callable[[Any], Reason] | None = None  # called with the value's ValueType

    @property
    def elem_type(self) -> int | None:
        if self.dtype is None or isinstance(self.dtype, int):
            return self.dtype
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))


@dataclass(eq=False)
class Const(Pattern):
    """A constant value; `where` is called with its numpy array."""

    name: str
    where: Callable[[np.ndarray], Reason] | None = None


@dataclass(eq=False)
class Op(Pattern):
    op_type: str
    inputs: list[Pattern]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    where: Callable[..., Reason] | None = None
    commute: bool | None = None
    domain: str = ""

    def __post_init__(self):
        if self.commute is None:
            self.commute = self.op_type in COMMUTATIVE and len(self.inputs) == 2

    def __getitem__(self, index: int) -> Output:
        return Output(self, index)

    def any_output(self, name: str | None = None) -> Output:
        return Output(self, None, name)

    def op_types(self) -> set[str]:
        return {self.op_type}


@dataclass(eq=False)
class Output(Pattern):
    """Output `index` of the node matched by `node` (for multi-output ops such as Split).

    `node.any_output("gate")` matches whichever output it is: for structure that decides
    which output is which (an LSTM's gates, in any order after one Split).
    """

    node: Op
    index: int | None
    name: str | None = None

    def op_types(self) -> set[str]:
        return {self.node.op_type}


@dataclass(eq=False, init=False)
class Alt(Pattern):
    options: tuple[Pattern, ...]

    def __init__(self, *options: Pattern, name: str | None = None):
        self.options, self.name = options, name

    def op_types(self) -> set[str]:
        types = [o.op_types() for o in self.options]
        return set() if any(not t for t in types) else set().union(*types)


@dataclass(eq=False)
class Opt(Pattern):
    """An optional input: absent, or matching `pattern`."""

    pattern: Pattern


class _OpBuilder:
    """`op.Conv(x, w, group=1, _name="conv")` builds an `Op` pattern."""

    def __getattr__(self, op_type: str) -> Callable[..., Op]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def build(*inputs: Pattern, **kwargs: Any) -> Op:
            options = {k[1:]: kwargs.pop(k) for k in list(kwargs) if k.startswith("_")}
            unknown = set(options) - {"name", "where", "commute", "domain"}
            if unknown:
                raise TypeError(f"op.{op_type}: unknown option(s) {sorted(unknown)}")
            return Op(op_type, list(inputs), kwargs, **options)

        return build


op = _OpBuilder()


def walk(pattern: Pattern, seen: set[int] | None = None):
    """Every pattern object reachable from `pattern`, each once."""
    seen = set() if seen is None else seen
    if id(pattern) in seen:
        return
    seen.add(id(pattern))
    yield pattern
    children: list[Pattern] = []
    if isinstance(pattern, Op):
        children = pattern.inputs
    elif isinstance(pattern, Output):
        children = [pattern.node]
    elif isinstance(pattern, Alt):
        children = list(pattern.options)
    elif isinstance(pattern, Opt):
        children = [pattern.pattern]
    for child in children:
        yield from walk(child, seen)


def capture_names(pattern: Pattern) -> set[str]:
    return {p.name for p in walk(pattern) if p.name}
