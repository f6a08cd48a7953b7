"""`fusion match MODEL [--json]`: what a rewrite would fuse, and why the near-misses are not
fused, per pattern; then every conv left unfused with its first reason, and the summary (fused
convs of all, onnxruntime islands); nothing is written. The JSON has the shape of `rewrite
--report`."""

from __future__ import annotations

import json

from fusion.cli.inputs import load_checked, pattern_names
from fusion.coverage import coverage
from fusion.registry import default_catalog
from fusion.rewriter import rewrite

NAME, HELP = "match", "list what would be fused (and near-misses, with reasons); writes nothing"


def add_arguments(p) -> None:
    p.add_argument("model", help="the .onnx file to match (read only)")
    p.add_argument("--only", type=pattern_names, help="comma-separated pattern names to use")
    p.add_argument("--exclude", type=pattern_names, help="comma-separated pattern names to skip")
    p.add_argument("--json", action="store_true", help="the rewrite --report JSON on stdout")


def execute(args) -> int:
    model = load_checked(args.model)[0]
    catalog = default_catalog().select(args.only or (), args.exclude or ())
    result = rewrite(model, catalog)  # in memory: the rewritten model is dropped
    cover = coverage(model, catalog, result)
    if args.json:
        print(json.dumps({**result.to_dict(), "coverage": cover.to_dict()}, indent=2))
        return 0
    print(f"{args.model}: {len(model.graph.node)} nodes")
    for rule in result.rules:
        fused = [f for f in result.fusions if f.rule == rule]
        misses = [n for n in result.near_misses if n.rule == rule]
        if not fused and not misses:
            print(f"{rule}: no match")
            continue
        print(f"{rule}: {len(fused)} match{'es' if len(fused) != 1 else ''}, "
              f"{len(misses)} near-miss{'es' if len(misses) != 1 else ''}")  # fmt: skip
        for f in fused:
            print(f"  match {f.node}: {', '.join(f.replaced)}")
        for n in misses:
            print(f"  near-miss at {n.at}: {n.reason}")
    print(cover)
    return 0
