"""rewrite(standard_ops=True) / `fusion rewrite --rnn-as-standard-op`: fused unrolled LSTM chains
written as the ONNX LSTM op, which plain onnxruntime runs as one op; checked against the
original with onnxruntime and fusion.verify."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_all_close, fused_ops, run_ort

import fusion
from fusion.cli import main
from fusion.modelfile import save_model
from fusion.models import LSTMWeights, unrolled_lstm

FIXTURES = Path(__file__).parent / "fixtures"
CATALOG = fusion.default_catalog()
ATOL = 1e-5


def feeds(model, batch, steps=None, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for inp in model.graph.input:
        dims = [d.dim_value or batch for d in inp.type.tensor_type.shape.dim]
        out[inp.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def lowered(model, sequences: int, op: str = "LSTM"):
    """The standard-op rewrite: `sequences` LSTM (GRU) ops, no fused node, no function left,
    the original's outputs in onnxruntime at batch 1 and 3, and fusion.verify passes."""
    result = fusion.rewrite(model, CATALOG, standard_ops=True)
    assert fused_ops(result.model) == [], result.explain()
    assert [n.op_type for n in result.model.graph.node].count(op) == sequences
    assert not result.model.functions
    assert result.counts() == {f"{op}Sequence": sequences}
    onnx.checker.check_model(result.model, full_check=True)
    for batch in (1, 3):
        x = feeds(model, batch)
        assert_all_close(run_ort(result.model, x), run_ort(model, x), rtol=0, atol=ATOL)
        assert fusion.verify(model, result.model, inputs=x).ok
    return result


@pytest.mark.parametrize(
    "cell",
    [dict(form="gemm"), dict(form="matmul", gates="slice", order="igfo", forget_bias=1.0),
     dict(form="concat_gemm", order="igfo"), dict(form="gemm", gates="split_attribute")],
    ids=["gemm", "tf-slices", "concat-gemm", "opset11"],
)  # fmt: skip
@pytest.mark.parametrize("steps", [2, 5])
def test_unrolled_chains_become_the_lstm_op(cell, steps):
    lowered(unrolled_lstm(LSTMWeights.random(5, 13, seed=steps), steps, "N", **cell), 1)


@pytest.mark.parametrize(
    "name, sequences, op",
    [
        ("lstmcell_stacked.onnx", 3, "LSTM"),
        ("tf_lstmcell_equal.onnx", 1, "LSTM"),
        ("keras_lstm_stacked.onnx", 2, "LSTM"),
        ("grucell_stacked.onnx", 2, "GRU"),
        ("keras_gru_reset_after.onnx", 1, "GRU"),
        ("keras_gru_reset_before.onnx", 1, "GRU"),  # linear_before_reset=0
    ],
)
def test_exported_models(name, sequences, op):
    lowered(onnx.load(str(FIXTURES / name)), sequences, op)


def test_a_step_read_outside_comes_from_a_gather_of_y():
    """Not folded (the Gathers feed something else too) and step 1's h also a graph output."""
    model = unrolled_lstm(LSTMWeights.random(4, 6, seed=2), 4, "N")
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    model.graph.node.append(onnx.helper.make_node("Relu", [gather.output[0]], ["x0_relu"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("x0_relu", 1, ["N", 4]))
    mid = next(n for n in model.graph.node if n.op_type == "Unsqueeze").input[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(mid, 1, ["N", 6]))
    nodes = [n.op_type for n in lowered(model, 1).model.graph.node]
    assert "Gather" in nodes and "Concat" in nodes


def test_a_middle_c_read_outside_stays_fused_and_says_why():
    model = unrolled_lstm(LSTMWeights.random(4, 6, seed=3), 3, "N")
    c1 = next(n for n in model.graph.node if n.op_type == "Add" and "Mul" in n.input[0]).output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(c1, 1, ["N", 6]))
    result = fusion.rewrite(model, CATALOG, standard_ops=True)
    assert fused_ops(result.model) == ["LSTMSequence"]
    assert "kept fused: a step's c other than the last is read" in result.explain("LSTMSequence")
    x = feeds(model, 2)
    assert_all_close(run_ort(result.model, x), run_ort(model, x), rtol=0, atol=ATOL)


def test_cli_flag_writes_and_verifies(capsys, tmp_path):
    src, out = tmp_path / "lstm.onnx", tmp_path / "out.onnx"
    save_model(unrolled_lstm(LSTMWeights.random(5, 7), 4, "N"), src)
    report = tmp_path / "report.json"
    argv = ["rewrite", src, "-o", out, "--rnn-as-standard-op", "--verify", "--report", report]
    code = main([str(a) for a in argv])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert len(json.loads(report.read_text())["standard_ops"]) == 1
    assert "1 fusion (LSTMSequence: 1)" in stdout and "written as standard ONNX ops" in stdout
    assert "PASS" in stdout
    assert [n.op_type for n in onnx.load(str(out)).graph.node].count("LSTM") == 1
