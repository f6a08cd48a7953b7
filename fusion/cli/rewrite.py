"""`fusion rewrite IN -o OUT`: fuse the catalog's patterns in a file, never touching the input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fusion.cli.inputs import (
    add_input_argument,
    beyond_the_checker,
    check_writes,
    input_files,
    pattern_names,
)
from fusion.coverage import coverage
from fusion.errors import FusionError, one_line
from fusion.files import same_file, write_atomic
from fusion.modelfile import read_model, require_valid, run_checker, save_model, write_model_bytes
from fusion.ort import REFERENCE, inference_session
from fusion.registry import default_catalog
from fusion.rewriter import rewrite
from fusion.verify import rollback

NAME, HELP = "rewrite", "fuse the catalog's patterns in an ONNX file"


def add_arguments(p) -> None:
    p.add_argument("model", help="input .onnx file (never modified unless --in-place)")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--only", type=pattern_names, help="comma-separated pattern names to use")
    p.add_argument("--exclude", type=pattern_names, help="comma-separated pattern names to skip")
    p.add_argument("--explain", action="store_true", help="print why near-misses were not fused")
    p.add_argument("--report", help="write a JSON report to this file")
    p.add_argument("--in-place", action="store_true", help="allow OUTPUT to be the input file")
    p.add_argument("-v", "--verbose", action="store_true", help="list every fused node")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check each fused node against onnxruntime and undo the ones that disagree",
    )
    p.add_argument(
        "--rnn-as-standard-op",
        action="store_true",
        help="write fused unrolled LSTM chains as the standard ONNX LSTM op, not as functions "
        "(plain onnxruntime then runs them at its native op's speed)",
    )
    add_input_argument(p, help="inputs for --verify (NAME=FILE.npy)")


def execute(args) -> int:
    return rewrite_file(
        args.model,
        args.output,
        only=args.only or (),
        exclude=args.exclude or (),
        explain=args.explain,
        report=args.report,
        in_place=args.in_place,
        verbose=args.verbose,
        verified=args.verify,
        inputs=args.input,
        standard_ops=args.rnn_as_standard_op,
    )


def rewrite_file(
    model,
    output,
    only=(),
    exclude=(),
    explain: bool = False,
    report=None,
    in_place: bool = False,
    verbose: bool = False,
    verified: bool = False,
    inputs: list[str] | None = None,
    standard_ops: bool = False,
) -> int:
    """Rewrite the file `model` into `output` and print what was fused; the exit code."""
    src, dst = Path(model), Path(output)
    if same_file(dst, src) and not in_place:
        raise FusionError(f"{dst}: output is the input file; pass --in-place to overwrite it")
    writes = {"the output": dst, "--report": report}
    replacing = {"the output": src} if in_place else None
    models = ("the output",)
    check_writes(writes, src, (), inputs, replacing, models)  # before reading a large model
    original, data_files = read_model(src)
    check_writes(writes, src, data_files, inputs, replacing, models)  # and its external data
    checked = require_valid(original, str(src), source=src)
    catalog = default_catalog().select(only, exclude)
    with beyond_the_checker(src, checked):
        result = rewrite(original, catalog, standard_ops=standard_ops and not verified)
        if verified and result.fusions:
            feeds = input_files(inputs)
            done = rollback(original, result, catalog, feeds, standard_ops=standard_ops)
            print(done)
            result = done.result
            if not done.ok:
                return 1
    keep = () if in_place else data_files  # what the old output named and the input still reads
    if result.fusions:
        try:
            _require_same_validity(result.model, original, checked)
        except FusionError as exc:  # our bug, not the user's input: do not write it
            print(f"fusion: internal error: {exc}", file=sys.stderr)
            return 1
        save_model(result.model, dst, external=bool(data_files), keep=keep)
    elif data_files:
        save_model(original, dst, external=True, keep=keep)
    elif not same_file(dst, src):  # nothing to fuse: the output is the input, byte for byte
        write_model_bytes(dst, src.read_bytes(), keep=keep)
    _print_rewrite(result, verbose)
    cover = coverage(original, catalog, result) if explain or report else None
    if explain:
        print(result.explain())
        print(cover)
    if report:
        data = {**result.to_dict(), "coverage": cover.to_dict()}
        write_atomic(report, (json.dumps(data, indent=2) + "\n").encode())
    return 0


def _require_same_validity(fused, original, checked: bool) -> None:
    """The rewritten model passes what the input passed: the checker (full when the input
    passes the full check), or, for an input only onnxruntime accepts, onnxruntime."""
    if checked:
        run_checker(fused, full=_passes_full_check(original), what="the rewritten model")
        return
    try:
        inference_session(fused, REFERENCE, threads=1)
    except Exception as exc:
        raise FusionError(f"onnxruntime cannot load the rewritten model: {one_line(exc)}") from None


def _passes_full_check(model) -> bool:
    try:
        run_checker(model, full=True, what="input")
        return True
    except FusionError:
        return False


def _print_rewrite(result, verbose: bool) -> None:
    total = sum(result.counts().values())
    counts = ", ".join(f"{name}: {n}" for name, n in result.counts().items())
    print(f"{total} fusion{'s' if total != 1 else ''}" + (f" ({counts})" if counts else ""))
    if result.standard:
        print(f"written as standard ONNX ops: {', '.join(f.node for f in result.standard)}")
    if verbose:
        for f in result.fusions:
            print(f"  {f.rule} {f.node} <- {', '.join(f.replaced)}")
