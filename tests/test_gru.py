"""GRUCell, GRUSequence, GRUOp: exporter forms fuse and match onnxruntime on the unfused graph
(and the native GRU op), near-misses say why, the kernel matches a naive NumPy GRU."""

import numpy as np
import onnx
import pytest
from helpers import assert_all_close, assert_close, fused_ops, naive_gru, near_miss, run_ort
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion.models import GRUWeights, native_gru, unrolled_gru
from fusion.runtime import Session
from fusion_kernels import gru as gru_kernel
from fusion_kernels import lstm as kernel
from fusion_kernels.config import get_threads, set_threads
from fusion_kernels.gru import gru_sequence, prepare_gru

CATALOG = fusion.default_catalog()
ATOL = 1e-5


def feeds(steps, batch, size, hidden, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "X": rng.standard_normal((steps, batch, size)).astype(np.float32),
        "h0": rng.standard_normal((batch, hidden)).astype(np.float32),
    }


def plan_of(w: GRUWeights, linear_before_reset=1):
    wz = w.reorder("zrn")
    return prepare_gru(wz.W.T, wz.R.T, wz.Wb, wz.Rb, linear_before_reset)


@pytest.mark.parametrize("lbr", [1, 0])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "steps, batch, size, hidden",
    [(1, 1, 1, 1), (5, 1, 20, 130), (3, 5, 17, 67), (4, 16, 24, 40), (2, 33, 6, 9), (1, 13, 3, 8)],
)
def test_kernel_matches_naive(steps, batch, size, hidden, threads, lbr, monkeypatch):
    """Reset after the product: row by row (batch <= ROWS_MAX) and the batch tile; before it:
    two stages per step, row by row; one thread and two."""
    monkeypatch.setattr(kernel, "SERIAL_MACS_PER_STEP", 0)
    w = GRUWeights.random(size, hidden, seed=5)
    x = feeds(steps, batch, size, hidden)
    old = get_threads()
    set_threads(threads)
    try:
        got = gru_sequence(x["X"], x["h0"], plan_of(w, lbr))
    finally:
        set_threads(old)
    assert got.shape == (steps, batch, hidden) and got.flags.c_contiguous
    want = naive_gru(x["X"], x["h0"], w, lbr)
    assert_close(got, want, rtol=0, atol=ATOL, check_dtype=False)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_late_thread_delays_nobody_with_the_reset_before(batch, parts):
    """Two stages per step: part 1 alone, the other parts' items marked STARTED and never done,
    computes every item of every stage (stage B reads r h of all units) and gets the numbers."""
    w = GRUWeights.random(9, 20, seed=7)
    x = feeds(3, batch, 9, 20)
    got, done = gru_kernel.run_part(x["X"], x["h0"], plan_of(w, 0), 1, parts, slice(None, None, 2))
    assert (done == kernel.DONE).all()
    want = naive_gru(x["X"], x["h0"], w, 0)
    assert_close(got, want, rtol=0, atol=ATOL, check_dtype=False)


def test_an_lstm_plan_is_refused():
    plan = kernel.prepare_lstm(np.zeros((3, 8), np.float32), np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="prepare_gru"):
        gru_sequence(np.zeros((1, 1, 3), np.float32), np.zeros((1, 2), np.float32), plan)


@pytest.mark.parametrize("form", ["torch", "keras"])
@pytest.mark.parametrize("steps, batch", [(1, 1), (4, 1), (3, 3)])
def test_unrolled_gru_fuses_and_matches_onnxruntime(form, steps, batch):
    size, hidden = 7, 13
    w = GRUWeights.random(size, hidden, seed=steps)
    model = unrolled_gru(w, steps, batch, form=form)
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == (["GRUSequence"] if steps > 1 else ["GRUCell"])
    onnx.checker.check_model(result.model, full_check=True)
    x = feeds(steps, batch, size, hidden)
    want = run_ort(model, x)
    session = Session(model, threads=2, catalog=CATALOG)
    assert_all_close(session.run(None, x), want, rtol=0, atol=ATOL)
    assert_all_close(run_ort(result.model, x), want, rtol=0, atol=ATOL)
    assert_all_close(want, run_ort(native_gru(w, steps, batch), x), rtol=0, atol=ATOL)
    if steps > 1:
        assert [s.kind for s in session.steps] == ["kernel"]


