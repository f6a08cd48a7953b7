"""BatchNormAct and ChannelConcat: DenseNet's pre-activation BN + Relu and its feature Concat
fuse, and their kernels (blocked and NCHW tactics) give onnxruntime's outputs on the original;
each near-miss says why."""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, assert_fuses, near_miss, run_ort

import fusion
from fusion_kernels.blocked import block
from fusion_patterns.concat import ConcatKernel, why_not_blocked


def batch_norm(g, x, channels, name="/bn"):
    rng = g.rng
    scale, bias, mean = (rng.standard_normal(channels).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, channels).astype(np.float32)
    return g.node("BatchNormalization", [x, *(g.const(v) for v in (scale, bias, mean, var))],
                  epsilon=1e-3, name=name)  # fmt: skip


def check_tactics(model, shapes, tactics=("blocked", "nchw")):
    result = fusion.rewrite(model)
    for shape in shapes:
        feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        want = run_ort(model, feeds)
        for tactic in tactics:
            session = fusion.Session(result.model, threads=2, fuse=False, tactics=tactic)
            for k, (got, w) in enumerate(zip(session.run(None, feeds), want, strict=True)):
                assert_close(got, w, 1e-4, 1e-5, what=f"{tactic} {shape} output {k}")


@pytest.mark.parametrize("act", ["Relu", "none", "Sigmoid"])
def test_batchnorm_with_and_without_activation(act):
    g = GraphBuilder()
    y = batch_norm(g, "x", 12)
    y = y if act == "none" else g.node(act, [y])
    model = g.model({"x": ["N", 12, 5, 7]}, [y])
    assert_fuses(model, ["BatchNormAct"], rtol=1e-5, atol=1e-5)
    check_tactics(model, [(1, 12, 5, 7), (3, 12, 5, 7)])


@pytest.mark.parametrize("shape", [(2, 6), (2, 6, 9)])
def test_batchnorm_of_rank_2_and_3_runs_nchw(shape):
    g = GraphBuilder()
    model = g.model({"x": ["N", *shape[1:]]}, [g.node("Relu", [batch_norm(g, "x", 6)])])
    assert_fuses(model, ["BatchNormAct"], rtol=1e-5, atol=1e-5)
    check_tactics(model, [shape], tactics=("nchw",))


def dense_block(g, x, channels=16, growth=8, layers=3):
    """DenseNet: each layer BN + Relu, a 3x3 conv; its output concatenated to the features."""
    features = [x]
    for k in range(layers):
        cat = g.node("Concat", features, axis=1) if len(features) > 1 else x
        t = g.node("Relu", [batch_norm(g, cat, channels + k * growth, name=f"/bn{k}")])
        conv = g.node("Conv", [t, g.weight(growth, channels + k * growth, 3, 3)], pads=[1] * 4)
        features.append(conv)
    return g.node("Concat", features, axis=1)


def test_dense_block_fuses_whole():
    g = GraphBuilder()
    model = g.model({"x": ["N", 16, "H", "W"]}, [dense_block(g, "x")])
    result = assert_fuses(model, None, rtol=1e-4, atol=1e-5)
    assert sorted(result.counts().items()) == [
        ("BatchNormAct", 3), ("ChannelConcat", 3), ("ConvBiasRelu", 3)
    ]  # fmt: skip
    assert fusion.coverage(model, result=result).islands == 0
    check_tactics(model, [(1, 16, 6, 6), (2, 16, 9, 5)])


@pytest.mark.parametrize("b", [8, 16])
def test_concat_blocked_only_with_whole_blocks(b):
    assert why_not_blocked(4, [16, 32, 3], b) is None  # the last input may fill part of a block
    assert why_not_blocked(4, [16, 8, 3], b) == (
        None if b == 8 else "input 1 has 8 channels, not whole blocks of 16"
    )
    assert why_not_blocked(4, [4, 8], b) == f"input 0 has 4 channels, not whole blocks of {b}"
    assert why_not_blocked(4, [8, -1], b) == "input 1 has an unknown number of channels"
    assert why_not_blocked(3, [16, 16], b) == "rank 3: the blocked layout is 4-D"


