"""The timing cache: tactic and whole-plan timings on disk, one JSON file per CPU, so that a
later process on this machine chooses without timing anything (fusion/runtime/choice.py).

    {"format": 1, "cpu": "AMD EPYC 7551 ... | avx2", "entries": {
      "fusion.ConvBiasRelu:<body hash>|1x8x10x10;c8x8x3x3;c8|t2|<version>":
          {"times": {"blocked-4x16": 1.2e-05, "nchw-winograd": 2.1e-05, "onnxruntime": 3e-05},
           "written": 1764620000},
      "plan:<model digest>|1x3x32x32|t2|<version>":
          {"plans": {"per-node": 1.1e-03, "nchw": 1.2e-03, "onnxruntime": 1.3e-03}, ...},
      "convert:1x24x112x112|b16|t2|<version>":
          {"times": {"to blocked": 4.1e-05, "from blocked": 6.3e-05}}}}

(A checkout older than the `convert:` entries reads them as node entries without an
onnxruntime time: it warns once and drops them when it writes; nothing else is lost.)

The file only saves time, so nothing wrong with it fails a command: a file that cannot be read,
is not a regular file (a FIFO, a symbolic link: neither is followed or waited on), is corrupt or
was written on another CPU is ignored, an entry that does not fit its kind's schema
(ENTRY_FIELDS) is dropped and the others kept; each problem is one warning per process. Writers
take a lock file, re-read and merge, and rename a complete file over the old one, so two
processes lose nothing. A write bounds the cache: entries of another version of the built-in
kernels are dropped (no key of this code can hit them), then all but the MAX_ENTRIES newest.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import stat
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from fusion.errors import FusionError, FusionWarning, one_line
from fusion.files import write_atomic
from fusion.runtime.tactics import ONNXRUNTIME

CACHE_FORMAT = 1
# Entries kept when the cache is written, the newest: a model has one per fused node and one
# per plan for each input shape and thread count, so this holds many models' choices, in about
# 1 MB (a conv's entry with three tactics is some 230 bytes).
MAX_ENTRIES = 4096
PLAN = "plan:"  # the start of a whole-plan race's key (plan_key); any other is a node's
CONVERT = "convert:"  # the start of a layout conversion's key (convert_key)
TO_BLOCKED, FROM_BLOCKED = "to blocked", "from blocked"  # a conversion entry's two times
LOCK = ".tactics.lock"


def cache_dir() -> Path:
    """FUSION_CACHE_DIR, else $XDG_CACHE_HOME/fusion, else ~/.cache/fusion."""
    if os.environ.get("FUSION_CACHE_DIR"):
        return Path(os.environ["FUSION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusion"


@functools.cache
def source_version(*modules: str) -> str:
    """A hash of the source files of the given packages (their sub-packages too, such as
    kernels/simd) or modules (a plugin's): a kernel change makes every cached timing of it
    stale. A file's path within its package counts with its bytes (a file moved is a change)."""
    digest = hashlib.sha1()
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        if getattr(module, "__path__", None):
            files = [(p.relative_to(d).as_posix(), p) for d in map(Path, module.__path__)
                     for p in d.rglob("*.py")]  # fmt: skip
        elif module.__file__:
            files = [(Path(module.__file__).name, Path(module.__file__))]
        else:
            continue
        for relative, path in sorted(files):
            with contextlib.suppress(OSError):
                data = path.read_bytes()
                digest.update(f"{name}/{relative}\0{len(data)}\0".encode())
                digest.update(data)
    return digest.hexdigest()[:16]


def timing_version(plugins: Sequence[str] = ()) -> str:
    """What a timing depends on in code, the last field of its key: the hash of the built-in
    kernels' and patterns' source, then `+` and the hash of the plugin modules whose kernels the
    session runs, if any. Without plugins: the built-in kernels' version, which a written cache
    keeps (another plugin's entries stay: another model may run it)."""
    builtin = source_version("fusion_kernels", "fusion_patterns")
    return f"{builtin}+{source_version(*plugins)}" if plugins else builtin


def builtin_version(key: str) -> str:
    """The built-in kernels' version a key (plan_key, node_key) or a version names."""
    return key.rsplit("|", 1)[-1].split("+", 1)[0]


# ---- what an entry holds ---------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """A field of a cache entry: check(value) is None when the value is sound, else why not."""

    check: Callable[[object], str | None]
    required: bool = True


def _seconds(value) -> str | None:
    sound = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return None if sound else "is not a time in seconds"  # NaN is not >= 0; inf is a failure


def _timings(*required: str) -> Callable[[object], str | None]:
    """The check of {name: seconds}: not empty, with the names `required`."""

    def check(value) -> str | None:
        if not isinstance(value, dict):
            return "is not an object"
        if not value:
            return "is empty"
        if any(_seconds(v) for v in value.values()):
            return "holds a value that is not a time in seconds"
        missing = [name for name in required if name not in value]
        return f"lacks {missing[0]!r}" if missing else None

    return check


# Per kind of entry (its key's: plan_key or node_key), the fields its readers use (Chooser.settle
# and Chooser.choose, fusion/runtime/choice.py) and `written` (Unix time, for MAX_ENTRIES). A
# field added later is optional (required=False), so that entries written before it still read.
def _of(*types: type, what: str) -> Callable[[object], str | None]:
    """The check of a value of one of `types` (bool is no number here)."""

    def check(value) -> str | None:
        number = isinstance(value, bool) and bool not in types
        return None if isinstance(value, types) and not number else f"is not {what}"

    return check


# A race's verdict (fusion/runtime/race.py, Verdict.to_entry): optional, as entries written before
# races were judged hold only "plans" (they are re-raced as provisional).
_VERDICT = {
    "chosen": Field(_of(str, what="a plan's name"), required=False),
    "noise": Field(_seconds, required=False),  # a ratio: the same check as a time
    "decided": Field(_of(bool, what="true or false"), required=False),
    "busy": Field(_of(bool, what="true or false"), required=False),
    "load": Field(_of(int, float, type(None), what="a number of cores or null"), required=False),
    "rounds": Field(_of(int, what="a count"), required=False),
}
ENTRY_FIELDS = {
    "plan": {"plans": Field(_timings()), "written": Field(_seconds, required=False), **_VERDICT},
    "node": {"times": Field(_timings(ONNXRUNTIME)), "written": Field(_seconds, required=False)},
    "convert": {"times": Field(_timings(TO_BLOCKED, FROM_BLOCKED)),
                "written": Field(_seconds, required=False)},
}  # fmt: skip


def kind(key: str) -> str:
    """Which of ENTRY_FIELDS' kinds the entry under `key` is."""
    return "plan" if key.startswith(PLAN) else "convert" if key.startswith(CONVERT) else "node"


def damage(key: str, entry) -> str | None:
    """Why a cache entry cannot be used (None: it can), by the schema of its key's kind. A plan
    entry holds a whole verdict or none of it (an entry from before judged races), names a
    chosen plan among its timings, and has at least one plan that ran (a finite time)."""
    if not isinstance(entry, dict):
        return "an entry is not an object"
    for name, spec in ENTRY_FIELDS[kind(key)].items():
        if name not in entry:
            if spec.required:
                return f"{name!r} is missing"
        elif (reason := spec.check(entry[name])) is not None:
            return f"{name!r} {reason}"
    if key.startswith(PLAN):
        held = [name for name in _VERDICT if name in entry]
        if held and len(held) != len(_VERDICT):
            return f"a verdict without {next(n for n in _VERDICT if n not in entry)!r}"
        if held and entry["chosen"] not in entry["plans"]:
            return "'chosen' names no plan it timed"
        if all(v == float("inf") for v in entry["plans"].values()):
            return "'plans' has no plan that ran"
    return None


# ---- the file --------------------------------------------------------------------------------
@dataclass
class TimingCache:
    """Tactic and plan timings on disk, one JSON file per CPU (see the module's docstring).

    version: the built-in kernels' (timing_version()); entries of another are dropped when
    read and when written. None keeps every version.

    >>> cache = TimingCache(cpu_key(), version=timing_version()).load()
    >>> cache.put({key: {"times": {"nchw-winograd": 2.1e-05, "onnxruntime": 3e-05}}})
    """

    cpu: str
    folder: Path = field(default_factory=cache_dir)
    entries: dict = field(default_factory=dict)
    version: str | None = None

    @property
    def path(self) -> Path:
        return self.folder / f"tactics-{hashlib.sha1(self.cpu.encode()).hexdigest()[:12]}.json"

    def load(self) -> TimingCache:
        self.entries = self._read()
        return self

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, new: dict) -> None:
        """Add entries and write them, merged with what other processes wrote meanwhile, and
        bounded. A cache that cannot be written is skipped silently: it only saves time."""
        fresh = {key: {**entry, "written": int(time.time())} for key, entry in new.items()}
        self.entries.update(fresh)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = _open_regular(self.folder / LOCK, os.O_RDWR | os.O_CREAT)
        except NotRegular as exc:
            message = f"timing cache lock {self.folder / LOCK} is {exc}; the cache is not written"
            _warn_once(self.folder / LOCK, "kind", message)
            return
        except OSError:
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = _newest({**self._read(), **fresh}, fresh)
            data = {"format": CACHE_FORMAT, "cpu": self.cpu, "entries": merged}
            write_atomic(self.path, json.dumps(data, indent=0, sort_keys=True).encode())
            self.entries = merged
        except (OSError, FusionError):  # FusionError: its name is taken (a folder, a FIFO)
            pass
        finally:
            os.close(lock)

    def _read(self) -> dict:
        """The sound entries of this version on disk: none when the file is missing or cannot
        be used."""
        problem = None
        try:
            with open(_open_regular(self.path, os.O_RDONLY), "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                problem = "corrupt", "is corrupt (unknown format); ignored"
            elif not isinstance(data.get("entries"), dict):
                problem = "corrupt", "is corrupt (no entries); ignored"
            elif data.get("cpu") != self.cpu:
                problem = "cpu", f"was written on another CPU ({data.get('cpu')!r}); ignored"
        except FileNotFoundError:
            return {}
        except NotRegular as exc:
            problem = "kind", f"is {exc}; ignored"
        except OSError as exc:
            problem = "unreadable", f"is unreadable ({exc.strerror or one_line(exc)}); ignored"
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            problem = "corrupt", f"is corrupt ({one_line(exc)}); ignored"
        if problem is not None:
            _warn_once(self.path, problem[0], f"timing cache {self.path} {problem[1]}")
            return {}
        return self._sound(data["entries"])

    def _sound(self, entries: dict) -> dict:
        """The entries of this version that fit their schema; one warning per kind of damage,
        with how many entries it cost."""
        sound, damaged = {}, Counter()
        for key, entry in entries.items():
            if self.version is not None and builtin_version(key) != self.version:
                continue  # timed with other kernels: dropped, no key of this code can hit it
            reason = damage(key, entry)
            if reason is None:
                sound[key] = entry
            else:
                damaged[reason] += 1
        for reason, n in damaged.items():
            what = "entry" if n == 1 else "entries"
            message = f"timing cache {self.path}: {n} damaged {what} dropped ({reason})"
            _warn_once(self.path, reason, message)
        return sound


def _newest(entries: dict, fresh: dict) -> dict:
    """At most MAX_ENTRIES of `entries`: the fresh ones, then the most recently written (an
    entry from before `written` existed counts as the oldest)."""
    if len(entries) <= MAX_ENTRIES:
        return entries
    order = sorted(entries, key=lambda k: (k in fresh, entries[k].get("written", 0), k))
    return {k: entries[k] for k in order[-MAX_ENTRIES:]}


class NotRegular(OSError):
    """A path that is not a regular file; its message says what it is."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _open_regular(path: Path, flags: int) -> int:
    """A descriptor of the regular file `path`, opened without following a symbolic link or
    waiting for a FIFO's other end (NotRegular says what else it is)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a symbolic link
            raise NotRegular("not a regular file (a symbolic link)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "a device")
        raise NotRegular(f"not a regular file ({kind})")
    return fd


_WARNED: set[tuple[str, str]] = set()  # (file, problem) this process has warned about


def _warn_once(path: Path, problem: str, message: str) -> None:
    """Warn about a problem of a cache file once per process: every session, load and merge
    before a write would meet it again."""
    if (str(path), problem) not in _WARNED:
        _WARNED.add((str(path), problem))
        warnings.warn(message, FusionWarning, stacklevel=3)


def plan_key(model_digest: str, shapes: Sequence, threads: int, version: str) -> str:
    """What a whole-plan timing depends on: the fused model without its weights' bytes (a
    digest of its graph, fused nodes and islands), its input shapes, threads, the kernels'
    source (`version`, timing_version(): the last field)."""
    dims = ";".join("-" if s is None else "x".join(map(str, s)) for s in shapes)
    return f"{PLAN}{model_digest}|{dims}|t{threads}|{version}"


def convert_key(shape: Sequence[int], block: int, threads: int, version: str) -> str:
    """What a layout conversion's timing depends on: the NCHW shape, the block, threads, the
    kernels' source."""
    return f"{CONVERT}{'x'.join(map(str, shape))}|b{block}|t{threads}|{version}"


def node_key(node: onnx.NodeProto, shapes: Sequence, threads: int, version: str,
             constants: Sequence = ()) -> str:  # fmt: skip
    """What a tactic timing depends on: the node's computation (its function's content hash
    names its body, attributes included), its input shapes, the shapes of its constant inputs
    (`constants`, by position: an array or None), threads, the kernels' source (`version`,
    timing_version(): the last field). A body names its weights as inputs, not their shapes:
    RegNet's 208 -> 208 and 208 -> 440 1x1 convs at 14 x 14 share one body and one input
    shape, and without their weights' shapes in the key one took the other's timings, of
    tactics it does not even have (bench/NOTES.md, "Timings keyed by the weights' shapes")."""
    consts = list(constants) + [None] * (len(shapes) - len(constants))
    dims = ";".join(
        "-" if s is None and c is None
        else "c" + "x".join(map(str, c.shape)) if s is None
        else "x".join(map(str, s))
        for s, c in zip(shapes, consts, strict=True)
    )  # fmt: skip
    return f"{node.domain}.{node.op_type}:{node.overload}|{dims}|t{threads}|{version}"
