"""Bad input gets one clear line and loses nothing; what the catalog cannot fuse stays correct.

Every refusal is checked the same way: exit code 2, exactly one line on stderr naming the
problem (no traceback), and the folder holding input and output byte for byte as it was (no
output, no temporary file, the input untouched). The >2 GB case writes 4 GB and holds ~7 GB of
memory: it runs only with FUSION_SLOW=1 (`FUSION_SLOW=1 python -m pytest tests/test_bad_input.py
-k 2gb`, about a minute).

Sections, in order: model files (not models, corrupt, devices and pipes, what only the checker
minds), where the output goes, external data, nothing the tool writes destroys a file it reads
(file identity, a crash while replacing a model and its data, SIGTERM, file modes), bad feeds
(unreadable files, None, memory layouts, batch 0), fused nodes a kernel must not run and
kernels that misbehave, the kernel cache, models the catalog cannot fuse, control flow. Model
files with a random bit or byte corrupted are fuzzed in test_fuzz.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_close,
    control_flow_model,
    conv_block,
    fused_ops,
    random_feeds,
    run_ort,
    save_external,
)
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion import FusionWarning
from fusion.cli import main
from fusion.modelfile import all_tensors, save_model
from fusion.models import conv_stack
from fusion.numerics import compare_arrays
from fusion.runtime import InvalidFeed

slow = pytest.mark.skipif(not os.environ.get("FUSION_SLOW"), reason="set FUSION_SLOW=1 to run")


def state(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden temporaries too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(result, message: str, folder: Path, before: dict) -> None:
    code, _, err = result
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), repr(err)  # one line, no blank one
    assert err.startswith("fusion: error: ") and message in err, err
    assert state(folder) == before  # no output, no temporary file, the input unchanged


def data_names(folder: Path, model: str) -> list[str]:
    """The data files save_model wrote for `model` in `folder`: MODEL.<digest>.data."""
    return sorted(p.name for p in folder.glob(f"{model}.*.data"))


def external_locations(model: onnx.ModelProto) -> set[str]:
    return {e.value for t in all_tensors(model) for e in t.external_data if e.key == "location"}


def small_model(**kw) -> onnx.ModelProto:
    return conv_stack(blocks=2, channels=4, size=6, **kw)


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


# Every command that reads a model file, and what it needs besides (a quick bench).
READING_A_MODEL = {
    "rewrite": ["-o", "out.onnx"],
    "match": [],
    "run": ["-o", "out.npz"],
    "verify": [],
    "tune": [],
    "bench": ["--same-process", "--threads", "1", "--rounds", "1", "--budget", "0"]
    + ["--no-memory", "--no-compile", "--no-nodes"],
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
    assert "100" not in result[2] and "bytes" not in result[2]


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


# ---- where the output goes -------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "in.onnx"
    save_model(small_model(), path)
    return path


@pytest.mark.parametrize(
    "output, message",
    [
        ("in.onnx", "output is the input file; pass --in-place"),
        ("./sub/../in.onnx", "output is the input file"),
        ("nope/out.onnx", "the output directory"),
        ("in.onnx/out.onnx", "is a file, not a directory"),
        ("sub", "is a directory; give a file name"),
    ],
)
def test_output_that_cannot_or_must_not_be_written(capsys, tmp_path, model_file, output, message):
    (tmp_path / "sub").mkdir()
    before = state(tmp_path)
    result = cli(capsys, "rewrite", model_file, "-o", tmp_path / output)
    assert_refused(result, message, tmp_path, before)


def test_symlink_to_the_input_is_the_input(capsys, tmp_path, model_file):
    (tmp_path / "link.onnx").symlink_to(model_file)
    before = state(tmp_path)
    result = cli(capsys, "rewrite", model_file, "-o", tmp_path / "link.onnx")
    assert_refused(result, "output is the input file", tmp_path, before)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_output_directory(capsys, tmp_path, model_file):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        before = state(tmp_path)
        result = cli(capsys, "rewrite", model_file, "-o", folder / "out.onnx")
        assert_refused(result, "is not writable", tmp_path, before)
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize(
    "report, message",
    [
        ("nope/r.json", "the output directory"),
        ("in.onnx", "--report would overwrite the input file"),
        ("out.onnx", "--report and the output are the same file"),
    ],
)
def test_report_is_checked_before_anything_is_written(
    capsys, tmp_path, model_file, report, message
):
    before = state(tmp_path)
    argv = ["rewrite", model_file, "-o", tmp_path / "out.onnx", "--report", tmp_path / report]
    assert_refused(cli(capsys, *argv), message, tmp_path, before)


def test_run_output_must_not_overwrite_the_model(capsys, tmp_path, model_file):
    before = state(tmp_path)
    result = cli(capsys, "run", model_file, "-o", model_file)
    assert_refused(result, "the output would overwrite the input file", tmp_path, before)


def test_in_place_replaces_the_input_atomically(capsys, tmp_path, model_file):
    feeds = random_feeds(small_model())
    want = run_ort(small_model(), feeds)
    code, out, _ = cli(capsys, "rewrite", model_file, "-o", model_file, "--in-place")
    assert code == 0 and "2 fusions" in out
    assert sorted(state(tmp_path)) == ["in.onnx"]
    assert_close(run_ort(onnx.load(model_file), feeds)[0], want[0], rtol=1e-5, atol=0)


# ---- external data ---------------------------------------------------------------------------
def test_external_data_is_written_beside_the_output(capsys, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    model = conv_stack(blocks=3, channels=16, size=6)
    src, dst = tmp_path / "a" / "in.onnx", tmp_path / "b" / "out.onnx"
    save_external(model, src)
    inputs = state(tmp_path / "a")
    code, out, _ = cli(capsys, "rewrite", src, "-o", dst)
    assert code == 0 and "3 fusions" in out
    assert state(tmp_path / "a") == inputs
    (data,) = data_names(tmp_path / "b", "out.onnx")
    assert sorted(state(tmp_path / "b")) == ["out.onnx", data]
    fused = onnx.load(str(dst), load_external_data=False)
    assert all(n.domain == "fusion" for n in fused.graph.node)
    assert external_locations(fused) == {data}  # the weights stay outside the model file
    onnx.checker.check_model(str(dst), full_check=True)
    feeds = random_feeds(model)
    want = run_ort(src, feeds)
    for got in (run_ort(dst, feeds), fusion.Session(str(dst), threads=1).run(None, feeds)):
        assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    first = state(tmp_path / "b")
    assert cli(capsys, "rewrite", src, "-o", dst)[0] == 0
    assert state(tmp_path / "b") == first  # the same bytes again: the data is not appended


def test_external_data_with_nothing_to_fuse(capsys, tmp_path):
    g = GraphBuilder()
    y = g.node("Sigmoid", [g.node("MatMul", ["x", g.weight(64, 64)])])
    model = g.model({"x": [2, 64]}, [y])
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    save_external(model, src)
    code, out, _ = cli(capsys, "rewrite", src, "-o", dst)
    assert code == 0 and "0 fusions" in out
    (data,) = data_names(tmp_path, "out.onnx")
    assert sorted(state(tmp_path)) == ["in.onnx", "out.onnx", data, "weights.bin"]
    feeds = random_feeds(model)
    assert_close(run_ort(dst, feeds)[0], run_ort(src, feeds)[0], rtol=0, atol=0)


def test_in_place_with_external_data(capsys, tmp_path):
    model = conv_stack(blocks=2, channels=16, size=6)  # weights of 9 KB: external data
    src = tmp_path / "in.onnx"
    save_external(model, src, location="in.onnx.data")
    feeds = random_feeds(model)
    want = run_ort(src, feeds)
    assert cli(capsys, "rewrite", src, "-o", src, "--in-place")[0] == 0
    (data,) = data_names(tmp_path, "in.onnx")  # the old in.onnx.data is gone, a new one named
    assert sorted(state(tmp_path)) == ["in.onnx", data] and data != "in.onnx.data"
    assert_close(run_ort(src, feeds)[0], want[0], rtol=1e-4, atol=1e-5)


def test_output_must_not_replace_the_inputs_data(capsys, tmp_path):
    save_external(small_model(), tmp_path / "in.onnx", location="weights.bin")
    before = state(tmp_path)
    result = cli(capsys, "rewrite", tmp_path / "in.onnx", "-o", tmp_path / "weights.bin")
    assert_refused(result, "the output would overwrite weights.bin, where", tmp_path, before)
    assert "keeps its weights" in result[2]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda folder: (folder / "weights.bin").unlink(), "cannot read its external data"),
        (
            lambda folder: (folder / "weights.bin").write_bytes(b"\0" * 100),
            "has 100 bytes, but shape [4, 4, 3, 3] of float32 needs 576",
        ),
    ],
    ids=["missing", "truncated"],
)
def test_damaged_external_data(capsys, tmp_path, damage, message):
    save_external(small_model(), tmp_path / "in.onnx")
    damage(tmp_path)
    before = state(tmp_path)
    result = cli(capsys, "rewrite", tmp_path / "in.onnx", "-o", tmp_path / "out.onnx")
    assert_refused(result, message, tmp_path, before)


def test_external_data_outside_the_models_folder(capsys, tmp_path):
    (tmp_path / "sub").mkdir()
    save_external(small_model(), tmp_path / "sub" / "in.onnx", location="w.bin")
    model = onnx.load(str(tmp_path / "sub" / "in.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../w.bin"
    shutil.move(tmp_path / "sub" / "w.bin", tmp_path / "w.bin")
    (tmp_path / "sub" / "in.onnx").write_bytes(model.SerializeToString())
    before = state(tmp_path)
    result = cli(capsys, "rewrite", tmp_path / "sub" / "in.onnx", "-o", tmp_path / "out.onnx")
    assert_refused(result, "points outside the directory", tmp_path, before)


@slow
def test_model_over_2gb_with_external_data(capsys, tmp_path):
    """One external initializer of 2 GB + 4 KB (a sparse file of zeros, instant to create)
    read by a Gather, beside a conv block: rewritten, the weights go to OUT.data and the
    model still loads and gives the same outputs."""
    n = (2**31 + 4096) // 4
    model = small_model()
    big = onnx.TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[n])
    big.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "big.bin"), ("offset", "0"), ("length", str(4 * n))):
        big.external_data.add(key=key, value=value)
    index = numpy_helper.from_array(np.array([0, n - 1], np.int64), "index")
    model.graph.initializer.extend([big, index])
    model.graph.node.append(helper.make_node("Gather", ["big", "index"], ["picked"], name="g"))
    model.graph.output.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, [2]))
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    with open(tmp_path / "big.bin", "wb") as f:
        f.seek(4 * n - 4)  # the rest is a hole: zeros that take no disk
        f.write(np.float32(7.0).tobytes())
    src.write_bytes(model.SerializeToString())
    try:
        code, out, err = cli(capsys, "rewrite", src, "-o", dst)
        assert code == 0, err
        (data,) = data_names(tmp_path, "out.onnx")
        assert "fusion" in out and (tmp_path / data).stat().st_size >= 4 * n
        feeds = random_feeds(small_model())
        want, got = run_ort(src, feeds), run_ort(dst, feeds)
        assert_close(got[1], [0.0, 7.0], rtol=0, atol=0, check_dtype=False)
        assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    finally:
        for name in ("big.bin", *data_names(tmp_path, "out.onnx")):  # not 4 GB per run kept
            (tmp_path / name).unlink(missing_ok=True)


# ---- nothing the tool writes destroys a file it reads ------------------------------------------
# Every file a command writes is checked, by file identity, against every file it reads, before
# any work: the model, its external data, --input files, plugins (fusion.files.check_outputs).
@pytest.fixture
def ext_model(tmp_path) -> Path:
    """A small conv model whose weights are external data in weights.bin."""
    save_external(small_model(), tmp_path / "ext.onnx")
    return tmp_path / "ext.onnx"


WRITES_OVER_READS = {
    "--report over the input's weights": (
        ["rewrite", "ext.onnx", "-o", "out.onnx", "--report", "weights.bin"],
        "--report would overwrite weights.bin, where",
    ),
    "run -o over the input's weights": (
        ["run", "ext.onnx", "-o", "weights.bin"],
        "the output would overwrite weights.bin, where",
    ),
    "rewrite over the --input file": (
        ["rewrite", "ext.onnx", "-o", "x.npy", "--verify", "--input", "input=x.npy"],
        "the output would overwrite the --input file",
    ),
    "run -o over the --input file": (
        ["run", "ext.onnx", "--input", "input=x.npy", "-o", "x.npy"],
        "the output would overwrite the --input file",
    ),
    "rewrite over the plugin": (
        ["rewrite", "ext.onnx", "-o", "plugin.py", "--plugin", "plugin.py"],
        "the output would overwrite the plugin",
    ),
    "bench --json over the model": (["bench", "ext.onnx", "--json", "ext.onnx"], "--json would"),
    "bench --markdown over the weights": (
        ["bench", "ext.onnx", "--markdown", "weights.bin"],
        "--markdown would overwrite weights.bin",
    ),
    "bench --plot over the model": (["bench", "ext.onnx", "--plot", "ext.onnx"], "--plot would"),
    "bench --json and --plot the same file": (
        ["bench", "ext.onnx", "--json", "r.out", "--plot", "r.out"],
        "--plot and --json are the same file",
    ),
    "bench --json in a missing folder": (
        ["bench", "ext.onnx", "--json", "nope/r.json"],
        "the output directory",
    ),
}


@pytest.mark.parametrize("case", list(WRITES_OVER_READS))
def test_a_write_over_a_read_file_is_refused_before_any_work(
    capsys, tmp_path, ext_model, monkeypatch, case
):
    argv, message = WRITES_OVER_READS[case]
    np.save(tmp_path / "x.npy", random_feeds(small_model())["input"])
    (tmp_path / "plugin.py").write_text("# registers nothing\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fusion.cli.bench.measure", lambda *a: pytest.fail("the bench ran"))
    before = state(tmp_path)
    assert_refused(cli(capsys, *argv), message, tmp_path, before)


@pytest.mark.parametrize("name", ["OUT.<digest>.data", "OUT.data", "in place"])
def test_a_report_named_like_the_outputs_data_is_refused(capsys, tmp_path, name):
    """OUT's weights go to OUT.<digest>.data beside it, and the data files an older OUT kept
    there (OUT.data, OUT.<digest>.data) are removed: a --report of such a name would be
    overwritten by the weights, overwrite them (OUT no longer loads) or be removed."""
    model = conv_stack(blocks=2, channels=16, size=6)  # weights of 9 KB: OUT gets a data file
    src, out = tmp_path / "ext.onnx", tmp_path / "out.onnx"
    save_external(model, src)
    if name == "in place":
        out = src
    assert cli(capsys, "rewrite", src, "-o", out, *["--in-place"] * (out == src))[0] == 0
    (data,) = data_names(tmp_path, out.name)
    report = tmp_path / (f"{out.name}.data" if name == "OUT.data" else data)
    before = state(tmp_path)
    argv = ["rewrite", src, "-o", out, "--report", report, *["--in-place"] * (out == src)]
    message = f"--report has a name kept for the weights of the output ({out.name}.data or "
    assert_refused(cli(capsys, *argv), message, tmp_path, before)


def test_the_same_file_under_another_name_is_the_input(capsys, tmp_path, model_file):
    """A hard link (and, where mounting is allowed, a bind mount) is the input file itself."""
    os.link(model_file, tmp_path / "link.onnx")
    before = state(tmp_path)
    result = cli(capsys, "rewrite", model_file, "-o", tmp_path / "link.onnx")
    assert_refused(result, "output is the input file; pass --in-place", tmp_path, before)
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "--bind", tmp_path, mount], capture_output=True).returncode:
        return  # not allowed here (no root, or a container without mount rights)
    try:
        result = cli(capsys, "rewrite", model_file, "-o", mount / "in.onnx")
        assert result[0] == 2 and "output is the input file" in result[2]
        assert (tmp_path / "in.onnx").read_bytes() == before["in.onnx"]
    finally:
        subprocess.run(["umount", mount], check=True)


# A child process that runs `fusion rewrite` and, at the n-th os.replace or unlink, either dies
# on the spot (os._exit: a crash, nothing cleaned up) or gets SIGTERM.
INTERRUPTED = """
import os, signal, sys
from fusion.cli import main

