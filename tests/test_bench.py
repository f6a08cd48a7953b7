"""fusion.bench on tiny models: every runner is verified against onnxruntime, a kernel that gives
wrong numbers is refused (no speed reported for it), and the JSON / Markdown / PNG outputs are
written and well-formed. Child-process measurements (peak memory, compile time cold and cached)
run once, on a rule with a NumPy kernel so that nothing slow compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import os
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusion import bench
from fusion.bench import (
    FUSED,
    NATIVE,
    ORT_ALL,
    ORT_FUSED,
    ORT_NONE,
    PROCESSES,
    SAME_PROCESS,
    Options,
    RunnerInfo,
    Timing,
    Workload,
)
from fusion.catalog import Catalog
from fusion.cli import bench as bench_command
from fusion.cli import main
from fusion.modelfile import save_model
from fusion.models import LSTMWeights, conv_stack, conv_stack_flops, native_lstm
from fusion.models.builder import GraphBuilder
from fusion_kernels.blocked import block
from fusion_patterns import conv

FAST = dict(threads=1, rounds=3, min_rounds=2, budget=0.0, warmup=1, repeat=2, memory=False,
            compile=False, mode=SAME_PROCESS, node_rounds=2, warm=0.01)  # fmt: skip


def tiny_conv(batch=1):
    model = conv_stack(blocks=2, channels=4, size=6, batch=batch, form="tf")
    x = np.random.default_rng(0).standard_normal((batch, 4, 6, 6)).astype(np.float32)
    return model, {"input": x}


def wrong_kernel(attrs, constants):
    """The real ConvBiasRelu kernel, plus 0.5 everywhere."""
    run = conv.make_kernel(attrs, constants)
    return lambda *args: tuple(y + np.float32(0.5) for y in run(*args))


def slow_kernel(attrs, constants):
    """The real ConvBiasRelu kernel, 20 ms late: right numbers, slower than onnxruntime."""
    run = conv.make_kernel(attrs, constants)

    def late(*args):
        time.sleep(0.02)
        return run(*args)

    return late


def test_flops_of_a_product_whose_shape_only_a_run_gives(monkeypatch):
    """A MatMul after a Reshape to a fed target (as a TorchScript transformer's reshapes are
    Shape arithmetic on its token ids): inference leaves its shapes unknown, so they come from
    one onnxruntime run on the feeds; without that run the node is named as not counted."""
    nodes = [helper.make_node("Reshape", ["x", "t"], ["r"]),
             helper.make_node("MatMul", ["r", "W"], ["y"])]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
         helper.make_tensor_value_info("t", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((8, 16), np.float32), "W")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.zeros((6, 8), np.float32), "t": np.array([3, 16], np.int64)}
    w16 = numpy_helper.from_array(np.zeros((16, 16), np.float32), "W")
    model.graph.initializer[0].CopyFrom(w16)  # [3, 16] x [16, 16]
    flops = bench.count_flops(model, feeds)
    assert flops.by_op == {"MatMul": 2 * 3 * 16 * 16} and flops.notes == []
    from fusion.modelfile import shapes_from_a_run

    assert shapes_from_a_run(model, ["r", "r"], feeds) == {"r": ((3, 16), np.float32)}
    assert shapes_from_a_run(model, ["r"], {"x": feeds["x"]}) == {}  # the run fails: no shapes
    import fusion.bench.flops as flops_module

    monkeypatch.setattr(flops_module, "shapes_from_a_run", lambda *a, **k: {})  # a failed run
    flops = bench.count_flops(model, feeds)
    assert flops.by_op == {} and flops.notes == [
        "1 Conv/MatMul/Gemm/LSTM nodes of unknown shape not counted"
    ]


def test_flops_of_conv_stack_match_the_closed_form():
    model, feeds = tiny_conv(batch=3)
    flops = bench.count_flops(model, feeds)
    assert flops.total == conv_stack_flops(blocks=2, channels=4, size=6, batch=3)
    assert flops.gemm_shape == (4, 36, 3 * 36)  # [M, C*kh*kw] x [C*kh*kw, N*OH*OW]


def test_flops_of_matmul_gemm_and_native_lstm():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Gemm", ["m", "V"], ["y"], transB=1),
    ]
    inits = [
        numpy_helper.from_array(np.zeros((8, 16), np.float32), "W"),
        numpy_helper.from_array(np.zeros((5, 16), np.float32), "V"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    flops = bench.count_flops(model, {"x": np.zeros((4, 8), np.float32)})
    assert flops.by_op == {"MatMul": 2 * 4 * 8 * 16, "Gemm": 2 * 4 * 16 * 5}
    w = LSTMWeights.random(6, 5)
    native = native_lstm(w, steps=3, batch=2)
    feeds = {"X": np.zeros((3, 2, 6), np.float32)}
    assert bench.count_flops(native, feeds).by_op == {"LSTM": 2 * 3 * 2 * 20 * (6 + 5)}


def test_measure_verifies_and_times_every_runner():
    model, feeds = tiny_conv()
    result = bench.measure(Workload("tiny", model, feeds), Options(**FAST))
    assert result.fused == {"ConvBiasRelu": 2}
    assert result.refused == [] and result.mode == SAME_PROCESS
    assert set(result.timing.times) == {ORT_NONE, ORT_ALL, FUSED, ORT_FUSED}
    assert all(len(t) == 2 * result.timing.rounds >= 4 for t in result.timing.times.values())
    assert result.speedup(ORT_NONE) > 0 and result.gflops(FUSED) > 0
    assert result.sgemm["gflops"] > 0 and result.sgemm["shape_mkn"] == [4, 36, 36]
    assert result.profile["kernels"] == 2 and result.profile["wall_s"] > 0
    # in one process onnxruntime's workers must not spin into the next runner's turn
    assert result.runners[ORT_ALL].settings == "default-no-spin"
    assert result.runners[ORT_ALL].spinning == "0"
    assert {r.pid for r in result.runners.values()} == {os.getpid()}
    steps = result.profile["steps"]
    assert [s["seconds"] for s in steps] == sorted((s["seconds"] for s in steps), reverse=True)
    assert sum(s["share"] for s in steps) == pytest.approx(1.0)
    assert {s["runs"] for s in steps if s["kind"] == "kernel"} == {
        "ConvBiasRelu (blocked-f1)"
    }  # 8 channels: one block
    assert [n["runs"] for n in result.nodes] == ["ConvBiasRelu (blocked-f1)"] * 2
    assert result.conv["convs"] == result.conv["convs_in_kernels"] == 2
    assert result.conv["share_in_kernels"] == 1.0
    head, (row,) = bench.summary_rows([result])
    summary = dict(zip(head, row, strict=True))
    assert summary["conv FLOPs in kernels"] == "100%" and summary["islands"] == "0"
    assert summary["FLOPs in kernels"] == "100%"  # its only counted nodes are the two convs
    assert summary["slower nodes"].endswith(" of 2")


def load_script(name: str):
    """A bench/ script as a module (bench/ is a folder of scripts, not a package)."""
    path = Path(__file__).parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_models_summarises_each_model_and_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))  # its `import zoo`
    models = load_script("models")
    monkeypatch.setenv("COLUMNS", "200")
    save_model(conv_stack(blocks=2, channels=4, size=6, batch="N", form="tf"), tmp_path / "c.onnx")
    out = tmp_path / "m.json"
    argv = [str(tmp_path / "c.onnx"), "--batch", "1", "2", "--threads", "1", "--rounds", "2"]
    argv += ["--repeat", "1", "--budget", "0", "--same-process", "--node-rounds", "1"]
    assert models.main([*argv, "--json", str(out), "--markdown", str(tmp_path / "m.md")]) == 0
    doc = json.loads(out.read_text())
    assert [w["workload"] for w in doc["workloads"]] == ["c b1", "c b2"]
    assert [w["batch"] for w in doc["workloads"]] == [1, 2]
    assert all(w["conv"]["share_in_kernels"] == 1.0 for w in doc["workloads"])
    md = (tmp_path / "m.md").read_text()
    assert "| c b2 | 2 | 2 |" in md and "conv FLOPs in kernels" in md and "Machine: " in md


def test_cnn_coverage_checks_each_model(tmp_path, capsys, monkeypatch):
    """bench/cnn_coverage.py on a file: the row (fused convs, islands, the kernels' outputs
    against onnxruntime) and the JSON."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))  # its `import zoo`
    script = load_script("cnn_coverage")
    save_model(conv_stack(blocks=2, channels=4, size=6, batch="N"), tmp_path / "c.onnx")
    out = tmp_path / "rows.json"
    assert script.main([str(tmp_path / "c.onnx"), "--batch", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["convs"], row["fused_convs"], row["islands"]) == (2, 2, 0)
    assert row["verify_ok"] and row["max_rel_to_scale"] < 1e-5
    assert "| c.onnx | 2/2 | 0 | rel err" in capsys.readouterr().out


def test_bench_models_times_the_model_beside_as_native_on_the_inputs_given_as_ones(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))  # its `import zoo`
    models = load_script("models")
    model = conv_stack(blocks=2, channels=4, size=6, batch="N", form="tf")
    save_model(model, tmp_path / "c.onnx")
    save_model(model, tmp_path / "c.alt.onnx")  # an equivalent model, as the optimizer's is
    out = tmp_path / "m.json"
    argv = [str(tmp_path / "c.onnx"), "--batch", "1", "--threads", "1", "--rounds", "2"]
    argv += ["--repeat", "1", "--budget", "0", "--same-process", "--no-nodes", "--ones", "input"]
    argv += ["--native", ".alt.onnx", "--runners", "ort-all", "fusion", "ort-native"]
    assert models.main([*argv, "--json", str(out)]) == 0
    (w,) = json.loads(out.read_text())["workloads"]
    assert set(w["runners"]) == {"ort-none", "ort-all", "fusion", "ort-native"}
    assert w["fusion_speedup_over"]["ort-native"] > 0 and "input all ones" in w["description"]
    with pytest.raises(SystemExit):
        models.main([str(tmp_path / "c.onnx"), "--native", ".missing.onnx"])
    assert ".missing.onnx: no such file" in capsys.readouterr().err


