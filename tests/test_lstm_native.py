"""LSTMOp: the ONNX LSTM op runs on the sequence kernel in every direction and layout, with and
without initial states, and matches onnxruntime's own op; what the kernel does not do is a
near-miss with its reason."""

import numpy as np
import onnx
import pytest
from helpers import assert_all_close, fused_ops, near_miss, run_ort
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion.models import LSTMWeights, native_lstm
from fusion.runtime import Session

CATALOG = fusion.default_catalog()
ATOL = 1e-5


def lstm_model(size, hidden, direction="forward", layout=0, states=True, outputs=3, **attrs):
    """One ONNX LSTM node with random weights; X and the states are graph inputs."""
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(size + hidden)
    scale = 1 / np.sqrt(hidden)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.uniform(-scale, scale, shape).astype(np.float32), name)

    inits = [weight("W", dirs, 4 * hidden, size), weight("R", dirs, 4 * hidden, hidden)]
    inits.append(weight("B", dirs, 8 * hidden))
    x_dims = ["T", "N", size] if layout == 0 else ["N", "T", size]
    s_dims = [dirs, "N", hidden] if layout == 0 else ["N", dirs, hidden]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_dims)]
    names = ["X", "W", "R", "B", ""]
    if states:
        names += ["h0", "c0"]
        inputs += [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, s_dims) for n in ("h0", "c0")
        ]
    outs = ["Y", "Y_h", "Y_c"][:outputs]
    node = helper.make_node("LSTM", names, outs, hidden_size=hidden, direction=direction,
                            layout=layout, **attrs)  # fmt: skip
    y_dims = ["T", dirs, "N", hidden] if layout == 0 else ["N", "T", dirs, hidden]
    dims = [y_dims, s_dims, s_dims]
    infos = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, d)
        for n, d in zip(outs, dims, strict=False)
    ]
    graph = helper.make_graph([node], "lstm", inputs, infos, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(model, steps, batch, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for inp in model.graph.input:
        dims = [d.dim_value or {"T": steps, "N": batch}[d.dim_param]
                for d in inp.type.tensor_type.shape.dim]  # fmt: skip
        out[inp.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def check(model, shapes=((1, 1), (4, 3), (3, 17))):
    result = fusion.rewrite(model, CATALOG)
    assert fused_ops(result.model) == ["LSTMOp"], result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    session = Session(model, threads=2, catalog=CATALOG)
    assert [s.kind for s in session.steps] == ["kernel"]
    for steps, batch in shapes:
        x = feeds(model, steps, batch)
        want = run_ort(model, x)
        assert_all_close(session.run(None, x), want, rtol=0, atol=ATOL)
        assert_all_close(run_ort(result.model, x), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("states", [True, False])
def test_lstm_op_runs_on_the_kernel(direction, states):
    check(lstm_model(5, 13, direction, states=states))  # hidden not a multiple of 8


def test_only_the_present_outputs():
    check(lstm_model(4, 9, "bidirectional", outputs=2))


@pytest.mark.parametrize("steps, batch", [(1, 1), (5, 3)])
def test_unsqueeze_and_squeeze_around_one_direction_fold_in(steps, batch):
    """fusion.models.native_lstm: Unsqueeze of h0, c0 before, Squeeze of Y, Y_h, Y_c after: one
    kernel call, no island; with Y_h also read as it is, its Squeeze stays outside."""
    w = LSTMWeights.random(6, 11, seed=steps)
    model = native_lstm(w, steps, batch)
    x = {"X": feeds(model, steps, batch)["X"]} | {
        k: np.random.default_rng(1).standard_normal((batch, 11)).astype(np.float32)
        for k in ("h0", "c0")
    }
    session = Session(model, threads=2, catalog=CATALOG)
    assert [s.kind for s in session.steps] == ["kernel"]
    assert_all_close(session.run(None, x), run_ort(model, x), rtol=0, atol=ATOL)
    y_h = next(n for n in model.graph.node if n.op_type == "LSTM").output[1]
    model.graph.output.append(helper.make_tensor_value_info(y_h, TensorProto.FLOAT, [1, batch, 11]))
    session = Session(model, threads=2, catalog=CATALOG)
    assert [s.kind for s in session.steps] == ["kernel", "island"]
    assert_all_close(session.run(None, x), run_ort(model, x), rtol=0, atol=ATOL)


def test_pytorch_nn_lstm_two_layers():
    """nn.LSTM(6, 12, num_layers=2) and bidirectional, as torch.onnx.export writes them (the
    Slices of the states, the Squeeze or Transpose + Reshape between layers, the Concat of the
    final states stay in onnxruntime)."""
    from pathlib import Path

    for name in ("lstm_2layers.onnx", "lstm_2layers_bidirectional.onnx"):
        model = onnx.load(str(Path(__file__).parent / "fixtures" / name))
        assert fused_ops(fusion.rewrite(model, CATALOG).model) == ["LSTMOp", "LSTMOp"]
        session = Session(model, threads=2, catalog=CATALOG)
        for batch in (1, 3):
            x = feeds(model, 5, batch)
            assert_all_close(session.run(None, x), run_ort(model, x), rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "attrs, reason",
    [
        (dict(clip=3.0), "clip=3.0: the kernel does not clip"),
        (dict(input_forget=1), "input_forget=1"),
        (dict(activations=["Sigmoid", "Relu", "Tanh"]), "the kernel runs Sigmoid, Tanh, Tanh"),
        (dict(layout=1), "layout=1 (batch first)"),
    ],
)
def test_what_the_kernel_does_not_do_is_a_near_miss(attrs, reason):
    near_miss(lstm_model(4, 5, **attrs), "LSTMOp", reason, catalog=CATALOG)


def test_sequence_lens_and_peepholes_are_near_misses():
    model = lstm_model(4, 5)
    node = model.graph.node[0]
    node.input[4] = "lens"
    model.graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"]))
    near_miss(model, "LSTMOp", "sequence_lens given", catalog=CATALOG)
    model = lstm_model(4, 5)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((1, 15), np.float32), "P"))
    model.graph.node[0].input.append("P")
    near_miss(model, "LSTMOp", "P given", catalog=CATALOG)
