"""kernels.conv_nchwc (the blocked direct conv with its fused epilogue) and kernels.blocked (the
layout conversions), against onnxruntime running the unfused Conv [+ Add] [+ activation] graph.

Odd shapes on purpose: channel counts that are not multiples of a block (1, 3, 5, 17, 20, 100),
images of width 1, 7, 13, 17, 56, asymmetric pads, pads wider than the kernel, dilations,
strides, groups of whole blocks, batch 2, and every epilogue (activations, a residual before or
after). Every case runs at both blocks, 8 and 16 channels (the SIMD width the kernel computes
at: 16-lane code runs on AVX2 too, as pairs of registers), and the register tiles of both
register files (AVX2's 16, AVX-512's 32). The tolerance is the rules' (1e-4 relative plus 1e-5
absolute) on outputs of order 1.
"""

import itertools
import math

import numba
import numpy as np
import pytest
from helpers import assert_close, run_ort
from onnx import TensorProto, helper, numpy_helper

import fusion_kernels._blocked_geometry as geo
import fusion_kernels.conv_nchwc as conv_module
from fusion_kernels.blocked import block_size, from_blocked, to_blocked
from fusion_kernels.config import get_threads, set_threads
from fusion_kernels.conv_nchwc import (
    _busiest_rows,
    band_rows,
    conv_nchwc,
    output_shape,
    prepare_conv_nchwc,
    supports,
    tile_blocks,
    tile_options,
    tile_rows,
)
from fusion_kernels.simd import width
from fusion_patterns.conv import RESIDUAL_SLOT as RESIDUAL

RTOL, ATOL = 1e-4, 1e-5
BLOCKS = (8, 16)
DEPTHWISE_BLOCKS = BLOCKS  # the depthwise kernel runs at its Lanes' width too

node = helper.make_node
# activation name -> ONNX nodes applying it to "t", writing "a" (and its kernel parameters)
ACTS = {
    None: ([], {}),
    "relu": ([node("Relu", ["t"], ["a"])], {}),
    "clip": ([node("Clip", ["t", "lo", "hi"], ["a"])], {"clip_min": -0.5, "clip_max": 0.75}),
    "leaky_relu": ([node("LeakyRelu", ["t"], ["a"], alpha=0.1)], {"alpha": 0.1}),
    "sigmoid": ([node("Sigmoid", ["t"], ["a"])], {}),
    "silu": ([node("Sigmoid", ["t"], ["s"]), node("Mul", ["t", "s"], ["a"])], {}),
    "hard_sigmoid": (
        [node("HardSigmoid", ["t"], ["a"], alpha=0.3, beta=0.4)],
        {"alpha": 0.3, "beta": 0.4},
    ),
    "hard_swish": ([node("HardSwish", ["t"], ["a"])], {}),
    "tanh": ([node("Tanh", ["t"], ["a"])], {}),
    "gelu": (
        [
            node("Div", ["t", "sqrt2"], ["d"]),
            node("Erf", ["d"], ["e"]),
            node("Add", ["e", "one"], ["e1"]),
            node("Mul", ["t", "e1"], ["m"]),
            node("Mul", ["m", "half"], ["a"]),
        ],
        {},
    ),
}


def reference(x, w, b, attrs, activation=None, residual=None, r=None):
    """onnxruntime on Conv, then Add(r) before or after the activation, as the graph says."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs)]
    value = "c"
    if residual == "before":
        nodes.append(helper.make_node("Add", [value, "r"], ["cr"]))
        value = "cr"
    nodes.append(helper.make_node("Identity", [value], ["t"]))
    act_nodes, _ = ACTS[activation]
    nodes += act_nodes if act_nodes else [helper.make_node("Identity", ["t"], ["a"])]
    out = "a"
    if residual == "after":
        nodes.append(helper.make_node("Add", ["a", "r"], ["y"]))
        out = "y"
    f32 = np.float32
    consts = {"w": w, "b": b, "lo": f32(-0.5), "hi": f32(0.75), "sqrt2": f32(np.sqrt(2)),
              "one": f32(1), "half": f32(0.5)}  # fmt: skip
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))]
    feeds = {"x": x}
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, list(r.shape)))
        feeds["r"] = r
    graph = helper.make_graph(
        nodes, "conv", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return run_ort(model, feeds)[0]


def run_blocked(x, w, b, attrs, activation=None, residual=None, r=None, tile=None, block=None):
    group = attrs.get("group", 1)
    plan = prepare_conv_nchwc(
        w, b, strides=attrs.get("strides", (1, 1)), pads=attrs.get("pads", (0, 0, 0, 0)),
        dilations=attrs.get("dilations", (1, 1)), group=group, activation=activation,
        residual=residual, tile=tile, block=block, **ACTS[activation][1],
    )  # fmt: skip
    assert plan.block == (width() if block is None else block)
    xb = to_blocked(x, block=plan.in_block)
    rb = to_blocked(r, block=plan.block) if residual else None
    yb = conv_nchwc(xb, plan, residual=rb)
    assert yb.shape == output_shape(xb.shape, plan)
    assert yb.shape[-1] == plan.block and yb.shape[1] == -(-w.shape[0] // plan.block)
    return from_blocked(yb, w.shape[0])


def case(n, c, m, h, w, k, seed=0, group=1, **attrs):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    kh, kw = (k, k) if isinstance(k, int) else k
    wt = rng.standard_normal((m, c // group, kh, kw), dtype=np.float32)
    wt /= np.sqrt(c // group * kh * kw)
    b = rng.standard_normal(m, dtype=np.float32)
    return x, wt, b, {"group": group, **attrs}


SHAPES = [
    # n, c, m, h, w, kernel, attrs
    (1, 3, 8, 13, 17, 3, {"pads": (1, 1, 1, 1)}),
    (2, 5, 17, 7, 7, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    (1, 16, 24, 9, 11, 5, {"pads": (2, 2, 2, 2)}),
    (1, 64, 64, 14, 14, 3, {"pads": (1, 1, 1, 1)}),
    (1, 17, 100, 1, 13, 1, {}),
    (3, 8, 8, 1, 1, 1, {}),
    (1, 3, 64, 23, 23, 7, {"strides": (2, 2), "pads": (3, 3, 3, 3)}),
    (1, 32, 16, 10, 10, 3, {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
    (1, 64, 64, 8, 8, 3, {"pads": (1, 1, 1, 1), "group": 8}),
    (1, 48, 48, 9, 9, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1), "group": 2}),
    (1, 128, 256, 7, 7, 3, {"pads": (1, 1, 1, 1)}),
    (1, 1, 8, 5, 40, 1, {}),
    (2, 96, 32, 6, 30, 1, {"strides": (2, 2)}),
    (1, 24, 24, 12, 12, 3, {"pads": (1, 1, 1, 1), "group": 3}),
    (1, 16, 16, 3, 3, 5, {"pads": (4, 4, 4, 4)}),
    (1, 17, 9, 13, 7, (1, 3), {"pads": (0, 2, 0, 1)}),  # asymmetric pads, a 1x3 kernel
    (1, 12, 40, 1, 17, (1, 5), {"pads": (0, 2, 0, 2)}),  # a Conv1d written as H = 1
    (2, 100, 8, 17, 1, 3, {"pads": (1, 1, 1, 1)}),  # width 1
    (1, 20, 24, 6, 56, 3, {"pads": (1, 1, 1, 1)}),  # width 56: a ResNet row
    (1, 20, 24, 9, 7, 3, {"pads": (1, 1, 1, 1), "dilations": (1, 2)}),  # 5 wide: 1 interior
    (1, 32, 32, 8, 8, 3, {"pads": (1, 1, 1, 1), "group": 2}),  # groups of 16 channels
    # depthwise (group == C == M): its own kernel
    (1, 20, 20, 13, 13, 3, {"pads": (1, 1, 1, 1), "group": 20}),
    (2, 32, 32, 17, 17, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1), "group": 32}),
    (1, 5, 5, 7, 30, 5, {"pads": (2, 2, 2, 2), "group": 5}),
    (1, 16, 16, 9, 9, 5, {"strides": (2, 2), "pads": (2, 1, 2, 3), "group": 16}),
    (1, 8, 8, 10, 10, 3, {"pads": (2, 2, 2, 2), "dilations": (2, 2), "group": 8}),
    (1, 24, 24, 1, 1, 3, {"pads": (1, 1, 1, 1), "group": 24}),
]


def blocks_of(shape):
    """The blocks a case runs at: both, and the depthwise kernel's (see DEPTHWISE_BLOCKS)."""
    n, c, m, _, _, _, attrs = shape
    group = attrs.get("group", 1)
    return DEPTHWISE_BLOCKS if group > 1 and group == c == m else BLOCKS


