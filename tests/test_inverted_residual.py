"""InvertedResidual: MobileNetV2's block (1x1 expand -> depthwise -> 1x1 project [+ x]) fuses into
one node whose kernel, depth first and op by op, gives onnxruntime's outputs on the unfused
graph at strides 1 and 2, expansions 1, 4 and 6, channels that are not whole blocks, images of
1 to 28 pixels and batches 0 to 3; each near-miss says why."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, assert_fuses, near_miss, run_bound, run_ort

import fusion

RNG = np.random.default_rng(0)


def weights(*shape, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def act(g, y, kind):
    if kind == "relu6":
        return g.node(
            "Clip", [y, g.const(np.array(0, np.float32)), g.const(np.array(6, np.float32))]
        )
    if kind == "relu":
        return g.node("Relu", [y])
    if kind == "hardswish":
        return g.node("HardSwish", [y])
    if kind == "silu":
        return g.node("Mul", [y, g.node("Sigmoid", [y])])
    return y


def conv(g, x, w, b, kind, bn=False, **attrs):
    y = g.node("Conv", [x, g.const(w), g.const(b)], **attrs)
    if bn:
        m = w.shape[0]
        stats = [RNG.uniform(0.5, 1.5, m), RNG.normal(0, 0.1, m), RNG.normal(0, 0.1, m),
                 RNG.uniform(0.5, 1.5, m)]  # fmt: skip
        y = g.node("BatchNormalization", [y, *(g.const(s.astype(np.float32)) for s in stats)])
    return act(g, y, kind)


def block(g, x, c, t, m, s=1, k=3, residual=None, acts=("relu6", "relu6", None), bn=False):
    """The block on `x`; returns (output, the weights and biases as the kernel takes them); g.inner:
    the expanded and depthwise tensors."""
    e = c * t
    we, be = (weights(e, c, 1, 1), weights(e, scale=0.1)) if t != 1 else (None, None)
    wd, bd = weights(e, 1, k, k), weights(e, scale=0.1)
    wp, bp = weights(m, e, 1, 1), weights(m, scale=0.1)
    expanded = x if t == 1 else conv(g, x, we, be, acts[0], bn)
    g.inner = (expanded, conv(g, expanded, wd, bd, acts[1], bn, group=e, strides=[s, s],
                              pads=[k // 2] * 4))  # fmt: skip
    y = conv(g, g.inner[1], wp, bp, acts[2], bn)
    residual = s == 1 and m == c if residual is None else residual
    if residual == "before":  # ResNet's order: the Add, then the activation
        y = g.node("Relu", [g.node("Add", [x, y], name="/block/add")])
    elif residual:
        y = g.node("Add", [y, x], name="/block/add")
    return y, (we, be, wd, bd, wp, bp)


def model_of(c, t, m, s=1, k=3, hw=7, **kw):
    g = GraphBuilder(opset=17)
    y, _ = block(g, "x", c, t, m, s, k, **kw)
    return g.model({"x": ["N", c, hw, hw]}, [y])


CASES = [  # c, t, m, s, k, hw, batch, activations
    (3, 6, 3, 1, 3, 7, 2, ("relu6", "relu6", None)),
    (5, 4, 5, 2, 3, 13, 3, ("relu", "relu", None)),
    (17, 6, 17, 1, 5, 13, 1, ("hardswish", "hardswish", None)),
    (24, 6, 24, 1, 3, 28, 1, ("relu6", "relu6", None)),
    (32, 6, 17, 2, 5, 7, 2, ("silu", "silu", "relu")),
    (16, 1, 24, 1, 3, 13, 2, (None, "relu6", None)),  # expansion 1: depthwise -> project
    (17, 1, 17, 2, 3, 7, 3, (None, "silu", None)),
    (24, 4, 32, 2, 3, 1, 1, ("relu6", "relu6", None)),  # a 1x1 image
    (5, 6, 5, 1, 3, 7, 0, ("relu6", "relu6", None)),  # batch 0
    (3, 2, 4, 1, 3, 9, 2, ("relu", "relu6", None)),  # E = 6: fewer than a block of d
]


@pytest.mark.parametrize("c,t,m,s,k,hw,batch,acts", CASES)
def test_fuses_and_both_tactics_match_onnxruntime(c, t, m, s, k, hw, batch, acts):
    model = model_of(c, t, m, s, k, hw, acts=acts, bn=c % 2 == 1)
    result = assert_fuses(model, ["InvertedResidual"], batch=max(batch, 1), rtol=1e-4, atol=1e-5)
    feeds = {"x": RNG.standard_normal((batch, c, hw, hw)).astype(np.float32)}
    (want,) = run_ort(model, feeds)
    for tactic in ("blocked-depthfirst", "blocked-opbyop"):
        session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
        assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5, what=tactic)


@pytest.mark.parametrize("b", [8, 16])
@pytest.mark.parametrize("c,t,m,s,k,hw,batch", [(17, 6, 17, 1, 3, 13, 2), (3, 1, 5, 2, 5, 7, 1)])
def test_kernel_alone_matches_onnxruntime(c, t, m, s, k, hw, batch, b):
    """kernels/inverted_residual.py on the weights of the graph, against the graph, in blocks
    of 8 and 16 whatever this CPU's width (16 lanes run on AVX2 as register pairs)."""
    from fusion_kernels.blocked import block_size, from_blocked, to_blocked
    from fusion_kernels.inverted_residual import inverted_residual, prepare_inverted_residual

    g = GraphBuilder(opset=17)
    y, (we, be, wd, bd, wp, bp) = block(g, "x", c, t, m, s, k)
    model = g.model({"x": ["N", c, hw, hw]}, [y])
    clip = ("clip", None, None, 0.0, 6.0)
    plan = prepare_inverted_residual(we, be, wd, bd, wp, bp, stride=s, acts=(clip, clip, None),
                                     residual=s == 1 and m == c, block=b)  # fmt: skip
    x = RNG.standard_normal((batch, c, hw, hw)).astype(np.float32)
    got = from_blocked(inverted_residual(to_blocked(x, block=block_size(c, b)), plan), m)
    assert_close(got, run_ort(model, {"x": x})[0], 1e-4, 1e-5)


