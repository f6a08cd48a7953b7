"""Results for people and programs: terminal tables, Markdown, JSON and a PNG bar chart."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from fusion.bench.result import BenchResult
from fusion.bench.runners import FUSED, NATIVE, ORT_ALL, ORT_FUSED, ORT_NONE, RUNNERS


def machine() -> dict:
    """Where the numbers come from: CPU, core count, library versions, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    import numba  # heavy: only to report its version

    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "numba": numba.__version__,
        "onnx": onnx.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _ms(result: BenchResult, name: str) -> str:
    info = result.runners.get(name)
    if info is None:
        return "-"
    if not info.ok:
        return "refused" if info.reason.startswith("wrong") else "failed"
    s = result.timing.times[name]
    return f"{statistics.median(s) * 1e3:.2f} [{min(s) * 1e3:.2f}-{max(s) * 1e3:.2f}]"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def time_rows(results: list[BenchResult]) -> tuple[list[str], list[list[str]]]:
    """Time per run of every runner, and fusion's speedups: header and one row per workload."""
    head = ["workload", "fused nodes", *RUNNERS, "fusion vs ort-none", "vs ort-all", "vs native"]
    body = []
    for r in results:
        body.append([
            r.workload,
            ", ".join(f"{k} {v}" for k, v in r.fused.items()) or "none",
            *(_ms(r, n) for n in RUNNERS),
            _x(r.speedup(ORT_NONE)),
            _x(r.speedup(ORT_ALL)),
            _x(r.speedup(NATIVE)) if NATIVE in r.runners else "-",
        ])  # fmt: skip
    return head, body


def detail_rows(results: list[BenchResult]) -> tuple[list[str], list[list[str]]]:
    """Where fusion's time goes, against the machine's SGEMM; compile time; memory."""
    head = ["workload", "GFLOP/run", "fusion GFLOP/s med / best",
            "SGEMM GFLOP/s med / best [MxKxN]", "of SGEMM med / best",
            "kernels ms", "islands ms", "between ms", "compile cold/cached s",
            "extra MB none/all/fusion/fused/native"]  # fmt: skip
    body = []
    for r in results:
        p, c, g = r.profile, r.compile, r.sgemm
        shape = "x".join(map(str, g.get("shape_mkn", ())))
        sgemm = f"{g['gflops']:.1f} / {g['gflops_best']:.1f} [{shape}]" if g else "-"
        mine = (r.gflops(FUSED), r.gflops(FUSED, best=True))
        mem = "/".join(
            _num(r.runners[n].extra_mb, ".0f") if n in r.runners else "-" for n in RUNNERS
        )
        body.append([
            r.workload,
            f"{r.flops / 1e9:.3f}",
            " / ".join(_num(v) for v in mine),
            sgemm,
            " / ".join(_num(r.sgemm_fraction(best=b), ".0%") for b in (False, True)),
            _num(p["kernel_s"] * 1e3, ".2f") if p else "-",
            _num(p["island_s"] * 1e3, ".2f") if p else "-",
            _num(p["between_s"] * 1e3, ".3f") if p else "-",
            f"{c['cold_s']:.1f} / {c['cached_s']:.1f}" if "cold_s" in c else "-",
            mem,
        ])  # fmt: skip
    return head, body


TIMES_TITLE = "time per run, ms: median [min-max] over interleaved rounds"
DETAILS_TITLE = "fusion's run: throughput, time split (Session.profile), compile, memory"


def rich_tables(results: list[BenchResult], title: str = ""):
    """The two summary tables for a terminal."""
    from rich.markup import escape
    from rich.table import Table

    tables = []
    for caption, (head, body) in ((TIMES_TITLE, time_rows(results)),
                                  (DETAILS_TITLE, detail_rows(results))):  # fmt: skip
        table = Table(title=escape(f"{title}: {caption}" if title else caption))
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 and "GFLOP" not in h else "right")
        for row in body:
            table.add_row(*row)
        tables.append(table)
    return tables


def legend() -> list[str]:
    lines = [f"- `{n}`: {label}" for n, label in RUNNERS.items()]
    lines += [
        "- `vs X`: median of X / median of fusion (above 1: fusion is faster)",
        "- GFLOP/s: the original model's Conv/MatMul/Gemm/LSTM FLOPs over fusion's median "
        "(best: fastest) run; SGEMM: numpy float32 on the workload's heaviest GEMM shape, "
        "same threads, same run; of SGEMM: median vs median / best vs best",
        "- kernels / islands / between: fusion.Session.profile, mean per run",
        "- compile: Session build + first run in a child process, fresh Numba cache / "
        "cached; measured once per set of fused ops (`measured_on` in the JSON)",
        "- extra MB (ort-none/ort-all/fusion/ort-fused/ort-native): peak RSS of a child process "
        "(everything imported, models loaded) while it builds the runner and runs it once, "
        "minus its RSS just before",
        "- refused: outputs disagree with onnxruntime, so no speed is reported",
    ]
    return lines


def notes(results: list[BenchResult]) -> list[str]:
    """Refusals, failures and notes, one line each."""
    out = []
    for r in results:
        for name in r.refused:
            out.append(f"{r.workload}: `{name}` {r.runners[name].reason}")
        out += [f"{r.workload}: {note}" for note in r.notes]
    return out


def _md_table(head, body) -> list[str]:
    lines = ["| " + " | ".join(head) + " |"]
    lines.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|")
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def markdown(results: list[BenchResult], info: dict | None = None, command: str = "") -> str:
    out = []
    if info:
        out.append(
            f"Machine: {info['cpu']}, {info['nproc']} cores; onnxruntime {info['onnxruntime']}, "
            f"numpy {info['numpy']}, numba {info['numba']}, Python {info['python']}."
        )
    if command:
        out.append(f"Command: `{command}`")
    if results:
        out.append(f"Threads: {results[0].threads} for every runner.")
    out += ["", f"**{TIMES_TITLE}**", "", *_md_table(*time_rows(results))]
    out += ["", f"**{DETAILS_TITLE}**", "", *_md_table(*detail_rows(results)), ""]
    out += legend()
    out += [f"- {line}" for line in notes(results)]
    return "\n".join(out) + "\n"


def write_json(results: list[BenchResult], path, info: dict | None = None, **extra) -> None:
    doc = {"machine": info or machine(), **extra, "workloads": [r.to_dict() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"{type(value)} is not JSON serializable")


def write_markdown(results, path, info: dict | None = None, command: str = "") -> None:
    Path(path).write_text(markdown(results, info, command))


def write_plot(results: list[BenchResult], path, title: str = "") -> None:
    """PNG bar chart: each runner's speedup over onnxruntime without optimizations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in RUNNERS if n != ORT_NONE]
    colors = {ORT_ALL: "#7f7f7f", FUSED: "#d62728", ORT_FUSED: "#1f77b4", NATIVE: "#2ca02c"}
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results) + 2), 4.5))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(results))]
        ys = [r.speedup(ORT_NONE, of=name) or 0.0 for r in results]
        if any(ys):
            ax.bar(xs, ys, width, label=RUNNERS[name], color=colors[name])
    for i, r in enumerate(results):
        for name in r.refused:  # where its bar would be
            x = i + (names.index(name) - (len(names) - 1) / 2) * width if name in names else i
            ax.annotate(f"{name}: refused", (x - width / 4, 0.05), rotation=90, fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r.workload for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup over onnxruntime ORT_DISABLE_ALL (median)")
    ax.set_title(title or "fusion benchmark", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