n, how = int(sys.argv[1]), sys.argv[2]
calls = 0

def interrupt(real):
    def call(*args, **kwargs):
        global calls
        calls += 1
        if calls == n:
            if how == "crash":
                os._exit(9)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    return call

os.replace, os.unlink = interrupt(os.replace), interrupt(os.unlink)
sys.exit(main(sys.argv[3:]))
"""


def interrupted_rewrite(n: int, how: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", INTERRUPTED, str(n), how, "rewrite", *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.parametrize("in_place", [False, True], ids=["over an older output", "in place"])
def test_a_crash_while_replacing_a_model_and_its_data_leaves_one_whole_pair(tmp_path, in_place):
    """out.onnx + out.onnx.data (weights A) are replaced by a rewrite of new.onnx (weights B,
    the same shapes), or m.onnx (weights A) in place by its rewrite. A crash at any step leaves
    a pair that loads and gives A's outputs or B's, never a mix."""

    def weights(seed):  # 16 channels: weights of 9 KB, stored as external data
        return conv_stack(blocks=2, channels=16, size=6, seed=seed)

    feeds = random_feeds(weights(1))
    results = [run_ort(weights(seed), feeds)[0] for seed in (1, 2)]
    for n in range(1, 12):
        for f in tmp_path.iterdir():
            f.unlink()
        if in_place:
            src = out = tmp_path / "m.onnx"
        else:
            src, out = tmp_path / "new.onnx", tmp_path / "out.onnx"
            save_external(weights(2), src, location="new.onnx.data")
        save_external(weights(1), out, location=f"{out.name}.data")
        proc = interrupted_rewrite(n, "crash", src, "-o", out, *["--in-place"] * in_place)
        got = run_ort(out, feeds)[0]
        assert any(compare_arrays("y", got, w, 1e-5, 1e-6).ok for w in results), (n, proc.stderr)
        if proc.returncode == 0:
            break
        assert proc.returncode == 9, proc.stderr
    else:
        pytest.fail("the rewrite never completed")
    assert n > 2  # the crashes hit the data's and the model's renames
    (data,) = data_names(tmp_path, out.name)  # the old data is gone
    assert sorted(state(tmp_path)) == sorted({src.name, out.name, data, *state(tmp_path)} - {""})
    assert not [name for name in state(tmp_path) if name.endswith(".tmp")]


def test_sigterm_while_writing_cleans_up_like_ctrl_c(tmp_path, ext_model):
    before = state(tmp_path)
    proc = interrupted_rewrite(1, "sigterm", ext_model, "-o", tmp_path / "out.onnx")
    assert proc.returncode == 143 and proc.stderr.strip() == "fusion: terminated", proc.stderr
    assert state(tmp_path) == before  # no temporary file left, no output


@pytest.mark.parametrize("external", [False, True])
def test_written_files_get_the_umask_mode_and_in_place_keeps_the_mode(capsys, tmp_path, external):
    src = tmp_path / "in.onnx"
    (save_external if external else save_model)(conv_stack(blocks=2, channels=16, size=6), src)
    src.chmod(0o640)
    mask = os.umask(0o027)
    try:
        out = tmp_path / "out.onnx"
        assert cli(capsys, "rewrite", src, "-o", out, "--report", tmp_path / "r.json")[0] == 0
        data = [tmp_path / name for name in data_names(tmp_path, out.name)]
        written = [out, tmp_path / "r.json", *data]
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in written} == {
            f.name: 0o640 for f in written
        }
        os.umask(0o022)
        src.chmod(0o604)  # an unusual mode, kept
        assert cli(capsys, "rewrite", src, "-o", src, "--in-place")[0] == 0
        data = [tmp_path / n for n in data_names(tmp_path, src.name)]
        assert {stat.S_IMODE(f.stat().st_mode) for f in [src, *data]} == {0o604}
    finally:
        os.umask(mask)


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
    save_model(string_input_model(), tmp_path / "s.onnx")  # tune fails after the bar: no feed
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, command, "m.onnx")
    assert code == 0 and err == "", repr(err)
    before = state(tmp_path)
    if command == "run":
        result = cli(capsys, "run", "m.onnx", "--input", "input=nope.npy")
        assert_refused(result, "nope.npy: cannot read it as .npy/.npz", tmp_path, before)
    else:
        assert_refused(cli(capsys, "tune", "s.onnx"), "input 's'", tmp_path, before)


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


# ---- fused nodes a kernel must not run, kernels that misbehave ---------------------------------
def rewritten() -> onnx.ModelProto:
    return fusion.rewrite(small_model()).model


def edited_body(m: onnx.ModelProto) -> None:
    for node in m.functions[0].node:
        if node.op_type == "Relu":
            node.op_type = "Sigmoid"  # the overload (the hash of the old body) is kept


def another_tools_function(m: onnx.ModelProto) -> None:
    """fusion.ConvBiasRelu, as some other tool might write it: no overload, its own body."""
    edited_body(m)
    m.functions[0].ClearField("overload")
    for node in m.graph.node:
        node.ClearField("overload")


def one_input(m: onnx.ModelProto) -> None:
    """Another tool's fusion.ConvBiasRelu with one input: Relu(x + 1)."""
    another_tools_function(m)
    func = m.functions[0]
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    body = [
        helper.make_node("Constant", [], ["c"], value=one),
        helper.make_node("Add", ["in0", "c"], ["t"]),
        helper.make_node("Relu", ["t"], ["out0"]),
    ]
    del func.input[1:], func.node[:]
    func.node.extend(body)
    for node in m.graph.node:
        del node.input[1:]


