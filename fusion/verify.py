"""Checking a fused model against its original, with onnxruntime as the oracle.

    report = verify("model.onnx", "model.fused.onnx", per_node=True)
    print(report)            # per output: max abs / rel error, pass or FAIL; per fused node too
    assert report.ok, report.first_bad_node

The original runs in onnxruntime (no graph optimizations: the model as written), the fused model
in fusion.Session with every fused node on its kernel (tactics="kernel": never the onnxruntime
fallback a timed session may choose, which would check nothing), both on the same inputs. A
kernel offering several tactics (blocked layout, NCHW Winograd, ...) is checked with each, as
the runtime may choose any of them on another machine or shape: one more run per further
tactic name, its outputs in `report.tactics`. With per_node, every fused node's kernel is also
checked on the inputs it actually received against onnxruntime running that node's function
body, which names the node at fault instead of just the output that drifted.

Values are compared by fusion.numerics (compare_arrays), with its tolerance rule by default:
the loosest rtol and atol among the rules whose fused nodes appear in the model.

rollback (what `rewrite --verify` and `fusion.rewrite(verify=True)` run) checks a rewrite so,
per node, and rewrites again without the fused nodes that disagree, by name, until none does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from fusion.catalog import DOMAIN, Catalog
from fusion.errors import FusionError, KernelError
from fusion.feeds import model_inputs
from fusion.graph import GraphView, node_label
from fusion.modelfile import as_model
from fusion.numerics import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    Comparison,
    accumulating,
    compare_arrays,
    tolerance,
)
from fusion.ort import REFERENCE, inference_session
from fusion.registry import default_catalog
from fusion.rewriter import RewriteResult, RolledBack, rewrite, write_standard
from fusion.runtime import Session
from fusion.runtime.kernel import binding_refusal, build_kernel
from fusion.runtime.plan import run_body
from fusion.runtime.tactics import POLICIES


@dataclass
class VerifyReport:
    outputs: list[Comparison]
    nodes: list[Comparison] = field(default_factory=list)  # per_node comparisons, in run order
    tactics: list[Comparison] = field(default_factory=list)  # outputs with the other tactics
    complete: bool = True  # False: a kernel stopped a run, so what came after it went unchecked
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    inputs: str = ""  # where the inputs came from

    @property
    def ok(self) -> bool:
        return all(c.ok for c in [*self.outputs, *self.nodes, *self.tactics])

    @property
    def first_bad_node(self) -> str | None:
        return next((c.node for c in self.nodes if not c.ok), None)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "rtol": self.rtol,
            "atol": self.atol,
            "inputs": self.inputs,
            "outputs": [c.to_dict() for c in self.outputs],
            "nodes": [c.to_dict() for c in self.nodes],
            "tactics": [c.to_dict() for c in self.tactics],
            "first_bad_node": self.first_bad_node,
            "complete": self.complete,
        }

    def __str__(self) -> str:
        lines = [f"inputs: {self.inputs}; tolerance rtol={self.rtol:g} atol={self.atol:g}"]
        lines += _table("output", self.outputs)
        if self.tactics:
            lines += _table("output [other tactic]", self.tactics)
        if self.nodes:
            lines += _table("fused node", self.nodes)
        verdict = "PASS" if self.ok else "FAIL"
        if self.first_bad_node:
            verdict += f" (first disagreeing node: {self.first_bad_node})"
        lines.append(verdict)
        return "\n".join(lines)


def _table(title: str, rows: list[Comparison]) -> list[str]:
    labels = [f"{c.node} -> {c.name}" if c.node else c.name for c in rows]
    width = max([len(label) for label in labels] + [len(title)])
    lines = [f"{title:<{width}}  {'shape':<16} {'max abs':>10} {'max rel':>10}  result"]
    for label, c in zip(labels, rows, strict=True):
        result = "ok" if c.ok else f"FAIL {c.note}".rstrip()
        shape = str(list(c.shape))
        lines.append(
            f"{label:<{width}}  {shape:<16} {c.max_abs:>10.3g} {c.max_rel:>10.3g}  {result}"
        )
    return lines


def verify(
    original,
    fused=None,
    inputs=None,
    rtol: float | None = None,
    atol: float | None = None,
    per_node: bool = False,
    seed: int = 0,
    catalog: Catalog | None = None,
    dims: Mapping[str, int] | None = None,
) -> VerifyReport:
    """Compare the fused model's outputs (and, with per_node, each fused node) to the original.

    original, fused: ModelProto or path; fused None means rewrite the original in memory.
    inputs: dict of name -> array or .npy path, an .npz path, an .npy path (one-input model), a
    list in input order, or None for seeded random inputs from the declared shapes.
    """
    original = as_model(original)
    if fused is None:
        fused = rewrite(original, catalog).model
    fused = as_model(fused)
    catalog = catalog if catalog is not None else default_catalog()
    out_rtol, out_atol = tolerance(catalog.rules_in(fused), rtol, atol)
    scaled = accumulating(catalog.rules_in(fused))

    feeds, source = model_inputs(original, inputs, seed, dims)
    report = VerifyReport([], rtol=out_rtol, atol=out_atol, inputs=source)
    try:  # builds every kernel (packs its weights) once, for all the tactics below
        first = Session(fused, fuse=False, catalog=catalog, tactics="kernel")
    except KernelError as exc:  # a kernel that cannot be built: the node at fault
        return _stopped(report, exc, "kernel")
    offered = first.offered
    tactics = ["kernel"]  # each kernel's first tactic, then every other one a kernel offers
    for names in offered.values():
        tactics += [t for t in names[1:] if t not in tactics and t not in POLICIES]
    expected, checked, compared = None, set(), set()
    for tactic in tactics:
        session = first if tactic == "kernel" else first.with_tactics(tactic)
        try:
            values = session.run_with_intermediates(feeds)  # first: its feed errors, one line
        except KernelError as exc:  # a kernel that fails to run: the node at fault
            return _stopped(report, exc, tactic)
        if expected is None:
            expected = inference_session(original, REFERENCE).run(None, feeds)
        steps = [s for s in session.steps_for(feeds) if s.kind == "kernel"]
        checked |= {(s.name, s.choice) for s in steps}
        into = report.outputs if tactic == "kernel" else report.tactics
        suffix = "" if tactic == "kernel" else f" [{tactic}]"
        for out, want in zip(original.graph.output, expected, strict=True):
            name = out.name + suffix
            if out.name not in values:
                into.append(Comparison(name, np.inf, np.inf, False, note="not produced"))
                continue
            into.append(compare_arrays(name, values[out.name], want, out_rtol, out_atol,
                                       scaled=scaled))  # fmt: skip
        if not per_node:
            continue
        # Each (node, tactic) once: a node runs its first tactic under every policy that names
        # none of its own, and a tactic first for one node may come second for another.
        for step in steps:
            if (step.name, step.choice) in compared:
                continue
            compared.add((step.name, step.choice))
            rule = catalog.get(step.node.op_type)
            args = [values[v] if v else None for v in step.node.input]  # NCHW, any tactic
            got = [values[v] for v in step.node.output if v]
            node_rtol, node_atol = tolerance([rule], rtol, atol)
            report.nodes += _compare_with_body(fused, step.node, args, got, node_rtol, node_atol,
                                               rule.accumulates, f" [{step.choice}]")  # fmt: skip
    node_names = {node_label(n): n.name for n in fused.graph.node if n.domain == DOMAIN}
    for label, names in offered.items():  # a tactic no policy name selects alone
        for name in names:
            if (label, name) not in checked:
                note = f"its tactic {name} could not be run alone (a name a policy takes)"
                where = {"node": label, "node_name": node_names.get(label, "")}
                report.nodes.append(Comparison(name, np.inf, np.inf, False, note=note, **where))
    return report


@dataclass
class Rollback:
    """What rollback leaves: `result`, the rewrite whose fused nodes all agreed with onnxruntime
    on the last check (`report`), with `result.rolled_back` the fusions undone on the way and
    why; with standard_ops, `standard`, the check of the standard ops against the original.
    Only the nodes are judged: `report.outputs` may still drift within what each node allows."""

    result: RewriteResult
    report: VerifyReport
    standard: VerifyReport | None = None

    @property
    def disagreeing(self) -> list[Comparison]:
        """What still disagrees: fused nodes the input already had (not this rewrite's, so not
        rolled back), and the standard ops' outputs."""
        rows = [c for c in self.report.nodes if not c.ok]
        if self.standard is not None:
            s = self.standard
            rows += [c for c in [*s.outputs, *s.tactics, *s.nodes] if not c.ok]
        return rows

    @property
    def ok(self) -> bool:
        return not self.disagreeing

    def __str__(self) -> str:
        lines = [f"rolled back: {r.reason}" for r in self.result.rolled_back]
        lines += [f"not rolled back (not fused by this rewrite): {c}"
                  for c in self.report.nodes if not c.ok]  # fmt: skip
        lines.append(f"verified {len(self.report.nodes)} fused node outputs (each tactic of each "
                     "kernel) against onnxruntime")  # fmt: skip
        if self.standard is not None:
            lines.append(f"verified the standard ops against the original:\n{self.standard}")
        return "\n".join(lines)


