"""Same input, same bytes (across processes and hash seeds); a second rewrite changes nothing;
Session.run from several threads at once gives what sequential calls give."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import onnx
from helpers import assert_close, control_flow_model, in_threads, save_external
from hypothesis import HealthCheck, given, settings
from strategies import models

import fusion
from fusion.modelfile import save_model
from fusion.models import conv_stack


def rewrite_in_a_process(src, dst, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}  # set and dict orders must not leak out
    cmd = [sys.executable, "-m", "fusion", "rewrite", str(src), "-o", str(dst)]
    subprocess.run(cmd, check=True, capture_output=True, env=env)


def test_byte_identical_across_processes(tmp_path):
    """A model with fusions, a pattern escaping into an If, Loop and Scan bodies; and the same
    conv stack with its weights as external data (model file and data file both identical)."""
    save_model(control_flow_model(), tmp_path / "cf.onnx")
    save_external(conv_stack(blocks=3, channels=8, size=6), tmp_path / "ext.onnx")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    for name in ("cf", "ext"):
        for run, seed in (("a", "1"), ("b", "2")):
            rewrite_in_a_process(tmp_path / f"{name}.onnx", tmp_path / run / f"{name}.onnx", seed)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files[:2] == ["cf.onnx", "ext.onnx"] and len(files) == 3
    assert files[2].startswith("ext.onnx.") and files[2].endswith(".data")  # named by content
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_rewriting_a_rewritten_model_is_a_no_op(case):
    model = case[0]
    once = fusion.rewrite(model).model
    again = fusion.rewrite(once)
    assert again.fusions == []
    assert again.model.SerializeToString(deterministic=True) == once.SerializeToString(
        deterministic=True
    )
    repeat = fusion.rewrite(model).model  # and the same input gives the same model
    assert repeat.SerializeToString(deterministic=True) == once.SerializeToString(
        deterministic=True
    )


def test_session_run_from_four_threads_equals_sequential_runs():
    model = conv_stack(blocks=3, channels=4, size=6)
    model.graph.node.append(onnx.helper.make_node("Sigmoid", [model.graph.output[0].name], ["s"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("s", 1, None))
    session = fusion.Session(model, threads=2)
    assert [s.kind for s in session.steps].count("kernel") == 3
    rng = np.random.default_rng(0)
    feeds = [
        {"input": rng.standard_normal((1 + k % 3, 4, 6, 6)).astype(np.float32)} for k in range(400)
    ]
    sequential = [session.run(None, f) for f in feeds]
    threaded: list = [None] * len(feeds)
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        start.wait()
        for k in range(t, len(feeds), 4):  # 100 calls each, interleaved with the others
            threaded[k] = session.run(None, feeds[k])

    in_threads(worker)
    for want, got in zip(sequential, threaded, strict=True):
        for w, g in zip(want, got, strict=True):
            assert_close(g, w, rtol=0, atol=0)
