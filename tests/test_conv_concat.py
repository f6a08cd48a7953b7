"""ConvConcat: a Concat of ConvBiasRelu outputs (Inception branches) becomes one node whose
convs write into their channel ranges; checked against onnxruntime on the original graph, at
more than one shape; near-misses are not fused and say why."""

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_close,
    conv_block,
    fire_graph,
    fused_ops,
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
from fusion_kernels.conv_concat import conv_concat
from fusion_patterns import conv_concat as conv_concat_pattern

CATALOG = fusion.default_catalog()


def inception(g, x, cin, widths=(16, (24, 32), (8, 16), 16), name="/cat", **block):
    """GoogLeNet's block as torchvision exports it (BatchNorm folded into Conv): a 1x1 branch,
    1x1 -> 3x3 and 1x1 -> 3x3 branches, MaxPool(3, stride 1, pad 1) -> 1x1, Concat(axis=1)."""
    one, (r3, c3), (r5, c5), proj = widths
    pad = dict(pads=[1, 1, 1, 1])
    b1 = conv_block(g, x, cin, one, k=1, **block)
    b2 = conv_block(g, conv_block(g, x, cin, r3, k=1, **block), r3, c3, k=3, **pad, **block)
    b3 = conv_block(g, conv_block(g, x, cin, r5, k=1, **block), r5, c5, k=3, **pad, **block)
    pooled = g.node("MaxPool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    b4 = conv_block(g, pooled, cin, proj, k=1, **block)
    return [b1, b2, b3, b4], g.node("Concat", [b1, b2, b3, b4], axis=1, name=name)


def check_against_onnxruntime(model, batches=(1, 3)):
    result = fusion.rewrite(model, CATALOG)
    onnx.checker.check_model(result.model, full_check=True)
    session = Session(result.model, threads=2, catalog=CATALOG)
    for batch in batches:
        feeds = random_feeds(model, batch=batch, seed=batch)
        (want,) = run_ort(model, feeds)
        (plain,) = run_ort(result.model, feeds)  # the function bodies, in plain onnxruntime
        (got,) = session.run(None, feeds)
        assert_close(plain, want, rtol=1e-6, atol=1e-6)
        assert_close(got, want, rtol=1e-4, atol=1e-5)
    return result


@pytest.mark.parametrize(
    "block",
    [dict(), dict(bias="add"), dict(bias="none", act="clip"), dict(act="relu6", opset=9)],
    ids=["pytorch", "add-bias", "no-bias-clip", "clip-attributes-opset9"],
)
def test_inception_block_fuses_into_one_node(block):
    block = dict(block)
    g = GraphBuilder(opset=block.pop("opset", 17))
    _, y = inception(g, "x", 12, **block)
    result = check_against_onnxruntime(g.model({"x": ["N", 12, 9, 11]}, [y]))
    assert sorted(fused_ops(result.model)) == [
        "ConvBiasRelu", "ConvBiasRelu", "ConvConcat", "MaxPool2D"]  # fmt: skip
    (cat,) = [n for n in result.model.graph.node if n.op_type == "ConvConcat"]
    assert cat.name == "/cat" and len(cat.input) >= 13  # 4 branches x (x, W, B, bias_add)
    assert "Concat" not in [n.op_type for n in result.model.graph.node]
    assert result.counts() == {"ConvBiasRelu": 2, "ConvConcat": 1, "MaxPool2D": 1}
    assert "ConvBiasRelu: 6 fused (4 of them inside later fusions)" in result.explain()


class HeScaled(GraphBuilder):
    """Conv weights with std sqrt(2 / fan_in), as trained networks keep activations O(1)."""

    def weight(self, *shape, scale=0.3):
        return super().weight(
            *shape, scale=np.sqrt(2 / np.prod(shape[1:])) if len(shape) == 4 else scale
        )


def test_two_inception_blocks_in_a_row_at_googlenet_width():
    g = HeScaled(seed=3)
    _, y = inception(g, "x", 48, widths=(16, (24, 32), (4, 8), 8))
    _, y = inception(g, y, 64, widths=(32, (32, 48), (8, 24), 16), name="/cat2")
    result = check_against_onnxruntime(g.model({"x": ["N", 48, 14, 14]}, [y]), batches=(2,))
    assert fused_ops(result.model).count("ConvConcat") == 2


# Branch widths in whole blocks at 8 and at 16 lanes but the last (odd): every tactic runs.
WHOLE = (16, (24, 32), (8, 16), 5)


@pytest.mark.parametrize("tactic", ["blocked", "blocked-wino", "nchw"])
@pytest.mark.parametrize("shape", [(12, 9, 11), (20, 14, 14)], ids=str)
def test_each_tactic_matches_onnxruntime(tactic, shape):
    """The blocked tactics write each branch's channel blocks of the output (the direct kernel
    in place, the 3x3 branches on Winograd through a copy); NCHW writes channel slices."""
    g = HeScaled(seed=shape[0])
    _, y = inception(g, "x", shape[0], widths=WHOLE)
    model = g.model({"x": ["N", *shape]}, [y])
    result = fusion.rewrite(model, CATALOG)
    session = Session(result.model, threads=2, catalog=CATALOG, tactics=tactic)
    assert session.offered["ConvConcat /cat"] == ["blocked", "blocked-wino", "nchw"]
    assert session.choices["ConvConcat /cat"] == tactic
    for batch in (1, 3):
        feeds = random_feeds(model, batch=batch, seed=batch)
        (want,) = run_ort(model, feeds)
        (got,) = run_bound(session, feeds)
        rule = conv_concat_pattern.RULE  # Winograd: within the rule's scale-relative tolerance
        result = compare_arrays("y", got, want, rule.rtol, rule.atol, scaled=True)
        assert result.ok, result


def concat_kernel(model):
    rewritten = fusion.rewrite(model, CATALOG).model
    (node,) = [n for n in rewritten.graph.node if n.op_type == "ConvConcat"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in rewritten.graph.initializer}
    return conv_concat_pattern.RULE.prepare(node_attributes(node),
                                            [inits.get(v) for v in node.input])  # fmt: skip


def test_blocked_only_with_whole_blocks_and_winograd_only_for_3x3():
    b = block()
    g = GraphBuilder()
    a, c = conv_block(g, "x", 4, b + 3, k=1), conv_block(g, "x", 4, 8, k=3, pads=[1, 1, 1, 1])
    y = g.node("Concat", [a, c], axis=1, name="/cat")
    kernel = concat_kernel(g.model({"x": ["N", 4, 6, 6]}, [y]))
    assert [t.name for t in kernel.tactics] == ["nchw"]
    assert kernel.nchw_only == f"input 0 has {b + 3} channels, not whole blocks of {b}"
    g = GraphBuilder()
    a, c = conv_block(g, "x", 4, b, k=1), conv_block(g, "x", 4, 3, k=1)
    y = g.node("Concat", [a, c], axis=1, name="/cat")
    kernel = concat_kernel(g.model({"x": ["N", 4, 6, 6]}, [y]))
    assert [t.name for t in kernel.tactics] == ["blocked", "nchw"]  # no 3x3 stride-1 branch
    assert kernel.nchw_only is None


def test_kernel_matches_a_numpy_concat_of_each_conv_and_writes_a_slice():
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(s).astype(np.float32) for s in [(2, 6, 9, 9), (2, 3, 17, 17)]]
    plans = [
        prepare_conv2d(rng.standard_normal((5, 6, 3, 3)).astype(np.float32), pads=(1,) * 4),
        prepare_conv2d(
            rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
            strides=(2, 2),
            pads=(1,) * 4,
            activation="relu",
        ),  # fmt: skip
    ]
    buf = np.full((2, 12, 9, 9), -7.0, np.float32)
    conv_concat(xs, plans, out=buf[:, 1:10])
    want = np.concatenate([conv2d_bias_act(x, p) for x, p in zip(xs, plans, strict=True)], 1)
    assert_close(buf[:, 1:10], want, rtol=0, atol=0)
    assert (buf[:, :1] == -7).all() and (buf[:, 10:] == -7).all()
    with pytest.raises(ValueError, match=r"differ in batch or size \(2x9x9, 2x17x17\)"):
        conv_concat([xs[0], xs[1]], [plans[0], prepare_conv2d(np.ones((4, 3, 1, 1), np.float32))])
    with pytest.raises(ValueError, match="one input per conv plan"):
        conv_concat(xs[:1], plans)