@pytest.mark.parametrize(
    ("shape", "block"),
    [(s, b) for s in SHAPES for b in blocks_of(s)],
    ids=lambda v: f"{v[:6]}{v[6]}" if isinstance(v, tuple) else f"b{v}",
)
def test_against_onnxruntime(shape, block):
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, **attrs)
    if supports(wt.shape, attrs["group"], block):  # groups of 8 channels: not whole 16s
        pytest.skip(supports(wt.shape, attrs["group"], block))
    got = run_blocked(x, wt, b, attrs, "relu", block=block)
    assert_close(got, reference(x, wt, b, attrs, "relu"), RTOL, ATOL)


NCHW_IN = [s for s in SHAPES if s[6].get("group", 1) == 1][:8] + [
    (2, 3, 24, 30, 31, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1)}),  # a stem, odd width
]


@pytest.mark.parametrize("residual", [None, "after"])
@pytest.mark.parametrize(
    ("shape", "block"), [(s, b) for s in NCHW_IN for b in BLOCKS],
    ids=lambda v: f"{v[:6]}{v[6]}" if isinstance(v, tuple) else f"b{v}",
)  # fmt: skip
def test_nchw_input_read_as_blocks_of_one(shape, block, residual):
    """in_block=1: the NCHW array itself, reshaped to [N, C, H, W, 1] (a stem's image read
    without a conversion), against onnxruntime."""
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, **attrs)
    plan = prepare_conv_nchwc(
        wt, b, strides=attrs.get("strides", (1, 1)), pads=attrs.get("pads", (0, 0, 0, 0)),
        dilations=attrs.get("dilations", (1, 1)), activation="relu", residual=residual,
        block=block, in_block=1,
    )  # fmt: skip
    r = np.random.default_rng(1).standard_normal(reference(x, wt, b, attrs).shape)
    r = r.astype(np.float32)
    rb = to_blocked(r, block=block) if residual else None
    got = from_blocked(conv_nchwc(x.reshape(*x.shape, 1), plan, residual=rb), m)
    assert_close(got, reference(x, wt, b, attrs, "relu", residual, r), RTOL, ATOL)


def test_small_c_tiles_take_their_pixel_step_as_a_constant():
    """A small-C conv's row tiles are compiled with the pixel step (SW BI floats) in their code
    (_direct_blocked.tile_item's step: 16 pixel pointers spilled otherwise); whole blocks keep
    the geometry's."""
    x, wt, b, _ = case(1, 3, 16, 20, 20, 3)
    for in_block, stride, step in ((1, 2, 2), (1, 1, 1), (None, 2, 6)):
        plan = prepare_conv_nchwc(wt, b, strides=(stride, stride), pads=(1, 1, 1, 1),
                                  block=16, in_block=in_block)  # fmt: skip
        xb = x.reshape(*x.shape, 1) if in_block == 1 else to_blocked(x, block=plan.in_block)
        conv_nchwc(xb, plan)
        (launch,) = plan.geometry.values()
        assert launch.head[1].dispatcher.py_func.__name__.endswith(f"_s{step}")
    wide = case(1, 16, 16, 9, 9, 3)[1]
    plan = prepare_conv_nchwc(wide, None, pads=(1, 1, 1, 1), block=16)
    conv_nchwc(to_blocked(case(1, 16, 16, 9, 9, 3)[0], block=16), plan)
    (launch,) = plan.geometry.values()
    assert "_s" not in launch.head[1].dispatcher.py_func.__name__


