"""What a run promises whatever a kernel does (issue 24): a kernel never writes into the
caller's arrays or into values other steps read (its inputs are read-only), every kernel output
has the sizes its node declares, and the norm kernels give a finite row for any finite row."""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, fused_ops, run_ort
from onnx import TensorProto, numpy_helper

import fusion
from fusion.cli.main import main
from fusion.errors import FusionWarning, KernelError
from fusion.pattern import Var, op


# ---- a plugin kernel that writes into its input ---------------------------------------------
def scale_relu_catalog(writes: str) -> fusion.Catalog:
    """relu(x * s) by a kernel that writes its result into its input x, or into s."""
    catalog = fusion.Catalog()

    def scale_relu(x, s):
        if writes == "x":
            return np.maximum(x * s, 0, out=x)
        s *= 1  # the session's constant, read by every run
        return np.maximum(x * s, 0)

    x, s = Var("x", dtype="float32"), Var("s", dtype="float32")
    fusion.register_pattern("ScaleRelu", op.Relu(op.Mul(x, s)), inputs=("x", "s"),
                            kernel=scale_relu, catalog=catalog)  # fmt: skip
    return catalog


def scale_relu_model() -> onnx.ModelProto:
    g = GraphBuilder()
    y = g.node("Relu", [g.node("Mul", ["x", g.const(np.array([1.5], np.float32))])], name="act")
    return g.model({"x": ["N", 4]}, [y])


@pytest.mark.parametrize("writes", ["x", "s"])
def test_a_kernel_that_writes_its_input_fails_naming_itself_and_changes_nothing(writes):
    catalog = scale_relu_catalog(writes)
    model = fusion.rewrite(scale_relu_model(), catalog).model
    session = fusion.Session(model, catalog=catalog, tactics="kernel")
    x = np.ones((2, 4), np.float32)
    with pytest.raises(KernelError) as err:
        session.run(None, {"x": x})
    message = str(err.value)
    assert ".scale_relu of ScaleRelu act failed" in message, message
    assert "failed: ValueError: output array is read-only (a kernel's inputs are read-only)" in (
        message
    )
    assert (x == 1).all()  # the caller's array as it was


def test_timing_rules_out_a_kernel_that_writes_its_input_and_the_run_is_right(
    tmp_path, monkeypatch
):
    """Timing calls a kernel some 25 times on the same arrays: one that wrote into its input
    compounded (the caller's 1.0 became 37876, the run returned 56815 where 1.5 is right).
    Now the write fails, the tactic is ruled out with a warning, and onnxruntime runs it."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    catalog = scale_relu_catalog("x")
    model = fusion.rewrite(scale_relu_model(), catalog).model
    x = np.ones((2, 4), np.float32)
    with pytest.warns(FusionWarning, match=r"ScaleRelu act: tactic kernel failed: output array"):
        session = fusion.Session(model, catalog=catalog, tactics="fastest")
        (y,) = session.run(None, {"x": x})
    assert (x == 1).all() and (y == np.float32(1.5)).all(), (x.max(), y.max())
    assert set(session.choices_for({"x": x}).values()) == {"onnxruntime"}


# ---- a plugin kernel that returns the wrong shape -------------------------------------------
WRONG_SHAPE = """
import numpy as np
import fusion
from fusion import Var, op


@fusion.register_pattern("NegRelu", op.Relu(op.Neg(Var("x", dtype="float32"))), inputs=("x",))
def neg_relu(x):
    return np.zeros((5, 2), np.float32)  # the node declares [N, 5]
"""


def neg_relu_model(reader: str) -> onnx.ModelProto:
    """NegRelu on x [N, 5], its output a graph output, read by an island or by another
    NegRelu kernel."""
    g = GraphBuilder()
    y = g.node("Relu", [g.node("Neg", ["x"])], name="first")
    if reader == "an island":
        y = g.node("Sigmoid", [y])
    elif reader == "a kernel":
        y = g.node("Relu", [g.node("Neg", [y])], name="second")
    return g.model({"x": ["N", 5]}, [y])


@pytest.mark.parametrize("reader", ["the caller", "an island", "a kernel"])
def test_fusion_run_refuses_a_kernel_output_of_another_shape(capsys, tmp_path, monkeypatch, reader):
    monkeypatch.setattr("fusion.registry.USER", fusion.Catalog())  # registered for this test
    plugin = tmp_path / "wrong_shape.py"
    plugin.write_text(WRONG_SHAPE)
    onnx.save(neg_relu_model(reader), tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.ones((3, 5), np.float32))
    argv = ["run", str(tmp_path / "m.onnx"), "--plugin", str(plugin), "--input",
            f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "out.npz")]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("fusion: error: fusion_plugin_wrong_shape.neg_relu of NegRelu "), err
    assert "returned shape [5, 2]" in err and "(declared [N, 5])" in err, err
    assert not (tmp_path / "out.npz").exists()


def neg_relu_catalog(wrong_rows: int) -> fusion.Catalog:
    """NegRelu whose kernel is right, except for inputs of `wrong_rows` rows: [5, 2] then."""
    catalog = fusion.Catalog()

    def neg_relu(x):
        return np.zeros((5, 2), np.float32) if len(x) == wrong_rows else np.maximum(-x, 0)

    pattern = op.Relu(op.Neg(Var("x", dtype="float32")))
    fusion.register_pattern("NegRelu", pattern, inputs=("x",), kernel=neg_relu, catalog=catalog)
    return catalog


@pytest.mark.parametrize("reader", ["the caller", "an island"])
def test_session_run_checks_every_run_of_a_kernel_against_the_declared_sizes(reader):
    """A shape that passed once does not excuse another one on a later run."""
    catalog = neg_relu_catalog(wrong_rows=3)
    model = fusion.rewrite(neg_relu_model(reader), catalog).model
    session = fusion.Session(model, catalog=catalog, tactics="kernel")
    for rows in (2, 4):
        feeds = {"x": -np.ones((rows, 5), np.float32)}
        assert_close(session.run(None, feeds)[0], run_ort(model, feeds)[0], 1e-6, 0)
    with pytest.raises(KernelError, match=r"NegRelu first returned shape \[5, 2\]") as err:
        session.run(None, {"x": np.ones((3, 5), np.float32)})
    assert "(declared [N, 5])" in str(err.value), err.value


def test_timing_rules_out_a_kernel_output_of_another_shape_naming_both(tmp_path, monkeypatch):
    """The per-node timing checks what it times: a tactic returning another shape than the
    body's is ruled out there with a warning, not chosen and then lost in the whole-plan race
    (which dropped every other kernel of the plan with it)."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    catalog = neg_relu_catalog(wrong_rows=3)
    model = fusion.rewrite(neg_relu_model("the caller"), catalog).model
    feeds = {"x": -np.ones((3, 5), np.float32)}
    pattern = r"NegRelu first: tactic kernel failed: returned float32 \[5, 2\] for \S+ where "
    with pytest.warns(FusionWarning, match=pattern + r"the node's function body gives float32"):
        session = fusion.Session(model, catalog=catalog, tactics="fastest")
        (y,) = session.run(None, feeds)
    assert (y == 1).all() and session.choices_for(feeds) == {"NegRelu first": "onnxruntime"}


