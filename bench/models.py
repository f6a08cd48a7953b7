"""Real models through the harness: fusion.Session against onnxruntime at its defaults.

    python bench/models.py --zoo                       # bench/zoo.py's BENCH set, batch 1 and 8
    python bench/models.py --zoo resnet18,googlenet --exporter dynamo18
    python bench/models.py FILE.onnx ... [--batch 1 8] [--rounds 10] [--json F] [--markdown F]
    python bench/models.py --builtin squeezenet1.1     # fusion/models' SqueezeNet, no file
    python bench/models.py ZOO/bert_small.s128.onnx --native .ortopt.onnx --batch 1

--zoo reads the files bench/zoo.py exported (torchvision's resnet18, resnet50, mobilenet_v2,
googlenet, shufflenet_v2_x1_0, densenet121, squeezenet1_1 by default) from its cache folder;
export them first (bench/zoo.py says how: torch lives in a venv of its own).

Each model (a symbolic first axis set to each --batch) goes through fusion.bench.measure:
every runner in a worker process of its own, onnxruntime at its defaults (spinning), round
robin, outputs checked against onnxruntime without optimizations first (the fused rules'
tolerance, or --rtol/--atol: a deep model's logits drift further, even between onnxruntime's
own optimization levels: resnet50's by 2.4e-4 of their size). Per model it reports
fusion's speed against onnxruntime's default, the share of the model's conv FLOPs that
fusion's own kernels run (the rest runs in onnxruntime: islands, or fused nodes left to their
function bodies), the number of onnxruntime islands, and every fused node slower than
onnxruntime running that node's own body (timed alone on the inputs it received). Every
output names the machine and the command.

--native SUFFIX times, as the ort-native runner, the file beside each model named with SUFFIX
in place of ".onnx" (bench/zoo_transformers.py writes NAME.sSEQ.ortopt.onnx, onnxruntime's
transformers optimizer's output: the "vs native" column is fusion against that). Its fused
Attention reads attention_mask as lengths (right padding), not as the 0/1 mask the export
computes with: `--ones attention_mask` feeds a batch without padding, where both agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from zoo import BENCH, EXPORTERS, model_path, zoo_dir  # bench/zoo.py, beside this script

from fusion import bench
from fusion.bench import PROCESSES, SAME_PROCESS, Options, Workload
from fusion.errors import FusionError
from fusion.feeds import model_inputs
from fusion.modelfile import read_model
from fusion.models import squeezenet

BUILTIN = {"squeezenet1.1": lambda: squeezenet("1.1", size=224, batch="N"),
           "squeezenet1.0": lambda: squeezenet("1.0", size=224, batch="N")}  # fmt: skip


def workload(name: str, model, batch: int, seed: int = 0, native=None, ones=()) -> Workload:
    """The model with its symbolic first axes set to `batch`, on seeded random inputs (those
    named in `ones` all ones); native: an equivalent model (same inputs and outputs) timed as
    ort-native."""
    dims = {}
    for vi in model.graph.input:
        shape = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if shape and shape[0].HasField("dim_param"):
            dims[shape[0].dim_param] = batch
    feeds, source = model_inputs(model, None, seed, dims)
    for input_name in ones:
        feeds[input_name] = np.ones_like(feeds[input_name])
        source += f", {input_name} all ones"
    first = next(iter(feeds.values()))
    if first.ndim and first.shape[0] != batch:
        raise FusionError(f"{name}: its first input has batch {first.shape[0]}, not {batch}")
    return Workload(f"{name} b{batch}", model, feeds, description=f"inputs: {source}",
                    batch=batch, native=native)  # fmt: skip


def markdown(results, info) -> str:
    head, body = bench.summary_rows(results)
    out = bench.markdown_header(results, info)
    out += ["", "| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    out += ["| " + " | ".join(row) + " |" for row in body]
    out += ["", "Details:", "", bench.markdown(results, info)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="ONNX files (a symbolic first axis is the batch)")
    ap.add_argument("--builtin", nargs="*", default=[], choices=sorted(BUILTIN),
                    help="built-in models instead of (or besides) files")  # fmt: skip
    ap.add_argument("--zoo", nargs="?", const=",".join(BENCH), default=None,
                    help="comma-separated names of bench/zoo.py's exported models "
                         "(default: its BENCH set)")  # fmt: skip
    ap.add_argument("--exporter", default="ts17", choices=sorted(EXPORTERS),
                    help="which of bench/zoo.py's exports (--zoo)")  # fmt: skip
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=float, default=5.0, help="seconds of timing per workload")
    ap.add_argument(
        "--gap",
        type=float,
        default=0.0,
        metavar="MS",
        help="sleep this long before each timed run (runs spaced like requests; the per-node "
        "comparison stays back to back)",
    )
    ap.add_argument("--same-process", action="store_true", help="quick mode, one process")
    ap.add_argument("--no-nodes", action="store_true", help="skip timing fused nodes alone")
    ap.add_argument("--node-rounds", type=int, default=3, help="rounds of that comparison")
    ap.add_argument("--rtol", type=float, default=None, help="output check (default: the rules')")
    ap.add_argument("--atol", type=float, default=None, help="output check (default: the rules')")
    ap.add_argument("--native", metavar="SUFFIX",
                    help="time FILE, SUFFIX for .onnx, as ort-native")  # fmt: skip
    ap.add_argument("--ones", nargs="+", default=[], metavar="INPUT",
                    help="inputs fed as all ones (attention_mask: nothing padded)")  # fmt: skip
    ap.add_argument("--runners", nargs="+", choices=sorted(bench.RUNNERS),
                    help="which runners (default: all; ort-none always checks)")  # fmt: skip
    ap.add_argument("--json", help="write every result as JSON to this file")
    ap.add_argument("--markdown", help="write the summary and details as Markdown")
    args = ap.parse_args(argv)
    files = list(args.models)
    for name in (args.zoo or "").split(","):
        if name.strip():
            path = model_path(zoo_dir(), name.strip(), args.exporter)
            if not path.is_file():
                ap.error(f"{path}: not exported yet (run bench/zoo.py in its venv)")
            files.append(str(path))
    if not files and not args.builtin:
        ap.error("name at least one model file, --zoo or --builtin model")
    from rich.console import Console  # heavy: only for the terminal
    from rich.table import Table

    info = bench.machine()
    console = Console(highlight=False)
    for line in bench.machine_lines(info):
        console.print(line, markup=False)
    opts = Options(
        threads=args.threads or os.cpu_count() or 1,
        rounds=args.rounds,
        min_rounds=min(5, args.rounds),
        budget=args.budget,
        repeat=args.repeat,
        gap=args.gap / 1e3,
        mode=SAME_PROCESS if args.same_process else PROCESSES,
        nodes=not args.no_nodes,
        node_rounds=args.node_rounds,
        rtol=args.rtol,
        atol=args.atol,
        runners=tuple(args.runners) if args.runners else None,
        memory=False,
        compile=False,
    )
    natives = {}
    for p in files:
        beside = Path(p.removesuffix(".onnx") + args.native) if args.native else None
        if beside is not None and not beside.is_file():
            ap.error(f"{beside}: no such file (--native {args.native})")
        natives[p] = beside
    models = [(Path(p).name.removesuffix(".onnx"), lambda p=p: read_model(p)[0], natives[p])
              for p in files]  # fmt: skip
    models += [(name, BUILTIN[name], None) for name in args.builtin]
    results = []
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if console.is_terminal else None
    for name, load, native_file in models:
        model = load()
        native = read_model(native_file)[0] if native_file else None
        for batch in args.batch:
            w = workload(name, model, batch, native=native, ones=args.ones)
            results.append(bench.measure(w, opts, say))
            r = results[-1]
            vs_native = f", vs ort-native {r.speedup('ort-native') or 0:.2f}x" if native else ""
            console.print(f"{r.workload}: fusion vs ort-all {r.speedup('ort-all') or 0:.2f}x"
                          f"{vs_native}", markup=False)  # fmt: skip
    head, body = bench.summary_rows(results)
    table = Table(title=f"fusion vs onnxruntime at its defaults; {results[0].timing.describe()}")
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    for row in body:
        table.add_row(*row)
    console.print(table)
    for line in bench.notes(results):
        console.print(line, markup=False)
    if args.json:
        bench.write_json(results, args.json, info, command=info["command"])
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, info))
    return 1 if any(r.refused for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
