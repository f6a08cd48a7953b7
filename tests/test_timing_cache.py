"""The timing cache on disk (fusion/runtime/timing_cache.py): whatever is wrong with its file (not
UTF-8, damaged entries, a FIFO or a symbolic link in its place, a write that fails) costs a
warning, once per problem per process, and never a failed or hung command or a temporary file
left behind; every write bounds it."""

from __future__ import annotations

import errno
import importlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import fused_model, scaled_relu, scaled_relu_catalog, scripted_race, tensor
from onnx import helper, numpy_helper

import fusion
import fusion.runtime.timing_cache as timing_cache
from fusion.errors import FusionWarning
from fusion.models import conv_stack
from fusion.runtime import Session
from fusion.runtime.tactics import ONNXRUNTIME
from fusion.runtime.timing_cache import TimingCache, node_key, plan_key
from fusion_kernels.machine import cpu_key

NODE = {"times": {"nchw": 1e-3, "onnxruntime": 2e-3}}
PLAN = {"plans": {"per-node": 1e-3, "onnxruntime": 2e-3}}
VERDICT = {**PLAN, "chosen": "per-node", "noise": 0.03, "decided": True, "busy": False,
           "load": 0.01, "rounds": 6}  # fmt: skip


def _node(batch: int, version: str = "v1") -> str:
    node = helper.make_node("ScaledRelu", ["x", "s"], ["y"], domain="fusion")
    node.overload = "body"
    return node_key(node, [(batch, 3), (1, 3)], 1, version)


def _plan(batch: int, version: str = "v1") -> str:
    return plan_key("digest", [(batch, 3)], 1, version)


def _cache(folder: Path) -> TimingCache:
    return TimingCache("cpu-a", folder, version="v1")


def _write(cache: TimingCache, entries: dict) -> None:
    cache.path.write_text(json.dumps({"format": 1, "cpu": cache.cpu, "entries": entries}))


def _on_disk(cache: TimingCache) -> dict:
    return json.loads(cache.path.read_text())["entries"]


def _model() -> onnx.ModelProto:
    s = numpy_helper.from_array(np.full((1, 3), 0.5, np.float32), "s")
    return fused_model([scaled_relu("x", "s", "y", "sr")], [tensor("x", (4, 3))],
                       [tensor("y", (4, 3))], [s])  # fmt: skip


def _session(monkeypatch) -> Session:
    """A timed session whose timings do not depend on this machine: each node timing comes out
    slower than the one before, so the first candidate (the kernel) wins its node, which makes
    the whole plan race, on a scripted clock that the plan of per-node choices wins; both are
    cached."""
    calls = []

    def time_call(run, *args, **kwargs):
        calls.append(run)
        return 1e-6 * len(calls)

    monkeypatch.setattr("fusion.runtime.choice.time_call", time_call)
    scripted_race(monkeypatch, {ONNXRUNTIME: 0.05, "nchw": 0.04, "per-node": 0.03})
    return Session(_model(), threads=1, catalog=scaled_relu_catalog(), tactics="fastest")


def _finishes(call) -> None:
    """call() in a thread must return rather than wait on a FIFO forever (the guard is long:
    it only turns a hang into a failure, it times nothing)."""
    done, raised = threading.Event(), []

    def target():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 (re-raised below, in the test's thread)
            raised.append(exc)
        finally:
            done.set()

    threading.Thread(target=target, daemon=True).start()
    assert done.wait(60), "blocked"
    if raised:
        raise raised[0]


# ---- files that are not JSON ----------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe{\x00", '{"format": 1, "entries": {"é": 1}}'.encode("latin-1"), b"[" * 100_000],
    ids=["utf-16", "latin-1", "nested-too-deep"],
)
def test_a_file_that_is_not_utf8_json_is_ignored_with_one_warning_then_rewritten(tmp_path, raw):
    cache = _cache(tmp_path)
    cache.path.write_bytes(raw)
    with pytest.warns(FusionWarning, match="is corrupt .*; ignored") as seen:
        assert cache.load().entries == {}
        cache.put({_node(1): NODE})  # its merge reads the file again: no second warning
    assert len(seen) == 1
    assert _cache(tmp_path).load().get(_node(1))["times"] == NODE["times"]


