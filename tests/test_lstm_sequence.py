"""LSTMSequence: unrolled chains of cells become one node, run as island, kernel, island, and
match onnxruntime on the unfused graph (and the native LSTM op with the same weights)."""

import numpy as np
import onnx
import pytest
from helpers import assert_all_close, assert_close, fused_ops, near_miss, run_ort
from onnx import numpy_helper

import fusion
from fusion.models import LSTMWeights, native_lstm, unrolled_lstm
from fusion.runtime import Session

CATALOG = fusion.default_catalog()
ATOL = 1e-5


def seq_feeds(steps, batch, size, hidden, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "X": rng.standard_normal((steps, batch, size)).astype(np.float32),
        "h0": rng.standard_normal((batch, hidden)).astype(np.float32),
        "c0": rng.standard_normal((batch, hidden)).astype(np.float32),
    }


def assert_same(got, want):
    assert_all_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "steps, batch, size, hidden",
    [(2, 1, 3, 5), (3, 1, 128, 256), (5, 2, 6, 13), (4, 3, 16, 33), (8, 16, 32, 64)],
)
def test_sequence_matches_onnxruntime(steps, batch, size, hidden):
    w = LSTMWeights.random(size, hidden, seed=steps)
    model = unrolled_lstm(w, steps, batch)
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ["LSTMSequence"]
    assert result.counts() == {"LSTMSequence": 1}  # the cells it absorbed are not counted
    assert [f.rule for f in result.fusions] == ["LSTMCell"] * steps + ["LSTMSequence"]
    onnx.checker.check_model(result.model, full_check=True)
    feeds = seq_feeds(steps, batch, size, hidden)
    session = Session(model, threads=2, catalog=CATALOG)
    got = session.run(None, feeds)
    assert_same(got, run_ort(model, feeds))
    assert_same(got, run_ort(native_lstm(w, steps, batch), feeds))
    # the Gathers before and Unsqueeze/Concat after fold into the node: no island at all
    assert [s.kind for s in session.steps] == ["kernel"]


def test_a_run_stores_only_the_outputs_it_reads():
    """The fused node has an output per step (Y, h_1 .. h_T, c_1 .. c_T); a run stores the
    three the graph returns, run_with_intermediates all of them, equal to onnxruntime's."""
    steps, batch, size, hidden = 4, 3, 5, 7
    model = unrolled_lstm(LSTMWeights.random(size, hidden, seed=3), steps, batch)
    session = Session(model, threads=2, catalog=CATALOG)
    (step,) = session.steps
    assert len(step.outputs) == 2 * steps + 1
    assert sorted(step.outputs[i] for i in step.live) == ["Y", "c_n", "h_n"]
    feeds = seq_feeds(steps, batch, size, hidden)
    stored = session.execute(feeds)
    assert [n for n in step.outputs if n in stored] == [step.outputs[i] for i in step.live]
    every = session.run_with_intermediates(feeds)
    assert all(name in every for name in step.outputs)
    want = dict(zip([o.name for o in model.graph.output], run_ort(model, feeds), strict=True))
    assert_close(every[step.outputs[steps]], want["h_n"], rtol=0, atol=ATOL)
    assert_close(every[step.outputs[1]], want["Y"][0], rtol=0, atol=ATOL)
    assert_same(session.run(None, feeds), run_ort(model, feeds))


