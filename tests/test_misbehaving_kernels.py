"""Fused nodes a kernel must not run (a body not as the rule wrote it), kernels that misbehave
(raise, return wrong sizes or dtypes), rollback by rewrite --verify, timing failures, and the
kernel cache where nothing is writable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
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
    fused_ops,
    random_feeds,
    run_ort,
    small_model,
    state,
)
from onnx import TensorProto, helper

import fusion
from fusion import FusionWarning
from fusion.modelfile import save_model
from fusion.models import conv_stack


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
    from fusion_patterns import conv

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
    for folder, name in (
        ("fusion", "fusion"),
        ("kernels", "fusion_kernels"),
        ("patterns", "fusion_patterns"),
    ):  # as installed (pyproject.toml)
        shutil.copytree(root / folder, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "fusion_kernels" / "__pycache__").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("")
    if os.geteuid() != 0:
        for folder in (package / "fusion_kernels", home):
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
        f"fusion: warning: neither {package}/fusion_kernels/__pycache__ nor {home}/.cache/numba is "
        f"writable: compiled kernels are cached in {cache}"
    ]
    assert "float32 [1, 4]" in proc.stdout and list(cache.rglob("*.nbi"))