def attribute_removed(m: onnx.ModelProto) -> None:
    node = m.graph.node[0]
    attrs = [a for a in node.attribute if a.name != "group"]
    del node.attribute[:]
    node.attribute.extend(attrs)


UNTRUSTED_NODES = {
    "body edited": (edited_body, "its function body is not the one the rule writes"),
    "another tool's function": (another_tools_function, "(content hash"),
    "one input": (one_input, "its function body is not the one the rule writes"),
    "attribute removed": (attribute_removed, "it lacks the attribute(s) group"),
}


@pytest.mark.parametrize("case", list(UNTRUSTED_NODES))
def test_a_fused_node_not_as_the_rule_wrote_it_runs_its_body(case):
    """The kernel is bound only to the body its rule writes, on a node with every input and
    attribute: anything else runs as plain onnxruntime would run the file, with a warning."""
    change, reason = UNTRUSTED_NODES[case]
    model = rewritten()
    change(model)
    feeds = random_feeds(small_model())
    with pytest.warns(FusionWarning, match="runs its function body in onnxruntime") as caught:
        session = fusion.Session(model, threads=1)
    assert reason in str(caught[0].message)
    assert_close(session.run(None, feeds)[0], run_ort(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_verify_of_an_edited_body_fails(capsys, tmp_path, model_file):
    model = rewritten()
    edited_body(model)
    save_model(model, tmp_path / "tampered.onnx")
    code, out, err = cli(capsys, "verify", model_file, tmp_path / "tampered.onnx")
    assert code == 1 and out.strip().endswith("FAIL"), out
    assert "fusion: warning: ConvBiasRelu" in err and "not the one the rule writes" in err


# A plugin whose Swish kernel (y = x * sigmoid(x)) misbehaves as MODE says.
PLUGIN = """
import numpy as np
import fusion
from fusion import Var, op

MODE = {mode!r}
x = Var("x", dtype="float32")


@fusion.register_pattern("Swish", op.Mul(x, op.Sigmoid(x)), inputs=("x",))
def swish(x):
    y = x / (1 + np.exp(-x))
    if MODE == "raises":
        raise RuntimeError("a bug in the plugin")
    if MODE == "two outputs":
        return y, y
    return {{"transposed": y.T, "float64": y.astype(np.float64)}}.get(MODE, y)
"""


@pytest.fixture
def swish(tmp_path, monkeypatch):
    """A Swish model (its output read by a Relu island) and a function writing the plugin."""
    monkeypatch.setattr("fusion.registry.USER", fusion.Catalog())  # registered for this test
    g = GraphBuilder()
    y = g.node("Relu", [g.node("Mul", ["x", g.node("Sigmoid", ["x"])])])
    save_model(g.model({"x": ["N", 3]}, [y]), tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3))

    def plugin(mode: str) -> Path:
        path = tmp_path / f"swish_{mode.replace(' ', '_')}.py"
        path.write_text(PLUGIN.format(mode=mode))
        return path

    return tmp_path / "m.onnx", plugin


@pytest.mark.parametrize(
    "mode, message",
    [
        ("transposed", "returned shape [3, 2] where the node declares size 3 on axis 1 for"),
        ("float64", "returned dtype float64 where the node declares float32 for"),
        ("two outputs", "returned 2 outputs; the node has 1"),
        ("raises", "failed: RuntimeError: a bug in the plugin"),
    ],
)
def test_a_kernel_that_misbehaves_is_named(capsys, tmp_path, swish, mode, message):
    model, plugin = swish
    argv = ["run", model, "--plugin", plugin(mode), "--input", f"x={tmp_path / 'x.npy'}"]
    before = state(tmp_path)
    result = cli(capsys, *argv, "-o", tmp_path / "out.npz")
    assert_refused(result, message, tmp_path, before)
    assert f"fusion_plugin_swish_{mode.replace(' ', '_')}.swish of Swish" in result[2]


@pytest.mark.parametrize("tactics", ["kernel", "fastest"])
@pytest.mark.parametrize(
    "mode, reason",
    [
        ("raises", "RuntimeError: a bug in the plugin"),
        ("two outputs", "returned 2 outputs"),
        ("float64", "returned dtype float64 where the node declares float32"),
    ],
)
def test_rewrite_verify_rolls_back_a_kernel_that_misbehaves(
    capsys, tmp_path, monkeypatch, swish, mode, reason, tactics
):
    # At the default tactics a timed session may leave the node to onnxruntime (a kernel that
    # raises is ruled out): verify still runs every kernel, so it checks something.
    monkeypatch.setenv("FUSION_TACTICS", tactics)
    model, plugin = swish
    out = tmp_path / "out.onnx"
    argv = ["rewrite", model, "-o", out, "--verify", "--plugin", plugin(mode)]
    code, stdout, err = cli(capsys, *argv)
    assert code == 0, err
    assert "rolled back: kernel disagrees with onnxruntime" in stdout and reason in stdout, stdout
    assert "0 fusions" in stdout and fused_ops(onnx.load(out)) == []
    code, stdout, _ = cli(capsys, "verify", model, "--plugin", plugin(mode))
    assert code == 1 and "FAIL" in stdout and reason in stdout, stdout


def test_rewrite_verify_checks_what_a_rollback_fuses_again(capsys, tmp_path, monkeypatch):
    """A Conv + Add + Relu chain rolled back at its Relu fuses again as Conv + Add under the
    Add's name: that fusion is verified too, and rolled back as well when it disagrees."""
    from patterns import conv

    def off_by_half(attrs, constants):  # the real kernel, plus 0.5 everywhere
        run = conv.make_kernel(attrs, constants)
        return lambda *args: tuple(y + np.float32(0.5) for y in run(*args))

    wrong = fusion.Catalog([dataclasses.replace(conv.RULE, prepare=off_by_half)])
    monkeypatch.setattr("fusion.cli.rewrite.default_catalog", lambda: wrong)
    save_model(conv_stack(blocks=1, channels=4, size=6), tmp_path / "m.onnx")
    code, out, err = cli(capsys, "rewrite", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx",
                         "--verify")  # fmt: skip
    assert code == 0, err
    assert out.count("rolled back: kernel disagrees") >= 2 and "0 fusions" in out, out
    assert fused_ops(onnx.load(tmp_path / "o.onnx")) == []


def test_a_kernel_output_that_is_a_graph_output_has_the_bodys_sizes(
    capsys, tmp_path, monkeypatch, swish
):
    """A graph output's declared sizes are not enforced (onnxruntime does not either), but a
    kernel's output sizes that differ from them must be what the function body gives."""
    _, plugin = swish
    g = GraphBuilder()
    y = g.node("Mul", ["x", g.node("Sigmoid", ["x"])])
    model = g.model({"x": ["N", 3]}, [y])
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 5  # onnxruntime gives 3
    save_model(model, tmp_path / "m.onnx")
    argv = ["run", tmp_path / "m.onnx", "--input", f"x={tmp_path / 'x.npy'}"]
    code, out, err = cli(capsys, *argv, "--plugin", plugin("right"))
    assert code == 0 and f"{y}: float32 [2, 3]" in out, err
    monkeypatch.setattr("fusion.registry.USER", fusion.Catalog())  # a second plugin's Swish
    transposed = plugin("transposed")
    before = state(tmp_path)
    result = cli(capsys, *argv, "--plugin", transposed, "-o", tmp_path / "o.npz")
    message = f"returned shape [3, 2] for {y} where the node's function body gives [2, 3]"
    assert_refused(result, message, tmp_path, before)


def test_a_fused_model_whose_input_rank_breaks_its_kernels_is_refused_in_one_line(capsys, tmp_path):
    # The input declared [1, 6, 6] where the conv needs NCHW: onnxruntime does not load it.
    model = fusion.rewrite(conv_stack(blocks=2, channels=8, size=6)).model
    del model.graph.input[0].type.tensor_type.shape.dim[1]
    save_model(model, tmp_path / "rank3.onnx")
    for command in ("run", "verify"):
        code, _, err = cli(capsys, command, tmp_path / "rank3.onnx")
        lines = [ln for ln in err.splitlines() if ln and not ln.startswith("fusion: warning: ")]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("fusion: error: "), err


def test_timing_failures_are_one_line_warnings_and_the_cache_knows_the_plugin(
    capsys, tmp_path, monkeypatch, swish
):
    """At the default tactics a kernel that raises is timed out with a "fusion: warning:"
    line; the cached timing names the plugin's source, so another plugin is timed anew."""
    model, plugin = swish
    monkeypatch.setenv("FUSION_TACTICS", "fastest")
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["run", model, "--input", f"x={tmp_path / 'x.npy'}"]
    code, _, err = cli(capsys, *argv, "--plugin", plugin("raises"))
    assert code == 0 and "tactic kernel failed: a bug in the plugin" in err, err
    assert all(ln.startswith("fusion: warning: ") for ln in err.splitlines() if ln), err
    monkeypatch.setattr("fusion.registry.USER", fusion.Catalog())  # a second plugin's Swish
    cli(capsys, *argv, "--plugin", plugin("right"))
    entries = json.loads(next((tmp_path / "cache").glob("tactics-*.json")).read_text())["entries"]
    assert len({k for k in entries if k.startswith("fusion.Swish")}) == 2  # one per plugin


# ---- the kernel cache ------------------------------------------------------------------------
def test_kernels_run_where_neither_the_package_nor_home_can_hold_the_cache(tmp_path):
    """A wheel installed by root, run by a user with no writable home: Numba can write neither
    kernels/__pycache__ nor ~/.cache/numba. The cache moves to a private temp folder, with one
    warning. (The package is a copy whose __pycache__ is a file: no one, root included, can
    make that folder; .cache in HOME is a file too.)"""
    root = Path(__file__).resolve().parent.parent
    package = tmp_path / "site"
    for name in ("fusion", "kernels", "patterns"):
        shutil.copytree(root / name, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "kernels" / "__pycache__").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("")
    if os.geteuid() != 0:
        for folder in (package / "kernels", home):
            folder.chmod(0o555)
    g = GraphBuilder()
    y = g.node("Flatten", [g.node("GlobalAveragePool", ["x"])], axis=1)
    save_model(g.model({"x": [1, 4, 5, 5]}, [y]), tmp_path / "pool.onnx")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    (tmp_path / "tmp").mkdir()
    env.update(PYTHONPATH=str(package), HOME=str(home), TMPDIR=str(tmp_path / "tmp"))
    # onnxruntime's own line when it cannot keep its telemetry ID in HOME; its opt-out:
    env["ORT_DISABLE_TELEMETRY"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "fusion", "run", tmp_path / "pool.onnx"],
        env=env,
        cwd=tmp_path,  # -m puts the working directory first on the path
        capture_output=True,
        text=True,
    )
    cache = tmp_path / "tmp" / f"fusion-numba-cache-{os.getuid()}"
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"fusion: warning: neither {package}/kernels/__pycache__ nor {home}/.cache/numba is "
        f"writable: compiled kernels are cached in {cache}"
    ]
    assert "float32 [1, 4]" in proc.stdout and list(cache.rglob("*.nbi"))


