"""Where a session's threads run: during a run, the calling thread held on the CPU it is on and
its Numba workers kept on the others; between runs the calling thread is free.

Why: a parallel region ends at a barrier where the calling thread spins (GOMP_SPINCOUNT,
kernels/config.py) until every worker is done. After a pause the workers sleep, and on a
virtual machine whose idle vCPUs the host lends to others Linux wakes a sleeping worker on the
waker's own CPU (it avoids a preempted vCPU): the worker then waits behind the spinning caller
for the whole spin, region after region, until the load balancer moves it. Runs spaced like a
30 fps camera's (`bench/models.py --gap 33 --repeat 20`) took 10.9 ms median where they take
1.2 back to back (mobilenet_v3_small, batch 1, two vCPUs of an AMD EPYC family 25 model 17;
onnxruntime 1.6: its caller never waits for a worker that has not started); placed, 2.4
against onnxruntime's 2.2. Two processes running it at once: 21 ms median each, placed 1.9-3.2
(onnxruntime 4.9-5.7); beside a busy single-threaded process: 7.0-9.9 ms on average, placed
2.7-3.1 (onnxruntime 3.5-3.7; `bench/concurrency.py`; bench/NOTES.md).
The caller keeps the CPU the system gave it (two processes' callers stay apart) and is free
again after each run, so a thread it starts between runs inherits no pinning: three system
calls a run (two of them about 2.5 us each here), and one per worker when the caller's CPU
changed. One run at a time is placed: another Python thread's run meanwhile goes unplaced.
A plan's first run is not placed (RunPlan.run): it may compile kernels, seconds of one thread
that a CPU held for the run would keep beside another process's held thread (the test suite,
two processes, ran about twice as long).

Left to the operating system: sessions whose threads are fewer than the allowed CPUs (a process
running several things at once) or more than PLACE_MAX (workers moved one system call each
whenever the caller's CPU changes), one thread or one CPU, FUSION_PIN=0, and a user's own
OpenMP placement (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY, KMP_AFFINITY), and Numba's TBB
layer (its workers serve every thread). Linux with glibc 2.30 or later (gettid) only;
elsewhere, or when anything here fails, nothing is pinned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

SWITCH = "FUSION_PIN"
USER_PLACEMENT = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
PLACE_MAX = 8  # threads
# per calling thread: .team (its workers' OS thread ids and the CPUs it may use, or None),
# .held (a run's placement, while one is on), .workers_off (the CPU the workers are kept off),
# .found (thread count -> the workers' ids, found once)
_local = threading.local()
# Runs placed now, in every thread: one at a time (two callers held each on its CPU, their
# workers kept off it, would leave the scheduler nothing to balance)
_placed = {"runs": 0}
_placed_lock = threading.Lock()


def wanted(threads: int, env=os.environ) -> bool:
    """Whether a session's threads should be placed: they fill the CPUs this thread may use (two
    to PLACE_MAX), the switch is not off and the user placed none."""
    if env.get(SWITCH, "1") == "0" or any(env.get(k) for k in USER_PLACEMENT):
        return False
    if not hasattr(os, "sched_setaffinity") or _current_cpu() is None or not _has_gettid():
        return False
    return 1 < threads == len(os.sched_getaffinity(0)) <= PLACE_MAX


def place(threads: int) -> None:
    """After the calling thread gave Numba `threads` (kernels.config.set_threads): find the
    workers its parallel kernels run on, for `enter` to place. Does nothing where `wanted` says
    no or the workers cannot be found (runs then go unplaced)."""
    free_workers()
    _local.team = None
    if not wanted(threads):
        return
    found = _local.__dict__.setdefault("found", {})
    try:
        import numba  # heavy: a session with kernels has it

        if numba.threading_layer() != "omp":  # TBB's workers serve every thread: not ours
            return
        if threads not in found:
            from fusion_kernels.config import worker_ids

            found[threads] = tuple(sorted(worker_ids()))
    except Exception:  # noqa: BLE001 - placement is an optimization: never fail a run for it
        return
    if len(found[threads]) == threads - 1:
        _local.team = (found[threads], frozenset(os.sched_getaffinity(0)))


def enter() -> object:
    """At a run's start, when `place` found the team and no other thread's run is placed: the
    calling thread held on the CPU it is on, each worker kept on the other CPUs (moved only
    when the caller's CPU changed since the last run). Returns what `leave` needs (None:
    nothing was moved); call it inside the run's try, `leave` in its finally."""
    team = getattr(_local, "team", None)
    if team is None or getattr(_local, "held", None) is not None:
        return None
    with _placed_lock:
        if _placed["runs"]:
            return None
        _placed["runs"] += 1
    workers, allowed = team
    try:
        saved = os.sched_getaffinity(0)
        here = _current_cpu()
        if here not in allowed:
            _release_slot()
            return None
        _local.held = (saved, here)
        os.sched_setaffinity(0, {here})
        if getattr(_local, "workers_off", None) != here:
            _local.workers_off = None
            for tid in workers:
                os.sched_setaffinity(tid, allowed - {here})
            _local.workers_off = here
    except BaseException as exc:  # an interrupt too: never leave the thread pinned
        held = getattr(_local, "held", None)
        if held is None:
            _release_slot()
        leave(held)
        if not isinstance(exc, OSError):
            raise
        free_workers()  # a worker gone (its pool shut down): found again on a new count
        _local.team = None
        _local.__dict__.get("found", {}).clear()
        return None
    return _local.held


def leave(held: object) -> None:
    """At a run's end (also when it raised): the calling thread free again (a thread it starts
    between runs inherits no pinning). The workers stay off its last CPU: they start no
    threads, and moving them every run would cost (threads - 1) system calls more."""
    if held is not None:
        _local.held = None
        _release_slot()
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, held[0])


def free_workers() -> None:
    """The calling thread's workers back on every CPU it may use (its team's placement undone)."""
    team = getattr(_local, "team", None)
    for tid in team[0] if team else ():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, team[1])
    _local.workers_off = None


@contextlib.contextmanager
def released():
    """Inside a placed run (`enter`): the calling thread on the CPUs it had before the run for
    the block, so that threads it starts (an onnxruntime session's pool) inherit those, not
    the run's one CPU."""
    held = getattr(_local, "held", None)
    if held is None:
        yield
        return
    saved, here = held
    os.sched_setaffinity(0, saved)
    try:
        yield
    finally:
        os.sched_setaffinity(0, {here})


def _release_slot() -> None:
    with _placed_lock:
        _placed["runs"] -= 1


def _has_gettid() -> bool:
    """Whether the C library has gettid (glibc 2.30 and later), which kernels.config.worker_ids
    calls: without it Numba could not link that function, and LLVM ends the process."""
    try:
        return hasattr(ctypes.CDLL(None), "gettid")
    except OSError:
        return False


def _forget() -> None:
    """In a forked child: the parent's workers are not this process's threads."""
    _local.__dict__.clear()
    _placed["runs"] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _current_cpu() -> int | None:
    """The CPU the calling thread runs on (glibc's sched_getcpu), None where it cannot tell."""
    global _getcpu
    if _getcpu is None:
        try:
            _getcpu = ctypes.CDLL(None).sched_getcpu
            _getcpu.restype, _getcpu.argtypes = ctypes.c_int, ()
        except (OSError, AttributeError):
            _getcpu = lambda: -1  # noqa: E731
    cpu = _getcpu()
    return None if cpu < 0 else cpu


_getcpu = None
