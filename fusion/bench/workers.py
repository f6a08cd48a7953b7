"""Runners in long-lived processes of their own: how fusion.bench times by default.

    workers, failed = start_workers({"ort-all": spec, "fusion": spec2}, progress=say)
    workers["ort-all"].run()          # its outputs on the feeds, for verification
    interleave(workers, rounds=20)    # the parent asks each in turn for a burst (worker.turn)
    close_workers(workers)

Each runner is built in a process of its own (`python -m fusion.bench --worker`) from the model
file and the feeds written to a folder, so onnxruntime runs with its real defaults (its idle
workers spin, and no other runner shares the process), as users run it. The parent sends
requests over a pipe; a worker answers one at a time and otherwise sleeps on the pipe, so only
the runner whose turn it is uses the cores. A burst is timed inside the worker with the same
`fusion.bench.timing.burst` a same-process run uses.

A `Host` is a runner and the calls it can time: the whole model, each fused node's kernel on
the inputs it received in a real run, or each fused node's function body alone in onnxruntime.
The same class serves requests in a worker process (Worker) and in the measuring process itself
(LocalWorker, the quick same-process mode), so both modes share every line but the pipe.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import onnx

from fusion.bench.runners import first_line, make_runner, spinning_entry
from fusion.bench.sgemm import Sgemm
from fusion.bench.timing import asleep, burst
from fusion.errors import FusionError
from fusion.functions import single_node_model
from fusion.ort import DEFAULT, DEFAULT_NO_SPIN, inference_session
from fusion.registry import load_plugin

SGEMM = "sgemm"  # a worker timing numpy's SGEMM on the workload's heaviest GEMM shape
BODIES = "ort-body"  # a worker timing fused nodes' function bodies alone in onnxruntime
BUILD_TIMEOUT = 3600.0  # s: a cold Numba compile of every kernel family takes minutes
REQUEST_TIMEOUT = 1800.0


class WorkerError(FusionError):
    """A worker failed: its reason, one line. stage "catalog": the rules could not be rebuilt
    in a process of its own (a kernel defined in a script's __main__, say)."""

    def __init__(self, reason: str, stage: str = ""):
        super().__init__(reason)
        self.stage = stage


def kernel_choice(step) -> str:
    """What runs a kernel step: the node's rule, and the tactic the runtime chose for it."""
    choice = getattr(step, "choice", None)
    return f"{step.node.op_type} ({choice})" if choice else step.node.op_type


class Host:
    """One runner and the calls it can time, where it lives (a worker process, or here).

    Besides its model (key None), a host can hold more models of the same kind under other
    keys (do_add: bench/convs.py times every conv of a model through three workers)."""

    def __init__(self, kind, model, feeds, threads, catalog=None, alone=False, shape=None,
                 progress=None):  # fmt: skip
        self.kind, self.model, self.feeds = kind, model, feeds
        self.threads, self.alone, self.catalog = threads, alone, catalog
        self.calls: dict = {}  # key -> a call to time (None: the whole model)
        self.runners: dict = {}  # key -> feeds -> outputs
        self.info = {"pid": os.getpid(), "settings": "", "spinning": ""}
        if kind == SGEMM:
            self.calls[None] = Sgemm(shape, threads)
            return
        if kind == BODIES:
            self.info["settings"] = (DEFAULT if alone else DEFAULT_NO_SPIN).name
            return
        if model is not None:
            self._add(None, model, feeds, progress)
            self.runner = self.runners[None]
            if self.runner.settings is not None:
                self.info["settings"] = self.runner.settings.name
                self.info["spinning"] = spinning_entry(self.runner.session)

    def _add(self, key, model, feeds, progress=None) -> None:
        run = make_runner(self.kind, model, self.catalog, self.threads, self.alone, progress)
        run.feeds = feeds
        self.runners[key], self.calls[key] = run, lambda: run(feeds)

    def handle(self, request: str, args: tuple):
        return getattr(self, f"do_{request}")(*args)

    def do_add(self, key, model, feeds) -> dict:
        """Another model of this host's kind under `key` (a ModelProto or its file, feeds or
        their .npz file)."""
        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(model)
        if not isinstance(feeds, dict):
            feeds = _load_feeds(feeds)
        self._add(key, model, feeds)
        run = self.runners[key]
        return {"settings": run.settings.name if run.settings else "",
                "spinning": spinning_entry(run.session)}  # fmt: skip

    def do_run(self, key=None):
        run = self.runners[key]
        out = run(run.feeds)
        if self.alone:  # a check run, too, leaves quiet cores to whoever runs next
            settle()
        return out

    def do_turn(self, key, calls: int, warm: float = 0.0, gap: float = 0.0) -> list[float]:
        times = burst(self.calls[key], calls, asleep(None, gap), warm=warm)
        if self.alone:  # the next runner, in another process, gets quiet cores
            settle()
        return times

    def do_profile(self, repeat: int, warm: float = 0.0) -> list[dict]:
        """fusion's run, step by step (Session.profile): kind, name, what runs it, seconds;
        after `warm` seconds of untimed runs, as a timed turn gets (a process that idled
        has slow CPUs and sleeping workers for its first runs)."""
        session = self.runner.session
        burst(self.calls[None], 0, warm=warm)
        prof = session.profile(self.feeds, repeat=repeat, warmup=0 if warm > 0 else 1)
        rows = []
        for step, (kind, name, seconds) in zip(
            session.steps_for(self.feeds), prof.steps, strict=True
        ):
            depth_first = False
            if kind == "kernel":
                runs, nodes = kernel_choice(step), 1
                depth_first = getattr(step, "depth_first", False)
            elif kind == "convert":
                runs, nodes = "layout conversion", 0
            else:
                runs, nodes = f"onnxruntime {step.settings.name}", len(step.nodes)
            rows.append({"kind": kind, "name": name, "runs": runs, "nodes": nodes,
                         "seconds": seconds, "depth_first": depth_first})  # fmt: skip
        rows.append({"kind": "between", "name": "between steps", "runs": "Python", "nodes": 0,
                     "seconds": prof.overhead})  # fmt: skip
        return rows

    def do_race(self) -> dict | None:
        """How fusion's session chose its plan for these feeds (Session.race_for)."""
        return self.runner.session.race_for(self.feeds)

    def do_nodes(self, key=None) -> list[tuple]:
        """Each fused node's kernel of model `key`, set up to be timed alone (call key: the
        step's name, or (key, name) for an added model) on the inputs it received in a real
        run; returns (step name, node, inputs, constant input names, kernel choice)."""
        run = self.runners[key]
        session, feeds = run.session, run.feeds
        values = session.run_with_intermediates(feeds)
        out = []
        for step in session.steps_for(feeds):
            if step.kind != "kernel":
                continue
            # the kernel on its own inputs (blocked where its tactic takes them so), the body
            # on the node's NCHW ones
            ins = [values[v] if v else None for v in step.inputs]
            args = [values[v] if v else None for v in step.node.input]
            constants = [v for v in step.node.input if v and session.view.constant(v) is not None]
            call_key = step.name if key is None else (key, step.name)
            self.calls[call_key] = lambda k=step.kernel, a=ins: k(*a)
            node = step.node.SerializeToString()
            out.append((step.name, node, args, constants, kernel_choice(step)))
        return out

    def do_bodies(self, nodes: list[tuple]) -> None:
        """Each fused node's function body as a one-node model in onnxruntime (DEFAULT when
        alone), constants as initializers (so it may pre-pack them), on the given inputs."""
        settings = DEFAULT if self.alone else DEFAULT_NO_SPIN
        for name, node_bytes, args, constants, _ in nodes:
            node = onnx.NodeProto.FromString(node_bytes)
            single, feeds = single_node_model(self.model, node, args, set(constants))
            session = inference_session(single, settings, self.threads)
            self.calls[name] = lambda s=session, f=feeds: s.run(None, f)


def settle(limit: float = 0.5, window: float = 0.002, quiet_for: float = 0.03) -> float:
    """Wait until this process's threads have stopped spinning: onnxruntime's idle workers spin
    for tens of milliseconds after a run by default (bench/NOTES.md, the bench harness), which
    would steal the cores of the runner whose turn comes next; they do not always start at
    once. Returns the seconds waited: at most `limit`, until `quiet_for` seconds of `window`s
    in a row pass each with under a tenth of it in CPU time."""
    start, quiet = time.perf_counter(), 0
    while quiet * window < quiet_for and time.perf_counter() - start < limit:
        cpu = time.process_time()
        time.sleep(window)
        quiet = quiet + 1 if time.process_time() - cpu < window / 10 else 0
    return time.perf_counter() - start


class LocalWorker:
    """A Host in the measuring process: the quick same-process mode."""

    def __init__(self, name: str, host: Host):
        self.name, self.host = name, host
        self.info = host.info

    def ask(self, request: str, *args):
        return self.host.handle(request, args)

    def run(self, key=None):
        return self.ask("run", key)

    def turn(self, calls: int, warm: float = 0.0, gap: float = 0.0, key=None) -> list[float]:
        return self.ask("turn", key, calls, warm, gap)

    def close(self) -> None:
        self.host = None


class Worker:
    """The parent's handle on a runner in a process of its own."""

    def __init__(self, name: str, spec: dict, env: dict | None = None, progress=None):
        self.name, self.progress, self.info = name, progress, {}
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        # its stdout and stderr, for the error message; closed in close()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        path = os.pathsep.join(p for p in sys.path if p)  # the parent's modules, as spawn does
        env = dict(os.environ if env is None else env, PYTHONPATH=path)
        cmd = [sys.executable, "-m", "fusion.bench", "--worker", str(child_in), str(child_out)]
        self.proc = subprocess.Popen(
            cmd, pass_fds=(child_in, child_out), env=env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=self._log,
        )  # fmt: skip
        os.close(child_in)
        os.close(child_out)
        self._out = Connection(parent_out, readable=False)
        self._in = Connection(parent_in, writable=False)
        self._out.send(spec)

    def fileno(self) -> int:
        return self._in.fileno()

    def take(self) -> tuple[bool, object]:
        """Read one message: (True, answer), or (False, None) after relaying a progress line;
        raises WorkerError for an error or a worker that died."""
        try:
            kind, value = self._in.recv()
        except (EOFError, OSError):
            raise WorkerError(f"{self.name}: worker exited ({self._last_words()})") from None
        if kind == "progress":
            if self.progress is not None:
                self.progress(f"{self.name}: {value}")
            return False, None
        if kind == "error":
            reason, stage = value
            raise WorkerError(reason, stage)
        return True, value

    def receive(self, timeout: float = REQUEST_TIMEOUT):
        """The next answer (progress lines go to `progress` on the way)."""
        while True:
            if not self._in.poll(timeout):
                raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s")
            done, value = self.take()
            if done:
                return value

    def ask(self, request: str, *args):
        self._out.send((request, args))
        return self.receive()

    def run(self, key=None):
        return self.ask("run", key)

    def turn(self, calls: int, warm: float = 0.0, gap: float = 0.0, key=None) -> list[float]:
        return self.ask("turn", key, calls, warm, gap)

    def close(self) -> None:
        if self._out.closed:
            return
        with contextlib.suppress(OSError):  # it may have died already
            self._out.send(("close", ()))
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._in.close()
        self._log.close()

    def _last_words(self) -> str:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return f"exit status {self.proc.returncode}: " + (lines[-1][:300] if lines else "no output")


class Keyed:
    """One of a worker's keyed calls (a fused node's kernel or body, one of several models) as
    a runner of the timing loop."""

    def __init__(self, worker, key):
        self.worker, self.key = worker, key

    def turn(self, calls: int, warm: float = 0.0, gap: float = 0.0) -> list[float]:
        return self.worker.turn(calls, warm, gap, self.key)


def start_workers(specs: dict, progress=None, envs: dict | None = None,
                  last: tuple = ()) -> tuple[dict, dict]:  # fmt: skip
    """Start one worker per spec at once and wait until each is built (they build in
    parallel), those named in `last` once the others are built: fusion's session races its
    plan while it is built, and the others' start-up would load that race (a race under load
    is provisional, raced again later, maybe inside a timed turn). Returns (name -> ready
    Worker, name -> WorkerError of those that failed)."""
    ready, failed = _start_all({n: s for n, s in specs.items() if n not in last}, progress, envs)
    later = {n: s for n, s in specs.items() if n in last}
    if later:
        more, more_failed = _start_all(later, progress, envs)
        ready, failed = ready | more, failed | more_failed
    return {n: ready[n] for n in specs if n in ready}, failed


def _start_all(specs: dict, progress, envs: dict | None) -> tuple[dict, dict]:
    pending = {name: Worker(name, spec, (envs or {}).get(name), progress)
               for name, spec in specs.items()}  # fmt: skip
    ready, failed = {}, {}
    while pending:
        for w in wait(list(pending.values()), timeout=BUILD_TIMEOUT) or list(pending.values()):
            try:
                done, info = w.take()
            except WorkerError as exc:
                del pending[w.name]
                failed[w.name] = exc
                w.close()
                continue
            if done:
                del pending[w.name]
                w.info, ready[w.name] = info, w
    return ready, failed


def close_workers(workers: dict) -> None:
    for w in workers.values():
        w.close()


def serve(fd_in: int, fd_out: int) -> None:
    """A worker process: build the Host its spec describes, then answer requests until told to
    close. Errors go back as ("error", (reason, stage))."""
    conn_in, conn_out = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    spec = conn_in.recv()
    stage = "catalog"
    try:
        for plugin in spec.get("plugins", ()):
            load_plugin(plugin)
        catalog = pickle.loads(spec["catalog"]) if spec.get("catalog") else None
        stage = "build"
        model = onnx.load(spec["model"]) if spec.get("model") else None
        feeds = _load_feeds(spec["feeds"]) if spec.get("feeds") else {}

        def progress(label, i, total):
            conn_out.send(("progress", f"building kernel {i}/{total} ({label})"))

        host = Host(spec["kind"], model, feeds, spec["threads"], catalog, alone=True,
                    shape=spec.get("shape"), progress=progress)  # fmt: skip
    except Exception as exc:
        conn_out.send(("error", (_reason(exc), stage)))
        return
    conn_out.send(("ok", host.info))
    while True:
        try:
            request, args = conn_in.recv()
        except EOFError:
            return
        if request == "close":
            return
        try:
            conn_out.send(("ok", host.handle(request, args)))
        except Exception as exc:
            conn_out.send(("error", (_reason(exc), request)))


def _load_feeds(path) -> dict:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files}


def _reason(exc: BaseException) -> str:
    if os.environ.get("FUSION_BENCH_DEBUG"):
        traceback.print_exc()
    return f"{type(exc).__name__}: {first_line(exc)}"


def worker_spec(kind: str, folder: Path, threads: int, model_file: str | None = None,
                catalog: bytes | None = None, plugins=(), shape=None) -> dict:  # fmt: skip
    """What a worker needs: its runner kind, the model file and feeds in `folder`, threads, and
    for fusion's runner the pickled catalog (and the plugins to load before unpickling it)."""
    return {
        "kind": kind,
        "model": str(folder / model_file) if model_file else None,
        "feeds": str(folder / "feeds.npz"),
        "threads": threads,
        "catalog": catalog,
        "plugins": [str(Path(p).resolve()) for p in plugins],
        "shape": list(shape) if shape else None,
    }
