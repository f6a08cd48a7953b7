"""FireModule: every ConvBiasRelu form of its three convs fuses, in either Concat order; the
kernel matches onnxruntime on several shapes; near-misses are not fused and say why.

Rewritten models pass the full ONNX checker and run in plain onnxruntime (through the fused
nodes' function bodies) against the original; kernels are checked against onnxruntime too.
"""

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_close,
    assert_fuses,
    conv_block,
    fire_graph,
    fused_ops,
    naive_conv,
    near_miss,
    random_feeds,
    run_bound,
    run_ort,
)

import fusion
from fusion.numerics import compare_arrays
from fusion.runtime import Session
from fusion.runtime.kernel import node_attributes
from fusion_kernels import conv2d_bias_act, prepare_conv2d
from fusion_kernels.blocked import block
from fusion_kernels.fire import fire, prepare_fire
from fusion_patterns import fire as fire_pattern

CATALOG = fusion.default_catalog()


def rewrite_checked(model, batch=2):
    return assert_fuses(model, None, CATALOG, batch=batch, rtol=1e-5, atol=1e-5)


VARIANTS = [
    dict(),  # PyTorch: bias as Conv's input, Relu
    dict(bias="add"),  # TensorFlow: Add of [1,C,1,1]
    dict(bias="both"),
    dict(bias="none"),
    dict(act="clip"),
    dict(act="relu6", bias="add", opset=9),  # Clip with min/max attributes
]


@pytest.mark.parametrize("order", ["1x1,3x3", "3x3,1x1"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_variant_fuses_and_kernel_matches(variant, order):
    variant = dict(variant)
    g = GraphBuilder(opset=variant.pop("opset", 17))
    *_, y = fire_graph(g, "x", 5, 3, 7, 5, order=order, **variant)  # odd channel counts
    model = g.model({"x": ["N", 5, 7, 9]}, [y])
    result = rewrite_checked(model, batch=3)
    assert fused_ops(result.model) == ["FireModule"], result.explain()
    assert result.counts() == {"FireModule": 1}
    (node,) = result.model.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["branch_order"].decode() == order
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG)
    for batch in (1, 3):
        feeds = random_feeds(model, batch=batch, seed=batch)
        (want,) = run_ort(model, feeds)
        (got,) = session.run(None, feeds)
        assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape, channels",
    [
        ((1, 5, 7, 9), (3, 7, 5)),  # im2col for every conv
        ((3, 16, 13, 11), (9, 17, 6)),  # squeeze >= 8: the 3x3 branch takes Winograd
        ((2, 64, 8, 8), (16, 64, 64)),  # SqueezeNet's first Fire module, small image
    ],
)
def test_kernel_matches_onnxruntime(x_shape, channels):
    g = GraphBuilder(seed=sum(channels))
    *_, y = fire_graph(g, "x", x_shape[1], *channels, order="3x3,1x1")
    model = g.model({"x": ["N", *x_shape[1:]]}, [y])
    (node,) = fusion.rewrite(model, CATALOG).model.graph.node
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    run = fire_pattern.RULE.prepare(node_attributes(node), [inits.get(v) for v in node.input])
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    (got,) = run(x)
    (want,) = run_ort(model, {"x": x})
    assert got.shape == want.shape and got.flags.c_contiguous
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tactic", ["blocked", "blocked-wino", "nchw"])
@pytest.mark.parametrize("order", ["1x1,3x3", "3x3,1x1"])
def test_each_tactic_matches_onnxruntime(tactic, order):
    """Blocked: the squeeze conv (6 channels: one partial block) on the direct kernel, each
    expand conv writing its channel blocks of y (the first in Concat order whole blocks at 8
    and 16 lanes, the second odd); "blocked-wino" runs the 3x3 one on Winograd."""
    e1, e3 = (16, 7) if order == "1x1,3x3" else (7, 16)
    g = GraphBuilder(seed=e1)
    *_, y = fire_graph(g, "x", 10, 6, e1, e3, order=order)
    model = g.model({"x": ["N", 10, 9, 13]}, [y])
    session = Session(fusion.rewrite(model, CATALOG).model, threads=2, catalog=CATALOG,
                      tactics=tactic)  # fmt: skip
    assert session.offered["FireModule /cat"] == ["blocked", "blocked-wino", "nchw"]
    assert session.choices["FireModule /cat"] == tactic
    for batch in (1, 3):
        feeds = random_feeds(model, batch=batch, seed=batch)
        (want,) = run_ort(model, feeds)
        (got,) = run_bound(session, feeds)
        result = compare_arrays("y", got, want, fire_pattern.RULE.rtol, fire_pattern.RULE.atol,
                                scaled=True)  # fmt: skip
        assert result.ok, result


