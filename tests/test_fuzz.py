"""Fuzzing the rewriter: random models made of catalog patterns, their variants and near-misses
(tests/strategies.py); and the command line on corrupted model files (at the end).

For every model: the rewrite passes the full ONNX checker, exactly the clean blocks are fused
(near-misses never), onnxruntime gives the same outputs on the rewritten and the original model,
and so does fusion.Session (kernels included). The default run is the same 200 examples every
time (tests/conftest.py); a longer hunt on new ones:

    FUSION_FUZZ_RANDOM=1 FUSION_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py
"""

from __future__ import annotations

import os

import onnx
from helpers import assert_close, random_feeds, run_ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from strategies import models

import fusion
from fusion.cli import main
from fusion.models import conv_stack

EXAMPLES = int(os.environ.get("FUSION_FUZZ_EXAMPLES", "200"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(models(), st.integers(0, 2**16))
def test_rewrite_keeps_meaning_and_fuses_exactly_the_clean_blocks(case, seed):
    model, expected, batch = case
    result = fusion.rewrite(model)
    onnx.checker.check_model(result.model, full_check=True)
    assert {f.node: f.rule for f in result.fusions} == expected, result.explain()
    feeds = random_feeds(model, batch, seed)
    # onnxruntime's optimized float16 Conv (in Session's islands) may round a float16 value
    # one step differently from the unoptimized oracle: a float16 ulp is ~1e-3 relative.
    half = any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)
    rtol, atol = (5e-3, 1e-3) if half else (1e-4, 1e-5)
    want = run_ort(model, feeds)
    for got in (
        run_ort(result.model, feeds),
        fusion.Session(result.model, threads=1).run(None, feeds),
    ):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert_close(g, w, rtol, atol)


# ---- corrupted files -------------------------------------------------------------------------
# One bit flipped, or one byte replaced, anywhere in a small conv model's file: `fusion rewrite`
# and `fusion run` refuse it with exit 2 and one line, or work (exit 0, and a rewrite means what
# the damaged file means in onnxruntime). Longer, on new draws: FUSION_FUZZ_RANDOM=1
# FUSION_FUZZ_CORRUPTIONS=20000 (every bit of the 2 KB file about once).
CORRUPTIONS = int(os.environ.get("FUSION_FUZZ_CORRUPTIONS", "150"))
MODEL_FILE = conv_stack(blocks=2, channels=4, size=6).SerializeToString(deterministic=True)


@settings(
    max_examples=CORRUPTIONS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.integers(0, len(MODEL_FILE) - 1),
    st.one_of(
        st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), st.integers(0, 255).map(lambda b: -b)
    ),
    st.sampled_from(["rewrite", "run"]),
)
def test_a_corrupted_model_file_is_refused_in_one_line_or_works(
    tmp_path, capfd, pos, change, command
):
    data = bytearray(MODEL_FILE)
    data[pos] = data[pos] ^ change if change > 0 else -change  # a bit flipped, or a new byte
    src, out = (
        tmp_path / "damaged.onnx",
        tmp_path / ("out.onnx" if command == "rewrite" else "o.npz"),
    )
    src.write_bytes(bytes(data))
    out.unlink(missing_ok=True)
    capfd.readouterr()
    code = main([command, str(src), "-o", str(out)])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line and not line.startswith("fusion: warning: ")]
    assert code in (0, 2), err
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("fusion: error: "), err
        return
    assert lines == [], err
    if command == "run":
        return
    try:  # what the damaged file computes, if onnxruntime runs it at all
        feeds = random_feeds(onnx.load(str(src)))
        want = run_ort(src, feeds)
    except Exception:
        return
    for got, expected in zip(run_ort(out, feeds), want, strict=True):
        assert_close(got, expected, rtol=1e-4, atol=1e-5)
