"""Pooling rules. MaxPool2D: a lone MaxPool fuses into the in-process kernel, which matches
onnxruntime exactly (output size rules included) on many configurations. GlobalAvgPoolFlatten:
a classifier head. Near-misses of both are not fused and say why."""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, conv_block, fused_ops, near_miss, run_bound, run_ort

import fusion
from fusion.runtime import Session
from fusion_kernels.blocked import from_blocked, to_blocked
from fusion_kernels.pool import (
    global_average_pool_blocked,
    maxpool2d,
    maxpool_blocked,
    prepare_maxpool,
)

CATALOG = fusion.default_catalog()
BLOCKS = [8, 16]  # the blocked kernels at either SIMD width, whatever this process's is

# (input shape, MaxPool attributes)
CASES = [
    ((1, 6, 23, 23), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),  # SqueezeNet
    ((2, 3, 7, 9), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ((1, 2, 5, 5), dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    ((1, 4, 8, 10), dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),  # GoogLeNet
    ((2, 3, 9, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 2, 2])),
    ((1, 2, 10, 11), dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2])),
    ((1, 3, 9, 9), dict(kernel_shape=[2, 3], strides=[1, 2], auto_pad="SAME_UPPER")),
    ((1, 3, 8, 9), dict(kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_LOWER")),
    ((1, 3, 8, 9), dict(kernel_shape=[3, 3], strides=[3, 3], auto_pad="VALID")),
    ((3, 2, 6, 5), dict(kernel_shape=[1, 1], strides=[2, 2])),
    ((1, 5, 12, 13), dict(kernel_shape=[5, 5], strides=[3, 1], pads=[2, 2, 2, 2], ceil_mode=1)),
    ((1, 2, 4, 40), dict(kernel_shape=[3, 3], strides=[2, 3], pads=[1, 2, 1, 2], ceil_mode=1)),
    # Left padding wider than the output (YOLO's SPP pools on small maps; it once wrote past
    # the row), VALID with ceil_mode, SAME with dilation, an input smaller than the window:
    ((1, 3, 4, 4), dict(kernel_shape=[13, 13], pads=[6, 6, 6, 6])),
    ((1, 2, 3, 1), dict(kernel_shape=[1, 3], pads=[0, 2, 0, 0])),
    ((1, 2, 3, 5), dict(kernel_shape=[2, 4], strides=[2, 2], auto_pad="VALID", ceil_mode=1)),
    ((1, 2, 6, 9), dict(kernel_shape=[3, 3], dilations=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 2, 7, 8), dict(kernel_shape=[3, 2], dilations=[2, 3], auto_pad="SAME_LOWER")),
    ((1, 2, 1, 4), dict(kernel_shape=[2, 3], strides=[3, 1])),
]


def pool_model(shape, attrs, opset=18):
    g = GraphBuilder(opset=opset)
    y = g.node("MaxPool", ["x"], name="/pool", **attrs)
    return g.model({"x": list(shape)}, [y])


@pytest.mark.parametrize("tactic", ["blocked", "nchw"])
@pytest.mark.parametrize(("shape", "attrs"), CASES, ids=lambda c: str(c))
def test_kernel_matches_onnxruntime_exactly(shape, attrs, tactic):
    model = pool_model(shape, attrs)
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ["MaxPool2D"], result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics=tactic)
    assert list(session.choices.values()) == [tactic]
    (got,) = run_bound(session, {"x": x})
    assert got.shape == want.shape
    assert_close(got, want, rtol=0, atol=0)
    (body,) = run_ort(result.model, {"x": x})  # the fused node's function body, in onnxruntime
    assert_close(body, want, rtol=0, atol=0)


def test_squeezenet_sized_planes_and_one_thread():
    plan = prepare_maxpool((3, 3), (2, 2), ceil_mode=True)
    model = pool_model((1, 64, 111, 111), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1))
    x = np.random.default_rng(2).standard_normal((1, 64, 111, 111)).astype(np.float32)
    (want,) = run_ort(model, {"x": x}, optimize=True)
    assert_close(maxpool2d(x, plan), want, rtol=0, atol=0)
    out = np.empty_like(want)
    assert maxpool2d(x, plan, out) is out
    assert_close(out, want, rtol=0, atol=0)


