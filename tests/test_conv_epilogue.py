"""ConvBiasRelu's widened epilogue: BatchNorm, every activation form, the residual Add before or
after it, Conv1d. Each variant fuses into one node, and that node's kernel (both tactics: the
blocked layout and NCHW) gives onnxruntime's outputs on the unfused graph, at two shapes; each
near-miss says why it was not fused."""

import math

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_close,
    assert_fuses,
    fused_ops,
    near_miss,
    run_bound,
    run_ort,
)

import fusion

GELU_ERF_OPSET = 17  # Gelu is an op from opset 20; before, exporters write the erf formula


def activation(g: GraphBuilder, t: str, kind: str) -> str:
    """The activation `kind` applied to t, written as exporters write it."""
    c = lambda v: g.const(np.array(v, np.float32))  # noqa: E731
    if kind == "none":
        return t
    if kind == "relu":
        return g.node("Relu", [t])
    if kind == "clip":
        return g.node("Clip", [t, c(-0.5), c(0.7)])
    if kind == "leaky_relu":
        return g.node("LeakyRelu", [t], alpha=0.1)
    if kind in ("sigmoid", "tanh"):
        return g.node(kind.capitalize(), [t])
    if kind == "silu":  # PyTorch's SiLU, Sigmoid first in the Mul
        return g.node("Mul", [g.node("Sigmoid", [t]), t])
    if kind == "hard_sigmoid":
        return g.node("HardSigmoid", [t], alpha=0.3, beta=0.4)
    if kind == "hard_swish":  # the op (opset 14)
        return g.node("HardSwish", [t])
    if kind == "hard_swish_hs":  # t * HardSigmoid(t) with HardSwish's constants
        return g.node("Mul", [t, g.node("HardSigmoid", [t], alpha=1 / 6, beta=0.5)])
    if kind == "hard_swish_relu6":  # Keras: t * relu6(t + 3) / 6
        r6 = g.node("Clip", [g.node("Add", [t, c(3.0)]), c(0.0), c(6.0)])
        return g.node("Div", [g.node("Mul", [t, r6]), c(6.0)])
    if kind == "gelu":  # the op (opset 20)
        return g.node("Gelu", [t])
    if kind == "gelu_erf":  # t * (1 + erf(t / sqrt 2)) * 0.5
        erf = g.node("Erf", [g.node("Div", [t, c(math.sqrt(2))])])
        return g.node("Mul", [g.node("Mul", [t, g.node("Add", [erf, c(1.0)])]), c(0.5)])
    if kind == "gelu_tanh":  # the op (opset 20)
        return g.node("Gelu", [t], approximate="tanh")
    if kind == "gelu_tanh_written":  # t * 0.5 * (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3)))
        cube = g.node("Mul", [g.node("Pow", [t, c(3.0)]), c(0.044715)])
        inner = g.node("Mul", [g.node("Add", [t, cube]), c(math.sqrt(2 / math.pi))])
        one = g.node("Add", [g.node("Tanh", [inner]), c(1.0)])
        return g.node("Mul", [g.node("Mul", [t, c(0.5)]), one])
    if kind == "elu":
        return g.node("Elu", [t], alpha=0.7)
    if kind == "selu":
        return g.node("Selu", [t])
    if kind in ("softplus", "softsign"):
        return g.node(kind.capitalize(), [t])
    raise ValueError(kind)


KINDS = ["none", "relu", "clip", "leaky_relu", "sigmoid", "silu", "hard_sigmoid", "hard_swish",
         "hard_swish_hs", "hard_swish_relu6", "tanh", "gelu", "gelu_erf", "gelu_tanh",
         "gelu_tanh_written", "elu", "selu", "softplus", "softsign"]  # fmt: skip


def opset_for(kind: str) -> int:
    return 20 if kind in ("gelu", "gelu_tanh") else GELU_ERF_OPSET


def batch_norm(g: GraphBuilder, t: str, channels: int, name: str = "/bn") -> str:
    rng = g.rng
    scale, bias, mean = (rng.standard_normal(channels).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, channels).astype(np.float32)
    names = [g.const(v) for v in (scale, bias, mean, var)]
    return g.node("BatchNormalization", [t, *names], epsilon=1e-3, name=name)


