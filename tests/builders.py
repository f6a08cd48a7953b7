"""Small ONNX graphs for tests, built with onnx.helper, and the onnxruntime oracle."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

FLOAT = TensorProto.FLOAT


class GraphBuilder:
    """Collects nodes and initializers; `model()` wraps them with typed inputs and outputs."""

    def __init__(self, opset: int = 17, seed: int = 0):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self._count = 0

    def const(self, array, name: str | None = None) -> str:
        name = name or self._fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, *shape, scale: float = 0.3) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op_type: str, inputs, n_out: int = 1, name: str | None = None, **attrs):
        name = name or self._fresh(f"/{op_type.lower()}")
        outs = [f"{name}_out{k}" if n_out > 1 else f"{name}_out" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name, **attrs))
        return outs if n_out > 1 else outs[0]

    def model(self, inputs: dict, outputs, elem=FLOAT, ir_version: int | None = None):
        """inputs: name -> shape; outputs: list of names (shapes left to inference)."""
        graph = helper.make_graph(
            self.nodes,
            "test",
            [helper.make_tensor_value_info(n, elem, s) for n, s in inputs.items()],
            [helper.make_tensor_value_info(n, elem, None) for n in outputs],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        if ir_version is not None:
            model.ir_version = ir_version
        inferred = onnx.shape_inference.infer_shapes(model)  # typed outputs, as exporters write
        del model.graph.output[:]
        model.graph.output.extend(inferred.graph.output)
        if any(not o.type.tensor_type.HasField("shape") for o in model.graph.output):
            _shapes_from_a_run(model)
        return model

    def _fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"


def conv_block(
    g: GraphBuilder,
    x: str,
    cin: int,
    cout: int,
    k: int = 3,
    bias: str = "input",  # "input" (Conv's third input), "add", "both" or "none"
    bias_shape: tuple | None = None,
    act: str = "relu",  # "relu", "clip" (input bounds or attributes by opset), "relu6", "none"
    **conv_attrs,
) -> str:
    w = g.weight(cout, cin // conv_attrs.get("group", 1), k, k)
    inputs = [x, w]
    if bias in ("input", "both"):
        inputs.append(g.weight(cout, scale=0.1))
    y = g.node("Conv", inputs, **conv_attrs)
    if bias in ("add", "both"):
        shape = bias_shape or (1, cout, 1, 1)
        y = g.node("Add", [y, g.weight(*shape, scale=0.1)])
    if act == "relu":
        y = g.node("Relu", [y])
    elif act in ("clip", "relu6"):
        lo, hi = 0.0, (6.0 if act == "relu6" else 0.5)
        if g.opset >= 11:
            lo_name = g.const(np.array(lo, np.float32))
            hi_name = g.const(np.array(hi, np.float32))
            y = g.node("Clip", [y, lo_name, hi_name])
        else:
            y = g.node("Clip", [y], min=lo, max=hi)
    return y


def _shapes_from_a_run(model: onnx.ModelProto) -> None:
    """Where inference gives up, take the output ranks and sizes from one onnxruntime run."""
    results = run_ort(model, random_feeds(model, batch=1))
    for out, value in zip(model.graph.output, results, strict=True):
        dims = ["N", *value.shape[1:]] if value.ndim else []
        out.CopyFrom(helper.make_tensor_value_info(out.name, out.type.tensor_type.elem_type, dims))


def run_ort(model: onnx.ModelProto, feeds: dict, optimize: bool = False) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def random_feeds(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def fused_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == "fusion"]
