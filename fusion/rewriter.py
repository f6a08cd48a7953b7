"""Apply a catalog to a model: find safe, non-overlapping matches and replace each by one node.

Order: rules in priority order (a rule that contains another goes first, so FireModule claims
its convolutions before ConvBiasRelu sees them), and within a rule the graph's node order (or
its reverse, for a rule whose root may be any node of a chain: Rule.from_last).
A match is fused only if no value it computes internally is read outside it or is a graph
output, and it shares no node with an earlier match. Every rejection keeps its reason.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import onnx
from onnx import helper

from fusion.catalog import DOMAIN, Catalog, Rule
from fusion.functions import BodyError, build_function
from fusion.graph import GraphView, implicit_inputs, node_label, topological_order
from fusion.matcher import FULL_MATCH, Failure, Match, Matcher, start_state
from fusion.pattern import Output
from fusion.registry import default_catalog
from fusion.shapes import absorb_shapes

FUNCTION_IR_VERSION = 10  # node.overload, which names a function's variant, needs IR 10


@dataclass
class Fusion:
    rule: str
    node: str  # name of the fused node
    replaced: list[str]  # labels of the original nodes, in graph order


@dataclass
class NearMiss:
    rule: str
    at: str  # the node the match was tried from
    reason: str


@dataclass(frozen=True)
class RolledBack:
    """A fusion that verification undid (fusion.verify.rollback): the fused node's name, its
    rule, and why: its kernel disagreed with onnxruntime on an output (the error figures), or
    failed, or returned what its node does not declare (then max_abs and max_rel are inf)."""

    node: str
    rule: str
    reason: str
    max_abs: float = math.inf
    max_rel: float = math.inf


@dataclass
class RewriteResult:
    model: onnx.ModelProto
    fusions: list[Fusion] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    standard: list[Fusion] = field(default_factory=list)  # fused nodes written as standard ops
    rolled_back: list[RolledBack] = field(default_factory=list)  # by verification, in order

    def counts(self) -> dict[str, int]:
        """Fused nodes per pattern in the rewritten model, in catalog priority order (those
        written as standard ops included). A fusion that a later stage absorbed (LSTMCell
        nodes into an LSTMSequence) is in `fusions` but not counted here: these are the nodes
        the model runs."""
        made = {(f.rule, f.node) for f in self.fusions}  # not fused nodes the input had
        counts = dict.fromkeys(self.rules, 0)
        for node in self.model.graph.node:
            if node.domain == DOMAIN and (node.op_type, node.name) in made:
                counts[node.op_type] += 1
        for f in self.standard:
            counts[f.rule] += 1
        return {rule: n for rule, n in counts.items() if n}

    def explain(self, pattern: str | None = None) -> str:
        """Per pattern: how many fused, and each near-miss with its reason; the patterns with
        neither share one last line (a pattern asked for by name always gets its own)."""
        lines, quiet, kept = [], [], self.counts()
        for rule in self.rules:
            if pattern is not None and rule != pattern:
                continue
            misses = [n for n in self.near_misses if n.rule == rule]
            fused = sum(f.rule == rule for f in self.fusions)
            if not fused and not misses and pattern is None:
                quiet.append(rule)
                continue
            inside = fused - kept.get(rule, 0)
            within = f" ({inside} of them inside later fusions)" if inside else ""
            lines.append(f"{rule}: {fused} fused{within}, {len(misses)} not fused")
            lines += [f"  {n.reason}" for n in misses]
        if quiet:
            lines.append(f"no match and no near-miss: {', '.join(quiet)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "fusions": sum(self.counts().values()),
            "counts": self.counts(),
            "fused_nodes": [vars(f) for f in self.fusions],
            "near_misses": [vars(n) for n in self.near_misses],
            "standard_ops": [f.node for f in self.standard],
            # inf (a kernel that failed) is null: JSON has no infinity
            "rolled_back": [
                {k: None if v == math.inf else v for k, v in vars(r).items()}
                for r in self.rolled_back
            ],  # fmt: skip
        }


def rewrite(
    model: onnx.ModelProto,
    catalog: Catalog | None = None,
    only: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    skip: dict[str, str] | None = None,
    standard_ops: bool = False,
) -> RewriteResult:
    """Fuse every safe match of the catalog's patterns; the input model is not modified.

    >>> result = rewrite(onnx.load("model.onnx"))
    >>> result.counts()
    {'ConvBiasRelu': 4}

    skip maps fused node names to a reason not to fuse them (a rollback after verification).
    standard_ops: fused nodes whose rule has a standard form (an unrolled LSTM chain: the ONNX
    LSTM op) are written in that form, so that plain onnxruntime runs them as one op too.
    """
    catalog = (catalog if catalog is not None else default_catalog()).select(only, exclude)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    result = RewriteResult(out, rules=[r.name for r in catalog.ordered()])
    for stage in sorted({rule.stage for rule in catalog}):
        _rewrite_stage(result, [rule for rule in catalog if rule.stage == stage], skip or {})
    if standard_ops:
        write_standard(result, catalog)
    return result


def write_standard(result: RewriteResult, catalog: Catalog) -> None:
    """Replace each fused node of `result` whose rule has a standard form by that form's nodes
    (rewrite(standard_ops=True); the CLI calls it after verifying the fused nodes)."""
    view = GraphView(result.model)
    before = _in_use(result.model.graph)
    made = {(f.rule, f.node): f for f in result.fusions}
    nodes, inits = [], []
    for node in view.nodes:
        rule = catalog.get(node.op_type) if node.domain == DOMAIN else None
        fusion = made.get((node.op_type, node.name))
        if rule is None or rule.standard is None or fusion is None:
            nodes.append(node)
            continue
        found = rule.standard(view, node)
        if isinstance(found, str):
            result.near_misses.append(
                NearMiss(rule.name, node_label(node), f"{node_label(node)}: kept fused: {found}")
            )
            nodes.append(node)
            continue
        nodes.extend(found[0])
        inits.extend(found[1])
        result.standard.append(fusion)
    if not result.standard:
        return
    graph = result.model.graph
    del graph.node[:]
    graph.node.extend(_sorted(nodes))
    graph.initializer.extend(inits)
    _drop_orphans(graph, before)
    called = {(n.domain, n.op_type, n.overload) for n in graph.node}
    for i in reversed(range(len(result.model.functions))):
        f = result.model.functions[i]
        if (f.domain, f.name, f.overload) not in called:
            del result.model.functions[i]


def _in_use(graph: onnx.GraphProto) -> tuple[set[str], set[str]]:
    """(the values something reads: a node, a subgraph of one, a graph output; every value
    name the graph defines or reads)."""
    read = {v for n in graph.node for v in (*n.input, *implicit_inputs(n))}
    read |= {o.name for o in graph.output}
    alive = read | {v for n in graph.node for v in n.output} | {i.name for i in graph.input}
    return read, alive | {t.name for t in graph.initializer}


def _drop_orphans(graph: onnx.GraphProto, before: tuple[set[str], set[str]]) -> None:
    """Remove what the rewrite left unread that was read `before` it (_in_use of the graph
    then): Constant nodes whose values fused nodes absorbed (into a body, an attribute, a
    standard op's weights), the Identity nodes the matcher saw them through, the initializers
    only replaced nodes read, and the value infos of values that are gone (plain onnxruntime
    warns about every unread constant it loads). Graph inputs and outputs stay, and so does
    whatever the model itself left unread. Deleted in place: re-adding a tensor over 2 GB to a
    repeated field fails to encode."""
    read_before, alive_before = before
    while True:  # an Identity removed orphans the Constant it copied
        read, _ = _in_use(graph)
        dead = [
            i
            for i, n in enumerate(graph.node)
            if n.output
            and n.op_type in ("Constant", "Identity")
            and n.domain in ("", "ai.onnx")
            and all(v not in read and v in read_before for v in n.output)
        ]
        if not dead:
            break
        for i in reversed(dead):
            del graph.node[i]
    inputs = {i.name for i in graph.input}
    for i in reversed(range(len(graph.initializer))):
        name = graph.initializer[i].name
        if name in read_before and name not in read and name not in inputs:
            del graph.initializer[i]
    _, alive = _in_use(graph)
    kept = [vi for vi in graph.value_info if vi.name in alive or vi.name not in alive_before]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _rewrite_stage(result: RewriteResult, rules: list[Rule], skip: dict) -> None:
    view = GraphView(result.model)
    names = _FusedNames(view)
    claimed: dict[int, str] = {}  # node index -> label of the fused node that took it
    replacements: list[tuple[int, onnx.NodeProto]] = []
    functions: dict[tuple[str, str], onnx.FunctionProto] = {}
    for rule in rules:
        anchored = (i for op_type in rule.anchors for i in view.by_op.get(op_type, ()))
        candidates = sorted(anchored, reverse=rule.from_last)
        misses: list[tuple[int, NearMiss]] = []  # reported in graph order
        for index in candidates:
            node = view.nodes[index]
            if index in claimed:
                continue
            if (node.domain or "") not in ("", "ai.onnx") and rule.finder is None:
                continue
            passed_over: list[str] = []
            found = _match_at(view, rule, index, claimed, skip, names, passed_over)
            if isinstance(found, Failure):
                if _is_near_miss(rule, found):
                    misses.append((index, NearMiss(rule.name, node_label(node), found.reason)))
                continue
            misses += [(index, NearMiss(rule.name, node_label(node), r)) for r in passed_over]
            match, fused, func = found
            for i in match.nodes:
                claimed[i] = f"{rule.name} {fused.name}"
            replacements.append((max(match.nodes), fused))
            functions.setdefault((func.name, func.overload), func)
            replaced = [node_label(view.nodes[i]) for i in match.nodes]
            result.fusions.append(Fusion(rule.name, fused.name, replaced))
        reasons = set()  # one entry per reason: a chain tried from each of its nodes fails once
        for _, miss in sorted(misses, key=lambda m: m[0]):
            short = miss.reason.removeprefix(f"{miss.at}: ")  # a check's reason names its root
            if miss.reason not in reasons and short not in reasons:
                reasons.update((miss.reason, short))
                result.near_misses.append(miss)
    if replacements:
        _apply(result.model, view, claimed, replacements, list(functions.values()))


def _match_at(view: GraphView, rule: Rule, index: int, claimed: dict, skip: dict, names,
              passed_over: list | None = None):  # fmt: skip
    """The first acceptable match rooted at node `index` (with its fused node), or a Failure.
    passed_over, when given, gets the check's reasons against larger matches at the same root
    that the accepted one leaves out (a conv fused without the Pad before it: why not the
    Pad)."""
    node = view.nodes[index]
    label = node_label(node)
    if rule.finder is not None:
        return _accept_found(view, rule, index, claimed, skip, names)
    root_output = (rule.pattern.index or 0) if isinstance(rule.pattern, Output) else 0
    if root_output >= len(node.output):
        return Failure(0, f"{label}: has no output {root_output}")
    matcher = Matcher(view)
    checked_out: list[tuple[set, str]] = []  # matches the rule's check refused, and why
    for state in matcher.match(rule.pattern, node.output[root_output], start_state(), label):
        match = Match(view, state)
        outputs = _flat(match[name] for name in rule.outputs) or [node.output[root_output]]
        reason = _acceptable(view, rule, match, index, outputs, claimed, skip, names)
        if isinstance(reason, tuple):
            if passed_over is not None:
                kept = set(match.nodes)
                passed_over += [r for nodes, r in checked_out if nodes > kept]
            return reason
        if isinstance(reason, _Refused):
            checked_out.append((set(match.nodes), reason))
        matcher.fail(state, reason, bonus=FULL_MATCH)
    return matcher.tracer.best or Failure(0, f"{label}: no match")


def _accept_found(view: GraphView, rule: Rule, index: int, claimed: dict, skip: dict, names):
    """Candidates from a rule's own finder go through the same checks as pattern matches."""
    node = view.nodes[index]
    found = rule.finder(view, index)
    if not found:
        return Failure(0, f"{node_label(node)}: no match")
    if isinstance(found, str):
        return Failure(FULL_MATCH, f"{node_label(node)}: {found}")
    reason = ""
    for match in found:
        outputs = _flat(match[name] for name in rule.outputs)
        reason = _acceptable(view, rule, match, index, outputs, claimed, skip, names)
        if isinstance(reason, tuple):
            return reason
    return Failure(FULL_MATCH, reason)


class _Refused(str):
    """A reason the rule's own check gave (not an overlap or an escaping value)."""


def _acceptable(view, rule: Rule, match: Match, index: int, outputs: list, claimed: dict,
                skip: dict, names: _FusedNames):  # fmt: skip
    """(match, fused node, function) if the match may be fused, else the reason it may not."""
    root = view.nodes[index]
    label = node_label(root)
    inputs = _flat(match[name] for name in rule.inputs)
    if rule.absorb_shapes:
        match.nodes, computed, reads = absorb_shapes(view, match.nodes, outputs)
        inputs = [("" if value in computed else value) for value in inputs] + reads
    reason = (
        _overlap(view, match, claimed)
        or _escapes(view, match, outputs)
        or _feeds_itself(view, match, inputs)
    )
    if not reason and rule.check is not None:
        verdict = rule.check(match)
        reason = _Refused(f"{label}: {verdict}") if verdict else None
    if not reason:
        try:
            name = names.of(index, root.name or f"{rule.name}_{outputs[0]}")
            fused, func = _fused_node(view, rule, match, name, inputs, outputs)
        except BodyError as exc:
            return f"{label}: {exc}"
        if fused.name not in skip:
            return match, fused, func
        reason = f"{label}: {skip[fused.name]}"
    return reason


def _flat(values) -> list[str]:
    """Captured values in order, a variadic capture (a list) spliced in place."""
    out: list[str] = []
    for value in values:
        out.extend(value if isinstance(value, list) else [value or ""])
    return out


def _is_near_miss(rule: Rule, failure: Failure) -> bool:
    if failure.score >= FULL_MATCH:
        return True
    if rule.explain_after is not None:
        return rule.explain_after in failure.ops
    return failure.score >= 2


def _overlap(view: GraphView, match: Match, claimed: dict) -> str | None:
    for i in match.nodes:
        if i in claimed:
            return f"{node_label(view.nodes[i])}: already part of {claimed[i]}"
    return None


def _escapes(view: GraphView, match: Match, outputs: list[str]) -> str | None:
    """Why a value computed inside the match is needed outside it, if one is."""
    inside = set(match.nodes)
    for i in match.nodes:
        node = view.nodes[i]
        for value in node.output:
            if not value or value in outputs:
                continue
            if view.is_graph_output(value):
                return f"{node_label(node)}: its output {value} is also a graph output"
            for user in view.consumers.get(value, ()):
                if user not in inside:
                    other = node_label(view.nodes[user])
                    return f"{node_label(node)}: its output {value} is also used by {other}"
    return None


def _feeds_itself(view: GraphView, match: Match, inputs: list[str]) -> str | None:
    """Why the fused node would read a value only it computes, if it would (a finder's match
    whose parts feed each other, e.g. consecutive convs that are all concatenated)."""
    inside = set(match.nodes)
    for value in inputs:
        producer = view.producer.get(value) if value else None
        if producer is not None and producer[0] in inside:
            node = node_label(view.nodes[producer[0]])
            return f"{node}: its output {value} would be an input of the node that replaces it"
    return None


class _FusedNames:
    """The names of one stage's fused nodes, each unique in the graph (onnxruntime refuses a
    model with two nodes of one name, and a rollback after verification keys on them): the
    root's own name when no other node of the graph holds it (the fused node takes the root's
    place), else a fresh one from the graph's allocator (view.node_names) on the root's name, or
    on `{rule}_{first output}` for an unnamed root. A root tried again with the same hint (by
    another match, another rule) gets the same name, so a rewrite with `skip` names a fusion as
    the rewrite before it did."""

    def __init__(self, view: GraphView):
        self.view = view
        self.holders = Counter(node.name for node in view.nodes)
        self.given: dict[tuple[int, str], str] = {}

    def of(self, root: int, hint: str) -> str:
        key = (root, hint)
        if key not in self.given:
            own = self.view.nodes[root].name
            alone = hint == own and self.holders[own] == 1
            self.given[key] = own if alone else self.view.node_names.fresh(hint)
        return self.given[key]


def _fused_node(view: GraphView, rule: Rule, match: Match, name: str, inputs, outputs):
    attrs = rule.attributes(match) if rule.attributes else {}
    inputs = list(inputs)
    func = build_function(view, rule.name, match.nodes, inputs, outputs, list(attrs))
    while inputs and not inputs[-1]:
        inputs.pop()
    node = helper.make_node(rule.name, inputs, outputs, name=name, domain=DOMAIN, **attrs)
    node.overload = func.overload
    return node, func


def _apply(model, view: GraphView, claimed: dict, replacements, functions) -> None:
    at = dict(replacements)
    nodes = []
    for index, node in enumerate(view.nodes):
        if index in at:
            nodes.append(at[index])
        elif index not in claimed:
            nodes.append(node)
    graph = model.graph
    before = _in_use(graph)
    del graph.node[:]
    graph.node.extend(_sorted(nodes))
    _drop_orphans(graph, before)
    known = {(f.domain, f.name, f.overload) for f in model.functions}
    model.functions.extend(f for f in functions if (f.domain, f.name, f.overload) not in known)
    if DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    model.ir_version = max(model.ir_version, FUNCTION_IR_VERSION)


def _sorted(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The rewritten nodes in a stable topological order: a fused node takes its last node's
    place, so a node that reads one of its inner outputs (an LSTM cell's c') may stand before it."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    deps = [
        [producer[v] for v in set(n.input) | implicit_inputs(n) if v in producer] for n in nodes
    ]
    order = topological_order(deps, lambda i: node_label(nodes[i]))
    return [nodes[i] for i in order]
