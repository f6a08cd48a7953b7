"""Tactic choice and its timing cache (fusion/runtime/tactics.py): the fastest of a kernel's
tactics and onnxruntime on the node's body is kept, the choice is cached on disk per CPU, and a
cache that is corrupt, from another CPU or written by two processes at once never gives a
wrong answer."""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    FakeMachine,
    GraphBuilder,
    assert_close,
    conv_block,
    fused_model,
    run_ort,
    scaled_relu,
    scaled_relu_catalog,
    scripted_race,
    tensor,
)
from onnx import helper, numpy_helper

import fusion.runtime.choice as choice_module
import fusion.runtime.tactics as tactics_module
from fusion.catalog import Catalog, Rule, Tactic
from fusion.cli.main import main
from fusion.errors import FusionWarning
from fusion.models import conv_stack
from fusion.ort import DEFAULT
from fusion.pattern import Var, op
from fusion.runtime import Session, describe_race
from fusion.runtime.choice import (
    WATCH_RUNS,
    WATCH_SKIP,
    WATCH_SPAN,
    WATCH_WINDOWS,
    Chooser,
    Watch,
)
from fusion.runtime.tactics import ONNXRUNTIME, first_timed, policy, preferred
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
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.03})
    # onnxruntime's body is scripted at 1 ms (the slow tactic sleeps 5, NumPy's takes µs): the
    # two real ones take about as long, and a node left to onnxruntime would leave no kernel to
    # race, so the choice must not be left to timing luck
    real = choice_module.time_call
    monkeypatch.setattr(
        choice_module,
        "time_call",
        lambda run, *a, **k: real(run, *a, **k) if run.__defaults__ else 1e-3,
    )
    session = _session(tactics="fastest")
    assert session.choices["ScaledRelu sr"] == "numpy"
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
    monkeypatch.setattr("fusion.runtime.choice.time_call", no_timing)
    again = _session(tactics="fastest")
    assert again.choices == session.choices
    assert session.race is not None and not session.race["cached"]
    assert again.race == session.race | {"cached": True}  # the whole-plan race, from the cache
    assert len(raced) == 1
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    (y,) = again.run(None, {"x": x})
    assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)


def test_the_whole_plan_races_onnxruntime_alone(monkeypatch, tmp_path):
    # A plan of kernels that are each faster than their bodies can still lose whole (layout
    # conversions, islands cut in two): then the model runs in onnxruntime at its defaults.
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    node_times = {"slow": 1.0, "numpy": 1e-6, ONNXRUNTIME: 1e-3}  # the kernel wins its node
    monkeypatch.setattr(Chooser, "time_tactics", lambda self, *args: node_times)
    scripted_race(monkeypatch, {"per-node": 0.02, "nchw": 0.02, ONNXRUNTIME: 0.01})
    session = _session(tactics="fastest")
    assert session.race["chosen"] == ONNXRUNTIME
    assert [s.kind for s in session.steps] == ["island"]
    assert session.steps[0].settings == DEFAULT


def test_the_whole_plan_races_each_node_s_fastest_kernel(monkeypatch, tmp_path):
    """A node whose kernel loses to its body alone (by the timing of one node, which cannot see
    the conversions and islands around it) is left to onnxruntime per node; the plan of every
    node on its fastest kernel tactic races too, and is kept when it wins whole."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    node_times = {"slow": 1.0, "numpy": 2e-3, ONNXRUNTIME: 1e-3}  # the body wins its node
    monkeypatch.setattr(Chooser, "time_tactics", lambda self, *args: node_times)
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.02, "kernels": 0.01})
    session = _session(tactics="fastest")
    assert raced == [[ONNXRUNTIME, "kernels"]]  # per-node is onnxruntime's plan: raced once
    assert session.race["chosen"] == "kernels" and session.choices["ScaledRelu sr"] == "numpy"
    assert "each node's fastest kernel 10 ms" in describe_race(session.race)
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)


def test_kernels_keeps_each_node_s_fastest_kernel_tactic_unraced(monkeypatch, tmp_path):
    """tactics="kernels": the node's tactics timed (onnxruntime too, for the cache), its fastest
    kernel tactic kept although the body is faster, and no whole-plan race."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    node_times = {"slow": 1.0, "numpy": 2e-3, ONNXRUNTIME: 1e-3}  # the body wins its node
    monkeypatch.setattr(Chooser, "time_tactics", lambda self, *args: node_times)
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.02, "kernels": 0.01})
    session = _session(tactics="kernels")
    assert session.choices["ScaledRelu sr"] == "numpy" and session.race is None
    assert raced == []
    assert [s.kind for s in session.steps] == ["kernel"]
    with pytest.raises(ValueError, match="untimed"):
        session.with_tactics("kernels")
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)


