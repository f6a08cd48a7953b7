"""fusion.numerics: the one array comparison (NaN, inf, shape, dtype, relative error near zero)
and the one tolerance rule."""

import numpy as np
import pytest

from fusion.numerics import DEFAULT_ATOL, DEFAULT_RTOL, accumulating, compare_arrays, tolerance
from fusion_patterns import conv, pool


def test_compare_arrays_handles_nan_inf_shape_and_dtype():
    nan, inf = np.nan, np.inf
    assert compare_arrays("v", [1.0, nan, inf], [1.0, nan, inf], 0, 0).ok
    bad = compare_arrays("v", [1.0, nan], [1.0, 2.0], 1e-3, 1e-3)
    assert not bad.ok and bad.max_abs == inf
    assert (
        compare_arrays("v", np.ones((2, 3)), np.ones((3, 2)), 0, 0).note
        == "shape [2, 3], expected [3, 2]"
    )
    assert not compare_arrays("v", np.ones(2, np.float64), np.ones(2, np.float32), 1, 1).ok
    assert compare_arrays("v", np.ones(2), np.ones(2, np.float32), 1, 1, check_dtype=False).ok
    assert compare_arrays("v", np.array([1, 2]), np.array([1, 2]), 0, 0).ok
    assert compare_arrays("v", np.array([100.0]), np.array([101.0]), 0.01, 0).ok
    assert not compare_arrays(
        "v", np.array([10001]), np.array([10000]), 1e-3, 1e-3
    ).ok  # ints: exact
    near_zero = compare_arrays("v", np.array([1e-6, 1.0]), np.array([0.0, 1.0]), 1e-4, 1e-5)
    assert near_zero.ok and near_zero.max_rel == pytest.approx(1e-5)  # 1e-6 / (atol / rtol)


class _Rule:  # anything with .rtol and .atol
    def __init__(self, rtol, atol):
        self.rtol, self.atol = rtol, atol


def test_tolerance_is_the_loosest_rule_unless_given():
    assert tolerance([]) == (DEFAULT_RTOL, DEFAULT_ATOL)
    rules = [_Rule(1e-4, 0.0), _Rule(0.0, 1e-3)]
    assert tolerance(rules) == (1e-4, 1e-3)
    assert tolerance(rules, rtol=0.5) == (0.5, 1e-3)
    assert tolerance(rules, atol=0.0) == (1e-4, 0.0)


def test_scaled_tolerance_is_relative_to_the_largest_value():
    """An accumulating kernel's error is bounded by its output's scale (Rule.accumulates):
    an element near zero may be off by rtol x max |want|, and no more."""
    want = np.array([10.0, 0.01, -3.0], np.float32)
    near = want + np.array([0.0, 5e-4, 0.0], np.float32)
    assert not compare_arrays("y", near, want, 1e-4, 1e-5).ok
    scaled = compare_arrays("y", near, want, 1e-4, 1e-5, scaled=True)
    assert scaled.ok and scaled.max_rel == pytest.approx(5e-5, rel=1e-2)  # of the scale, 10
    assert not compare_arrays("y", want + np.float32(2e-3), want, 1e-4, 1e-5, scaled=True).ok
    inf = np.array([np.inf, 1.0], np.float32)  # the scale is the largest finite value
    assert not compare_arrays("y", inf + [0, 1e-3], inf, 1e-4, 1e-5, scaled=True).ok
    assert accumulating([conv.RULE]) and not accumulating([pool.RULE])
