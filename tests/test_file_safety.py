"""Nothing the tool writes destroys a file it reads, and what it writes is whole.

Where the output goes (refused outputs, symlinks, read-only folders, --in-place), external data
written beside the output, file identity between every file written and every file read, a crash
while replacing a model and its data, SIGTERM, file modes. The >2 GB case writes 4 GB and holds
~7 GB of memory: it runs only with FUSION_SLOW=1 (`FUSION_SLOW=1 python -m pytest
tests/test_file_safety.py -k 2gb`, about a minute).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_close,
    assert_refused,
    cli,
    data_names,
    random_feeds,
    run_ort,
    save_external,
    small_model,
    state,
)
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion.modelfile import all_tensors, save_model
from fusion.models import conv_stack
from fusion.numerics import compare_arrays

slow = pytest.mark.skipif(not os.environ.get("FUSION_SLOW"), reason="set FUSION_SLOW=1 to run")


def external_locations(model: onnx.ModelProto) -> set[str]:
    return {e.value for t in all_tensors(model) for e in t.external_data if e.key == "location"}


# ---- where the output goes -------------------------------------------------------------------
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
