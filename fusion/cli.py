"""The `fusion` command line. Exit codes: 0 success, 1 a check failed, 2 bad input or usage."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fusion.catalog import CatalogError, default_catalog
from fusion.io import FusionError, check_model, read_model, save_model, write_atomic


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def cmd_rewrite(args) -> int:
    src, dst = Path(args.model), Path(args.output)
    if dst.resolve() == src.resolve() and not args.in_place:
        raise FusionError(f"{dst}: output is the input file; pass --in-place to overwrite it")
    model, external = read_model(src)
    check_model(model, full=False, what=str(src))
    from fusion.rewriter import rewrite

    catalog = default_catalog().select(args.only or (), args.exclude or ())
    result = rewrite(model, catalog)
    if result.fusions:
        full = _passes_full_check(model)
        try:
            check_model(result.model, full=full, what="the rewritten model")
        except FusionError as exc:  # our bug, not the user's input: do not write it
            print(f"fusion: internal error: {exc}", file=sys.stderr)
            return 1
        save_model(result.model, dst, external=external)
    elif external:
        save_model(model, dst, external=True)
    else:
        _copy_unchanged(src, dst)
    _print_rewrite(result, args.verbose)
    if args.explain:
        print(result.explain())
    if args.report:
        Path(args.report).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0


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
    total = len(result.fusions)
    counts = ", ".join(f"{name}: {n}" for name, n in result.counts().items())
    print(f"{total} fusion{'s' if total != 1 else ''} ({counts})")
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
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("rewrite", help="fuse the catalog's patterns in an ONNX file")
    p.add_argument("model", help="input .onnx file (never modified unless --in-place)")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--only", type=_names, help="comma-separated pattern names to use")
    p.add_argument("--exclude", type=_names, help="comma-separated pattern names to skip")
    p.add_argument("--explain", action="store_true", help="print why near-misses were not fused")
    p.add_argument("--report", help="write a JSON report to this file")
    p.add_argument("--in-place", action="store_true", help="allow OUTPUT to be the input file")
    p.add_argument("-v", "--verbose", action="store_true", help="list every fused node")
    p.set_defaults(func=cmd_rewrite)

    p = sub.add_parser("patterns", help="list the catalog")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_patterns)

    p = sub.add_parser("demo", help="build an example model, rewrite it and report")
    p.add_argument("--dir", help="where to write the example files (default: a temp folder)")
    p.add_argument("--threads", type=int, default=None, help="threads for the timing runs")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FusionError, CatalogError) as exc:
        if args.debug:
            raise
        print(f"fusion: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusion: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