def conv_chain(g, x, cin, cout, kind="relu", bn=False, residual=None, rank=2, bias=True,
               **attrs):  # fmt: skip
    """Conv (+ BatchNorm) (+ residual before) + act (+ residual after); the residual is the
    graph input "r". Returns the output's name."""
    k = (3,) * rank
    w = g.weight(cout, cin // attrs.get("group", 1), *k)
    inputs = ["x" if x is None else x, w] + ([g.weight(cout, scale=0.1)] if bias else [])
    t = g.node("Conv", inputs, pads=[1] * (2 * rank), name="/conv", **attrs)
    if bn:
        t = batch_norm(g, t, cout)
    if residual == "before":
        t = g.node("Add", [t, "r"], name="/add")
    t = activation(g, t, kind)
    if residual == "after":
        t = g.node("Add", ["r", t], name="/add")  # residual first: Add commutes
    return t


SHAPES = {2: [(1, 4, 9, 9), (2, 4, 6, 13)], 1: [(1, 4, 17), (3, 4, 8)]}


def check_kernels(build, rank: int, residual: bool = False, rtol=1e-4, atol=1e-5):
    """For each of the rank's two input shapes: the model build(g, shape) makes (spatial sizes
    fixed, as exporters write them, so the residual's shape is known; the batch dynamic) fuses
    into ConvBiasRelu nodes only, and their kernels, every tactic (blocked and NCHW), give
    onnxruntime's outputs on the original."""
    for shape in SHAPES[rank]:
        g = GraphBuilder(opset=17)
        y, cout = build(g)
        inputs = {"x": ["N", *shape[1:]], **({"r": ["N", cout, *shape[2:]]} if residual else {})}
        model = g.model(inputs, [y])
        result = assert_fuses(model, None, rtol=rtol, atol=atol)
        assert set(fused_ops(result.model)) == {"ConvBiasRelu"}, result.explain()
        rng = np.random.default_rng(1)
        feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
        if residual:
            feeds["r"] = rng.standard_normal((shape[0], cout, *shape[2:])).astype(np.float32)
        (want,) = run_ort(model, feeds)
        for tactic in ("blocked", "nchw") if rank == 2 else ("nchw",):
            session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
            (got,) = run_bound(session, feeds)
            assert_close(got, want, rtol, atol, what=f"{tactic} {shape}")
    return result


@pytest.mark.parametrize("kind", KINDS)
def test_every_activation_fuses_and_runs(kind):
    def build(g):
        g.opset = opset_for(kind)
        return conv_chain(g, None, 4, 12, kind), 12

    result = check_kernels(build, 2)
    assert len(result.fusions) == 1


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("kind", ["relu", "none", "silu"])
def test_batchnorm_and_residual(kind, where):
    """ResNet (BN, Add, Relu), MobileNetV2 (BN, Add, no act), and a SiLU between."""
    result = check_kernels(lambda g: (conv_chain(g, None, 4, 8, kind, bn=True, residual=where), 8),
                           2, residual=True)  # fmt: skip
    (fused,) = result.fusions
    assert len(fused.replaced) == 3 + (kind != "none") + (kind == "silu"), fused.replaced


def test_residual_from_another_conv_and_depthwise():
    """A bottleneck's last conv adds the block's input; a depthwise conv with BN and HardSwish
    between. The residual comes from another fused conv: in the blocked tactic, blocked. (The
    depthwise conv is dilated: undilated, the three would be one InvertedResidual node.)"""

    def build(g):
        a = conv_chain(g, None, 4, 8, "relu", bn=True)
        b = g.node("Conv", [a, g.weight(8, 1, 3, 3)], group=8, pads=[2] * 4, dilations=[2, 2])
        b = activation(g, batch_norm(g, b, 8, "/bn2"), "hard_swish")
        return g.node("Relu", [g.node("Add", [g.node("Conv", [b, g.weight(8, 8, 1, 1)]), a])]), 8

    result = check_kernels(build, 2)
    assert sorted(len(f.replaced) for f in result.fusions) == [3, 3, 3], result.fusions


@pytest.mark.parametrize("kind", ["relu", "silu", "gelu_erf"])
def test_conv1d(kind):
    result = check_kernels(
        lambda g: (conv_chain(g, None, 4, 6, kind, bn=True, residual="after", rank=1), 6),
        1, residual=True,
    )  # fmt: skip
    assert len(result.fusions[0].replaced) >= 4


def test_conv1d_strided_dilated_grouped():
    def build(g):
        w = g.weight(6, 2, 3)
        conv = g.node("Conv", ["x", w], strides=[2], dilations=[2], pads=[2, 1], group=2)
        return g.node("Relu", [conv]), 6

    check_kernels(build, 1)


# ---- near-misses -----------------------------------------------------------------------------
def test_batchnorm_in_training_mode_is_not_folded():
    g = GraphBuilder(opset=15)
    t = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv")
    t = g.node("Relu", [batch_norm(g, t, 8)])
    bn = g.nodes[-2]  # training mode: the running statistics are outputs too
    bn.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    bn.output.extend(["/bn_mean", "/bn_var"])
    near_miss(g.model({"x": [1, 4, 6, 6]}, [t]), "ConvBiasRelu",
              "BatchNormalization /bn: training_mode=1", fused=["ConvBiasRelu"])  # fmt: skip


def test_broadcast_residual_is_not_a_residual():
    """Add of a [N, C, 1, 1] tensor broadcasts over the pixels; the kernel adds a tensor of the
    output's shape. The conv fuses without it."""
    g = GraphBuilder()
    t = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], pads=[1, 1, 1, 1], name="/conv")
    y = g.node("Relu", [g.node("Add", [t, "r"], name="/add")])
    model = g.model({"x": [2, 4, 6, 6], "r": [2, 8, 1, 1]}, [y])
    near_miss(model, "ConvBiasRelu", "Add /add: r of shape [2, 8, 1, 1] broadcasts to [2, 8, 6, 6]",
              fused=["ConvBiasRelu"])  # fmt: skip