# ---- damaged entries -------------------------------------------------------------------------
DAMAGED = [  # (key maker, entry, the reason the warning gives)
    (_node, "fast", "an entry is not an object"),
    (_node, {}, "'times' is missing"),
    (_node, {"times": None}, "'times' is not an object"),
    (_node, {"times": [1e-3]}, "'times' is not an object"),
    (_node, {"times": {}}, "'times' is empty"),
    (_node, {"times": {"nchw": "fast", "onnxruntime": 1e-3}}, "'times' holds a value"),
    (_node, {"times": {"nchw": True, "onnxruntime": 1e-3}}, "'times' holds a value"),
    (_node, {"times": {"nchw": -1.0, "onnxruntime": 1e-3}}, "'times' holds a value"),
    (_node, {"times": {"nchw": float("nan"), "onnxruntime": 1e-3}}, "'times' holds a value"),
    (_node, {"times": {"blocked": 1e-3}}, "'times' lacks 'onnxruntime'"),
    (_node, {**NODE, "written": "today"}, "'written' is not a time"),
    (_plan, None, "an entry is not an object"),
    (_plan, NODE, "'plans' is missing"),
    (_plan, {"plans": None}, "'plans' is not an object"),
    (_plan, {"plans": {}}, "'plans' is empty"),
    (_plan, {"plans": {"per-node": None}}, "'plans' holds a value"),
    (_plan, {"plans": {"per-node": float("inf")}}, "'plans' has no plan that ran"),
    (_plan, {**VERDICT, "chosen": 3}, "'chosen' is not a plan's name"),
    (_plan, {**VERDICT, "busy": "no"}, "'busy' is not true or false"),
    (_plan, {**VERDICT, "load": True}, "'load' is not a number of cores"),
    (_plan, {k: v for k, v in VERDICT.items() if k != "noise"}, "a verdict without 'noise'"),
    (_plan, {**VERDICT, "chosen": "nchw"}, "'chosen' names no plan it timed"),
]


@pytest.mark.parametrize("key, entry, reason", DAMAGED)
def test_a_damaged_entry_is_dropped_and_the_others_kept(tmp_path, key, entry, reason):
    cache = _cache(tmp_path)
    _write(cache, {_node(1): NODE, _plan(1): PLAN, key(2): entry, key(3): entry})
    with pytest.warns(FusionWarning, match=rf"2 damaged entries dropped \({reason}") as seen:
        cache.load()
    assert len(seen) == 1
    assert cache.entries == {_node(1): NODE, _plan(1): PLAN}


def test_each_kind_of_damage_is_one_warning_with_its_count(tmp_path):
    cache = _cache(tmp_path)
    entries = {key(10 + k): entry for k, (key, entry, _) in enumerate(DAMAGED)}
    _write(cache, entries | {_node(1): NODE})
    with pytest.warns(FusionWarning, match="damaged") as seen:
        cache.load()
    reasons = {reason for _, _, reason in DAMAGED}
    assert len(seen) == len(reasons)
    assert cache.entries == {_node(1): NODE}


@pytest.mark.parametrize(
    "node_entry, plan_entry",
    [("fast", None), ({}, {}), ({"times": None}, {"plans": None}), ({"times": {}}, {"plans": {}}),
     ({"times": {"kernel": "fast", "onnxruntime": 1.0}}, {"plans": {"per-node": [1]}})],
    ids=["not-objects", "missing", "null", "empty", "wrong-types"],
)  # fmt: skip
def test_a_session_on_a_damaged_cache_times_anew_and_repairs_it(
    monkeypatch, tmp_path, node_entry, plan_entry
):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    first = _session(monkeypatch)
    (path,) = tmp_path.glob("tactics-*.json")
    data = json.loads(path.read_text())
    sound = data["entries"]
    assert len(sound) == 2  # the node's tactic timings and the plan's race
    data["entries"] = {k: plan_entry if k.startswith("plan:") else node_entry for k in sound}
    path.write_text(json.dumps(data))
    with pytest.warns(FusionWarning, match="damaged entr"):
        again = _session(monkeypatch)
    assert again.choices == first.choices and again.race == first.race
    repaired = json.loads(path.read_text())["entries"]
    assert set(repaired) == set(sound) and all(timing_cache.damage(k, e) is None
                                               for k, e in repaired.items())  # fmt: skip


