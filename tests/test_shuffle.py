"""ChannelShuffle: ShuffleNet's Reshape -> Transpose -> Reshape (with the Concat before it and
the Split after it) fuses into one channel gather that matches onnxruntime exactly, NCHW and
blocked; Reshapes and Transposes that are not a channel shuffle do not fuse and say why."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, conv_block, fused_ops, near_miss, run_bound, run_ort

import fusion
from fusion.runtime import Session
from fusion_kernels.blocked import from_blocked, to_blocked
from fusion_kernels.shuffle import channel_gather, channel_gather_blocked, shuffle_map

CATALOG = fusion.default_catalog()
BLOCKS = [8, 16]  # the blocked kernel at either SIMD width, whatever this process's is


def naive_shuffle(x, g):
    n, c, h, w = x.shape
    return x.reshape(n, g, c // g, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)


def shuffle_model(c, g, h, w, concat=False, split=None, dynamic=False, perm=(0, 2, 1, 3, 4),
                  first=None, second=None, opset=17):  # fmt: skip
    """x [N, C, H, W] (or a, b [N, C/2, H, W] concatenated) shuffled in g groups, then split
    into `split` parts. dynamic: the Reshape targets read N, H, W from x's Shape, as
    TorchScript writes them for a symbolic batch."""
    gb = GraphBuilder(opset=opset)
    inputs = {"a": ["N", c // 2, h, w], "b": ["N", c - c // 2, h, w]} if concat else {}
    x = gb.node("Concat", ["a", "b"], axis=1) if concat else "x"
    inputs = inputs or {"x": ["N", c, h, w]}
    if dynamic:
        shape = gb.node("Shape", [x])
        dims = [gb.node("Gather", [shape, gb.const(np.array([k], np.int64))], axis=0)
                for k in range(4)]  # fmt: skip
        n_, h_, w_ = dims[0], dims[2], dims[3]
        g_ = gb.const(np.array([g], np.int64))
        per_group = gb.node("Div", [dims[1], g_])  # C / g from x's Shape, as TorchScript
        s1 = gb.node("Concat", [n_, g_, per_group, h_, w_], axis=0)
        s2 = gb.node("Concat", [n_, gb.const(np.array([-1], np.int64)), h_, w_], axis=0)
    else:
        s1 = gb.const(np.array(first or [-1, g, c // g, h, w], np.int64))
        s2 = gb.const(np.array(second or [-1, c, h, w], np.int64))
    y = gb.node(
        "Reshape", [gb.node("Transpose", [gb.node("Reshape", [x, s1])], perm=list(perm)), s2]
    )
    outs = [y]
    if split:
        sizes = gb.const(np.array(split, np.int64))
        outs = gb.node("Split", [y, sizes], n_out=len(split), axis=1)
    return gb.model(inputs, outs)


def feeds_for(model, batch, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        dims = [
            d.dim_value if d.HasField("dim_value") else batch for d in i.type.tensor_type.shape.dim
        ]
        out[i.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def check_exact(model, ops, batch, tactic):
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ops, result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    feeds = feeds_for(model, batch)
    want = run_ort(model, feeds)
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics=tactic)
    got = run_bound(session, feeds)
    assert list(session.choices.values()) == [tactic]
    assert len(got) == len(want)
    for g_, w_ in zip(got, want, strict=True):
        assert_close(g_, w_, rtol=0.0, atol=0.0)
    assert_close(run_ort(result.model, feeds)[0], want[0], rtol=0.0, atol=0.0)  # the body


@pytest.mark.parametrize("tactic", ["blocked", "nchw"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize(("c", "g", "h", "w"), [(6, 2, 7, 13), (24, 3, 1, 1), (58, 2, 13, 7),
                                                (116, 4, 7, 7), (12, 4, 1, 13)])  # fmt: skip
def test_shuffle_matches_onnxruntime(c, g, h, w, batch, tactic):
    check_exact(shuffle_model(c, g, h, w), ["ChannelShuffle"], batch, tactic)


SPLITS = [(6, 2, 7, [3, 3]), (58, 2, 13, [29, 29]), (24, 3, 1, [8, 16]), (116, 2, 7, [58, 58])]


@pytest.mark.parametrize("tactic", ["blocked", "nchw"])
@pytest.mark.parametrize(("c", "g", "hw", "split"), SPLITS)
def test_concat_shuffle_split_matches_onnxruntime(c, g, hw, split, tactic):
    model = shuffle_model(c, g, hw, hw, concat=True, split=split, dynamic=True)
    check_exact(model, ["ChannelShuffle"], 3, tactic)
    model = shuffle_model(c, g, hw, hw, concat=True)
    check_exact(model, ["ChannelShuffle"], 2, tactic)


def test_shuffle_between_convs_stays_blocked():
    """conv -> shuffle -> split -> conv on one half: the planner keeps the blocked layout."""
    gb = GraphBuilder(opset=17)
    x = conv_block(gb, "x", 3, 24, k=1)
    s1 = gb.const(np.array([-1, 2, 12, 7, 7], np.int64))
    s2 = gb.const(np.array([-1, 24, 7, 7], np.int64))
    y = gb.node(
        "Reshape", [gb.node("Transpose", [gb.node("Reshape", [x, s1])], perm=[0, 2, 1, 3, 4]), s2]
    )
    lo, hi = gb.node("Split", [y, gb.const(np.array([12, 12], np.int64))], n_out=2, axis=1)
    z = conv_block(gb, hi, 12, 16, k=3, pads=[1, 1, 1, 1])
    model = gb.model({"x": ["N", 3, 7, 7]}, [lo, z])
    result = fusion.rewrite(model, CATALOG)
    assert "ChannelShuffle" in fused_ops(result.model), result.explain()
    feeds = feeds_for(model, 2)
    want = run_ort(model, feeds)
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics="kernel")
    for g_, w_ in zip(session.run(None, feeds), want, strict=True):
        assert_close(g_, w_, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hw", [(7, 5), (9, 11)])  # one run of pixels, two (RUN = 64)
@pytest.mark.parametrize("b", BLOCKS)
@pytest.mark.parametrize(("ca", "cb"), [(3, 3), (5, 17), (29, 29), (1, 1), (40, 24)])
def test_blocked_kernel_against_numpy(ca, cb, b, hw):
    """Parts in blocks of the output's width take the permuting kernel (every output block
    gathered from several source blocks: a random map), narrower parts the lane by lane one."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, ca, *hw)).astype(np.float32)
    bb = rng.standard_normal((2, cb, *hw)).astype(np.float32)
    z = np.concatenate([a, bb], axis=1)
    src = rng.permutation(ca + cb)[: max(1, (ca + cb) // 2 + 1)]
    want = z[:, src]
    assert np.array_equal(channel_gather([a, bb], src), want)
    parts = [to_blocked(a, block=min(b, ca)), to_blocked(bb, block=min(b, cb))]
    yb = channel_gather_blocked(parts, [ca, cb], src, b)
    assert np.array_equal(from_blocked(yb, src.size), want)
    assert yb.shape[4] == b
    assert not yb[:, -1, :, :, src.size - (yb.shape[1] - 1) * yb.shape[4] :].any()  # padding 0


def test_shuffle_map_is_the_reshape_transpose():
    for c, g in [(6, 2), (24, 3), (116, 4), (5, 5), (1, 1)]:
        x = np.arange(c, dtype=np.float32).reshape(1, c, 1, 1)
        assert np.array_equal(x[:, shuffle_map(c, g)], naive_shuffle(x, g))
    with pytest.raises(ValueError, match="do not split"):
        shuffle_map(6, 4)


def test_kernel_refuses_bad_input():
    x = np.zeros((1, 4, 2, 2), np.float32)
    with pytest.raises(ValueError, match="channel map"):
        channel_gather([x], [4])
    with pytest.raises(ValueError, match="float32"):
        channel_gather([x.astype(np.float64)], [0])
    with pytest.raises(ValueError, match="cannot hold"):
        channel_gather_blocked([to_blocked(x)], [9], [0], 8)


# ---- near-misses -----------------------------------------------------------------------------
def test_wrong_perm_does_not_fuse():
    model = shuffle_model(6, 2, 3, 3, perm=(0, 1, 2, 4, 3))
    near_miss(model, "ChannelShuffle", "with perm [0, 1, 2, 4, 3], not a channel shuffle's",
              catalog=CATALOG)  # fmt: skip


def test_reshape_that_is_not_a_channel_split_does_not_fuse():
    model = shuffle_model(6, 2, 4, 4, first=[-1, 2, 3, 2, 8], second=[-1, 6, 4, 4])
    near_miss(model, "ChannelShuffle", "not [N, g, C/g, H, W]", catalog=CATALOG)
    model = shuffle_model(6, 2, 4, 4, second=[-1, 6, 2, 8])
    near_miss(model, "ChannelShuffle", "not [N, C, H, W]", catalog=CATALOG)


def test_unknown_channels_do_not_fuse():
    model = shuffle_model(6, 2, 3, 3)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "C"
    del model.graph.value_info[:]
    near_miss(model, "ChannelShuffle", "rank or channel count is unknown", catalog=CATALOG)


def test_inner_value_read_outside_does_not_fuse():
    model = shuffle_model(6, 2, 3, 3)
    reshaped = model.graph.node[0].output[0]
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(reshaped, onnx.TensorProto.FLOAT, None)
    )
    near_miss(model, "ChannelShuffle", "also read outside the shuffle", catalog=CATALOG)


# ---- a real ShuffleNet v2 (torchvision's, small: tests/fixtures/export_shufflenet.py) -------
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("exporter", ["dynamo18", "ts17"])
def test_shufflenet_export(exporter):
    """Every shuffle fused with its Concat and the next unit's halves, no island left: dynamo
    writes the halves as a Split; TorchScript as two Slices whose bounds it computes from
    Shape(y)[1] // 2, and names every channel count after the first shuffle `unk__N` (the
    graph's types know them: GraphView reads the Reshape targets and Slice bounds)."""
    model = onnx.load(FIXTURES / f"shufflenet_tiny.{exporter}.onnx")
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model).count("ChannelShuffle") == 5, result.explain()
    assert fusion.coverage(model, CATALOG, result).islands == 0
    x = np.random.default_rng(3).standard_normal((3, 3, 32, 32)).astype(np.float32)
    (want,) = run_ort(model, {"input": x})
    for tactic in ("kernel", "nchw"):
        session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics=tactic)
        assert_close(run_bound(session, {"input": x})[0], want, rtol=1e-4, atol=1e-4)