def test_residual_both_before_and_after_fuses_one():
    g = GraphBuilder()
    y = conv_chain(g, None, 4, 8, "relu", residual="before")
    y = g.node("Add", [y, "r"], name="/add2")
    model = g.model({"x": ["N", 4, 6, 6], "r": ["N", 8, 6, 6]}, [y])
    result = assert_fuses(model, ["ConvBiasRelu"], rtol=1e-4, atol=1e-5)
    assert "Add /add2" not in result.fusions[0].replaced  # the second Add runs in onnxruntime
    assert "a residual Add both before and after the activation" in result.explain()


def test_relu6_with_other_bounds_is_not_hard_swish():
    """t * clip(t + 3, 0, 5) / 6 is not HardSwish: the Conv fuses alone (its output is read
    by the Mul outside); the reason names the bound."""
    g = GraphBuilder()
    c = lambda v: g.const(np.array(v, np.float32))  # noqa: E731
    t = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv")
    r = g.node("Clip", [g.node("Add", [t, c(3.0)]), c(0.0), c(5.0)])
    y = g.node("Div", [g.node("Mul", [t, r]), c(6.0)])
    near_miss(g.model({"x": [1, 4, 6, 6]}, [y]), "ConvBiasRelu",
              "Clip /clip6: 5.0 is not 6", fused=["ConvBiasRelu"])  # fmt: skip


def test_hard_sigmoid_product_with_other_constants_is_not_hard_swish():
    """t * HardSigmoid(t, alpha 0.2) is not HardSwish; HardSigmoid alone is an activation, so the
    Conv + HardSigmoid fuse and the Mul stays (it reads the conv's output: the Conv alone)."""
    g = GraphBuilder()
    t = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv")
    y = g.node("Mul", [t, g.node("HardSigmoid", [t], alpha=0.2, beta=0.5)])
    result = assert_fuses(g.model({"x": [1, 4, 6, 6]}, [y]), ["ConvBiasRelu"])
    assert result.fusions[0].replaced == ["Conv /conv"]
