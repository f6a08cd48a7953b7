"""A stack of 3x3 Conv + bias + Relu blocks, the built-in example (`fusion demo`, the tests and
the benchmarks), written the way a real exporter does, with seeded random weights.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from fusion.models.builder import GraphBuilder


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
    g = GraphBuilder(opset, seed)
    x = "input"
    scale = np.sqrt(2.0 / (9 * channels))  # He init keeps activations O(1) through the stack
    for i in range(blocks):
        w = (g.rng.standard_normal((channels, channels, 3, 3)) * scale).astype(np.float32)
        b = (g.rng.standard_normal(channels) * 0.1).astype(np.float32)
        wname = g.const(w, f"conv{i}.weight")
        conv_attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}
        if form == "tf":
            bias = g.const(b.reshape(1, channels, 1, 1), f"conv{i}.bias")
            y = g.node("Conv", [x, wname], name=f"/conv{i}/Conv", **conv_attrs)
            y = g.node("Add", [y, bias], name=f"/add{i}/Add")
        elif form == "pytorch":
            bias = g.const(b, f"conv{i}.bias")
            g.nodes.append(
                helper.make_node("Identity", [wname], [f"/identity{i}"], f"/Identity_{i}")
            )
            y = g.node("Conv", [x, f"/identity{i}", bias], name=f"/conv{i}/Conv", **conv_attrs)
        else:
            raise ValueError(f"unknown form {form!r} (tf or pytorch)")
        x = g.node("Relu", [y], name=f"/relu{i}/Relu")
    shape = [batch, channels, size, size]
    model = g.model({"input": shape}, {x: shape}, name=f"conv_stack_{form}")
    model.producer_name = "fusion.models"
    return model


def conv_stack_flops(blocks: int = 4, channels: int = 64, size: int = 56, batch: int = 1) -> int:
    """Multiply-adds counted as 2 FLOPs, the convention GFLOP/s figures use."""
    return 2 * blocks * batch * channels * channels * 9 * size * size
