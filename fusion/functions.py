"""The model-local function behind every fused node.

The body is the matched subgraph itself, with values renamed canonically: so plain
onnxruntime (and Netron) can run and show a rewritten model, and the function computes exactly
what the original nodes computed. Constants the body needs that are not inputs of the fused
node (Clip's bounds, Split's sizes) become Constant nodes inside the body. Identical bodies share
one function: its `overload` is a hash of the canonical body, so rewriting is deterministic.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusion.catalog import DOMAIN
from fusion.graph import GraphView

MAX_EMBEDDED_ELEMENTS = 4096  # a larger constant that is not a fused input is a pattern bug


class BodyError(Exception):
    """The matched nodes cannot become a function body (carries the reason)."""


def build_function(
    view: GraphView,
    name: str,
    nodes: list[int],
    inputs: list[str],
    outputs: list[str],
    attributes: list[str],
) -> onnx.FunctionProto:
    """A FunctionProto computing `outputs` from `inputs` with the original `nodes`.

    `attributes` are the fused node's attribute names: declared on the function so the node is
    valid, though the body, being the original nodes, has them written out already.
    """
    matched = [n for i in nodes for n in _inlined(view, view.nodes[i])]
    rename: dict[str, str] = {}
    for k, value in enumerate(inputs):
        if value:
            rename.setdefault(value, f"in{k}")
    produced = {out for node in matched for out in node.output if out}
    body: list[onnx.NodeProto] = []
    for node in matched:
        for value in node.input:
            if value and value not in rename and value not in produced:
                constant = f"const{len(rename)}"
                body.append(_embed_constant(view, value, constant))
                rename[value] = constant
    for k, value in enumerate(outputs):
        rename[value] = f"out{k}"
    for node in matched:
        for value in node.output:
            if value and value not in rename:
                rename[value] = f"t{len(rename)}"
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = ""
        copy.doc_string = ""
        copy.input[:] = [rename.get(v, "") if v else "" for v in node.input]
        copy.output[:] = [rename[v] if v else "" for v in node.output]
        body.append(copy)
    domains = sorted({n.domain or "" for n in body} | {""})
    opsets = [helper.make_opsetid(d, view.opset.get(d, 1)) for d in domains]
    formal_in = [f"in{k}" for k in range(len(inputs))]
    formal_out = [f"out{k}" for k in range(len(outputs))]
    func = helper.make_function(
        DOMAIN, name, formal_in, formal_out, body, opsets, attributes=sorted(attributes)
    )
    func.overload = content_hash(func)
    return func


def content_hash(func: onnx.FunctionProto) -> str:
    """The hash of a function's canonical body and signature, its overload as the rewriter
    writes it: the runtime binds a kernel only to a body whose hash still matches."""
    unnamed = onnx.FunctionProto()
    unnamed.CopyFrom(func)
    unnamed.ClearField("overload")
    return hashlib.sha1(unnamed.SerializeToString(deterministic=True)).hexdigest()[:10]


def _inlined(view: GraphView, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """`node`, or, for a fused node, its function's body in the graph's names: a body that
    calls another model-local function with an overload does not load in onnxruntime."""
    if node.domain != DOMAIN:
        return [node]
    key = (node.domain, node.op_type, node.overload)
    func = next((f for f in view.model.functions if (f.domain, f.name, f.overload) == key), None)
    if func is None:
        raise BodyError(f"fused node {node.name} has no function body to inline")
    names = dict(zip(func.input, list(node.input) + [""] * len(func.input), strict=False))
    names.update(zip(func.output, node.output, strict=False))
    prefix = f"{node.output[0]}/"  # unique (SSA), where node names need not be
    out: list[onnx.NodeProto] = []
    for inner in func.node:
        if any(a.ref_attr_name for a in inner.attribute):
            raise BodyError(f"{node.op_type}'s body reads its attributes; it cannot be inlined")
        for v in (*inner.input, *inner.output):  # the body's own values: apart from the graph's
            if v and v not in names:
                names[v] = view.names.fresh(prefix + v)
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.input[:] = [names[v] if v else "" for v in inner.input]
        copy.output[:] = [names[v] if v else "" for v in inner.output]
        out.extend(_inlined(view, copy))
    return out


def _embed_constant(view: GraphView, value: str, new_name: str) -> onnx.NodeProto:
    array = view.constant(value)
    if array is None:
        raise BodyError(f"{value} is read by the match but is neither a fused input nor constant")
    if array.size > MAX_EMBEDDED_ELEMENTS:
        raise BodyError(f"constant {value} ({array.size} elements) must be a fused input")
    tensor = numpy_helper.from_array(array, new_name)
    return helper.make_node("Constant", [], [new_name], value=tensor)


def single_node_model(
    model: onnx.ModelProto, node: onnx.NodeProto, args, constants=()
) -> tuple[onnx.ModelProto, dict]:
    """A one-node model calling a fused node's function (the model's functions and opsets),
    its inputs typed and shaped by `args` (arrays aligned to node.input, None where absent),
    and the feeds for it: onnxruntime's version of what that node's kernel computes (verify
    checks against it, tactics and the bench time it). Inputs named in `constants` become
    initializers, weights onnxruntime may pre-pack as it does in the whole model."""
    values = {v: np.asarray(a) for v, a in zip(node.input, args, strict=True) if v}
    feeds = {v: a for v, a in values.items() if v not in constants}
    inputs = [
        helper.make_tensor_value_info(v, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for v, a in feeds.items()
    ]
    inits = [numpy_helper.from_array(a, v) for v, a in values.items() if v in constants]
    outputs = [onnx.ValueInfoProto(name=v) for v in node.output if v]
    graph = helper.make_graph([node], f"single_{node.op_type}", inputs, outputs, inits)
    single = helper.make_model(
        graph,
        opset_imports=list(model.opset_import),
        functions=list(model.functions),
        ir_version=model.ir_version,
    )
    return single, feeds