# ---- FIFOs, symbolic links -------------------------------------------------------------------
def test_a_cache_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    cache = _cache(tmp_path)
    os.mkfifo(cache.path)
    with pytest.warns(FusionWarning, match=r"is not a regular file \(a FIFO\); ignored") as seen:
        _finishes(cache.load)
        _finishes(lambda: cache.put({_node(1): NODE}))
    assert len(seen) == 1
    assert stat.S_ISFIFO(os.lstat(cache.path).st_mode)  # left as it is
    assert not list(tmp_path.glob(".tactics-*"))


def test_a_lock_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    cache = _cache(tmp_path)
    os.mkfifo(tmp_path / ".tactics.lock")
    with pytest.warns(FusionWarning, match=r"lock .* is not a regular file \(a FIFO\)") as seen:
        _finishes(lambda: cache.put({_node(1): NODE}))
        _finishes(lambda: cache.put({_node(2): NODE}))
    assert len(seen) == 1 and not cache.path.exists()


def test_a_planted_lock_link_creates_nothing_where_it_points(tmp_path):
    folder, target = tmp_path / "cache", tmp_path / "elsewhere" / "planted"
    folder.mkdir()
    target.parent.mkdir()
    (folder / ".tactics.lock").symlink_to(target)
    with pytest.warns(FusionWarning, match=r"is not a regular file \(a symbolic link\)"):
        _cache(folder).put({_node(1): NODE})
    assert not target.exists()


def test_a_cache_file_that_is_a_link_is_not_followed(tmp_path):
    cache, other = _cache(tmp_path / "cache"), _cache(tmp_path / "other")
    other.folder.mkdir()
    _write(other, {_node(1): NODE})
    before = other.path.read_bytes()
    cache.folder.mkdir()
    cache.path.symlink_to(other.path)
    with pytest.warns(FusionWarning, match=r"is not a regular file \(a symbolic link\)"):
        assert cache.load().entries == {}
    cache.put({_node(2): NODE})  # replaces the link itself, not what it points to
    assert not cache.path.is_symlink() and set(_on_disk(cache)) == {_node(2)}
    assert other.path.read_bytes() == before


# ---- temporary files -------------------------------------------------------------------------
def test_a_cache_whose_name_is_a_folder_leaves_no_temporary_file(tmp_path):
    cache = _cache(tmp_path)
    cache.path.mkdir()
    with pytest.warns(FusionWarning, match=r"a directory"):
        cache.load()
        for batch in range(3):
            cache.put({_node(batch): NODE})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tactics.lock", cache.path.name]


@pytest.mark.parametrize("failure", [OSError(errno.EIO, "I/O error"), KeyboardInterrupt()])
def test_a_write_stopped_after_its_temporary_file_is_made_removes_it(monkeypatch, tmp_path,
                                                                      failure):  # fmt: skip
    def rename(*args):
        raise failure

    cache = _cache(tmp_path)
    monkeypatch.setattr(os, "replace", rename)
    if isinstance(failure, OSError):
        cache.put({_node(1): NODE})  # skipped silently: the cache only saves time
    else:
        with pytest.raises(KeyboardInterrupt):
            cache.put({_node(1): NODE})
    assert [p.name for p in tmp_path.iterdir()] == [".tactics.lock"]


# ---- one warning per problem -----------------------------------------------------------------
def test_a_problem_is_warned_about_once_per_process(tmp_path):
    _cache(tmp_path).path.write_text('{"format": 1, "entries": {"k": ')
    with pytest.warns(FusionWarning, match="corrupt") as seen:
        for _ in range(2):  # two sessions' caches, each loaded and written
            cache = _cache(tmp_path).load()
            cache.path.write_text('{"format": 1, "entries": {"k": ')  # damaged again
            cache.put({_node(1): NODE})
    assert len(seen) == 1


