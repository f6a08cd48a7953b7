"""Numba's on-disk cache for the functions of this package, fresh while their source is.

Numba stamps a cached function with a hash of its own source file only. A kernel compiles in
the functions it calls from other files (kernels/simd's exp, _gemm's panel_sum, epilogue's
activate_rows in _depthwise_blocked), so after a change to one of those alone it went on loading
the old machine code
from the cache. Here a function's stamp is a hash of its module and of every module of the
package that module imports, directly or not (parent packages included: their __init__ runs
too), read from the import statements of the source: a change anywhere in what a kernel can
call makes it compile again, and a change elsewhere (pool.py for a conv) does not.

The folder is the one Numba's own locators pick (NUMBA_CACHE_DIR, __pycache__ beside the
source, the user's cache folder): PackageLocator wraps the first that takes the function and
only replaces its stamp. install() puts it first in Numba's list; kernels.config calls it, so
it is in place before any kernel is decorated.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import time
from pathlib import Path

from numba.core import caching, dispatcher

PACKAGE = Path(__file__).resolve().parent
NAME = __name__.rpartition(".")[0]  # "fusion_kernels" (the kernels/ folder, installed)
_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # Numba < 0.61: private


def module_file(name: str) -> Path | None:
    """The file of module `name` of this package (a package's __init__.py), else None."""
    parts = name.split(".")
    if parts[0] != NAME:
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _module_name(path: Path) -> str:
    parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# `from X import a, b` (names in parentheses over several lines too) and `import X`: read with
# a pattern rather than parsed (every process stamps every kernel module: ast.parse of them all
# costs start-up time, bench/NOTES.md). A match in a docstring or comment can only add a
# module, never lose one.
_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.M)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w.]+(?:[ \t]*,[ \t]*[\w.]+)*)", re.M)


@functools.cache
def imported(path: Path) -> frozenset[Path]:
    """The files of the package's modules that the module at `path` imports anywhere in its
    source (functions included), with the parent packages of each."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    text = path.read_text()
    targets = [t.strip() for m in _IMPORT.finditer(text) for t in m.group(1).split(",")]
    for m in _FROM.finditer(text):
        base = m.group(1).lstrip(".")
        level = len(m.group(1)) - len(base)
        if level:
            anchor = package.split(".")[: len(package.split(".")) - level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        targets.append(base)
        names = re.sub(r"#[^\n]*", "", m.group(2))  # comments inside a parenthesized list
        targets += [f"{base}.{w}" for w in re.findall(r"\w+", names)]
    names = set()
    for target in targets:
        parts = target.split(".")
        names.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return frozenset(f for f in map(module_file, names) if f is not None and f != path)


@functools.cache
def source_stamp(path: Path) -> str:
    """A hash of the module at `path` and of every module of the package it imports, directly
    or through others: what a function of that module may compile in."""
    seen, todo = {path}, [path]
    while todo:
        for dep in imported(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    digest = hashlib.sha256()
    for file in sorted(seen):
        digest.update(_file_digest(file))
    return digest.hexdigest()


@functools.cache
def _file_digest(path: Path) -> bytes:
    """A hash of one file's place in the package and its bytes."""
    data = path.read_bytes()
    return hashlib.sha256(f"{path.relative_to(PACKAGE).as_posix()}\0".encode() + data).digest()


class PackageLocator(caching._CacheLocator):
    """Numba's locator for a function of this package, with source_stamp as its stamp."""

    def __init__(self, inner, path: Path):
        self._inner, self._path = inner, path
        self._py_file = str(path)  # what Numba's warning about an uncachable function names

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_disambiguator(self):
        # the package's import name in the cache files' names: an index pickles the types of
        # its signatures with their modules' names, and one written when kernels/ was imported
        # as `kernels` imported that second copy of the package when it was read
        return f"{NAME}-{self._inner.get_disambiguator()}"

    def get_source_stamp(self):
        stamp = source_stamp(self._path)
        _STAMPS.add(stamp)  # this package's cache files: the ones that take claims
        return stamp

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if PACKAGE not in path.parents or not path.is_file():
            return None
        for other in _IMPL._locator_classes:
            inner = None if other is cls else other.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner, path)
        return None


