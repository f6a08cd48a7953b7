"""kernels/pointwise.py against a naive NumPy version: per-channel scale and shift, a per-image
gate, a residual before or after, every activation; NCHW, [N, C, L] and blocked tensors at
blocks of 8 and 16 (both widths in one process), with channel counts that fill whole blocks
of both (32), of 8 only (8, 24), and of neither (5, 12)."""

import math

import numpy as np
import pytest
from helpers import assert_close

from fusion_kernels.blocked import from_blocked, to_blocked
from fusion_kernels.pointwise import pointwise, pointwise_blocked, prepare_pointwise

ACTS = {
    None: lambda v: v,
    "relu": lambda v: np.maximum(v, 0),
    "leaky_relu": lambda v: np.where(v >= 0, v, 0.1 * v),
    "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
    "silu": lambda v: v / (1 + np.exp(-v)),
    "hard_sigmoid": lambda v: np.clip(0.3 * v + 0.4, 0, 1),
    "hard_swish": lambda v: v * np.clip(v / 6 + 0.5, 0, 1),
    "tanh": np.tanh,
    "gelu": lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2))),
    "clip": lambda v: np.clip(v, -0.5, 0.7),
}
PARAMS = {"leaky_relu": dict(alpha=0.1), "hard_sigmoid": dict(alpha=0.3, beta=0.4),
          "clip": dict(clip_min=-0.5, clip_max=0.7)}  # fmt: skip
BLOCKS = [8, 16]
SHAPES = [(2, 12, 5, 7), (1, 8, 3, 3), (3, 5, 11), (1, 32, 2, 3), (2, 24, 3, 1), (1, 5, 4, 4)]


def naive(x, scale, shift, act, residual, r, gate):
    """The same op in float64 on an NCHW (or [N, C, L]) x."""
    n, c = x.shape[:2]
    per = (1, c) + (1,) * (x.ndim - 2)
    s = scale.reshape(per)
    if gate is not None:  # the gate multiplies the scale, not the shift
        s = s * gate.reshape(n, c, *per[2:])
    v = x.astype(np.float64) * s + shift.reshape(per)
    if residual == "before":
        v = v + r
    v = ACTS[act](v)
    return v + r if residual == "after" else v


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("residual", [None, "before", "after"])
def test_matches_naive(act, residual):
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        c = shape[1]
        x = rng.standard_normal(shape).astype(np.float32)
        r = rng.standard_normal(shape).astype(np.float32)
        scale, shift = rng.standard_normal(c), rng.standard_normal(c)
        plan = prepare_pointwise(c, scale, shift, activation=act, residual=residual,
                                 **PARAMS.get(act, {}))  # fmt: skip
        want = naive(x, scale, shift, act, residual, r, None)
        got = pointwise(x, plan, residual=r if residual else None)
        assert_close(got, want, 1e-5, 1e-5, check_dtype=False, what=f"NCHW {shape}")
        for block in BLOCKS if x.ndim == 4 else []:
            rb = to_blocked(r, block=block) if residual else None
            yb = pointwise_blocked(to_blocked(x, block=block), plan, residual=rb)
            assert yb.shape[-1] == block
            got = from_blocked(yb, c)
            assert_close(got, want, 1e-5, 1e-5, check_dtype=False, what=f"block {block} {shape}")


def test_gate_in_place_and_errors():
    """A squeeze-excitation gate per image and channel; out=x runs in place."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 12, 4, 4)).astype(np.float32)
    gate = rng.uniform(0, 1, (2, 12)).astype(np.float32)
    scale, shift = np.full(12, 1.0), np.zeros(12)
    plan = prepare_pointwise(12, gated=True)
    want = naive(x, scale, shift, None, None, None, gate)
    for block in BLOCKS:
        got = from_blocked(pointwise_blocked(to_blocked(x, block=block), plan, gate=gate), 12)
        assert_close(got, want, 1e-6, 1e-6, check_dtype=False, what=f"block {block}")
    y = x.copy()
    assert pointwise(y, plan, gate=gate, out=y) is y
    assert_close(y, want, 1e-6, 1e-6, check_dtype=False)
    with pytest.raises(ValueError, match="the gate must be"):
        pointwise(x, plan, gate=gate[:1])
    with pytest.raises(ValueError, match="the residual must be"):
        pointwise(x, prepare_pointwise(12, residual="after"), residual=x[:1])
    with pytest.raises(ValueError, match="channel planes, the plan is for 8"):
        pointwise(x, prepare_pointwise(8))
    with pytest.raises(ValueError, match="blocks of 3 channels"):
        pointwise_blocked(to_blocked(x, block=3), plan, gate=gate)
    with pytest.raises(ValueError, match="residual must be one of"):
        prepare_pointwise(8, residual="sideways")