def test_a_node_s_candidates_are_timed_in_rounds_each_at_its_least_disturbed(monkeypatch, tmp_path):
    """A moment of load on one candidate's first turn does not decide the node: the candidates
    are timed in turn, three times over, each kept at its best round (a scripted clock: "slow"
    is disturbed once and is otherwise the fastest)."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    turns = []

    def scripted(run, *args, **kwargs):
        name = run.__defaults__[0].name if run.__defaults__ else ONNXRUNTIME
        turns.append(name)
        if name == "slow":
            return 5e-3 if turns.count("slow") == 1 else 1e-4
        return 2e-3 if name == "numpy" else 3e-3

    monkeypatch.setattr(choice_module, "time_call", scripted)
    session = _session(tactics="kernels")
    assert session.choices["ScaledRelu sr"] == "slow"
    assert turns == ["slow", "numpy", ONNXRUNTIME, "numpy", ONNXRUNTIME, "slow",
                     ONNXRUNTIME, "slow", "numpy"]  # fmt: skip


# ---- the race as a judge: provisional under load, watched when cached ----------------------------
NODE_WINS = {"slow": 1.0, "numpy": 1e-6, ONNXRUNTIME: 1e-3}  # the kernel wins its node: a race


def _plan_entries(folder) -> dict:
    (path,) = folder.glob("tactics-*.json")
    entries = json.loads(path.read_text())["entries"]
    return {k: e for k, e in entries.items() if k.startswith("plan:")}


@pytest.fixture
def judged(monkeypatch, tmp_path):
    """Node timings that make the kernel win, a fresh cache, and a fresh process's memory of
    which provisional verdicts it raced again."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(Chooser, "time_tactics", lambda self, *args: NODE_WINS)
    monkeypatch.setattr("fusion.runtime.choice.RERACED", set())
    return tmp_path


def test_a_race_under_load_is_provisional_and_raced_again_once_quiet(monkeypatch, judged):
    times = {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.03}
    raced = scripted_race(monkeypatch, times, load=1.0)  # another process on a core
    first = _session(tactics="fastest")
    assert first.race["busy"] and first.race["chosen"] == "per-node"
    assert [e["busy"] for e in _plan_entries(judged).values()] == [True]
    assert "raced under load: provisional" in describe_race(first.race)
    _session(tactics="fastest")  # provisional: raced again (still under load) ...
    _session(tactics="fastest")  # ... but once per process
    assert len(raced) == 2
    monkeypatch.setattr("fusion.runtime.choice.RERACED", set())  # a later process, quiet
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.01, "nchw": 0.04, "per-node": 0.03})
    quiet = _session(tactics="fastest")
    assert (quiet.race["chosen"], quiet.race["busy"], len(raced)) == (ONNXRUNTIME, False, 1)
    assert _session(tactics="fastest").race == quiet.race | {"cached": True}
    assert len(raced) == 1  # a quiet verdict is kept
    assert [e["busy"] for e in _plan_entries(judged).values()] == [False]