def test_concat_kernel_takes_the_block_of_the_process():
    """The rewrite leaves the block open; the kernel, built in this process, offers the
    blocked tactic for whole blocks of this process's block (8 with AVX2, 16 with AVX-512)."""
    b = block()
    kernel = ConcatKernel({"rank": 4, "channels": [2 * b, b, 3]}, [])
    assert [t.name for t in kernel.tactics] == ["blocked", "nchw"]
    assert kernel.tactics[0].in_blocks == (b, b, b) and kernel.nchw_only is None
    kernel = ConcatKernel({"rank": 4, "channels": [b // 2, b]}, [])
    assert [t.name for t in kernel.tactics] == ["nchw"]
    assert kernel.nchw_only == f"input 0 has {b // 2} channels, not whole blocks of {b}"


def test_concat_of_odd_channels_runs():
    g = GraphBuilder()
    a = g.node("Relu", [g.node("Conv", ["x", g.weight(5, 4, 1, 1)])])
    b = g.node("Relu", [g.node("Conv", ["x", g.weight(3, 4, 3, 3)], pads=[1] * 4)])
    y = g.node("Sigmoid", [g.node("Concat", [a, g.node("Relu", ["x"])], axis=1)])
    model = g.model({"x": ["N", 4, 5, 5]}, [y, b])
    assert fusion.rewrite(model).counts()["ChannelConcat"] == 1
    check_tactics(model, [(2, 4, 5, 5)])


def test_concat_on_another_axis_is_declined():
    g = GraphBuilder()
    a = g.node("Relu", ["x"])
    y = g.node("Concat", [a, g.node("Sigmoid", ["x"])], axis=2, name="/cat")
    near_miss(g.model({"x": [1, 4, 5, 5]}, [y]), "ChannelConcat",
              "Concat on axis 2, not on the channels (axis 1)")  # fmt: skip


def test_batchnorm_in_training_mode_is_declined():
    g = GraphBuilder(opset=15)
    y = g.node("Relu", [batch_norm(g, "x", 4)])
    bn = g.nodes[-2]
    bn.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    bn.output.extend(["/bn_mean", "/bn_var"])
    near_miss(g.model({"x": [1, 4, 5, 5]}, [y]), "BatchNormAct",
              "BatchNormalization /bn: training_mode=1")  # fmt: skip


def test_a_concatenation_reserves_room_for_the_one_that_extends_it():
    """DenseNet's layer k concatenates x_0 ... x_k again: each ChannelConcat but the last knows
    the channels of the longest one extending it, and its kernel leaves room for them."""
    g = GraphBuilder()
    model = g.model({"x": ["N", 16, "H", "W"]}, [dense_block(g, "x", layers=3)])
    result = fusion.rewrite(model)
    concats = [n for n in result.model.graph.node if n.op_type == "ChannelConcat"]
    reserves = [
        next((list(a.ints) for a in n.attribute if a.name == "reserve"), None) for n in concats
    ]
    assert reserves == [[16, 8, 8, 8], [16, 8, 8, 8], None]


@pytest.mark.parametrize("n", [1, 2])
def test_dense_block_of_whole_blocks_appends_and_stays_right(n, monkeypatch):
    """Channels and growth in whole blocks: every concatenation is blocked, each appends to
    the one before (4 parts copied, not 2 + 3 + 4), and two runs in a row (the second reusing
    nothing of the first) both give onnxruntime's result."""
    import fusion_kernels.concat

    placed = []
    place = fusion_kernels.concat._place
    monkeypatch.setattr(fusion_kernels.concat, "_place", lambda buf, ps, at: (
        placed.extend(ps), place(buf, ps, at))[1])  # fmt: skip
    b = block()
    g = GraphBuilder()
    model = g.model({"x": ["N", b, "H", "W"]}, [dense_block(g, "x", channels=b, growth=b)])
    feeds = {"x": np.random.default_rng(1).standard_normal((n, b, 7, 6)).astype(np.float32)}
    want = run_ort(model, feeds)[0]
    session = fusion.Session(fusion.rewrite(model).model, threads=2, fuse=False,
                             tactics="blocked")  # fmt: skip
    for _ in range(2):
        placed.clear()
        assert_close(session.run(None, feeds)[0], want, 1e-4, 1e-5, what=f"N = {n}")
        assert len(placed) == 4
