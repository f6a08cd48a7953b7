"""`fusion match`: every match and near-miss per pattern, the rewrite --report JSON, and nothing
written anywhere."""

import json
import os

import pytest
from onnx import TensorProto, helper

from fusion.cli import main
from fusion.modelfile import save_model
from fusion.models import conv_stack


@pytest.fixture
def model_file(tmp_path):
    """Two conv blocks; the first block's Add output is also a graph output (a near-miss)."""
    model = conv_stack(blocks=2, channels=4, size=6)
    extra = helper.make_tensor_value_info("/add0/Add_output_0", TensorProto.FLOAT, [1, 4, 6, 6])
    model.graph.output.append(extra)
    path = tmp_path / "model.onnx"
    save_model(model, path)
    return path


def snapshot(folder):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*"))}


def test_match_lists_matches_and_near_misses_and_writes_nothing(capsys, model_file, tmp_path,
                                                                monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert main(["match", str(model_file)]) == 0
    out = capsys.readouterr().out
    assert snapshot(tmp_path) == before  # the input untouched, no file created
    assert "ConvBiasRelu: 2 matches, 1 near-miss" in out  # the graph output's Conv alone
    assert "match /relu1/Relu: Conv /conv1/Conv, Add /add1/Add, Relu /relu1/Relu" in out
    assert "near-miss at Relu /relu0/Relu:" in out and "graph output" in out
    assert "FireModule: no match" in out


def test_match_json_is_the_rewrite_report(capsys, model_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert main(["match", str(model_file), "--json"]) == 0
    matched = json.loads(capsys.readouterr().out)
    assert snapshot(tmp_path) == before
    report = tmp_path / "report.json"
    assert main(["rewrite", str(model_file), "-o", str(tmp_path / "out.onnx"),
                 "--report", str(report)]) == 0  # fmt: skip
    assert matched == json.loads(report.read_text())
    assert matched["counts"] == {"ConvBiasRelu": 2} and len(matched["near_misses"]) == 1
    assert os.path.exists(tmp_path / "out.onnx")  # rewrite writes; match did not
