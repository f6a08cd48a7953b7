"""Where a session's threads run (fusion/runtime/placement.py): with as many threads as the CPUs
the caller may use, a run holds the caller on the CPU it is on and keeps its Numba workers on
the others; the caller is free again after the run; threads started inside a run keep the
caller's CPUs; another thread count frees the workers; nothing is pinned with fewer threads,
with FUSION_PIN=0 or a user's OpenMP placement. Linux only, two CPUs or more."""

import os
import sys
import threading
import time

import numba
import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, conv_block, run_ort

import fusion
from fusion.runtime import placement, steps
from fusion_kernels.config import worker_ids

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not 2 <= len(CPUS) <= placement.PLACE_MAX
    or len(CPUS) > numba.config.NUMBA_NUM_THREADS
    or not placement._has_gettid(),
    reason="thread placement is Linux's (glibc 2.30+), for 2 to PLACE_MAX CPUs, all Numba's",
)


def conv_model():
    g = GraphBuilder()
    return g.model({"x": ["N", 8, 12, 12]}, [conv_block(g, "x", 8, 16, pads=[1, 1, 1, 1])])


def affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


def session(threads: int) -> fusion.Session:
    return fusion.Session(conv_model(), threads=threads, tactics="kernel")


class Spy:
    """A run step that records where the calling thread and the workers may run, then runs the
    step it wraps."""

    def __init__(self, step, seen: list):
        self.step, self.seen = step, seen
        self.kind, self.name = step.kind, step.name
        self.inputs, self.outputs = step.inputs, step.outputs

    def __call__(self, values, keep_all):
        workers = placement._local.team[0]
        self.seen.append((os.sched_getaffinity(0), [affinity(t) for t in workers]))
        return self.step(values, keep_all)


@pytest.fixture
def unplaced(monkeypatch):
    """No placement left over from an earlier test in this thread, none left after it."""
    monkeypatch.delenv(placement.SWITCH, raising=False)
    for name in placement.USER_PLACEMENT:
        monkeypatch.delenv(name, raising=False)
    placement.free_workers()
    placement._local.__dict__.clear()
    yield
    placement.free_workers()
    placement._local.__dict__.clear()