@pytest.mark.parametrize(
    "command, damage",
    [("run", b"\xff\xfe{"), ("tune", b'{"format": 1, "entries": {"k": ')],
    ids=["not-utf8", "truncated"],
)
def test_the_cli_says_a_damaged_cache_in_one_warning_line(tmp_path, command, damage):
    model = tmp_path / "m.onnx"
    onnx.save(fusion.rewrite(conv_stack(blocks=1, channels=8, size=6)).model, model)
    cache = TimingCache(cpu_key(), tmp_path / "cache")
    cache.folder.mkdir()
    cache.path.write_bytes(damage)
    env = os.environ | {"FUSION_CACHE_DIR": str(cache.folder), "FUSION_TACTICS": "fastest"}
    proc = subprocess.run(
        [sys.executable, "-m", "fusion", command, str(model), "--threads", "1"],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"fusion: warning: timing cache {cache.path} is corrupt ("), line
    assert _on_disk(cache)  # and rewritten, sound


# ---- bounds ----------------------------------------------------------------------------------
def test_keys_end_with_their_version_and_another_plugin_is_kept(tmp_path):
    assert timing_cache.builtin_version(_node(1, "v1+plugin")) == "v1"
    assert timing_cache.builtin_version(_plan(1, "v1")) == "v1"
    cache = _cache(tmp_path)
    _write(cache, {_node(1, "v0"): NODE, _node(2, "v1+a"): NODE, _plan(1, "v0+a"): PLAN})
    cache.load().put({_node(3, "v1+b"): NODE})
    assert set(_on_disk(cache)) == {_node(2, "v1+a"), _node(3, "v1+b")}


def test_a_write_bounds_a_huge_cache_to_the_newest_of_this_version(tmp_path):
    cap = timing_cache.MAX_ENTRIES
    cache = _cache(tmp_path)
    old_format = {_node(k): NODE for k in range(100)}  # before entries recorded `written`
    current = {_node(k): {**NODE, "written": k} for k in range(100, cap + 500)}
    stale = {_node(k, "v0"): {**NODE, "written": 10**10} for k in range(cap * 2)}
    _write(cache, old_format | current | stale)
    cache.load()
    assert len(cache.entries) == cap + 500  # another version is not even kept in memory
    cache.put({_plan(1): PLAN})
    on_disk = _on_disk(cache)
    assert len(on_disk) == cap and _plan(1) in on_disk
    assert set(on_disk) == {_plan(1)} | {_node(k) for k in range(501, cap + 500)}  # the newest
    assert len(TimingCache("cpu-a", tmp_path).load().entries) == cap == len(cache.entries)
    assert cache.path.stat().st_size < cap * 200  # bytes per entry: the key and a few timings


def test_a_session_whose_answers_are_cached_reads_the_file_once_and_writes_nothing(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    _session(monkeypatch)
    (path,) = tmp_path.glob("tactics-*.json")
    before = path.stat()
    opened, real_open = [], os.open

    def counting_open(file, *args, **kwargs):
        opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    _session(monkeypatch)
    assert opened.count(path.name) == 1 and ".tactics.lock" not in opened
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_the_source_version_covers_sub_packages(tmp_path, monkeypatch):
    """A kernel package's sub-package (kernels/simd) is kernel source too: a change there
    makes every cached timing stale, and so does a file moved."""
    package = tmp_path / "kernelpkg"
    (package / "simd").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "simd" / "__init__.py").write_text("W = 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("kernelpkg")

    def version() -> str:
        timing_cache.source_version.cache_clear()
        return timing_cache.source_version("kernelpkg")

    before = version()
    (package / "simd" / "__init__.py").write_text("W = 16\n")
    changed = version()
    (package / "simd" / "__init__.py").rename(package / "simd" / "lanes.py")
    assert len({before, changed, version()}) == 3
    timing_cache.source_version.cache_clear()