def test_bench_attention_times_the_kernel_against_the_exporters_subgraph(tmp_path, capsys):
    attention = load_script("attention")
    fixture = Path(__file__).parent / "fixtures" / "bert_tiny.ts17.onnx"
    out = tmp_path / "a.json"
    argv = [str(fixture), "--layer", "1", "--seq", "16", "--threads", "1", "--rounds", "2"]
    argv += ["--repeat", "1", "--budget", "0", "--same-process", "--node-rounds", "1"]
    assert attention.main([*argv, "--json", str(out)]) == 0
    (w,) = json.loads(out.read_text())["workloads"]
    assert w["workload"] == "bert_tiny.ts17 attention 1" and w["fused_nodes"] == {"Attention": 1}
    assert w["fusion_speedup_over"]["ort-all"] > 0


def test_bench_winograd_times_direct_and_both_tiles_with_their_error(capsys):
    winograd = load_script("winograd")
    assert winograd.main(["--shapes", "8x5", "--rounds", "1", "--threads", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(" ")]
    runners = [r[1] for r in rows if r[0] == "8x5"]
    assert runners == ["direct", "wino2", "wino4", "ort"]
    errors = [float(r[-1]) for r in rows if r[0] == "8x5" and r[1] != "ort"]
    assert all(e < 1e-4 for e in errors)


def test_bench_convs_times_every_conv_by_class(tmp_path, capsys):
    """bench/convs.py on a model with a stem, a 3x3 + Relu conv twice (timed once) and a 1x1
    stride-2 conv with nothing after it (a projection conv: fused too)."""
    convs = load_script("convs")
    g = GraphBuilder()
    rng = np.random.default_rng(0)
    w = [g.const(rng.standard_normal(s).astype(np.float32) * 0.2)
         for s in ((8, 3, 3, 3), (8, 8, 3, 3), (8, 8, 3, 3), (16, 8, 1, 1))]  # fmt: skip
    h = g.node("Relu", [g.node("Conv", ["x", w[0]], pads=[1, 1, 1, 1])])
    for k in (1, 2):
        h = g.node("Relu", [g.node("Conv", [h, w[k]], pads=[1, 1, 1, 1])])
    y = g.node("Conv", [h, w[3]], strides=[2, 2])
    save_model(g.model({"x": ["N", 3, 8, 8]}, {y: None}), tmp_path / "m.onnx")
    out = tmp_path / "convs.json"
    argv = [str(tmp_path / "m.onnx"), "--threads", "1", "--rounds", "2", "--repeat", "1"]
    assert convs.main([*argv, "--json", str(out), "-q"]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu"] and doc["machine"]["command"]
    rows = doc["batches"]["1"]["convs"]
    assert [(r["class"], r["count"], bool(r["fused"])) for r in rows] == [
        ("stem kxk C<=4", 1, True), ("3x3 s1", 2, True), ("1x1 s2", 1, True)
    ]  # fmt: skip
    assert all(r["fusion_gflops"] > 0 and r["ort-all_gflops"] > 0 for r in rows)
    # a fused conv's kernel is timed alone, in its own layout, and named (the 1x1's 16 output
    # channels are two blocks of 8 with AVX2, one of 16 with AVX-512: its tile is f2 or f1)
    fb = -(-16 // block())
    assert [r.get("kernel", "") for r in rows] == ["ConvBiasRelu (blocked-f1)"] * 2 + [
        f"ConvBiasRelu (blocked-f{fb})"
    ]
    classes = {c["class"]: c for c in doc["batches"]["1"]["classes"]}
    assert sum(c["flop_share"] for c in classes.values()) == pytest.approx(1.0)
    assert classes["3x3 s1"]["median_ratio"] > 0 and classes["1x1 s2"]["not_fused"] == 0
    assert "| 3x3 s1 | 2 (1) |" in capsys.readouterr().out


def test_default_onnxruntime_runners_keep_spinning_each_in_its_own_process():
    """The headline mode: every runner in a worker process of its own, onnxruntime at
    fusion.ort.DEFAULT (its idle workers spin, as by default), the unfused oracle at REFERENCE."""
    model, feeds = tiny_conv()
    opts = Options(**{**FAST, "mode": PROCESSES})
    result = bench.measure(Workload("tiny", model, feeds), opts)
    assert result.refused == [] and result.mode == PROCESSES
    runners = result.runners
    pids = [r.pid for r in runners.values()]
    assert os.getpid() not in pids and len(set(pids)) == len(pids)
    for name in (ORT_ALL, ORT_FUSED):
        assert runners[name].settings == "default"
        assert runners[name].spinning == "default"  # the entry is unset: onnxruntime's own
    assert runners[ORT_NONE].settings == "reference"
    assert "each runner in its own process" in result.timing.describe()
    assert len(result.nodes) == 2 and all(n["onnxruntime_settings"] == "default"
                                          for n in result.nodes)  # fmt: skip


def test_a_worker_turn_ends_once_its_threads_stop_spinning():
    """settle waits out a thread that burns CPU (as onnxruntime's idle workers do after a run)
    and returns at once in a quiet process."""
    from fusion.bench.workers import settle

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    # On a loaded machine the spinning thread can be descheduled for settle's whole quiet spell
    # (30 ms): a wait cut short that way is tried again, at most three times.
    waits = []
    for _ in range(3):
        thread = threading.Thread(target=spin, args=(0.15,))
        thread.start()
        waits.append(settle(limit=2.0))
        thread.join()
        if 0.15 <= waits[-1] < 1.0:
            break
    assert 0.15 <= waits[-1] < 1.0, waits
    assert settle(limit=2.0) < 0.15


def test_a_fused_node_slower_than_its_body_is_flagged():
    model, feeds = tiny_conv()
    slow = Catalog([dataclasses.replace(conv.RULE, prepare=slow_kernel)])
    result = bench.measure(Workload("slow", model, feeds, catalog=slow), Options(**FAST))
    assert result.refused == []
    assert len(result.slower_nodes) == 2
    assert all(n["kernel_ms"] > 20 > n["onnxruntime_ms"] for n in result.slower_nodes)
    assert sum("slower than onnxruntime on its own body" in n for n in result.notes) == 2
    assert "SLOWER" in bench.markdown([result])


def test_wrong_kernel_is_refused_and_no_speed_is_reported(tmp_path):
    model, feeds = tiny_conv()
    bad = Catalog([dataclasses.replace(conv.RULE, prepare=wrong_kernel)])
    result = bench.measure(Workload("bad", model, feeds, catalog=bad), Options(**FAST))
    assert result.refused == [FUSED]
    assert result.runners[FUSED].reason.startswith("wrong numbers")
    assert result.runners[FUSED].max_abs >= 0.5 - 1e-6  # the last layer adds 0.5 at least
    assert FUSED not in result.timing.times
    assert result.speedup(ORT_NONE) is None and result.gflops(FUSED) is None
    assert result.runners[ORT_FUSED].ok  # the function bodies are right; only the kernel is not
    doc = result.to_dict()
    assert doc["refused"] == [FUSED] and "median_ms" not in doc["runners"][FUSED]
    assert doc["fusion_speedup_over"][ORT_ALL] is None
    text = bench.markdown([result])
    assert "| bad | ConvBiasRelu 2 |" in text and "refused" in text


def test_cli_writes_json_markdown_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    model = conv_stack(blocks=2, channels=4, size=6, batch="N", form="tf")
    path = tmp_path / "tiny.onnx"
    save_model(model, path)
    out = {k: tmp_path / f"out.{k}" for k in ("json", "md", "png")}
    argv = [str(path), "--threads", "1", "--rounds", "3", "--budget", "0", "--batch", "2"]
    argv += ["--same-process", "--repeat", "2", "--no-memory", "--no-compile"]
    argv += ["--json", str(out["json"]), "--markdown", str(out["md"]), "--plot", str(out["png"])]
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    monkeypatch.setattr("sys.argv", ["/usr/bin/fusion", "bench", *argv])  # as typed
    assert bench_command.execute(parser.parse_args(argv)) == 0
    doc = json.loads(out["json"].read_text())
    assert doc["machine"]["nproc"] >= 1 and doc["machine"]["cpu"]
    (w,) = doc["workloads"]
    assert w["workload"] == "tiny" and w["fused_nodes"] == {"ConvBiasRelu": 2}
    assert w["refused"] == [] and w["gflop_per_run"] == pytest.approx(2 * 2 * 16 * 9 * 36 * 2e-9)
    for name in (ORT_NONE, ORT_ALL, FUSED, ORT_FUSED):
        r = w["runners"][name]
        assert r["ok"] and r["min_ms"] <= r["median_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["p99_ms"] <= r["max_ms"]
        samples = np.array(r["samples_ms"])
        assert len(samples) == r["calls"] == w["rounds"] * w["calls_per_turn"]
        assert r["p90_ms"] == pytest.approx(np.percentile(samples, 90))
        assert r["throughput_per_s"] == pytest.approx(2 / (r["median_ms"] / 1e3))  # batch 2
    assert w["mode"] == "same process" and w["batch"] == 2
    m = doc["machine"]
    assert m["cpu"] and m["threads"] >= m["cores"] >= 1
    for key in ("cpu_family", "cpu_model", "stepping", "llvm_cpu"):
        assert key in m
    if m["vendor"] in ("AuthenticAMD", "GenuineIntel"):
        assert m["cpu_family"] > 0 and m["cpu_model"] is not None and m["llvm_cpu"]
        assert set(m["isa"]) <= {"avx512f", "avx2", "fma", "avx"}
    assert m["onnxruntime"] and m["numba"] and m["numpy"]
    assert m["command"].startswith("fusion bench ") and "--json" in m["command"]
    md = out["md"].read_text()
    assert "Machine: " in md and m["cpu"] in md and "Command: `fusion bench " in md
    assert "all runners in one process (quick mode)" in md
    lines = md.splitlines()
    tables = [ln for ln in lines if ln.startswith("| tiny |")]
    assert len(tables) == 2  # times and details
    header = next(ln for ln in lines if ln.startswith("| workload |"))
    assert all(ln.count("|") == header.count("|") for ln in tables[:1])
    assert "| runner | median | min-max | p90 | p99 | items/s | vs ort-all |" in lines
    assert sum(ln.startswith(f"| {name} | ") for ln in lines for name in w["runners"]) >= 4
    # Same-process mode: onnxruntime's ORT_ENABLE_ALL runners do not spin, and say so.
    assert "workers not spinning (same-process mode)" in w["runners"][ORT_ALL]["label"]
    assert "spinning)" not in md.replace("not spinning (same-process mode)", "")
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def fixed_result(batch: int = 1_000_000) -> bench.BenchResult:
    """A result with fixed, deliberately wide figures (5 significant digits and more, from 7 ns
    to 2 minutes, a speedup of 10^7, a rate of 10^11 items/s), every runner, one refused."""
    ms = {
        ORT_NONE: [0.0999449, 0.0082234, 1234.5678],
        ORT_ALL: [123456.7, 99.94, 123456.7],
        FUSED: [0.0071234, 0.0082234, 0.0071234],
        NATIVE: [9.99949, 0.00099949, 999.949],
    }
    runners = {n: RunnerInfo(n, ok=n in ms, reason="" if n in ms else "wrong numbers") for n in
               (ORT_NONE, ORT_ALL, FUSED, ORT_FUSED, NATIVE)}  # fmt: skip
    timing = Timing(1, 3, {n: [t / 1e3 for t in v] for n, v in ms.items()}, repeat=1)
    return bench.BenchResult(
        "a_model_with_a_rather_long_file_name_for_the_title", "fixed figures", threads=1,
        fused={"ConvBiasRelu": 2}, flops=10**9, timing=timing, runners=runners, batch=batch,
    )  # fmt: skip


def test_the_runner_table_reads_at_80_columns_whatever_the_figures():
    """One runner per row, its name whole; every line fits; no header cut into a stub."""
    from rich.console import Console

    result = fixed_result()
    console = Console(file=io.StringIO(), width=80, highlight=False)
    for table in bench.rich_tables([result], width=80):
        console.print(table)
    out = console.file.getvalue()
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, out
    assert "…" not in out and "..." not in out
    top = next((i for i, ln in enumerate(lines) if ln.split()[:1] == ["runner"]), None)
    assert top is not None, out
    assert lines[top].split() == ["runner", "median", "min-max", "p90", "p99", "items/s", "vs",
                                  "ort-all"]  # fmt: skip
    rows = [ln.split() for ln in lines[top + 2 : top + 2 + len(result.runners)]]
    assert [row[0] for row in rows] == list(result.runners), out  # one row each, names whole
    assert [len(row) for row in rows] == [7, 7, 7, 2, 7], out  # its figures, or "refused"
    assert lines[top + 2 + len(rows)].strip() == "", out  # and nothing wrapped onto more lines
    assert "7.12µs" in out and "123s" in out and "1.73e+07x" in out  # 3 significant digits


def test_fusion_bench_at_80_columns(tmp_path, capsys, monkeypatch):
    """The real command (its timings vary, so nothing here depends on their widths)."""
    monkeypatch.setenv("COLUMNS", "80")
    path = tmp_path / "a_model_with_a_rather_long_file_name_for_the_title.onnx"
    save_model(tiny_conv()[0], path)
    argv = ["bench", str(path), "--threads", "1", "--rounds", "2", "--budget", "0"]
    argv += ["--same-process", "--no-memory", "--no-compile"]
    monkeypatch.setattr("sys.argv", ["/usr/bin/fusion", *argv])
    assert main(argv) == 0
    out = capsys.readouterr().out
    words = out.split()
    assert all(name in words for name in (ORT_NONE, ORT_ALL, FUSED, ORT_FUSED)), out
    assert "CPU: " in out and "command: fusion bench " in out
    assert "building runners" not in out and "verifying" not in out  # no progress off a TTY
    assert "all runners in one process (quick mode)" in out
    assert "ConvBiasRelu 2" in out


def test_compare_times_on_the_bench_runners():
    """fusion.compare: the light front on the same runners and interleaved loop."""
    from fusion import compare

    model, feeds = tiny_conv()
    timing = compare(model, feeds, threads=1, rounds=3, warmup=1)
    assert timing.rounds == 3 and all(len(t) == 3 for t in timing.times.values())
    table = timing.table()
    for label in ("onnxruntime, optimizations disabled", "onnxruntime, ORT_ENABLE_ALL"):
        assert label in table
    assert "fusion.Session (fused)" in table and table.count("x\n") == 2


NEG_RELU = """
    import numpy as np
    from fusion.catalog import Rule
    from fusion.pattern import Var, op

    def make_kernel(attrs, constants):
        return lambda x: (np.maximum(-x, 0),)

    RULE = Rule("NegRelu", op.Relu(op.Neg(Var("x", dtype="float32"))), inputs=("x",),
                prepare=make_kernel)
"""


def test_child_processes_measure_memory_and_compile_time(tmp_path, monkeypatch):
    """A rules module named in the workload is rebuilt in the children (found on PYTHONPATH)."""
    (tmp_path / "negrelu_rules.py").write_text(textwrap.dedent(NEG_RELU))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Relu", ["n"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)}
    native = onnx.ModelProto()
    native.CopyFrom(model)  # stands in for a native-op twin
    workload = Workload("negrelu", model, feeds, rules=("negrelu_rules",), native=native)
    cache = {}
    opts = Options(**{**FAST, "memory": True, "compile": True})
    result = bench.measure(workload, opts, compile_cache=cache)
    assert result.fused == {"NegRelu": 1} and result.refused == []
    for name in (ORT_NONE, ORT_ALL, FUSED, ORT_FUSED, NATIVE):
        assert result.runners[name].peak_mb > 0, result.notes
    assert result.compile["cold_s"] > 0 and result.compile["cached_s"] > 0, result.compile
    assert list(cache) == ["NegRelu"]  # measured once per set of fused ops


def test_a_run_with_every_node_on_onnxruntime_has_no_node_rows(monkeypatch):
    # What the session's whole-plan race does when onnxruntime alone wins: no kernel to time.
    monkeypatch.setenv("FUSION_TACTICS", "onnxruntime")
    model, feeds = tiny_conv()
    result = bench.measure(Workload("tiny", model, feeds), Options(**FAST))
    assert result.refused == [] and result.nodes == []
    assert result.profile["kernels"] == 0 and result.conv["share_in_kernels"] == 0.0


def test_interleave_gives_every_runner_each_other_as_predecessor_equally_often():
    """Rounds in balanced orders (a Williams design): within rounds each runner follows each
    other equally often, as a rotation would not; every runner gets one turn per round."""
    from fusion.bench.timing import interleave

    turns = []

    class Runner:
        def __init__(self, name):
            self.name = name

        def turn(self, calls, warm=0.0):
            turns.append(self.name)
            return [0.001] * calls

    for names, rounds in ((["a", "b", "c", "d"], 12), (["a", "b", "c", "d", "e"], 10)):
        turns.clear()
        timing = interleave({n: Runner(n) for n in names}, rounds=rounds, warmup=0, repeat=2)
        assert timing.rounds == rounds and all(len(timing.times[n]) == 2 * rounds for n in names)
        k = len(names)
        orders = [turns[i : i + k] for i in range(0, len(turns), k)]
        assert all(sorted(r) == names for r in orders)
        pairs = Counter((r[i], r[i + 1]) for r in orders for i in range(k - 1))
        assert len(pairs) == k * (k - 1) and len(set(pairs.values())) == 1, pairs


def test_a_gap_puts_that_much_sleep_before_every_timed_call(monkeypatch):
    """--gap: runs spaced like requests. The warm-up calls go back to back, each timed call
    follows the gap's sleep, and the figures say so."""
    from fusion.bench.timing import interleave

    events = []
    monkeypatch.setattr(time, "sleep", lambda s: events.append(("sleep", s)))
    timing = interleave({"a": lambda: events.append("call")}, rounds=2, warmup=1, repeat=3,
                        gap=0.005)  # fmt: skip
    assert events == ["call"] + [("sleep", 0.005), "call"] * 6
    assert timing.describe().endswith("3 timed calls per turn, each after 5 ms asleep")
    assert timing.to_dict()["gap_s"] == 0.005


def test_a_gap_reaches_the_runners_that_time_themselves(monkeypatch):
    model, feeds = tiny_conv()
    naps = []
    sleep = time.sleep
    gap = 0.0037  # no other sleep of the bench's is this long
    monkeypatch.setattr(time, "sleep", lambda s: naps.append(s) if s == gap else sleep(s))
    result = bench.measure(Workload("tiny", model, feeds), Options(**FAST, gap=gap))
    timed = sum(len(t) for t in result.timing.times.values())
    assert result.refused == [] and result.timing.gap == gap
    assert len(naps) == timed >= 4 * 4  # one sleep before each timed call of every runner


def inverted_residual(c=8, e=48, hw=7, batch=2, gate=False):
    """x -> 1x1 expand + Relu -> depthwise 3x3 + Relu -> 1x1 project, + x: one block (or, with
    `gate`, squeeze-excitation alone: its convs read per-channel vectors, no block)."""
    rng = np.random.default_rng(3)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    g = GraphBuilder(opset=17)
    if gate:
        s = g.node("GlobalAveragePool", ["x"])
        s = g.node("Relu", [g.node("Conv", [s, g.const(w(4, c, 1, 1)), g.const(w(4))])])
        s = g.node("Sigmoid", [g.node("Conv", [s, g.const(w(c, 4, 1, 1)), g.const(w(c))])])
        y = g.node("Mul", ["x", s])
    else:
        t = g.node("Relu", [g.node("Conv", ["x", g.const(w(e, c, 1, 1)), g.const(w(e))])])
        t = g.node("Relu", [g.node("Conv", [t, g.const(w(e, 1, 3, 3)), g.const(w(e))],
                                   group=e, pads=[1, 1, 1, 1])])  # fmt: skip
        y = g.node("Add", [g.node("Conv", [t, g.const(w(c, e, 1, 1)), g.const(w(c))]), "x"])
    model = g.model({"x": ["N", c, hw, hw]}, {y: ["N", c, hw, hw]})
    return model, {"x": rng.standard_normal((batch, c, hw, hw)).astype(np.float32)}


def test_block_traffic_counts_the_tensors_between_a_blocks_convs():
    """fusion.bench.traffic: an inverted residual run depth first moves x and y; op by op it
    also writes and reads back e and d (2 x 48 x 7 x 7 floats each); a squeeze-excitation's
    per-channel vectors and a single conv's epilogue make no block."""
    from fusion.bench.flops import inferred_shapes
    from fusion.bench.traffic import block_traffic
    from fusion.registry import default_catalog
    from fusion.rewriter import Fusion, rewrite

    model, feeds = inverted_residual()
    rewritten = rewrite(model, default_catalog())
    (fused,) = rewritten.fusions
    assert fused.rule == "InvertedResidual"
    label = f"{fused.rule} {fused.node}"
    shapes = inferred_shapes(model, feeds)
    x, e = 4 * 2 * 8 * 49, 4 * 2 * 48 * 49  # bytes of x (and y), of e (and d)
    deep = block_traffic(model, rewritten.fusions, shapes,
                         [{"kind": "kernel", "name": label, "depth_first": True}])  # fmt: skip
    assert deep == {"blocks": 1, "depth_first": 1, "mb_as_run": 2 * x / 1e6,
                    "mb_op_by_op": (2 * x + 4 * e) / 1e6}  # fmt: skip
    flat = block_traffic(model, rewritten.fusions, shapes,
                         [{"kind": "kernel", "name": label, "depth_first": False}])  # fmt: skip
    assert flat["depth_first"] == 0 and flat["mb_as_run"] == flat["mb_op_by_op"]
    assert block_traffic(model, rewritten.fusions, shapes, []) == flat  # onnxruntime ran it
    # a later stage's node that replaced the block: counted once, as that node
    outer = Fusion("Outer", "outer", [label])
    ran = [{"kind": "kernel", "name": "Outer outer", "depth_first": True}]
    again = block_traffic(model, [*rewritten.fusions, outer], shapes, ran)
    assert again == deep

    gate, feeds = inverted_residual(gate=True)
    fused_gate = rewrite(gate, default_catalog())
    assert [f.rule for f in fused_gate.fusions] == ["SqueezeExcite"]
    assert block_traffic(gate, fused_gate.fusions, inferred_shapes(gate, feeds), []) == {}


def test_measure_reports_the_traffic_of_the_blocks_it_ran():
    """The bench's result and summary carry the estimate for the tactic the session ran (the
    profile row says whether it was depth first); a model without blocks shows '-'."""
    model, feeds = inverted_residual()
    result = bench.measure(Workload("block", model, feeds), Options(**FAST))
    (step,) = [s for s in result.profile["steps"] if s["kind"] == "kernel"]
    assert step["depth_first"] == ("depthfirst" in step["runs"])
    x, e = 4 * 2 * 8 * 49, 4 * 2 * 48 * 49
    as_run = 2 * x if step["depth_first"] else 2 * x + 4 * e
    assert result.traffic["mb_as_run"] == as_run / 1e6
    assert result.to_dict()["block_traffic"] == result.traffic
    head, (row,) = bench.summary_rows([result])
    summary = dict(zip(head, row, strict=True))
    assert (
        summary["block traffic MB (op by op)"]
        == f"{as_run / 1e6:.1f} ({(2 * x + 4 * e) / 1e6:.1f})"
    )
    model, feeds = tiny_conv()
    plain = bench.measure(Workload("tiny", model, feeds), Options(**FAST))
    assert plain.traffic == {}
    head, (row,) = bench.summary_rows([plain])
    assert dict(zip(head, row, strict=True))["block traffic MB (op by op)"] == "-"


def test_workers_named_last_start_once_the_others_are_built(monkeypatch):
    """fusion's session races its plan while it is built: its worker starts only when the
    others have finished building, so their start-up does not load that race."""
    import fusion.bench.workers as workers_module

    events = []

    class Built:
        def __init__(self, name, spec, env, progress):
            self.name = name
            events.append(("start", name))

        def take(self):
            events.append(("built", self.name))
            return True, {}

        def close(self):
            pass

    monkeypatch.setattr(workers_module, "Worker", Built)
    monkeypatch.setattr(workers_module, "wait", lambda conns, timeout=None: list(conns))
    specs = {"ort-none": {}, "fusion": {}, "ort-all": {}}
    ready, failed = workers_module.start_workers(specs, last=("fusion",))
    assert list(ready) == ["ort-none", "fusion", "ort-all"] and not failed  # specs' order
    assert events.index(("start", "fusion")) > max(events.index(("built", "ort-none")),
                                                   events.index(("built", "ort-all")))  # fmt: skip
    events.clear()
    workers_module.start_workers(specs)  # by default all at once
    assert [e for e in events if e[0] == "start"] == [("start", n) for n in specs]
    assert events.index(("start", "ort-all")) < events.index(("built", "ort-none"))
