"""Catalog entries (rules) and catalogs: which patterns exist, what they fuse into, which kernel.

A `Rule` pairs a pattern with the fused node it becomes and the kernel that runs that node:

    Rule("ConvBiasRelu", pattern, inputs=("x", "W", "B"), prepare=make_conv_kernel,
         attributes=lambda m: {"strides": m.attrs("conv")["strides"]})

`inputs` names the captures that become the fused node's inputs, in order (an optional capture
that did not match becomes an absent input). `outputs` names the captures that become its
outputs (default: the value the pattern's root matches). `prepare(attrs, constants)` is called
once per fused node when a session is built, with the node's attributes and, per input, its
constant value (or None), and returns the kernel, a function `run(*inputs) -> tuple of arrays`
(or any sequence of arrays: a session reads only the outputs later steps use, see KernelStep).
A kernel that can compute its node in more than one way lists them as `kernel.tactics`, a list
of `Tactic`s (fusion/runtime/tactics.py chooses among them and onnxruntime per input shape).

Rules and catalogs are data: this module knows no pattern and no kernel. The catalog a rewrite
uses by default (built-in, installed, registered) is fusion.registry.default_catalog().
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import onnx

from fusion.errors import CatalogError
from fusion.numerics import DEFAULT_ATOL, DEFAULT_RTOL
from fusion.pattern import Op, Pattern, capture_names, walk

KernelFactory = Callable[[dict, list], Callable[..., tuple]]  # (attrs, constants) -> run
DOMAIN = "fusion"  # the domain of every fused node and its function

__all__ = ["DOMAIN", "Catalog", "CatalogError", "KernelFactory", "Rule", "Tactic", "validate"]


@dataclass(frozen=True)
class Tactic:
    """One way a kernel can run its fused node. `run(*inputs)` returns the outputs; the inputs
    at `blocked_inputs` arrive in the blocked layout (kernels/blocked.py) with `in_blocks[k]`
    channels per block, and the outputs at `blocked_outputs` leave in it, holding
    `out_channels[k]` channels. A session converts layouts only where a blocked tactic meets
    anything else (fusion/runtime/layout.py).

        Tactic("blocked", run, blocked_inputs=(0,), in_blocks=(8,), blocked_outputs=(0,),
               out_channels=(64,))
    """

    name: str
    run: Callable[..., Sequence]
    blocked_inputs: tuple[int, ...] = ()
    in_blocks: tuple[int, ...] = ()
    blocked_outputs: tuple[int, ...] = ()
    out_channels: tuple[int, ...] = ()
    # a block kernel run depth first: the values between its convs stay in its cache-sized
    # scratch instead of going to memory (what fusion.bench.traffic's estimate counts), or
    # are never made (a squeeze-excitation gate folded into the next conv's weights)
    depth_first: bool = False
    # bind(*inputs) -> run specialized for inputs of these shapes (or None: not offered): a
    # session's step calls it once per input shapes, then the function it returns on every
    # run with the same shapes, which may skip run's checks and look-ups (a step's Python
    # is ~4 us of a small conv's ~10; fusion/runtime/steps.py KernelStep)
    bind: Callable[..., Callable[..., Sequence] | None] | None = None
    # a way to run the node where its other tactics cannot: timed (and compiled on a cold
    # start) only where every other tactic failed. An NCHW kernel beside blocked ones: timed
    # per node on Zen 4 it lost 270 of 270 nodes at 16 lanes, 145 of 152 at 8, and compiling
    # it to be timed cost a cold start ~10 s (tactics.first_timed; bench/NOTES.md)
    fallback: bool = False


@dataclass(eq=False)
class Rule:
    name: str
    pattern: Pattern | None
    inputs: Sequence[str]
    prepare: KernelFactory | None = None  # builds the kernel of one fused node
    outputs: Sequence[str] = ()
    attributes: Callable | None = None  # Match -> dict of the fused node's attributes
    check: Callable | None = None  # Match -> None | reason, run after a structural match
    priority: int = 0  # higher first; a rule that contains another must have a higher one
    description: str = ""
    rtol: float = DEFAULT_RTOL  # what the kernel promises against onnxruntime (fusion.numerics)
    atol: float = DEFAULT_ATOL
    # The kernel sums long runs of products (a conv, a matrix product) in float32 in its own
    # order: its error is bounded relative to the output's largest magnitude, not to each
    # element, so its atol is taken as at least rtol x max |expected| (fusion.numerics).
    accumulates: bool = False
    explain_after: str | None = None  # a near-miss must have matched this op type
    # For structure a pattern cannot state (a chain of any length): finder(view, node_index)
    # returns candidate Matches rooted at that node, or a reason string, or None.
    finder: Callable | None = None
    anchor_ops: Sequence[str] = ()  # with a finder: the op types it starts from
    stage: int = 0  # rules of a later stage see the graph that earlier stages rewrote
    # Try roots from the graph's end backwards: for a pattern whose root may be any node of a
    # chain (a Conv with an optional epilogue), the longest chain is claimed first.
    from_last: bool = False
    # The fused node written as standard ONNX ops instead (rewrite(standard_ops=True)):
    # standard(view, node) -> (nodes, initializers), or a reason string when it cannot be.
    # Every name it invents comes from view.names (values) and view.node_names (nodes).
    standard: Callable | None = None
    # Shape computations that read values inside a match and feed only the match join it
    # (fusion/shapes.py); the captured inputs they compute become absent inputs, what they read
    # from outside trailing ones. For kernels that ignore shape inputs (TorchScript's Reshapes).
    absorb_shapes: bool = False

    def __post_init__(self):
        self.inputs, self.outputs = tuple(self.inputs), tuple(self.outputs)
        validate(self)

    @property
    def anchors(self) -> set[str]:
        return set(self.anchor_ops) or self.pattern.op_types()


def validate(rule: Rule) -> None:
    """Fail early, with a message, on a rule that could never fuse correctly."""
    where = f"rule {rule.name!r}"
    if not rule.name.isidentifier():
        raise CatalogError(f"{where}: the name must be an identifier (it becomes an op_type)")
    if rule.finder is not None:
        if rule.pattern is not None or not rule.anchor_ops:
            raise CatalogError(f"{where}: a rule with a finder has anchor_ops and no pattern")
        return
    if rule.pattern is None or not rule.pattern.op_types():
        raise CatalogError(f"{where}: the pattern's root must be an op (or alternatives of ops)")
    captured = capture_names(rule.pattern)
    for name in (*rule.inputs, *rule.outputs):
        if name not in captured:
            raise CatalogError(f"{where}: {name!r} is used but never bound by the pattern")
    for pat in walk(rule.pattern):
        if isinstance(pat, Op) and pat.domain in ("", "ai.onnx"):
            _validate_op(where, pat)


def _validate_op(where: str, pat: Op) -> None:
    if not onnx.defs.has(pat.op_type):
        raise CatalogError(f"{where}: unknown ONNX op {pat.op_type!r}")
    unknown = set(pat.attrs) - _known_attributes(pat.op_type)
    if unknown:
        raise CatalogError(f"{where}: {pat.op_type} has no attribute {sorted(unknown)[0]!r}")


@functools.cache
def _known_attributes(op_type: str) -> frozenset:
    """Attribute names of `op_type` in any opset version (Clip had min/max as attributes)."""
    return frozenset(
        name
        for schema in onnx.defs.get_all_schemas_with_history()
        if schema.name == op_type and schema.domain == ""
        for name in schema.attributes
    )


class Catalog:
    """An ordered set of rules, indexed by the op type their pattern's root matches."""

    def __init__(self, rules: Iterable[Rule] = ()):
        self._rules: dict[str, Rule] = {}
        for rule in rules:
            self.add(rule)

    def add(self, rule: Rule, replace: bool = False) -> Rule:
        if rule.name in self._rules and not replace:
            raise CatalogError(f"a rule named {rule.name!r} is already in the catalog")
        self._rules[rule.name] = rule
        return rule

    def remove(self, name: str) -> Rule:
        if name not in self._rules:
            raise CatalogError(f"no pattern named {name!r}")
        return self._rules.pop(name)

    def __add__(self, other: Catalog) -> Catalog:
        return Catalog([*self, *other])

    def __iter__(self):
        return iter(self.ordered())

    def __len__(self) -> int:
        return len(self._rules)

    def __contains__(self, name: str) -> bool:
        return name in self._rules

    def get(self, name: str) -> Rule | None:
        return self._rules.get(name)

    def ordered(self) -> list[Rule]:
        """Priority order: higher priority first, then registration order."""
        rules = list(self._rules.values())
        return sorted(rules, key=lambda r: -r.priority)

    def rules_in(self, model: onnx.ModelProto) -> list[Rule]:
        """The rules of the fused nodes in `model`'s graph (one per node, in graph order)."""
        found = (self._rules.get(n.op_type) for n in model.graph.node if n.domain == DOMAIN)
        return [rule for rule in found if rule is not None]

    def select(self, only: Sequence[str] = (), exclude: Sequence[str] = ()) -> Catalog:
        for name in (*only, *exclude):
            if name not in self._rules:
                raise CatalogError(f"no pattern named {name!r} (known: {', '.join(self._rules)})")
        keep = [r for r in self.ordered() if (not only or r.name in only) and r.name not in exclude]
        return Catalog(keep)