# ---- models the catalog cannot fuse ----------------------------------------------------------
def typed_model(elem: int) -> onnx.ModelProto:
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    g = GraphBuilder()
    w = g.const((g.rng.standard_normal((4, 2, 3, 3)) * 0.3).astype(dtype))
    b = g.const(np.full(4, 0.1, dtype))
    y = g.node("Relu", [g.node("Conv", ["x", w, b], pads=[1, 1, 1, 1], name="/conv")])
    return g.model({"x": ["N", 2, 5, 5]}, [y], elem=elem)


def int8_qdq_model() -> onnx.ModelProto:
    """A quantized (QDQ) Conv + Relu as quantization tools write it: int8 in, int8 out."""
    g = GraphBuilder()
    scale, zero = g.const(np.float32(0.05)), g.const(np.int8(0))
    w = g.const(g.rng.integers(-50, 50, (4, 2, 3, 3)).astype(np.int8))
    x = g.node("DequantizeLinear", ["x", scale, zero])
    wf = g.node("DequantizeLinear", [w, scale, zero])
    y = g.node("Relu", [g.node("Conv", [x, wf], pads=[1, 1, 1, 1], name="/conv")])
    q = g.node("QuantizeLinear", [y, scale, zero])
    return g.model({"x": ["N", 2, 5, 5]}, [q], elem=TensorProto.INT8)


