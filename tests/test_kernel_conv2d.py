"""kernels.conv2d against two oracles: a naive float64 NumPy convolution written here, and
onnxruntime running a one-node Conv (+ Relu / Clip) model.

Tolerance: rtol = atol = 1e-4 on outputs of order 1 (weights are scaled by 1/sqrt(K)). A float32
sum of K <= 1000 products is off by ~sqrt(K) * 6e-8 * |y| ~ 2e-6 |y|, and Winograd adds a few
ulps more, so 1e-4 has margin against noise while any indexing or padding bug (an O(1) error)
still fails.
"""

import math

import numpy as np
import onnx
import pytest
from helpers import assert_close, naive_conv, run_ort
from onnx import TensorProto, helper, numpy_helper

from fusion_kernels import conv2d_bias_act, get_threads, output_shape, prepare_conv2d
from fusion_kernels.conv2d import launch

RTOL = ATOL = 1e-4
CLIP = (-0.5, 0.75)


def ort_conv(x, w, b, attrs, activation):
    """onnxruntime on Conv [+ Relu | Clip], optimizations disabled (the unfused graph)."""
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if b is not None:
        inits.append(numpy_helper.from_array(b.reshape(-1), "b"))
        inputs.append("b")
    nodes = [helper.make_node("Conv", inputs, ["y" if activation is None else "c"], **attrs)]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    elif activation == "clip":
        inits += [
            numpy_helper.from_array(np.float32(v), k)
            for k, v in zip(("lo", "hi"), CLIP, strict=True)
        ]
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return run_ort(model, {"x": x})[0]


P0, P1, S1, S2, NO = (0,) * 4, (1,) * 4, (1, 1), (2, 2), "NOTSET"
# (N, C, H, W, M, kh, kw, strides, pads, dilations, group, auto_pad, bias, activation)
CASES = {
    "odd_stride2_dil2": (1, 3, 7, 9, 5, 3, 3, S2, (2, 1, 0, 3), S2, 1, NO, True, None),
    "pad_gt_kernel": (1, 4, 5, 5, 6, 2, 2, S1, (3, 4, 3, 2), S1, 1, NO, True, "relu"),
    "1x1_batch2": (2, 16, 9, 7, 24, 1, 1, S1, P0, S1, 1, NO, True, "clip"),
    "7x7_stride2": (1, 3, 17, 15, 8, 7, 7, S2, (3, 3, 3, 3), S1, 1, NO, True, "relu"),
    "panel_blocks": (1, 3, 41, 40, 8, 3, 3, S2, P1, S1, 1, NO, True, "relu"),  # 2+ panels/item
    "1x1_big_weights": (1, 300, 9, 9, 240, 1, 1, S1, P0, S1, 1, NO, True, "relu"),  # blocks
    # weights past L2, pixel blocks that 2 threads cannot share evenly: a 1x1 conv splits by
    # channel ranges (63 panels: 32 + 31, the last partial); a gathered 3x3 does not
    "1x1_classifier_like": (1, 300, 13, 13, 250, 1, 1, S1, P0, S1, 1, NO, True, "relu"),
    "3x3_s2_big_weights": (1, 64, 19, 19, 301, 3, 3, S2, P1, S1, 1, NO, True, None),
    "1x1_direct_odd": (2, 24, 7, 5, 20, 1, 1, S1, P0, S1, 2, NO, True, None),  # group 2
    "rect_aniso": (1, 5, 11, 10, 7, 3, 2, (1, 2), (1, 0, 2, 1), (2, 1), 1, NO, False, None),
    "group2": (1, 8, 10, 10, 6, 3, 3, S1, P1, S1, 2, NO, True, "relu"),
    "group32": (1, 64, 9, 9, 64, 3, 3, S1, P1, S1, 32, NO, True, "clip"),
    "depthwise_s2": (2, 16, 12, 12, 16, 3, 3, S2, P1, S1, 16, NO, True, None),
    "depthwise_dil2": (1, 8, 11, 9, 8, 3, 3, S1, (2, 2, 2, 2), S2, 8, NO, False, "relu"),
    "depthwise_5x3_s12": (2, 6, 9, 13, 6, 5, 3, (1, 2), (0, 3, 4, 1), S1, 6, NO, True, "clip"),
    "depthwise_pad_gt": (1, 4, 3, 4, 4, 2, 2, (3, 2), (4, 1, 5, 6), (1, 3), 4, NO, True, None),
    "depthwise_x2": (1, 4, 8, 8, 8, 3, 3, S1, P1, S1, 4, NO, True, "relu"),  # multiplier 2
    "wino_batch3": (3, 16, 13, 11, 18, 3, 3, S1, P1, S1, 1, NO, True, "relu"),
    "wino_nopad_odd": (1, 8, 9, 12, 8, 3, 3, S1, P0, S1, 1, NO, False, None),
    "wino_bigpad": (1, 12, 6, 5, 10, 3, 3, S1, (3, 2, 4, 5), S1, 1, NO, True, "clip"),
    "wino_64ch_56": (1, 64, 56, 56, 64, 3, 3, S1, P1, S1, 1, NO, True, "relu"),
    "wino_13x13_m_split": (1, 32, 13, 13, 40, 3, 3, S1, P1, S1, 1, NO, True, "relu"),
    "wino2_264ch": (2, 264, 7, 9, 12, 3, 3, S1, P1, S1, 1, NO, True, "relu"),
    "wino2_264ch_nopad": (1, 264, 6, 5, 9, 3, 3, S1, P0, S1, 1, NO, False, "clip"),
    "valid": (1, 3, 10, 11, 4, 3, 3, S2, P0, S1, 1, "VALID", True, None),
    "same_upper_s2": (1, 3, 10, 11, 4, 3, 3, S2, P0, S1, 1, "SAME_UPPER", True, None),
    "same_lower_s2": (1, 3, 10, 11, 4, 4, 4, S2, P0, S1, 1, "SAME_LOWER", True, None),
    "same_upper_wino": (2, 8, 7, 6, 8, 3, 3, S1, P0, S1, 1, "SAME_UPPER", True, "relu"),
    "same_lower_dil": (1, 4, 9, 8, 4, 2, 3, S1, P0, (2, 1), 1, "SAME_LOWER", False, "clip"),
}  # fmt: skip