def test_the_block_is_compiled_once_for_every_pair_of_tiles():
    """The 1x1 convs' serial work is the direct kernel's, compiled per register tile and shared
    with conv_nchwc; the block's driver and item around it are compiled once (a parallel loop
    per pair of tiles, ~10 s of compile each, made MobileNetV2's cold start 2x longer)."""
    from fusion_kernels import _blocked_geometry as geo
    from fusion_kernels import _inverted_residual_blocked as ir
    from fusion_kernels.blocked import to_blocked
    from fusion_kernels.conv_nchwc import tile_item
    from fusion_kernels.inverted_residual import inverted_residual, prepare_inverted_residual
    from fusion_kernels.simd import lanes, width

    b = width()
    x = to_blocked(weights(1, b, 6, 6), block=b)
    runs = set()  # the projections' work items, by the address of their machine code
    for m in (b, 4 * b):  # projections of one and four blocks: tiles of 1 and 4 blocks
        wp = weights(m, 2 * b, 1, 1)
        plan = prepare_inverted_residual(weights(2 * b, b, 1, 1), None, weights(2 * b, 1, 3, 3),
                                         None, wp, None)  # fmt: skip
        inverted_residual(x, plan)
        (launch,) = plan.launches.values()
        runs.add(launch.args[2].address)
        # conv_nchwc's work item for the same tile (and input blocks): the same machine code
        pw = int(launch.args[12][geo.PW])  # the projection's geometry
        same = tile_item(lanes(b), pw, plan.project.fb, lanes(b))
        assert same.address == launch.args[2].address
    assert len(runs) == 2
    lanes_type = ir.inverted_residual_blocked.signatures[0][0]
    ci = [sig[17] for sig in ir.inverted_residual_blocked.signatures]  # x in blocks of b: L
    assert ci.count(lanes_type) == 1


def test_bands_fit_l2_and_feed_every_thread():
    from fusion_kernels.inverted_residual import L2_SHARE, bands
    from fusion_kernels.machine import cache_bytes

    parts, rows = bands(1, 56, 56, 56, 9, 16, 3, 1, 2)  # one image, two threads: two parts
    assert parts == 2 and 1 <= rows <= 28
    assert ((rows - 1) + 3) * 56 * 9 * 16 * 4 + rows * 56 * 9 * 16 * 4 <= cache_bytes(2) // L2_SHARE
    assert bands(8, 7, 7, 7, 60, 16, 3, 1, 2)[0] == 1  # eight images keep two threads busy
    assert bands(3, 7, 7, 7, 60, 16, 3, 1, 2)[0] == 2  # three would leave one idle a third
    assert bands(1, 56, 56, 112, 96, 16, 3, 2, 2)[1] >= 1  # never fewer than one row


