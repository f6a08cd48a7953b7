"""kernels.winograd_nchwc (Winograd F(2x2, 3x3) and F(4x4, 3x3) on blocked tensors) against
onnxruntime running the unfused Conv [+ Add] [+ activation] graph, and the conv rule's
blocked-wino tactics.

Odd shapes on purpose: channels 1, 3, 5, 17, 64 (a last block of padding), images 1, 2, 7, 13,
17 wide (tiles hanging over the output's edge), pads 0, 1 and asymmetric, batch 0, 1, 3; every
case at blocks 8 and 16 (16-lane code runs on AVX2 as register pairs). The tolerance is the
conv rule's, scale-relative (it accumulates: fusion.numerics).
"""

import numpy as np
import pytest
from helpers import run_ort
from onnx import TensorProto, helper, numpy_helper

from fusion.numerics import compare_arrays
from fusion_kernels.blocked import from_blocked, to_blocked
from fusion_kernels.winograd_nchwc import prepare_winograd_nchwc, supports, winograd_nchwc
from fusion_patterns.conv import RULE, WINOGRAD_SWITCH

BLOCKS = (8, 16)
node = helper.make_node
ACTS = {  # activation -> (ONNX nodes from "t" to "a", kernel keywords)
    None: ([node("Identity", ["t"], ["a"])], {}),
    "relu": ([node("Relu", ["t"], ["a"])], {}),
    "leaky_relu": ([node("LeakyRelu", ["t"], ["a"], alpha=0.1)], {"alpha": 0.1}),
    "sigmoid": ([node("Sigmoid", ["t"], ["a"])], {}),
    "hard_swish": ([node("HardSwish", ["t"], ["a"])], {}),
}


def reference(x, w, b, pads, activation=None, residual=None, r=None):
    """onnxruntime on Conv, then Add(r) before or after the activation."""
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=list(pads))]
    nodes.append(node("Add", ["c", "r"], ["t"]) if residual == "before" else
                 node("Identity", ["c"], ["t"]))  # fmt: skip
    nodes += ACTS[activation][0]
    out = "a"
    if residual == "after":
        nodes.append(node("Add", ["a", "r"], ["y"]))
        out = "y"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))]
    feeds = {"x": x}
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, list(r.shape)))
        feeds["r"] = r
    graph = helper.make_graph(
        nodes, "conv", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )  # fmt: skip
    return run_ort(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feeds)[0]