def explain_concat(model) -> str:
    return near_miss(model, "ConvConcat", catalog=CATALOG)


def test_concat_on_another_axis_is_not_fused():
    g = GraphBuilder()
    a, b = conv_block(g, "x", 4, 3, k=1), conv_block(g, "x", 4, 3, k=3, pads=[1, 1, 1, 1])
    y = g.node("Concat", [a, b], axis=2, name="/cat")
    text = explain_concat(g.model({"x": [1, 4, 5, 5]}, [y]))
    assert "Concat /cat: Concat on axis 2, not on the channels (axis 1)" in text


def test_branch_output_used_elsewhere_is_not_fused():
    g = GraphBuilder()
    (b1, *_), y = inception(g, "x", 8)
    side = g.node("Neg", [b1], name="/side")
    text = explain_concat(g.model({"x": [1, 8, 6, 6]}, [y, side]))
    assert "is also used by Neg /side" in text


def test_input_that_is_not_a_conv_is_not_fused():
    g = GraphBuilder()
    a = conv_block(g, "x", 4, 3, k=1)
    pooled = g.node("MaxPool", ["x"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    y = g.node("Concat", [a, pooled], axis=1, name="/cat")
    text = explain_concat(g.model({"x": [1, 4, 5, 5]}, [y]))
    assert f"Concat /cat: input 1 ({pooled}) is not the output of a ConvBiasRelu" in text


def test_the_same_branch_twice_is_not_fused():
    g = GraphBuilder()
    a = conv_block(g, "x", 4, 3, k=1)
    y = g.node("Concat", [a, a], axis=1, name="/cat")
    text = explain_concat(g.model({"x": [1, 4, 5, 5]}, [y]))
    assert "the same ConvBiasRelu output is concatenated more than once" in text


def test_fire_module_wins_over_conv_concat():
    g = GraphBuilder()
    *_, y = fire_graph(g, "x", 6, 4, 5, 5)
    result = fusion.rewrite(g.model({"x": ["N", 6, 6, 6]}, [y]), CATALOG)
    assert fused_ops(result.model) == ["FireModule"]


def test_consecutive_convs_concatenated_are_not_fused():
    # VoVNet's one-shot aggregation: Concat([a, conv(a)]); a fused node cannot read `a`,
    # which it would compute itself
    g = GraphBuilder()
    a = conv_block(g, "x", 4, 3, k=1)
    b = conv_block(g, a, 3, 5, k=3, pads=[1, 1, 1, 1])
    y = g.node("Concat", [a, b], axis=1, name="/cat")
    model = g.model({"x": ["N", 4, 5, 5]}, [y])
    text = explain_concat(model)
    assert "Concat /cat: branch 1 reads branch 0's output (consecutive convs" in text
    check_against_onnxruntime(model, batches=(2,))  # still valid, still right


def test_branches_with_the_same_node_names_keep_a_valid_body():
    # node names need not be unique in ONNX (onnxruntime refuses such a model, the checker
    # does not); the bodies inlined into the fused node must still be SSA
    g = GraphBuilder()
    a = conv_block(g, "x", 4, 3, k=1)
    b = conv_block(g, "x", 4, 5, k=3, pads=[1, 1, 1, 1])
    y = g.node("Concat", [a, b], axis=1, name="/cat")
    unique = g.model({"x": ["N", 4, 5, 5]}, [y])
    same = onnx.ModelProto()
    same.CopyFrom(unique)
    for node in same.graph.node:
        node.name = node.op_type.lower()
    onnx.checker.check_model(same, full_check=True)
    result = fusion.rewrite(same, CATALOG)  # not assert_fuses: onnxruntime refuses `same`
    assert fused_ops(result.model) == ["ConvConcat"] and len(result.model.graph.node) == 1
    onnx.checker.check_model(result.model, full_check=True)
    feeds = random_feeds(unique, batch=2)
    (want,) = run_ort(unique, feeds)
    assert_close(run_ort(result.model, feeds)[0], want, rtol=1e-6, atol=1e-6)
    got = Session(result.model, threads=2, catalog=CATALOG).run(None, feeds)[0]
    assert_close(got, want, rtol=1e-4, atol=1e-5)
