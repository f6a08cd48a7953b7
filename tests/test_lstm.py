"""LSTMCell: every exporter form fuses and matches onnxruntime on the unfused graph; near-misses
say why; the kernel matches a naive NumPy cell."""

import numpy as np
import onnx
import pytest
from helpers import assert_all_close, assert_close, assert_fuses, naive_lstm, near_miss, run_ort
from onnx import numpy_helper

import fusion
from fusion import Catalog
from fusion.models import LSTMWeights, cell_model, unrolled_lstm
from fusion.runtime import Session
from fusion_kernels import lstm as kernel
from fusion_kernels.config import get_threads, set_threads
from fusion_kernels.lstm import lstm_sequence, prepare_lstm
from fusion_patterns import lstm

CATALOG = fusion.default_catalog()
ATOL = 1e-5


def cell_feeds(batch, size, hidden, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((batch, size)).astype(np.float32),
        "h": rng.standard_normal((batch, hidden)).astype(np.float32),
        "c": rng.standard_normal((batch, hidden)).astype(np.float32),
    }


def check_fused_cell(model, feeds):
    result = assert_fuses(model, ["LSTMCell"], CATALOG, rtol=0, atol=ATOL)
    want = run_ort(model, feeds)
    for got in (
        run_ort(result.model, feeds),
        Session(model, threads=2, catalog=CATALOG).run(None, feeds),
    ):
        assert_all_close(got, want, rtol=0, atol=ATOL)
    return result


FORMS = [
    dict(form="gemm"),  # PyTorch nn.LSTMCell, split sizes as input
    dict(form="gemm", gates="split_attribute"),  # opset < 13
    dict(form="gemm", gates="num_outputs", order="fgoi"),  # opset 18
    dict(form="matmul", assoc=0, gates="slice"),
    dict(form="matmul", assoc=1, order="igfo", forget_bias=1.0),  # TF BasicLSTMCell
    dict(form="matmul", assoc=2, gates="slice", order="ogif"),
    dict(form="concat", order="igfo", forget_bias=1.0),  # TF / Keras concat form
    dict(form="concat", gates="slice", order="gfoi"),
]


@pytest.mark.parametrize("cell", FORMS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_cell_forms_fuse_and_match_onnxruntime(cell):
    size, hidden, batch = 6, 13, 3  # hidden not a multiple of 8
    model = cell_model(LSTMWeights.random(size, hidden, seed=1), batch, **cell)
    check_fused_cell(model, cell_feeds(batch, size, hidden))


@pytest.mark.parametrize("batch, size, hidden", [(1, 1, 1), (1, 128, 256), (5, 3, 17), (16, 32, 8)])
def test_cell_sizes(batch, size, hidden):
    model = cell_model(LSTMWeights.random(size, hidden, seed=2), batch, form="gemm")
    check_fused_cell(model, cell_feeds(batch, size, hidden))


def test_gate_roles_come_from_structure_not_position():
    """Every order of the four gate blocks fuses, with the blocks recorded per role."""
    for order in ("ifgo", "oigf", "gofi"):
        model = cell_model(LSTMWeights.random(4, 5), 2, order=order)
        node = fusion.rewrite(model, CATALOG).model.graph.node[0]
        gates = next(
            onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "gates"
        )
        assert list(gates) == [order.index(g) for g in "ifgo"]


def _edit(model, op_type, fn):
    """Apply fn to the first node of op_type; returns the model."""
    fn(next(n for n in model.graph.node if n.op_type == op_type))
    return model


def _near_miss(model):
    return near_miss(model, "LSTMCell", catalog=CATALOG, fused=[])


def test_intermediate_used_outside_prevents_fusion():
    model = cell_model(LSTMWeights.random(4, 5), 2, extra_output="Tanh")
    assert "is also a graph output" in _near_miss(model)


def _gemm_attributes(**attrs):
    def edit(node):
        node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in attrs.items())

    return edit


def test_gemm_alpha_and_beta_fold_into_the_weights():
    model = _edit(cell_model(LSTMWeights.random(4, 5), 2), "Gemm", _gemm_attributes(alpha=0.5))
    model = _edit(model, "Gemm", _gemm_attributes(beta=-2.0))  # the same first Gemm
    check_fused_cell(model, cell_feeds(2, 4, 5))


def test_gemm_with_transposed_input_is_a_near_miss():
    model = _edit(cell_model(LSTMWeights.random(4, 5), 2), "Gemm", _gemm_attributes(transA=1))
    assert "transA=1, pattern needs 0" in _near_miss(model)


def test_split_along_the_wrong_axis_is_a_near_miss():
    model = _edit(
        cell_model(LSTMWeights.random(4, 5), 2),
        "Split",
        lambda n: n.attribute[0].CopyFrom(onnx.helper.make_attribute("axis", 0)),
    )
    assert "gates must be split along the last axis" in _near_miss(model)