def test_a_fresh_race_under_load_is_raced_again_in_its_process_once_runs_are_quiet(
    monkeypatch, judged
):
    """A race under load chose onnxruntime alone (the load slowed the kernels' plan more);
    the same session's runs then find the machine quiet, so within WATCH_SKIP + WATCH_RUNS
    runs it races again, uses the quiet verdict and caches it; a second quiet window races
    nothing more. Under load all along, nothing is raced again."""
    scripted_race(monkeypatch, {ONNXRUNTIME: 0.02, "nchw": 0.04, "per-node": 0.03}, load=1.0)
    session = _session(tactics="fastest")
    assert session.race["busy"] and session.race["chosen"] == ONNXRUNTIME
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.01})
    x = np.ones((4, 3), np.float32)
    for _ in range(2 * (WATCH_SKIP + WATCH_RUNS)):
        (y,) = session.run(None, {"x": x})
        assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)
    assert len(raced) == 1
    assert (session.race["chosen"], session.race["busy"]) == ("per-node", False)
    (entry,) = _plan_entries(judged).values()
    assert (entry["chosen"], entry["busy"]) == ("per-node", False)
    monkeypatch.setattr("fusion.runtime.choice.RERACED", set())  # another process, loaded
    scripted_race(monkeypatch, {ONNXRUNTIME: 0.02, "nchw": 0.04, "per-node": 0.03}, load=1.0)
    (path,) = judged.glob("tactics-*.json")
    path.unlink()  # a fresh cache: the race runs under load again
    loaded = _session(tactics="fastest")
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.01},
                          load=1.0)  # fmt: skip
    for _ in range(2 * (WATCH_SKIP + WATCH_RUNS)):
        loaded.run(None, {"x": x})
    assert not raced and loaded.race["chosen"] == ONNXRUNTIME


def test_a_cached_verdict_its_runs_disagree_with_is_raced_again(monkeypatch, judged):
    """A race that recorded 5 s for the plan it chose (its machine was loaded, and nothing
    showed it): the runs of a later session take far less, so within WATCH_SKIP + WATCH_RUNS
    runs the plan is raced again, and the new verdict is used and cached."""
    scripted_race(monkeypatch, {ONNXRUNTIME: 15.0, "nchw": 9.0, "per-node": 5.0})
    assert _session(tactics="fastest").race["chosen"] == "per-node"
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.01, "nchw": 0.04, "per-node": 0.03})
    later = _session(tactics="fastest")
    assert later.race["cached"] and later.race["chosen"] == "per-node" and not raced
    x = np.ones((4, 3), np.float32)
    for _ in range(WATCH_SKIP + WATCH_RUNS):
        (y,) = later.run(None, {"x": x})
        assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)
    assert len(raced) == 1 and later.race["chosen"] == ONNXRUNTIME and not later.race["cached"]
    (entry,) = _plan_entries(judged).values()
    assert entry["chosen"] == ONNXRUNTIME
    later.run(None, {"x": x})
    assert len(raced) == 1  # the new verdict is not watched: it was just measured


def test_a_watch_judges_over_a_window_whose_load_can_be_read(monkeypatch):
    """/proc/stat counts CPU time in 10 ms ticks: a watch keeps watching past WATCH_RUNS runs
    until its window spans WATCH_SPAN, then judges them all."""

    class Clocked(FakeMachine):
        now = 0.0

        def elapsed(self):
            return Clocked.now

    monkeypatch.setattr("fusion.runtime.choice.Machine", lambda: Clocked(0.0))
    watch = Watch({}, 1.0, 0.05)
    for _ in range(WATCH_SKIP + 3 * WATCH_RUNS):
        assert watch.seen(1.0) is None and watch.open
    Clocked.now = WATCH_SPAN
    assert watch.seen(2.0) is True and not watch.open  # the median of 3 WATCH_RUNS + 1 runs
    assert len(watch.times) == 3 * WATCH_RUNS + 1


