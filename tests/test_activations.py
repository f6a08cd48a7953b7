"""Every activation of the kernels' one table (kernels/simd/activation.py) through every kernel
epilogue that applies one, against onnxruntime on the unfused graph: the blocked conv (direct,
with a residual before or after, and depthwise), the elementwise pass (NCHW and blocked: a
BatchNorm's, and the NCHW conv's epilogue beyond a clip), the linear layer (linear_act), and
the fused ConvBiasRelu and LinearAct nodes of each activation the patterns match, both tactics.

The inputs hold NaN, +-inf, +-0, magnitudes that saturate every fit (1e30, +-90, +-20) and
ordinary values: outputs are onnxruntime's, NaN where it gives NaN (silu, hard_swish and gelu
of -inf: -inf * 0), the same infinity where it gives one. Specials reach the activation one
to one: the convs are 1x1 over one input channel, the products have K = 1, except in the
depthwise case (3x3 windows, a few specials). Tolerance: the rules' (1e-4 relative, 1e-5
absolute)."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, fused_ops, run_ort
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion_kernels.blocked import from_blocked, to_blocked
from fusion_kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc
from fusion_kernels.dense_gemm import prepare_dense
from fusion_kernels.linear_act import linear_act
from fusion_kernels.pointwise import pointwise, pointwise_blocked, prepare_pointwise
from fusion_kernels.simd.activation import KINDS, encode

RTOL, ATOL = 1e-4, 1e-5
f32 = np.float32
node = helper.make_node

# kind -> (its ONNX nodes from "t" to "a", the keywords of encode); constants: see CONSTANTS
ONNX = {
    "identity": ([node("Identity", ["t"], ["a"])], {}),
    "relu": ([node("Relu", ["t"], ["a"])], {}),
    "leaky_relu": ([node("LeakyRelu", ["t"], ["a"], alpha=0.1)], {"alpha": 0.1}),
    "clip": ([node("Clip", ["t", "lo", "hi"], ["a"])], {"clip_min": -0.5, "clip_max": 0.75}),
    "sigmoid": ([node("Sigmoid", ["t"], ["a"])], {}),
    "tanh": ([node("Tanh", ["t"], ["a"])], {}),
    "hard_sigmoid": (
        [node("HardSigmoid", ["t"], ["a"], alpha=0.3, beta=0.4)],
        {"alpha": 0.3, "beta": 0.4},
    ),  # fmt: skip
    "hard_swish": ([node("HardSwish", ["t"], ["a"])], {}),
    "silu": ([node("Sigmoid", ["t"], ["s"]), node("Mul", ["t", "s"], ["a"])], {}),
    "gelu": ([node("Gelu", ["t"], ["a"])], {}),
    "gelu_tanh": ([node("Gelu", ["t"], ["a"], approximate="tanh")], {}),
    "elu": ([node("Elu", ["t"], ["a"], alpha=0.7)], {"alpha": 0.7}),
    "selu": ([node("Selu", ["t"], ["a"])], {}),
    "softplus": ([node("Softplus", ["t"], ["a"])], {}),
    "softsign": ([node("Softsign", ["t"], ["a"])], {}),
}
CONSTANTS = {"lo": f32(-0.5), "hi": f32(0.75)}
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 90.0, -90.0, 20.0, -20.0, 5.0, -5.0,
           3.0, -3.0, 1.0, -1.0, 0.5, -0.5, 1e-3]  # fmt: skip


def test_every_kind_has_a_case():
    assert sorted(ONNX) == sorted(KINDS)


def with_specials(shape, seed, every=1):
    """Normal values times 4, with SPECIAL at every `every`-th place (cycling)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    flat = x.reshape(-1)
    idx = np.arange(0, flat.size, every)[: max(1, flat.size // every)]
    flat[idx] = np.resize(np.array(SPECIAL, np.float32), idx.size)
    return x


def reference(kind, first, feeds, residual=None, constants=None):
    """onnxruntime on `first` (nodes writing "t0" from the feeds), Add(r) before or after the
    activation `kind`: the output."""
    nodes = list(first)
    value = "t0"
    if residual == "before":
        nodes.append(node("Add", [value, "r"], ["t1"]))
        value = "t1"
    nodes.append(node("Identity", [value], ["t"]))
    nodes += ONNX[kind][0]
    out = "a"
    if residual == "after":
        nodes.append(node("Add", ["a", "r"], ["y"]))
        out = "y"
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
              for k, v in feeds.items()]  # fmt: skip
    consts = {**CONSTANTS, **(constants or {})}
    graph = helper.make_graph(
        nodes, "act", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    return run_ort(model, feeds)[0]


def conv_case(kind, residual, depthwise):
    """(x, w, b, r, onnxruntime's y) for the blocked conv cases."""
    rng = np.random.default_rng(KINDS.index(kind))
    if depthwise:  # 3x3 windows, a few specials: each output sees at most one
        x = with_specials((2, 12, 9, 9), 1, every=53)
        w = rng.uniform(0.2, 1.0, (12, 1, 3, 3)).astype(np.float32)
        attrs = dict(pads=[1, 1, 1, 1], group=12)
    else:
        x = with_specials((2, 1, 5, 7), 1)
        w = rng.uniform(0.5, 2.0, (12, 1, 1, 1)) * rng.choice([-1, 1], (12, 1, 1, 1))
        w, attrs = w.astype(np.float32), {}
    b = rng.standard_normal(12).astype(np.float32)
    feeds = {"x": x}
    if residual:
        feeds["r"] = rng.standard_normal((2, 12, *x.shape[2:])).astype(np.float32)
    conv = node("Conv", ["x", "w", "b"], ["t0"], **attrs)
    want = reference(kind, [conv], feeds, residual, {"w": w, "b": b})
    return x, w, b, feeds.get("r"), attrs, want


@pytest.mark.parametrize("residual", [None, "before", "after"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_through_the_blocked_conv_epilogue(kind, residual):
    x, w, b, r, attrs, want = conv_case(kind, residual, depthwise=False)
    for block in (8, 16):  # both SIMD widths' blocks, whatever this process's width
        plan = prepare_conv_nchwc(w, b, activation=kind, residual=residual, block=block,
                                  **ONNX[kind][1])  # fmt: skip
        rb = None if r is None else to_blocked(r, block=plan.block)
        yb = conv_nchwc(to_blocked(x, block=plan.in_block), plan, residual=rb)
        assert_close(from_blocked(yb, 12), want, RTOL, ATOL, what=f"{kind} {residual} {block}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_through_the_depthwise_epilogue(kind):
    x, w, b, _, attrs, want = conv_case(kind, None, depthwise=True)
    for block in (8, 16):
        plan = prepare_conv_nchwc(w, b, pads=(1, 1, 1, 1), group=12, activation=kind,
                                  block=block, **ONNX[kind][1])  # fmt: skip
        got = from_blocked(conv_nchwc(to_blocked(x, block=plan.in_block), plan), 12)
        assert_close(got, want, RTOL, ATOL, what=f"{kind} {block}")


@pytest.mark.parametrize("residual", [None, "after"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_through_the_elementwise_epilogue(kind, residual):
    """y = act(x s + t) (+ r) per channel, NCHW planes of 35 pixels (4 vectors and a tail) and
    blocked pixels in blocks of 8 and 16, 12 channels (a partial block)."""
    rng = np.random.default_rng(KINDS.index(kind))
    x = with_specials((2, 12, 5, 7), 2)
    s = rng.uniform(0.5, 2.0, 12).astype(np.float32) * rng.choice([-1, 1], 12).astype(np.float32)
    t = rng.standard_normal(12).astype(np.float32)
    feeds = {"x": x}
    if residual:
        feeds["r"] = rng.standard_normal(x.shape).astype(np.float32)
    first = [node("Mul", ["x", "scale"], ["xs"]), node("Add", ["xs", "shift"], ["t0"])]
    per = {"scale": s.reshape(1, 12, 1, 1), "shift": t.reshape(1, 12, 1, 1)}
    want = reference(kind, first, feeds, residual, per)
    plan = prepare_pointwise(12, s, t, activation=kind, residual=residual, **ONNX[kind][1])
    r = feeds.get("r")
    assert_close(pointwise(x, plan, residual=r), want, RTOL, ATOL, what=f"NCHW {kind}")
    for b in (8, 16):  # both SIMD widths' blocks, whatever this process's width
        rb = None if r is None else to_blocked(r, block=b)
        got = from_blocked(pointwise_blocked(to_blocked(x, block=b), plan, residual=rb), 12)
        assert_close(got, want, RTOL, ATOL, what=f"blocked {kind} block {b}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_through_linear_act(kind):
    """act(x W + b) + r, K = 1 (the specials one to one) and K = 19; N = 23: whole vectors
    and a masked tail per row."""
    rng = np.random.default_rng(KINDS.index(kind))
    for k in (1, 19):
        x = with_specials((37, k), 3, every=1 if k == 1 else 7)
        w = rng.standard_normal((k, 23)).astype(np.float32)
        if k == 1:
            w = np.where(np.abs(w) < 0.5, 1.0, w).astype(np.float32)  # no tiny weights
        b = rng.standard_normal(23).astype(np.float32)
        r = rng.standard_normal((37, 23)).astype(np.float32)
        first = [node("MatMul", ["x", "w"], ["xw"]), node("Add", ["xw", "bias"], ["t0"])]
        want = reference(kind, first, {"x": x, "r": r}, "after", {"w": w, "bias": b})
        got = linear_act(x, prepare_dense(w, b, encode(kind, **ONNX[kind][1])), r)
        assert_close(got, want, RTOL, ATOL, what=f"{kind} K={k}")


# ---- the fused nodes: every kind the patterns match ----------------------------------------
PATTERN_KINDS = ["relu", "clip", "leaky_relu", "sigmoid", "silu", "hard_sigmoid", "hard_swish",
                 "tanh", "gelu"]  # fmt: skip


def activation(g, t, kind):
    c = lambda v: g.const(np.array(v, np.float32))  # noqa: E731
    if kind == "clip":
        return g.node("Clip", [t, c(-0.5), c(0.75)])
    if kind == "silu":
        return g.node("Mul", [t, g.node("Sigmoid", [t])])
    op, attrs = {"relu": ("Relu", {}), "leaky_relu": ("LeakyRelu", {"alpha": 0.1}),
                 "sigmoid": ("Sigmoid", {}), "hard_sigmoid": ("HardSigmoid", {"alpha": 0.3}),
                 "hard_swish": ("HardSwish", {}), "tanh": ("Tanh", {}),
                 "gelu": ("Gelu", {})}[kind]  # fmt: skip
    return g.node(op, [t], **attrs)


@pytest.mark.parametrize("kind", PATTERN_KINDS)
def test_nan_and_inf_through_the_fused_conv(kind):
    """ConvBiasRelu on a 1x1 conv of one channel: both tactics (the blocked conv with its
    epilogue; conv2d and the elementwise pass) give onnxruntime's outputs, specials included."""
    g = GraphBuilder(opset=20)
    w = g.const(np.linspace(-2, 2, 12, dtype=np.float32).reshape(12, 1, 1, 1) + f32(0.1))
    y = activation(g, g.node("Conv", ["x", w, g.weight(12)]), kind)
    model = g.model({"x": ["N", 1, 5, 7]}, [y])
    result = fusion.rewrite(model)
    assert fused_ops(result.model) == ["ConvBiasRelu"], result.explain()
    feeds = {"x": with_specials((2, 1, 5, 7), 4)}
    (want,) = run_ort(model, feeds)
    for tactic in ("blocked", "nchw"):
        session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
        (got,) = session.run(None, feeds)
        assert_close(got, want, RTOL, ATOL, what=f"{tactic} {kind}")


@pytest.mark.parametrize("kind", PATTERN_KINDS)
def test_every_pattern_kind_through_linear_act_rule(kind):
    """A classifier head (GlobalAveragePool, Flatten, Gemm, activation) fuses into LinearAct,
    whose kernel gives onnxruntime's outputs; the feature map holds an inf and a NaN."""
    g = GraphBuilder(opset=20)
    t = g.node("Flatten", [g.node("GlobalAveragePool", ["x"])], axis=1)
    y = activation(g, g.node("Gemm", [t, g.weight(23, 6, scale=1.0), g.weight(23)], transB=1),
                   kind)  # fmt: skip
    model = g.model({"x": ["N", 6, 3, 3]}, [y])
    result = fusion.rewrite(model)
    assert "LinearAct" in fused_ops(result.model), result.explain()
    x = (np.random.default_rng(5).standard_normal((3, 6, 3, 3)) * 8).astype(np.float32)
    x[1, 2, 0, 0], x[2, 4, 1, 1] = np.inf, np.nan
    (want,) = run_ort(model, {"x": x})
    (got,) = fusion.Session(result.model, threads=2, fuse=False).run(None, {"x": x})
    assert_close(got, want, RTOL, ATOL, what=kind)