def test_slice_that_is_not_a_gate_block_is_a_near_miss():
    model = cell_model(LSTMWeights.random(4, 5), 2, gates="slice")
    ends = next(n for n in model.graph.node if n.op_type == "Slice").input[2]
    init = next(t for t in model.graph.initializer if t.name == ends)
    init.CopyFrom(
        numpy_helper.from_array(np.array([14], np.int64), ends)
    )  # block [10:15] -> [10:14]
    assert "is not a block of 5 columns" in _near_miss(model)


def test_output_gate_without_sigmoid_is_a_near_miss():
    model = cell_model(LSTMWeights.random(4, 5), 2)
    sig_o = [n for n in model.graph.node if n.op_type == "Sigmoid"][-1]
    sig_o.op_type = "Relu"
    assert "pattern needs Sigmoid" in _near_miss(model)


def test_unrolled_cells_without_sequence_rule_fuse_one_by_one():
    model = unrolled_lstm(LSTMWeights.random(4, 6), steps=3, batch=2)
    assert_fuses(model, ["LSTMCell"] * 3, Catalog([lstm.RULE]), rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "steps, batch, size, hidden", [(1, 1, 1, 1), (3, 1, 7, 9), (4, 2, 5, 16), (2, 7, 33, 70)]
)
def test_kernel_matches_naive(steps, batch, size, hidden):
    w = LSTMWeights.random(size, hidden, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((steps, batch, size)).astype(np.float32)
    h0, c0 = (rng.standard_normal((batch, hidden)).astype(np.float32) for _ in range(2))
    plan = prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb)
    for got, want in zip(lstm_sequence(x, h0, c0, plan), naive_lstm(x, h0, c0, w), strict=True):
        assert_close(got, want, rtol=0, atol=ATOL, check_dtype=False)


def test_kernel_validates_shapes():
    plan = prepare_lstm(np.zeros((3, 8), np.float32), np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match=r"x must be \[T, B, 3\]"):
        lstm_sequence(np.zeros((1, 1, 4), np.float32), np.zeros((1, 2)), np.zeros((1, 2)), plan)
    with pytest.raises(ValueError, match=r"c0 must be \[1, 2\]"):
        lstm_sequence(np.zeros((1, 1, 3), np.float32), np.zeros((1, 2)), np.zeros((2, 2)), plan)


@pytest.mark.parametrize("steps, batch", [(0, 1), (0, 3), (2, 0), (0, 0)])
def test_empty_sequences_have_the_right_shapes(steps, batch):
    plan = prepare_lstm(np.ones((3, 8), np.float32), np.ones((2, 8), np.float32))
    x, h = np.ones((steps, batch, 3), np.float32), np.zeros((batch, 2), np.float32)
    for out in lstm_sequence(x, h, h, plan):
        assert out.shape == (steps, batch, 2) and out.dtype == np.float32


# Kernel paths: batches up to ROWS_MAX run a GEMV per block and row, larger ones a tile of R
# batch rows x a unit group's 4 gate vectors (rows past the batch zero-padded); one thread
# runs everything in order, two share one parallel region: each thread does its own run of
# items, then any item of the other's run still open.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "steps, batch, size, hidden",
    [
        (5, 1, 20, 130),
        (3, 5, 17, 67),
        (4, 16, 24, 40),
        (1, 1, 128, 256),
        (2, 3, 8, 512),
        (3, 24, 10, 20),
        (2, 33, 6, 9),
        (1, 16, 24, 40),
        (2, 8, 9, 16),
    ],
)
def test_kernel_paths_match_naive(steps, batch, size, hidden, threads, monkeypatch):
    monkeypatch.setattr(kernel, "SERIAL_MACS_PER_STEP", 0)  # threads=2: always parallel
    w = LSTMWeights.random(size, hidden, seed=5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((steps, batch, size)).astype(np.float32)
    h0, c0 = (rng.standard_normal((batch, hidden)).astype(np.float32) for _ in range(2))
    plan = prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb)
    # Scratch is reused between calls: poison it, so that reading stale scratch would show.
    floats, ints = kernel.workspace(x, plan)
    floats[:], ints[:] = np.nan, 12345
    old = get_threads()
    set_threads(threads)
    try:
        got = lstm_sequence(x, h0, c0, plan)
    finally:
        set_threads(old)
    for g, want in zip(got, naive_lstm(x, h0, c0, w), strict=True):
        assert g.flags.c_contiguous and g.shape == (steps, batch, hidden)
        assert_close(g, want, rtol=0, atol=ATOL, check_dtype=False)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("batch", [1, 3, 6, 20])
