"""The one ONNX graph builder behind the example models, the benchmarks and the tests.

    g = GraphBuilder(opset=17)
    y = g.node("Relu", [g.node("Conv", ["x", g.const(w, "conv.weight")], name="/conv/Conv")])
    model = g.model({"x": ["N", 3, 8, 8]}, {y: None})

Names follow torch.onnx.export by default: a node "/Conv_3" writes "/Conv_3_output_0"; a
subclass changes `node_name` / `output_names` for another convention.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class GraphBuilder:
    """Collects nodes and initializers; `model()` wraps them with typed inputs and outputs."""

    def __init__(self, opset: int = 17, seed: int = 0, first: int = 0):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.count = first  # fresh names count from here (subgraphs share one namespace)

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, array, name: str | None = None) -> str:
        """An initializer holding `array`; returns its name."""
        name = name or self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node_name(self, op_type: str) -> str:
        return self.fresh(f"/{op_type}_")

    def output_names(self, name: str, n_out: int) -> list[str]:
        return [f"{name}_output_{k}" for k in range(n_out)]

    def node(self, op_type: str, inputs, n_out: int = 1, name: str | None = None, **attrs):
        """Append a node; returns its output (a list of them when n_out > 1)."""
        name = name or self.node_name(op_type)
        outs = self.output_names(name, n_out)
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name, **attrs))
        return outs if n_out > 1 else outs[0]

    def model(
        self, inputs: dict, outputs: dict, elem: int = TensorProto.FLOAT, name: str = "main_graph"
    ) -> onnx.ModelProto:
        """inputs, outputs: value name -> shape (None: unknown) of element type `elem`."""

        def info(specs):
            return [helper.make_tensor_value_info(n, elem, s) for n, s in specs.items()]

        graph = helper.make_graph(self.nodes, name, info(inputs), info(outputs), self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
