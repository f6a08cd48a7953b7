"""Model files that are not models, or not ones onnxruntime can load, get one clear line.

Every refusal is checked the same way (helpers.assert_refused): exit code 2, exactly one line on
stderr naming the problem (no traceback), and the folder holding the input byte for byte as it
was. Covers files that are not models, corrupt or truncated ones, devices and pipes, external data
outside the model's folder, and what only the ONNX checker minds. Model files with a random bit or
byte corrupted are fuzzed in test_fuzz.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    READING_A_MODEL,
    assert_close,
    assert_refused,
    cli,
    random_feeds,
    run_ort,
    save_external,
    small_model,
    state,
)
from onnx import helper, numpy_helper

import fusion
from fusion.cli import main
from fusion.modelfile import all_tensors, save_model


def modified(change) -> onnx.ModelProto:
    model = small_model()
    change(model)
    return model


def cut_before_opset(model: onnx.ModelProto) -> bytes:
    """The file cut cleanly between two fields: the graph is whole, opset_import is gone."""
    data = model.SerializeToString()
    head = onnx.ModelProto()
    head.CopyFrom(model)
    del head.opset_import[:]
    assert data.startswith(head.SerializeToString())  # fields are written in number order
    return data[: head.ByteSize()]


# ---- model files ---------------------------------------------------------------------------
def undefined_input(m):
    m.graph.node[0].input[0] = "nowhere"


def unknown_op(m):
    m.graph.node[2].op_type = "Relux"


BAD_FILES = {
    "missing": (None, "no such file"),
    "empty": (b"", "the file is empty"),
    "random bytes": (np.random.default_rng(0).bytes(3000), "not an ONNX model"),
    "text": (b"this is not a model\n" * 10, "not an ONNX model"),
    "truncated half": (small_model().SerializeToString()[:900], "truncated"),
    "truncated by one byte": (small_model().SerializeToString()[:-1], "truncated"),
    "truncated between fields": (cut_before_opset(small_model()), "without opset_import"),
    "a TensorProto": (numpy_helper.from_array(np.ones(3, np.float32), "t"), "not an ONNX model"),
    "a GraphProto": (small_model().graph, "not an ONNX model"),
    "a NodeProto": (helper.make_node("Relu", ["x"], ["y"]), "not an ONNX model"),
    "checker: undefined input": (modified(undefined_input), "fails the ONNX checker: Nodes"),
    "checker: unknown op": (modified(unknown_op), "fails the ONNX checker: No Op registered"),
    # only the checker's full check (strict shape inference) sees it; onnxruntime refuses it too
    "checker and onnxruntime: unknown element type": (
        modified(lambda m: setattr(m.graph.input[0].type.tensor_type, "elem_type", 99)),
        "fails the ONNX checker: Invalid tensor data type 99",
    ),
    "IR version onnxruntime cannot load": (
        modified(lambda m: setattr(m, "ir_version", 15)),
        "cannot load it: IR version 15 (it supports up to",
    ),
    "opset onnxruntime cannot load": (
        modified(lambda m: setattr(m.opset_import[0], "version", 99)),
        "cannot load it: opset 99 of domain ai.onnx (it supports up to",
    ),
    "corrupt initializer": (
        modified(lambda m: setattr(m.graph.initializer[0], "raw_data", b"\0" * 8)),
        "tensor 'conv0.weight' has 8 bytes, but shape [4, 4, 3, 3] of float32 needs 576",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.parametrize("command", list(READING_A_MODEL))
def test_bad_file_is_refused(capsys, tmp_path, monkeypatch, case, command):
    content, message = BAD_FILES[case]
    src = tmp_path / "in.onnx"
    if content is not None:
        src.write_bytes(content if isinstance(content, bytes) else content.SerializeToString())
    before = state(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = cli(capsys, command, src, *READING_A_MODEL[command])
    assert_refused(result, message, tmp_path, before)


def test_directory_is_refused(capsys, tmp_path):
    (tmp_path / "in.onnx").mkdir()
    before = state(tmp_path)
    result = cli(capsys, "rewrite", tmp_path / "in.onnx", "-o", tmp_path / "out.onnx")
    assert_refused(result, "is a directory", tmp_path, before)


def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "in.onnx").write_bytes(b"junk" * 100)
    with pytest.raises(fusion.FusionError, match="not an ONNX model"):
        main(["rewrite", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "o.onnx"), "--debug"])


@pytest.mark.parametrize("kind", ["device", "named pipe"])
@pytest.mark.parametrize("command", ["rewrite", "run", "verify"])
def test_a_device_or_a_pipe_is_not_a_model_file(capsys, tmp_path, command, kind):
    src = Path("/dev/urandom")
    if kind == "named pipe":
        src = tmp_path / "pipe.onnx"
        os.mkfifo(src)  # reading it would block: it must be refused unread
    before = state(tmp_path)
    out = ["-o", tmp_path / ("out.onnx" if command == "rewrite" else "out.npz")]
    result = cli(capsys, command, src, *(out if command != "verify" else []))
    assert_refused(result, "not a regular file (a device, a pipe or a socket)", tmp_path, before)


def test_a_plugin_that_is_a_directory(capsys, tmp_path):
    before = state(tmp_path)
    assert_refused(
        cli(capsys, "patterns", "--plugin", tmp_path), "is a directory", tmp_path, before
    )


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_external_data_outside_the_folder_is_refused_before_anything_is_learnt_of_it(
    capsys, tmp_path, where
):
    """Containment is checked before sizes: the message says nothing of the outside file (here
    100 bytes, less than the weights need, which an earlier size check would have told)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "secret").write_bytes(b"s" * 100)
    save_external(small_model(), tmp_path / "sub" / "in.onnx", location="w.bin")
    model = onnx.load(str(tmp_path / "sub" / "in.onnx"), load_external_data=False)
    location = "../secret" if where == "relative" else str(tmp_path / "secret")
    for tensor in all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    (tmp_path / "sub" / "in.onnx").write_bytes(model.SerializeToString())
    before = state(tmp_path)
    result = cli(capsys, "rewrite", tmp_path / "sub" / "in.onnx", "-o", tmp_path / "out.onnx")
    assert_refused(result, "points outside the directory of the model", tmp_path, before)
    told = result[2].replace(str(tmp_path), "<tmp>")  # pytest's folder may hold "100" itself
    assert "100" not in told and "bytes" not in told


def model_without_output_shape() -> onnx.ModelProto:
    """Its output declared with a dtype and no shape: the checker rejects it, onnxruntime (and
    every exporter that leaves it so) does not mind."""
    model = small_model()
    model.graph.output[0].type.tensor_type.ClearField("shape")
    return model


@pytest.mark.parametrize("command", list(READING_A_MODEL))
def test_a_model_only_the_checker_rejects_is_used_with_a_warning(
    capsys, tmp_path, monkeypatch, command
):
    src = tmp_path / "in.onnx"
    save_model(model_without_output_shape(), src)
    monkeypatch.chdir(tmp_path)
    code, stdout, err = cli(capsys, command, src, *READING_A_MODEL[command])
    assert code == 0, err
    assert err.strip().splitlines() == [
        f"fusion: warning: {src} fails the ONNX checker: Field 'shape' of 'type' is required but "
        "missing.; onnxruntime loads it, so going on"
    ]
    if command == "rewrite":
        assert "2 fusions" in stdout
        feeds = random_feeds(small_model())
        want = run_ort(small_model(), feeds)[0]
        assert_close(run_ort(tmp_path / "out.onnx", feeds)[0], want, rtol=1e-5, atol=1e-6)
