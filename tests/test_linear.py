"""patterns/linear.py: the linear(x, W, b) sub-pattern in every exporter form, checked through a
test rule whose NumPy kernel runs x @ W + b from linear_params, against onnxruntime."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_fuses, near_miss

from fusion.catalog import Catalog, Rule
from fusion.pattern import Var, op
from fusion_patterns.linear import (
    check_linear,
    linear,
    linear_attributes,
    linear_inputs,
    linear_params,
)

PATTERN = op.Relu(linear(Var("x", dtype="float32", rank=2), "W", "fc"))


def kernel(attrs, constants):
    w, b = linear_params(attrs["fc_linear"], *constants[1:4])

    def run(x, *_):
        return (np.maximum(x @ w + b, 0),)

    return run


RULE = Rule(
    "LinearRelu",
    PATTERN,
    inputs=("x", *linear_inputs("W", "fc")),
    prepare=kernel,
    attributes=lambda m: linear_attributes(m, "fc"),
    check=lambda m: check_linear(m, "W", "fc"),
)
CATALOG = Catalog([RULE])


def model(form: str, trans_b=0, alpha=1.0, beta=1.0, bias_shape=(5,), add=False):
    g = GraphBuilder(seed=1)
    w = g.weight(*((5, 7) if trans_b else (7, 5)))
    if form == "matmul":
        y = g.node("MatMul", ["x", g.node("Identity", [w])])  # a weight seen through Identity
    else:
        inputs = ["x", w] + ([g.weight(*bias_shape)] if form == "gemm_c" else [])
        y = g.node("Gemm", inputs, transB=trans_b, alpha=alpha, beta=beta)
    if add:
        y = g.node("Add", [g.weight(5), y])
    return g.model({"x": ["N", 7]}, [g.node("Relu", [y])])


@pytest.mark.parametrize(
    "form, options",
    [
        ("matmul", {}),
        ("matmul", dict(add=True)),
        ("gemm", dict(trans_b=1)),
        ("gemm_c", dict(trans_b=1, alpha=0.5, beta=2.0)),
        ("gemm_c", dict(bias_shape=(1, 5), add=True)),
        ("gemm_c", dict(trans_b=1, bias_shape=(1,), alpha=-1.0)),
    ],
)
def test_linear_forms_fuse_and_match_onnxruntime(form, options):
    assert_fuses(model(form, **options), ["LinearRelu"], CATALOG)


def test_a_bias_that_is_not_a_row_is_a_near_miss():
    near_miss(model("gemm_c", bias_shape=(3, 5)), "LinearRelu", "is not a row of 5 values",
              catalog=CATALOG)  # fmt: skip
