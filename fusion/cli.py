"""The `fusion` command line. Exit codes: 0 success, 1 a check failed, 2 bad input or usage."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from fusion.bench import add_bench_arguments
from fusion.catalog import CatalogError, default_catalog
from fusion.io import (
    FusionError,
    check_model,
    is_runtime_error,
    one_line,
    read_model,
    runtime_reason,
    save_model,
    writable_folder,
    write_atomic,
)
from fusion.registry import load_plugin


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def cmd_rewrite(args) -> int:
    src, dst = Path(args.model), Path(args.output)
    if dst.resolve() == src.resolve() and not args.in_place:
        raise FusionError(f"{dst}: output is the input file; pass --in-place to overwrite it")
    writable_folder(dst)  # before the work, not after it
    if args.report:
        if Path(args.report).resolve() == dst.resolve():
            raise FusionError(f"{args.report}: --report and the output are the same file")
        _refuse_overwriting(Path(args.report), src, "--report")
        writable_folder(args.report)
    model, data_files = read_model(src)
    check_model(model, full=False, what=str(src))
    _refuse_overwriting(dst, src, "output", data_files, in_place=args.in_place)
    from fusion.rewriter import rewrite

    catalog = default_catalog().select(args.only or (), args.exclude or ())
    result = rewrite(model, catalog)
    if args.verify and result.fusions:
        result = _rewrite_verified(model, result, catalog, args)
    if result.fusions:
        full = _passes_full_check(model)
        try:
            check_model(result.model, full=full, what="the rewritten model")
        except FusionError as exc:  # our bug, not the user's input: do not write it
            print(f"fusion: internal error: {exc}", file=sys.stderr)
            return 1
        save_model(result.model, dst, external=bool(data_files))
    elif data_files:
        save_model(model, dst, external=True)
    else:
        _copy_unchanged(src, dst)
    _print_rewrite(result, args.verbose)
    if args.explain:
        print(result.explain())
    if args.report:
        write_atomic(args.report, (json.dumps(result.to_dict(), indent=2) + "\n").encode())
    return 0


def _refuse_overwriting(target: Path, src: Path, what: str, data_files=(), in_place=False):
    """Writing `target` (and, for a model, its `.data` beside it) must not destroy the input:
    the input file itself (unless --in-place) or an external data file the input reads."""
    if in_place and target.resolve() == src.resolve():
        return  # the user asked to replace the input, weights included
    targets = [target.resolve()]
    if what == "output":
        targets.append(target.resolve().with_name(target.name + ".data"))
    for path in targets:
        if path == src.resolve():
            raise FusionError(f"{target}: the {what} would overwrite the input file {src}")
        if path in data_files:
            raise FusionError(
                f"{target}: the {what} would overwrite {path.name}, where {src} keeps its weights"
            )


def _rewrite_verified(model, result, catalog, args):
    """Check every fused node on a real run; rewrite again without the ones that disagree."""
    from fusion.rewriter import rewrite
    from fusion.verify import verify

    report = verify(model, result.model, inputs=_inputs(args.input), per_node=True, catalog=catalog)
    bad = {}
    for check in report.nodes:
        if not check.ok:
            name = check.node.split(" ", 1)[1]
            bad[name] = f"rolled back: kernel disagrees with onnxruntime on {check.name} " + (
                f"(max abs error {check.max_abs:.3g}, max rel {check.max_rel:.3g})"
            )
    if bad:
        result = rewrite(model, catalog, skip=bad)
        for reason in bad.values():
            print(f"{reason}")
    print(f"verified {len(report.nodes)} fused node outputs against onnxruntime")
    return result


def _inputs(items: list[str] | None):
    """--input NAME=FILE.npy (repeatable) or one FILE.npz / FILE.npy."""
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


def cmd_run(args) -> int:
    import numpy as np

    from fusion.runtime import Session
    from fusion.verify import model_inputs

    if args.output:
        if Path(args.output).resolve() == Path(args.model).resolve():
            raise FusionError(f"{args.output}: the output would overwrite the model {args.model}")
        writable_folder(args.output)
    session = _session(args.model, args.threads)
    feeds, source = model_inputs(session.model, _inputs(args.input), args.seed, None)
    outputs = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    for name, value in zip(names, outputs, strict=True):
        print(f"{name}: {value.dtype} {list(value.shape)}")
    if args.output:
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(names, outputs, strict=True)))
        write_atomic(args.output, buffer.getvalue())
    print(f"inputs: {source}; {Session.__name__} ran {len(session.steps)} steps")
    return 0


def _session(model_path, threads):
    """A fusion.Session, with a progress bar while kernels compile on first use."""
    from rich.progress import Progress

    from fusion.runtime import Session

    with Progress(transient=True) as bar:
        task = bar.add_task("preparing kernels", total=None)

        def progress(name, i, total):
            bar.update(task, total=total, completed=i - 1, description=f"kernel {name}")

        return Session(_load(model_path), threads=threads, progress=progress)


def _load(path):
    """A model file read and checked (structure only: a fused model may be run or verified)."""
    model = read_model(path)[0]
    check_model(model, full=False, what=str(path))
    return model


def cmd_verify(args) -> int:
    from fusion.verify import verify

    original = _load(args.original)
    fused = _load(args.fused) if args.fused else None
    report = verify(
        original,
        fused,
        inputs=_inputs(args.input),
        rtol=args.rtol,
        atol=args.atol,
        per_node=args.per_node,
        seed=args.seed,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok else 1


def _passes_full_check(model) -> bool:
    try:
        check_model(model, full=True, what="input")
        return True
    except FusionError:
        return False


def _copy_unchanged(src: Path, dst: Path) -> None:
    """Nothing to fuse: the output is the input, byte for byte."""
    if dst.resolve() != src.resolve():
        write_atomic(dst, src.read_bytes())


def _print_rewrite(result, verbose: bool) -> None:
    total = sum(result.counts().values())
    counts = ", ".join(f"{name}: {n}" for name, n in result.counts().items())
    print(f"{total} fusion{'s' if total != 1 else ''}" + (f" ({counts})" if counts else ""))
    if verbose:
        for f in result.fusions:
            print(f"  {f.rule} {f.node} <- {', '.join(f.replaced)}")


def cmd_patterns(args) -> int:
    rules = default_catalog().ordered()
    rows = [
        {
            "name": r.name,
            "priority": r.priority,
            "anchors": sorted(r.anchors),
            "matches": r.description,
            "kernel": f"{r.kernel.__module__}.{r.kernel.__qualname__}" if r.kernel else None,
            "inputs": list(r.inputs),
        }
        for r in rules
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fusion catalog (priority order)")
    for column in ("name", "priority", "matches", "kernel"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], str(row["priority"]), row["matches"], row["kernel"] or "-")
    Console().print(table)
    return 0


def cmd_demo(args) -> int:
    from fusion.demo import run_demo

    return run_demo(args.dir, threads=args.threads)


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

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    p = command("rewrite", "fuse the catalog's patterns in an ONNX file")
    p.add_argument("model", help="input .onnx file (never modified unless --in-place)")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--only", type=_names, help="comma-separated pattern names to use")
    p.add_argument("--exclude", type=_names, help="comma-separated pattern names to skip")
    p.add_argument("--explain", action="store_true", help="print why near-misses were not fused")
    p.add_argument("--report", help="write a JSON report to this file")
    p.add_argument("--in-place", action="store_true", help="allow OUTPUT to be the input file")
    p.add_argument("-v", "--verbose", action="store_true", help="list every fused node")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check each fused node against onnxruntime and undo the ones that disagree",
    )
    p.add_argument("--input", action="append", help="inputs for --verify (NAME=FILE.npy)")
    p.set_defaults(func=cmd_rewrite)

    p = command("run", "run a model with fusion.Session")
    p.add_argument("model", help=".onnx file, fused or not (an unfused one is fused in memory)")
    p.add_argument("--input", action="append", help="NAME=FILE.npy (repeatable) or FILE.npz")
    p.add_argument("-o", "--output", help="write the outputs to this .npz file")
    p.add_argument("--threads", type=int, default=None, help="threads (Numba and onnxruntime)")
    p.add_argument("--seed", type=int, default=0, help="seed of random inputs not given")
    p.set_defaults(func=cmd_run)

    p = command("verify", "compare a fused model with the original in onnxruntime")
    p.add_argument("original", help="the original .onnx file")
    p.add_argument("fused", nargs="?", help="the fused file (default: fuse the original)")
    p.add_argument("--input", action="append", help="NAME=FILE.npy (repeatable) or FILE.npz")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance")
    p.add_argument("--per-node", action="store_true", help="check each fused node's kernel")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_verify)

    p = command("patterns", "list the catalog")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_patterns)

    p = command("demo", "build an example model, rewrite it, verify and time it")
    p.add_argument("--dir", help="where to write the example files (default: a temp folder)")
    p.add_argument("--threads", type=int, default=None, help="threads for the timing runs")
    p.set_defaults(func=cmd_demo)
    add_bench_arguments(command("bench", "time a model: onnxruntime vs fusion, side by side"))
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
        if args.debug or not is_runtime_error(exc):
            raise
        print(f"fusion: error: onnxruntime: {runtime_reason(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusion: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
