"""LinearAct:  y = act(x W + b)   x float32 [N, K], W [K, M] constant

The classifier of a CNN (torchvision's fc, MobileNetV3's Gemm + HardSwish + Gemm), in every
form patterns/linear.py knows (MatMul + Add, Gemm with transB/alpha/beta and its C), with any
activation of patterns/activation.py or none, and a Softmax over the classes after it (Keras's
Dense(activation="softmax")). Only a head: x is 2-D and comes from a pooled
feature map (GlobalAveragePool or ReduceMean, through Flatten, Reshape, Dropout and earlier
layers of the head); the products of transformers and recurrent cells are left to their own
entries, and a product elsewhere is not a near-miss. Unfused, the head is the last
onnxruntime island of a fused CNN.

The kernel: kernels/dense_gemm.py's GEMM (W packed once; bias and activation applied to each
tile as it is stored), as the transformers' linear layers run; at batch 1 its one-row tile
streams W. Not NumPy's BLAS: its threads spin on the cores the next kernel needs.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Var, op
from fusion_patterns.activation import (
    activation,
    activation_attributes,
    activation_keywords,
    check_relu6,
)
from fusion_patterns.linear import (
    check_linear,
    linear,
    linear_attributes,
    linear_inputs,
    linear_params,
)

POOLS = {"GlobalAveragePool", "ReduceMean", "GlobalAvgPoolFlatten"}
THROUGH = {"Flatten", "Reshape", "Squeeze", "Dropout", "Identity", "Gemm", "MatMul", "Add", "Relu",
           "Clip", "HardSwish", "Sigmoid", "Mul", "Tanh", "LeakyRelu", "HardSigmoid",
           "Gelu"}  # fmt: skip


def after_pool(m, node) -> str | None:
    """None when the product's x comes from a pooled feature map within a few nodes."""
    value = node.input[0]
    for _ in range(12):
        producer = m.view.producer.get(value)
        if producer is None:
            break
        prev = m.view.nodes[producer[0]]
        if prev.op_type in POOLS:
            return None
        if prev.op_type not in THROUGH or not prev.input:
            break
        value = prev.input[0]
    return f"{node.input[0]} is not a pooled feature map (the rule takes classifier heads)"


def linear_act():
    fc = linear(Var("x", dtype="float32", rank=2), "W", "fc", where=after_pool)
    y = Alt(activation(fc), fc)
    return Alt(op.Softmax(y, _name="softmax"), y)  # Keras's Dense(activation="softmax")


def attributes(m) -> dict:
    softmax = {"softmax": 1} if "softmax" in m.node_index else {}
    return {**linear_attributes(m, "fc"), **activation_attributes(m), **softmax}


def check(m) -> str | None:
    if "softmax" in m.node_index:
        axis = m.attrs("softmax").get("axis", -1)  # defaults filled in by opset: -1, or 1
        if axis not in (-1, 1):
            return f"Softmax {m.node('softmax').name} on axis {axis}, not over the classes"
    return check_linear(m, "W", "fc") or check_relu6(m)


def make_kernel(attrs: dict, constants: list):
    from fusion_kernels.dense_gemm import bind_dense_gemm, prepare_dense  # heavy (Numba): at build
    from fusion_kernels.linear_act import linear_act
    from fusion_kernels.simd.activation import encode

    w, b = linear_params(attrs["fc_linear"], *(list(constants) + [None] * 3)[1:4])
    plan = prepare_dense(w, b, encode(**activation_keywords(attrs)))  # W [K, M] packed once

    softmax = bool(attrs.get("softmax"))

    def finish(y):
        if softmax:  # per row, as onnxruntime: e^(y - max) / sum (a NaN makes its row NaN)
            y -= y.max(axis=1, keepdims=True)
            np.exp(y, out=y)
            y /= y.sum(axis=1, keepdims=True)
        return (y,)

    def run(x, *_constants):
        return finish(linear_act(x, plan))

    def bind(x, *_constants):  # the product bound to x's shape (Tactic.bind)
        call = bind_dense_gemm(x, plan)
        return lambda x, *_constants: finish(call(x))

    run.tactics = [Tactic("kernel", run, bind=bind)]
    return run


RULE = Rule(
    "LinearAct",
    linear_act(),
    inputs=("x", *linear_inputs("W", "fc")),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=1,  # after every rule built on the linear sub-pattern (LSTM and GRU cells)
    description="2-D MatMul/Gemm + bias + optional activation and Softmax, float32 (classifier "
    "heads)",
    explain_after="Gemm",
    from_last=True,
)