@pytest.mark.parametrize("b", [8, 16])
@pytest.mark.parametrize("budget", [1, 8_000, 20_000])
@pytest.mark.parametrize(
    "c,t,m,s,k,hw",
    [(17, 6, 17, 1, 3, 13), (8, 4, 24, 2, 5, 17), (16, 1, 16, 2, 3, 13), (16, 1, 16, 1, 5, 9)],
)
def test_bands_of_few_rows_carry_the_rows_they_share(monkeypatch, c, t, m, s, k, hw, budget, b):
    """Bands of 1 to a few rows (a tiny L2): each band moves the k - s rows of e it shares with
    the one before to the top of its scratch and computes the rest; parts of an image start
    afresh. Against onnxruntime on the graph, strides 1 and 2, k 3 and 5, blocks of 8 and
    16."""
    import fusion_kernels.inverted_residual as K
    from fusion_kernels.blocked import block_size, from_blocked, to_blocked

    monkeypatch.setattr(K, "cache_bytes", lambda level: budget)
    g = GraphBuilder(opset=17)
    y, (we, be, wd, bd, wp, bp) = block(g, "x", c, t, m, s, k, acts=("relu6", "relu", None))
    model = g.model({"x": ["N", c, hw, hw]}, [y])
    plan = K.prepare_inverted_residual(we, be, wd, bd, wp, bp, stride=s, pads=(k // 2,) * 4,
                                       acts=(("clip", None, None, 0.0, 6.0), ("relu",), None),
                                       residual=s == 1 and m == c, block=b)  # fmt: skip
    x = RNG.standard_normal((2, c, hw, hw)).astype(np.float32)
    got = from_blocked(K.inverted_residual(to_blocked(x, block=block_size(c, b)), plan), m)
    assert_close(got, run_ort(model, {"x": x})[0], 1e-4, 1e-5)
    (launch,) = plan.launches.values()
    assert launch.geometry[K.ir.ROWS] < launch.shape[2]  # several bands per image


def test_expanded_tensor_that_is_a_graph_output_is_not_fused_away():
    g = GraphBuilder(opset=17)
    y, _ = block(g, "x", 8, 6, 8)
    model = g.model({"x": ["N", 8, 7, 7]}, [y, g.inner[0]])
    # the depthwise conv and the projection still fuse, as an expansion-1 block reading it
    near_miss(model, "InvertedResidual", "is also a graph output",
              fused=["ConvBiasRelu", "InvertedResidual"])  # fmt: skip


def test_depthwise_output_with_a_second_consumer_is_not_fused_away():
    g = GraphBuilder(opset=17)
    y, _ = block(g, "x", 8, 6, 8)
    other = g.node("Relu", [g.inner[1]], name="/other")
    # the expand and the depthwise conv still run depth first, stopping at d
    near_miss(g.model({"x": ["N", 8, 7, 7]}, [y, other]), "InvertedResidual",
              "is also used by Relu /other", fused=["ExpandDepthwise", "ConvBiasRelu"])  # fmt: skip


def test_squeeze_excite_between_depthwise_and_project_is_left_to_its_patterns():
    g = GraphBuilder(opset=17)
    e = conv(g, "x", weights(48, 8, 1, 1), weights(48), "relu")
    d = conv(g, e, weights(48, 1, 3, 3), weights(48), "relu", group=48, pads=[1] * 4)
    m = g.node("GlobalAveragePool", [d])
    h = conv(g, m, weights(8, 48, 1, 1), weights(8), "relu")
    s = g.node(
        "Sigmoid", [g.node("Conv", [h, g.const(weights(48, 8, 1, 1)), g.const(weights(48))])]
    )
    y = g.node("Conv", [g.node("Mul", [d, s]), g.const(weights(8, 48, 1, 1))])
    model = g.model({"x": ["N", 8, 7, 7]}, [y])
    near_miss(model, "InvertedResidual", fused=["ExpandDepthwise", "SqueezeExciteConv"])


def test_grouped_middle_conv_is_not_a_depthwise_one():
    g = GraphBuilder(opset=17)
    e = conv(g, "x", weights(16, 8, 1, 1), weights(16), "relu")
    d = conv(g, e, weights(16, 2, 3, 3), weights(16), "relu", group=8, pads=[1] * 4)
    y = g.node("Conv", [d, g.const(weights(8, 16, 1, 1))])
    near_miss(g.model({"x": ["N", 8, 7, 7]}, [y]), "InvertedResidual", "not a depthwise one",
              fused=["ConvBiasRelu", "ConvBiasRelu", "ConvBiasRelu"])  # fmt: skip


def test_dilated_depthwise_conv_is_a_near_miss_that_says_why():
    g = GraphBuilder(opset=17)
    e = conv(g, "x", weights(48, 8, 1, 1), weights(48), "relu6")
    d = conv(g, e, weights(48, 1, 3, 3), weights(48), "relu6", group=48, pads=[2] * 4,
             dilations=[2, 2])  # fmt: skip
    y = g.node("Add", [conv(g, d, weights(8, 48, 1, 1), weights(8), None), "x"])
    near_miss(g.model({"x": ["N", 8, 9, 9]}, [y]), "InvertedResidual", "dilations [2, 2]",
              fused=["ConvBiasRelu", "ConvBiasRelu", "ConvBiasRelu"])  # fmt: skip


@pytest.mark.parametrize("t", [1, 4])
def test_residual_added_before_the_activation(t):
    """ResNet's order, Relu(x + project(d)): one node, the Relu inside it (not left to
    onnxruntime after the block), both tactics against onnxruntime."""
    g = GraphBuilder(opset=17)
    y, _ = block(g, "x", 16, t, 16, residual="before", bn=True)
    model = g.model({"x": ["N", 16, 11, 11]}, [y])
    result = assert_fuses(model, ["InvertedResidual"], batch=2, rtol=1e-4, atol=1e-5)
    feeds = {"x": RNG.standard_normal((2, 16, 11, 11)).astype(np.float32)}
    (want,) = run_ort(model, feeds)
    for tactic in ("blocked-depthfirst", "blocked-opbyop"):
        session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
        assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5, what=tactic)


