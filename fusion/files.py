"""Files the tool writes: never one it reads, never half written, with the modes users expect.

Before any work, every command names the files it will write and the files it reads, and
`check_outputs` refuses, with one line, a write that is the same file as a read or as another
write, or one whose folder is missing or not writable. "The same file" is file identity
(st_dev, st_ino): a symlink, a hard link or a bind mount of an input is that input.

Writes are atomic: the bytes go to a temporary file beside the target, flushed to disk, then
renamed over it. A new file gets the mode the umask allows (0666 & ~umask, as open() gives);
a replaced file keeps its mode. An interruption (Ctrl-C, or SIGTERM, which the CLI turns into
the same clean exit) removes the temporary file.

    check_outputs({"output": "out.onnx", "--report": "r.json"}, {"in.onnx": "the input file"})
    write_atomic("r.json", b"{}")
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from fusion.errors import FusionError

PathLike = str | os.PathLike


def check_outputs(
    writes: Mapping[str, PathLike | None],
    reads: Mapping[PathLike, str],
    replacing: Mapping[str, PathLike] | None = None,
) -> None:
    """Refuse, before any work, writes that would destroy a read file or cannot be made.

    writes: label (as the user wrote the option: "output", "--report") -> path, None skipped.
    reads: path -> what it is, for the message ("the input file m.onnx").
    replacing: label -> the one read file that write may replace (rewrite's --in-place).

    >>> check_outputs({"-o": "out.npz"}, {"m.onnx": "the model m.onnx"})
    """
    replacing = replacing or {}
    seen: dict[str, tuple[str, os.stat_result | None]] = {}
    for label, target in writes.items():
        if target is None:
            continue
        writable_folder(target)
        identity = _identity(target)
        for read, what in reads.items():
            if identity is None or not _same(identity, _identity(read)):
                continue
            allowed = replacing.get(label)
            if allowed is not None and _same(identity, _identity(allowed)):
                continue
            raise FusionError(f"{target}: {label} would overwrite {what}")
        for other, (other_label, other_identity) in seen.items():
            same_path = Path(other).resolve() == Path(target).resolve()
            if same_path or (identity is not None and _same(identity, other_identity)):
                raise FusionError(f"{target}: {label} and {other_label} are the same file")
        seen[str(target)] = (label, identity)


def same_file(a: PathLike, b: PathLike) -> bool:
    """Both exist and are one file (a symlink, hard link or bind mount of the other)."""
    return _same(_identity(a), _identity(b))


def _identity(path: PathLike) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _same(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def writable_folder(path: PathLike) -> Path:
    """The folder `path` would be written in; FusionError when it cannot be."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise FusionError(f"{path}: is a directory; give a file name to write")
    if path.exists() and not path.is_file():
        raise FusionError(f"{path}: not a regular file (a device or a pipe); cannot replace it")
    if not folder.exists():
        raise FusionError(f"{path}: the output directory {folder} does not exist")
    if not folder.is_dir():
        raise FusionError(f"{path}: cannot write there, {folder} is a file, not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FusionError(f"{path}: the output directory {folder} is not writable")
    return folder


def write_atomic(path: PathLike, data: bytes) -> None:
    """`data` to `path`, all or nothing."""
    with atomic_temp(Path(path)) as tmp, open(tmp, "wb") as f:
        f.write(data)
        synced(f)


@contextlib.contextmanager
def atomic_temp(path: Path, mode_of: Path | None = None) -> Iterator[str]:
    """A temporary file beside `path`, renamed to `path` if the block succeeds, else removed.

    Its mode: that of the file it replaces (or of `mode_of`, when that exists), else what the
    umask allows a new file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=writable_folder(path))
    try:
        try:
            os.fchmod(fd, file_mode(path, mode_of))
        finally:
            os.close(fd)  # once: a second close could close a number another thread reused
        yield tmp
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def file_mode(path: Path, mode_of: Path | None = None) -> int:
    """The permission bits a file written at `path` gets: those of the file it replaces (or of
    `mode_of`), else 0666 less the umask."""
    for existing in (path, mode_of):
        if existing is not None and existing.is_file():
            return stat.S_IMODE(existing.stat().st_mode)
    return 0o666 & ~umask()


def umask() -> int:
    """The process's umask (read from /proc where it can be: setting it is process-wide)."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def synced(f) -> None:
    """Flush an open file to disk: a rename must never publish bytes still in the page cache
    (after a power cut, the new name could hold nothing)."""
    f.flush()
    os.fsync(f.fileno())


def sync_folder(folder: Path) -> None:
    """Make the renames in `folder` durable."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
