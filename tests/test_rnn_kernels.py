"""The LSTM and GRU sequence kernels against onnxruntime's own LSTM / GRU ops, on odd hidden
sizes (1, 3, 17, 100: tails of every block), batches 1, 2 (row by row), 5 and 16 (the batch tile),
1 and 5 steps, and with NaN and inf in the inputs, at both SIMD widths in one process (a plan's
width: 16-lane code runs on AVX2 too, each vector split in two by LLVM).

onnxruntime's native ops clamp each gate with min/max before their activation fits, which turns
a NaN pre-activation into a number; the kernels keep IEEE NaN (as onnxruntime on the unfused
graph does), so rows with a NaN or inf are compared with the float64 NumPy recurrence instead,
the other rows with onnxruntime."""

import numpy as np
import pytest
from helpers import assert_close, naive_gru, naive_lstm, run_ort
from onnx import TensorProto, helper

from fusion.models import GRUWeights, LSTMWeights
from fusion_kernels.gru import gru_sequence, prepare_gru
from fusion_kernels.lstm import lstm_sequence, prepare_lstm

RTOL, ATOL = 1e-4, 1e-5
SIZE = 7  # input features
WIDTHS = (8, 16)


def _model(op, gates, steps, batch, hidden, w, r, b, **attrs):
    """One ONNX LSTM or GRU node over X [T, B, I] and initial states, outputs Y, Y_h (, Y_c)."""
    f = TensorProto.FLOAT
    states = ["initial_h", "initial_c"] if op == "LSTM" else ["initial_h"]
    outs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    node = helper.make_node(op, ["X", "W", "R", "B", "", *states], outs, hidden_size=hidden,
                            **attrs)  # fmt: skip
    inits = [helper.make_tensor(n, f, a.shape, a.ravel()) for n, a in (("W", w), ("R", r),
                                                                       ("B", b))]  # fmt: skip
    inputs = [helper.make_tensor_value_info("X", f, [steps, batch, w.shape[2]])]
    inputs += [helper.make_tensor_value_info(s, f, [1, batch, hidden]) for s in states]
    outputs = [helper.make_tensor_value_info(o, f, None) for o in outs]
    graph = helper.make_graph([node], op.lower(), inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _data(steps, batch, hidden, gates, seed, special):
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(hidden)
    w = rng.uniform(-scale, scale, (1, gates * hidden, SIZE)).astype(np.float32)
    r = rng.uniform(-scale, scale, (1, gates * hidden, hidden)).astype(np.float32)
    b = rng.uniform(-scale, scale, (1, 2 * gates * hidden)).astype(np.float32)
    x = rng.standard_normal((steps, batch, SIZE)).astype(np.float32)
    h0, c0 = rng.standard_normal((2, 1, batch, hidden)).astype(np.float32)
    if special:  # one batch row each: a NaN, +inf and -inf in its inputs
        x[0, 0, 0] = np.nan
        if batch > 1:
            x[0, 1, 1], x[-1, 1, 2] = np.inf, -np.inf
    return x, w, r, b, h0, c0


def _blocks(a, order, hidden):
    """Gate blocks of a [G H, ...] array in `order` (indices into its blocks)."""
    return np.concatenate([a[g * hidden : (g + 1) * hidden] for g in order])


def _clean(batch, special):
    """The batch rows without a NaN or inf in their inputs (see _data)."""
    return np.arange(2 if special else 0, batch)


CASES = [(steps, batch, hidden) for steps in (1, 5) for batch in (1, 2, 5, 16)
         for hidden in (1, 3, 17, 100)]  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("steps, batch, hidden", CASES)
def test_lstm_matches_onnxruntime(steps, batch, hidden, special, width):
    x, w, r, b, h0, c0 = _data(steps, batch, hidden, 4, steps + batch + hidden, special)
    want = run_ort(_model("LSTM", 4, steps, batch, hidden, w, r, b),
                   {"X": x, "initial_h": h0, "initial_c": c0})  # fmt: skip
    ifgo = (0, 2, 3, 1)  # ONNX's gates are i, o, f, c
    bias = b[0, : 4 * hidden] + b[0, 4 * hidden :]
    plan = prepare_lstm(_blocks(w[0], ifgo, hidden).T, _blocks(r[0], ifgo, hidden).T,
                        _blocks(bias, ifgo, hidden), width=width)  # fmt: skip
    hs, cs = lstm_sequence(x, h0[0], c0[0], plan)
    rows = _clean(batch, special)
    assert_close(hs[:, rows], want[0][:, 0, rows], RTOL, ATOL, what="Y")
    assert_close(hs[-1, rows], want[1][0, rows], RTOL, ATOL, what="Y_h")
    assert_close(cs[-1, rows], want[2][0, rows], RTOL, ATOL, what="Y_c")
    if special:
        weights = LSTMWeights(*(_blocks(a, ifgo, hidden) for a in (w[0], r[0], *b.reshape(2, -1))))
        with np.errstate(invalid="ignore", over="ignore"):
            ref_h, ref_c = naive_lstm(x, h0[0], c0[0], weights)
        assert_close(hs, ref_h, RTOL, ATOL, check_dtype=False, what="Y (NumPy)")
        assert_close(cs, ref_c, RTOL, ATOL, check_dtype=False, what="c (NumPy)")
        assert np.isnan(hs[-1, 0]).all()  # the NaN reaches every later state of its row


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("lbr", [1, 0])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("steps, batch, hidden", CASES)
def test_gru_matches_onnxruntime(steps, batch, hidden, special, lbr, width):
    x, w, r, b, h0, _ = _data(steps, batch, hidden, 3, steps + batch + hidden, special)
    model = _model("GRU", 3, steps, batch, hidden, w, r, b, linear_before_reset=lbr)
    want = run_ort(model, {"X": x, "initial_h": h0})
    zrn = (0, 1, 2)  # ONNX's gates are z, r, h: the kernel's order already
    plan = prepare_gru(_blocks(w[0], zrn, hidden).T, _blocks(r[0], zrn, hidden).T,
                       b[0, : 3 * hidden], b[0, 3 * hidden :], lbr, width=width)  # fmt: skip
    hs = gru_sequence(x, h0[0], plan)
    rows = _clean(batch, special)
    assert_close(hs[:, rows], want[0][:, 0, rows], RTOL, ATOL, what="Y")
    assert_close(hs[-1, rows], want[1][0, rows], RTOL, ATOL, what="Y_h")
    if special:
        rzn = (1, 0, 2)  # GRUWeights' order
        weights = GRUWeights(*(_blocks(a, rzn, hidden) for a in (w[0], r[0], *b.reshape(2, -1))))
        with np.errstate(invalid="ignore", over="ignore"):
            ref = naive_gru(x, h0[0], weights, lbr)
        assert_close(hs, ref, RTOL, ATOL, check_dtype=False, what="Y (NumPy)")
        assert np.isnan(hs[-1, 0]).all()


def test_the_kernels_take_the_process_widths_only():
    """8 or 16 lanes (kernels.simd.width's choices); 4 is refused, not run half-computed (a
    one-row input projection at 4 lanes set 16 of a block's 32 columns)."""
    wx, wh = np.zeros((3, 8), np.float32), np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="8 or 16 lanes"):
        prepare_lstm(wx, wh, width=4)
    with pytest.raises(ValueError, match="8 or 16 lanes"):
        prepare_gru(np.zeros((3, 6), np.float32), np.zeros((2, 6), np.float32), width=4)
