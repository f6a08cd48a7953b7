"""PreActConv: a BatchNormalization (+ activation) that only a 1x1 conv reads (DenseNet's
layers and transitions) fuses with that conv into one node, whose kernel, depth first (the
norm of a band of pixels in L2) and op by op, gives onnxruntime's outputs on the unfused graph
for channels that are not whole blocks, images of 1 to 56 x 56 pixels, batches 0 to 3, bands
of a few pixels, and an input that is a channel prefix of a longer buffer; each near-miss says
why."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, assert_fuses, near_miss, run_bound, run_ort

import fusion

RNG = np.random.default_rng(0)


def bn(g, x, channels, name=None):
    stats = [RNG.uniform(0.5, 1.5, channels), RNG.normal(0, 0.3, channels),
             RNG.normal(0, 0.3, channels), RNG.uniform(0.5, 1.5, channels)]  # fmt: skip
    return g.node("BatchNormalization", [x, *(g.const(s.astype(np.float32)) for s in stats)],
                  epsilon=1e-3, **({"name": name} if name else {}))  # fmt: skip


def act(g, y, kind):
    if kind == "relu":
        return g.node("Relu", [y])
    if kind == "sigmoid":
        return g.node("Sigmoid", [y])
    if kind == "relu6":
        return g.node(
            "Clip", [y, g.const(np.array(0, np.float32)), g.const(np.array(6, np.float32))]
        )
    return y


def preact(g, x, c, m, norm_act="relu", conv_act="relu", conv_bn=True, bias=True, k=1, **attrs):
    """BN(x) -> act -> Conv kxk (C -> M) [-> BN] -> act: DenseNet's layer start."""
    t = act(g, bn(g, x, c, name="/norm"), norm_act)
    w = (RNG.standard_normal((m, c, k, k)) * 0.2).astype(np.float32)
    ins = [t, g.const(w)] + ([g.const(RNG.standard_normal(m).astype(np.float32))] if bias else [])
    y = g.node("Conv", ins, name="/conv", **attrs)
    return act(g, bn(g, y, m) if conv_bn else y, conv_act)


def check_tactics(model, shapes, tactics=("blocked-preact", "blocked-opbyop")):
    result = fusion.rewrite(model)
    assert "PreActConv" in result.counts(), result.explain("PreActConv")
    for shape in shapes:
        feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
        want = run_ort(model, feeds)[0]
        for tactic in tactics:
            session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
            assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5, what=f"{tactic} {shape}")


@pytest.mark.parametrize("c,m", [(16, 32), (17, 5), (100, 24), (3, 1)])
@pytest.mark.parametrize("norm_act,conv_act", [("relu", "relu"), ("none", "relu6"),
                                               ("sigmoid", "none")])  # fmt: skip
def test_norm_act_and_1x1_conv_fuse_and_match_onnxruntime(c, m, norm_act, conv_act):
    g = GraphBuilder(opset=17)
    y = preact(g, "x", c, m, norm_act, conv_act, conv_bn=conv_act != "relu6")
    model = g.model({"x": ["N", c, "H", "W"]}, [y])
    assert_fuses(model, ["PreActConv"], rtol=1e-4, atol=1e-5)
    check_tactics(model, [(1, c, 13, 7), (2, c, 1, 1), (3, c, 7, 17)])


def test_a_transition_without_bias_or_epilogue_fuses():
    """DenseNet's transition: BN -> ReLU -> 1x1 conv with no bias, no activation after it."""
    g = GraphBuilder(opset=17)
    y = preact(g, "x", 32, 16, "relu", "none", conv_bn=False, bias=False)
    model = g.model({"x": ["N", 32, "H", "W"]}, [g.node("AveragePool", [y], kernel_shape=[2, 2],
                                                       strides=[2, 2])])  # fmt: skip
    assert_fuses(model, ["PreActConv", "AvgPool2D"], rtol=1e-4, atol=1e-5)
    check_tactics(model, [(1, 32, 56, 56), (0, 32, 8, 8)])


@pytest.mark.parametrize("b", [8, 16])
@pytest.mark.parametrize("budget", [1, 20_000])
def test_bands_of_a_few_pixels(monkeypatch, budget, b):
    """A tiny L2: bands of one to a few pixels, every one through the one-pixel path or a tile;
    in blocks of 8 and 16 whatever this CPU's width."""
    import fusion_kernels.preact_conv as K
    from fusion_kernels.blocked import from_blocked, to_blocked

    monkeypatch.setattr(K, "cache_bytes", lambda level: budget)
    c, m = 40, 24
    s, t = RNG.standard_normal(c).astype(np.float32), RNG.standard_normal(c).astype(np.float32)
    w = (RNG.standard_normal((m, c, 1, 1)) * 0.2).astype(np.float32)
    plan = K.prepare_preact_conv(s, t, w, None, norm_act={"activation": "relu"}, block=b)
    x = RNG.standard_normal((2, c, 9, 11)).astype(np.float32)
    ref = np.einsum("nchw,mc->nmhw", np.maximum(x * s[:, None, None] + t[:, None, None], 0),
                    w[:, :, 0, 0])  # fmt: skip
    got = from_blocked(K.preact_conv(to_blocked(x, block=plan.block), plan), m)
    assert_close(got, ref, 1e-4, 1e-5)
    (launch,) = plan.launches.values()
    assert launch.args[6][K.BAND] < 9 * 11  # several bands per image


