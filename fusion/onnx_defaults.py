"""ONNX attribute defaults, so that patterns see `strides=[1, 1]` on a Conv that omits it.

Two sources: the operator schema's declared default values, and the defaults the spec only
states in prose ("If not present, the stride defaults to 1 along each spatial axis"), which
depend on the rank of the weight or input and are filled in here.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

# Ops whose spatial attributes default by rank: the number of spatial axes comes from the weight
# (input 1) for convolutions and from the input (input 0) for pooling.
_SPATIAL_OPS = {"Conv": 1, "ConvTranspose": 1, "MaxPool": 0, "AveragePool": 0, "LpPool": 0}


def schema_defaults(op_type: str, opset: int, domain: str = "") -> dict:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return {}
    out = {}
    for name, attr in schema.attributes.items():
        if attr.default_value.type != onnx.AttributeProto.UNDEFINED:
            value = onnx.helper.get_attribute_value(attr.default_value)
            out[name] = value.decode() if isinstance(value, bytes) else value
    return out


def attribute_defaults(node: onnx.NodeProto, opsets: dict, type_of: Callable) -> dict:
    """Defaults of the node's attributes at the graph's opsets (domain -> version); type_of(value)
    gives a value's ValueType (the rank of a weight or input, for the spatial defaults)."""
    domain = node.domain if node.domain != "ai.onnx" else ""
    opset = opsets.get(domain)
    if opset is None:
        return {}
    attrs = schema_defaults(node.op_type, opset, domain)
    if domain == "" and node.op_type in _SPATIAL_OPS:
        attrs.update(_spatial_defaults(node, type_of, _SPATIAL_OPS[node.op_type]))
    return attrs


def _spatial_defaults(node: onnx.NodeProto, type_of: Callable, shape_input: int) -> dict:
    given = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    kernel = given.get("kernel_shape")
    if kernel is None and shape_input == 1 and len(node.input) > 1:
        vt = type_of(node.input[1])
        if vt is not None and vt.shape is not None and all(isinstance(d, int) for d in vt.shape):
            kernel = list(vt.shape[2:])
    n = len(kernel) if kernel is not None else None
    if n is None and len(node.input) > shape_input:
        vt = type_of(node.input[shape_input])
        n = vt.rank - 2 if vt is not None and vt.rank is not None else None
    if n is None:
        return {}
    out = {"strides": [1] * n, "pads": [0] * (2 * n), "dilations": [1] * n}
    if kernel is not None:
        out["kernel_shape"] = list(kernel)
    if node.op_type == "ConvTranspose":
        out["output_padding"] = [0] * n
    return out
