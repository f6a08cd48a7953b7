"""fusion.rollback and fusion.rewrite(verify=True): what `rewrite --verify` does, as a library.

Every fused node is checked against onnxruntime; a fusion that disagrees is undone by its node's
name (the rewriter gives each fused node a name no other node holds) and the rest checked again.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
from helpers import cli, fused_model, fused_ops, random_feeds, run_ort, scaled_relu, tensor
from helpers import scaled_relu_catalog as catalog
from onnx import helper as h
from onnx import numpy_helper

import fusion
from fusion.modelfile import save_model
from fusion.models import conv_stack


def two_scaled_relus(first: str, second: str) -> onnx.ModelProto:
    """x -> relu(x * 1.5) -> relu(. * 2) -> z, the Relus (each fusion's root) named `first`
    and `second` ("" for none)."""
    nodes = [
        h.make_node("Mul", ["x", "s1"], ["t1"], name="mul1"),
        h.make_node("Relu", ["t1"], ["y"], name=first),
        h.make_node("Mul", ["y", "s2"], ["t2"], name="mul2"),
        h.make_node("Relu", ["t2"], ["z"], name=second),
    ]
    scales = [numpy_helper.from_array(np.float32(s), f"s{i}") for i, s in ((1, 1.5), (2, 2.0))]
    graph = h.make_graph(nodes, "g", [tensor("x")], [tensor("z")], scales)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])


def wrong_for_two(attrs: dict, constants: list):
    """relu(x * s), off by 0.5 where s is 2 (the second fusion of two_scaled_relus)."""
    shift = np.float32(0.5 if float(constants[1]) == 2.0 else 0.0)
    return lambda x, s: (np.maximum(x * s, 0).astype(x.dtype) + shift,)


def failing_for_two(attrs: dict, constants: list):
    run = wrong_for_two(attrs, constants)
    if float(constants[1]) != 2.0:
        return run

    def fail(x, s):
        raise RuntimeError("a bug in the kernel")

    return fail


def fused_names(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.domain == fusion.DOMAIN]


def test_a_chain_and_what_it_fuses_again_are_rolled_back_by_name():
    """Conv + Add + Relu rolled back at its Relu fuses again as Conv + Add under the Add's
    name, then as the Conv alone: each is checked and undone in turn, and what is left agrees."""
    from fusion_patterns import conv

    def off_by_half(attrs, constants):  # the real kernel, plus 0.5 everywhere
        run = conv.make_kernel(attrs, constants)
        return lambda *args: tuple(y + np.float32(0.5) for y in run(*args))

    wrong = fusion.Catalog([dataclasses.replace(conv.RULE, prepare=off_by_half)])
    model = conv_stack(blocks=1, channels=4, size=6)
    done = fusion.rollback(model, fusion.rewrite(model, wrong), wrong)
    undone = done.result.rolled_back
    assert [(r.node, r.rule) for r in undone] == [
        ("/relu0/Relu", "ConvBiasRelu"),
        ("/add0/Add", "ConvBiasRelu"),
        ("/conv0/Conv", "ConvBiasRelu"),
    ]
    for r, value in zip(undone, ["/relu0/Relu", "/add0/Add", "/conv0/Conv"], strict=True):
        assert r.reason.startswith(f"kernel disagrees with onnxruntime on {value}_output_0 [")
        assert "max abs error 0.5" in r.reason and r.max_abs == pytest.approx(0.5)
    assert done.ok and fused_ops(done.result.model) == []
    assert "/conv0/Conv: rolled back: kernel disagrees" in done.result.explain()
    assert fusion.verify(model, done.result.model, per_node=True, catalog=wrong).ok


@pytest.mark.parametrize(
    "first, second, kept",
    [
        # the unnamed root's fused node would be ScaledRelu_y, the other root's name: two nodes
        # of one name (onnxruntime refuses that), one label, and a rollback of both
        ("", "ScaledRelu_y", "ScaledRelu_y_1"),
        # names holding the space the CLI once split labels on ("ScaledRelu relu two")
        ("ScaledRelu relu", "ScaledRelu relu two", "ScaledRelu relu"),
    ],
)
def test_fused_nodes_are_rolled_back_by_a_name_only_they_hold(first, second, kept):
    model = two_scaled_relus(first, second)
    result = fusion.rewrite(model, catalog(wrong_for_two))
    assert fused_names(result.model) == [kept, second]
    done = fusion.rollback(model, result, catalog(wrong_for_two))
    assert [(r.node, r.rule) for r in done.result.rolled_back] == [(second, "ScaledRelu")]
    assert "on z [kernel] (max abs error 0.5" in done.result.rolled_back[0].reason
    assert done.ok and fused_names(done.result.model) == [kept]
    names = [n.name for n in done.result.model.graph.node]
    assert len(set(names)) == len(names), names
    feeds = random_feeds(model)  # onnxruntime loads it (no two nodes of one name), same numbers
    np.testing.assert_allclose(run_ort(done.result.model, feeds)[0], run_ort(model, feeds)[0])
    report = fusion.verify(model, done.result.model, per_node=True, catalog=catalog(wrong_for_two))
    assert report.ok and {c.node_name for c in report.nodes} == {kept}


def test_a_kernel_that_fails_is_rolled_back_with_its_failure():
    model = two_scaled_relus("relu1", "relu2")
    done = fusion.rollback(model, fusion.rewrite(model, catalog(failing_for_two)),
                           catalog(failing_for_two))  # fmt: skip
    (undone,) = done.result.rolled_back
    assert (undone.node, undone.rule, undone.max_abs) == ("relu2", "ScaledRelu", np.inf)
    assert "failed: RuntimeError: a bug in the kernel" in undone.reason
    assert done.ok and fused_names(done.result.model) == ["relu1"]


def test_a_fused_node_the_input_had_is_not_rolled_back_and_verify_says_so():
    """Only this rewrite's fusions can be undone: a wrong fused node the input already held
    stays, and the check fails naming it (after one round, not one per node)."""
    nodes = [
        scaled_relu("a", "s", "y1", "sr1", shift=0.5),
        h.make_node("Mul", ["y1", "s"], ["t"], name="mul"),
        h.make_node("Relu", ["t"], ["z"], name="relu"),
    ]
    s = numpy_helper.from_array(np.float32(1.5), "s")
    model = fused_model(nodes, [tensor("a")], [tensor("z", None)], [s])
    done = fusion.rollback(model, fusion.rewrite(model, catalog()), catalog())
    assert done.result.rolled_back == [] and fused_names(done.result.model) == ["sr1", "relu"]
    assert not done.ok and {c.node_name for c in done.disagreeing} == {"sr1"}
    assert "not rolled back (not fused by this rewrite): ScaledRelu sr1 -> y1" in str(done)
    with pytest.raises(fusion.FusionError, match="still disagrees with .*: ScaledRelu sr1"):
        fusion.rewrite(model, catalog(), verify=True)


# The plugin a user would pass to the CLI: ScaledRelu, wrong where s is 2.
PLUGIN = """
import numpy as np
import fusion
from fusion import Const, Var, op


def prepare(attrs, constants):
    shift = np.float32(0.5 if float(constants[1]) == 2.0 else 0.0)
    return lambda x, s: (np.maximum(x * s, 0).astype(x.dtype) + shift,)


pattern = op.Relu(op.Mul(Var("x", dtype="float32"), Const("s")))
fusion.register_pattern("ScaledRelu", pattern, inputs=("x", "s"), prepare=prepare)
"""


def test_rewrite_verify_in_python_is_what_the_cli_writes(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("fusion.registry.USER", fusion.Catalog())  # registered for this test
    (tmp_path / "scaled_relu.py").write_text(PLUGIN)
    model = two_scaled_relus("", "ScaledRelu_y")
    save_model(model, tmp_path / "m.onnx")
    argv = ["rewrite", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--verify"]
    argv += ["--report", tmp_path / "r.json"]
    code, out, err = cli(capsys, *argv, "--plugin", tmp_path / "scaled_relu.py")
    assert code == 0, err
    result = fusion.rewrite(model, verify=True)  # the default catalog, the plugin's rule in it
    assert [r.node for r in result.rolled_back] == ["ScaledRelu_y"]
    (reported,) = json.loads((tmp_path / "r.json").read_text())["rolled_back"]
    assert reported["node"] == "ScaledRelu_y" and reported["reason"] == result.rolled_back[0].reason
    assert f"rolled back: {result.rolled_back[0].reason}\n" in out and "1 fusion " in out, out
    written = onnx.load(tmp_path / "o.onnx")
    assert written.SerializeToString() == result.model.SerializeToString()
