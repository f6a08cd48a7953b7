"""`fusion bench MODEL.onnx`: one model file through fusion.bench.measure, tables printed."""

from __future__ import annotations

import os
from pathlib import Path

from fusion.bench.machine import machine
from fusion.bench.measure import measure
from fusion.bench.report import (
    header_lines,
    notes,
    rich_tables,
    write_json,
    write_markdown,
    write_plot,
)
from fusion.bench.timing import PROCESSES, SAME_PROCESS
from fusion.bench.workload import Options, Workload
from fusion.cli.inputs import (
    add_input_argument,
    batch_sizes,
    beyond_the_checker,
    check_writes,
    input_files,
    load_checked,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from fusion.cli.progress import progress_bar
from fusion.feeds import model_inputs

NAME, HELP = "bench", "time a model: onnxruntime vs fusion, side by side"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="the .onnx file to benchmark (original, not fused)")
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="threads for every runner"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=20, help="at most this many timed rounds"
    )
    parser.add_argument("--repeat", type=positive_int, default=3, help="calls per runner and round")
    parser.add_argument(
        "--budget", type=non_negative_float, default=10.0, help="seconds of timed rounds"
    )
    parser.add_argument(
        "--gap",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="sleep this long before each timed call (runs spaced like requests)",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=None, help="size of symbolic first axes (default 1)"
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="quick mode: every runner in this process (onnxruntime's workers not spinning)",
    )
    add_input_argument(parser)
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of random inputs")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child")
    parser.add_argument("--no-compile", action="store_true", help="skip the compile-time children")
    parser.add_argument("--no-nodes", action="store_true", help="skip timing fused nodes alone")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.add_argument("--markdown", help="write a Markdown table to this file")
    parser.add_argument("--plot", help="write a PNG bar chart of speedups to this file")


def execute(args) -> int:
    """Benchmark one model file; exit 1 if any runner's numbers were refused."""
    from rich.console import Console  # heavy: only for the tables

    info = machine()  # the command line as typed, the machine, before anything runs
    model, data_files, checked = load_checked(args.model)
    writes = {"--json": args.json, "--markdown": args.markdown, "--plot": args.plot}
    check_writes(writes, args.model, data_files, args.input)  # before the long run
    batch = batch_sizes(model, None if args.batch is None else [args.batch])[0]
    feeds, source = model_inputs(model, input_files(args.input), args.seed, None, batch)
    opts = Options(
        threads=args.threads or os.cpu_count() or 1,
        rounds=args.rounds,
        repeat=args.repeat,
        budget=args.budget,
        gap=args.gap / 1e3,
        mode=SAME_PROCESS if args.same_process else PROCESSES,
        nodes=not args.no_nodes,
        memory=not args.no_memory,
        compile=not args.no_compile,
    )
    workload = Workload(
        Path(args.model).stem,
        model,
        feeds,
        description=f"inputs: {source}",
        plugins=tuple(getattr(args, "plugin", None) or ()),
    )
    console = Console(highlight=False)
    # progress while kernels compile and runners warm up
    with beyond_the_checker(args.model, checked), progress_bar(console) as bar:
        task = bar.add_task(workload.name, total=None)
        result = measure(workload, opts, lambda s: bar.update(task, description=s))
    for line in header_lines([result], info):
        console.print(line, markup=False)
    for table in rich_tables([result], width=console.width):
        console.print(table)
    for line in notes([result]):
        console.print(line, markup=False)
    if args.json:
        write_json([result], args.json, info, command=info["command"])
    if args.markdown:
        write_markdown([result], args.markdown, info)
    if args.plot:
        write_plot([result], args.plot, title=f"{args.model}, {opts.threads} threads", info=info)
    return 1 if result.refused else 0
