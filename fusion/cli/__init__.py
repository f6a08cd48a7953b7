"""The `fusion` command line: `main` (parser, error handling, exit codes) and one module per
subcommand (rewrite, run, verify, patterns, demo, bench), each with NAME, HELP,
add_arguments(parser) and execute(args) -> exit code. Shared input parsing is in inputs."""

from fusion.cli.main import main

__all__ = ["main"]
