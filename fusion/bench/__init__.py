"""Benchmark one workload: fused against unfused and against onnxruntime, side by side.

    result = measure(Workload("conv", model, feeds), Options(threads=2))
    print(result.speedup("ort-all"))          # median ort-all time / median fusion time
    write_json([result], "bench.json"); write_markdown(...); write_plot(...)

The modules, in the order a measurement uses them:

  timing    the one timing loop, `interleave`, and its Timing (bench/ scripts use it too)
  workload  Workload (model, inputs, rules) and Options (rounds, budget, mode, what to measure)
  runners   the runners (ort-none, ort-all, fusion, ort-fused, ort-native), their outputs
            verified against ort-none, timed through the loop
  workers   each runner in a long-lived process of its own (the default), or here (quick)
  flops     FLOPs of Conv, MatMul, Gemm and LSTM nodes, and the heaviest GEMM shape
  sgemm     the machine's SGEMM on that shape, the reference for GFLOP/s
  child     peak memory and Numba compile time, in child processes
  measure   `measure`: all of the above for one workload -> BenchResult (result)
  machine   the CPU, ISA, cores, library versions and command every result names
  report    terminal tables, Markdown, JSON and a PNG bar chart
  compare   `fusion.compare`, the light front on runners and loop

`fusion bench MODEL.onnx` is fusion.cli.bench.
"""

from fusion.bench.compare import compare
from fusion.bench.flops import Flops, count_flops
from fusion.bench.machine import command_line, cpu_line, machine, machine_lines
from fusion.bench.measure import measure
from fusion.bench.report import (
    detail_rows,
    header_lines,
    legend,
    markdown,
    markdown_header,
    node_rows,
    notes,
    rich_tables,
    runner_rows,
    step_rows,
    summary_rows,
    time_rows,
    write_json,
    write_markdown,
    write_plot,
)
from fusion.bench.result import BenchResult
from fusion.bench.runners import (
    FUSED,
    NATIVE,
    ORT_ALL,
    ORT_FUSED,
    ORT_NONE,
    RUNNERS,
    RunnerInfo,
    make_runner,
    time_runners,
    verify_runners,
)
from fusion.bench.timing import PROCESSES, SAME_PROCESS, Timing, interleave
from fusion.bench.workload import Options, Workload, catalog_with

__all__ = [
    "FUSED",
    "NATIVE",
    "ORT_ALL",
    "ORT_FUSED",
    "ORT_NONE",
    "PROCESSES",
    "RUNNERS",
    "SAME_PROCESS",
    "BenchResult",
    "Flops",
    "Options",
    "RunnerInfo",
    "Timing",
    "Workload",
    "catalog_with",
    "command_line",
    "compare",
    "count_flops",
    "cpu_line",
    "detail_rows",
    "header_lines",
    "interleave",
    "legend",
    "machine",
    "machine_lines",
    "make_runner",
    "markdown",
    "markdown_header",
    "measure",
    "node_rows",
    "notes",
    "rich_tables",
    "runner_rows",
    "step_rows",
    "summary_rows",
    "time_runners",
    "time_rows",
    "verify_runners",
    "write_json",
    "write_markdown",
    "write_plot",
]
