"""Recurrent nets as the exporters write them (tests/fixtures, made by export_torch.py and
export_keras.py): each fuses into the expected nodes and matches onnxruntime on the unfused
graph at batch 1 and 3."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_all_close, fused_ops, run_ort

import fusion
from fusion.runtime import Session

FIXTURES = Path(__file__).parent / "fixtures"
CATALOG = fusion.default_catalog()
ATOL = 1e-5


def load(name: str) -> onnx.ModelProto:
    return onnx.load(str(FIXTURES / name))


def feeds(model: onnx.ModelProto, batch: int, seed: int = 0) -> dict:
    """Random inputs; the dynamic axis (batch) takes `batch`."""
    rng = np.random.default_rng(seed)
    out = {}
    for inp in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in
                inp.type.tensor_type.shape.dim]  # fmt: skip
        out[inp.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def check(name: str, fused: list[str], steps: list[str] | None = None):
    """The fixture fuses into `fused` (graph order) and matches onnxruntime; `steps`: the
    session's step kinds (kernel / island)."""
    model = load(name)
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == fused, result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    session = Session(model, threads=2, catalog=CATALOG)
    if steps is not None:
        assert [s.kind for s in session.steps] == steps
    for batch in (1, 3):
        x = feeds(model, batch)
        want = run_ort(model, x)
        assert_all_close(session.run(None, x), want, rtol=0, atol=ATOL)
        assert_all_close(run_ort(result.model, x), want, rtol=0, atol=ATOL)
    return result


@pytest.mark.parametrize(
    "name, fused, steps",
    [
        # nn.LSTMCell(12, 12) in a loop: input size = hidden size, one sequence, not 5 cells
        ("lstmcell_equal.onnx", ["LSTMSequence"], ["kernel"]),
        ("lstmcell_equal_dynamo.onnx", ["LSTMSequence"], ["kernel"]),  # torch.export's form
        # three layers 6 -> 12 -> 12 -> 10 (the second and third of equal width)
        ("lstmcell_stacked.onnx", ["LSTMSequence"] * 3, ["kernel"] * 3),
        # tf.compat.v1 LSTMCell: Concat([x, h]) @ W + b, gates i j f o, Add(f, forget_bias)
        ("tf_lstmcell.onnx", ["LSTMSequence"], ["kernel"]),
        ("tf_lstmcell_equal.onnx", ["LSTMSequence"], ["kernel"]),
        # Keras LSTM(unroll=True): Transpose, tf.unstack, MatMul + MatMul + bias, tf.stack
        ("keras_lstm.onnx", ["LSTMSequence"], None),
        ("keras_lstm_stacked.onnx", ["LSTMSequence"] * 2, None),
        # nn.GRUCell(12, 12) loop; 6 -> 12 -> 10; Keras GRU, reset after and before h R
        ("grucell_equal.onnx", ["GRUSequence"], ["kernel"]),
        ("grucell_stacked.onnx", ["GRUSequence"] * 2, ["kernel"] * 2),
        ("keras_gru_reset_after.onnx", ["GRUSequence"], None),
        ("keras_gru_reset_before.onnx", ["GRUSequence"], None),  # two stages per step
        # nn.LSTM / nn.GRU exported as the ONNX ops, two layers, one or both directions
        ("lstm_2layers.onnx", ["LSTMOp"] * 2, None),
        ("lstm_2layers_bidirectional.onnx", ["LSTMOp"] * 2, None),
        ("gru_1layer.onnx", ["GRUOp"], ["kernel"]),  # the Squeeze after it folds in
        ("gru_2layers_bidirectional.onnx", ["GRUOp"] * 2, None),
    ],
)
def test_exports_fuse_and_match_onnxruntime(name, fused, steps):
    check(name, fused, steps)
