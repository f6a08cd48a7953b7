"""Running with bad feeds: unreadable files, None, arrays of no one shape, memory layouts, batch 0,
signalling NaNs; each a one-line error (exit 2) or the result onnxruntime gives.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from helpers import (
    READING_A_MODEL,
    GraphBuilder,
    assert_close,
    assert_refused,
    cli,
    conv_block,
    random_feeds,
    run_ort,
    small_model,
    state,
    typed_model,
)
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion.errors import FusionError
from fusion.modelfile import save_model
from fusion.models import conv_stack
from fusion.runtime import InvalidFeed


# ---- running with bad feeds ------------------------------------------------------------------
def two_input_model() -> onnx.ModelProto:
    g = GraphBuilder()
    y = conv_block(g, "x", 3, 4, bias="add")
    z = g.node("Add", [y, "b"])
    graph_inputs = {"x": ["N", 3, 5, 5], "b": [1, 4, 1, 1]}
    return g.model(graph_inputs, [z])


def x_value(shape=(1, 3, 5, 5), dtype=np.float32):
    return np.ones(shape, dtype)


FEED_ERRORS = {
    "missing input": ({"x": x_value()}, r"Required inputs (['b']) are missing"),
    "extra input": (
        {"x": x_value(), "b": np.ones((1, 4, 1, 1), np.float32), "c": x_value()},
        "Invalid input name: c",
    ),
    "wrong dtype": (
        {"x": x_value(dtype=np.float64), "b": np.ones((1, 4, 1, 1), np.float32)},
        "Actual: (float64), expected: (float32)",
    ),
    "wrong shape": (
        {"x": x_value((1, 2, 5, 5)), "b": np.ones((1, 4, 1, 1), np.float32)},
        "invalid dimensions for input: x index: 1 Got: 2 Expected: 3",
    ),
    "wrong rank": (
        {"x": x_value((3, 5, 5)), "b": np.ones((1, 4, 1, 1), np.float32)},
        "Invalid rank for input: x Got: 3 Expected: 4",
    ),
}


@pytest.mark.parametrize("case", list(FEED_ERRORS))
def test_session_run_with_bad_feeds(case):
    feeds, message = FEED_ERRORS[case]
    session = fusion.Session(two_input_model(), threads=1)
    assert [s.kind for s in session.steps].count("kernel") == 1
    with pytest.raises(InvalidFeed) as err:
        session.run(None, feeds)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("case", list(FEED_ERRORS))
def test_fusion_run_with_bad_feeds(capsys, tmp_path, case):
    feeds, message = FEED_ERRORS[case]
    save_model(two_input_model(), tmp_path / "m.onnx")
    argv = ["run", tmp_path / "m.onnx", "-o", tmp_path / "out.npz"]
    for name, value in feeds.items():
        np.save(tmp_path / f"{name}.npy", value)
        argv += ["--input", f"{name}={tmp_path / name}.npy"]
    before = state(tmp_path)
    assert_refused(cli(capsys, *argv), message, tmp_path, before)


def test_fusion_run_with_an_unreadable_input_file(capsys, tmp_path):
    save_model(two_input_model(), tmp_path / "m.onnx")
    (tmp_path / "x.npy").write_bytes(b"not numpy")
    before = state(tmp_path)
    result = cli(capsys, "run", tmp_path / "m.onnx", "--input", f"x={tmp_path / 'x.npy'}")
    assert_refused(result, "cannot read it as .npy", tmp_path, before)


def string_input_model() -> onnx.ModelProto:
    """Identity on a string tensor: onnxruntime runs it; no random values can be made for it."""
    s = helper.make_tensor_value_info("s", TensorProto.STRING, [2])
    t = helper.make_tensor_value_info("t", TensorProto.STRING, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "g", [s], [t])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("command", ["run", "verify", "bench", "tune"])
def test_an_input_that_needs_values_names_the_option_to_give_them(
    capsys, tmp_path, monkeypatch, command
):
    """The CLI names its --input option (the library says inputs=); tune has none."""
    save_model(string_input_model(), tmp_path / "s.onnx")
    before = state(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = cli(capsys, command, "s.onnx", *READING_A_MODEL[command])
    how = (
        ", and fusion tune only makes random inputs"
        if command == "tune"
        else "; give its values: --input s=FILE.npy"
    )
    assert_refused(result, f"input 's' is of type string: no random values can be made{how}",
                   tmp_path, before)  # fmt: skip
    with pytest.raises(fusion.FusionError, match="no random values can be made; pass inputs=$"):
        fusion.verify(string_input_model())


@pytest.mark.parametrize("force_color", [False, True])
@pytest.mark.parametrize("command", ["run", "tune"])
def test_progress_writes_nothing_where_stderr_is_not_a_terminal(
    capsys, tmp_path, monkeypatch, command, force_color
):
    """run and tune show a progress bar while kernels compile, on a terminal only: elsewhere a
    run that succeeds writes nothing to stderr, and an error is its one line (rich ended even
    an invisible bar with a blank line). FORCE_COLOR makes rich take any file for a terminal;
    the bar still asks the file."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    if force_color:
        monkeypatch.setenv("FORCE_COLOR", "1")
    save_model(small_model(), tmp_path / "m.onnx")
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, command, "m.onnx")
    assert code == 0 and err == "", repr(err)
    before = state(tmp_path)
    if command == "run":
        result = cli(capsys, "run", "m.onnx", "--input", "input=nope.npy")
        assert_refused(result, "nope.npy: cannot read it as .npy/.npz", tmp_path, before)
    else:  # tune checks its inputs before the bar: an error after it, once the kernels are built

        def fails(race):
            raise FusionError("the race cannot be described")

        monkeypatch.setattr("fusion.cli.tune.describe_race", fails)
        assert_refused(cli(capsys, "tune", "m.onnx"), "cannot be described", tmp_path, before)


