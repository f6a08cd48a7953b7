"""The `fusion` command line: `main` (parser, error handling, exit codes) and one module per
subcommand (rewrite, match, run, tune, verify, patterns, demo, bench), each with NAME, HELP,
add_arguments(parser) and execute(args) -> exit code. Shared input parsing is in inputs; the
progress bar (on a terminal only) in progress."""

from fusion.cli.main import main

__all__ = ["main"]