@pytest.mark.parametrize("residual", [None, "after"])
def test_a_stem_offers_a_tactic_reading_nchw(residual):
    """A conv on fewer channels than a block offers the direct kernel on its NCHW input (no
    input conversion: blocked_inputs holds the residual alone), equal to the NCHW kernel; a
    wider one does not."""
    from fusion_patterns.conv import ConvKernel

    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1,
             "auto_pad": "NOTSET", "activation": "relu", "residual": residual}  # fmt: skip
    x, wt, b, _ = case(2, 3, 24, 17, 20, 3)
    kernel = ConvKernel(attrs, wt, b, 4)
    stems = [t for t in kernel.tactics if t.name.endswith("-nchw-in")]
    assert len(stems) == 1 and stems[0].blocked_outputs == (0,)
    assert stems[0].blocked_inputs == ((RESIDUAL,) if residual else ())
    r = np.random.default_rng(2).standard_normal((2, 24, 9, 10)).astype(np.float32)
    args = [x] + [None] * (RESIDUAL - 1) + [r] if residual else [x]
    want = kernel(*args)[0]
    if residual:
        args[RESIDUAL] = to_blocked(r, block=stems[0].in_blocks[0])
    assert_close(from_blocked(stems[0].run(*args)[0], 24), want, RTOL, ATOL)
    _, wide, b, _ = case(1, 32, 24, 5, 5, 3)
    assert not [t for t in ConvKernel(attrs, wide, b, 4).tactics if t.name.endswith("-nchw-in")]


def test_blocks_of_one_only_for_whole_convs():
    x, wt, b, attrs = case(1, 32, 32, 5, 5, 3, group=2)
    with pytest.raises(ValueError, match="in_block must be"):
        prepare_conv_nchwc(wt, b, group=2, in_block=1, block=16)


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("residual", [None, "before", "after"])
@pytest.mark.parametrize(
    ("depthwise", "block"),
    [(False, b) for b in BLOCKS] + [(True, b) for b in DEPTHWISE_BLOCKS],
    ids=lambda v: ("depthwise" if v else "direct") if isinstance(v, bool) else f"b{v}",
)
def test_every_epilogue(activation, residual, depthwise, block):
    c, group = (20, 20) if depthwise else (12, 1)
    x, wt, b, attrs = case(2, c, 20, 9, 7, 3, seed=3, group=group, pads=(1, 1, 1, 1))
    r = np.random.default_rng(4).standard_normal((2, 20, 9, 7), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, activation, residual, r, block=block)
    assert_close(got, reference(x, wt, b, attrs, activation, residual, r), RTOL, ATOL)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("width", [6, 7, 9])
