"""kernels/_depthwise_blocked.py, the depthwise conv on blocked tensors, at blocks 8 and 16 in
one process, against onnxruntime running the unfused Conv (group = C) [+ Add] [+ activation] graph.

The kernel is driven here with its own packing ([CB, KH, KW, b] weights, [CB b] bias) and
geometry, the contract conv_nchwc keeps, so that both widths are tested whatever block the
process's conv_nchwc packs for. Channel counts that fill whole blocks of 8 and 16 (32), of 8
only (24), and neither (5, 20); widths that leave part of a tile (1, 13, 17), strides,
dilations, asymmetric pads, several row items per block, 3- and 5-wide filters (their row-shared
loads) and others; the four ways the tiles read (PAD 1: an item's padded copy; PAD 0: x in
place, tiles inside the image among them, and a tile's padded copy at an edge; PAD 2: x in
place, edge pixels one at a time; PAD 3: x in place, every column in tiles, the columns outside
the row masked, on the shapes masked_edges allows), PAD 2 and 3 equal to PAD 1 float for float.
"""

import numpy as np
import pytest
from helpers import assert_close, run_ort
from onnx import TensorProto, helper, numpy_helper

from fusion_kernels import _blocked_geometry as geo
from fusion_kernels._depthwise_blocked import dwconv_nchwc, masked_edges, scratch_size
from fusion_kernels.blocked import from_blocked, to_blocked
from fusion_kernels.epilogue import RESIDUALS
from fusion_kernels.simd import lanes
from fusion_kernels.simd.activation import encode
from fusion_kernels.workspace import per_thread

RTOL, ATOL = 1e-4, 1e-5
BLOCKS = [8, 16]

node = helper.make_node
# activation -> (ONNX nodes from "t" to "a", the kernel's encode() keywords); relu and clip
# are the clipping kinds (the epilogue in the tile), silu and hard_swish the others (_activate)
ACTS = {
    None: ([node("Identity", ["t"], ["a"])], {}),
    "relu": ([node("Relu", ["t"], ["a"])], {}),
    "clip": ([node("Clip", ["t", "lo", "hi"], ["a"])], {"clip_min": -0.5, "clip_max": 0.75}),
    "silu": ([node("Sigmoid", ["t"], ["s"]), node("Mul", ["t", "s"], ["a"])], {}),
    "hard_swish": ([node("HardSwish", ["t"], ["a"])], {}),
}


