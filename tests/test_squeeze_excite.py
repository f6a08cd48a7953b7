"""SqueezeExcite: the gate block as each exporter writes it fuses into one node whose kernel
(blocked and NCHW tactics) gives onnxruntime's outputs on the original at two shapes; each
near-miss says why."""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, assert_fuses, near_miss, run_bound, run_ort

import fusion
from fusion.verify import verify_node

SHAPES = [(1, 16, 7, 7), (3, 16, 5, 9)]


def squeeze_excite(g, x, channels, hidden=4, pool="gap", act1="silu", act2="sigmoid", k=1):
    """y = x * act2(conv2(act1(conv1(mean_hw(x))))), names as the TorchScript exporter's."""
    if pool == "gap":
        m = g.node("GlobalAveragePool", [x], name="/se/avgpool")
    elif pool == "reduce_input":  # opset 18: axes as an input (dynamo)
        m = g.node("ReduceMean", [x, g.const(np.array([-1, -2]))], keepdims=1, name="/se/mean")
    else:  # opset < 18: axes as an attribute; "axes:..." and "keepdims=0" for near-misses
        axes = [1] if pool == "axes:1" else [2, 3]
        keep = 0 if pool == "keepdims=0" else 1
        m = g.node("ReduceMean", [x], axes=axes, keepdims=keep, name="/se/mean")
    pads = [k // 2] * 4
    h = g.node("Conv", [m, g.weight(hidden, channels, k, k), g.weight(hidden)], pads=pads,
               name="/se/fc1")  # fmt: skip
    h = g.node("Mul", [h, g.node("Sigmoid", [h])]) if act1 == "silu" else g.node("Relu", [h])
    s = g.node("Conv", [h, g.weight(channels, hidden, 1, 1), g.weight(channels)], name="/se/fc2")
    if act2 == "sigmoid":
        s = g.node("Sigmoid", [s])
    else:
        s = g.node("HardSigmoid", [s], alpha=1 / 6, beta=0.5)
    return g.node("Mul", [s, x], name="/se/mul")


def block(g, pool="gap", tail=3, residual=None, c=16, **se):
    """A conv, the gate on its output, a conv of tail x tail after it (1: the block's
    projection, which the gate folds into; residual "before" or "after" its Relu: the gate's
    input added, MobileNetV3's residual on a block that keeps its width)."""
    t = g.node("Relu", [g.node("Conv", ["x", g.weight(c, 16, 3, 3)], pads=[1, 1, 1, 1])])
    y = squeeze_excite(g, t, c, pool=pool, **se)
    m = c if residual else 8
    z = g.node("Conv", [y, g.weight(m, c, tail, tail), g.weight(m)], pads=[tail // 2] * 4,
               name="/proj")  # fmt: skip
    if residual == "before":
        return g.node("Relu", [g.node("Add", [z, t])])
    if residual == "after":
        return g.node("Add", [g.node("Relu", [z]), t])
    return z


@pytest.mark.parametrize(
    "opset,pool,act1,act2",
    [(17, "gap", "silu", "sigmoid"), (18, "reduce_input", "relu", "hard_sigmoid"),
     (13, "reduce_attr", "relu", "sigmoid")],
)  # fmt: skip
def test_fuses_and_runs_both_tactics(opset, pool, act1, act2):
    for shape in SHAPES:
        g = GraphBuilder(opset=opset)
        model = g.model({"x": ["N", *shape[1:]]}, [block(g, pool, act1=act1, act2=act2)])
        result = assert_fuses(model, ["ConvBiasRelu", "SqueezeExcite", "ConvBiasRelu"])
        feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        (want,) = run_ort(model, feeds)
        for tactic in ("blocked", "nchw"):
            session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
            assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5, what=f"{tactic} {shape}")
    assert fusion.coverage(model, result=result).summary() == (
        "convs: 4 of 4 fused; onnxruntime islands: 0"
    )


def test_reducemean_over_channels_is_not_a_squeeze():
    g = GraphBuilder(opset=13)
    model = g.model({"x": [1, 16, 5, 5]}, [block(g, "axes:1")])
    near_miss(model, "SqueezeExcite", "ReduceMean /se/mean over axes [1], not the spatial axes")


def test_reducemean_without_keepdims_is_not_a_squeeze():
    """(onnxruntime would reject the conv on its [N, C] output: checked without a run)"""
    g = GraphBuilder(opset=13)
    x = g.node("Relu", ["x"])
    m = g.node("ReduceMean", [x], axes=[2, 3], keepdims=0, name="/se/mean")
    r = g.node("Reshape", [m, g.const(np.array([1, 16, 1, 1]))])
    h = g.node("Relu", [g.node("Conv", [r, g.weight(4, 16, 1, 1)])])
    s = g.node("Sigmoid", [g.node("Conv", [h, g.weight(16, 4, 1, 1)])])
    y = g.node("Mul", [x, s])
    text = near_miss(g.model({"x": [1, 16, 5, 5]}, [y]), "SqueezeExcite")  # the convs fuse
    assert "pattern needs ReduceMean" in text or "pattern needs GlobalAveragePool" in text, text


def test_a_3x3_conv_in_the_gate_is_declined():
    g = GraphBuilder(opset=17)
    model = g.model({"x": [1, 16, 5, 5]}, [block(g, k=3, tail=1)])
    near_miss(model, "SqueezeExcite", "fc1: a [4, 16, 3, 3] conv of group 1, not a 1x1 one",
              fused=["ConvBiasRelu"] * 4)  # fmt: skip
    text = near_miss(model, "SqueezeExciteConv", fused=["ConvBiasRelu"] * 4)
    assert "fc1: a [4, 16, 3, 3] conv of group 1, not a 1x1 one" in text, text


# ---- the gate folded into the 1x1 conv after it (SqueezeExciteConv) ---------------------------
GATED_TACTICS = ("blocked-gated", "blocked-gated-one", "blocked-opbyop", "blocked-opbyop-one")


@pytest.mark.parametrize(
    "opset,pool,act1,act2,residual,c",
    [(17, "gap", "silu", "sigmoid", None, 16), (18, "reduce_input", "relu", "hard_sigmoid",
      "before", 20), (13, "reduce_attr", "relu", "sigmoid", "after", 40)],
)  # fmt: skip
def test_the_gate_folds_into_the_conv_after_it(opset, pool, act1, act2, residual, c):
    for shape in [(1, 16, 7, 7), (3, 16, 5, 9), (2, 16, 1, 1), (1, 16, 13, 12)]:
        g = GraphBuilder(opset=opset, seed=c)
        y = block(g, pool, tail=1, residual=residual, c=c, act1=act1, act2=act2)
        model = g.model({"x": ["N", 16, "H", "W"]}, [y])
        result = assert_fuses(model, ["ConvBiasRelu", "SqueezeExciteConv"])
        feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        (want,) = run_ort(model, feeds)
        for tactic in (*GATED_TACTICS, "race"):
            session = fusion.Session(result.model, threads=2, fuse=False,
                                     tactics="kernels" if tactic == "race" else tactic)  # fmt: skip
            # raced, the first conv may take a Winograd tactic: the rules' scale-relative error
            atol = 1e-4 * float(np.abs(want).max()) if tactic == "race" else 1e-5
            assert_close(run_bound(session, feeds)[0], want, 1e-4, atol, what=f"{tactic} {shape}")
        # the kernel called on NCHW tensors (its own conversions) against the node's body
        values = fusion.Session(result.model, threads=2, fuse=False).run_with_intermediates(feeds)
        node = next(n for n in result.model.graph.node if n.op_type == "SqueezeExciteConv")
        assert verify_node(result.model, node, values)[2], shape
    assert fusion.coverage(model, result=result).summary() == (
        "convs: 4 of 4 fused; onnxruntime islands: 0"
    )


def test_a_3x3_conv_after_the_gate_takes_it_apart():
    g = GraphBuilder(opset=17)
    model = g.model({"x": [1, 16, 5, 5]}, [block(g, tail=3)])
    near_miss(model, "SqueezeExciteConv", "p: a [8, 16, 3, 3] conv of group 1, not a 1x1 one",
              fused=["ConvBiasRelu", "SqueezeExcite", "ConvBiasRelu"])  # fmt: skip


def test_a_gated_tensor_read_elsewhere_is_not_folded_away():
    """y = x g is also a graph output: the conv cannot read x in its place."""
    g = GraphBuilder(opset=17)
    t = g.node("Relu", [g.node("Conv", ["x", g.weight(16, 16, 3, 3)], pads=[1, 1, 1, 1])])
    y = squeeze_excite(g, t, 16)
    z = g.node("Conv", [y, g.weight(8, 16, 1, 1)])
    model = g.model({"x": [1, 16, 5, 5]}, [z, y])
    text = near_miss(model, "SqueezeExciteConv",
                     fused=["ConvBiasRelu", "SqueezeExcite", "ConvBiasRelu"])  # fmt: skip
    assert "/se/mul" in text and "graph output" in text, text


# ---- the blocked kernel (kernels/squeeze_excite.py) at both widths ---------------------------
def se_model(channels, hidden, act1, act2, seed):
    g = GraphBuilder(seed=seed)
    return g, g.model({"x": ["N", channels, "H", "W"]},
                      [squeeze_excite(g, "x", channels, hidden, act1=act1, act2=act2)])  # fmt: skip


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize(
    "shape, hidden, act1, act2",
    [
        ((1, 5, 1, 1), 1, "relu", "sigmoid"),  # fewer channels than a block, a 1x1 plane
        ((3, 17, 13, 13), 3, "silu", "hard_sigmoid"),  # a block and one channel, 3 images
        ((1, 100, 7, 9), 24, "silu", "sigmoid"),
        ((1, 32, 56, 56), 8, "relu", "hard_sigmoid"),  # few blocks: planes cut in parts
        ((0, 16, 5, 5), 4, "relu", "sigmoid"),
        ((3, 48, 5, 5), 6, "relu", "sigmoid"),  # one region: an image's blocks on two threads
    ],
    ids=str,
)
@pytest.mark.parametrize("one_region", [False, True], ids=["four-regions", "one-region"])
def test_blocked_kernel_against_onnxruntime(block, shape, hidden, act1, act2, one_region):
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.simd.activation import encode
    from fusion_kernels.squeeze_excite import prepare_squeeze_excite, squeeze_excite_blocked

    n, c, h, w = shape
    g, model = se_model(c, hidden, act1, act2, seed=c)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    (w1, b1), (w2, b2) = [[inits[v] for v in node.input[1:]] for node in model.graph.node
                          if node.op_type == "Conv"]  # fmt: skip
    acts = {"relu": encode("relu"), "silu": encode("silu"), "sigmoid": encode("sigmoid"),
            "hard_sigmoid": encode("hard_sigmoid", alpha=1 / 6, beta=0.5)}  # fmt: skip
    plan = prepare_squeeze_excite(w1, b1, w2, b2, acts[act1], acts[act2])
    x = np.random.default_rng(n + c).standard_normal(shape).astype(np.float32)
    xb = to_blocked(x, block=block)
    yb = squeeze_excite_blocked(xb, plan, one_region=one_region)
    assert yb.shape == xb.shape
    assert not yb[:, -1, ..., c % block or block :].any()  # the padding stays zero
    if n:
        (want,) = run_ort(model, {"x": x})
        assert_close(from_blocked(yb, c), want, 1e-4, 1e-5)


def test_blocked_kernel_propagates_nan_and_checks_its_input():
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.simd.activation import encode
    from fusion_kernels.squeeze_excite import prepare_squeeze_excite, squeeze_excite_blocked

    g, model = se_model(20, 4, "relu", "sigmoid", seed=1)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    (w1, b1), (w2, b2) = [[inits[v] for v in node.input[1:]] for node in model.graph.node
                          if node.op_type == "Conv"]  # fmt: skip
    plan = prepare_squeeze_excite(w1, b1, w2, b2, encode("relu"), encode("sigmoid"))
    x = np.random.default_rng(0).standard_normal((2, 20, 6, 6)).astype(np.float32)
    x[1, 3, 2, 2] = np.nan  # image 1's mean of channel 3 is NaN: so is every gate of image 1
    (want,) = run_ort(model, {"x": x})
    for one_region in (False, True):
        got = from_blocked(squeeze_excite_blocked(to_blocked(x, block=16), plan, None, one_region),
                           20)  # fmt: skip
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[1]).all()
        assert_close(got[0], want[0], 1e-4, 1e-5)
    xb = to_blocked(x, block=16)
    xb.flags.writeable = False  # a read-only x after a writable one: its own entry point
    got = from_blocked(squeeze_excite_blocked(xb, plan, None, True), 20)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    with pytest.raises(ValueError, match="does not hold 20 channels"):
        squeeze_excite_blocked(to_blocked(x[:, :16], block=16), plan)
    with pytest.raises(ValueError, match="do not chain"):
        prepare_squeeze_excite(w1, b1, w1, b2, encode("relu"), encode("sigmoid"))


