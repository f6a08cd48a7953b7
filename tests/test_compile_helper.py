"""A cold start's compiling on two cores: a session compiles the nodes it is about to time,
from the first, while a helper process does from the last (fusion/runtime/precompile.py), and
a process that misses Numba's cache on an entry another process is compiling waits for it
instead of compiling it twice (kernels/_cache.py claims)."""

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, run_ort

import fusion
from fusion.catalog import Tactic


# ---- claims --------------------------------------------------------------------------------
def test_a_miss_claims_the_entry_and_a_save_releases_it(tmp_path):
    from fusion_kernels import _cache

    path = str(tmp_path / ".claim-a")
    assert _cache.claim_or_wait(path, lambda: None) is None  # claimed: this process compiles
    with open(path) as f:
        assert f.read() == str(os.getpid())
    _cache.release(path)
    assert not os.path.exists(path)


def test_a_miss_waits_for_a_live_claimer_and_loads_what_it_saved(tmp_path, monkeypatch):
    from fusion_kernels import _cache

    monkeypatch.setattr(_cache, "CLAIM_POLL_S", 0.001)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / ".claim-b"
        path.write_text(str(other.pid))
        polls = []

        def load():  # the other process saves after a few polls
            polls.append(1)
            return "machine code" if len(polls) >= 5 else None

        assert _cache.claim_or_wait(str(path), load) == "machine code"
        assert len(polls) == 5 and path.exists()  # the claim is the other process's to remove
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("case", ["dead", "stale", "ours"])
def test_an_abandoned_claim_is_taken_over(tmp_path, case):
    from fusion_kernels import _cache

    path = tmp_path / ".claim-c"
    if case == "dead":
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        path.write_text(str(gone.pid))
    elif case == "stale":  # a live process (pid 1) whose claim is older than any compile
        path.write_text("1")
        old = time.time() - 2 * _cache.CLAIM_STALE_S
        os.utime(path, (old, old))
    else:  # this process's own, left by a compile that did not finish
        path.write_text(str(os.getpid()))
    assert _cache.claim_or_wait(str(path), lambda: None) is None
    assert path.read_text() == str(os.getpid())
    _cache.release(str(path))


def test_a_failed_compile_releases_its_claims(tmp_path, monkeypatch):
    """A cached function that does not type: its compile raises, and the claim its cache miss
    made is gone (another process would otherwise wait on it)."""
    import numba

    from fusion_kernels import _cache  # importing kernels installs the claims

    claimed = []
    real = _cache.claim_or_wait

    def recording(path, load):
        claimed.append(path)
        return real(path, load)

    monkeypatch.setattr(_cache, "claim_or_wait", recording)

    class Every(set):  # claims are for the kernels package's functions: this one too, here
        def __contains__(self, _stamp):
            return True

    monkeypatch.setattr(_cache, "_STAMPS", Every())
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba"))
    source = tmp_path / "bad_kernel.py"
    source.write_text("import numba\n\n@numba.njit(cache=True)\ndef f(x):\n    return x.nope\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import bad_kernel

    with pytest.raises(numba.core.errors.TypingError):
        bad_kernel.f(np.zeros(3))
    assert claimed and not any(os.path.exists(p) for p in claimed)  # made, then released
    assert list((tmp_path / "numba").rglob(".claim-*")) == []


# ---- the helper process ----------------------------------------------------------------------
def conv_chain(blocks=6, c=16, hw=10):
    g = GraphBuilder(opset=17)
    y = "x"
    for k in range(blocks):
        y = g.node("Relu", [g.node("Conv", [y, g.weight(c, c, 3, 3), g.weight(c)],
                                   pads=[1] * 4, name=f"/conv{k}")])  # fmt: skip
    return g.model({"x": ["N", c, hw, hw]}, [y])


def test_the_helper_compiles_from_the_last_node_back_until_they_meet(tmp_path, monkeypatch):
    """With the session's nodes after its first held until the helper (a real process) has
    claimed one, the helper takes the last nodes: the two meet before the end, the helper is
    gone when the race times, and the session gives onnxruntime's outputs."""
    from fusion.runtime import precompile

    monkeypatch.setenv(precompile.HELPER_SWITCH, "1")
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "timing"))  # every node untimed
    monkeypatch.setattr(precompile, "COLD_SECONDS", 0.0)
    monkeypatch.setattr(precompile, "_cores", lambda: 2)
    work = tmp_path / "work"  # the exchange folder, known here
    work.mkdir()

    class Folder:
        def __init__(self, prefix=None):
            pass

        def __enter__(self):
            return str(work)

        def __exit__(self, *_exc):
            return False

    monkeypatch.setattr(precompile.tempfile, "TemporaryDirectory", Folder)
    real, calls = precompile.call_once, []

    def after_the_helper_starts(*args):  # the session's nodes wait for the helper's first claim
        calls.append(1)
        deadline = time.monotonic() + 300
        while len(calls) > 1 and not (work / "helper.pos").exists():
            assert time.monotonic() < deadline, "the helper never claimed a node"
            time.sleep(0.05)
        real(*args)

    monkeypatch.setattr(precompile, "call_once", after_the_helper_starts)
    model = conv_chain()
    session = fusion.Session(model, threads=2, tactics="kernels")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 16, 10, 10)).astype(np.float32)}
    got = session.run(None, feeds)[0]  # the first run of this shape: compiled, then timed
    done = session._plans.chooser.compiled
    assert done["helper"] and done["met"] < 6 and done["here"] < 6, done
    want = run_ort(model, feeds)[0]  # raced, a conv may take Winograd: scale-relative error
    assert_close(got, want, 1e-4, 1e-4 * float(np.abs(want).max()))


def test_a_cold_start_compiles_no_fallback_tactic():
    """call_once calls what the race times first: not a fallback while another tactic is
    offered, every tactic when all are fallbacks."""
    from fusion.runtime.precompile import call_once

    called = []
    first = Tactic("first", lambda x: called.append("first"))
    spare = Tactic("spare", lambda x: called.append("spare"), fallback=True)
    call_once([first, spare], [(2, 3)], [None])
    assert called == ["first"]
    called.clear()
    call_once([spare, dataclasses.replace(spare, name="other")], [(2, 3)], [None])
    assert called == ["spare", "spare"]


def test_no_helper_when_switched_off_or_warm(monkeypatch, tmp_path):
    from fusion.runtime import precompile

    calls = []
    monkeypatch.setattr(precompile, "_start", lambda *a: calls.append(a))
    monkeypatch.setattr(precompile, "_cores", lambda: 2)
    todo = {i: [] for i in range(8)}
    monkeypatch.setenv(precompile.HELPER_SWITCH, "0")
    monkeypatch.setattr(precompile, "COLD_SECONDS", 0.0)
    done = precompile.warm(None, todo, lambda i: True, 2, lambda i: time.sleep(0.01))
    assert done == {"here": 1, "helper": False, "met": 8} and not calls
    monkeypatch.setenv(precompile.HELPER_SWITCH, "1")
    monkeypatch.setattr(precompile, "COLD_SECONDS", 10.0)  # the first node was quick: warm
    done = precompile.warm(None, todo, lambda i: True, 2, lambda i: None)
    assert done["helper"] is False and not calls
