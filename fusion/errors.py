"""The errors every layer may raise: bad user input, a rule or catalog that cannot work, a
kernel that failed or returned what its node does not declare; and the warning for what the
tool works around (the CLI prints it as `fusion: warning: ...`).

All are one-line messages: the CLI prints them as `fusion: error: ...` and exits 2.
"""


class FusionError(Exception):
    """A problem with the user's input, reported as one line (exit code 2 on the CLI)."""


class CatalogError(ValueError):
    """A rule or catalog that cannot work, with the reason."""


class KernelError(CatalogError):
    """A kernel raised, or returned outputs that do not fit its fused node (count, dtype, rank,
    a declared size). `node` is the fused node's label: verify reports it as the node at
    fault, and a rewrite with --verify rolls that fusion back."""

    def __init__(self, message: str, node: str = "", name: str = ""):
        super().__init__(message)
        self.node, self.name = node, name  # the node's label and name


class FusionWarning(UserWarning):
    """Something the tool worked around and the user should know (one line)."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (checker messages span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:limit]
