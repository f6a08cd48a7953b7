"""Every Conv of a real model timed alone: the project's kernel against onnxruntime's Conv.

    python bench/convs.py MODEL.onnx [--batch 1 8] [--rounds 10] [--json F] [--markdown F]

Each Conv (with the Relu or Clip that follows it, when it is the conv's only reader: the form
exporters write) becomes a one-conv model on the same weights, attributes and input shape.
fusion.Session runs its rewrite, and the fused node's kernel is timed alone on the inputs it
received in that run, in its own layout (a blocked tactic's conversions happen at the borders
of a blocked region, which bench/models.py counts), onnxruntime at its defaults
(fusion.ort.DEFAULT, spinning) runs the model as exported, and onnxruntime without
optimizations checks both first (fusion.numerics, the rule's tolerance): each in a worker
process of its own (fusion.bench.workers), every conv added to the same three workers, the two
rivals timed round robin per conv (fusion.bench.timing.interleave). Convs of the same shape and
attributes are timed once and counted as many times as the model has them.

Convs are grouped by class: 1x1 s1, 1x1 s2, 3x3 s1, 3x3 s2, stem kxk with C <= 4, depthwise,
grouped, conv1d, other. Per conv: GFLOP/s of both and the ratio (onnxruntime's time / the
kernel's: above 1 the kernel is faster); per class the median, min and max ratio and the share
of the model's conv FLOPs. A conv the catalog does not fuse is listed as "not fused" (it would
run in onnxruntime). Results name the machine and the command (JSON, Markdown, terminal).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

import fusion
from fusion.bench import FUSED, ORT_ALL, ORT_NONE, count_flops, interleave, machine
from fusion.bench.flops import inferred_shapes
from fusion.bench.machine import cpu_line
from fusion.bench.timing import PROCESSES
from fusion.bench.workers import Keyed, close_workers, start_workers, worker_spec
from fusion.graph import GraphView, node_label
from fusion.modelfile import read_model
from fusion.numerics import accumulating, compare_arrays, tolerance

CLASSES = ("1x1 s1", "1x1 s2", "3x3 s1", "3x3 s2", "stem kxk C<=4", "depthwise", "grouped",
           "conv1d", "other")  # fmt: skip
ACTIVATIONS = ("Relu", "Clip")


def conv_class(x_shape, w_shape, attrs) -> str:
    """The class of a conv by its input [N, C, ...], weights [M, C/g, k...] and attributes."""
    c, group = x_shape[1], attrs.get("group", 1)
    kernel, strides = list(w_shape[2:]), list(attrs.get("strides") or [1] * len(w_shape[2:]))
    if len(kernel) == 1 or (len(kernel) == 2 and x_shape[2] == 1 and kernel[0] == 1):
        return "conv1d"
    if group > 1:
        return "depthwise" if group == c and w_shape[1] == 1 else "grouped"
    if c <= 4:
        return "stem kxk C<=4"
    if kernel in ([1, 1], [3, 3]) and len(set(strides)) == 1 and strides[0] in (1, 2):
        return f"{kernel[0]}x{kernel[1]} s{strides[0]}"
    return "other"


def one_conv_models(model: onnx.ModelProto, batch: int):
    """Per distinct conv: (labels of the convs like it, class, one-conv model, feeds)."""
    view = GraphView(model)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in view.initializers:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else batch
                for d in vi.type.tensor_type.shape.dim]  # fmt: skip
        feeds[vi.name] = np.zeros(dims, np.float32)
    shapes = inferred_shapes(model, feeds)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    distinct: dict[tuple, list] = {}
    rng = np.random.default_rng(0)
    for node in model.graph.node:
        if node.op_type != "Conv" or node.input[0] not in shapes:
            continue
        w = view.constant(node.input[1])
        b = view.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if w is None:
            continue
        act = _activation(view, node)
        attrs = view.attributes(node)
        x_shape = shapes[node.input[0]]
        key = (tuple(x_shape), w.shape, b is not None, repr(sorted(attrs.items())),
               act and (act.op_type, tuple(_clip_bounds(view, act))))  # fmt: skip
        if key in distinct:
            distinct[key][0].append(node_label(node))
            continue
        one = _conv_model(node, act, view, x_shape, w, b, opset)
        x = rng.standard_normal(x_shape).astype(np.float32)
        distinct[key] = [[node_label(node)], conv_class(x_shape, w.shape, attrs), one, {"x": x}]
    return list(distinct.values())


def _activation(view: GraphView, conv: onnx.NodeProto) -> onnx.NodeProto | None:
    readers = view.consumers.get(conv.output[0], [])
    if len(readers) != 1 or conv.output[0] in view.graph_outputs:
        return None
    node = view.nodes[readers[0]]
    return node if node.op_type in ACTIVATIONS else None


def _clip_bounds(view: GraphView, clip: onnx.NodeProto) -> list:
    if clip.op_type != "Clip":
        return []
    bounds = [view.constant(v) if v else None for v in clip.input[1:3]]
    return [None if v is None else float(v) for v in bounds]


def _conv_model(conv, act, view, x_shape, w, b, opset) -> onnx.ModelProto:
    """Conv (+ Relu or Clip) on input "x", weights as initializers, as the exporter wrote it."""
    inits = [numpy_helper.from_array(w, "W")]
    inputs = ["x", "W"]
    if b is not None:
        inits.append(numpy_helper.from_array(b, "B"))
        inputs.append("B")
    nodes = [helper.make_node("Conv", inputs, ["y"], name="conv", **_attrs(conv))]
    out = "y"
    if act is not None:
        act_inputs = ["y"]
        for i, bound in enumerate(_clip_bounds(view, act)):
            name = ("min", "max")[i]
            act_inputs.append(name if bound is not None else "")
            if bound is not None:
                inits.append(numpy_helper.from_array(np.array(bound, np.float32), name))
        nodes.append(helper.make_node(act.op_type, act_inputs, ["z"], name="act"))
        out = "z"
    graph = helper.make_graph(
        nodes,
        "one_conv",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def describe(labels, model) -> str:
    conv = model.graph.node[0]
    x = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    w = numpy_helper.to_array(model.graph.initializer[0]).shape
    attrs = GraphView(model).attributes(conv)
    act = f" +{model.graph.node[1].op_type}" if len(model.graph.node) > 1 else ""
    k = "x".join(map(str, w[2:]))
    strides = attrs.get("strides") or [1]
    s = str(strides[0]) if len(set(strides)) == 1 else "x".join(map(str, strides))
    g = f" g{attrs['group']}" if attrs.get("group", 1) > 1 else ""
    return f"{x[1]}->{w[0]} {k} s{s}{g} {'x'.join(map(str, x[2:]))}{act}"


def time_convs(path: str, batch: int, threads: int, rounds: int, repeat: int, say=print):
    """Every distinct conv of the model at `batch`: checked, then timed; a row per conv."""
    model = read_model(path)[0]
    catalog = fusion.default_catalog()
    convs = one_conv_models(model, batch)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusion-convs-") as tmp:
        folder = Path(tmp)
        np.savez(folder / "feeds.npz")
        specs = {
            ORT_NONE: worker_spec(ORT_NONE, folder, threads),
            ORT_ALL: worker_spec(ORT_ALL, folder, threads),
            FUSED: worker_spec(FUSED, folder, threads, catalog=pickle.dumps(catalog)),
        }
        workers, failed = start_workers(specs, say)
        if failed:
            close_workers(workers)
            raise SystemExit(f"a worker failed: {next(iter(failed.values()))}")
        try:
            for k, (labels, cls, one, feeds) in enumerate(convs):
                rows.append(_one(k, labels, cls, one, feeds, workers, catalog, folder, rounds,
                                 repeat, threads))  # fmt: skip
                say(f"{k + 1}/{len(convs)} {rows[-1]['conv']}: {rows[-1]['ratio'] or 0:.2f}x")
        finally:
            close_workers(workers)
    return rows


def _one(k, labels, cls, one, feeds, workers, catalog, folder, rounds, repeat, threads) -> dict:
    rewritten = fusion.rewrite(one, catalog)
    fused = {r: n for r, n in rewritten.counts().items() if n}
    files = {}
    for name, m in (("orig", one), ("fused", rewritten.model)):
        files[name] = folder / f"conv{k}.{name}.onnx"
        onnx.save(m, str(files[name]))
    np.savez(folder / f"conv{k}.npz", **feeds)
    for name, w in workers.items():
        w.ask("add", k, str(files["fused" if name == FUSED else "orig"]),
              str(folder / f"conv{k}.npz"))  # fmt: skip
    want = workers[ORT_NONE].run(k)
    rules = catalog.rules_in(rewritten.model)
    rtol, atol = tolerance(rules)
    scaled = accumulating(rules)  # a conv sums long runs: error relative to the output's scale
    row = {"convs": labels, "count": len(labels), "class": cls, "conv": describe(labels, one),
           "fused": fused, "gflop": count_flops(one, feeds).total / 1e9}  # fmt: skip
    for name in (FUSED, ORT_ALL):
        got = workers[name].run(k)
        c = compare_arrays("y", got[0], want[0], rtol, atol, scaled=scaled)
        row[f"{name}_max_rel"] = c.max_rel
        if not c.ok:
            row[f"{name}_refused"] = str(c)
    calls = {name: Keyed(workers[name], k) for name in (FUSED, ORT_ALL)}
    kernels = workers[FUSED].ask("nodes", k)
    if len(kernels) == 1:  # the fused conv's kernel alone, on inputs in its own layout
        ((name, *_, choice),) = kernels
        calls[FUSED] = Keyed(workers[FUSED], (k, name))
        row["kernel"] = choice
    timing = interleave(calls, rounds, warmup=2, repeat=repeat, threads=threads, mode=PROCESSES,
                        warm=0.05)  # fmt: skip
    for name in (FUSED, ORT_ALL):
        s = timing.stats(name)
        row[f"{name}_ms"] = s["median_ms"]
        row[f"{name}_min_ms"], row[f"{name}_max_ms"] = s["min_ms"], s["max_ms"]
        row[f"{name}_gflops"] = row["gflop"] / (s["median_ms"] / 1e3)
    ok = not any(k.endswith("_refused") for k in row)
    row["ratio"] = row[f"{ORT_ALL}_ms"] / row[f"{FUSED}_ms"] if ok and fused else None
    return row


def by_class(rows: list[dict]) -> list[dict]:
    """Per class: convs, share of the model's conv FLOPs, median / min / max ratio."""
    total = sum(r["gflop"] * r["count"] for r in rows) or 1.0
    groups = defaultdict(list)
    for r in rows:
        groups[r["class"]].append(r)
    out = []
    for cls in CLASSES:
        rs = groups.get(cls)
        if not rs:
            continue
        ratios = [r["ratio"] for r in rs if r["ratio"] is not None]
        out.append({
            "class": cls,
            "convs": sum(r["count"] for r in rs),
            "distinct": len(rs),
            "flop_share": sum(r["gflop"] * r["count"] for r in rs) / total,
            "not_fused": sum(r["count"] for r in rs if not r["fused"]),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "min_ratio": min(ratios, default=None),
            "max_ratio": max(ratios, default=None),
        })  # fmt: skip
    return out


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(model: str, results: dict, info: dict) -> str:
    out = [f"Machine: {cpu_line(info)}; onnxruntime {info['onnxruntime']}, numba "
           f"{info['numba']}, numpy {info['numpy']}.", f"Command: `{info['command']}`",
           "Timing: each runner in its own process (the fused conv's kernel alone, in its own "
           "layout, [tactic] after the conv; onnxruntime at its defaults on the exported "
           "one-conv model), round robin per conv, medians over every call. Ratio: "
           "onnxruntime's time / the kernel's.", ""]  # fmt: skip
    for batch, rows in results.items():
        out += [f"**{Path(model).name}, batch {batch}: by class**", "",
                "| class | convs (distinct) | conv FLOPs | not fused | median | min | max |",
                "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for c in by_class(rows):
            out.append(f"| {c['class']} | {c['convs']} ({c['distinct']}) | "
                       f"{c['flop_share']:.0%} | {c['not_fused']} | {_x(c['median_ratio'])} | "
                       f"{_x(c['min_ratio'])} | {_x(c['max_ratio'])} |")  # fmt: skip
        out += ["", f"**{Path(model).name}, batch {batch}: per conv**", "",
                "| class | conv | count | GFLOP | fusion ms | ort ms | fusion GFLOP/s | "
                "ort GFLOP/s | ratio |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in sorted(rows, key=lambda r: (CLASSES.index(r["class"]), -r["gflop"])):
            fused = f" [{r['kernel']}]" if r.get("kernel") else ""
            fused = fused if r["fused"] else " (not fused)"
            out.append(f"| {r['class']} | {r['conv']}{fused} | {r['count']} | {r['gflop']:.3f} | "
                       f"{r['fusion_ms']:.3f} | {r['ort-all_ms']:.3f} | "
                       f"{r['fusion_gflops']:.1f} | {r['ort-all_gflops']:.1f} | "
                       f"{_x(r['ratio'])} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="an exported CNN (.onnx)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=10, help="rounds per conv")
    ap.add_argument("--repeat", type=int, default=3, help="calls per turn")
    ap.add_argument("--json", help="write the rows and classes as JSON to this file")
    ap.add_argument("--markdown", help="write the tables as Markdown to this file")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    info = machine()
    threads = args.threads or os.cpu_count() or 1
    say = (lambda _: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    results = {b: time_convs(args.model, b, threads, args.rounds, args.repeat, say)
               for b in args.batch}  # fmt: skip
    text = markdown(args.model, results, info)
    print(text)
    if args.json:
        doc = {"machine": info, "model": args.model, "threads": threads,
               "batches": {str(b): {"classes": by_class(rows), "convs": rows}
                           for b, rows in results.items()}}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