def run(x, w, b, pads, tile, block, activation=None, residual=None, r=None, fb=None):
    plan = prepare_winograd_nchwc(w, b, pads=pads, tile=tile, block=block, fb=fb,
                                  activation=activation, residual=residual,
                                  **ACTS[activation][1])  # fmt: skip
    assert plan.block == block
    rb = to_blocked(r, block=block) if residual else None
    yb = winograd_nchwc(to_blocked(x, block=block), plan, residual=rb)
    assert yb.shape[-1] == block and yb.shape[1] == -(-w.shape[0] // block)
    return from_blocked(yb, w.shape[0])


def case(n, c, m, h, w, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    wt = rng.standard_normal((m, c, 3, 3), dtype=np.float32) / np.float32(np.sqrt(9 * c))
    return x, wt, rng.standard_normal(m, dtype=np.float32)


def check(got, want):
    result = compare_arrays("y", got, want, RULE.rtol, RULE.atol, scaled=True)
    assert result.ok, result


SHAPES = [  # n, c, m, h, w, pads
    (1, 1, 1, 1, 1, (1, 1, 1, 1)),
    (1, 3, 5, 7, 7, (1, 1, 1, 1)),
    (3, 5, 3, 13, 2, (1, 1, 1, 1)),
    (1, 17, 17, 13, 13, (0, 0, 0, 0)),
    (1, 17, 5, 17, 7, (0, 2, 1, 0)),  # asymmetric
    (1, 64, 64, 17, 17, (1, 1, 1, 1)),
    (3, 3, 17, 2, 13, (2, 1, 0, 1)),
]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tile", (2, 4))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_against_onnxruntime(shape, tile, block):
    n, c, m, h, w, pads = shape
    x, wt, b = case(n, c, m, h, w)
    check(run(x, wt, b, pads, tile, block, fb=1), reference(x, wt, b, pads))


EPILOGUES = [("relu", None), ("leaky_relu", "before"), ("sigmoid", "after"), ("hard_swish", None),
             ("relu", "before")]  # fmt: skip


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tile", (2, 4))
@pytest.mark.parametrize(("activation", "residual"), EPILOGUES)
def test_epilogue(activation, residual, tile, block):
    x, wt, b = case(3, 17, 40, 13, 7, seed=1)
    pads = (1, 1, 1, 1)
    r = np.random.default_rng(2).standard_normal((3, 40, 13, 7), dtype=np.float32)
    got = run(x, wt, b, pads, tile, block, activation, residual, r)  # default register tile
    check(got, reference(x, wt, b, pads, activation, residual, r))


@pytest.mark.parametrize("block", BLOCKS)
def test_batch_zero(block):
    x, wt, b = case(0, 5, 3, 7, 7)
    got = run(x, wt, b, (1, 1, 1, 1), 2, block, fb=1)
    assert got.shape == (0, 3, 7, 7)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tile", (2, 4))
def test_nan_and_inf_propagate_as_in_onnxruntime(tile, block):
    x, wt, b = case(1, 5, 3, 13, 13)
    x[0, 1, 4, 5], x[0, 3, 10, 2] = np.nan, np.inf
    want = reference(x, wt, b, (1, 1, 1, 1))
    got = run(x, wt, b, (1, 1, 1, 1), tile, block, fb=1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isfinite(want).sum() > want.size // 2  # a transform would smear the NaN wider
    check(got, want)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tile", (2, 4))
@pytest.mark.parametrize("nan", (False, True))
def test_writes_its_blocks_of_a_larger_tensor_in_place(tile, block, nan):
    """at: y as channel blocks at, at + 1, ... of a concatenation's tensor (a Fire module's
    expand, an Inception branch), every other block left as it was; with a NaN in x, through
    the direct conv's fallback, the same."""
    x, wt, b = case(2, 5, 17, 13, 7, seed=4)  # 17 channels: 2 blocks of 16, 3 of 8
    if nan:
        x[1, 2, 6, 3] = np.nan
    plan = prepare_winograd_nchwc(wt, b, pads=(1, 1, 1, 1), tile=tile, block=block,
                                  activation="relu")  # fmt: skip
    xb = to_blocked(x, block=block)
    alone = winograd_nchwc(xb, plan)
    mb = alone.shape[1]
    big = np.random.default_rng(5).standard_normal((2, mb + 3, 13, 7, block)).astype(np.float32)
    before = big.copy()
    assert winograd_nchwc(xb, plan, out=big, at=2) is big
    assert np.array_equal(big[:, 2 : 2 + mb], alone, equal_nan=True)
    assert np.array_equal(big[:, :2], before[:, :2])
    assert np.array_equal(big[:, 2 + mb :], before[:, 2 + mb :])
    check(from_blocked(alone, 17), reference(x, wt, b, (1, 1, 1, 1), "relu"))
    with pytest.raises(ValueError, match="blocks"):
        winograd_nchwc(xb, plan, out=big, at=4)  # past the end


def test_supports_says_why():
    assert supports((8, 8, 3, 3)) is None
    assert "strides (2, 2)" in supports((8, 8, 3, 3), strides=(2, 2))
    assert "3x3 only" in supports((8, 8, 5, 5))
    assert "group 2" in supports((8, 4, 3, 3), group=2)
    w = np.zeros((8, 8, 3, 3), np.float32)
    with pytest.raises(ValueError, match="strides"):
        prepare_winograd_nchwc(w, strides=(2, 2))
    with pytest.raises(ValueError, match="tile must be 2"):
        prepare_winograd_nchwc(w, tile=3)


def conv_kernel(strides, c=8):
    from fusion_patterns.conv import ConvKernel

    attrs = {"strides": list(strides), "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1,
             "auto_pad": "NOTSET", "activation": "relu"}  # fmt: skip
    _, wt, b = case(1, c, 8, 1, 1)
    return ConvKernel(attrs, wt, b, 4)


def test_the_winograd_tactics_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(WINOGRAD_SWITCH, raising=False)  # the default: both offered
    kernel = conv_kernel((1, 1))
    winos = [t.name for t in kernel.tactics if t.name.startswith("blocked-wino")]
    assert winos == ["blocked-wino2", "blocked-wino4"]
    monkeypatch.setenv(WINOGRAD_SWITCH, "0")
    kernel = conv_kernel((1, 1))
    assert not [t.name for t in kernel.tactics if t.name.startswith("blocked-wino")]
    assert f"{WINOGRAD_SWITCH}='0'" in kernel.winograd_reasons[2]
    monkeypatch.setenv(WINOGRAD_SWITCH, "2")  # F(2x2) only
    kernel = conv_kernel((1, 1))
    winos = [t.name for t in kernel.tactics if t.name.startswith("blocked-wino")]
    assert winos == ["blocked-wino2"]
    assert f"{WINOGRAD_SWITCH}='2'" in kernel.winograd_reasons[4]


def test_3x3_stride_1_offers_the_winograd_tactics(monkeypatch):
    monkeypatch.setenv(WINOGRAD_SWITCH, "4")
    kernel = conv_kernel((1, 1))
    names = [t.name for t in kernel.tactics]
    winos = [t for t in kernel.tactics if t.name.startswith("blocked-wino")]
    assert [t.name for t in winos] == ["blocked-wino2", "blocked-wino4"]
    assert names[0].startswith("blocked-f")  # the direct kernel stays first ("kernel" policy)
    x = np.random.default_rng(3).standard_normal((2, 8, 7, 7), dtype=np.float32)
    want = kernel(x)[0]
    for tactic in winos:
        got = from_blocked(tactic.run(to_blocked(x, block=tactic.in_blocks[0]))[0], 8)
        check(got, want)


def test_3x3_stride_2_does_not_and_says_why(monkeypatch):
    monkeypatch.setenv(WINOGRAD_SWITCH, "4")
    kernel = conv_kernel((2, 2))
    assert not [t.name for t in kernel.tactics if t.name.startswith("blocked-wino")]
    assert "strides (2, 2)" in kernel.winograd_reasons[2]
    wide = conv_kernel((1, 1), c=300)
    assert [t.name for t in wide.tactics if t.name.startswith("blocked-wino")] == ["blocked-wino2"]
    assert "300 input channels" in wide.winograd_reasons[4]