def random_attributes(rng):
    """A MaxPool configuration (every attribute) on a small random input."""
    k = [int(v) for v in rng.integers(1, 5, 2)]
    attrs = dict(kernel_shape=k, strides=[int(v) for v in rng.integers(1, 4, 2)])
    if rng.random() < 0.5:
        attrs["dilations"] = [int(v) for v in rng.integers(1, 4, 2)]
    attrs["ceil_mode"] = int(rng.integers(0, 2))
    mode = str(rng.choice(["NOTSET", "NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
    if mode == "NOTSET":
        attrs["pads"] = [int(rng.integers(0, k[i % 2])) for i in range(4)]
    else:
        attrs["auto_pad"] = mode
    return (1, 2, int(rng.integers(1, 10)), int(rng.integers(1, 10))), attrs


def test_random_configurations_match_onnxruntime_exactly():
    """Output sizes and values on 150 random configurations, tiny inputs included; where
    onnxruntime rejects a configuration, the kernel must refuse it too."""
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(150):
        shape, attrs = random_attributes(rng)
        x = rng.standard_normal(shape).astype(np.float32)
        try:
            (want,) = run_ort(pool_model(shape, attrs), {"x": x})
        except Exception:  # onnxruntime rejects it (negative SAME padding, empty output)
            want = None
        plan = prepare_maxpool(attrs["kernel_shape"], attrs["strides"],
                               attrs.get("pads", (0, 0, 0, 0)), attrs.get("dilations", (1, 1)),
                               attrs["ceil_mode"], attrs.get("auto_pad", "NOTSET"))  # fmt: skip
        if want is None or want.size == 0:
            with pytest.raises(ValueError):
                maxpool2d(x, plan)
            for block in BLOCKS:
                with pytest.raises(ValueError):
                    maxpool_blocked(to_blocked(x, block=block), plan)
            continue
        got = maxpool2d(x, plan)
        assert got.shape == want.shape, (shape, attrs)
        assert_close(got, want, rtol=0, atol=0, what=str((shape, attrs)))
        for block in BLOCKS:
            got = from_blocked(maxpool_blocked(to_blocked(x, block=block), plan), shape[1])
            assert_close(got, want, rtol=0, atol=0, what=f"block {block} {(shape, attrs)}")
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("channels", [5, 16, 20, 32])
def test_blocked_kernels_at_either_block(channels, block):
    """MaxPool and the head on blocks of 8 and 16 channels, with channel counts that fill whole
    blocks of both (32), of 8 only (16), and of neither (5, 20: a zero-padded last block)."""
    shape = (2, channels, 11, 12)
    x = np.random.default_rng(channels).standard_normal(shape).astype(np.float32)
    xb = to_blocked(x, block=block)
    padded = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    dilated = dict(kernel_shape=[3, 2], strides=[1, 2], dilations=[2, 1], ceil_mode=1)
    for attrs in (padded, dilated):
        (want,) = run_ort(pool_model(shape, attrs), {"x": x})
        plan = prepare_maxpool(attrs["kernel_shape"], attrs["strides"],
                               attrs.get("pads", (0, 0, 0, 0)), attrs.get("dilations", (1, 1)),
                               attrs.get("ceil_mode", 0))  # fmt: skip
        yb = maxpool_blocked(xb, plan)
        assert yb.shape == (*xb.shape[:2], *want.shape[2:], block)
        assert_close(from_blocked(yb, channels), want, rtol=0, atol=0, what=str(attrs))
    (want,) = run_ort(head_model(shape), {"x": x})
    assert_close(global_average_pool_blocked(xb, channels), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="blocked float32"):
        global_average_pool_blocked(xb, channels + block)  # one block more than x holds


def test_windows_without_nan_are_exact():
    """A NaN's fate differs between onnxruntime's own code paths (see kernels/pool.py); every
    window that holds none must still match, and inf is a value like any other."""
    shape, attrs = (2, 3, 11, 12), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.03] = np.nan
    x[rng.random(shape) < 0.03] = np.inf
    plan = prepare_maxpool((3, 3), (2, 2), pads=(1, 1, 1, 1))
    (want,) = run_ort(pool_model(shape, attrs), {"x": x})
    got = maxpool2d(x, plan)
    clean = maxpool2d(np.isnan(x).astype(np.float32), plan) == 0  # windows without a NaN
    assert clean.mean() > 0.5 and np.isinf(want[clean]).any()
    assert_close(got[clean], want[clean], rtol=0, atol=0)


def test_output_must_not_overlap_the_input():
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        maxpool2d(x, prepare_maxpool((1, 1)), out=x)


def explain_pool(model) -> str:
    return near_miss(model, "MaxPool2D", catalog=CATALOG)


def test_indices_output_in_use_is_not_fused():
    g = GraphBuilder()
    y, idx = g.node("MaxPool", ["x"], n_out=2, name="/pool", kernel_shape=[2, 2], strides=[2, 2])
    where = g.node("Cast", [idx], name="/cast", to=onnx.TensorProto.FLOAT)
    text = explain_pool(g.model({"x": [1, 2, 4, 4]}, [y, where]))
    assert f"its output {idx} is also used by Cast /cast" in text


def test_one_d_and_three_d_pools_are_not_fused():
    g = GraphBuilder()
    y = g.node("MaxPool", ["x"], name="/pool1d", kernel_shape=[2])
    text = explain_pool(g.model({"x": [1, 2, 8]}, [y]))
    assert "MaxPool /pool1d" in text and "rank 3" in text
    g = GraphBuilder()
    y = g.node("MaxPool", ["x"], name="/pool3d", kernel_shape=[2, 2, 2])
    text = explain_pool(g.model({"x": [1, 2, 4, 4, 4]}, [y]))
    assert "MaxPool /pool3d" in text and "rank 5" in text


def test_same_padding_with_a_kernel_smaller_than_the_stride_is_not_fused():
    g = GraphBuilder()
    y = g.node("MaxPool", ["x"], name="/pool", kernel_shape=[1, 1], strides=[2, 2],
               auto_pad="SAME_UPPER")  # fmt: skip
    text = explain_pool(g.model({"x": [1, 2, 5, 5]}, [y]))
    assert "MaxPool /pool: SAME padding with a kernel [1, 1] smaller than the stride" in text


def test_pads_not_smaller_than_the_kernel_are_not_fused():
    g = GraphBuilder()
    y = g.node("MaxPool", ["x"], name="/pool", kernel_shape=[2, 2], pads=[2, 0, 0, 0])
    text = explain_pool(g.model({"x": [1, 2, 5, 5]}, [y]))
    assert "MaxPool /pool: pads (2, 0, 0, 0) must be smaller than the kernel (2, 2)" in text


def test_integer_pool_is_not_fused():
    g = GraphBuilder()
    y = g.node("MaxPool", ["x"], name="/pool", kernel_shape=[2, 2])
    model = g.model({"x": [1, 2, 4, 4]}, [y], elem=onnx.TensorProto.UINT8)
    assert "MaxPool /pool" in explain_pool(model)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="smaller than the kernel"):
        prepare_maxpool((2, 2), pads=(2, 0, 0, 0))
    with pytest.raises(ValueError, match="float32"):
        maxpool2d(np.zeros((1, 1, 4, 4), np.float64), prepare_maxpool((2, 2)))
    with pytest.raises(ValueError, match="empty"):
        maxpool2d(np.zeros((1, 1, 2, 2), np.float32), prepare_maxpool((3, 3)))


# ---- GlobalAveragePool + Flatten -------------------------------------------------------------
def head_model(shape, axis=1):
    g = GraphBuilder()
    gap = g.node("GlobalAveragePool", ["x"], name="/gap")
    y = g.node("Flatten", [gap], name="/flat", axis=axis)
    return g.model({"x": list(shape)}, [y])


@pytest.mark.parametrize("tactic", ["blocked", "nchw"])
@pytest.mark.parametrize("shape", [(1, 1000, 13, 13), (3, 7, 5, 9), (2, 4, 1, 1), (1, 20, 7, 7)])
def test_classifier_head_fuses_and_matches_onnxruntime(shape, tactic):
    model = head_model(shape)
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ["GlobalAvgPoolFlatten"], result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 10
    (want,) = run_ort(model, {"x": x})
    session = Session(result.model, threads=2, fuse=False, catalog=CATALOG, tactics=tactic)
    assert list(session.choices.values()) == [tactic]
    (got,) = run_bound(session, {"x": x})
    assert got.shape == want.shape == shape[:2]
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_flatten_on_another_axis_is_not_fused():
    reason = "Flatten /flat: Flatten on axis 2; the head flattens from axis 1"
    near_miss(head_model((1, 4, 3, 3), axis=2), "GlobalAvgPoolFlatten", reason, catalog=CATALOG)


def test_pooled_value_used_elsewhere_is_not_fused():
    g = GraphBuilder()
    gap = g.node("GlobalAveragePool", ["x"], name="/gap")
    y = g.node("Flatten", [gap], name="/flat", axis=1)
    side = g.node("Neg", [gap], name="/side")
    model = g.model({"x": [1, 4, 3, 3]}, [y, side])
    reason = f"its output {gap} is also used by Neg /side"
    near_miss(model, "GlobalAvgPoolFlatten", reason, catalog=CATALOG)


# ---- AvgPool2D -------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_tiling_average_pool_fuses_and_runs(k):
    """DenseNet's transition pool (2x2 stride 2) and a 3x3 one; odd sizes drop the remainder."""
    for shape in [(1, 16, 8, 8), (2, 12, 7, 11)]:
        g = GraphBuilder()
        t = g.node("Relu", [g.node("Conv", ["x", g.weight(shape[1], shape[1], 1, 1)])])
        y = g.node("AveragePool", [t], kernel_shape=[k, k], strides=[k, k])
        model = g.model({"x": ["N", *shape[1:]]}, [y])
        result = fusion.rewrite(model)
        assert fused_ops(result.model) == ["ConvBiasRelu", "AvgPool2D"], result.explain()
        feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        (want,) = run_ort(model, feeds)
        for tactic in ("blocked", "nchw"):
            got = Session(result.model, threads=2, fuse=False, tactics=tactic).run(None, feeds)
            assert_close(got[0], want, 1e-6, 1e-6, what=f"{tactic} {shape}")


@pytest.mark.parametrize("block", [None, 8, 16])  # NCHW, then both SIMD widths' blocks
@pytest.mark.parametrize(("kh", "kw"), [(2, 3), (3, 1), (1, 1)])
def test_tiled_average_pool_kernel_on_rectangular_windows(kh, kw, block):
    from fusion_kernels.blocked import from_blocked, to_blocked
    from fusion_kernels.pool import tiled_average_pool

    x = np.random.default_rng(1).standard_normal((2, 19, 8, 10)).astype(np.float32)
    oh, ow = 8 // kh, 10 // kw
    want = x[:, :, : oh * kh, : ow * kw].reshape(2, 19, oh, kh, ow, kw).mean(axis=(3, 5))
    if block is None:
        got = tiled_average_pool(x, kh, kw)
    else:
        got = from_blocked(tiled_average_pool(to_blocked(x, block=block), kh, kw), 19)
    assert_close(got, want.astype(np.float32), 1e-6, 1e-6)


def test_overlapping_or_padded_average_pool_is_declined():
    g = GraphBuilder()
    y = g.node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1],
               name="/avg")  # fmt: skip
    reason = "windows [3, 3], strides [1, 1], pads [1, 1, 1, 1] (NOTSET): the kernel takes"
    near_miss(g.model({"x": [1, 4, 6, 6]}, [y]), "AvgPool2D", reason)


def test_convs_pools_and_the_head_stay_blocked_between_kernels():
    # conv -> MaxPool -> conv -> GlobalAveragePool + Flatten: one conversion in, none after
    g = GraphBuilder()
    y = conv_block(g, "x", 5, 20, pads=[1, 1, 1, 1])
    y = g.node("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    y = conv_block(g, y, 20, 12, pads=[1, 1, 1, 1])
    y = g.node("Flatten", [g.node("GlobalAveragePool", [y])], axis=1)
    model = g.model({"x": [2, 5, 15, 15]}, [y])
    session = Session(model, threads=2, catalog=CATALOG, tactics="kernel")
    assert [s.kind for s in session.steps] == ["convert"] + ["kernel"] * 4
    assert all(c.startswith("blocked") for c in session.choices.values()), session.choices
    x = np.random.default_rng(5).standard_normal((2, 5, 15, 15)).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    (got,) = session.run(None, {"x": x})
    assert_close(got, want, rtol=1e-4, atol=1e-5)