def test_a_watch_that_runs_under_load_or_in_threads_at_once_judges_nothing(monkeypatch, judged):
    """The same wrong cached verdict as above, watched while other processes load the machine,
    or by runs that overlap in two threads: the watch cannot tell, so nothing is raced again."""
    scripted_race(monkeypatch, {ONNXRUNTIME: 15.0, "nchw": 9.0, "per-node": 5.0})
    _session(tactics="fastest")
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.01, "nchw": 0.04, "per-node": 0.03},
                          load=1.0)  # fmt: skip
    loaded = _session(tactics="fastest")
    x = np.ones((4, 3), np.float32)
    for _ in range(WATCH_SKIP + WATCH_WINDOWS * WATCH_RUNS + 2):
        loaded.run(None, {"x": x})
    assert not raced and loaded.race["chosen"] == "per-node"
    assert not loaded._plans.default.watch.open  # WATCH_WINDOWS windows dropped: it stopped
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.01, "nchw": 0.04, "per-node": 0.03})
    threaded = _session(tactics="fastest")
    inside, chooser = threading.Barrier(2), threaded._plans.chooser
    real_run = chooser.run

    def both_at_once(*args, **kw):  # each run starts with one in the other thread
        inside.wait(timeout=10)
        return real_run(*args, **kw)

    monkeypatch.setattr(chooser, "run", both_at_once)
    runs = (WATCH_SKIP + WATCH_RUNS) // 2
    threads = [threading.Thread(target=lambda: [threaded.run(None, {"x": x})
                                                for _ in range(runs)])
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    watched = threaded._plans.default.watch
    assert watched.open and watched.windows == 1 and not watched.overlapped  # the next window
    assert not raced and threaded.race["chosen"] == "per-node"


def test_an_entry_from_before_judged_races_is_raced_again(monkeypatch, judged):
    scripted_race(monkeypatch, {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.03})
    _session(tactics="fastest")
    (path,) = judged.glob("tactics-*.json")
    data = json.loads(path.read_text())
    for key, entry in data["entries"].items():
        if key.startswith("plan:"):
            data["entries"][key] = {"plans": entry["plans"]}  # what older versions wrote
    path.write_text(json.dumps(data))
    monkeypatch.setattr("fusion.runtime.choice.RERACED", set())
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.01, "nchw": 0.04, "per-node": 0.03})
    assert _session(tactics="fastest").race["chosen"] == ONNXRUNTIME and len(raced) == 1