def reference(x, w, b, conv, activation, residual, r):
    """onnxruntime: Conv, then Add(r) before or after the activation."""
    nodes = [node("Conv", ["x", "w", "b"], ["c"], group=x.shape[1], **conv)]
    nodes.append(node("Add", ["c", "r"], ["t"]) if residual == "before" else
                 node("Identity", ["c"], ["t"]))  # fmt: skip
    nodes += ACTS[activation][0]
    out = "a"
    if residual == "after":
        nodes.append(node("Add", ["a", "r"], ["y"]))
        out = "y"
    consts = {"w": w, "b": b, "lo": np.float32(-0.5), "hi": np.float32(0.75)}
    feeds = {"x": x, "r": r} if residual else {"x": x}
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
              for k, v in feeds.items()]  # fmt: skip
    graph = helper.make_graph(
        nodes, "dw", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return run_ort(model, feeds)[0]


def run_kernel(block, x, w, b, conv, activation, residual, r, rows, pad):
    """The kernel at `block` lanes on x [N, C, H, W]: packed and laid out as conv_nchwc does;
    pad: how its tiles read (1: an item's padded copy, 0: x, and a padded copy at an edge)."""
    n, c, h, wd = x.shape
    kh, kw = w.shape[2:]
    (sh, sw), (dh, dw) = conv.get("strides", (1, 1)), conv.get("dilations", (1, 1))
    pt, pl, pb, pr = conv.get("pads", (0, 0, 0, 0))
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (wd + pl + pr - (kw - 1) * dw - 1) // sw + 1
    cb = -(-c // block)
    wp = np.zeros((cb * block, kh, kw), np.float32)
    wp[:c] = w.reshape(c, kh, kw)
    packed = np.ascontiguousarray(wp.reshape(cb, block, kh, kw).transpose(0, 2, 3, 1)).ravel()
    bias = np.zeros(cb * block, np.float32)
    bias[:c] = b
    kind, act_a, act_b = encode(activation, **ACTS[activation][1])
    g = geo.pack(
        N=n,
        CB=cb,
        BI=block,
        H=h,
        W=wd,
        KH=kh,
        KW=kw,
        SH=sh,
        SW=sw,
        DH=dh,
        DW=dw,
        PT=pt,
        PL=pl,
        OH=oh,
        OW=ow,
        ROWS=min(rows, oh),
        PAD=pad,
        RESIDUAL=RESIDUALS[residual],
        ACT=kind,
    )
    xf = to_blocked(x, block=block).reshape(-1)
    yb = np.empty((n, cb, oh, ow, block), np.float32)
    yf = yb.reshape(-1)
    res = to_blocked(r, block=block).reshape(-1) if residual else yf
    dwconv_nchwc(lanes(block), xf, packed, bias, yf, res, g, act_a, act_b,
                 per_thread(scratch_size(g)))  # fmt: skip
    return from_blocked(yb, c)


def case(n, c, h, w, k, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    kh, kw = (k, k) if isinstance(k, int) else k
    wt = rng.standard_normal((c, 1, kh, kw), dtype=np.float32) / np.float32(np.sqrt(kh * kw))
    return x, wt, rng.standard_normal(c, dtype=np.float32)


SHAPES = [
    # n, c, h, w, kernel, conv attributes, output rows per item
    (1, 20, 13, 13, 3, {"pads": (1, 1, 1, 1)}, 4),
    (2, 32, 17, 17, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1)}, 3),
    (1, 5, 7, 30, 5, {"pads": (2, 2, 2, 2)}, 7),
    (1, 24, 9, 9, 5, {"strides": (2, 2), "pads": (2, 1, 2, 3)}, 2),
    (1, 16, 10, 10, 3, {"pads": (2, 2, 2, 2), "dilations": (2, 2)}, 5),
    (2, 24, 1, 1, 3, {"pads": (1, 1, 1, 1)}, 1),
    (1, 40, 6, 17, (1, 3), {"pads": (0, 1, 0, 1)}, 2),
    (1, 24, 11, 40, 3, {"strides": (2, 2), "pads": (1, 1, 1, 1)}, 2),
    # 5 wide: its row-shared loads at block 16 (two half tiles at stride 2), tap by tap at 8
    (2, 32, 15, 37, 5, {"strides": (2, 2), "pads": (2, 2, 2, 2)}, 3),
    (1, 16, 12, 21, 5, {"pads": (2, 2, 2, 2)}, 5),
    (1, 16, 12, 12, 5, {"pads": (4, 4, 4, 4), "dilations": (2, 2)}, 4),  # dilated: tap by tap
    (1, 24, 14, 14, 5, {"strides": (2, 2), "pads": (2, 2, 2, 2)}, 3),  # 7-wide rows: 7-pixel tiles
    # rows whose taps all lie in the padding (bias alone), and a row of 8 inner columns
    (1, 16, 3, 10, 3, {"pads": (3, 1, 3, 1)}, 2),
    # PAD 3's masks: two columns of padding at each end of 3-wide rows (a tile's first two and
    # last two vectors masked), rows narrower than a tile at strides 1 and 2 (one tile, its
    # pixels past the row not stored), padding only at the right (TensorFlow's SAME at stride 2)
    (1, 16, 9, 12, 3, {"pads": (2, 2, 2, 2)}, 3),
    (1, 24, 7, 7, 3, {"pads": (1, 1, 1, 1)}, 7),
    (1, 16, 9, 15, 3, {"strides": (2, 2), "pads": (1, 1, 0, 0)}, 2),
    (2, 16, 10, 20, 3, {"strides": (2, 2), "pads": (0, 0, 1, 1)}, 3),
]


def masked(shape, block) -> bool:
    """Whether PAD 3 may run the shape (masked_edges: row-shared loads, two columns of padding
    at most at either end of a tile's row)."""
    _, _, _, w, k, conv, _ = shape
    kh, kw = (k, k) if isinstance(k, int) else k
    (_, sw), (_, dw) = conv.get("strides", (1, 1)), conv.get("dilations", (1, 1))
    _, pl, _, pr = conv.get("pads", (0, 0, 0, 0))
    ow = (w + pl + pr - (kw - 1) * dw - 1) // sw + 1
    return masked_edges(kw, sw, dw, pl, w, ow, block)


def test_masked_edges_where_the_shapes_allow():
    """The shapes above that PAD 3 runs, at 8 and 16 lanes: not the dilated, the 1x1 image, or
    the 5-wide filters at 8 lanes (tap by tap there, no shared loads to mask)."""
    allowed = {block: [s[2:5] for s in SHAPES if masked(s, block)] for block in (8, 16)}
    assert allowed[8] == [(13, 13, 3), (17, 17, 3), (6, 17, (1, 3)), (11, 40, 3), (3, 10, 3),
                          (9, 12, 3), (7, 7, 3), (9, 15, 3), (10, 20, 3)]  # fmt: skip
    assert allowed[16] == [(13, 13, 3), (17, 17, 3), (7, 30, 5), (6, 17, (1, 3)), (11, 40, 3),
                           (15, 37, 5), (12, 21, 5), (3, 10, 3), (9, 12, 3), (7, 7, 3),
                           (9, 15, 3), (10, 20, 3)]  # fmt: skip


# every shape at PAD 0, 1 and 2, and at PAD 3 where it runs (masked)
CASES = [pytest.param(shape, block, pad, id=f"{shape[:5]}{shape[5]}-{block}-pad{pad}")
         for shape in SHAPES for block in BLOCKS for pad in (0, 1, 2, 3)
         if pad < 3 or masked(shape, block)]  # fmt: skip


@pytest.mark.parametrize("shape, block, pad", CASES)
def test_against_onnxruntime(shape, block, pad):
    n, c, h, w, k, conv, rows = shape
    x, wt, b = case(n, c, h, w, k)
    want = reference(x, wt, b, conv, "relu", None, None)
    got = run_kernel(block, x, wt, b, conv, "relu", None, None, rows, pad)
    assert_close(got, want, RTOL, ATOL, what=f"block {block} pad {pad}")


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[:5]}{s[5]}")
def test_read_in_place_equals_padded_copy(shape, block):
    """PAD 2 (x read in place, edge pixels one at a time, filter rows outside skipped) and PAD 3
    (every column in tiles, the columns outside the row loaded as zeros) sum each pixel's taps
    in the order the padded copy's tiles do: the same floats."""
    n, c, h, w, k, conv, rows = shape
    x, wt, b = case(n, c, h, w, k, seed=5)
    pads = (1, 2, 3) if masked(shape, block) else (1, 2)
    got = [run_kernel(block, x, wt, b, conv, "hard_swish", None, None, rows, pad)
           for pad in pads]  # fmt: skip
    for other in got[1:]:
        np.testing.assert_array_equal(other, got[0])


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("residual", [None, "before", "after"])
@pytest.mark.parametrize("activation", list(ACTS))
def test_every_epilogue(activation, residual, block, pad):
    conv = {"pads": (1, 1, 1, 1)}
    x, wt, b = case(2, 20, 9, 11, 3, seed=3)
    oh, ow = x.shape[2:]
    r = np.random.default_rng(4).standard_normal((2, 20, oh, ow), dtype=np.float32)
    want = reference(x, wt, b, conv, activation, residual, r)
    got = run_kernel(block, x, wt, b, conv, activation, residual, r, 3, pad)
    assert_close(got, want, RTOL, ATOL, what=f"{activation} {residual} block {block} pad {pad}")
