"""The timing cache: tactic and whole-plan timings on disk, one JSON file per CPU, so that a
later process on this machine chooses without timing anything (fusion/runtime/tactics.py)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from fusion.errors import FusionWarning

CACHE_FORMAT = 1


def cache_dir() -> Path:
    """FUSION_CACHE_DIR, else $XDG_CACHE_HOME/fusion, else ~/.cache/fusion."""
    if os.environ.get("FUSION_CACHE_DIR"):
        return Path(os.environ["FUSION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusion"


@functools.cache
def source_version(*modules: str) -> str:
    """A hash of the source files of the given packages or modules (a plugin's too): a kernel
    change makes every cached timing of it stale."""
    digest = hashlib.sha1()
    paths = []
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        if getattr(module, "__path__", None):
            paths += [str(p) for d in module.__path__ for p in sorted(Path(d).glob("*.py"))]
        elif module.__file__:
            paths.append(module.__file__)
    for path in paths:
        with contextlib.suppress(OSError):
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class TimingCache:
    """Tactic timings on disk, one JSON file per CPU; safe against concurrent writers (a lock
    file, then read-merge-write and an atomic rename), ignored with a warning when unreadable
    or written on another CPU."""

    cpu: str
    folder: Path = field(default_factory=cache_dir)
    entries: dict = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.folder / f"tactics-{hashlib.sha1(self.cpu.encode()).hexdigest()[:12]}.json"

    def load(self) -> TimingCache:
        self.entries = self._read() or {}
        return self

    def _read(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            warnings.warn(
                f"timing cache {self.path} unreadable ({exc}); ignored", FusionWarning, stacklevel=3
            )
            return None
        try:
            data = json.loads(text)
            if data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError("unknown format")
        except (ValueError, AttributeError) as exc:
            warnings.warn(
                f"timing cache {self.path} is corrupt ({exc}); ignored", FusionWarning, stacklevel=3
            )
            return None
        if data.get("cpu") != self.cpu:
            warnings.warn(
                f"timing cache {self.path} was written on another CPU "
                f"({data.get('cpu')!r}); ignored",
                FusionWarning,
                stacklevel=3,
            )
            return None
        return data["entries"]

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, new: dict) -> None:
        """Add entries and write them, merged with what other processes wrote meanwhile. A
        cache that cannot be written is skipped silently: it only saves time."""
        self.entries.update(new)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / ".tactics.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**(self._read() or {}), **new}
                data = {"format": CACHE_FORMAT, "cpu": self.cpu, "entries": merged}
                fd, tmp = tempfile.mkstemp(prefix=".tactics-", dir=self.folder)
                with os.fdopen(fd, "w") as out:
                    json.dump(data, out, indent=0, sort_keys=True)
                os.replace(tmp, self.path)
                self.entries = merged
        except OSError:
            pass


def plan_key(model_digest: str, shapes: Sequence, threads: int, version: str) -> str:
    """What a whole-plan timing depends on: the fused model without its weights' bytes (a
    digest of its graph, fused nodes and islands), its input shapes, threads, the kernels'
    source."""
    dims = ";".join("-" if s is None else "x".join(map(str, s)) for s in shapes)
    return f"plan:{model_digest}|{dims}|t{threads}|{version}"


def node_key(node: onnx.NodeProto, shapes: Sequence, threads: int, version: str) -> str:
    """What a tactic timing depends on: the node's computation (its function's content hash
    names its body, attributes included), its input shapes, threads, the kernels' source."""
    dims = ";".join("-" if s is None else "x".join(map(str, s)) for s in shapes)
    return f"{node.domain}.{node.op_type}:{node.overload}|{dims}|t{threads}|{version}"
