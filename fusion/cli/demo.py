"""`fusion demo`: build the built-in example, rewrite it, verify it and time it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fusion.bench.compare import compare
from fusion.cli.inputs import check_writes, positive_int
from fusion.cli.rewrite import rewrite_file
from fusion.cli.verify import verify_files
from fusion.modelfile import save_model
from fusion.models import conv_stack

NAME, HELP = "demo", "build an example model, rewrite it, verify and time it"


def add_arguments(p) -> None:
    p.add_argument("--dir", help="where to write the example files (default: a temp folder)")
    p.add_argument("--threads", type=positive_int, default=None, help="threads for the timing runs")


def execute(args) -> int:
    return run_demo(args.dir, threads=args.threads)


def run_demo(folder: str | None = None, threads: int | None = None) -> int:
    folder = Path(folder or tempfile.mkdtemp(prefix="fusion-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    original, fused = folder / "conv_stack.onnx", folder / "conv_stack.fused.onnx"
    check_writes({"the example": original, "the fused example": fused})
    save_model(conv_stack(blocks=4, channels=64, size=56, form="tf"), original)
    print(f"example: 4 x (3x3 Conv, 64 channels, 56x56) + Add(bias) + Relu -> {original}")
    code = rewrite_file(original, fused, verbose=True) or verify_files(original, fused)
    if code:
        return code
    print(compare(original, threads=threads, rounds=20).table())
    return 0