def test_equal_input_and_hidden_sizes_chain():
    w = GRUWeights.random(12, 12, seed=2)
    model = unrolled_gru(w, 4, 2)
    assert fusion.rewrite(model, CATALOG).counts() == {"GRUSequence": 1}


def test_gates_out_of_order_are_a_near_miss():
    """The x product's blocks in one order, the h product's in another: not a GRU."""
    model = unrolled_gru(GRUWeights.random(4, 5), 1, 2)
    split_h = [n for n in model.graph.node if n.op_type == "Split"][1]
    split_h.output[:] = [split_h.output[1], split_h.output[0], split_h.output[2]]
    near_miss(model, "GRUCell", "the gate blocks of x W [1, 0, 2] and of h R [0, 1, 2] differ",
              catalog=CATALOG)  # fmt: skip


def test_an_h_split_that_is_not_two_gates_is_a_near_miss():
    """Keras GRU(reset_after=False) (tests/fixtures): h's product cut [H, H, 0]; cut otherwise,
    it is not the z and r blocks."""
    from pathlib import Path

    model = onnx.load(str(Path(__file__).parent / "fixtures" / "keras_gru_reset_before.onnx"))
    sizes = next(t for t in model.graph.initializer if list(t.dims) == [3] and "split" in t.name)
    sizes.CopyFrom(numpy_helper.from_array(np.array([12, 8, 4], np.int64), sizes.name))
    near_miss(model, "GRUCell", "split_h: the Split must cut the product into 2 gates of 12",
              catalog=CATALOG, fused=[])  # fmt: skip


def gru_model(size, hidden, direction="forward", states=True, lbr=1, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(size * hidden)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.uniform(-0.3, 0.3, shape).astype(np.float32), name)

    inits = [weight("W", dirs, 3 * hidden, size), weight("R", dirs, 3 * hidden, hidden)]
    inits.append(weight("B", dirs, 6 * hidden))
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", size])]
    names = ["X", "W", "R", "B"]
    if states:
        names += ["", "h0"]
        inputs.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, [dirs, "N", hidden]))
    node = helper.make_node("GRU", names, ["Y", "Y_h"], hidden_size=hidden, direction=direction,
                            linear_before_reset=lbr, **attrs)  # fmt: skip
    outs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)
        for name, dims in (("Y", ["T", dirs, "N", hidden]), ("Y_h", [dirs, "N", hidden]))
    ]
    graph = helper.make_graph([node], "gru", inputs, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("lbr", [1, 0])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("states", [True, False])
def test_gru_op_runs_on_the_kernel(direction, states, lbr):
    model = gru_model(5, 13, direction, states, lbr)
    assert fused_ops(fusion.rewrite(model, CATALOG).model) == ["GRUOp"]
    session = Session(model, threads=2, catalog=CATALOG)
    assert [s.kind for s in session.steps] == ["kernel"]
    for steps, batch in ((1, 1), (4, 3), (3, 17)):
        x = feeds(steps, batch, 5, 13)
        x = {"X": x["X"]} | ({"h0": np.stack([x["h0"]] * (1 + (direction == "bidirectional")))}
                             if states else {})  # fmt: skip
        assert_all_close(session.run(None, x), run_ort(model, x), rtol=0, atol=ATOL)


def test_gru_op_with_clip_is_a_near_miss():
    near_miss(gru_model(4, 5, clip=2.0), "GRUOp", "clip=2.0: the kernel does not clip",
              catalog=CATALOG)  # fmt: skip


def test_unrolled_gru_as_the_standard_op():
    w = GRUWeights.random(5, 13, seed=1)
    model = unrolled_gru(w, 4, "N", form="keras")
    result = fusion.rewrite(model, CATALOG, standard_ops=True)
    assert fused_ops(result.model) == [] and not result.model.functions
    assert [n.op_type for n in result.model.graph.node].count("GRU") == 1
    onnx.checker.check_model(result.model, full_check=True)
    for batch in (1, 3):
        x = feeds(4, batch, 5, 13)
        assert_all_close(run_ort(result.model, x), run_ort(model, x), rtol=0, atol=ATOL)
        assert fusion.verify(model, result.model, inputs=x).ok