def test_fusion_run_of_a_model_onnxruntime_cannot_run(capsys, tmp_path):
    """float64 Conv has no CPU kernel in onnxruntime: its one-line error, exit 2."""
    save_model(typed_model(TensorProto.DOUBLE), tmp_path / "m.onnx")
    before = state(tmp_path)
    result = cli(capsys, "run", tmp_path / "m.onnx")
    assert_refused(
        result, "onnxruntime: Could not find an implementation for Conv", tmp_path, before
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "cannot read it as .npy/.npz (the file is empty)"),
        ("two arrays", "an .npz archive of 2 arrays where one array (.npy) is expected"),
        ("truncated", "cannot read it as .npy/.npz (Failed to read all data"),
    ],
)
def test_fusion_run_with_an_input_file_that_holds_no_one_array(capsys, tmp_path, content, message):
    save_model(two_input_model(), tmp_path / "m.onnx")
    x = tmp_path / "x.npy"
    if content == "two arrays":
        with open(x, "wb") as f:  # an .npz archive, whatever its name
            np.savez(f, a=x_value(), b=x_value())
    elif content == "truncated":
        np.save(x, x_value())
        x.write_bytes(x.read_bytes()[:-8])
    else:
        x.write_bytes(content)
    before = state(tmp_path)
    result = cli(capsys, "run", tmp_path / "m.onnx", "--input", f"x={x}")
    assert_refused(result, message, tmp_path, before)


def test_session_run_with_an_input_that_is_none():
    session = fusion.Session(two_input_model(), threads=1)
    with pytest.raises(InvalidFeed, match=r"^Input b is None: expected tensor\(float\)$"):
        session.run(None, {"x": x_value(), "b": None})


@pytest.mark.parametrize("value", ["abc", [[1.0, 2.0], [3.0]]])
def test_session_run_with_an_input_that_is_no_array(value):
    session = fusion.Session(two_input_model(), threads=1)
    with pytest.raises(InvalidFeed, match=r"^Input b is a (str|list) that is no array of float32"):
        session.run(None, {"x": x_value(), "b": value})


@pytest.mark.parametrize("layout", ["Fortran order", "strided view", "Fortran order, from a file"])
def test_feeds_in_any_memory_layout_are_accepted(capsys, tmp_path, layout):
    """onnxruntime accepts any layout; so does Session, making one C-ordered copy."""
    model = small_model()
    x = random_feeds(model)["input"]
    want = run_ort(model, {"input": x})[0]
    if layout == "strided view":
        wide = np.zeros((*x.shape[:3], 2 * x.shape[3]), np.float32)
        wide[..., ::2] = x
        feed = wide[..., ::2]
    else:
        feed = np.asfortranarray(x)
    if layout.endswith("from a file"):
        save_model(model, tmp_path / "m.onnx")
        np.save(tmp_path / "x.npy", feed)
        argv = ["run", tmp_path / "m.onnx", "--input", f"input={tmp_path / 'x.npy'}"]
        argv += ["-o", tmp_path / "out.npz"]
        assert cli(capsys, *argv)[0] == 0
        got = np.load(tmp_path / "out.npz")[model.graph.output[0].name]
    else:
        assert not feed.flags.c_contiguous
        (got,) = fusion.Session(model, threads=1).run(None, {"input": feed})
    assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tactics", ["kernel", "fastest"])
def test_batch_0_gives_empty_outputs_like_onnxruntime(capsys, tmp_path, tactics):
    model = conv_stack(blocks=2, channels=4, size=6)
    x = np.zeros((0, 4, 6, 6), np.float32)
    want = run_ort(model, {"input": x})
    session = fusion.Session(model, threads=1, tactics=tactics)
    assert [s.kind for s in session.steps if s.kind != "convert"] == ["kernel", "kernel"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to time on an empty batch: no tactic fails
        got = session.run(None, {"input": x})
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    save_model(model, tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", x)
    code, out, err = cli(capsys, "run", tmp_path / "m.onnx", "--input", f"input={tmp_path}/x.npy")
    assert code == 0 and "float32 [0, 4, 6, 6]" in out, err


def test_a_signalling_nan_in_the_weights_runs_like_onnxruntime_without_a_warning(capsys, tmp_path):
    # A corrupted file's weight bytes can spell a signalling NaN (0x7f800001): widening it to
    # float64 while the kernel is built raised "invalid value encountered in cast" (CI fuzz).
    model = conv_stack(blocks=2, channels=4, size=6)
    weight = model.graph.initializer[0]
    values = numpy_helper.to_array(weight).copy()
    values.reshape(-1).view(np.uint32)[:3] = 0x7F800001
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 6)).astype(np.float32)
    want = run_ort(model, {"input": x})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fusion.Session(model, threads=1).run(None, {"input": x})
    assert np.isnan(want[0]).any()
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    save_model(model, tmp_path / "m.onnx")
    code, _, err = cli(capsys, "run", tmp_path / "m.onnx", "-o", tmp_path / "o.npz")
    assert code == 0 and not err.strip(), err