def test_blocked_only_when_the_first_expand_fills_whole_blocks():
    b = block()
    g = GraphBuilder()
    *_, y = fire_graph(g, "x", 4, 3, b + 2, b, order="1x1,3x3")
    model = fusion.rewrite(g.model({"x": ["N", 4, 6, 6]}, [y]), CATALOG).model
    (node,) = model.graph.node
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    kernel = fire_pattern.RULE.prepare(node_attributes(node), [inits.get(v) for v in node.input])
    assert [t.name for t in kernel.tactics] == ["nchw"]
    assert kernel.nchw_only == (f"expand convs in Concat order: input 0 has {b + 2} channels, "
                                f"not whole blocks of {b}")  # fmt: skip


def naive_conv_relu(x, w, b, pad):
    """Direct convolution in NumPy, stride 1, then bias and ReLU (the per-kernel oracle)."""
    return naive_conv(x, w, b, (1, 1), (pad,) * 4, (1, 1), 1, lo=0.0)


def test_kernel_writes_into_a_channel_slice_and_validates():
    rng = np.random.default_rng(2)
    shapes, pads = [(4, 6, 1, 1), (3, 4, 1, 1), (5, 4, 3, 3)], [(0,) * 4, (0,) * 4, (1,) * 4]
    ws = [rng.standard_normal(shape).astype(np.float32) * 0.3 for shape in shapes]
    bs = [rng.standard_normal(w.shape[0]).astype(np.float32) for w in ws]
    plans = [
        prepare_conv2d(w, b, pads=p, activation="relu")
        for w, b, p in zip(ws, bs, pads, strict=True)
    ]
    plan = prepare_fire(*plans)
    x = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    buf = np.full((2, 12, 5, 4), -7.0, np.float32)
    fire(x, plan, out=buf[:, 2:10])
    s = naive_conv_relu(x, ws[0], bs[0], 0)
    want = np.concatenate(
        [naive_conv_relu(s, ws[1], bs[1], 0), naive_conv_relu(s, ws[2], bs[2], 1)], 1
    )
    assert_close(buf[:, 2:10], want, rtol=1e-4, atol=1e-5, check_dtype=False)
    assert (buf[:, :2] == -7).all() and (buf[:, 10:] == -7).all()  # nothing outside the slice
    with pytest.raises(ValueError, match="expand 0 reads 6 channels, the squeeze conv writes 4"):
        prepare_fire(plans[0], plans[0])
    unpadded = prepare_fire(plans[0], plans[1], prepare_conv2d(ws[2], bs[2]))
    with pytest.raises(ValueError, match=r"outputs differ in batch or size \(2x5x4, 2x3x2\)"):
        fire(x, unpadded)


def explain_fire(model) -> str:
    return near_miss(model, "FireModule", catalog=CATALOG)


def test_concat_on_another_axis_is_not_a_fire_module():
    g = GraphBuilder()
    *_, y = fire_graph(g, "x", 4, 3, 6, 6, axis=2)
    text = explain_fire(g.model({"x": [1, 4, 5, 5]}, [y]))
    assert "Concat /cat: Concat on axis 2; a Fire module concatenates channels (axis 1)" in text


