"""fusion.verify: a correct kernel passes; a wrong one fails, and per_node names it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import OPSETS, fused_model, scaled_relu, tensor
from helpers import scaled_relu_catalog as catalog
from onnx import TensorProto as T
from onnx import helper as h

import fusion
from fusion.errors import FusionError
from fusion.models import LSTMWeights, conv_stack, unrolled_lstm
from fusion.runtime import Session
from fusion.verify import verify, verify_node


def original_model() -> onnx.ModelProto:
    """a -> Add(a, a) -> relu(. * s) -> relu(. * s) -> Neg -> z, the standard-op original."""
    nodes = [
        h.make_node("Add", ["a", "a"], ["x"], name="add"),
        h.make_node("Mul", ["x", "s"], ["t1"], name="mul1"),
        h.make_node("Relu", ["t1"], ["y1"], name="relu1"),
        h.make_node("Mul", ["y1", "s"], ["t2"], name="mul2"),
        h.make_node("Relu", ["t2"], ["y2"], name="relu2"),
        h.make_node("Neg", ["y2"], ["z"], name="neg"),
    ]
    s = h.make_tensor("s", T.FLOAT, [], [1.5])
    graph = h.make_graph(nodes, "g", [tensor("a")], [tensor("z", None)], [s])
    return h.make_model(graph, opset_imports=OPSETS[:1])


def fused(second_shift: float = 0.0) -> onnx.ModelProto:
    """The same with both Mul + Relu fused; `second_shift` breaks the second kernel only."""
    nodes = [
        h.make_node("Add", ["a", "a"], ["x"], name="add"),
        scaled_relu("x", "s", "y1", "sr1"),
        scaled_relu("y1", "s", "y2", "sr2", shift=second_shift),
        h.make_node("Neg", ["y2"], ["z"], name="neg"),
    ]
    s = h.make_tensor("s", T.FLOAT, [], [1.5])
    return fused_model(nodes, [tensor("a")], [tensor("z", None)], [s])


def test_correct_kernels_pass():
    report = verify(original_model(), fused(), per_node=True, catalog=catalog())
    assert report.ok, str(report)
    assert [c.name for c in report.outputs] == ["z"] and report.outputs[0].shape == (1, 3)
    assert [c.node for c in report.nodes] == ["ScaledRelu sr1", "ScaledRelu sr2"]
    assert report.first_bad_node is None and str(report).endswith("PASS")
    assert report.inputs == "random (seed 0)"


def test_wrong_kernel_fails_and_per_node_names_it():
    report = verify(original_model(), fused(second_shift=0.5), per_node=True, catalog=catalog())
    assert not report.ok
    assert not report.outputs[0].ok and report.outputs[0].max_abs == pytest.approx(0.5)
    assert [c.ok for c in report.nodes] == [True, False]
    assert report.first_bad_node == "ScaledRelu sr2"
    text = str(report)
    assert "FAIL (first disagreeing node: ScaledRelu sr2)" in text
    assert json.loads(json.dumps(report.to_dict()))["first_bad_node"] == "ScaledRelu sr2"


def test_without_per_node_only_outputs_are_checked():
    report = verify(original_model(), fused(second_shift=0.5), catalog=catalog())
    assert not report.ok and report.nodes == [] and report.first_bad_node is None


def test_tolerance_defaults_to_the_loosest_rule_and_can_be_given():
    loose = catalog(rtol=0.0, atol=1.0)
    report = verify(original_model(), fused(second_shift=0.5), per_node=True, catalog=loose)
    assert report.ok and (report.rtol, report.atol) == (0.0, 1.0)
    strict = verify(original_model(), fused(second_shift=0.5), atol=0.1, rtol=0, catalog=loose)
    assert not strict.ok and strict.atol == 0.1


def test_inputs_from_dict_npy_and_npz(tmp_path):
    a = np.arange(-6, 6, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "inputs.npz", a=a)
    for inputs in [
        {"a": a},
        {"a": tmp_path / "a.npy"},
        str(tmp_path / "a.npy"),
        [a],
        tmp_path / "inputs.npz",
    ]:
        report = verify(original_model(), fused(), inputs=inputs, catalog=catalog())
        assert report.ok and report.outputs[0].shape == (4, 3), inputs
    with pytest.raises(FusionError, match="missing.npy: cannot read it as .npy/.npz"):
        verify(original_model(), fused(), inputs=tmp_path / "missing.npy", catalog=catalog())


def test_wrong_input_name_is_a_one_line_error():
    with pytest.raises(ValueError, match="Invalid input name: b"):
        verify(
            original_model(),
            fused(),
            inputs={"a": np.ones((1, 3), np.float32), "b": np.ones(1)},
            catalog=catalog(),
        )


def test_random_inputs_fill_symbolic_dims():
    model, fused_one = original_model(), fused()
    for m in (model, fused_one):
        m.graph.input[0].CopyFrom(tensor("a", ("batch", "width")))
    report = verify(model, fused_one, catalog=catalog(), dims={"width": 5})
    assert report.ok and report.outputs[0].shape == (1, 5)


def test_random_inputs_give_a_named_dim_one_size():
    """X [T, N, I] and h0 [N, H]: N is axis 1 of one and axis 0 of the other, one size."""
    model = unrolled_lstm(LSTMWeights.random(4, 6, seed=1), steps=3, batch="N")
    result = fusion.rewrite(model, fusion.default_catalog())
    report = verify(model, result.model, catalog=fusion.default_catalog())
    assert report.ok
    assert report.outputs[0].shape[1] == report.outputs[1].shape[0]  # Y [T, N, H], h_n [N, H]


def test_verify_node_for_the_rewriters_rollback():
    model = fused(second_shift=0.5)
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(4, 3)
    s = np.float32(1.5)
    max_abs, max_rel, ok = verify_node(model, model.graph.node[1], [x, s], catalog())
    assert ok and max_abs == 0.0
    max_abs, _, ok = verify_node(model, model.graph.node[2], {"y1": x, "s": s}, catalog())
    assert not ok and max_abs == pytest.approx(0.5)
    with pytest.raises(FusionError, match="Add add is not a fused node"):
        verify_node(model, model.graph.node[0], [x, x], catalog())


def test_verify_checks_every_tactic_a_kernel_offers():
    """A conv kernel offers the blocked layout (each register tile worth timing) and NCHW: the
    runtime may choose any of them on another machine, so verify runs each once."""
    model = conv_stack(blocks=2, channels=16, size=12)
    offered = Session(model, threads=1, tactics="kernel").offered
    names = {t for tactics in offered.values() for t in tactics}
    assert len(names) >= 2 and any(t.startswith("nchw") for t in names)
    report = verify(model, per_node=True)
    assert report.ok, str(report)
    others = names - {tactics[0] for tactics in offered.values()}
    assert {c.name.rsplit(" [", 1)[1].rstrip("]") for c in report.tactics} == others
    checked = {c.name.rsplit(" [", 1)[1].rstrip("]") for c in report.nodes}
    assert checked == names  # every (node, tactic) compared with the node's body
    assert "output [other tactic]" in str(report)


def test_verify_runs_each_tactic_by_its_own_name():
    """A kernel offering "nchw-fast" and "nchw": verify must run "nchw" itself (a prefix
    choice would take "nchw-fast" twice and pass a wrong "nchw")."""
    from fusion.catalog import Tactic

    def prepare(attrs, constants):
        s = constants[1]

        def good(x, scale):
            return (np.maximum(x * s, 0).astype(np.float32),)

        def wrong(x, scale):
            return (np.zeros_like(x),)

        good.tactics = [Tactic("nchw-fast", good), Tactic("nchw", wrong)]
        return good

    report = verify(original_model(), fused(), catalog=catalog(kernel=prepare), per_node=True)
    assert not report.ok and report.first_bad_node == "ScaledRelu sr1", str(report)
    assert all(c.ok for c in report.outputs)  # "kernel": each node's first tactic, nchw-fast
    assert [c.name for c in report.tactics if not c.ok] == ["z [nchw]"], str(report)
    bad = {(c.node, c.name) for c in report.nodes if not c.ok}
    assert bad == {("ScaledRelu sr1", "y1 [nchw]")}, str(report)  # sr2 gets zeros: agrees
