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
from fusion.rewriter import rewrite
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
    expected, checked = None, set()
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
        for step in steps:
            if tactic != "kernel" and step.choice != tactic:
                continue  # each (node, tactic) once
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
