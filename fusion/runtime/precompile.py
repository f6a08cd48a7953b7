"""Cold start on two cores: a helper process compiles part of a model's kernels.

A model's first run on an empty Numba cache compiles every tactic the per-node race times
(`python bench/cold_start.py MODEL`: efficientnet_b0 ~90 s of compiling, one core busy and
the other idle). Numba compiles on one thread per process (its compiler lock) and saves what
it compiles to its on-disk cache, which another process loads in milliseconds. So before the
race times anything, the session calls each untimed node's tactics once (which compiles them)
from the first node on, while a helper process does the same from the last node back; each
writes the position it is about to start to a file the other reads, and both stop where they
meet (at most one node is compiled twice). The race then times on compiled code with the
helper gone: it never shares the machine with a timing.

Only nodes of the built-in catalog go to the helper (rules registered in the user's process do
not exist in another); it inherits the environment (Numba's cache directory, the SIMD width,
the thread settings). Whatever the helper fails to do, the race compiles as before: this only
moves work earlier and onto the other core. FUSION_COMPILE_HELPER=0 turns it off.

    python -m fusion.runtime.precompile DIR      # the helper: DIR holds model.onnx, job.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

HELPER_SWITCH = "FUSION_COMPILE_HELPER"  # "0": no helper (the race compiles as it times)
MIN_NODES = 4  # untimed nodes below this: not worth a process
COLD_SECONDS = 0.5  # the first node's calls took longer: compiling (the cache is cold)
WAIT_S = 600.0  # the longest the session waits for the helper to finish its node
_MODEL, _JOB, _SESSION, _HELPER = "model.onnx", "job.json", "session.pos", "helper.pos"


def call_once(tactics, shapes: Sequence, consts: Sequence) -> None:
    """Each tactic the race times first (first_timed: the fallbacks only if all are) once on
    random inputs of the node's shapes, in its layouts, as the race's first call makes it
    (fusion/runtime/choice.py time_tactics): the same argument types, so the same compiled
    code. A tactic that fails is left to the race, which reports it."""
    from fusion.runtime.tactics import first_timed, random_inputs, tactic_inputs

    inputs = random_inputs(shapes, consts)
    for tactic in first_timed(tactics):
        try:
            tactic.run(*tactic_inputs(tactic, inputs))
        except Exception:  # noqa: BLE001, S112 (the race times it again and reports it)
            continue


def _write(path: Path, value: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(value))
    os.replace(tmp, path)


def _read(path: Path, default: int) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return default


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def warm(model, todo: dict, helped: Callable[[int], bool], threads: int,
         compile_node: Callable[[int], None]) -> dict:  # fmt: skip
    """Compile the nodes of `todo` (index in the model's nodes -> its inputs' shapes, in race
    order) before they are timed: compile_node(i) in this process from the first on, and,
    when the first took long enough to be compiling and enough remain, a helper process from
    the last back over the nodes `helped` accepts (built-in rules), until the two meet.
    Returns what was done: {"here": nodes compiled in this process, "helper": whether a
    helper ran, "met": the position in todo where the helper's part began (len(todo): none)}."""
    done = {"here": 0, "helper": False, "met": len(todo)}
    if not todo:
        return done
    order = list(todo)
    start = time.perf_counter()
    compile_node(order[0])
    done["here"] = 1
    rest = order[1:]
    cold = time.perf_counter() - start > COLD_SECONDS
    switched_off = os.environ.get(HELPER_SWITCH, "1") == "0"
    if (not cold or len(rest) < MIN_NODES or _cores() < 2 or os.name != "posix"
            or getattr(sys, "frozen", False) or switched_off):  # fmt: skip
        return done  # the race compiles the rest as it times them, as without a helper
    with tempfile.TemporaryDirectory(prefix="fusion-compile-") as tmp:
        folder = Path(tmp)
        helper = _start(folder, model, rest, todo, helped, threads)
        done["helper"] = helper is not None
        try:
            for pos, i in enumerate(rest):
                if helper is not None and pos >= _read(folder / _HELPER, len(rest)):
                    done["met"] = 1 + pos
                    for j in rest[pos:]:  # the helper's part, but for the nodes it cannot build
                        if not helped(j):
                            compile_node(j)
                            done["here"] += 1
                    break  # the helper has this node and the ones after it
                _write(folder / _SESSION, pos)
                compile_node(i)
                done["here"] += 1
        except BaseException:  # interrupted, or a compile that raised: no helper outlives it
            if helper is not None:
                helper.kill()
            raise
        finally:
            if helper is not None:
                _finish(helper, folder, len(rest))
    return done


def _start(folder: Path, model, rest: list, todo: dict, helped, threads: int):
    """The helper process over the nodes of `rest` it can build, or None (none it can build;
    the model over protobuf's 2 GB; no room for its copy; no process to be had)."""
    mine = [pos for pos, i in enumerate(rest) if helped(i)]
    if not mine:
        return None
    nodes = [[pos, rest[pos], [None if s is None else [int(d) for d in s] for s in todo[rest[pos]]]]
             for pos in mine]  # fmt: skip
    env = dict(os.environ, **{HELPER_SWITCH: "0"})  # a helper starts no helper
    try:
        (folder / _MODEL).write_bytes(model.SerializeToString())
        job = {"threads": threads, "nodes": nodes, "session": os.getpid()}
        (folder / _JOB).write_text(json.dumps(job))
        _write(folder / _SESSION, -1)
        return subprocess.Popen(  # noqa: S603 (our own module, our own interpreter)
            [sys.executable, "-m", "fusion.runtime.precompile", str(folder)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _finish(helper: subprocess.Popen, folder: Path, count: int) -> None:
    """The helper ends: at once if it has not started a node (still importing, or nothing
    left for it), else once it has finished the node it is compiling (which this process
    skipped), within WAIT_S; killed whatever interrupts the wait."""
    if _read(folder / _HELPER, count) >= count:
        helper.kill()
    try:
        helper.wait(timeout=WAIT_S)
    except BaseException:  # the wait's end, or an interrupt: the helper outlives nothing
        helper.kill()
        helper.wait()
        if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            raise


def helper_main(folder: Path) -> int:
    """The helper: build the model's kernels (built-in catalog) and compile the job's nodes
    from the last back, stopping where the session's position has come."""
    import onnx

    from fusion.registry import default_catalog
    from fusion.runtime.kernel import build_kernels, ensure_threads

    job = json.loads((folder / _JOB).read_text())
    model = onnx.load_from_string((folder / _MODEL).read_bytes())
    built = build_kernels(model, default_catalog(), int(job["threads"]))
    ensure_threads(built.threads)
    for pos, i, ins in reversed(job["nodes"]):
        if pos <= _read(folder / _SESSION, -1) or os.getppid() != job["session"]:
            break  # the session has come this far (the rest is done), or is gone
        _write(folder / _HELPER, pos)
        tactics = built.tactics.get(i)
        if tactics is None:
            continue
        node = built.view.nodes[i]
        consts = [built.view.constant(v) if v else None for v in node.input]
        call_once(tactics, [None if s is None else tuple(s) for s in ins], consts)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(helper_main(Path(sys.argv[1])))
