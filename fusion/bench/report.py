"""Results for people and programs: terminal tables, Markdown, JSON and a PNG bar chart.

Every form names the machine and the command (fusion.bench.machine) and how the runners were
timed (each in its own process, or all in one: the quick mode). The terminal tables read at 80
columns: one runner per row, the details as name-value rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fusion.bench.machine import cpu_line, machine, machine_lines
from fusion.bench.result import BenchResult
from fusion.bench.runners import (
    FUSED,
    NATIVE,
    ORT_ALL,
    ORT_FUSED,
    ORT_NONE,
    RUNNERS,
    runner_label,
)
from fusion.bench.traffic import describe
from fusion.runtime import describe_race

TOP_STEPS = 8  # profile rows shown in a terminal or Markdown (the JSON has them all)
WIDE = 160  # columns from which the terminal also gets the one-row-per-workload summary


# A figure is at most 3 significant digits with a unit that keeps it below 1000, so a column
# of them has a bounded width whatever the machine measures (the tables must read at 80
# columns: one runner per row, its name whole).
_TIME_UNITS = (("ns", 1e-6), ("µs", 1e-3), ("ms", 1.0), ("s", 1e3))  # unit, its size in ms
_RATE_PREFIXES = ("", "k", "M", "G", "T")


def _scaled(value: float, units) -> str:
    """`value` in the first of `units` ((suffix, its size), smallest first) that keeps its 3
    significant digits below 1000; the last takes any size."""
    for unit, size in units:
        shown = float(f"{value / size:.3g}")  # rounded first: 999.7 ms shows as 1s
        if shown < 1000:
            return f"{shown:.3g}{unit}"
    return f"{shown:.0f}{unit}"


def _time(ms: float) -> str:
    """A duration given in ms: 7.12µs, 412ms, 1.5s, 123s (at most 6 characters below a day)."""
    return _scaled(ms, _TIME_UNITS)


def _ms(result: BenchResult, name: str) -> str:
    info = result.runners.get(name)
    if info is None:
        return "-"
    if not info.ok:
        return "refused" if info.reason.startswith("wrong") else "failed"
    s = result.timing.stats(name)
    return f"{_time(s['median_ms'])} [{_time(s['min_ms'])}-{_time(s['max_ms'])}]"


def _x(value: float | None) -> str:
    """A ratio: 1.25x, 312x, 1.74e+07x (at most 9 characters)."""
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 100 else f"{value:.3g}x"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _rate(per_s: float | None) -> str:
    """Items per second, 3 significant digits: 3.25, 412, 31k, 130G."""
    if per_s is None:
        return "-"
    return _scaled(per_s, [(p, 1000.0**i) for i, p in enumerate(_RATE_PREFIXES)])


def _fused(result: BenchResult) -> str:
    return ", ".join(f"{k} {v}" for k, v in result.fused.items()) or "none"


def modes(results: list[BenchResult]) -> str:
    """How the runners were timed, one phrase for all results."""
    texts = sorted({r.timing.describe().split(";")[0] for r in results})
    return "; ".join(texts)


def time_rows(results: list[BenchResult]) -> tuple[list[str], list[list[str]]]:
    """Time per run of every runner, and fusion's speedups: header and one row per workload."""
    head = ["workload", "fused nodes", *RUNNERS, "fusion vs ort-all", "vs ort-none", "vs native"]
    body = []
    for r in results:
        body.append([
            r.workload,
            _fused(r),
            *(_ms(r, n) for n in RUNNERS),
            _x(r.speedup(ORT_ALL)),
            _x(r.speedup(ORT_NONE)),
            _x(r.speedup(NATIVE)) if NATIVE in r.runners else "-",
        ])  # fmt: skip
    return head, body