def rollback(
    original,
    result: RewriteResult,
    catalog: Catalog | None = None,
    inputs=None,
    *,
    skip: Mapping[str, str] | None = None,
    standard_ops: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
) -> Rollback:
    """Check every fused node of `result` (rewrite(original, catalog)) on a real run, with each
    tactic its kernel offers, and rewrite again without those that disagree (outside tolerance,
    or a kernel that fails or returns what its node does not declare), keyed by node name.

    Verified again after every rollback, until a run finds no disagreement: a kernel that fails
    stops the run before the nodes after it, and a chain rolled back at its root may fuse again
    shorter, under another node's name, which is then checked in turn. With standard_ops the
    fused nodes that have a standard form (an unrolled LSTM chain) are then written as it and
    checked against the original. skip: what `result` was rewritten without (rewrite's skip),
    kept in every rewrite after; inputs, rtol, atol, seed, dims: as verify's. When nothing is
    rolled back the result returned is `result` itself (written as standard ops, if asked).

    >>> done = rollback(model, rewrite(model))
    >>> [(r.node, r.rule, r.reason) for r in done.result.rolled_back]
    """
    if result.standard:
        raise FusionError("rollback checks fused nodes: pass standard_ops to it, not to rewrite")
    original = as_model(original)
    catalog = catalog if catalog is not None else default_catalog()
    check = {"inputs": inputs, "rtol": rtol, "atol": atol, "seed": seed, "catalog": catalog,
             "dims": dims}  # fmt: skip
    undone: list[RolledBack] = []
    skip = dict(skip or {})
    for _ in range(len(original.graph.node) + 1):  # each round skips one more name at least
        report = verify(original, result.model, per_node=True, **check)
        rules = _fused_here(result)
        bad: dict[str, RolledBack] = {}
        for c in report.nodes:
            if not c.ok and c.node_name in rules:
                bad[c.node_name] = RolledBack(c.node_name, rules[c.node_name], _disagreement(c),
                                              c.max_abs, c.max_rel)  # fmt: skip
        if not bad:
            break
        undone += bad.values()
        skip.update({name: f"rolled back: {r.reason}" for name, r in bad.items()})
        result = rewrite(original, catalog, skip=skip)
    else:
        raise RuntimeError(f"rollback did not settle in {len(original.graph.node) + 1} rounds")
    result.rolled_back = undone
    done = Rollback(result, report)
    if standard_ops and result.fusions:
        write_standard(result, catalog)
        if result.standard:
            done.standard = verify(original, result.model, **check)
    return done


