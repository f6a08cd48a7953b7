"""Fuzzing the rewriter: random models made of catalog patterns, their variants and near-misses
(tests/strategies.py).

For every model: the rewrite passes the full ONNX checker, exactly the clean blocks are fused
(near-misses never), onnxruntime gives the same outputs on the rewritten and the original model,
and so does fusion.Session (kernels included). The default run is 200 examples; a longer one:

    FUSION_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py
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
