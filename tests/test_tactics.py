"""Tactic choice and its timing cache (fusion/runtime/tactics.py): the fastest of a kernel's
tactics and onnxruntime on the node's body is kept, the choice is cached on disk per CPU, and a
cache that is corrupt, from another CPU or written by two processes at once never gives a
wrong answer."""

from __future__ import annotations

import json
import multiprocessing
import re
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_close, fused_model, scaled_relu, scaled_relu_catalog, tensor
from onnx import helper, numpy_helper

import fusion.runtime.tactics as tactics_module
from fusion.catalog import Catalog, Rule, Tactic
from fusion.cli.main import main
from fusion.errors import FusionWarning
from fusion.models import conv_stack
from fusion.ort import DEFAULT
from fusion.pattern import Var, op
from fusion.runtime import Session
from fusion.runtime.tactics import ONNXRUNTIME, policy, preferred
from fusion.runtime.timing_cache import TimingCache, node_key


def _model():
    s = np.full((1, 3), 0.5, np.float32)
    return fused_model(
        [scaled_relu("x", "s", "y", "sr")],
        [tensor("x", (4, 3))],
        [tensor("y", (4, 3))],
        [numpy_helper.from_array(s, "s")],
    )


def _two_tactics(attrs, constants):
    """A kernel offering a slow tactic (sleeps) and a NumPy one: the slow one must never win."""

    def fast(x, s):
        return (np.maximum(x * s, 0).astype(np.float32),)

    def slow(x, s):
        time.sleep(0.005)
        return fast(x, s)

    def run(x, s):
        return slow(x, s)

    run.tactics = [Tactic("slow", slow), Tactic("numpy", fast)]
    return run


def _session(**kw):
    return Session(_model(), threads=1, catalog=scaled_relu_catalog(_two_tactics), **kw)


def test_fastest_never_keeps_a_slower_tactic_and_caches_the_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    session = _session(tactics="fastest")
    assert session.choices["ScaledRelu sr"] in ("numpy", ONNXRUNTIME)
    files = list(tmp_path.glob("tactics-*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["entries"]
    (times,) = [e["times"] for k, e in entries.items() if not k.startswith("plan:")]
    assert set(times) == {"slow", "numpy", ONNXRUNTIME}
    assert times["slow"] > max(times["numpy"], times[ONNXRUNTIME])

    # A later session reads the choice and times nothing.
    def no_timing(run):
        raise AssertionError("timed although the cache had the answer")

    monkeypatch.setattr(tactics_module, "time_call", no_timing)
    monkeypatch.setattr("fusion.runtime.session.time_call", no_timing, raising=False)
    again = _session(tactics="fastest")
    assert again.choices == session.choices
    assert again.race == session.race is not None  # the whole-plan race, also from the cache
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    (y,) = again.run(None, {"x": x})
    assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)


def test_the_whole_plan_races_onnxruntime_alone(monkeypatch, tmp_path):
    # A plan of kernels that are each faster than their bodies can still lose whole (layout
    # conversions, islands cut in two): then the model runs in onnxruntime at its defaults.
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    node_times = {"slow": 1.0, "numpy": 1e-6, ONNXRUNTIME: 1e-3}  # the kernel wins its node
    monkeypatch.setattr(Session, "_time", lambda self, *args: node_times)
    slower = {"per-node": 2e-3, ONNXRUNTIME: 1e-3}
    monkeypatch.setattr(Session, "_time_plan", lambda self, plan, values: slower[plan.race_name])
    monkeypatch.setattr(
        Session, "_plan", lambda self, c, _plan=Session._plan: _named(_plan(self, c), c)
    )
    session = _session(tactics="fastest")
    assert session.race["chosen"] == ONNXRUNTIME
    assert [s.kind for s in session.steps] == ["island"]
    assert session.steps[0].settings == DEFAULT


def _named(run_plan, choices):
    kernels = any(t is not None for t in choices.values())
    run_plan.race_name = "per-node" if kernels else ONNXRUNTIME
    return run_plan


def test_a_node_on_onnxruntime_merges_into_an_island(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    session = _session(tactics=ONNXRUNTIME)
    assert session.choices["ScaledRelu sr"] == ONNXRUNTIME
    assert [s.kind for s in session.steps] == ["island"]


def test_policy_and_preferred_tactic():
    assert policy("kernel") == "kernel"
    ts = [Tactic("blocked", None), Tactic("nchw-winograd", None)]
    assert preferred(ts, "nchw").name == "nchw-winograd"
    assert preferred(ts, "nothing-like-it").name == "blocked"
    with pytest.raises(ValueError):
        policy(3)


TIMES = {"times": {"a": 1.0, ONNXRUNTIME: 2.0}}  # a node's entry: onnxruntime is always timed


def test_corrupt_cache_is_ignored_with_a_warning_then_rewritten(tmp_path):
    cache = TimingCache("cpu-a", tmp_path)
    cache.path.write_text('{"format": 1, "entries": {"k": ')
    with pytest.warns(FusionWarning, match="corrupt"):
        cache.load()
    assert cache.get("k") is None
    cache.put({"k": TIMES})  # its merge meets the same corrupt file: warned about once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TimingCache("cpu-a", tmp_path).load().get("k")["times"] == TIMES["times"]


def test_cache_from_another_cpu_is_ignored_with_a_warning(tmp_path):
    TimingCache("cpu-a", tmp_path).put({"k": TIMES})
    other = TimingCache("cpu-b", tmp_path)
    # A cache copied from another machine under this CPU's file name.
    other.path.write_text(TimingCache("cpu-a", tmp_path).path.read_text())
    with pytest.warns(FusionWarning, match="another CPU"):
        other.load()
    assert other.get("k") is None


def _writer(folder: str, tag: str, n: int) -> None:
    cache = TimingCache("cpu-a", Path(folder))
    for k in range(n):
        cache.put({f"{tag}{k}": {"times": {"x": float(k), ONNXRUNTIME: 1.0}}})


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 40)) for tag in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = TimingCache("cpu-a", tmp_path).load().entries
    assert set(entries) == {f"{t}{k}" for t in "ab" for k in range(40)}
    assert not list(tmp_path.glob(".tactics-*"))  # no temporary file left behind