def test_tune_force_races_again_and_show_says_when_and_under_what_load(capsys, monkeypatch, judged):
    monkeypatch.setattr("fusion.registry.USER", scaled_relu_catalog(_two_tactics))
    path = judged / "m.onnx"
    onnx.save(_model(), path)
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.03},
                          load=0.6)  # fmt: skip
    assert main(["tune", str(path), "--threads", "1"]) == 0
    assert main(["tune", str(path), "--threads", "1", "--force"]) == 0
    assert len(raced) == 2
    capsys.readouterr()
    assert main(["tune", str(path), "--show"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"inputs 4x3, threads 1, raced \d{4}-\d\d-\d\d \d\d:\d\d UTC:", out[0])
    assert out[1].startswith("  runs each node's fastest, the fastest (onnxruntime alone 50 ms")
    assert "other processes used 0.60 cores; raced under load: provisional" in out[1]
    assert main(["tune", str(path), "--show", "--threads", "2"]) == 0  # raced with 1 thread
    assert capsys.readouterr().out.startswith("no cached whole-plan verdict for ")
    assert main(["tune", "--show"]) == 0
    assert re.match(r"model [0-9a-f]{16}, inputs 4x3", capsys.readouterr().out)
    for argv, message in ((["tune"], "tune needs a MODEL"), (["tune", "--show", "--force"],
                                                             "--show times nothing")):  # fmt: skip
        assert main(argv) == 2 and message in capsys.readouterr().err


def _with_fallback(first_fails: bool, calls: list):
    """A kernel whose first tactic works (or raises) and whose second is its fallback."""

    def make(attrs, constants):
        def relu(x, s):
            return (np.maximum(x * s, 0).astype(np.float32),)

        def first(x, s):
            calls.append("first")
            if first_fails:
                raise ValueError("declined")
            return relu(x, s)

        def spare(x, s):
            calls.append("spare")
            return relu(x, s)

        first.tactics = [Tactic("first", first), Tactic("spare", spare, fallback=True)]
        return first

    return make


def _node_times(folder) -> dict:
    (path,) = folder.glob("tactics-*.json")
    entries = json.loads(path.read_text())["entries"]
    (times,) = [e["times"] for k, e in entries.items() if not k.startswith("plan:")]
    return times


def test_a_fallback_is_timed_only_where_every_other_tactic_failed(monkeypatch, tmp_path):
    """A fallback tactic is not called, timed or cached while another tactic of its kernel
    works; where every other one fails, it is timed and chosen."""
    calls = []
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "works"))
    catalog = scaled_relu_catalog(_with_fallback(False, calls))
    session = Session(_model(), threads=1, catalog=catalog, tactics="kernels")
    assert session.choices["ScaledRelu sr"] == "first"
    assert "first" in calls and "spare" not in calls
    assert set(_node_times(tmp_path / "works")) == {"first", ONNXRUNTIME}

    calls.clear()
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "fails"))
    catalog = scaled_relu_catalog(_with_fallback(True, calls))
    with pytest.warns(FusionWarning, match="tactic first failed: declined"):
        session = Session(_model(), threads=1, catalog=catalog, tactics="kernels")
    assert session.choices["ScaledRelu sr"] == "spare"
    times = _node_times(tmp_path / "fails")
    assert times["first"] == float("inf") and 0 < times["spare"] < float("inf")
    x = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    assert_close(y, np.maximum(x * 0.5, 0), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("fallbacks_timed", [False, True])
def test_no_nchw_plan_is_raced_where_a_fallback_went_untimed(monkeypatch, tmp_path,
                                                              fallbacks_timed):  # fmt: skip
    """A conv's NCHW tactic is its blocked tactics' fallback: untimed, the whole-plan race has
    no NCHW-only candidate (it would be onnxruntime's convs), and with it timed (first_timed
    made to keep every tactic) it has one. Every kernel tactic takes 1 ms on a scripted clock,
    onnxruntime's body and a conversion 2 ms."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_module, "time_call",
                        lambda run, *a, **k: 1e-3 if run.__defaults__ else 2e-3)  # fmt: skip
    if fallbacks_timed:
        monkeypatch.setattr(choice_module, "first_timed", list)
    raced = scripted_race(monkeypatch, {ONNXRUNTIME: 0.03, "nchw": 0.02, "per-node": 0.01})
    model = conv_stack(blocks=2, channels=16, size=8, batch=1)
    session = Session(model, threads=1, tactics="fastest")
    assert all(c.startswith("blocked") for c in session.choices.values()), session.choices
    assert raced == [[ONNXRUNTIME, "nchw", "per-node"] if fallbacks_timed
                     else [ONNXRUNTIME, "per-node"]]  # fmt: skip


def _reshaped_conv():
    """x [2, 8, 36, 1] reshaped by the target fed as t, then a conv: shape inference cannot
    know the conv's input shape (as with the branches after ShuffleNet's fused channel split,
    whose function it does not see through)."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array((rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "t"], ["r"]),
         helper.make_node("Conv", ["r", "w", "b"], ["c"], pads=[1] * 4),
         helper.make_node("Relu", ["c"], ["y"])],
        "reshaped_conv",
        [tensor("x", (2, 8, 36, 1)),
         helper.make_tensor_value_info("t", onnx.TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [w, b],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("run_fails", [False, True])
def test_a_node_whose_input_shape_inference_misses_is_timed_on_a_run_s_shapes(
    monkeypatch, tmp_path, run_fails
):
    """The shapes of a fused node's inputs that inference cannot give come from one run of the
    model in onnxruntime, and the node is timed on them; if that run fails, the node runs its
    first tactic untimed, as before."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    if run_fails:  # the run for shapes fails (best effort: no shapes), a node's timing does not
        monkeypatch.setattr(choice_module, "shapes_from_a_run", lambda *a, **k: {})
    model = _reshaped_conv()
    session = Session(model, threads=1, tactics="kernels")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8, 36, 1)).astype(np.float32),
             "t": np.array([2, 8, 6, 6], np.int64)}  # fmt: skip
    got = session.run(None, feeds)[0]
    files = list(tmp_path.glob("tactics-*.json"))  # none when nothing was timed
    entries = json.loads(files[0].read_text())["entries"] if files else {}
    timed = [k.split("|")[1] for k in entries if k.startswith("fusion.ConvBiasRelu")]
    assert timed == ([] if run_fails else ["2x8x6x6;c8x8x3x3;c8"])
    want = run_ort(model, feeds)[0]
    assert_close(got, want, 1e-4, 1e-4 * float(np.abs(want).max()))


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
    # the weights' shapes: one body, one input shape, 8 or 16 output channels
    node.input.extend(["w"])
    w8, w16 = np.zeros((8, 8, 1, 1), np.float32), np.zeros((16, 8, 1, 1), np.float32)
    k8 = node_key(node, [(1, 8, 7, 7), None], 2, "v1", [None, w8])
    assert k8 != node_key(node, [(1, 8, 7, 7), None], 2, "v1", [None, w16])
    assert k8 == node_key(node, [(1, 8, 7, 7), None], 2, "v1", [None, w8 + 1])  # not values
    assert k8.split("|")[1] == "1x8x7x7;c8x8x1x1"


def test_convs_of_one_input_and_two_widths_are_timed_apart(monkeypatch, tmp_path):
    # Two 1x1 convs read x with the same attributes (one fused body) and write 8 and 24
    # channels: each node's timings are its own, of its own tactics, not the first one's.
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    g = GraphBuilder(seed=3)
    a = conv_block(g, "x", 8, 8, k=1)
    b = conv_block(g, "x", 8, 24, k=1)
    session = Session(g.model({"x": (1, 8, 6, 6)}, [a, b]), threads=1, tactics="kernels")
    fused = [n for n in session.model.graph.node if n.domain == "fusion"]
    assert len(fused) == 2 and fused[0].overload == fused[1].overload  # one body: the collision
    entries = json.loads(next(tmp_path.glob("tactics-*.json")).read_text())["entries"]
    nodes = {k: e["times"] for k, e in entries.items() if k.startswith("fusion.")}
    assert sorted(k.split("|")[1] for k in nodes) == ["1x8x6x6;c24x8x1x1;c24",
                                                      "1x8x6x6;c8x8x1x1;c8"]  # fmt: skip
    offered = {tuple(sorted(t.name for t in first_timed(ts)))  # (the NCHW fallback untimed)
               for ts in session._built.tactics.values()}  # fmt: skip
    assert {tuple(sorted(set(t) - {ONNXRUNTIME})) for t in nodes.values()} == offered
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 6, 6)).astype(np.float32)}
    want = run_ort(g.model({"x": (1, 8, 6, 6)}, [a, b]), feeds)
    for got, ref in zip(session.run(None, feeds), want, strict=True):
        assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_fusion_tune_fills_the_cache_and_says_what_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.onnx"
    onnx.save(conv_stack(blocks=2, channels=8, size=10, batch="N"), path)
    assert main(["tune", str(path), "--batch", "1", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 1: " in out and "batch 2: " in out and out.count("tactics: ") == 2
    said = re.compile(
        r"batch \d+: (runs .+, the (fastest|simplest within the \d+% noise of the fastest) "
        r"\(.*onnxruntime alone [\d.]+ ms.*\)|no race \(no fused .+\))$"
    )
    assert all(said.match(line) for line in out.splitlines() if line.startswith("batch ")), out
    entries = json.loads(next((tmp_path / "cache").glob("tactics-*.json")).read_text())["entries"]
    nodes = [k for k in entries if not k.startswith(("plan:", "convert:"))]
    timed = {k.split("|")[1].split(";")[0] for k in nodes}
    assert timed == {"1x8x10x10", "2x8x10x10"}  # each conv at both batch sizes
    converts = {k.split("|")[0] for k in entries if k.startswith("convert:")}
    assert converts >= {"convert:1x8x10x10", "convert:2x8x10x10"}  # the input's, both batches
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


def test_a_conv_reading_nhwc_keeps_its_nchw_tactic_a_fallback():
    """A conv that reads an NHWC input (the Transpose before it joined the node: a Keras
    export's stem) wraps each tactic to transpose first: the NCHW one stays the fallback."""
    g = GraphBuilder(seed=2)
    x = g.node("Transpose", ["x"], perm=[0, 3, 1, 2])
    y = g.node("Relu", [g.node("Conv", [x, g.weight(16, 3, 3, 3), g.weight(16)], pads=[1] * 4)])
    session = Session(g.model({"x": (1, 12, 12, 3)}, [y]), threads=1, tactics="kernel")
    ((i, tactics),) = session._built.tactics.items()
    assert session.view.nodes[i].op_type == "ConvBiasRelu", session.view.nodes[i].op_type
    flags = {t.name: t.fallback for t in tactics}
    assert any(n.startswith("blocked") for n in flags), flags
    assert {n: f for n, f in flags.items() if f} == {n: True for n in flags if n.startswith("nchw")}
    assert [t.name for t in first_timed(tactics)] == [n for n in flags if not flags[n]]
