"""`fusion demo`: build the built-in example, rewrite it, verify it and time it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fusion.examples import conv_stack
from fusion.io import save_model


def run_demo(folder: str | None = None, threads: int | None = None) -> int:
    from fusion.cli import main as cli

    folder = Path(folder or tempfile.mkdtemp(prefix="fusion-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    original, fused = folder / "conv_stack.onnx", folder / "conv_stack.fused.onnx"
    save_model(conv_stack(blocks=4, channels=64, size=56, form="tf"), original)
    print(f"example: 4 x (3x3 Conv, 64 channels, 56x56) + Add(bias) + Relu -> {original}")
    code = cli(["rewrite", str(original), "-o", str(fused), "-v"])
    if code:
        return code
    code = cli(["verify", str(original), str(fused)])
    if code:
        return code
    return _time(original, threads)


def _time(original: Path, threads: int | None) -> int:
    from fusion.timing import compare

    print(compare(original, threads=threads, rounds=20).table())
    return 0