# ---- norms of rows whose squares overflow float32 -------------------------------------------
E = 16


def rows() -> np.ndarray:
    """Finite rows of every magnitude float32 holds, one per row: the squares of all but the
    first and the tiny one overflow float32."""
    base = np.random.default_rng(3).standard_normal(E)
    base /= np.abs(base).max()
    scaled = [base * m for m in (1.0, 1e19, 3e19, 1e30, 3e38, 1e-30)]
    mixed = np.array([3e38, -1e-30, 1.0, 0.0, -2e38, 5e-45, 7.0, 1e19] * (E // 8))
    return np.stack([*scaled, mixed]).astype(np.float32)


def in_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph computing in float64: onnxruntime's answer without float32's range."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    graph = wide.graph
    for k, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            array = numpy_helper.to_array(init).astype(np.float64)
            graph.initializer[k].CopyFrom(numpy_helper.from_array(array, init.name))
    for vi in (*graph.input, *graph.output):
        vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    del graph.value_info[:]
    return wide


def norm_model(kind: str) -> tuple[onnx.ModelProto, list[str]]:
    g = GraphBuilder(seed=11)
    gamma, beta = g.weight(E, scale=1.0), g.weight(E, scale=0.1)
    if kind == "RMSNorm":
        mean_square = g.node("ReduceMean", [g.node("Mul", ["x", "x"])], axes=[-1])
        std = g.node("Sqrt", [g.node("Add", [mean_square, g.const(np.float32(1e-6))])])
        y = g.node("Mul", [g.node("Div", ["x", std]), gamma])
        return g.model({"x": ["N", E]}, [y]), [y]
    x = g.node("Add", ["x", "r"]) if kind == "SkipLayerNorm" else "x"
    y = g.node("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)
    inputs = {"x": ["N", E], "r": ["N", E]} if kind == "SkipLayerNorm" else {"x": ["N", E]}
    outputs = [y, x] if kind == "SkipLayerNorm" else [y]
    return g.model(inputs, outputs), outputs


def norm_feeds(kind: str, x: np.ndarray) -> dict:
    if kind != "SkipLayerNorm":
        return {"x": x}
    r = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    return {"x": x, "r": r}


@pytest.mark.parametrize("kind", ["LayerNorm", "SkipLayerNorm", "RMSNorm"])
def test_norms_of_finite_rows_of_any_magnitude_are_finite_and_right(kind):
    """float32 squares overflow from |x| about 1e19: onnxruntime returns zeros there, the
    kernel returned NaN; both are wrong. The oracle is onnxruntime on the same graph in
    float64; below the overflow onnxruntime's float32 agrees with it."""
    model, outputs = norm_model(kind)
    fused = fusion.rewrite(model).model
    assert fused_ops(fused) == [kind]
    feeds = norm_feeds(kind, rows())
    got = fusion.Session(fused).run(None, feeds)
    wide = run_ort(in_float64(model), {k: v.astype(np.float64) for k, v in feeds.items()})
    for name, value, want in zip(outputs, got, wide, strict=True):
        assert np.isfinite(value).all(), (name, np.isfinite(value).all(axis=-1))
        assert_close(value, want, 1e-4, 1e-5, check_dtype=False, what=name)
    small = [0, 5]  # rows of magnitude 1 and 1e-30: onnxruntime's float32 is right there
    plain = run_ort(model, {k: v[small] for k, v in feeds.items()})
    assert_close(got[0][small], plain[0], 1e-4, 1e-5, what=outputs[0])


@pytest.mark.parametrize("kind", ["LayerNorm", "SkipLayerNorm", "RMSNorm"])
def test_norms_pass_nan_and_inf_on_as_onnxruntime_does(kind):
    model, _ = norm_model(kind)
    fused = fusion.rewrite(model).model
    x = np.tile(np.linspace(-2, 2, E, dtype=np.float32), (3, 1))
    x[0, 3], x[1, 5], x[2, 7] = np.nan, np.inf, -np.inf
    feeds = norm_feeds(kind, x)
    got = fusion.Session(fused).run(None, feeds)
    for value, want in zip(got, run_ort(model, feeds), strict=True):
        assert_close(value, want, 1e-4, 1e-5)  # NaN where onnxruntime's is, the rest equal
