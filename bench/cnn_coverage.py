"""Catalog coverage of real CNNs: fused convs, onnxruntime islands, and the outputs checked.

    python bench/cnn_coverage.py              # every model bench/zoo.py exported, both exporters
    python bench/cnn_coverage.py --zoo resnet18,googlenet --exporter dynamo18 [--batch 2] [--json F]
    python bench/cnn_coverage.py FILE.onnx ...

Per model: convs inside fused nodes that a kernel runs / all convs (fusion.coverage), the
onnxruntime islands of a run with every fused node on its kernel, the fused nodes by rule, and
the outputs of fusion.Session with tactics="kernel" (so the project's kernels, never the
onnxruntime fallback, compute every fused node) against onnxruntime on the original model
(fusion.verify): the largest error relative to the output's largest magnitude, which the issue
wants under 1e-4, and verify's own elementwise verdict. --why lists each unfused conv's reason.
Not a timing: no lock needed beyond the shared one (it compiles kernels on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from zoo import EXPORTERS, MODELS, model_path, zoo_dir  # bench/zoo.py, beside this script

import fusion
from fusion.coverage import coverage
from fusion.feeds import model_inputs
from fusion.modelfile import read_model
from fusion.numerics import compare_arrays
from fusion.ort import REFERENCE, inference_session

SCALE_RTOL = 1e-4  # the largest error allowed, relative to the output's largest magnitude


def check(name: str, model, batch: int, why: bool) -> dict:
    start = time.perf_counter()
    result = fusion.rewrite(model)
    cover = coverage(model, result=result)
    row = {"model": name, **cover.to_dict(), "rules": result.counts()}
    dims = {d.dim_param: batch for vi in model.graph.input
            for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param")}  # fmt: skip
    feeds, _ = model_inputs(model, None, 0, dims)
    try:
        session = fusion.Session(result.model, fuse=False, tactics="kernel")
        got = session.run(None, feeds)
        want = inference_session(model, REFERENCE).run(None, feeds)
        # Errors against each output's largest value (a deep CNN's logits drift past an
        # elementwise tolerance even between onnxruntime's own optimization levels).
        scales = [max(float(np.max(np.abs(w), initial=0.0)), 1e-30) for w in want]
        checks = [compare_arrays(f"output {k}", g, w, 0.0, SCALE_RTOL * s)
                  for k, (g, w, s) in enumerate(zip(got, want, scales, strict=True))]  # fmt: skip
        rel = max(c.max_abs / s for c, s in zip(checks, scales, strict=True))
        report = fusion.verify(model, result.model, inputs=feeds)
        row.update(max_rel_to_scale=rel, scale_ok=all(c.ok for c in checks), verify_ok=report.ok,
                   verify_max_rel=max(c.max_rel for c in report.outputs))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 (a failing model is a row, not the end of the run)
        row.update(error=f"{type(exc).__name__}: {exc}"[:300])
    row["seconds"] = round(time.perf_counter() - start, 1)
    if not why:
        row.pop("unfused_convs")
    return row


def line(row: dict) -> str:
    if "error" in row:
        out = f"ERROR {row['error']}"
    else:
        out = (f"rel err {row['max_rel_to_scale']:.1e} "
               f"({'ok' if row['scale_ok'] else f'OVER {SCALE_RTOL:g}'}), "
               f"verify {'ok' if row['verify_ok'] else 'FAIL'}")  # fmt: skip
    return (f"| {row['model']} | {row['fused_convs']}/{row['convs']} | {row['islands']} | {out} | "
            f"{', '.join(f'{k} {v}' for k, v in row['rules'].items())} |")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="ONNX files")
    ap.add_argument("--zoo", nargs="?", const=",".join(MODELS), default=None)
    ap.add_argument("--exporter", nargs="+", default=list(EXPORTERS), choices=sorted(EXPORTERS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--why", action="store_true", help="each unfused conv with its reason")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("FUSION_TACTICS", "kernel")
    files = [(Path(f).name, Path(f)) for f in args.models]
    if args.zoo is not None or not files:
        names = (args.zoo or ",".join(MODELS)).split(",")
        files += [(f"{n}.{e}", model_path(zoo_dir(), n, e)) for n in names for e in args.exporter]
    rows = []
    print("| model | fused convs | islands | outputs vs onnxruntime | fused nodes |")
    print("|---|---:|---:|---|---|")
    for name, path in files:
        if not path.exists():
            print(f"| {name} | missing: {path} |")
            continue
        row = check(name, read_model(path)[0], args.batch, args.why)
        rows.append(row)
        print(line(row), flush=True)
        for item in row.get("unfused_convs", []):
            print(f"    {item['conv']}: {item['reason']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
