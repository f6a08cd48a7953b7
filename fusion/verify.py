"""Checking a fused model against its original, with onnxruntime as the oracle.

    report = verify("model.onnx", "model.fused.onnx", per_node=True)
    print(report)            # per output: max abs / rel error, pass or FAIL; per fused node too
    assert report.ok, report.first_bad_node

The original runs in onnxruntime (no graph optimizations: the model as written), the fused model
in fusion.Session, both on the same inputs. With per_node, every fused node's kernel is also
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
from onnx import helper, numpy_helper

from fusion.catalog import DOMAIN, Catalog
from fusion.errors import FusionError
from fusion.feeds import model_inputs
from fusion.graph import GraphView, node_label
from fusion.modelfile import as_model
from fusion.numerics import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare_arrays, tolerance
from fusion.ort import REFERENCE, inference_session
from fusion.registry import default_catalog
from fusion.rewriter import rewrite
from fusion.runtime import Session
from fusion.runtime.kernel import build_kernel


@dataclass
class VerifyReport:
    outputs: list[Comparison]
    nodes: list[Comparison] = field(default_factory=list)  # per_node comparisons, in run order
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    inputs: str = ""  # where the inputs came from

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.outputs) and all(c.ok for c in self.nodes)

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
            "first_bad_node": self.first_bad_node,
        }

    def __str__(self) -> str:
        lines = [f"inputs: {self.inputs}; tolerance rtol={self.rtol:g} atol={self.atol:g}"]
        lines += _table("output", self.outputs)
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

    feeds, source = model_inputs(original, inputs, seed, dims)
    fused_session = Session(fused, threads=None, fuse=False, catalog=catalog)
    values = fused_session.run_with_intermediates(feeds)  # first: its feed errors are one line
    expected = inference_session(original, REFERENCE).run(None, feeds)
    report = VerifyReport([], rtol=out_rtol, atol=out_atol, inputs=source)
    for out, want in zip(original.graph.output, expected, strict=True):
        if out.name not in values:
            report.outputs.append(Comparison(out.name, np.inf, np.inf, False, note="not produced"))
            continue
        report.outputs.append(compare_arrays(out.name, values[out.name], want, out_rtol, out_atol))
    if not per_node:
        return report
    for step in fused_session.steps:
        if step.kind != "kernel":
            continue
        rule = catalog.get(step.node.op_type)
        args = [values[v] if v else None for v in step.inputs]
        got = [values[v] for v in step.outputs if v]
        node_rtol, node_atol = tolerance([rule], rtol, atol)
        report.nodes += _compare_with_body(fused, step.node, args, got, node_rtol, node_atol)
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
    if isinstance(input_values, Mapping):
        input_values = [input_values.get(v) if v else None for v in node.input]
    kernel = build_kernel(rule, node, GraphView(model))
    got = list(kernel(*input_values))
    outputs = _compare_with_body(model, node, input_values, got, *tolerance([rule], rtol, atol))
    return (
        max(c.max_abs for c in outputs),
        max(c.max_rel for c in outputs),
        all(c.ok for c in outputs),
    )


def _compare_with_body(model, node, args, got, rtol, atol) -> list[Comparison]:
    want = run_function_body(model, node, args)
    names = [v for v in node.output if v]
    label = node_label(node)
    if len(got) != len(want):
        note = f"the kernel returned {len(got)} outputs, the function {len(want)}"
        return [Comparison(names[0], np.inf, np.inf, False, note=note, node=label)]
    return [
        Comparison(**{**vars(compare_arrays(name, g, w, rtol, atol)), "node": label})
        for name, g, w in zip(names, got, want, strict=True)
    ]


def run_function_body(model: onnx.ModelProto, node: onnx.NodeProto, args) -> list[np.ndarray]:
    """onnxruntime's result for one fused node: a one-node model that calls its function."""
    single, feeds = function_body_model(model, node, args)
    return inference_session(single, REFERENCE).run(None, feeds)


def function_body_model(
    model: onnx.ModelProto, node: onnx.NodeProto, args, constants=()
) -> tuple[onnx.ModelProto, dict]:
    """A one-node model calling a fused node's function (the model's functions and opsets),
    its inputs typed and shaped by `args` (aligned to node.input), and the feeds for it.
    Inputs named in `constants` become initializers (weights onnxruntime may pre-pack)."""
    values = {v: np.asarray(a) for v, a in zip(node.input, args, strict=True) if v}
    feeds = {v: a for v, a in values.items() if v not in constants}
    inputs = [
        helper.make_tensor_value_info(v, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for v, a in feeds.items()
    ]
    inits = [numpy_helper.from_array(a, v) for v, a in values.items() if v in constants]
    outputs = [onnx.ValueInfoProto(name=v) for v in node.output if v]
    graph = helper.make_graph([node], f"check_{node.op_type}", inputs, outputs, inits)
    single = helper.make_model(
        graph,
        opset_imports=list(model.opset_import),
        functions=list(model.functions),
        ir_version=model.ir_version,
    )
    return single, feeds
