"""`fusion rewrite` and `fusion patterns`: what a user sees, what gets written, exit codes."""

import json
import subprocess
import sys

import onnx
import pytest
from helpers import GraphBuilder
from onnx import TensorProto, helper

from fusion.cli import main
from fusion.modelfile import save_model
from fusion.models import conv_stack


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    save_model(conv_stack(blocks=4, channels=8, size=10), path)
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_rewrite_writes_fused_model_and_leaves_input(capsys, model_file, tmp_path):
    before = model_file.read_bytes()
    out = tmp_path / "fused.onnx"
    code, stdout, _ = run(capsys, "rewrite", model_file, "-o", out, "-v")
    assert code == 0
    assert "4 fusions (ConvBiasRelu: 4)" in stdout
    assert "ConvBiasRelu /relu0/Relu <- Conv /conv0/Conv, Add /add0/Add, Relu /relu0/Relu" in stdout
    assert model_file.read_bytes() == before
    fused = onnx.load(str(out))
    onnx.checker.check_model(fused, full_check=True)
    assert [n.op_type for n in fused.graph.node] == ["ConvBiasRelu"] * 4
    assert fused.producer_name == "fusion.models"  # metadata kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.onnx", "model.onnx"]  # no temp


def test_rewrite_is_byte_identical_across_processes(model_file, tmp_path):
    outs = [tmp_path / "a.onnx", tmp_path / "b.onnx"]
    for out in outs:
        cmd = [sys.executable, "-m", "fusion", "rewrite", str(model_file), "-o", str(out)]
        subprocess.run(cmd, check=True, capture_output=True)
    assert outs[0].read_bytes() == outs[1].read_bytes()


def test_nothing_to_fuse_is_written_unchanged(capsys, tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    src, dst = tmp_path / "plain.onnx", tmp_path / "out.onnx"
    save_model(helper.make_model(graph), src)
    code, stdout, _ = run(capsys, "rewrite", src, "-o", dst)
    assert code == 0 and "0 fusions" in stdout
    assert dst.read_bytes() == src.read_bytes()


def test_rewriting_a_rewritten_file_changes_nothing(capsys, model_file, tmp_path):
    once, twice = tmp_path / "once.onnx", tmp_path / "twice.onnx"
    assert run(capsys, "rewrite", model_file, "-o", once)[0] == 0
    code, stdout, _ = run(capsys, "rewrite", once, "-o", twice)
    assert code == 0 and "0 fusions" in stdout
    assert once.read_bytes() == twice.read_bytes()


def test_explain_and_report(capsys, tmp_path):
    g = GraphBuilder()
    conv = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv3")
    y = g.node("Relu", [conv], name="/relu3")
    src, dst, report = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    save_model(g.model({"x": [1, 4, 6, 6]}, [y, conv]), src)
    code, stdout, _ = run(capsys, "rewrite", src, "-o", dst, "--explain", "--report", report)
    assert code == 0
    assert "Conv /conv3: its output /conv3_out is also a graph output" in stdout
    data = json.loads(report.read_text())
    assert data["fusions"] == 1 and data["near_misses"][0]["rule"] == "ConvBiasRelu"
    assert "convs: 1 of 1 fused; onnxruntime islands: 1" in stdout  # the Relu's island


def test_only_and_exclude(capsys, model_file, tmp_path):
    out = tmp_path / "o.onnx"
    assert (
        "0 fusions" in run(capsys, "rewrite", model_file, "-o", out, "--exclude", "ConvBiasRelu")[1]
    )
    assert "4 fusions" in run(capsys, "rewrite", model_file, "-o", out, "--only", "ConvBiasRelu")[1]
    code, _, err = run(capsys, "rewrite", model_file, "-o", out, "--only", "Nope")
    assert code == 2 and "no pattern named 'Nope'" in err


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such file"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b""), "the file is empty"),
        (lambda p: p.write_bytes(b"\x93\x01garbage\xff" * 10), "not an ONNX model"),
        (
            lambda p: p.write_bytes(onnx.TensorProto(name="t").SerializeToString()),
            "not an ONNX model",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, setup, message):
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    setup(src)
    code, _, err = run(capsys, "rewrite", src, "-o", dst)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not dst.exists()


def test_output_equal_to_input_is_refused(capsys, model_file):
    before = model_file.read_bytes()
    code, _, err = run(capsys, "rewrite", model_file, "-o", model_file)
    assert code == 2 and "--in-place" in err
    assert model_file.read_bytes() == before
    assert run(capsys, "rewrite", model_file, "-o", model_file, "--in-place")[0] == 0
    assert model_file.read_bytes() != before


def test_missing_output_directory(capsys, model_file, tmp_path):
    code, _, err = run(capsys, "rewrite", model_file, "-o", tmp_path / "nope" / "o.onnx")
    assert code == 2 and "does not exist" in err


def test_patterns_listing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "patterns", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and rows["ConvBiasRelu"]["kernel"] == "fusion_patterns.conv.make_kernel"
    assert list(rows)[0] == "FireModule"  # priority order: the larger pattern first
    code, out, _ = run(capsys, "patterns")
    assert code == 0 and "ConvBiasRelu" in out
    # at 80 columns every cell reads whole: long words fold, nothing is cut to "…"
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    assert "fusion_patterns.squ" in out  # a dotted kernel name folds onto the next line


def test_python_dash_m_is_the_same_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "fusion", "patterns", "--json"], capture_output=True
    )
    assert proc.returncode == 0 and b"ConvBiasRelu" in proc.stdout
