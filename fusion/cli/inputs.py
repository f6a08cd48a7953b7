"""What several subcommands read from their arguments: model files, --input, pattern names."""

from __future__ import annotations

import onnx

from fusion.errors import FusionError
from fusion.modelfile import read_model, run_checker


def add_input_argument(parser, help: str = "NAME=FILE.npy (repeatable) or FILE.npz") -> None:
    parser.add_argument("--input", action="append", help=help)


def input_files(items: list[str] | None):
    """--input NAME=FILE.npy (repeatable) or one FILE.npz / FILE.npy, as fusion.feeds takes it."""
    if not items:
        return None
    if len(items) == 1 and "=" not in items[0]:
        return items[0]
    feeds = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise FusionError(f"--input {item}: expected NAME=FILE.npy")
        feeds[name] = path
    return feeds


def pattern_names(text: str) -> list[str]:
    """--only / --exclude: comma-separated pattern names."""
    return [n.strip() for n in text.split(",") if n.strip()]


def load_checked(path) -> onnx.ModelProto:
    """A model file read and checked (structure only: a fused model may be run or verified)."""
    model = read_model(path)[0]
    run_checker(model, full=False, what=str(path))
    return model