def test_gather_used_elsewhere_stays_outside_in_one_island():
    steps, batch, size, hidden = 3, 2, 4, 6
    model = unrolled_lstm(LSTMWeights.random(size, hidden), steps, batch)
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    model.graph.node.append(onnx.helper.make_node("Relu", [gather.output[0]], ["x0_relu"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("x0_relu", 1, None))
    session = Session(model, threads=2, catalog=CATALOG)
    assert fused_ops(session.model) == ["LSTMSequence"]
    # one island before (Gathers, Relu), one after (Unsqueeze, Concat), never one per step
    assert [s.kind for s in session.steps] == ["island", "kernel", "island"]
    feeds = seq_feeds(steps, batch, size, hidden)
    assert_same(session.run(None, feeds), run_ort(model, feeds))


@pytest.mark.parametrize(
    "cell",
    [
        dict(form="matmul", gates="slice", order="igfo", forget_bias=1.0),
        dict(form="concat", gates="num_outputs", order="ogif"),
        dict(form="gemm", gates="split_attribute"),
    ],
    ids=["tf-slices", "concat-opset18", "gemm-opset11"],
)
def test_sequence_forms(cell):
    steps, batch, size, hidden = 4, 2, 5, 9
    w = LSTMWeights.random(size, hidden, seed=1)
    model = unrolled_lstm(w, steps, batch, **cell)
    session = Session(model, threads=2, catalog=CATALOG)
    assert fused_ops(session.model) == ["LSTMSequence"]
    feeds = seq_feeds(steps, batch, size, hidden)
    assert_same(session.run(None, feeds), run_ort(model, feeds))


def test_initial_state_from_another_node_and_an_h_read_outside():
    """h0 computed by a one-output node (Tanh) in front of the first cell, and one step's h
    also a graph output: the chain finder must not take the Tanh for a cell (it crashed)."""
    steps, batch, size, hidden = 4, 2, 5, 6
    model = unrolled_lstm(LSTMWeights.random(size, hidden, seed=2), steps, batch)
    graph = model.graph
    graph.input[1].name = "h0_raw"
    graph.node.insert(0, onnx.helper.make_node("Tanh", ["h0_raw"], ["h0"]))
    mid = next(n for n in graph.node if n.op_type == "Unsqueeze").input[0]  # step 1's h
    graph.output.append(onnx.helper.make_tensor_value_info(mid, 1, None))
    session = Session(model, threads=2, catalog=CATALOG)
    assert "LSTMSequence" in fused_ops(session.model)
    feeds = seq_feeds(steps, batch, size, hidden)
    feeds["h0_raw"] = feeds.pop("h0")
    assert_same(session.run(None, feeds), run_ort(model, feeds))


def test_one_step_stays_a_cell():
    w = LSTMWeights.random(4, 6)
    model = unrolled_lstm(w, 1, 1)
    session = Session(model, threads=2, catalog=CATALOG)
    assert fused_ops(session.model) == ["LSTMCell"]
    feeds = seq_feeds(1, 1, 4, 6)
    assert_same(session.run(None, feeds), run_ort(model, feeds))


def test_cells_with_other_weights_do_not_chain_and_say_why():
    """Two layers' worth of weights in one chain: step 2 onwards uses a copy with one change."""
    model = unrolled_lstm(LSTMWeights.random(4, 6), 3, 2)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    tensor = next(t for t in model.graph.initializer if t.name == gemms[0].input[1])
    changed = numpy_helper.to_array(tensor) + np.float32(1)
    model.graph.initializer.append(numpy_helper.from_array(changed, "W_other"))
    for gemm in gemms[2:]:  # cells 2 and 3 read W_other
        if gemm.input[1] == tensor.name:
            gemm.input[1] = "W_other"
    fused = ["LSTMCell", "LSTMSequence"]  # the last two cells chain, the first stays a cell
    near_miss(model, "LSTMSequence", "has other weights (W)", catalog=CATALOG, fused=fused)
    feeds = seq_feeds(3, 2, 4, 6)
    assert_same(Session(model, threads=2, catalog=CATALOG).run(None, feeds), run_ort(model, feeds))


def test_function_body_runs_in_onnxruntime():
    """The sequence's body inlines its cells' bodies: onnxruntime cannot call an overloaded
    function from a function body."""
    model = unrolled_lstm(LSTMWeights.random(3, 4), 3, 2)
    result = fusion.rewrite(model, CATALOG)
    feeds = seq_feeds(3, 2, 3, 4)
    assert_same(run_ort(result.model, feeds), run_ort(model, feeds))


@pytest.mark.parametrize("form", ["gemm", "matmul", "concat", "concat_gemm"])
@pytest.mark.parametrize("steps, batch", [(4, 1), (3, 3)])
def test_equal_input_and_hidden_sizes_chain(form, steps, batch):
    """I = H: the cell pattern cannot tell x from h by the weights' shapes; the chain takes
    them from the data flow (h' of step t arrives as step t + 1's h)."""
    size = hidden = 12
    w = LSTMWeights.random(size, hidden, seed=4)
    model = unrolled_lstm(w, steps, batch, form=form, order="igfo", forget_bias=1.0)
    session = Session(model, threads=2, catalog=CATALOG)
    assert fused_ops(session.model) == ["LSTMSequence"]
    feeds = seq_feeds(steps, batch, size, hidden)
    assert_same(session.run(None, feeds), run_ort(model, feeds))


def test_h_and_x_exchanged_in_every_cell_chain():
    """Each cell adds h R before x W (so the pattern binds the step's x as h): still one chain,
    and the numbers are right."""
    steps, batch, hidden = 4, 2, 12
    model = unrolled_lstm(LSTMWeights.random(hidden, hidden, seed=6), steps, batch)
    for node in model.graph.node:
        if node.op_type == "Add" and all(i.startswith("/Gemm") for i in node.input):
            node.input[:] = node.input[::-1]
    result = fusion.rewrite(model, CATALOG)
    assert result.counts() == {"LSTMSequence": 1}
    feeds = seq_feeds(steps, batch, hidden, hidden)
    session = Session(model, threads=2, catalog=CATALOG)
    assert_same(session.run(None, feeds), run_ort(model, feeds))


def test_a_cell_reading_c_but_not_h_says_why_no_chain():
    """Step 2 reads step 1's c' but h from the graph input: no sequence, and explain says why."""
    model = unrolled_lstm(LSTMWeights.random(4, 6), 2, 2)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    gemms[3].input[0] = "h0"  # step 2's h R reads h0 instead of h_1
    near_miss(
        model, "LSTMSequence", "reads c' of", "but not its h'", catalog=CATALOG,
        fused=["LSTMCell", "LSTMCell"],
    )  # fmt: skip
    feeds = seq_feeds(2, 2, 4, 6)
    assert_same(Session(model, threads=2, catalog=CATALOG).run(None, feeds), run_ort(model, feeds))