def runner_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """One row per runner: median, min-max, p90, p99 (each with its unit), throughput, and how
    many times faster than onnxruntime at its defaults (ort-all)."""
    head = ["runner", "median", "min-max", "p90", "p99", "items/s", "vs ort-all"]
    body = []
    base = result.median(ORT_ALL)
    for name, info in result.runners.items():
        if not info.ok:
            body.append([name, "refused" if info.reason.startswith("wrong") else "failed",
                         "", "", "", "", ""])  # fmt: skip
            continue
        s = result.timing.stats(name)
        body.append([
            name,
            _time(s["median_ms"]),
            f"{_time(s['min_ms'])}-{_time(s['max_ms'])}",
            _time(s["p90_ms"]),
            _time(s["p99_ms"]),
            _rate(result.throughput(name)),
            _x(base / result.median(name)) if base else "-",
        ])  # fmt: skip
    return head, body


def summary_rows(results: list[BenchResult]) -> tuple[list[str], list[list[str]]]:
    """One row per workload for a set of real models: fusion against onnxruntime at its
    defaults, the share of conv FLOPs fusion's own kernels run and of all counted FLOPs (Conv,
    MatMul, Gemm, LSTM: a transformer's products), islands, how many fused nodes are slower
    than onnxruntime on their own body, and the megabytes of activations the depth-first
    blocks move per run as run (and op by op): fusion.bench.traffic."""
    head = ["model", "batch", "fused nodes", "fusion", "ort-all", "fusion vs ort-all",
            "conv FLOPs in kernels", "FLOPs in kernels", "islands", "slower nodes",
            "block traffic MB (op by op)"]  # fmt: skip
    body = []
    for r in results:
        share, share_all = r.conv.get("share_in_kernels"), r.conv.get("share_all_in_kernels")
        body.append([
            r.workload,
            str(r.batch),
            str(sum(r.fused.values())),
            _ms(r, FUSED),
            _ms(r, ORT_ALL),
            _x(r.speedup(ORT_ALL)),
            "-" if share is None else f"{share:.0%}",
            "-" if share_all is None else f"{share_all:.0%}",
            str(r.profile.get("islands", "-")),
            f"{len(r.slower_nodes)} of {len(r.nodes)}" if r.nodes else "-",
            (f"{r.traffic['mb_as_run']:.1f} ({r.traffic['mb_op_by_op']:.1f})"
             if r.traffic else "-"),
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


def step_rows(result: BenchResult, top: int | None = TOP_STEPS) -> tuple[list, list]:
    """fusion's run step by step, slowest first: fused nodes (with the kernel that runs them)
    and onnxruntime islands, with their share of the run."""
    head = ["step", "runs", "time", "share"]
    steps = result.profile.get("steps", [])
    body = [
        [s["name"], s["runs"] + (f" ({s['nodes']} nodes)" if s["kind"] == "island" else ""),
         _time(s["seconds"] * 1e3), f"{s['share']:.0%}"]
        for s in steps[:top]
    ]  # fmt: skip
    if top is not None and len(steps) > top:
        rest = steps[top:]
        share = sum(s["share"] for s in rest)
        ms = sum(s["seconds"] for s in rest) * 1e3
        body.append([f"{len(rest)} more steps", "", _time(ms), f"{share:.0%}"])
    return head, body


def node_rows(result: BenchResult, top: int | None = TOP_STEPS) -> tuple[list, list]:
    """Each fused node alone against onnxruntime on its own function body: slowest kernels
    first, and every node that is slower than its body."""
    head = ["fused node", "kernel", "time", "ort time", "speedup"]
    nodes = result.nodes if top is None else [
        n for i, n in enumerate(result.nodes) if i < top or n["slower"]
    ]  # fmt: skip
    body = [
        [n["name"], n["runs"], _time(n["kernel_ms"]), _time(n["onnxruntime_ms"]),
         _x(n["speedup"]) + (" SLOWER" if n["slower"] else "")]
        for n in nodes
    ]  # fmt: skip
    return head, body


def detail_pairs(result: BenchResult) -> list[tuple[str, str]]:
    """The details of one workload as (what, value) rows: readable at any width."""
    head, body = detail_rows([result])
    pairs = list(zip(head[1:], body[0][1:], strict=True))
    p, c = result.profile, result.conv
    if p:
        pairs.append(("kernels / islands", f"{p['kernels']} / {p['islands']}"))
    if p.get("race"):
        pairs.append(("whole plan", describe_race(p["race"])))
    if c.get("share_in_kernels") is not None:
        pairs.append(("conv FLOPs in fusion's kernels",
                      f"{c['share_in_kernels']:.0%} ({c['convs_in_kernels']} of {c['convs']} "
                      "convs)"))  # fmt: skip
    if c.get("share_all_in_kernels") is not None:
        pairs.append(
            (
                "FLOPs in fusion's kernels (Conv, MatMul, Gemm, LSTM)",
                f"{c['share_all_in_kernels']:.0%} of {c['gflop_counted']:.3f} GFLOP",
            )
        )
    if result.traffic:
        pairs.append(("activations the depth-first blocks move per run (estimate)",
                      describe(result.traffic)))  # fmt: skip
    return [(k, v) for k, v in pairs if v not in ("-", "- / -", "-/-/-/-/-")]


TIMES_TITLE = "time per run: median [min-max]"
DETAILS_TITLE = "fusion's run: throughput, time split (Session.profile), compile, memory"


def header_lines(results: list[BenchResult], info: dict) -> list[str]:
    """The machine, the command and how the runners were timed."""
    lines = machine_lines(info)
    if results:
        lines.append(f"timing: {results[0].timing.describe()}")
    return lines


def rich_tables(results: list[BenchResult], width: int = 80):
    """Terminal tables for `width` columns: per workload, one runner per row, the details as
    name-value rows, the slowest steps and the fused nodes against their bodies; on wide
    terminals also the one-row-per-workload summary."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    def table(title, head, body, right_from=1, whole=None):
        """whole: the columns never wrapped (default: the figures, from right_from on); when
        the table is too wide rich narrows the others, folding their text."""
        whole = range(max(right_from, 1), len(head)) if whole is None else whole
        t = Table(title=escape(title), box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for i, h in enumerate(head):
            t.add_column(escape(h), justify="right" if i >= right_from else "left",
                         overflow="fold", no_wrap=i in whole)  # fmt: skip
        for row in body:
            t.add_row(*(escape(c) for c in row))
        return t

    out = []
    for r in results:
        # A runner's name stays whole: its figures fold first (their width is bounded: _time).
        out.append(table(f"{r.workload} ({_fused(r)}), batch {r.batch}: time per run",
                         *runner_rows(r), whole=(0,)))  # fmt: skip
        out.append(table(f"{r.workload}: details", ["what", "value"],
                         [list(p) for p in detail_pairs(r)], right_from=2))  # fmt: skip
        if r.profile.get("steps"):
            out.append(table(f"{r.workload}: fusion's run by step, slowest first",
                             *step_rows(r), right_from=2))  # fmt: skip
        if r.nodes:
            out.append(table(f"{r.workload}: each fused node alone vs onnxruntime on its body",
                             *node_rows(r), right_from=2))  # fmt: skip
    if width >= WIDE and len(results) > 1:
        out.append(table(TIMES_TITLE, *time_rows(results), right_from=2))
    return out


def legend(mode: str) -> list[str]:
    lines = [f"- `{n}`: {runner_label(n, mode)}" for n in RUNNERS]
    lines += [
        "- `vs X`: median of X / median of fusion (above 1: fusion is faster)",
        "- medians, min and max over every timed call; p90, p99: percentiles of them; items/s: "
        "the batch over the median",
        "- GFLOP/s: the original model's Conv/MatMul/Gemm/LSTM FLOPs over fusion's median "
        "(best: fastest) run; SGEMM: numpy float32 on the workload's heaviest GEMM shape, "
        "same threads, same rounds; of SGEMM: median vs median / best vs best",
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
    """Refusals, failures, slower fused nodes and notes, one line each."""
    out = []
    for r in results:
        for name in r.refused:
            out.append(f"{r.workload}: `{name}` {r.runners[name].reason}")
        out += [f"{r.workload}: {note}" for note in r.notes]
    return out


def _md_table(head, body, left: int = 2) -> list[str]:
    lines = ["| " + " | ".join(head) + " |"]
    lines.append("|" + "|".join("---" if i < left else "---:" for i in range(len(head))) + "|")
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def markdown_header(results: list[BenchResult], info: dict) -> list[str]:
    """The machine, the command and how the runners were timed, as Markdown lines."""
    out = [f"Machine: {cpu_line(info)}; onnxruntime {info['onnxruntime']}, numba "
           f"{info['numba']}, numpy {info['numpy']}, Python {info['python']}."]  # fmt: skip
    if info.get("command"):
        out.append(f"Command: `{info['command']}`")
    if results:
        out.append(f"Timing: {results[0].timing.describe()}.")
    return out


def markdown(results: list[BenchResult], info: dict | None = None, command: str = "") -> str:
    info = dict(info or machine())
    if command:
        info["command"] = command
    out = markdown_header(results, info)
    out += ["", f"**{TIMES_TITLE}**", "", *_md_table(*time_rows(results))]
    out += ["", f"**{DETAILS_TITLE}**", "", *_md_table(*detail_rows(results)), ""]
    for r in results:
        out += [f"**{r.workload}: each runner, time per run (items/s: the batch over the median)**",
                "", *_md_table(*runner_rows(r), left=1), ""]  # fmt: skip
        if r.profile.get("steps"):
            out += [f"**{r.workload}: fusion's run by step, slowest first**", "",
                    *_md_table(*step_rows(r), left=2), ""]  # fmt: skip
        if r.slower_nodes:
            out += [f"**{r.workload}: fused nodes slower than onnxruntime on their own body**",
                    "", *_md_table(*node_rows(r, top=0), left=2), ""]  # fmt: skip
    for mode in sorted({r.mode for r in results}):
        out += legend(mode)
    out += [f"- {line}" for line in notes(results)]
    return "\n".join(out) + "\n"


def write_json(results: list[BenchResult], path, info: dict | None = None, **extra) -> None:
    info = dict(info or machine())
    if extra.get("command"):
        info["command"] = extra["command"]
    doc = {"machine": info, **extra, "workloads": [r.to_dict() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"{type(value)} is not JSON serializable")


def write_markdown(results, path, info: dict | None = None, command: str = "") -> None:
    Path(path).write_text(markdown(results, info, command))


def write_plot(results: list[BenchResult], path, title: str = "", info: dict | None = None):
    """PNG bar chart: each runner's speedup over onnxruntime at its defaults (ort-all), with the
    machine, the command and the timing mode written under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = info or machine()
    names = [n for n in RUNNERS if n != ORT_ALL]
    colors = {ORT_NONE: "#7f7f7f", FUSED: "#d62728", ORT_FUSED: "#1f77b4", NATIVE: "#2ca02c"}
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(results) + 2), 5.2))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(results))]
        ys = [r.speedup(ORT_ALL, of=name) or 0.0 for r in results]
        if any(ys):
            label = "; ".join(sorted({runner_label(name, r.mode) for r in results}))
            ax.bar(xs, ys, width, label=label, color=colors[name])
    for i, r in enumerate(results):
        for name in r.refused:  # where its bar would be
            x = i + (names.index(name) - (len(names) - 1) / 2) * width if name in names else i
            ax.annotate(f"{name}: refused", (x - width / 4, 0.05), rotation=90, fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r.workload for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup over ort-all, onnxruntime ORT_ENABLE_ALL (median)")
    ax.set_title(title or "fusion benchmark", fontsize=9)
    ax.legend(fontsize=7)
    caption = [*machine_lines(info), modes(results)]
    fig.text(0.01, 0.01, "\n".join(caption), fontsize=6, va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
