"""Checking a fused model against its original, with onnxruntime as the oracle.

    report = verify("model.onnx", "model.fused.onnx", per_node=True)
    print(report)            # per output: max abs / rel error, pass or FAIL; per fused node too
    assert report.ok, report.first_bad_node

The original runs in onnxruntime (no graph optimizations: the model as written), the fused model
in fusion.Session, both on the same inputs. With per_node, every fused node's kernel is also
checked on the inputs it actually received against onnxruntime running that node's function
body, which names the node at fault instead of just the output that drifted.

A float element passes when |fused - original| <= atol + rtol * |original| (NaN matches NaN);
integers and booleans must be equal. The reported relative error is |fused - original| /
max(|original|, atol / rtol): below atol / rtol the absolute tolerance is what counts, so values
near zero do not make it meaningless, and a passing output has max_rel <= 2 * rtol. Default
tolerances: the loosest rtol and atol among the rules whose fused nodes appear in the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from fusion.catalog import DOMAIN, Catalog, Rule, default_catalog
from fusion.graph import GraphView, node_label
from fusion.io import FusionError
from fusion.runtime import Session, load

BATCH_DIM = 1  # a symbolic first axis (batch) in random inputs
OTHER_DIM = 32  # any other symbolic axis in random inputs (override with dims={"name": n})
RULE_RTOL = Rule.__dataclass_fields__["rtol"].default  # when no fused node names a rule
RULE_ATOL = Rule.__dataclass_fields__["atol"].default


@dataclass
class Check:
    """One compared value: a graph output, or one output of one fused node."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    shape: tuple = ()
    note: str = ""  # why it failed beyond the numbers (shape or dtype mismatch)
    node: str = ""  # per-node checks: the fused node's label

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


@dataclass
class VerifyReport:
    outputs: list[Check]
    nodes: list[Check] = field(default_factory=list)  # per_node checks, in run order
    rtol: float = RULE_RTOL
    atol: float = RULE_ATOL
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


def _table(title: str, checks: list[Check]) -> list[str]:
    labels = [f"{c.node} -> {c.name}" if c.node else c.name for c in checks]
    width = max([len(label) for label in labels] + [len(title)])
    lines = [f"{title:<{width}}  {'shape':<16} {'max abs':>10} {'max rel':>10}  result"]
    for label, c in zip(labels, checks, strict=True):
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
    original = load(original)
    if fused is None:
        from fusion.rewriter import rewrite

        fused = rewrite(original, catalog).model
    fused = load(fused)
    catalog = catalog if catalog is not None else default_catalog()
    rules = [catalog.get(n.op_type) for n in fused.graph.node if n.domain == DOMAIN]
    rules = [r for r in rules if r is not None]
    out_rtol = rtol if rtol is not None else max([r.rtol for r in rules], default=RULE_RTOL)
    out_atol = atol if atol is not None else max([r.atol for r in rules], default=RULE_ATOL)

    feeds, source = model_inputs(original, inputs, seed, dims)
    session = Session(fused, threads=None, fuse=False, catalog=catalog)
    values = session.run_with_intermediates(feeds)  # first: its feed errors are one line
    expected = _reference(original).run(None, feeds)
    report = VerifyReport([], rtol=out_rtol, atol=out_atol, inputs=source)
    for out, want in zip(original.graph.output, expected, strict=True):
        if out.name not in values:
            report.outputs.append(Check(out.name, np.inf, np.inf, False, note="not produced"))
            continue
        report.outputs.append(compare(out.name, values[out.name], want, out_rtol, out_atol))
    if not per_node:
        return report
    for step in session.steps:
        if step.kind != "kernel":
            continue
        rule = catalog.get(step.node.op_type)
        args = [values[v] if v else None for v in step.inputs]
        got = [values[v] for v in step.outputs if v]
        report.nodes += _check_against_body(
            fused,
            step.node,
            args,
            got,
            rtol if rtol is not None else rule.rtol,
            atol if atol is not None else rule.atol,
        )
    return report


def check_node(
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

    >>> max_abs, max_rel, ok = check_node(fused_model, fused_node, [x, w, b])
    """
    catalog = catalog if catalog is not None else default_catalog()
    rule = catalog.get(node.op_type)
    if rule is None or node.domain != DOMAIN:
        raise FusionError(f"{node_label(node)} is not a fused node of a rule in the catalog")
    if isinstance(input_values, Mapping):
        input_values = [input_values.get(v) if v else None for v in node.input]
    view = GraphView(model)
    attrs = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        attrs[a.name] = value.decode() if isinstance(value, bytes) else value
    kernel = rule.make_kernel(attrs, [view.constant(v) if v else None for v in node.input])
    got = list(kernel(*input_values))
    rtol, atol = rule.rtol if rtol is None else rtol, rule.atol if atol is None else atol
    checks = _check_against_body(model, node, input_values, got, rtol, atol)
    return (
        max(c.max_abs for c in checks),
        max(c.max_rel for c in checks),
        all(c.ok for c in checks),
    )


def _check_against_body(model, node, args, got, rtol, atol) -> list[Check]:
    want = run_function_body(model, node, args)
    names = [v for v in node.output if v]
    label = node_label(node)
    if len(got) != len(want):
        note = f"the kernel returned {len(got)} outputs, the function {len(want)}"
        return [Check(names[0], np.inf, np.inf, False, note=note, node=label)]
    return [
        Check(**{**vars(compare(name, g, w, rtol, atol)), "node": label})
        for name, g, w in zip(names, got, want, strict=True)
    ]


def run_function_body(model: onnx.ModelProto, node: onnx.NodeProto, args) -> list[np.ndarray]:
    """onnxruntime's result for one fused node: a one-node model that calls its function."""
    feeds = {v: np.asarray(a) for v, a in zip(node.input, args, strict=True) if v}
    inputs = [
        helper.make_tensor_value_info(v, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for v, a in feeds.items()
    ]
    outputs = [onnx.ValueInfoProto(name=v) for v in node.output if v]
    graph = helper.make_graph([node], f"check_{node.op_type}", inputs, outputs)
    single = helper.make_model(
        graph,
        opset_imports=list(model.opset_import),
        functions=list(model.functions),
        ir_version=model.ir_version,
    )
    session = _reference(single)
    return session.run(None, feeds)


def compare(name: str, got, want, rtol: float, atol: float) -> Check:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        note = f"shape {list(got.shape)}, expected {list(want.shape)}"
        return Check(name, np.inf, np.inf, False, tuple(want.shape), note)
    note = "" if got.dtype == want.dtype else f"dtype {got.dtype}, expected {want.dtype}"
    if got.size == 0 or got.dtype.kind != "f" or want.dtype.kind != "f":
        ok = np.array_equal(got, want) and not note  # integers, booleans: exactly
        return Check(name, 0.0 if ok else np.inf, 0.0 if ok else np.inf, ok, got.shape, note)
    a, b = got.astype(np.float64), want.astype(np.float64)
    floor = atol / rtol if rtol > 0 else atol or np.finfo(np.float64).tiny
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))  # equal infinities and NaNs agree
        err = np.where(same, 0.0, np.abs(a - b))
        err[np.isnan(err)] = np.inf  # NaN against a number is as bad as it gets
        rel = err / np.where(same, 1.0, np.maximum(np.abs(b), floor))
        ok = bool(np.all(same | (err <= atol + rtol * np.abs(b)))) and not note
    return Check(name, float(err.max()), float(rel.max()), ok, got.shape, note)


# ---- inputs ----------------------------------------------------------------------------------
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


def _reference(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: warnings would break one-line stderr
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
