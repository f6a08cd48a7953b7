"""Matching patterns against a GraphView, with a reason for every rejection.

Matching is a backtracking search written as generators: each pattern yields every way it can
match a value given the bindings so far, so alternatives and commutative inputs are explored
until the whole pattern (and the rule's checks) fit. A `Tracer` keeps the failure that got the
furthest (most nodes matched), which is what `--explain` reports as a near-miss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx

from fusion.graph import GraphView, ValueType, node_label
from fusion.pattern import Alt, Const, Op, Opt, Output, Pattern, Var
from fusion.shapes import shape_entries

FULL_MATCH = 1000  # score bonus of a failure found after the whole pattern matched


@dataclass(frozen=True)
class State:
    values: dict  # capture name -> value name
    nodes: dict  # capture name -> node index
    memo: dict  # id(pattern) -> value name (Var/Const/Alt/Opt) or node index (Op)
    matched: dict  # node index -> id(pattern), in match order

    def bind(self, pat: Pattern, key, value: str | None = None, node: int | None = None) -> State:
        values, nodes, matched = self.values, self.nodes, self.matched
        if pat.name and value is not None:
            values = {**values, pat.name: value}
        if node is not None:
            matched = {**matched, node: id(pat)}
            if pat.name:
                nodes = {**nodes, pat.name: node}
        return State(values, nodes, {**self.memo, id(pat): key}, matched)


@dataclass(order=True)
class Failure:
    score: int
    reason: str = field(compare=False)
    ops: frozenset = field(compare=False, default=frozenset())  # op types matched before it
    absent: bool = field(compare=False, default=False)  # an op the graph does not have there


class Tracer:
    """Keeps the failure that matched the most nodes (the first one at equal depth, but one
    that found the ops it needed over one that did not: x's dtype, not the optional Pad that
    an alternative looked for before it)."""

    def __init__(self):
        self.best: Failure | None = None

    def fail(self, view: GraphView, state: State, reason: str, bonus: int = 0,
             absent: bool = False) -> None:  # fmt: skip
        score = len(state.matched) + bonus
        best = self.best
        if best is None or score > best.score or (score == best.score and best.absent
                                                  and not absent):  # fmt: skip
            ops = frozenset(view.nodes[i].op_type for i in state.matched)
            self.best = Failure(score, reason, ops, absent)


class Match:
    """A successful match: captured values and nodes, with helpers to read them."""

    def __init__(self, view: GraphView, state: State):
        self.view = view
        self.values: dict[str, str | list[str]] = state.values  # a list: variadic
        self.node_index: dict[str, int] = state.nodes
        self.nodes: list[int] = sorted(state.matched)

    @classmethod
    def of(cls, view: GraphView, values: dict, nodes: dict, matched) -> Match:
        """A match found by a rule's own finder rather than by a pattern."""
        return cls(view, State(dict(values), dict(nodes), {}, dict.fromkeys(matched, 0)))

    def __getitem__(self, name: str) -> str | None:
        """The value captured as `name` (None when an optional part was absent)."""
        return self.values.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def const(self, name: str) -> np.ndarray | None:
        value = self.values.get(name)
        return None if value is None else self.view.constant(value)

    def node(self, name: str) -> onnx.NodeProto:
        return self.view.nodes[self.node_index[name]]

    def attrs(self, name: str) -> dict:
        return self.view.attributes(self.node(name))

    def shape_entries(self, name: str, known: dict | None = None) -> list | None:
        """The entries of the 1-D shape tensor captured as `name`, each a constant or the
        size of some tensor's axis (fusion.shapes.shape_entries; `known`: sizes the rule
        knows). None when it is absent or computed some other way."""
        value = self.values.get(name)
        return None if value is None else shape_entries(self.view, value, known)

    def type(self, name: str) -> ValueType | None:
        value = self.values.get(name)
        return None if value is None else self.view.type_of(value)