def serialize_saves() -> None:
    """Numba saves a cache entry by reading the function's index, adding the entry and writing
    the index back, with no lock: two processes adding different signatures of one function
    at the same time can leave the index naming the other's machine code (numba#4807), and a
    kernel then computes with another tile's code (seen: test workers at 8 lanes, every
    register tile's work item in one closure's index). Saves take a file lock in the cache's
    folder, in every process (where fcntl exists: Unix)."""
    try:
        import fcntl
    except ImportError:  # Windows: one process per cache folder (README)
        return
    save = caching.IndexDataCacheFile.save
    if getattr(save, "locked", False):
        return

    def locked_save(self, key, data):
        with open(os.path.join(self._cache_path, ".kernels-cache.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return save(self, key, data)

    locked_save.locked = True
    caching.IndexDataCacheFile.save = locked_save


# ---- one compile per signature across processes ---------------------------------------------
# Two processes that miss the cache on the same function and signature at once (the session
# and its compile helper, fusion/runtime/precompile.py; two test workers) each compiled it:
# seconds of a cold start spent twice (inverted_residual_blocked alone takes ~12 s). Here a
# process that misses first claims the entry (a file in the cache folder, created exclusively,
# holding its pid) and compiles; another that misses while the claim stands waits for it to go
# (saved: it then loads the entry) instead of compiling, unless the claimer has died, the
# claim is older than CLAIM_STALE_S (a compile that failed in a process still running), or it
# has waited CLAIM_WAIT_S: then it compiles too, as without claims.
CLAIM_STALE_S = 60.0  # the longest single compile seen is ~12 s (a reused pid waits this long)
CLAIM_EMPTY_S = 5.0  # a claim still without its pid after this: its writer died
CLAIM_WAIT_S = 300.0
CLAIM_POLL_S = 0.02
_HELD: list[str] = []  # this process's claims, oldest first
_STAMPS: set[str] = set()  # the source stamps of this package's functions (PackageLocator)


def claim_path(folder: str, index_name: str, key) -> str:
    """The claim file of cache entry `key` of the index `index_name` in `folder`."""
    digest = hashlib.sha256(f"{index_name}\0{key!r}".encode()).hexdigest()[:40]
    return os.path.join(folder, f".claim-{digest}")


def _claimer(path: str) -> tuple[int, float] | None:
    """(pid, age in seconds) of the claim at `path`, pid 0 while it is being written (or its
    writer died before writing it); None when there is none."""
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    try:
        return int(text or 0), age
    except ValueError:
        return 0, age


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def claim_or_wait(path: str, load):
    """The entry, loaded (load() -> data or None) once another process that claimed it has
    saved it; or None after claiming it here (this process compiles it, release() after)."""
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        except OSError:  # a read-only cache folder, say: no claims, compile as before
            return None
        else:
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            _HELD.append(path)
            return None
        owner = _claimer(path)
        if owner is not None:
            pid, age = owner
            gone = pid == os.getpid() or not _alive(pid) or age > CLAIM_STALE_S
            abandoned = age > CLAIM_EMPTY_S if pid == 0 else gone
            if abandoned:  # ours (a failed compile), or its claimer gone: take it over
                release(path, force=True)
                if os.path.exists(path):  # not ours to remove (another user's, a read-only
                    return None  # folder): compile without a claim, as before claims
                continue
        if time.monotonic() > deadline:
            return None
        time.sleep(CLAIM_POLL_S)
        data = load()
        if data is not None:
            return data


def release(path: str, force: bool = False) -> None:
    """Remove a claim this process holds (any claim at `path` with force)."""
    if path in _HELD:
        _HELD.remove(path)
    elif not force:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)


def claim_compiles() -> None:
    """Numba's cache misses claim their entry, saves release it, and a compile that raises
    releases the claims it made (once per process)."""
    load, save = caching.IndexDataCacheFile.load, caching.IndexDataCacheFile.save
    if getattr(load, "claims", False) or os.name != "posix":  # pids and O_EXCL files: POSIX
        return

    def claiming_load(self, key):
        data = load(self, key)
        if data is not None or self._source_stamp not in _STAMPS:  # another package's: as is
            return data
        path = claim_path(self._cache_path, self._index_name, key)
        return claim_or_wait(path, lambda: load(self, key))

    def releasing_save(self, key, data):
        try:
            return save(self, key, data)
        finally:
            release(claim_path(self._cache_path, self._index_name, key))

    compile_ = dispatcher.Dispatcher.compile

    def releasing_compile(self, sig):
        held = len(_HELD)
        try:
            return compile_(self, sig)
        except BaseException:
            for path in _HELD[held:]:
                release(path)
            raise

    claiming_load.claims = True
    caching.IndexDataCacheFile.load = claiming_load
    caching.IndexDataCacheFile.save = releasing_save
    dispatcher.Dispatcher.compile = releasing_compile


def install() -> None:
    """Put PackageLocator first among Numba's cache locators, serialize cache saves, and claim
    the entries this process compiles (once)."""
    if PackageLocator not in _IMPL._locator_classes:
        _IMPL._locator_classes.insert(0, PackageLocator)
    serialize_saves()
    claim_compiles()