def test_k_cut_into_chunks_when_weights_pass_half_of_l2(width, block):
    # 512 input channels, 3x3, filter groups of 4 output blocks at 8 lanes (5 blocks) or of 3
    # at 16: 590 or 885 KB of packed weights per filter group, past half of a 1 MB L2, so K is
    # cut into chunks and the accumulators wait in the per-item buffer; widths 6 and 7 leave
    # an interior remainder (an overlapping tile), 9 none at 7 pixels.
    x, wt, b, attrs = case(1, 512, 40, 5, width, 3, seed=5, pads=(1, 1, 1, 1))
    fb = min(4, -(-40 // block))
    if 512 * 9 * fb * block * 4 <= conv_module._budgets()[0]:
        pytest.skip("an L2 this large holds these weights: K is not cut (see the next test)")
    r = np.random.default_rng(8).standard_normal((1, 40, 5, width), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, "silu", "before", r, tile=fb, block=block)
    assert_close(got, reference(x, wt, b, attrs, "silu", "before", r), RTOL, ATOL)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(("n", "c", "m", "h", "w"), [(1, 24, 40, 7, 9), (2, 100, 16, 1, 13),
                                                     (1, 20, 24, 56, 56)])  # fmt: skip
def test_a_last_block_of_at_most_half_its_channels_runs_half_the_channel_loop(n, c, m, h, w, block):
    """A dense conv whose last input block holds at most block / 2 channels (24 at 16 lanes,
    20 at 8 or 16) runs that block's taps on its first half only (geometry HALF): the other
    half is never read. Set to NaN in x, it must not reach the output of a 1x1 conv (whose
    pixels all run in row tiles); read, it would."""
    x, wt, b, attrs = case(n, c, m, h, w, 1, seed=11)
    plan = prepare_conv_nchwc(wt, b, activation="relu", block=block)
    xb = to_blocked(x, block=plan.in_block)
    tail = c % block
    assert conv_module.geometry(plan, xb.shape, 1)[geo.HALF] == (0 < tail <= block // 2)
    if not 0 < tail <= block // 2:
        pytest.skip(f"{c} channels fill more than half of their last block of {block}")
    xb[:, -1, ..., block // 2 :] = np.nan
    got = from_blocked(conv_nchwc(xb, plan), m)
    assert_close(got, reference(x, wt, b, attrs, "relu"), RTOL, ATOL)


def test_half_blocks_only_where_a_block_s_lanes_are_one_group_s():
    """HALF is set for dense convs only: a grouped or depthwise conv's blocks, a narrow stem's
    planes (in_block = C) keep the whole loop."""
    for wshape, group, want in (((40, 24, 1, 1), 1, 1), ((40, 28, 1, 1), 1, 0),
                                ((40, 4, 3, 3), 10, 0), ((24, 1, 3, 3), 24, 0),
                                ((16, 3, 3, 3), 1, 0)):  # fmt: skip
        plan = prepare_conv_nchwc(np.ones(wshape, np.float32), group=group, block=16)
        c = wshape[1] * group
        xb = to_blocked(np.ones((1, c, 5, 5), np.float32), block=plan.in_block)
        assert conv_module.geometry(plan, xb.shape, 1)[geo.HALF] == want, (wshape, group)


CHUNK_CASES = [
    # (tile at 8 lanes, at 16), (n, c, m, h, w, kernel, attrs): widths of the output
    (((3, 4), (6, 4)), (1, 32, 40, 5, 13, 3, {"pads": (1, 1, 1, 1)})),
    (((3, 4), (6, 4)), (1, 32, 40, 5, 16, 3, {"pads": (1, 1, 1, 1)})),  # half-height tails
    (((14, 1), (30, 1)), (1, 32, 16, 4, 65, 3, {"pads": (1, 1, 1, 1), "strides": (1, 2)})),
    ((2, 2), (2, 20, 24, 3, 7, 1, {})),  # 6x2 and 2x2, or narrower
]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(("tiles", "shape"), CHUNK_CASES, ids=str)
def test_k_in_chunks_of_one_block_for_every_tile(monkeypatch, block, tiles, shape):
    # A budget of one input block's weights per chunk: every chunk boundary parks and reloads
    # every tile, the overlapping tile, the half-height tile and the one-pixel path.
    monkeypatch.setattr(conv_module, "_budgets", lambda: (1, 1))
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, seed=9, **attrs)
    oh, ow = h, (w + 2 * attrs.get("pads", (0,) * 4)[1] - k) // attrs.get("strides", (1, 1))[1] + 1
    r = np.random.default_rng(10).standard_normal((n, m, oh, ow), dtype=np.float32)
    tile = tiles[BLOCKS.index(block)]
    got = run_blocked(x, wt, b, attrs, "hard_swish", "after", r, tile=tile, block=block)
    assert_close(got, reference(x, wt, b, attrs, "hard_swish", "after", r), RTOL, ATOL)


def numpy_blocked(x, b):
    """The blocked layout by NumPy: zero channels up to whole blocks, then [N, CB, H, W, b]."""
    n, c, h, w = x.shape
    padded = np.zeros((n, -(-c // b) * b, h, w), np.float32)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, -1, b, h, w).transpose(0, 1, 3, 4, 2))


@pytest.mark.parametrize("c", [1, 3, 5, 8, 16, 17, 40, 100])
@pytest.mark.parametrize("n, size", [(2, (1, 1)), (1, (3, 3)), (2, (7, 13)), (1, (17, 19))])
def test_layout_round_trip(c, n, size):
    """Both conversions against NumPy's, NaN and inf carried: whole blocks move W pixels at a
    time (vtranspose), a last block of fewer channels with its missing rows as zeros, the
    pixels past a plane part's whole runs one at a time; on two threads one 3 x 3 image of one
    block is cut in more parts than it has pixel pairs, so its last parts are empty."""
    before = get_threads()
    set_threads(2)
    try:
        _round_trip(c, n, size)
    finally:
        set_threads(before)


def _round_trip(c, n, size):
    x = np.random.default_rng(c).standard_normal((n, c, *size), dtype=np.float32)
    x.flat[::5] = np.nan
    x.flat[1::7] = -np.inf
    xb = to_blocked(x)
    assert xb.shape[-1] == block_size(c)
    assert np.array_equal(xb, numpy_blocked(x, xb.shape[-1]), equal_nan=True)
    assert np.array_equal(from_blocked(xb, c), x, equal_nan=True)
    for b in BLOCKS:  # into buffers followed by a guard zone, which must stay untouched
        want = numpy_blocked(x, b)
        xb, guard = guarded(want.shape)
        to_blocked(x, block=b, out=xb)
        assert np.array_equal(xb, want, equal_nan=True) and (guard == 7).all()
        y, guard = guarded(x.shape)
        from_blocked(xb, c, out=y)
        assert np.array_equal(y, x, equal_nan=True) and (guard == 7).all()


def guarded(shape):
    """An array of `shape` at the start of a buffer whose next 4096 floats read 7.0."""
    buffer = np.full(math.prod(shape) + 4096, 7.0, np.float32)
    return buffer[: math.prod(shape)].reshape(shape), buffer[math.prod(shape) :]


def test_planes_are_cut_for_the_threads_of_the_process():
    """A few work items per thread, from the thread count: not a number tuned on one machine."""
    from fusion_kernels.blocked import ITEMS_PER_THREAD, plane_parts

    before = get_threads()
    try:
        for threads in (1, 2):
            set_threads(threads)
            assert plane_parts(1, 50176) == ITEMS_PER_THREAD * threads  # one RGB image
            assert plane_parts(3, 50176) == -(-ITEMS_PER_THREAD * threads // 3)
            assert plane_parts(64, 3136) == 1  # blocks enough
            assert plane_parts(1, 2) == 2  # never more parts than pixels
    finally:
        set_threads(before)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("where", ["interior", "edge"])
def test_nan_and_inf_pass_through_like_onnxruntime(block, where):
    x, wt, b, attrs = case(1, 20, 24, 6, 13, 3, pads=(1, 1, 1, 1))
    col = 6 if where == "interior" else 0  # a tile's column, or the one-pixel path's
    x[0, 2, 3, col], x[0, 17, 0, 12 - col] = np.nan, np.inf
    got = run_blocked(x, wt, b, attrs, "relu", block=block)
    want = reference(x, wt, b, attrs, "relu")
    assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want))
    assert_close(got, want, RTOL, ATOL)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    "n, c, width, k, attrs",
    [
        (1, 48, 8, 3, {"pads": (1, 1, 1, 1)}),  # RegNetY's group width 8: 2 groups a block at 16
        (2, 104, 8, 3, {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # half a block left over
        (1, 24, 4, 3, {"pads": (0, 1, 2, 1)}),
        (3, 12, 2, 1, {}),  # fewer channels than a block: one block-diagonal group
    ],
    ids=str,
)
def test_groups_narrower_than_a_block(block, n, c, width, k, attrs):
    """Groups of `width` channels in and out, fewer than a block: block-diagonal groups of one
    block each, against onnxruntime's grouped conv; the weights across groups stay zero."""
    x, wt, b, attrs = case(n, c, c, 7, 9, k, seed=c, group=c // width, **attrs)
    assert supports(wt.shape, c // width, block) is None
    for activation in ("relu", "sigmoid"):
        got = run_blocked(x, wt, b, attrs, activation, block=block)
        assert_close(got, reference(x, wt, b, attrs, activation), RTOL, ATOL)
    if width < block:
        dense = conv_module.block_diagonal(wt, c // width, block)
        assert dense.shape == (-(-c // block) * block, block, k, k)
        lanes = np.arange(block)
        across = lanes[:, None] // width != lanes[None, :] // width
        assert not dense.reshape(-1, block, block, k, k)[:, across].any()


def test_refusals_say_why():
    assert "whole blocks of 8" in supports((12, 3, 3, 3), group=4, block=8)
    assert supports((16, 8, 3, 3), group=2, block=8) is None
    assert "whole blocks of 16" in supports((24, 8, 3, 3), group=2, block=16)  # 8 in, 12 out
    assert supports((16, 8, 3, 3), group=2, block=16) is None  # narrow: block-diagonal
    assert supports((32, 16, 3, 3), group=2, block=16) is None
    with pytest.raises(ValueError, match="whole blocks"):
        prepare_conv_nchwc(np.ones((12, 3, 3, 3), np.float32), group=4)
    with pytest.raises(ValueError, match="whole blocks of 16"):
        prepare_conv_nchwc(np.ones((24, 8, 3, 3), np.float32), group=2, block=16)
    with pytest.raises(ValueError, match="block"):
        prepare_conv_nchwc(np.ones((8, 8, 3, 3), np.float32), block=4)
    for block in BLOCKS:
        plan = prepare_conv_nchwc(np.ones((8, 32, 3, 3), np.float32), block=block)
        with pytest.raises(ValueError, match="reads 32 channels"):
            conv_nchwc(to_blocked(np.ones((1, 16, 5, 5), np.float32), block=block), plan)
        with pytest.raises(ValueError, match="reads 32 channels"):  # the other block
            conv_nchwc(to_blocked(np.ones((1, 32, 5, 5), np.float32), block=24 - block), plan)
        with pytest.raises(ValueError, match="empty"):
            conv_nchwc(to_blocked(np.ones((1, 32, 2, 2), np.float32), block=block), plan)


def plan_of(wt, b, attrs, activation=None, block=None):
    return prepare_conv_nchwc(wt, b, pads=attrs.get("pads", (0, 0, 0, 0)),
                              group=attrs.get("group", 1), activation=activation, block=block,
                              **ACTS[activation][1])  # fmt: skip


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", [1, 3])
def test_parts_written_into_a_larger_output(block, n):
    """Convs writing their channel blocks of one output (a concatenation's parts, `at`): a 1x1
    and a 3x3 conv in place, a non-clip activation's pass included, a depthwise conv through a
    copy; blocks outside the parts untouched, every image at its own offset."""
    x, w1, b1, a1 = case(n, 24, 2 * block, 7, 9, 1, seed=1)
    _, w3, b3, a3 = case(n, 24, block, 7, 9, 3, seed=2, pads=(1, 1, 1, 1))
    _, wd, bd, ad = case(n, 24, 24, 7, 9, 3, seed=3, group=24, pads=(1, 1, 1, 1))
    parts = [(w1, b1, a1, "relu"), (w3, b3, a3, "hard_swish"), (wd, bd, ad, "clip")]
    xb = to_blocked(x, block=block)
    total = 3 + -(-24 // block)  # blocks of the concatenation
    y = np.full((n, total + 1, 7, 9, block), np.nan, np.float32)  # one more: must stay NaN
    at = 0
    for wt, b, attrs, act in parts:
        plan = plan_of(wt, b, attrs, act, block)
        assert conv_nchwc(xb, plan, out=y, at=at) is y
        at += plan.out_blocks
    want = np.concatenate([reference(x, wt, b, attrs, act) for wt, b, attrs, act in parts], 1)
    assert_close(from_blocked(np.ascontiguousarray(y[:, :total]), 3 * block + 24), want, RTOL,
                 ATOL)  # fmt: skip
    assert np.isnan(y[:, total]).all()
    assert not y[:, total - 1, ..., 24 % block or block :].any()  # the last part's padding


def test_a_part_is_checked_before_it_is_written():
    x, wt, b, attrs = case(1, 16, 16, 5, 5, 1)
    xb = to_blocked(x, block=8)
    plan = plan_of(wt, b, attrs, block=8)
    y = np.zeros((1, 3, 5, 5, 8), np.float32)
    with pytest.raises(ValueError, match="blocks 2..3 are not in out's 3"):
        conv_nchwc(xb, plan, out=y, at=2)
    with pytest.raises(ValueError, match="blocks of 16 channels"):
        conv_nchwc(xb, plan, out=np.zeros((1, 3, 5, 5, 16), np.float32), at=0)
    with pytest.raises(ValueError, match="cannot hold"):
        conv_nchwc(xb, plan, out=np.zeros((1, 3, 5, 4, 8), np.float32), at=0)
    with pytest.raises(ValueError, match="C-contiguous"):
        conv_nchwc(xb, plan, out=np.zeros((1, 6, 5, 5, 8), np.float32)[:, ::2], at=0)
    residual = prepare_conv_nchwc(wt, b, residual="after", block=8)
    with pytest.raises(ValueError, match="residual"):
        conv_nchwc(xb, residual, out=y, at=0)
    assert not y.any()


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("group", [1, 8], ids=["direct", "depthwise"])
def test_batch_0_gives_an_empty_output(group, block):
    x, wt, b, attrs = case(1, 8, 8, 6, 6, 3, group=group, pads=(1, 1, 1, 1))
    got = run_blocked(x[:0], wt, b, attrs, "relu", block=block)
    assert got.shape == (0, 8, 6, 6)


# The tiles the rule gives with AVX2's 16 registers (3x4, 4x3, 6x2, 8x1 at 8 lanes; 1x4, 2x2,
# 6x1 at 16) and with AVX-512's 32 (6x4, 9x3, 14x2, 16x1 at 16 lanes), and the one-column tiles
# the register file holds (14x1, 30x1), forced: on a CPU with fewer registers LLVM spills, and
# the sums are the same.
TILES = {8: [(3, 4), (4, 3), (6, 2), (8, 1), (14, 1)],
         16: [(6, 4), (9, 3), (14, 2), (16, 1), (30, 1), (1, 4), (2, 2), (6, 1)]}  # fmt: skip


@pytest.mark.parametrize(("block", "tile"), [(b, t) for b in BLOCKS for t in TILES[b]], ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 16, 40, 5, 17, 3, {"pads": (1, 1, 1, 1)}),  # interior 15: whole tiles + an overlap
        (2, 32, 72, 3, 47, 1, {}),  # 1x1: every column interior
        (1, 16, 8, 4, 5, 3, {"pads": (1, 1, 1, 1)}),  # a row narrower than most tiles
    ],
    ids=lambda s: f"{s[:6]}",
)
def test_every_register_tile(shape, block, tile):
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, seed=6, **attrs)
    r = np.random.default_rng(7).standard_normal((n, m, h, w), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, "sigmoid", "after", r, tile=tile, block=block)
    assert_close(got, reference(x, wt, b, attrs, "sigmoid", "after", r), RTOL, ATOL)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("width", [1, 7, 13, 56])
@pytest.mark.parametrize(
    ("c", "m", "attrs"),
    [
        (3, 24, {"pads": (1, 1, 1, 1)}),  # a stem: input blocks of 3 channels
        (20, 24, {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
        (20, 16, {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
        (16, 8, {}),  # 1x1 below: 8 channels, one block padded at 16 lanes
    ],
    ids=str,
)
def test_output_widths_at_the_rule_s_tiles(block, width, c, m, attrs):
    k = 1 if not attrs else 3
    x, wt, b, attrs = case(1, c, m, 3, width * attrs.get("strides", (1, 1))[1], k, seed=11,
                           **attrs)  # fmt: skip
    got = run_blocked(x, wt, b, attrs, "clip", block=block)
    assert got.shape[-1] == width
    assert_close(got, reference(x, wt, b, attrs, "clip"), RTOL, ATOL)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The kernel split into work items of all rows (1 thread) or of a few (2)."""
    before = get_threads()
    set_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    set_threads(before)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("chunks", [False, True], ids=["whole-K", "K-in-chunks"])
@pytest.mark.parametrize(
    "shape",
    [
        (4, 16, 32, 11, 7, 3, {"pads": (1, 1, 1, 1)}),  # a late layer's 7-wide rows
        (2, 8, 24, 9, 3, 3, {"pads": (1, 1, 1, 1)}),  # 3 wide: no row tile, all columns down
        (3, 20, 16, 27, 9, 3, {"pads": (2, 1, 2, 1), "strides": (2, 1), "dilations": (2, 1)}),
        (2, 16, 40, 14, 14, (5, 3), {"pads": (2, 0, 2, 0)}),  # no edge columns: none down
    ],
    ids=lambda s: f"{s[:6]}{s[6]}",
)
def test_edge_columns_run_down_the_rows(threads, monkeypatch, block, chunks, shape):
    # An edge column's pixels in rows whose vertical taps are all inside run as tiles down the
    # rows (and an overlapping or a half-height one), in work items of every row or of a few;
    # the rest (top and bottom rows, short items) one pixel at a time; with K in chunks they
    # park in slots of their own.
    if chunks:
        monkeypatch.setattr(conv_module, "_budgets", lambda: (1, 1))
    n, c, m, h, w, k, attrs = shape
    x, wt, b, attrs = case(n, c, m, h, w, k, seed=12, **attrs)
    want = reference(x, wt, b, attrs, "tanh")
    r = np.random.default_rng(13).standard_normal(want.shape, dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, "tanh", "after", r, block=block)
    assert_close(got, reference(x, wt, b, attrs, "tanh", "after", r), RTOL, ATOL)


def test_tile_options(monkeypatch):
    # The options follow the register file of the CPU compiled for, not this machine's:
    # AVX2's 16 registers of 8 lanes, then AVX-512's 32 of 16 (an 8-lane vector in each).
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (16, 8))
    # 8 blocks: no tile computes padding; 3x4 first, the next by FMAs per load (6x2) timed too
    assert tile_options((64, 64, 3, 3), block=8) == (4, 2)
    assert tile_options((24, 16, 1, 1), block=8) == (3, 1)  # 3 blocks: 4x3, then 8x1: tight
    assert tile_options((40, 16, 1, 1), block=8) == (3, 1)  # 5: 4x3 padded (6x2 too), 8x1
    assert tile_options((8, 16, 1, 1), block=8) == (1,)
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (32, 16))
    assert tile_options((64, 64, 3, 3), block=8) == (4, 2)
    # 5 blocks: 9x3 (one padded of 6, 2.25 FMAs per load) before 14x2 (as many, 1.75) and 6x4
    # (3 of 8), or 16x1 tight
    assert tile_options((40, 16, 1, 1), block=8) == (3, 1)
    monkeypatch.undo()
    assert tile_options((16, 16, 1, 1), block=16) == (1,)
    assert tile_options((32, 1, 3, 3), group=32) == (1,)  # depthwise: its own kernel
    assert tile_options((64, 64, 3, 3)) == tile_options((64, 64, 3, 3), block=width())
    with pytest.raises(ValueError, match="tile"):
        prepare_conv_nchwc(np.ones((8, 8, 1, 1), np.float32), tile=5)
    with pytest.raises(ValueError, match="tile"):
        prepare_conv_nchwc(np.ones((8, 8, 1, 1), np.float32), tile=(0, 2))


def test_tile_blocks_rank_by_padding_among_tiles_not_bound_by_loads(monkeypatch):
    # With AVX-512's 32 registers of 16 lanes: 6x4 (2.4 FMAs per load), 9x3, 14x2 (1.75), 16x1
    # (0.94: a load per FMA, never first while another tile does better).
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (32, 16))
    assert [conv_module.tiles.fit_rows(fb, 16) for fb in (4, 3, 2, 1)] == [6, 9, 14, 30]
    # no padding: the most FMAs per load first; then the tightest other (9x3 pads 8 blocks
    # to 9: 14x2 next), both timed
    assert tile_blocks(8, 16) == (4, 2)
    assert tile_blocks(64, 16) == (4, 2)
    assert tile_blocks(12, 16) == (4, 3)  # 6x4 and 9x3 both tight: the more FMAs per load
    assert tile_blocks(3, 16) == (3, 1)
    assert tile_blocks(6, 16) == (3, 2)  # 9x3 and 14x2 tight, 6x4 pads a third
    assert tile_blocks(9, 16) == (3, 1)  # 9x3 tight; 14x2 pads one of 10, 16x1 none
    assert tile_blocks(10, 16) == (2, 1)  # 9x3 and 6x4 pad two of 12
    assert tile_blocks(5, 16) == (3, 1)  # one padded of 6 either way (9x3, 14x2), or 16x1
    assert tile_blocks(1, 16) == (1,)  # 16x1 alone: nothing else to pick
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (16, 8))
    assert [conv_module.tiles.fit_rows(fb, 8) for fb in (4, 3, 2, 1)] == [3, 4, 6, 14]


def test_tile_rows_narrow_for_narrow_rows(monkeypatch):
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (16, 8))
    assert tile_rows(4, 8, 54) == 3  # a 56-wide 3x3 row: 18 tiles of 3
    assert tile_rows(1, 8, 56) == 8  # one column: at most half the register file (tallest)
    assert tile_rows(1, 8, 5) == 4  # 7 wide, 3x3: a tile of 4 and its half, 2
    assert tile_rows(1, 8, 7) == 7  # one tile of 7 (14's halving), not two of 4
    assert tile_rows(1, 8, 12) == 8
    assert tile_rows(2, 8, 5) == 3
    assert tile_rows(4, 8, 1) == 3  # no tile fits: the one-pixel path
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (32, 16))
    assert tile_rows(4, 16, 5) == 3  # 7x7 late layers at 16 lanes: 3x4 and 2x4, not 6x4
    assert tile_rows(4, 16, 54) == 6
    assert tile_rows(4, 16, 56) == 6  # 60 slots, 3x4 57: not worth twice the weight traffic
    assert tile_rows(4, 16, 13) == 6  # two 6x4 and a 3x4: 18 with set-ups, 3x4's 19.5
    assert tile_rows(1, 16, 26) == 16
    assert tile_rows(1, 16, 12) == 8
    assert tile_rows(1, 16, 15) == 15  # 30's halving, under the cap of 16


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(
    ("n", "c", "m", "h", "w"),
    [(1, 64, 160, 7, 7), (2, 24, 48, 14, 14), (1, 40, 24, 5, 13), (1, 16, 16, 1, 1)],
)
def test_pointwise_runs_in_the_rows_that_tile_best(threads, block, n, c, m, h, w):
    # A 1x1, stride-1, unpadded conv's pixels are one run per block, so the kernel takes them
    # as any rows x columns of the same count (7x7 as one row of 49): the output is the conv's,
    # with the epilogue's activation and residual applied per row.
    x, wt, b, attrs = case(n, c, m, h, w, 1, seed=14)
    r = np.random.default_rng(15).standard_normal((n, m, h, w), dtype=np.float32)
    got = run_blocked(x, wt, b, attrs, "silu", "after", r, block=block)
    assert_close(got, reference(x, wt, b, attrs, "silu", "after", r), RTOL, ATOL)
    plan = prepare_conv_nchwc(wt, b, block=block)
    g = conv_module.geometry(plan, to_blocked(x, block=plan.in_block).shape, get_threads())
    rows, cols = g[conv_module.geo.OH], g[conv_module.geo.OW]
    assert rows * cols == h * w and (g[conv_module.geo.H], g[conv_module.geo.W]) == (rows, cols)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", [1, 3])
def test_pointwise_runs_of_pixels_as_work_items(monkeypatch, block, n):
    """A 1x1 conv on 7 x 7 with 3 filter groups on two threads: its one row of 49 pixels cut
    in 3 runs of 17, 17 and 15 (g[PARTS]; the runs forced, not left to this CPU's tile count),
    each (image, group, run) an item; the epilogue, a residual and a write into a
    concatenation's part (its own block stride) at every run's offset."""
    monkeypatch.setattr(conv_module, "_pointwise_rows", lambda plan, n, h, w, t: (1, h * w, 3))
    before = get_threads()
    set_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        x, wt, b, attrs = case(n, 40, 3 * block, 7, 7, 1, seed=21)
        r = np.random.default_rng(22).standard_normal((n, 3 * block, 7, 7), dtype=np.float32)
        plan = prepare_conv_nchwc(wt, b, activation="silu", residual="after", tile=1,
                                  block=block)  # fmt: skip
        g = conv_module.geometry(plan, to_blocked(x, block=plan.in_block).shape, get_threads())
        assert g[conv_module.geo.PARTS] == 3
        got = conv_nchwc(to_blocked(x, block=block), plan, residual=to_blocked(r, block=block))
        want = reference(x, wt, b, attrs, "silu", "after", r)
        assert_close(from_blocked(got, 3 * block), want, RTOL, ATOL)
        plan = prepare_conv_nchwc(wt, b, activation="relu", tile=1, block=block)
        y = np.full((n, 5, 7, 7, block), np.nan, np.float32)
        conv_nchwc(to_blocked(x, block=block), plan, out=y, at=1)
        assert np.isnan(y[:, 0]).all() and np.isnan(y[:, 4]).all()
        assert_close(from_blocked(np.ascontiguousarray(y[:, 1:4]), 3 * block),
                     reference(x, wt, b, attrs, "relu"), RTOL, ATOL)  # fmt: skip
    finally:
        set_threads(before)


def test_pointwise_rows_follow_the_tiles(monkeypatch):
    # at 16 lanes (6x4 tiles), 7-wide rows take a tile of 6 and a half-height one (3): 49
    # pixels in one row take 8 and a half-height one; with few filter groups the row splits
    monkeypatch.setattr(conv_module.tiles, "registers", lambda: (32, 16))
    wt = np.zeros((160, 960, 1, 1), np.float32)
    plan = prepare_conv_nchwc(wt, block=16, tile=4)
    assert conv_module._pointwise_rows(plan, 1, 7, 7, 1) == (1, 49, 1)
    # on two threads its 3 filter groups (10 blocks) run as 6 items, the row cut in 2 runs
    assert conv_module._pointwise_rows(plan, 1, 7, 7, 2) == (1, 49, 2)
    # a padded or strided 1x1 conv keeps its own rows
    plan = prepare_conv_nchwc(wt, block=16, tile=4, strides=(2, 2))
    g = conv_module.geometry(plan, (1, 10, 14, 14, 16), 2)
    assert (g[conv_module.geo.OH], g[conv_module.geo.OW]) == (7, 7)


@pytest.mark.parametrize("group", [1, 16])
def test_later_calls_run_the_compiled_entry_point(group):
    # after a shape's first call the launch calls the machine code directly (no dispatcher):
    # the same output, for a read-only input too; an output it could not write is refused
    x, wt, b, attrs = case(1, 16, 16, 6, 7, 3, seed=16, group=group, pads=(1, 1, 1, 1))
    plan = prepare_conv_nchwc(wt, b, pads=(1, 1, 1, 1), group=group, activation="relu")
    xb = to_blocked(x, block=plan.in_block)
    first = conv_nchwc(xb, plan)
    (launch,) = plan.geometry.values()
    assert launch.bound
    frozen = xb.copy()
    frozen.flags.writeable = False
    assert np.array_equal(conv_nchwc(frozen, plan), first)
    assert np.array_equal(conv_nchwc(xb, plan), first)
    assert_close(from_blocked(first, 16), reference(x, wt, b, attrs, "relu"), RTOL, ATOL)
    out = np.empty_like(first)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        conv_nchwc(xb, plan, out=out)


def test_blocked_tensors_and_scratch_start_on_a_cache_line():
    # a 16-lane load at a block's start must not straddle two lines (workspace.empty)
    from fusion_kernels.workspace import ALIGN, per_thread

    x, wt, b, _ = case(1, 20, 24, 5, 6, 3, seed=17, group=1, pads=(1, 1, 1, 1))
    plan = prepare_conv_nchwc(wt, b, pads=(1, 1, 1, 1))
    for _ in range(3):  # whatever the allocator hands out this time
        xb = to_blocked(x, block=plan.in_block)
        yb = conv_nchwc(xb, plan)
        assert xb.ctypes.data % ALIGN == 0 and yb.ctypes.data % ALIGN == 0
        rows = per_thread(1001)
        assert rows.shape[1] >= 1001 and all(r.ctypes.data % ALIGN == 0 for r in rows)


def test_per_thread_scratch_views_are_kept_until_the_area_grows():
    """per_thread hands the same view for the same size (a kernel call's 0.5 us), rows on cache
    lines; a larger size replaces the area and the views cut from the old one; sizes past
    KEEP_MAX are allocated per call."""
    from fusion_kernels import workspace
    from fusion_kernels.workspace import ALIGN, KEEP_MAX, per_thread

    a = per_thread(100)
    assert per_thread(100) is a and a.shape[1] >= 100
    big = per_thread(workspace._AREA.floats.size + 1)  # past this thread's area, whatever it is
    b = per_thread(100)
    assert b is not a and np.shares_memory(b, big) and b.ctypes.data % ALIGN == 0
    huge = KEEP_MAX // 4
    assert per_thread(huge) is not per_thread(huge)


@pytest.mark.parametrize("shape", [0, 1, 17, (2, 3, 5, 7, 16), (1, 16, 56, 56, 16), ()])
def test_workspace_empty_is_aligned_and_owns_its_memory(shape):
    """Blocked tensors start on a cache line (workspace.ALIGN), any size, a length or a shape."""
    from fusion_kernels import workspace

    a = workspace.empty(shape)
    want = shape if isinstance(shape, tuple) else (shape,)
    assert a.shape == want and a.dtype == np.float32 and a.flags.c_contiguous
    assert a.ctypes.data % workspace.ALIGN == 0 and a.flags.writeable
    a[...] = 1.0
    b = workspace.empty(shape)  # a separate allocation, not a view of the same area
    b[...] = 2.0
    assert np.all(a == 1.0)


def test_get_threads_follows_set_threads():
    before = get_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            set_threads(n)
            assert get_threads() == n == numba.get_num_threads()
    finally:
        set_threads(before)


def test_row_bands_lighten_the_busiest_thread():
    """band_rows: never a busier thread than at least 4 items a thread gave, never more than
    twice its items; 9 filter groups of 7 rows on two threads no longer leave 5 of 9 whole
    items on one thread."""
    for threads in (1, 2, 3, 4):
        for oh in (1, 2, 7, 13, 14, 28, 56, 112):
            for others in (1, 2, 3, 5, 9, 16, 36):
                base = -(-oh // min(oh, max(1, -(-4 * threads // others))))
                rows = band_rows(oh, others, threads)
                assert 1 <= rows <= base
                assert -(-oh // rows) <= 2 * -(-oh // base)
                load = _busiest_rows(oh, others, rows, threads)
                assert load <= _busiest_rows(oh, others, base, threads)
                assert load >= -(-oh * others // threads)  # no thread below the mean
    assert _busiest_rows(7, 9, band_rows(7, 9, 2), 2) == 32 < _busiest_rows(7, 9, 7, 2) == 35


def test_busiest_rows_counts_as_prange_cuts():
    """_busiest_rows against the items listed one by one (bands of `rows`, the last shorter),
    cut for the threads in runs of equal counts, in order."""
    for oh, others, threads in itertools.product((1, 2, 5, 7, 13, 28), (1, 2, 3, 9), (1, 2, 3, 4)):
        for rows in range(1, oh + 1):
            bands = -(-oh // rows)
            sizes = [oh - (bands - 1) * rows if j == bands - 1 else rows
                     for _ in range(others) for j in range(bands)]  # fmt: skip
            cuts = [t * len(sizes) // threads for t in range(threads + 1)]
            want = max(sum(sizes[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))
            assert _busiest_rows(oh, others, rows, threads) == want


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_rows_split_by_the_busiest_thread(stride, monkeypatch):
    """One block of one image on two threads: the depthwise kernel's row items are cut evenly.
    Its split counted items as equal, so 56 rows went as items of 55 and 1 rows (one thread
    idle, 16 x 56 x 56 3x3 no faster on two threads than on one). L2 fixed at 1 MB: the padded
    copy's cap, not this CPU's."""
    monkeypatch.setattr(conv_module, "cache_bytes", lambda level: 1 << 20)
    w = np.ones((16, 1, 3, 3), np.float32)
    plan = prepare_conv_nchwc(w, None, group=16, pads=(1,) * 4, strides=(stride,) * 2, block=16)
    g = conv_module.geometry(plan, (1, 1, 56 * stride, 56 * stride, 16), 2)
    assert g[conv_module.geo.OH] == 56 and g[conv_module.geo.ROWS] == 28


@pytest.mark.parametrize("block", [8, 16])
def test_depthwise_counts_put_masked_edges_first(block):
    """The count the depthwise split and the depth-first bands rank the ways by: where PAD 3 may
    run (masked_edges, a row of at least a tile), its tiles' FMAs are the least, level with PAD
    0 only where no tile meets an edge (no padding); a band (inverted_residual._pad) is ranked
    by the same count, as an image of its own."""
    from fusion_kernels.inverted_residual import _pad

    for size, k, stride, pl in [(56, 3, 1, 1), (112, 3, 2, 1), (28, 5, 1, 2), (14, 3, 1, 1),
                                (56, 5, 2, 2), (20, 3, 1, 0)]:  # fmt: skip
        out = (size + 2 * pl - k) // stride + 1
        counts, _ = conv_module.depthwise_counts((size, size), (out, out), (k, k),
                                                 (stride,) * 2, (1, 1), (pl, pl),
                                                 block)  # fmt: skip
        for rows in (1, 4, out):
            c = counts(rows)
            if k == 5 and block == 8:  # tap by tap at 8 lanes: nothing to mask
                assert 3 not in c
                continue
            assert c[3] == min(c.values())
            assert (c[0] == c[3]) == (pl == 0)
            want = 0 if pl == 0 else 3
            assert _pad(size, out, k, stride, pl, rows, block) == want
