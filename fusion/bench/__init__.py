"""Benchmark one workload: fused against unfused and against onnxruntime, side by side.

    result = measure(Workload("conv", model, feeds), Options(threads=2))
    print(result.speedup("ort-all"))          # median ort-all time / median fusion time
    write_json([result], "bench.json"); write_markdown(...); write_plot(...)

The modules, in the order a measurement uses them:

  workload  Workload (model, inputs, rules) and Options (rounds, budget, what to measure)
  runners   the runners (ort-none, ort-all, fusion, ort-fused, ort-native), their outputs
            verified against ort-none, and the one timing loop, `interleave` (fusion.compare
            uses it too)
  flops     FLOPs of Conv, MatMul, Gemm and LSTM nodes, and the heaviest GEMM shape
  sgemm     the machine's SGEMM on that shape, the reference for GFLOP/s
  child     peak memory and Numba compile time, in child processes
  measure   `measure`: all of the above for one workload -> BenchResult (result)
  report    terminal tables, Markdown, JSON and a PNG bar chart
  cli       `fusion bench MODEL.onnx`
"""

from fusion.bench.cli import add_bench_arguments, cmd_bench
from fusion.bench.flops import Flops, count_flops
from fusion.bench.measure import measure
from fusion.bench.report import (
    detail_rows,
    legend,
    machine,
    markdown,
    notes,
    rich_tables,
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
    Timing,
    interleave,
    make_runner,
    verify_runners,
)
from fusion.bench.workload import Options, Workload, catalog_with

__all__ = [
    "FUSED",
    "NATIVE",
    "ORT_ALL",
    "ORT_FUSED",
    "ORT_NONE",
    "RUNNERS",
    "BenchResult",
    "Flops",
    "Options",
    "RunnerInfo",
    "Timing",
    "Workload",
    "add_bench_arguments",
    "catalog_with",
    "cmd_bench",
    "count_flops",
    "detail_rows",
    "interleave",
    "legend",
    "machine",
    "make_runner",
    "markdown",
    "measure",
    "notes",
    "rich_tables",
    "time_rows",
    "verify_runners",
    "write_json",
    "write_markdown",
    "write_plot",
]
