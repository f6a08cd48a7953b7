"""The `fusion` command line. Exit codes: 0 success, 1 a check failed, 2 bad input or usage."""

from __future__ import annotations

import argparse
import sys

from fusion.cli import bench, demo, match, patterns, rewrite, run, verify
from fusion.errors import CatalogError, FusionError, one_line
from fusion.ort import is_ort_error, ort_error_line
from fusion.registry import load_plugin

# each has NAME, HELP, add_arguments, execute
COMMANDS = (rewrite, match, run, verify, patterns, demo, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion", description="Pattern fusion for ONNX models.")
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
    args = parser.parse_args(argv)
    try:
        for plugin in args.plugin:
            load_plugin(plugin)
        return args.func(args)
    except (FusionError, CatalogError) as exc:
        if args.debug:
            raise
        print(f"fusion: error: {one_line(exc, limit=1000)}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
