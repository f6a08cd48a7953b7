"""The `fusion` command line. Exit codes: 0 success, 1 a check failed, 2 bad input or usage
(one line on stderr), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). An interruption or
termination unwinds like an error, so every temporary file is removed."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import warnings

from fusion.cli import bench, demo, match, patterns, rewrite, run, tune, verify
from fusion.errors import CatalogError, FusionError, FusionWarning, one_line
from fusion.feeds import InputsNeeded
from fusion.ort import is_ort_error, ort_error_line
from fusion.registry import load_plugin

# each has NAME, HELP, add_arguments, execute
COMMANDS = (rewrite, match, run, tune, verify, patterns, demo, bench)


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so that `finally` blocks clean up (as Ctrl-C)."""


class UsageError(Exception):
    """A command line the parser refuses (argparse would print its usage, then exit)."""


class Parser(argparse.ArgumentParser):
    """argparse, its errors as every other error of the CLI: one line, exit 2."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fusion", description="Pattern fusion for ONNX models.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    common.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE.py",
        help="a Python file that registers patterns (repeatable)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, parents=[common])
        command.add_arguments(p)
        p.set_defaults(func=command.execute)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"fusion: error: {exc}", file=sys.stderr)
        return 2
    with _terminate_cleanly(), warnings.catch_warnings():
        warnings.simplefilter("default", FusionWarning)  # shown once each, as one line
        warnings.showwarning = _show_warning
        try:
            for plugin in args.plugin:
                load_plugin(plugin)
            return args.func(args)
        except (FusionError, CatalogError) as exc:
            if args.debug:
                raise
            message = one_line(_in_cli_words(exc, args), limit=1000)
            print(f"fusion: error: {message}", file=sys.stderr)
            return 2
        except MemoryError as exc:  # what the checks of sizes (fusion.feeds) could not foresee
            if args.debug:
                raise
            print(f"fusion: error: out of memory ({one_line(exc)})", file=sys.stderr)
            return 2
        except OSError as exc:  # reading or writing a file the checks above could not foresee
            if args.debug:
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"fusion: error: {where}{exc.strerror or one_line(exc)}", file=sys.stderr)
            return 2
        except Exception as exc:
            if args.debug or not is_ort_error(exc):
                raise
            print(f"fusion: error: onnxruntime: {ort_error_line(exc)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("fusion: interrupted", file=sys.stderr)
            return 130
        except Terminated:
            print("fusion: terminated", file=sys.stderr)
            return 143


@contextlib.contextmanager
def _terminate_cleanly():
    """While a command runs, SIGTERM raises Terminated (Python's default would end the process
    at once, leaving a half-written temporary file behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def terminate(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _in_cli_words(exc: Exception, args) -> Exception | str:
    """An error as a command-line user reads it: an input that needs values names --input
    (the library's message names the Python API's inputs=)."""
    if not isinstance(exc, InputsNeeded):
        return exc
    if hasattr(args, "input"):
        return f"input {exc.name!r} {exc.reason}; give its values: --input {exc.name}=FILE.npy"
    return f"input {exc.name!r} {exc.reason}, and fusion {args.command} only makes random inputs"


def _show_warning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, FusionWarning):
        print(f"fusion: warning: {one_line(message, limit=1000)}", file=sys.stderr)
    else:
        print(warnings.formatwarning(message, category, filename, lineno, line), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