def _fused_here(result: RewriteResult) -> dict[str, str]:
    """Name -> rule of the fused nodes this rewrite made that its model runs."""
    made = {(f.rule, f.node) for f in result.fusions}
    nodes = result.model.graph.node
    return {n.name: n.op_type for n in nodes if n.domain == DOMAIN and (n.op_type, n.name) in made}


def _disagreement(c: Comparison) -> str:
    figures = c.note or f"max abs error {c.max_abs:.3g}, max rel {c.max_rel:.3g}"
    return f"kernel disagrees with onnxruntime on {c.name} ({figures})"


def _stopped(report: VerifyReport, exc: KernelError, tactic: str) -> VerifyReport:
    """The report of a run a kernel stopped: that node at fault, what came after unchecked."""
    note = str(exc) if tactic == "kernel" else f"tactic {tactic}: {exc}"
    report.nodes.append(Comparison(exc.name, np.inf, np.inf, False, note=note, node=exc.node,
                                   node_name=exc.name))  # fmt: skip
    report.complete = False
    return report


def verify_node(
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    input_values,
    catalog: Catalog | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[float, float, bool]:
    """Run one fused node's kernel and its function body on the same inputs; compare.

    input_values: a list aligned to node.input (None for absent inputs) or a dict by name.
    Returns (max_abs, max_rel, ok) over the node's outputs, with the rule's tolerances unless
    given. For a rewriter's rollback:

    >>> max_abs, max_rel, ok = verify_node(fused_model, fused_node, [x, w, b])
    """
    catalog = catalog if catalog is not None else default_catalog()
    rule = catalog.get(node.op_type)
    if rule is None or node.domain != DOMAIN:
        raise FusionError(f"{node_label(node)} is not a fused node of a rule in the catalog")
    key = (node.domain, node.op_type, node.overload)
    body = next((f for f in model.functions if (f.domain, f.name, f.overload) == key), None)
    reason = binding_refusal(rule, node, body)
    if reason is not None:
        raise FusionError(f"{node_label(node)}: the kernel does not run this node: {reason}")
    if isinstance(input_values, Mapping):
        input_values = [input_values.get(v) if v else None for v in node.input]
    kernel = build_kernel(rule, node, GraphView(model))
    got = list(kernel(*input_values))
    outputs = _compare_with_body(model, node, input_values, got, *tolerance([rule], rtol, atol),
                                 rule.accumulates)  # fmt: skip
    return (
        max(c.max_abs for c in outputs),
        max(c.max_rel for c in outputs),
        all(c.ok for c in outputs),
    )


def _compare_with_body(model, node, args, got, rtol, atol, scaled=False, suffix=""):
    want = run_function_body(model, node, args)
    names = [v + suffix for v in node.output if v]
    where = {"node": node_label(node), "node_name": node.name}
    if len(got) != len(want):
        note = f"the kernel returned {len(got)} outputs, the function {len(want)}"
        return [Comparison(names[0], np.inf, np.inf, False, note=note, **where)]
    return [
        Comparison(**{**vars(compare_arrays(name, g, w, rtol, atol, scaled=scaled)), **where})
        for name, g, w in zip(names, got, want, strict=True)
    ]


def run_function_body(model: onnx.ModelProto, node: onnx.NodeProto, args) -> list[np.ndarray]:
    """onnxruntime's result for one fused node (the model as written): its function body."""
    return run_body(model, node, args, REFERENCE)
