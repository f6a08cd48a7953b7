"""fusion.coverage: convs fused of all, the first reason per conv left unfused, onnxruntime
islands; and where users see it: fusion.explain, `rewrite --explain`, `match`, the JSON report."""

import json

from helpers import GraphBuilder

import fusion
from fusion.cli import main


def three_convs():
    """/c1 fuses with its Relu; /c2's weight is fed at run time (not fused); /c3 fuses alone.
    The run: kernel, island (/c2, Sigmoid), kernel."""
    g = GraphBuilder()
    a = g.node("Relu", [g.node("Conv", ["x", g.weight(8, 4, 3, 3)], pads=[1, 1, 1, 1], name="/c1")])
    b = g.node("Sigmoid", [g.node("Conv", [a, "w"], name="/c2")])
    c = g.node("Conv", [b, g.weight(4, 8, 1, 1)], name="/c3")
    return g.model({"x": [1, 4, 6, 6], "w": [8, 8, 3, 3]}, [c])


def test_coverage_counts_and_reasons():
    cov = fusion.coverage(three_convs())
    assert (cov.convs, cov.fused, cov.islands) == (3, 2, 1)
    assert cov.unfused == [("Conv /c2", "input w is not a constant (ConvBiasRelu)")]
    assert cov.summary() == "convs: 2 of 3 fused; onnxruntime islands: 1"
    assert cov.to_dict()["unfused_convs"] == [
        {"conv": "Conv /c2", "reason": "input w is not a constant (ConvBiasRelu)"}
    ]


def test_a_conv_no_rule_tried_says_so():
    """With the conv rules left out, nothing names the convs: each says no rule matched it."""
    catalog = fusion.default_catalog().select((), ("ConvBiasRelu", "InvertedResidual"))
    cov = fusion.coverage(three_convs(), catalog)
    assert cov.fused == 0 and cov.islands == 1
    assert {reason for _, reason in cov.unfused} == {"no rule matched it"}


def test_explain_ends_with_the_coverage():
    text = str(fusion.explain(three_convs()))
    assert text.endswith(
        "convs left unfused:\n  Conv /c2: input w is not a constant (ConvBiasRelu)\n"
        "convs: 2 of 3 fused; onnxruntime islands: 1"
    ), text
    assert fusion.explain(three_convs()).coverage.fused == 2


def test_cli_match_and_report(capsys, tmp_path):
    src = tmp_path / "m.onnx"
    fusion.save_model(three_convs(), src)
    assert main(["match", str(src)]) == 0
    out = capsys.readouterr().out
    assert "  Conv /c2: input w is not a constant (ConvBiasRelu)" in out
    assert out.rstrip().endswith("convs: 2 of 3 fused; onnxruntime islands: 1")
    assert main(["match", str(src), "--json"]) == 0
    matched = json.loads(capsys.readouterr().out)
    assert matched["coverage"]["fused_convs"] == 2 and matched["coverage"]["islands"] == 1
    report = tmp_path / "r.json"
    assert main(["rewrite", str(src), "-o", str(tmp_path / "o.onnx"), "--report", str(report)]) == 0
    assert json.loads(report.read_text())["coverage"] == matched["coverage"]
