"""The two errors every layer may raise: bad user input, and a rule or catalog that cannot work.

Both are one-line messages: the CLI prints them as `fusion: error: ...` and exits 2.
"""


class FusionError(Exception):
    """A problem with the user's input, reported as one line (exit code 2 on the CLI)."""


class CatalogError(ValueError):
    """A rule or catalog that cannot work, with the reason."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (checker messages span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:limit]