def test_a_late_thread_delays_nobody(batch, parts):
    """The other parts never run: part 1 alone does its own run of every stage, then all of
    the others' items (those marked STARTED after a bounded wait), and gets the same numbers."""
    steps, size, hidden = 3, 9, 20
    w = LSTMWeights.random(size, hidden, seed=7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((steps, batch, size)).astype(np.float32)
    h0, c0 = (rng.standard_normal((batch, hidden)).astype(np.float32) for _ in range(2))
    plan = prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb)
    *got, done = kernel.run_part(x, h0, c0, plan, 1, parts, started=slice(None, None, 2))
    assert (done == kernel.DONE).all()
    for g, want in zip(got, naive_lstm(x, h0, c0, w), strict=True):
        assert_close(g, want, rtol=0, atol=ATOL, check_dtype=False)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_an_infinite_input_stays_out_of_the_other_units(batch):
    """hidden 7 pads the last block with a unit whose weights are zero: 0 * inf is NaN, which
    must not reach the real units through the padded unit's h (it did, batch > 1)."""
    w = LSTMWeights.random(5, 7, seed=11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, batch, 5)).astype(np.float32)
    x[0, 0, 1] = np.inf
    h0 = c0 = np.zeros((batch, 7), np.float32)
    got = lstm_sequence(x, h0, c0, prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb))
    with np.errstate(invalid="ignore", over="ignore"):
        want = naive_lstm(x, h0, c0, w)
    for g, ref in zip(got, want, strict=True):
        assert np.isfinite(ref).all()
        assert_close(g, ref, rtol=0, atol=ATOL, check_dtype=False)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_read_only_inputs_reuse_the_compiled_kernel(batch):
    """Constant initial states are read-only arrays; Numba would compile the kernel again
    for them (seconds), so they are passed on as writable copies."""
    w = LSTMWeights.random(4, 6, seed=2)
    x = np.ones((2, batch, 4), np.float32)
    h = np.zeros((batch, 6), np.float32)
    for a in (x, h):
        a.setflags(write=False)
    lstm_sequence(x, h, h, prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb))
    signatures = kernel.compiled_signatures()
    assert not any(getattr(t, "readonly", False) for sig in signatures for t in sig)


def test_workspace_sizes_cover_the_scratch():
    """The workspace size (Python) and the carving (Numba) count the same scratch."""
    for steps, batch, size, hidden in [(3, 1, 5, 7), (2, 3, 3, 8), (4, 17, 6, 20)]:
        w = LSTMWeights.random(size, hidden, seed=1)
        plan = prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb)
        x = np.ones((steps, batch, size), np.float32)
        h = np.zeros((batch, hidden), np.float32)
        scratch, done, n_floats, n_ints = kernel.carve(x, h, h, plan)
        used = scratch[0].size + scratch[1].size  # xp + gx, or z + c: the workspace's floats
        assert used <= n_floats and done.size == n_ints


@pytest.mark.parametrize("batch", [2, 17])  # row by row, batch tile
def test_kernel_keeps_nan(batch):
    """A NaN in one batch row stays NaN in that row's outputs (the gate math clamps with
    compares, not min/max) and does not leak into the other rows."""
    w = LSTMWeights.random(6, 16, seed=9)
    x = np.ones((2, batch, 6), np.float32)
    x[0, 1, 2] = np.nan
    h0 = c0 = np.zeros((batch, 16), np.float32)
    hs, cs = lstm_sequence(x, h0, c0, prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb))
    others = [r for r in range(batch) if r != 1]
    assert np.isnan(hs[:, 1]).all() and np.isnan(cs[:, 1]).all()
    assert np.isfinite(hs[:, others]).all() and np.isfinite(cs[:, others]).all()


@pytest.mark.parametrize("batch", [2, 3, 5])
def test_small_batches_row_by_row_and_tiled(batch, monkeypatch):
    """Batches up to ROWS_MAX run row by row; the batch tile (forced here) gives the same."""
    w = LSTMWeights.random(9, 13, seed=batch)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((3, batch, 9)).astype(np.float32)
    h0, c0 = (rng.standard_normal((batch, 13)).astype(np.float32) for _ in range(2))
    plan = prepare_lstm(w.W.T, w.R.T, w.Wb + w.Rb)
    want = naive_lstm(x, h0, c0, w)
    for rows_max in (kernel.ROWS_MAX, 0):
        monkeypatch.setattr(kernel, "ROWS_MAX", rows_max)
        for got, ref in zip(lstm_sequence(x, h0, c0, plan), want, strict=True):
            assert got.flags.c_contiguous and got.shape == (3, batch, 13)
            assert_close(got, ref, rtol=0, atol=ATOL, check_dtype=False)