def unknown_rank_model() -> onnx.ModelProto:
    """Conv reads a Reshape to a shape fed at run time: its input's rank is unknown."""
    g = GraphBuilder()
    y = conv_block(g, g.node("Reshape", ["x", "shape"]), 2, 4)
    graph_inputs = {"x": ["N", 50], "shape": ["k"]}
    graph = helper.make_graph(
        g.nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, graph_inputs["x"])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N", "C", "H", "W"])],
        g.inits,
    )
    graph.input.append(helper.make_tensor_value_info("shape", TensorProto.INT64, ["k"]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


UNFUSABLE = {
    "float16": (lambda: typed_model(TensorProto.FLOAT16), "dtype float16, kernels are float32"),
    "float64": (lambda: typed_model(TensorProto.DOUBLE), "dtype float64, kernels are float32"),
    "int8 QDQ": (int8_qdq_model, "Conv /conv"),
    "unknown rank": (unknown_rank_model, "rank of /reshape1_out is unknown"),
}


@pytest.mark.parametrize("case", list(UNFUSABLE))
def test_unfusable_model_is_left_unchanged_with_a_reason(capsys, tmp_path, case):
    build, reason = UNFUSABLE[case]
    model = build()
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    save_model(model, src)
    code, out, _ = cli(capsys, "rewrite", src, "-o", dst, "--explain")
    assert code == 0 and "0 fusions" in out
    assert "ConvBiasRelu: 0 fused, 1 not fused" in out and reason in out, out
    assert dst.read_bytes() == src.read_bytes()
    if case == "float64":
        return  # onnxruntime has no float64 Conv on CPU: nothing to run
    feeds = random_feeds(model)
    if case == "int8 QDQ":
        feeds = {"x": np.random.default_rng(0).integers(-100, 100, (2, 2, 5, 5)).astype(np.int8)}
    if case == "unknown rank":
        x = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
        feeds = {"x": x, "shape": np.array([2, 2, 5, 5], np.int64)}
    want = run_ort(model, feeds)
    got = fusion.Session(str(dst), threads=1).run(None, feeds)
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


# ---- control flow ----------------------------------------------------------------------------
def test_patterns_in_subgraphs_are_left_alone_and_nothing_breaks(capsys, tmp_path):
    model = control_flow_model()
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    save_model(model, src)
    code, out, _ = cli(capsys, "rewrite", src, "-o", dst, "--explain")
    assert code == 0 and "2 fusions (" in out, out
    assert "is also used by If" in out  # the escape through the If branch was seen
    fused = onnx.load(str(dst))
    onnx.checker.check_model(fused, full_check=True)
    # the first block whole, the second's Conv alone (its output is read inside the If)
    assert [n.op_type for n in fused.graph.node].count("ConvBiasRelu") == 2
    for node in fused.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:  # bodies are untouched
                original = next(n for n in model.graph.node if n.op_type == node.op_type)
                assert attr.g == next(a.g for a in original.attribute if a.name == attr.name)
    for seed in range(2):
        feeds = random_feeds(model, batch=2, seed=seed)
        want = run_ort(model, feeds)
        for got in (run_ort(fused, feeds), fusion.Session(fused, threads=1).run(None, feeds)):
            for g, w in zip(got, want, strict=True):
                assert_close(g, w, rtol=1e-4, atol=1e-5)
