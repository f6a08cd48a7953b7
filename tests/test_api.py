"""The public API for user patterns: registration, validation, check_pattern, explain,
plugins and entry points."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, fused_ops, random_feeds, run_ort

import fusion
from fusion import Catalog, CatalogError, Const, Var, op
from fusion.cli import main
from fusion.registry import installed_catalogs

SCALED_RELU = op.Relu(op.Mul(Var("x", dtype="float32"), Const("s")))


def scaled_relu_model():
    g = GraphBuilder()
    y = g.node("Relu", [g.node("Mul", ["x", g.const(np.float32(1.5))])], name="/relu")
    return g.model({"x": ["N", 5]}, [y])


def test_decorator_registers_a_plain_kernel_that_runs():
    catalog = Catalog()

    @fusion.register_pattern("ScaledRelu", SCALED_RELU, inputs=("x", "s"), catalog=catalog)
    def scaled_relu(x, s):
        return np.maximum(x * s, 0)

    model = scaled_relu_model()
    result = fusion.rewrite(model, catalog)
    assert fused_ops(result.model) == ["ScaledRelu"]
    feeds = random_feeds(model, batch=3)
    got = fusion.Session(result.model, catalog=catalog).run(None, feeds)
    assert_close(got[0], run_ort(model, feeds)[0], rtol=1e-6, atol=0)
    assert scaled_relu(np.ones(2, np.float32), 2.0)[0] == 2.0  # the decorator returns the function


def test_prepare_factory_runs_once_per_node():
    calls = []

    def prepare(attrs, constants):
        calls.append(constants)
        scale = constants[1]
        return lambda x, s: (np.maximum(x * scale, 0),)

    catalog = Catalog()
    fusion.register_pattern(
        "ScaledRelu", SCALED_RELU, inputs=("x", "s"), prepare=prepare, catalog=catalog
    )
    sess = fusion.Session(scaled_relu_model(), catalog=catalog)
    for _ in range(3):
        sess.run(None, {"x": np.ones((2, 5), np.float32)})
    assert len(calls) == 1 and float(calls[0][1]) == 1.5 and calls[0][0] is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kernel=lambda x: x), "cannot take the pattern's 2 inputs"),
        (dict(prepare=lambda attrs: None), "prepare must be called as prepare"),
        (dict(kernel=lambda x, s: x, prepare=lambda a, c: None), "not both"),
    ],
)
def test_registration_rejects_bad_kernels(kwargs, message):
    with pytest.raises(CatalogError, match=message):
        fusion.register_pattern(
            "ScaledRelu", SCALED_RELU, inputs=("x", "s"), catalog=Catalog(), **kwargs
        )


def test_registration_rejects_a_builtin_name():
    with pytest.raises(CatalogError, match="already in the built-in catalog"):
        fusion.register_pattern("ConvBiasRelu", SCALED_RELU, inputs=("x",), kernel=lambda x: x)


def test_check_pattern_finds_a_wrong_kernel():
    good, bad = Catalog(), Catalog()
    fusion.register_pattern(
        "ScaledRelu",
        SCALED_RELU,
        inputs=("x", "s"),
        kernel=lambda x, s: np.maximum(x * s, 0),
        catalog=good,
    )
    fusion.register_pattern(
        "ScaledRelu", SCALED_RELU, inputs=("x", "s"), kernel=lambda x, s: x * s, catalog=bad
    )
    shapes = {"x": [4, 8], "s": []}
    assert fusion.check_pattern(good.get("ScaledRelu"), shapes).ok
    report = fusion.check_pattern(bad.get("ScaledRelu"), shapes)
    assert report.fused and not report.ok and report.max_abs > 0
    assert "FAILED" in str(report)


def test_explain_as_data_and_text():
    g = GraphBuilder()
    conv = g.node("Conv", ["x", g.weight(8, 4, 3, 3)], name="/conv3")
    y = g.node("Relu", [conv], name="/relu3")
    model = g.model({"x": [1, 4, 6, 6]}, [y, conv])
    found = fusion.explain(model, pattern="ConvBiasRelu")
    assert [(m.rule, m.at) for m in found] == [("ConvBiasRelu", "Relu /relu3")]
    assert "its output /conv3_out is also a graph output" in found[0].reason
    assert str(found).startswith("ConvBiasRelu: 1 fused, 1 not fused")  # the Conv alone
    with pytest.raises(CatalogError, match="no pattern named"):
        fusion.explain(model, pattern="Nope")


def test_broken_plugin_is_a_one_line_error(tmp_path, capsys):
    plugin = tmp_path / "bad.py"
    bad_rule = "fusion.register_pattern('X', fusion.op.Nope(fusion.Var('x')), inputs=('x',))"
    plugin.write_text(f"import fusion\n{bad_rule}\n")
    assert main(["patterns", "--plugin", str(plugin)]) == 2
    err = capsys.readouterr().err
    assert "unknown ONNX op 'Nope'" in err and len(err.strip().splitlines()) == 1


def test_entry_point_catalogs(monkeypatch):
    class FakeEntryPoint:
        name = "third_party"

        def load(self):
            rule = fusion.Rule("ThirdPartyRelu", SCALED_RELU, inputs=("x", "s"))
            return lambda: [rule]

    monkeypatch.setattr("fusion.registry.entry_points", lambda group: [FakeEntryPoint()])
    installed_catalogs.cache_clear()
    try:
        assert "ThirdPartyRelu" in fusion.default_catalog()
    finally:
        monkeypatch.undo()
        installed_catalogs.cache_clear()
    assert "ThirdPartyRelu" not in fusion.default_catalog()
