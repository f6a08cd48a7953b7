"""The progress bar of the commands that compile kernels or warm up runners (run, tune, bench).

Drawn on an interactive terminal only. Elsewhere (a pipe, a log file, a test) it writes nothing:
rich ends even an invisible bar with a newline, which would make every error message of such a
command two lines (a blank one, then `fusion: error: ...`). FORCE_COLOR and TTY_COMPATIBLE make
rich treat any file as a terminal; a bar is still only drawn where the file itself is a tty.
"""

from __future__ import annotations

import contextlib


def progress_bar(console, *columns):
    """A transient rich Progress on `console` (with rich's default columns, or `columns`),
    disabled unless that is an interactive tty.

    >>> with progress_bar(Console(stderr=True)) as bar:
    ...     task = bar.add_task("preparing kernels", total=None)
    """
    from rich.progress import Progress  # heavy: only for the commands that show progress

    return Progress(*columns, console=console, transient=True, disable=not _draws(console))


def _draws(console) -> bool:
    if not console.is_interactive:
        return False
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no isatty, or closed
        return console.file.isatty()
    return False