@pytest.mark.parametrize(
    "c,t,m,k,hw,acts,residual",
    [
        (32, 6, 32, 3, 7, ("relu6", "relu6", None), None),  # the residual after (MobileNetV2)
        (24, 6, 24, 5, 5, ("silu", "silu", None), "before"),  # Relu(x + project(d))
        (40, 6, 24, 3, 7, ("hardswish", "relu6", "silu"), False),  # an activation after
        (48, 1, 48, 3, 4, (None, "relu6", None), None),  # expansion 1: x read in place
    ],
)
def test_channel_parts_of_a_small_image(monkeypatch, c, t, m, k, hw, acts, residual):
    """One small image on two threads: each thread takes part of the expanded channels over
    every row (no shared rows computed twice), its projection's partial sums added with the
    epilogue after (taken whatever channel_cuts would choose); against onnxruntime."""
    import fusion_kernels.inverted_residual as K

    def two_parts(c, e, m, h, w, oh, ow, k, s, parts, b, fb, threads, expand):
        return K.block_cuts(-(-e // b), fb if expand else 1, 2)

    monkeypatch.setattr(K, "channel_cuts", two_parts)
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.config import get_threads, set_threads

    g = GraphBuilder(opset=17)
    y, (we, be, wd, bd, wp, bp) = block(g, "x", c, t, m, 1, k, residual=residual, acts=acts)
    model = g.model({"x": ["N", c, hw, hw]}, [y])
    keywords = {"relu6": ("clip", None, None, 0.0, 6.0), "hardswish": ("hard_swish",),
                "silu": ("silu",), None: None}  # fmt: skip
    kind = {None: c == m, False: None, "before": "before"}[residual]
    kernel_acts = [keywords[a] for a in acts]
    if residual == "before":  # block() puts a Relu after the Add
        kernel_acts[2] = ("relu",)
    plan = K.prepare_inverted_residual(we, be, wd, bd, wp, bp, pads=(k // 2,) * 4,
                                       acts=kernel_acts, residual=kind)  # fmt: skip
    x = RNG.standard_normal((1, c, hw, hw)).astype(np.float32)
    threads = get_threads()
    set_threads(2)
    try:
        got = from_blocked(K.inverted_residual(to_blocked(x), plan), m)
    finally:
        set_threads(threads)
    (launch,) = plan.launches.values()
    assert launch.geometry[K.ir.SPLIT] == 2
    assert_close(got, run_ort(model, {"x": x})[0], 1e-4, 1e-5)


def test_channel_cuts_where_rows_would_compute_shared_rows_twice():
    from fusion_kernels.inverted_residual import channel_cuts

    # 7x7, 160 -> 960 -> 160, two runs of rows would expand 6 + 5 rows: channel parts instead
    assert channel_cuts(160, 960, 160, 7, 7, 7, 7, 3, 1, 2, 16, 4, 2, True) == [0, 32, 60]
    assert channel_cuts(160, 960, 160, 7, 7, 7, 7, 3, 1, 2, 16, 4, 4, True) == [0, 16, 32, 48, 60]
    # 56x56: 30 rows of 56 per run, the shared rows cost less than adding partial sums
    assert channel_cuts(24, 144, 24, 56, 56, 56, 56, 3, 1, 2, 16, 2, 2, True) is None
    assert channel_cuts(160, 960, 160, 7, 7, 7, 7, 3, 1, 1, 16, 4, 2, True) is None  # batch 2


def se_block(g, x, c, t, m, s=1, k=3, acts=("silu", "silu"), bn=False, se=True):
    """EfficientNet's block: expand -> depthwise -> squeeze-excitation -> project (no
    residual); returns (output, (we, be, wd, bd)); g.inner_d: the depthwise conv's output."""
    e = c * t
    we, be = weights(e, c, 1, 1), weights(e, scale=0.1)
    wd, bd = weights(e, 1, k, k), weights(e, scale=0.1)
    d = conv(g, conv(g, x, we, be, acts[0], bn), wd, bd, acts[1], bn, group=e, strides=[s, s],
             pads=[k // 2] * 4)  # fmt: skip
    g.inner_d = d
    if se:
        h = conv(g, g.node("GlobalAveragePool", [d]), weights(4, e, 1, 1), weights(4), "silu")
        gate = g.node("Conv", [h, g.const(weights(e, 4, 1, 1)), g.const(weights(e))])
        d = g.node("Mul", [d, g.node("Sigmoid", [gate])])
    return g.node("Conv", [d, g.const(weights(m, e, 1, 1))]), (we, be, wd, bd)


ED_CASES = [  # c, t, s, k, hw, batch, activations, BatchNorm
    (16, 6, 2, 3, 29, 1, ("silu", "silu"), True),  # EfficientNet's features.2.0, smaller
    (24, 6, 1, 5, 13, 2, ("silu", "silu"), False),
    (16, 4, 2, 5, 14, 3, ("hardswish", "hardswish"), True),  # MobileNetV3
    (5, 3, 1, 3, 7, 2, ("relu6", "relu"), False),  # E = 15: less than a block
    (17, 6, 1, 3, 1, 1, ("relu", None), True),  # a 1x1 image, no activation on d
    (8, 6, 2, 3, 9, 0, ("silu", "silu"), False),  # batch 0
]


@pytest.mark.parametrize("c,t,s,k,hw,batch,acts,bn", ED_CASES)
def test_expand_depthwise_before_a_gate_matches_onnxruntime(c, t, s, k, hw, batch, acts, bn):
    """Squeeze-excitation splits the block at its gate: the expand and the depthwise conv are
    one ExpandDepthwise node (e never leaves the cache), the gate and the projection another
    (SqueezeExciteConv), each node's tactics against onnxruntime (the gate folded into the
    projection's weights, then not)."""
    g = GraphBuilder(opset=17)
    y, _ = se_block(g, "x", c, t, 8, s, k, acts, bn)
    model = g.model({"x": ["N", c, hw, hw]}, [y])
    result = assert_fuses(model, ["ExpandDepthwise", "SqueezeExciteConv"],
                          batch=max(batch, 1), rtol=1e-4, atol=1e-5)  # fmt: skip
    feeds = {"x": RNG.standard_normal((batch, c, hw, hw)).astype(np.float32)}
    (want,) = run_ort(model, feeds)
    # (SqueezeExciteConv has no blocked-depthfirst: it runs its first tactic, blocked-gated)
    for tactic in ("blocked-depthfirst", "blocked-opbyop"):
        session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
        assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5, what=tactic)


@pytest.mark.parametrize("hw,parts", [(57, 1), (7, 2)])
def test_expand_depthwise_kernel_in_bands_and_channel_parts(monkeypatch, hw, parts):
    """The kernel alone against onnxruntime on the graph's d: a large image in several bands
    of rows per run, and a small one whose two threads take half of the channels each (their
    blocks of d written straight into y: no partial sums to add)."""
    import fusion_kernels.inverted_residual as K
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.config import get_threads, set_threads

    if parts == 2:
        monkeypatch.setattr(K, "channel_cuts", lambda *a: K.block_cuts(-(-a[1] // a[10]), 1, 2))
    monkeypatch.setattr(K, "L2_SHARE", 64)  # small scratches: many bands
    c, t, k = 24, 6, 3
    g = GraphBuilder(opset=17)
    _, (we, be, wd, bd) = se_block(g, "x", c, t, 8, 1, k, acts=("relu6", "silu"), se=False)
    model = g.model({"x": ["N", c, hw, hw]}, [g.inner_d])
    relu6 = ("clip", None, None, 0.0, 6.0)
    plan = K.prepare_inverted_residual(we, be, wd, bd, None, None, acts=(relu6, ("silu",)))
    x = RNG.standard_normal((1, c, hw, hw)).astype(np.float32)
    threads = get_threads()
    set_threads(2)
    try:
        got = from_blocked(K.inverted_residual(to_blocked(x), plan), c * t)
    finally:
        set_threads(threads)
    (launch,) = plan.launches.values()
    assert launch.split == parts
    if parts == 1:
        assert launch.geometry[K.ir.ROWS] < launch.shape[2]  # several bands per image
    assert_close(got, run_ort(model, {"x": x})[0], 1e-4, 1e-5)


def test_a_block_that_stops_at_d_needs_the_expand():
    from fusion_kernels.inverted_residual import prepare_inverted_residual

    wd, bd = weights(8, 1, 3, 3), weights(8)
    with pytest.raises(ValueError, match="without a projection the block needs we"):
        prepare_inverted_residual(None, None, wd, bd, None, None)


def test_expanded_tensor_read_elsewhere_is_not_fused_into_expand_depthwise():
    g = GraphBuilder(opset=17)
    e = conv(g, "x", weights(48, 8, 1, 1), weights(48), "relu")
    d = conv(g, e, weights(48, 1, 3, 3), weights(48), "relu", group=48, pads=[1] * 4)
    m = g.node("GlobalAveragePool", [d])
    y = g.node("Mul", [d, g.node("Sigmoid", [m])])
    near_miss(g.model({"x": ["N", 8, 7, 7]}, [y, e]), "ExpandDepthwise", "is also a graph output",
              fused=["ConvBiasRelu", "ConvBiasRelu"])  # fmt: skip


def test_expand_that_is_not_a_1x1_conv_is_a_near_miss_that_says_why():
    """A stem's 3x3 conv before a depthwise one (EfficientNet's features.0 -> features.1)."""
    g = GraphBuilder(opset=17)
    e = conv(g, "x", weights(32, 3, 3, 3), weights(32), "relu", strides=[2, 2], pads=[1] * 4)
    d = conv(g, e, weights(32, 1, 3, 3), weights(32), "relu", group=32, pads=[1] * 4)
    near_miss(g.model({"x": ["N", 3, 16, 16]}, [d]), "ExpandDepthwise",
              "e: a [32, 3, 3, 3] conv of group 1, not a 1x1 one",
              fused=["ConvBiasRelu", "ConvBiasRelu"])  # fmt: skip


def test_dilated_depthwise_after_an_expand_is_a_near_miss_that_says_why():
    g = GraphBuilder(opset=17)
    e = conv(g, "x", weights(48, 8, 1, 1), weights(48), "relu6")
    d = conv(g, e, weights(48, 1, 3, 3), weights(48), "relu6", group=48, pads=[2] * 4,
             dilations=[2, 2])  # fmt: skip
    near_miss(g.model({"x": ["N", 8, 9, 9]}, [d]), "ExpandDepthwise", "dilations [2, 2]",
              fused=["ConvBiasRelu", "ConvBiasRelu"])  # fmt: skip