class Matcher:
    def __init__(self, view: GraphView):
        self.view = view
        self.tracer = Tracer()

    def fail(self, state: State, reason: str, bonus: int = 0, absent: bool = False) -> None:
        self.tracer.fail(self.view, state, reason, bonus, absent)

    def match(self, pat: Pattern, value: str, state: State, at: str) -> Iterator[State]:
        """Every extension of `state` in which `pat` matches `value`; `at` names the consumer."""
        if id(pat) in state.memo and not isinstance(pat, Op):
            if state.memo[id(pat)] == value:
                yield state
            else:
                self.fail(state, f"{at}: expected the same value as {state.memo[id(pat)]}")
            return
        if isinstance(pat, Opt):
            if not value:
                yield state.bind(pat, value)
            else:
                for st in self.match(pat.pattern, value, state, at):
                    yield st.bind(pat, value, value)
            return
        if not value:
            self.fail(state, f"{at}: a required input is absent")
            return
        if isinstance(pat, Var):
            reason = self._var_mismatch(pat, value)
            if reason:
                self.fail(state, f"{at}: {reason}")
            else:
                yield state.bind(pat, value, value)
        elif isinstance(pat, Const):
            arr = self.view.constant(value)
            reason = f"input {value} is not a constant" if arr is None else None
            reason = reason or (pat.where(arr) if pat.where else None)
            if reason:
                self.fail(state, f"{at}: {reason}")
            else:
                yield state.bind(pat, value, value)
        elif isinstance(pat, Alt):
            for option in pat.options:
                for st in self.match(option, value, state, at):
                    yield st.bind(pat, value, value)
        elif isinstance(pat, (Op, Output)):
            yield from self._match_op(pat, value, state, at)
        else:
            raise TypeError(f"not a pattern: {pat!r}")

    def _var_mismatch(self, pat: Var, value: str) -> str | None:
        """Why `value` does not meet the Var's dtype, rank and `where` constraints, if not."""
        if pat.dtype is None and pat.rank is None and pat.where is None:
            return None
        vt = self.view.type_of(value)
        if pat.elem_type is not None:
            if vt is None or not vt.elem_type:
                return f"dtype of {value} is unknown"
            if vt.elem_type != pat.elem_type:
                want = onnx.helper.tensor_dtype_to_np_dtype(pat.elem_type).name
                return f"dtype {vt.dtype_name}, kernels are {want}-only"
        if pat.rank is not None:
            if vt is None or vt.rank is None:
                return f"rank of {value} is unknown"
            if vt.rank != pat.rank:
                return f"{value} has rank {vt.rank}, pattern needs rank {pat.rank}"
        return pat.where(vt) if pat.where else None

    def _match_op(self, pat: Op | Output, value: str, state: State, at: str) -> Iterator[State]:
        op_pat, want_out = (pat.node, pat.index) if isinstance(pat, Output) else (pat, 0)
        prod = self.view.producer.get(value)
        if prod is None:
            self.fail(state, f"{at}: {value} is not computed by a node, pattern needs "
                      f"{op_pat.op_type}", absent=True)  # fmt: skip
            return
        index, out = prod
        node = self.view.nodes[index]
        label = node_label(node)
        if node.op_type != op_pat.op_type or (node.domain or "") not in (op_pat.domain, "ai.onnx"):
            self.fail(state, f"{at}: {value} comes from {label}, pattern needs {op_pat.op_type}",
                      absent=True)  # fmt: skip
            return
        if want_out is not None and out != want_out:
            self.fail(state, f"{at}: {value} is output {out} of {label}, pattern needs {want_out}",
                      absent=True)  # fmt: skip
            return
        if id(op_pat) in state.memo:
            if state.memo[id(op_pat)] == index:  # a second output of a node already matched
                yield state.bind(pat, value, value) if isinstance(pat, Output) else state
            else:
                self.fail(state, f"{at}: {value} must come from the same node as before")
            return
        if index in state.matched:
            self.fail(state, f"{label}: would be matched twice by one pattern")
            return
        state = state.bind(op_pat, index, node.output[0], node=index)
        reason = self._node_mismatch(op_pat, index, state)
        if reason:
            self.fail(state, f"{label}: {reason}")
            return
        inputs = list(node.input)
        while inputs and not inputs[-1]:
            inputs.pop()
        if len(inputs) > len(op_pat.inputs):
            self.fail(
                state, f"{label}: has {len(inputs)} inputs, pattern expects {len(op_pat.inputs)}"
            )
            return
        inputs += [""] * (len(op_pat.inputs) - len(inputs))
        orders = [inputs, inputs[::-1]] if op_pat.commute and inputs[0] != inputs[1] else [inputs]
        for order in orders:
            for st in self._match_all(op_pat.inputs, order, state, label):
                yield st.bind(pat, value, value) if isinstance(pat, Output) else st

    def _node_mismatch(self, pat: Op, index: int, state: State) -> str | None:
        """Why node `index` does not meet the Op's attribute and `_where` constraints, if not."""
        attrs = self.view.attributes(self.view.nodes[index])
        for name, want in pat.attrs.items():
            have = attrs.get(name)
            if callable(want):
                verdict = want(have)
                if verdict is False:
                    return f"{name}={_show(have)} not accepted"
                if isinstance(verdict, str):
                    return verdict
            elif _norm(have) != _norm(want):
                return f"{name}={_show(have)}, pattern needs {_show(want)}"
        if pat.where is not None:
            return pat.where(Match(self.view, state), self.view.nodes[index])
        return None

    def _match_all(self, pats: list[Pattern], values: list[str], state: State, at: str):
        if not pats:
            yield state
            return
        for st in self.match(pats[0], values[0], state, at):
            yield from self._match_all(pats[1:], values[1:], st, at)


def start_state() -> State:
    return State({}, {}, {}, {})


def _norm(value):
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v) for v in value)
    if isinstance(value, bytes):
        return value.decode()
    return value


def _show(value) -> str:
    return "absent" if value is None else str(_norm(value)).replace(" ", "")