def test_a_run_holds_the_caller_and_its_workers_apart_and_frees_the_caller(unplaced):
    before = os.sched_getaffinity(0)
    s = session(len(CPUS))
    x = np.random.default_rng(0).standard_normal((2, 8, 12, 12)).astype(np.float32)
    feeds = {"x": x}
    s.run(None, feeds)  # finds the team; a plan's first run is not placed
    assert set(placement._local.team[0]) == worker_ids() != set()
    steps, seen = s.steps_for(feeds), []
    steps[0] = Spy(steps[0], seen)
    out = s.run(None, feeds)
    time.sleep(0.01)  # a pause: the workers sleep
    s.run(None, feeds)
    for caller, workers in seen:
        assert len(caller) == 1 and caller <= before  # the CPU it was on
        assert len(workers) == len(CPUS) - 1
        assert all(w == before - caller for w in workers), (caller, workers)  # the others
    assert os.sched_getaffinity(0) == before  # free after the run
    assert_close(out[0], run_ort(s.model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_another_thread_count_frees_the_workers(unplaced):
    s = session(len(CPUS))
    for _ in range(2):  # a plan's first run is not placed
        s.run(None, {"x": np.ones((1, 8, 12, 12), np.float32)})
    workers = placement._local.team[0]
    assert all(len(affinity(t)) == len(CPUS) - 1 for t in workers)
    session(1).run(None, {"x": np.ones((1, 8, 12, 12), np.float32)})
    assert all(affinity(t) == set(CPUS) for t in workers)
    assert placement._local.team is None


def test_a_run_inside_a_pinned_block_stays_pinned_and_the_block_ends_free(unplaced):
    s = session(len(CPUS))
    x = np.ones((1, 8, 12, 12), np.float32)
    s.run(None, {"x": x})  # places the threads
    seen = []
    saved = placement.enter()
    try:
        seen.append(os.sched_getaffinity(0))
        s.run(None, {"x": x})  # a run inside a pinned block (a race's) leaves it pinned
        seen.append(os.sched_getaffinity(0))
    finally:
        placement.leave(saved)
    assert len(seen[0]) == 1 and seen == [seen[0], seen[0]]
    assert os.sched_getaffinity(0) == set(CPUS)


def test_threads_started_inside_a_run_keep_the_callers_cpus(unplaced):
    session(len(CPUS)).run(None, {"x": np.ones((1, 8, 12, 12), np.float32)})
    got = {}

    def record(key):
        got[key] = os.sched_getaffinity(0)

    saved = placement.enter()
    try:
        t = threading.Thread(target=record, args=("plain",))
        t.start()
        t.join()
        with placement.released():
            t = threading.Thread(target=record, args=("released",))
            t.start()
            t.join()
        record("after")
    finally:
        placement.leave(saved)
    assert len(got["plain"]) == 1  # what released() is for: a thread inherits the run's CPU
    assert got["released"] == set(CPUS)
    assert got["after"] == got["plain"]


@pytest.mark.parametrize("why", ["fewer threads", "switch", "user placement"])
def test_nothing_is_pinned_when_placement_is_not_wanted(unplaced, monkeypatch, why):
    threads = len(CPUS)
    if why == "fewer threads":
        threads = 1
    elif why == "switch":
        monkeypatch.setenv(placement.SWITCH, "0")
    else:
        monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert not placement.wanted(threads)
    s = session(threads)
    s.run(None, {"x": np.ones((1, 8, 12, 12), np.float32)})
    assert getattr(placement._local, "team", None) is None
    assert placement.enter() is None


def test_an_island_built_inside_a_run_gets_the_callers_cpus(unplaced, monkeypatch):
    """An island whose session is built on a first run (its input types known only then):
    onnxruntime starts its pool's threads there, and they keep the CPUs they are born with."""
    g = GraphBuilder()
    y = g.node("Softmax", [conv_block(g, "x", 8, 16, pads=[1, 1, 1, 1])], axis=1)
    s = fusion.Session(g.model({"x": ["N", 8, 12, 12]}, [y]), threads=len(CPUS), tactics="kernel")
    feeds = {"x": np.ones((1, 8, 12, 12), np.float32)}
    s.run(None, feeds)  # places the threads
    assert placement._local.team is not None
    (island,) = [step for step in s.steps_for(feeds) if step.kind == "island"]
    island.session, island._run = None, None  # built again on the next run, inside it
    built_on = []
    build = steps.inference_session

    def spy(*args, **kwargs):
        assert placement._local.held is not None  # inside a placed run
        built_on.append(os.sched_getaffinity(0))
        return build(*args, **kwargs)

    monkeypatch.setattr(steps, "inference_session", spy)
    s.run(None, feeds)
    assert built_on == [set(CPUS)]
    assert island.session is not None


def test_one_run_at_a_time_is_placed(unplaced):
    """Another thread's run holds the placement: this one runs unplaced (two callers held
    apart from their workers would leave the scheduler nothing to balance)."""
    session(len(CPUS)).run(None, {"x": np.ones((1, 8, 12, 12), np.float32)})
    with placement._placed_lock:
        placement._placed["runs"] += 1  # what another thread's enter() does
    try:
        assert placement.enter() is None and os.sched_getaffinity(0) == set(CPUS)
    finally:
        placement._release_slot()
    held = placement.enter()
    assert held is not None
    placement.leave(held)
    assert placement._placed["runs"] == 0


def test_an_interrupt_inside_enter_leaves_nothing_pinned(unplaced, monkeypatch):
    session(len(CPUS)).run(None, {"x": np.ones((1, 8, 12, 12), np.float32)})
    placement._local.workers_off = None  # the workers to be moved: a call that is interrupted
    pin = os.sched_setaffinity

    def interrupted(tid, cpus):
        if tid != 0:
            raise KeyboardInterrupt
        pin(tid, cpus)

    monkeypatch.setattr(placement.os, "sched_setaffinity", interrupted)
    with pytest.raises(KeyboardInterrupt):
        placement.enter()
    monkeypatch.undo()
    assert os.sched_getaffinity(0) == set(CPUS)
    assert placement._local.held is None and placement._placed["runs"] == 0
    held = placement.enter()  # and later runs are placed again
    assert held is not None
    placement.leave(held)


def test_a_plans_first_run_is_not_placed(unplaced):
    """It may compile kernels: seconds of one thread that a held CPU would keep beside another
    process's held thread."""
    s = session(len(CPUS))
    feeds = {"x": np.ones((1, 8, 12, 12), np.float32)}
    steps, seen = s.steps_for(feeds), []
    steps[0] = Spy(steps[0], seen)
    s.run(None, feeds)
    s.run(None, feeds)
    assert [len(caller) for caller, _ in seen] == [len(CPUS), 1]
