"""The timing cache on disk (fusion/runtime/timing_cache.py): whatever is wrong with its file (not
UTF-8, a FIFO or a symbolic link in its place, a write that fails) costs a warning, once per
problem per process, and never a failed or hung command or a temporary file left behind."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import onnx
import pytest
from onnx import helper

import fusion
from fusion.errors import FusionWarning
from fusion.models import conv_stack
from fusion.runtime.timing_cache import TimingCache, node_key

NODE = {"times": {"nchw": 1e-3, "onnxruntime": 2e-3}}


def _node(batch: int, version: str = "v1") -> str:
    node = helper.make_node("ScaledRelu", ["x", "s"], ["y"], domain="fusion")
    node.overload = "body"
    return node_key(node, [(batch, 3), (1, 3)], 1, version)


def _cache(folder: Path) -> TimingCache:
    return TimingCache("cpu-a", folder)


def _write(cache: TimingCache, entries: dict) -> None:
    cache.path.write_text(json.dumps({"format": 1, "cpu": cache.cpu, "entries": entries}))


def _on_disk(cache: TimingCache) -> dict:
    return json.loads(cache.path.read_text())["entries"]


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
    from kernels.machine import cpu_key

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