def gated_conv_model(channels, hidden, out, seed):
    """The gate, then a 1x1 conv with a bias: SqueezeExciteConv's body, for the kernels."""
    g = GraphBuilder(seed=seed)
    y = squeeze_excite(g, "x", channels, hidden, act1="silu", act2="sigmoid")
    z = g.node("Conv", [y, g.weight(out, channels, 1, 1), g.weight(out)], name="/proj")
    return g.model({"x": ["N", channels, "H", "W"]}, [z])


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize(
    "shape, hidden, out",
    [((1, 5, 1, 1), 1, 3), ((3, 17, 13, 13), 3, 40), ((1, 100, 7, 9), 24, 17),
     ((1, 32, 56, 56), 8, 16), ((0, 16, 5, 5), 4, 8), ((2, 48, 5, 5), 6, 100),
     ((2, 2600, 3, 3), 48, 64)],  # at 16 lanes a 4-block tile's K is cut in chunks
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("one_region", [False, True], ids=["regions", "one-region"])
def test_gated_weights_against_onnxruntime(block, shape, hidden, out, one_region):
    """conv(x g) computed as (W g) x, every register tile of the conv, against onnxruntime's
    gate and conv."""
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc, tile_options
    from fusion_kernels.simd.activation import encode
    from fusion_kernels.squeeze_excite import gated_weights, prepare_squeeze_excite

    n, c, h, w = shape
    model = gated_conv_model(c, hidden, out, seed=c)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    convs = [node for node in model.graph.node if node.op_type == "Conv"]
    (w1, b1), (w2, b2), (wp, bp) = [[inits[v] for v in node.input[1:]] for node in convs]
    plan = prepare_squeeze_excite(w1, b1, w2, b2, encode("silu"), encode("sigmoid"))
    x = np.random.default_rng(n + c).standard_normal(shape).astype(np.float32)
    xb = to_blocked(x, block=block)
    want = run_ort(model, {"x": x})[0] if n else None
    for tile in tile_options(wp.shape, 1, block):
        conv = prepare_conv_nchwc(wp, bp, tile=tile, block=block, in_block=block)
        weights = gated_weights(xb, plan, conv, one_region)
        assert weights.shape == (n, conv.packed.size)
        zb = conv_nchwc(xb, conv, weights=weights)
        if n:  # a sum over up to 2600 channels: its error is relative to the output's scale
            # (onnxruntime's own is 3.4e-5 off a float64 reference at a scale of 36 there)
            assert_close(from_blocked(zb, out), want, 1e-4, 1e-5, what=f"tile {tile}",
                         scaled=True)  # fmt: skip


def test_gated_weights_propagate_nan_and_check_their_arguments():
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc
    from fusion_kernels.simd.activation import encode
    from fusion_kernels.squeeze_excite import gated_weights, prepare_squeeze_excite

    model = gated_conv_model(20, 4, 24, seed=1)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    convs = [node for node in model.graph.node if node.op_type == "Conv"]
    (w1, b1), (w2, b2), (wp, bp) = [[inits[v] for v in node.input[1:]] for node in convs]
    plan = prepare_squeeze_excite(w1, b1, w2, b2, encode("silu"), encode("sigmoid"))
    x = np.random.default_rng(0).standard_normal((2, 20, 6, 6)).astype(np.float32)
    x[1, 3, 2, 2] = np.nan  # image 1's gates are all NaN: so is every output of image 1
    (want,) = run_ort(model, {"x": x})
    conv = prepare_conv_nchwc(wp, bp, block=16, in_block=16)
    xb = to_blocked(x, block=16)
    for one_region in (False, True):
        got = from_blocked(conv_nchwc(xb, conv, weights=gated_weights(xb, plan, conv, one_region)),
                           24)  # fmt: skip
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[1]).all()
        assert_close(got[0], want[0], 1e-4, 1e-5)
    with pytest.raises(ValueError, match="folds into a 1x1 conv of group 1 on 20 channels"):
        gated_weights(xb, plan, prepare_conv_nchwc(wp[:, :16], bp, block=16, in_block=16))
    with pytest.raises(ValueError, match="folds into a 1x1 conv"):
        three = prepare_conv_nchwc(np.ones((24, 20, 3, 3), np.float32), bp, pads=(1, 1, 1, 1),
                                   block=16, in_block=16)  # fmt: skip
        gated_weights(xb, plan, three)
    with pytest.raises(ValueError, match=r"weights must be a C-contiguous float32 array of shape"):
        conv_nchwc(xb, conv, weights=np.zeros((1, conv.packed.size), np.float32))
    depthwise = prepare_conv_nchwc(np.ones((20, 1, 3, 3), np.float32), group=20, block=16)
    with pytest.raises(ValueError, match="depthwise conv takes its plan's weights"):
        conv_nchwc(xb, depthwise, weights=np.zeros((2, depthwise.packed.size), np.float32))