@pytest.mark.parametrize("n", [1, 3])
def test_a_channel_prefix_of_a_longer_buffer_is_read_in_place(n):
    """DenseNet's concatenations append in place (kernels/concat.py): with N > 1 the norm's
    input is a strided view, read where it is."""
    import fusion_kernels.preact_conv as K
    from fusion_kernels.blocked import block, to_blocked

    b = block()
    c, m = 2 * b, 8
    s, t = RNG.standard_normal(c).astype(np.float32), RNG.standard_normal(c).astype(np.float32)
    w = (RNG.standard_normal((m, c, 1, 1)) * 0.2).astype(np.float32)
    plan = K.prepare_preact_conv(s, t, w, None, norm_act={"activation": "relu"})
    longer = to_blocked(RNG.standard_normal((n, 3 * b, 5, 6)).astype(np.float32), block=b)
    view = longer[:, :2]
    assert view.flags.c_contiguous == (n == 1)
    xf, step = K._images(view)
    assert np.shares_memory(xf, longer) and step == (3 if n > 1 else 2) * 5 * 6 * b
    got = K.preact_conv(view, plan)
    np.testing.assert_array_equal(got, K.preact_conv(np.ascontiguousarray(view), plan))


def test_a_3x3_conv_after_the_norm_is_a_near_miss():
    g = GraphBuilder(opset=17)
    y = preact(g, "x", 16, 8, k=3, pads=[1] * 4)
    near_miss(g.model({"x": ["N", 16, 7, 7]}, [y]), "PreActConv", "not a 1x1 one",
              fused=["BatchNormAct", "ConvBiasRelu"])  # fmt: skip


def test_a_strided_1x1_conv_is_a_near_miss():
    g = GraphBuilder(opset=17)
    y = preact(g, "x", 16, 8, strides=[2, 2])
    near_miss(g.model({"x": ["N", 16, 8, 8]}, [y]), "PreActConv", "strides [2, 2]",
              fused=["BatchNormAct", "ConvBiasRelu"])  # fmt: skip


def test_a_norm_output_read_elsewhere_is_not_fused_away():
    g = GraphBuilder(opset=17)
    y = preact(g, "x", 16, 8)
    relu = next(n for n in g.nodes if n.op_type == "Relu")
    other = g.node("Sigmoid", [relu.output[0]], name="/other")
    near_miss(g.model({"x": ["N", 16, 7, 7]}, [y, other]), "PreActConv",
              "is also used by Sigmoid /other",
              fused=["BatchNormAct", "ConvBiasRelu"])  # fmt: skip


@pytest.mark.parametrize("bias_add", [False, True])
def test_a_norm_after_a_conv_folds_into_that_conv_instead(bias_add):
    """Conv -> BN -> ReLU -> 1x1 conv: the BN folds into the first conv's weights (free), so
    both convs are ConvBiasRelu, not a PreActConv that would run the BN as a pass."""
    g = GraphBuilder(opset=17)
    a = g.node("Conv", ["x", g.weight(16, 8, 3, 3)], pads=[1] * 4)
    if bias_add:
        a = g.node("Add", [a, g.const(RNG.standard_normal((1, 16, 1, 1)).astype(np.float32))])
    y = preact(g, a, 16, 8)
    model = g.model({"x": ["N", 8, 7, 7]}, [y])
    assert_fuses(model, ["ConvBiasRelu", "ConvBiasRelu"], rtol=1e-4, atol=1e-5)


def test_every_register_tile_is_a_tactic_and_right():
    """One depth-first tactic per tile the conv would time (tile_options), each right."""
    from fusion_kernels.blocked import block, from_blocked, to_blocked
    from fusion_kernels.conv_nchwc import tile_options
    from fusion_patterns.preact_conv import PreActConvKernel

    b = block()
    c, m = 2 * b + 3, 6 * b  # six output blocks: several tiles worth timing
    s, t = RNG.standard_normal(c).astype(np.float32), RNG.standard_normal(c).astype(np.float32)
    mean, var = np.zeros(c, np.float32), np.ones(c, np.float32)
    w = (RNG.standard_normal((m, c, 1, 1)) * 0.2).astype(np.float32)
    attrs = {"n_epsilon": 0.0, "n_activation": "relu", "c_strides": [1, 1], "c_pads": [0] * 4,
             "c_dilations": [1, 1], "c_group": 1, "c_auto_pad": "NOTSET",
             "c_activation": "identity"}  # fmt: skip
    kernel = PreActConvKernel(attrs, [None, s, t, mean, var, w, None, None, None, None, None,
                                      None])  # fmt: skip
    tiles = tile_options(w.shape)
    names = [k.name for k in kernel.tactics]
    assert names == [f"blocked-preact-f{k}" for k in tiles] + ["blocked-opbyop"]
    x = RNG.standard_normal((2, c, 9, 10)).astype(np.float32)
    want = np.einsum("nchw,mc->nmhw", np.maximum(x * s[:, None, None] + t[:, None, None], 0),
                     w[:, :, 0, 0])  # fmt: skip
    for tactic in kernel.tactics:
        got = from_blocked(tactic.run(to_blocked(x, block=b))[0], m)
        assert_close(got, want, 1e-4, 1e-5, what=tactic.name)