def test_branch_output_used_elsewhere_is_not_fused():
    g = GraphBuilder()
    _, a, _, y = fire_graph(g, "x", 4, 3, 6, 6)
    side = g.node("Neg", [a], name="/side")
    text = explain_fire(g.model({"x": [1, 4, 5, 5]}, [y, side]))
    assert f"its output {a} is also used by Neg /side" in text
    result = fusion.rewrite(g.model({"x": [1, 4, 5, 5]}, [y, side]), CATALOG)
    # each conv still fuses, and the Concat (a branch is read elsewhere) as a plain copy
    assert result.counts() == {"ConvBiasRelu": 3, "ChannelConcat": 1}


def test_squeeze_output_with_a_third_consumer_is_not_fused():
    g = GraphBuilder()
    s, *_, y = fire_graph(g, "x", 4, 3, 6, 6)
    pooled = g.node("MaxPool", [s], name="/pool", kernel_shape=[2, 2])
    text = explain_fire(g.model({"x": [1, 4, 6, 6]}, [y, pooled]))
    assert f"its output {s} is also used by MaxPool /pool" in text


def test_two_1x1_expand_convs_are_not_a_fire_module():
    g = GraphBuilder()
    s = conv_block(g, "x", 4, 3, k=1)
    a, b = conv_block(g, s, 3, 5, k=1), conv_block(g, s, 3, 6, k=1)
    y = g.node("Concat", [a, b], axis=1)
    text = explain_fire(g.model({"x": [1, 4, 5, 5]}, [y]))
    assert "expand3x3 conv is 1x1, a Fire module needs 3x3" in text


def test_fire_modules_in_a_row():
    g = GraphBuilder()
    *_, y = fire_graph(g, "x", 6, 4, 5, 5)
    *_, y = fire_graph(g, y, 10, 4, 6, 6, "3x3,1x1", name="/cat2", bias="add", act="clip")
    result = rewrite_checked(g.model({"x": ["N", 6, 6, 6]}, [y]))
    assert fused_ops(result.model) == ["FireModule"] * 2


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan-and-inf"])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_call_and_per_conv_paths_agree(poison, batch):
    """fire() runs a usual Fire module (squeeze im2col, expands im2col or Winograd) as one
    compiled call; anything else (here a third expand) conv by conv. Both must give what the
    convs give one by one, also when the input holds NaN and inf (Winograd steps aside)."""
    rng = np.random.default_rng(batch)
    w = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in
         [(16, 12, 1, 1), (10, 16, 1, 1), (9, 16, 3, 3), (7, 16, 3, 3)]]  # fmt: skip
    pads = [(0,) * 4, (0,) * 4, (1,) * 4, (1,) * 4]
    sq, e1, e3, e3b = (
        prepare_conv2d(a, pads=p, activation="relu") for a, p in zip(w, pads, strict=True)
    )
    assert e3.method == "winograd"
    x = rng.standard_normal((batch, 12, 9, 10)).astype(np.float32)
    if poison:
        x[0, 3, 4, 4], x[-1, 5, 0, 9] = np.nan, np.inf
    s = conv2d_bias_act(x, sq)
    for expands in [(e3, e1), (e1, e3, e3b)]:
        plan = prepare_fire(sq, *expands)
        assert plan.one_call == (len(expands) == 2)
        want = np.concatenate([conv2d_bias_act(s, e) for e in expands], 1)
        assert_close(fire(x, plan), want, rtol=0, atol=0)
        buf = np.full((batch, plan.out_channels + 3, 9, 10), -7.0, np.float32)
        fire(x, plan, out=buf[:, 1:-2])
        assert_close(buf[:, 1:-2], want, rtol=0, atol=0)
        assert (buf[:, :1] == -7).all() and (buf[:, -2:] == -7).all()
