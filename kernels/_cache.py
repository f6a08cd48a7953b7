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

import functools
import hashlib
import os
import re
from pathlib import Path

from numba.core import caching

PACKAGE = Path(__file__).resolve().parent
NAME = __name__.rpartition(".")[0]  # "kernels"
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

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    def get_source_stamp(self):
        return source_stamp(self._path)

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


def install() -> None:
    """Put PackageLocator first among Numba's cache locators, and serialize cache saves
    (once)."""
    if PackageLocator not in _IMPL._locator_classes:
        _IMPL._locator_classes.insert(0, PackageLocator)
    serialize_saves()
