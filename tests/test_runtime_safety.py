"""What a run promises whatever a kernel does (issue 24): a kernel never writes into the
caller's arrays or into values other steps read (its inputs are read-only), and the norm
kernels give a finite row for any finite row."""

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, assert_close, fused_ops, run_ort
from onnx import TensorProto, numpy_helper

import fusion
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
