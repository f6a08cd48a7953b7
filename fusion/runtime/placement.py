"""Where a session's threads run: during a run, the calling thread held on the CPU it is on and
its Numba workers kept on the others; between runs the calling thread is free.

Why: a parallel region ends at a barrier where the calling thread spins (GOMP_SPINCOUNT,
kernels/config.py) until every worker is done. After a pause the workers sleep, and on a
virtual machine whose idle vCPUs the host lends to others Linux wakes a sleeping worker on the
waker's own CPU (it avoids a preempted vCPU): the worker then waits behind the spinning caller
for the whole spin, region after region, until the load balancer moves it. Runs spaced like a
30 fps camera's (`bench/models.py --gap 33 --repeat 20`) took 10.9 ms median where they take
1.2 back to back (mobilenet_v3_small, batch 1, two Zen 4 vCPUs; onnxruntime 1.6: its caller
never waits for a worker that has not started); placed, 2.4 against onnxruntime's 2.2. While
the host was busy, runs back to back alone took 5.2 ms median, placed 2.5 (onnxruntime 1.9),
and two processes at once 5.5-5.7, placed 4.5-5.3 (`bench/concurrent.py`; bench/NOTES.md).
The caller keeps the CPU the system gave it (two processes' callers stay apart) and is free
again after each run, so a thread it starts between runs inherits no pinning: two system
calls a run (about 2.5 us each here), and one per worker when the caller's CPU changed.

Left to the operating system: sessions whose threads are fewer than the allowed CPUs (a process
running several things at once) or more than PLACE_MAX (workers moved one system call each
whenever the caller's CPU changes), one thread or one CPU, FUSION_PIN=0, and a user's own
OpenMP placement (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY). Linux with glibc only;
elsewhere, or when anything here fails, nothing is pinned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

SWITCH = "FUSION_PIN"
USER_PLACEMENT = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
PLACE_MAX = 8  # threads
# per calling thread: .team (its workers' OS thread ids and the CPUs it may use, or None),
# .held (a run's placement, while one is on), .workers_off (the CPU the workers are kept off)
_local = threading.local()


def wanted(threads: int, env=os.environ) -> bool:
    """Whether a session's threads should be placed: they fill the CPUs this thread may use (two
    to PLACE_MAX), the switch is not off and the user placed none."""
    if env.get(SWITCH, "1") == "0" or any(env.get(k) for k in USER_PLACEMENT):
        return False
    if not hasattr(os, "sched_setaffinity") or _current_cpu() is None:
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
    try:
        from kernels.config import worker_ids  # heavy: Numba (a session with kernels)

        workers = tuple(sorted(worker_ids()))
    except Exception:  # noqa: BLE001 - placement is an optimization: never fail a run for it
        return
    if len(workers) == threads - 1:
        _local.team = (workers, frozenset(os.sched_getaffinity(0)))


def enter() -> object:
    """At a run's start, when `place` found the team: the calling thread held on the CPU it is
    on, each worker kept on the other CPUs (moved only when the caller's CPU changed since the
    last run). Returns what `leave` needs (None: nothing was moved)."""
    team = getattr(_local, "team", None)
    if team is None or getattr(_local, "held", None) is not None:
        return None
    workers, allowed = team
    try:
        saved = os.sched_getaffinity(0)
        here = _current_cpu()
        if here not in allowed:
            return None
        os.sched_setaffinity(0, {here})
        _local.held = (saved, here)
        if getattr(_local, "workers_off", None) != here:
            _local.workers_off = None
            for tid in workers:
                os.sched_setaffinity(tid, allowed - {here})
            _local.workers_off = here
    except OSError:  # a worker gone (its pool shut down): runs go unplaced from now on
        leave(getattr(_local, "held", None))
        free_workers()
        _local.team = None
        return None
    return _local.held


def leave(held: object) -> None:
    """At a run's end (also when it raised): the calling thread free again (a thread it starts
    between runs inherits no pinning). The workers stay off its last CPU: they start no
    threads, and moving them every run would cost (threads - 1) system calls more."""
    if held is not None:
        _local.held = None
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
