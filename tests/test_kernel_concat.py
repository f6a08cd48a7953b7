"""kernels/concat.py: a concatenation that a longer one extends appends in place, and only
when that is safe (the same arrays placed, nothing appended since, room enough)."""

import gc

import numpy as np
import pytest

from fusion_kernels.concat import _OPEN, concat_channels


def parts(*channels, n=1, rest=(3, 4), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, c, *rest)).astype(np.float32) for c in channels]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("rest", [(3, 4), (2, 5, 16), (7,)])
def test_a_chain_appends_into_one_buffer(n, rest):
    xs = parts(4, 2, 3, 1, n=n, rest=rest)
    ys = [concat_channels(xs[: k + 1], reserve=12) for k in range(4)]
    for k, y in enumerate(ys):
        np.testing.assert_array_equal(y, np.concatenate(xs[: k + 1], axis=1))
        assert np.shares_memory(y, ys[0])
    assert ys[-1].flags.c_contiguous == (n == 1)  # a prefix of the channels: strided for N > 1


def test_without_room_or_reserve_a_whole_copy():
    xs = parts(4, 2, 3)
    y2 = concat_channels(xs[:2], reserve=7)  # room for one channel, the next part has three
    y3 = concat_channels(xs, reserve=7)
    assert not np.shares_memory(y2, y3)
    np.testing.assert_array_equal(y3, np.concatenate(xs, axis=1))
    assert concat_channels(xs).base is None or not np.shares_memory(concat_channels(xs), y3)


def test_a_fork_gets_its_own_buffer():
    """Two extensions of one concatenation: the second may not write where the first did."""
    a, b, c, d = parts(2, 2, 2, 2)
    y = concat_channels([a, b], reserve=8)
    y_c = concat_channels([a, b, c], reserve=8)
    y_d = concat_channels([a, b, d], reserve=8)
    np.testing.assert_array_equal(y_c, np.concatenate([a, b, c], axis=1))
    np.testing.assert_array_equal(y_d, np.concatenate([a, b, d], axis=1))
    np.testing.assert_array_equal(y, np.concatenate([a, b], axis=1))
    assert np.shares_memory(y, y_c) and not np.shares_memory(y_c, y_d)


def test_equal_but_other_arrays_are_not_appended_to():
    a, b, c = parts(2, 2, 2)
    concat_channels([a, b], reserve=6)
    a2 = a.copy()
    y = concat_channels([a2, b, c], reserve=6)
    np.testing.assert_array_equal(y, np.concatenate([a2, b, c], axis=1))
    y2 = concat_channels([a, b.copy(), c], reserve=6)  # first part the same, second not
    np.testing.assert_array_equal(y2, np.concatenate([a, b, c], axis=1))
    assert not np.shares_memory(y, y2)


def test_the_same_parts_again_are_a_new_buffer():
    """A repeated call (timing) is not an extension: it must not hand back a stale buffer."""
    a, b = parts(2, 3)
    y1 = concat_channels([a, b], reserve=9)
    b[...] = 7.0
    y2 = concat_channels([a, b], reserve=9)
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y2[:, 2:], b)


def test_a_freed_part_closes_its_buffer():
    a, b = parts(2, 3, seed=1)
    concat_channels([a, b], reserve=9)
    assert id(a) in _OPEN
    del b
    gc.collect()
    assert id(a) not in _OPEN


def test_bad_parts_are_refused():
    a, b = parts(2, 3)
    with pytest.raises(ValueError, match="differ outside axis 1"):
        concat_channels([a, b[:, :, :2]], reserve=9)
    with pytest.raises(ValueError, match="float32"):
        concat_channels([a.astype(np.float64)], reserve=9)
    with pytest.raises(ValueError, match="at least one"):
        concat_channels([], reserve=9)