def test_node_key_names_what_a_timing_depends_on():
    node = helper.make_node("ConvBiasRelu", ["x"], ["y"], domain="fusion")
    node.overload = "abc"
    k1 = node_key(node, [(1, 8, 7, 7)], 2, "v1")
    assert k1 != node_key(node, [(2, 8, 7, 7)], 2, "v1")  # shape
    assert k1 != node_key(node, [(1, 8, 7, 7)], 1, "v1")  # threads
    assert k1 != node_key(node, [(1, 8, 7, 7)], 2, "v2")  # kernels' source
    node.overload = "abd"
    assert k1 != node_key(node, [(1, 8, 7, 7)], 2, "v1")  # the body


def test_fusion_tune_fills_the_cache_and_says_what_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.onnx"
    onnx.save(conv_stack(blocks=2, channels=8, size=10, batch="N"), path)
    assert main(["tune", str(path), "--batch", "1", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 1: " in out and "batch 2: " in out and out.count("tactics: ") == 2
    said = re.compile(
        r"batch \d: (runs .+ \(.*onnxruntime alone [\d.]+ ms\)|no race \(no fused .+\))$"
    )
    assert all(said.match(line) for line in out.splitlines() if line.startswith("batch ")), out
    entries = json.loads(next((tmp_path / "cache").glob("tactics-*.json")).read_text())["entries"]
    timed = {k.split("|")[1].split(";")[0] for k in entries if not k.startswith("plan:")}
    assert timed == {"1x8x10x10", "2x8x10x10"}  # each conv at both batch sizes
    assert main(["tune", str(path), "--batch", "0"]) == 2
    assert "argument --batch: must be at least 1" in capsys.readouterr().err


def test_a_node_with_integer_inputs_is_not_timed_on_random_floats(monkeypatch, tmp_path):
    # A fused node reading a shape (int64) of fixed size: random float "shapes" would make its
    # body fail in onnxruntime; such a node runs its kernel, and the whole plan is still raced.
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    rule = Rule(
        "ReshapeRelu",
        op.Relu(op.Reshape(Var("x", dtype="float32"), Var("shape"))),
        inputs=("x", "shape"),
        prepare=lambda attrs, consts: lambda x, s: (np.maximum(x.reshape(s), 0),),
    )
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Relu", ["r"], ["y"]),
        ],
        "g",
        [tensor("x", (2, 6)), tensor("shape", (2,), onnx.TensorProto.INT64)],
        [tensor("y", (3, 4))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = Session(model, threads=1, catalog=Catalog([rule]), tactics="fastest")
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    (y,) = session.run(None, {"x": x, "shape": np.array([3, 4], np.int64)})
    np.testing.assert_array_equal(y, np.maximum(x.reshape(3, 4), 0))
    assert session.race_for({"x": x, "shape": np.array([3, 4], np.int64)}) is not None