def make_case(case, seed=0):
    n, c, h, w, m, kh, kw, strides, pads, dils, group, auto_pad, has_bias, act = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    k = c // group * kh * kw
    wt = (rng.standard_normal((m, c // group, kh, kw)) / math.sqrt(k)).astype(np.float32)
    b = rng.standard_normal((1, m, 1, 1)).astype(np.float32) * 0.5 if has_bias else None
    kwargs = dict(strides=strides, dilations=dils, group=group, auto_pad=auto_pad, activation=act)
    if auto_pad == "NOTSET":
        kwargs["pads"] = pads
    if act == "clip":
        kwargs["clip_min"], kwargs["clip_max"] = CLIP
    return x, wt, b, kwargs


def onnx_attrs(wt, kwargs):
    attrs = dict(
        kernel_shape=list(wt.shape[2:]),
        strides=list(kwargs["strides"]),
        dilations=list(kwargs["dilations"]),
        group=kwargs["group"],
    )
    if kwargs["auto_pad"] == "NOTSET":
        attrs["pads"] = list(kwargs["pads"])
    else:
        attrs["auto_pad"] = kwargs["auto_pad"]
    return attrs


@pytest.mark.parametrize("name", list(CASES))
def test_conv_matches_naive_and_onnxruntime(name):
    x, wt, b, kwargs = make_case(CASES[name])
    plan = prepare_conv2d(wt, b, **kwargs)
    got = conv2d_bias_act(x, plan)
    _, pads = output_shape(x.shape, plan)
    lo, hi = {None: (-math.inf, math.inf), "relu": (0, math.inf), "clip": CLIP}[
        kwargs["activation"]
    ]
    want = naive_conv(
        x, wt, b, kwargs["strides"], pads, kwargs["dilations"], kwargs["group"], lo, hi
    )
    assert_close(got, want, rtol=RTOL, atol=ATOL, check_dtype=False)
    if kwargs["auto_pad"].startswith("SAME") and kwargs["dilations"] != (1, 1):
        return  # onnxruntime rejects dilation with SAME_*; the ONNX formula is checked above
    ort_y = ort_conv(x, wt, b, onnx_attrs(wt, kwargs), kwargs["activation"])
    assert got.shape == ort_y.shape
    assert_close(got, ort_y, rtol=RTOL, atol=ATOL)


WINO = [name for name in CASES if name.startswith(("wino", "same_upper_wino"))]


@pytest.mark.parametrize("name", WINO)
def test_winograd_f4_matches_naive_and_onnxruntime(name):
    """F(4x4, 3x3), opt-in: ~10x the rounding error of F(2x2), still far inside 1e-4."""
    x, wt, b, kwargs = make_case(CASES[name])
    plan = prepare_conv2d(wt, b, winograd_tile=4, **kwargs)
    assert plan.method == ("winograd" if x.shape[1] > 256 else "winograd4")
    got = conv2d_bias_act(x, plan)
    _, pads = output_shape(x.shape, plan)
    lo, hi = {None: (-math.inf, math.inf), "relu": (0, math.inf), "clip": CLIP}[
        kwargs["activation"]
    ]
    want = naive_conv(x, wt, b, (1, 1), pads, (1, 1), 1, lo, hi)
    assert_close(got, want, rtol=RTOL, atol=ATOL, check_dtype=False)
    ort_y = ort_conv(x, wt, b, onnx_attrs(wt, kwargs), kwargs["activation"])
    assert_close(got, ort_y, rtol=RTOL, atol=ATOL)


def test_plan_picks_winograd_only_where_it_applies():
    w64 = make_case(CASES["wino_64ch_56"])[1]
    assert prepare_conv2d(w64, pads=(1,) * 4).method == "winograd"
    assert prepare_conv2d(w64, pads=(1,) * 4, winograd_tile=4).method == "winograd4"
    w264 = make_case(CASES["wino2_264ch"])[1]
    assert prepare_conv2d(w264, pads=(1,) * 4, winograd_tile=4).method == "winograd"
    for name in ("odd_stride2_dil2", "group32", "1x1_batch2", "depthwise_x2"):
        x, wt, b, kwargs = make_case(CASES[name])
        assert prepare_conv2d(wt, b, **kwargs).method == "im2col", name
    for name in ("depthwise_s2", "depthwise_dil2"):
        x, wt, b, kwargs = make_case(CASES[name])
        assert prepare_conv2d(wt, b, **kwargs).method == "depthwise", name


@pytest.mark.parametrize("name", ["wino_batch3", "wino2_264ch", "odd_stride2_dil2", "group2"])
def test_out_channel_slice_of_concat_buffer(name):
    """Two branches written straight into one [N, Mtotal, OH, OW] buffer (a Fire-module concat)."""
    x, wt, b, kwargs = make_case(CASES[name])
    plan = prepare_conv2d(wt, b, **kwargs)
    (n, m, oh, ow), pads = output_shape(x.shape, plan)
    buf = np.full((n, m + 11, oh, ow), 7.0, np.float32)
    view = buf[:, 5 : 5 + m]
    assert conv2d_bias_act(x, plan, out=view) is view
    lo, hi = {None: (-math.inf, math.inf), "relu": (0, math.inf), "clip": CLIP}[
        kwargs["activation"]
    ]
    want = naive_conv(
        x, wt, b, kwargs["strides"], pads, kwargs["dilations"], kwargs["group"], lo, hi
    )
    assert_close(buf[:, 5 : 5 + m], want, rtol=RTOL, atol=ATOL, check_dtype=False)
    assert (buf[:, :5] == 7.0).all() and (buf[:, 5 + m :] == 7.0).all()


def test_preallocated_out_and_bias_shapes():
    x, wt, _, kwargs = make_case(CASES["group2"])
    bias = np.arange(6, dtype=np.float32)
    ref = conv2d_bias_act(x, prepare_conv2d(wt, bias, **kwargs))
    for b in (bias.reshape(6, 1, 1), bias.reshape(1, 6, 1, 1)):
        out = np.empty_like(ref)
        assert conv2d_bias_act(x, prepare_conv2d(wt, b, **kwargs), out=out) is out
        assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["7x7_stride2", "wino_64ch_56", "wino2_264ch", "depthwise_s2"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("tile", [2, 4])
def test_nan_and_inf_propagate_like_onnxruntime(case, bad, tile):
    """Only the outputs whose window holds the bad input are affected, on every path
    (Winograd would spread it over its whole tile, so such inputs take the im2col path)."""
    x, wt, b, kwargs = make_case(CASES[case])
    x[0, 1, 4, 6] = bad
    got = conv2d_bias_act(x, prepare_conv2d(wt, b, winograd_tile=tile, **kwargs))
    want = ort_conv(x, wt, b, onnx_attrs(wt, kwargs), kwargs["activation"])
    assert not np.isfinite(got).all()
    assert_close(got, want, rtol=RTOL, atol=ATOL)  # NaN matches NaN


W3 = np.ones((4, 2, 3, 3), np.float32)
X = np.ones((1, 2, 5, 5), np.float32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: conv2d_bias_act(X.astype(np.float64), prepare_conv2d(W3)), "float32"),
        (lambda: conv2d_bias_act(X[0], prepare_conv2d(W3)), "4-D"),
        (lambda: conv2d_bias_act(np.ones((1, 3, 5, 5), np.float32), prepare_conv2d(W3)),
         "channels"),
        (lambda: conv2d_bias_act(np.ones((1, 2, 5, 10), np.float32)[..., ::2], prepare_conv2d(W3)),
         "C-contiguous"),
        (lambda: conv2d_bias_act(X, prepare_conv2d(W3), out=np.empty((1, 4, 5, 5), np.float32)),
         "shape"),
        (lambda: conv2d_bias_act(X, prepare_conv2d(W3), out=np.empty((1, 4, 3, 3))), "float32"),
        (lambda: conv2d_bias_act(X, prepare_conv2d(W3),
                                 out=np.empty((1, 4, 3, 6), np.float32)[..., ::2]), "contiguous"),
        (lambda: conv2d_bias_act(X[:, :, :2, :2].copy(), prepare_conv2d(W3)), "empty"),
        (lambda: prepare_conv2d(W3.astype(np.float64)), "float32"),
        (lambda: prepare_conv2d(W3[0]), "float32 array"),
        (lambda: prepare_conv2d(W3, np.ones(3, np.float32)), "bias"),
        (lambda: prepare_conv2d(W3, group=3), "group"),
        (lambda: prepare_conv2d(W3, strides=(0, 1)), "strides"),
        (lambda: prepare_conv2d(W3, pads=(1, 1)), "pads"),
        (lambda: prepare_conv2d(W3, auto_pad="SAME"), "auto_pad"),
        (lambda: prepare_conv2d(W3, activation="gelu"), "activation"),
        (lambda: prepare_conv2d(W3, winograd_tile=3), "winograd_tile"),
        (lambda: prepare_conv2d(W3, activation="clip", clip_min=1.0, clip_max=0.0), "clip_min"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_channel_split_only_where_it_pays():
    """A classifier-like 1x1 conv (weights past L2) over 5 pixel panels, which 2 threads cannot
    share evenly, takes the channel split (see conv2d._launch); a 3x3 im2col with weights past
    L2, or a 1x1 with few channel panels, does not."""

    def n_ms(name, x_shape=None):
        x, wt, b, kwargs = make_case(CASES[name])
        return launch(prepare_conv2d(wt, b, **kwargs), x_shape or x.shape)[2][-2]

    plan = prepare_conv2d(np.zeros((250, 300, 1, 1), np.float32))
    five_panels = (1, 300, 5, plan.tile.cols * plan.lanes.width)
    assert n_ms("1x1_classifier_like", five_panels) == get_threads()  # (1 thread: no split)
    assert n_ms("3x3_s2_big_weights") == 1
    few = prepare_conv2d(np.zeros((12, 3000, 1, 1), np.float32))  # 3 channel panels
    assert launch(few, (1, 3000, 13, 13))[2][-2] == 1


def test_a_replaced_plan_does_not_reuse_the_old_launch_arguments():
    import dataclasses
    import math

    x = np.random.default_rng(0).standard_normal((1, 4, 6, 6)).astype(np.float32)
    relu = prepare_conv2d(np.ones((3, 4, 1, 1), np.float32), activation="relu")
    assert conv2d_bias_act(x, relu).min() >= 0  # caches launch arguments (lo = 0) on the plan
    plain = dataclasses.replace(relu, clip=(np.float32(-math.inf), np.float32(math.inf)))
    assert conv2d_bias_act(x, plain).min() < 0
