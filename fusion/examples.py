"""Built-in example models (no download): used by `fusion demo`, the tests and the benchmark.

Each builder writes the graph the way a real exporter does, with seeded random weights.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv_stack(
    blocks: int = 4,
    channels: int = 64,
    size: int = 56,
    batch: int | str = "N",
    form: str = "tf",
    opset: int = 17,
    seed: int = 0,
) -> onnx.ModelProto:
    """`blocks` 3x3 pad-1 Conv + bias + Relu blocks on a [batch, channels, size, size] input.

    form "tf": Conv without bias, then Add of a [1,C,1,1] constant, then Relu (TensorFlow
    converters). form "pytorch": Conv with its bias input, weights behind Identity, then Relu.
    """
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "input"
    scale = np.sqrt(2.0 / (9 * channels))  # He init keeps activations O(1) through the stack
    for i in range(blocks):
        w = (rng.standard_normal((channels, channels, 3, 3)) * scale).astype(np.float32)
        b = (rng.standard_normal(channels) * 0.1).astype(np.float32)
        wname, conv_out, out = (
            f"conv{i}.weight",
            f"/conv{i}/Conv_output_0",
            f"/relu{i}/Relu_output_0",
        )
        inits.append(numpy_helper.from_array(w, wname))
        conv_attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}
        if form == "tf":
            inits.append(numpy_helper.from_array(b.reshape(1, channels, 1, 1), f"conv{i}.bias"))
            nodes.append(
                helper.make_node("Conv", [x, wname], [conv_out], f"/conv{i}/Conv", **conv_attrs)
            )
            nodes.append(
                helper.make_node(
                    "Add", [conv_out, f"conv{i}.bias"], [f"/add{i}/Add_output_0"], f"/add{i}/Add"
                )
            )
            conv_out = f"/add{i}/Add_output_0"
        elif form == "pytorch":
            inits.append(numpy_helper.from_array(b, f"conv{i}.bias"))
            nodes.append(helper.make_node("Identity", [wname], [f"/identity{i}"], f"/Identity_{i}"))
            nodes.append(
                helper.make_node(
                    "Conv",
                    [x, f"/identity{i}", f"conv{i}.bias"],
                    [conv_out],
                    f"/conv{i}/Conv",
                    **conv_attrs,
                )
            )
        else:
            raise ValueError(f"unknown form {form!r} (tf or pytorch)")
        nodes.append(helper.make_node("Relu", [conv_out], [out], f"/relu{i}/Relu"))
        x = out
    shape = [batch, channels, size, size]
    graph = helper.make_graph(
        nodes,
        f"conv_stack_{form}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.producer_name = "fusion.examples"
    return model


def conv_stack_flops(blocks: int = 4, channels: int = 64, size: int = 56, batch: int = 1) -> int:
    """Multiply-adds counted as 2 FLOPs, the convention GFLOP/s figures use."""
    return 2 * blocks * batch * channels * channels * 9 * size * size
