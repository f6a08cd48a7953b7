"""Register tiles (kernels.simd.tile): the rank-1 update, loads and stores of whole tiles, and
the shapes the register file allows, at W = 8 and W = 16 on every machine (a Lanes argument
forces the width; 16 lanes on AVX2 are ymm pairs), against NumPy in float64."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from fusion_kernels import simd
from fusion_kernels.config import JIT_GEMM
from fusion_kernels.simd import Tile, tile_fma, tile_load, tile_store, tile_zeros, vfma, vget
from fusion_kernels.simd import tile as tiles

HARNESS = dict(JIT_GEMM, cache=False)


@numba.jit(**HARNESS)
def _panel(L, T, a, b, k_len, out):
    """out[r, c W + j] = sum_k a[k, r] b[k, c W + j]: a packed [K, rows], b packed [K, cols W]."""
    t = tile_zeros(L, T)
    for k in range(k_len):
        t = tile_fma(t, a, k * T.rows, 1, b, k * T.cols * L.width)
    tile_store(out, 0, t)


@numba.jit(**HARNESS)
def _strided(L, T, x, xstep, w, k_len, acc, out):
    """out = acc + sum_k x[k + r xstep] w[k, c W + j] (broadcasts at a stride, as a direct
    convolution's pixels): acc loaded and the sum stored as whole tiles."""
    t = tile_load(L, T, acc, 0)
    for k in range(k_len):
        t = tile_fma(t, x, k, xstep, w, k * T.cols * L.width)
    tile_store(out, 0, t)


@numba.jit(**HARNESS)
def _one(L, T, a, b, r, c):
    """Lane 0 of accumulator (r, c) after one update, read through t[r][c]."""
    t = tile_fma(tile_zeros(L, T), a, 0, 1, b, 0)
    return vget(vfma(1.0, t[r][c], 0.0), 0)


@pytest.mark.parametrize("w", [8, 16])
@pytest.mark.parametrize("shape", [(1, 1), (4, 3), (6, 2), (3, 4), (14, 2), (2, 5)])
def test_rank1_updates_sum_a_product(w, shape):
    L, T = simd.Lanes(w), Tile(*shape)
    rows, cols = shape
    rng = np.random.default_rng(rows * 31 + cols)
    for k in (1, 7, 64):
        a = rng.standard_normal((k, rows)).astype(np.float32)
        b = rng.standard_normal((k, cols * w)).astype(np.float32)
        a[0, 0] = np.nan if k == 7 else a[0, 0]  # a NaN reaches its row only
        out = np.empty((rows, cols * w), np.float32)
        _panel(L, T, a, b, k, out)
        ref = a.T.astype(np.float64) @ b
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * math.sqrt(k))


@pytest.mark.parametrize("w", [8, 16])
def test_strided_broadcasts_and_whole_tile_loads(w):
    L, T = simd.Lanes(w), Tile(3, 4)
    rng = np.random.default_rng(5)
    k, xstep = 9, 11
    x = rng.standard_normal(k + 2 * xstep + 1).astype(np.float32)
    wt = rng.standard_normal((k, 4 * w)).astype(np.float32)
    acc = rng.standard_normal((3, 4 * w)).astype(np.float32)
    out = np.empty_like(acc)
    _strided(L, T, x, xstep, wt, k, acc, out)
    xs = np.stack([x[r * xstep : r * xstep + k] for r in range(3)])  # [rows, K]
    np.testing.assert_allclose(out, acc + xs.astype(np.float64) @ wt, rtol=1e-5, atol=1e-5)


def test_an_accumulator_is_a_vector():
    L, T = simd.Lanes(8), Tile(2, 3)
    a = np.array([2.0, 3.0], np.float32)
    b = np.arange(24, dtype=np.float32)
    assert _one(L, T, a, b, 1, 2) == 3.0 * 16.0


def test_a_tile_argument_is_typed_without_python(monkeypatch):
    L, T = simd.Lanes(8), tiles.tile(1, 1)
    a, b = np.ones(1, np.float32), np.ones(8, np.float32)
    out = np.empty(8, np.float32)
    _panel(L, T, a, b, 1, out)
    monkeypatch.setattr(_panel, "typeof_pyval", lambda value: pytest.fail(f"typeof {value}"))
    _panel(L, T, a, b, 1, out)
    assert tiles.tile(1, 1) is T


def test_a_tile_pickles_by_its_shape():
    """Numba's cache keys a kernel closing over tiles by their pickle: a number of the type's,
    different in every process, must not be in it."""
    import pickle

    data = pickle.dumps(tiles.tile(3, 2))
    assert b"numba" not in data
    assert pickle.loads(data) is tiles.tile(3, 2)


def test_bad_shapes_and_arguments():
    with pytest.raises(ValueError, match="1-64 rows"):
        Tile(0, 2)
    with pytest.raises(ValueError, match="1-16 vectors"):
        Tile(2, 17)
    with pytest.raises(numba.TypingError, match="takes a tile"):
        numba.njit(lambda a: tile_fma(a, a, 0, 1, a, 0))(np.zeros(8, np.float32))


@pytest.mark.parametrize(
    ("isa", "regs", "gemm", "conv"),
    [
        # (cols, w): (fit_rows, tallest); 16 lanes on AVX2 take two registers a vector
        ("avx2+fma", (16, 8), {8: (4, 3), 16: (6, 1)},
         {(4, 8): (3, 3), (2, 8): (6, 6), (1, 8): (14, 8), (1, 16): (6, 6)}),
        ("avx512f+fma", (32, 16), {8: (14, 2), 16: (14, 2)},
         {(4, 16): (6, 6), (2, 16): (14, 14), (1, 16): (30, 16), (1, 8): (30, 16)}),
    ],
    ids=["avx2", "avx512"],
)  # fmt: skip
def test_shapes_follow_the_register_file(monkeypatch, isa, regs, gemm, conv):
    """The register file of the CPU Numba compiles for sets the shapes: every accumulator and
    operand of a tile in a register (rows x cols + min(rows, cols) + 1 of them)."""
    monkeypatch.setattr(tiles, "target_isa", lambda: isa)
    tiles.registers.cache_clear()
    try:
        assert tiles.registers() == regs
        for w, shape in gemm.items():
            assert tiles.gemm_shape(w) == shape
            rows, cols = shape
            v = -(-w // regs[1])
            assert v * (rows * cols + min(rows, cols) + 1) <= regs[0]
        for (cols, w), (rows, tallest) in conv.items():
            assert tiles.fit_rows(cols, w) == rows
            # a one-column tile stops at half as many rows as registers; wider ones fill them
            assert tiles.tallest(cols, w) == tallest
    finally:
        tiles.registers.cache_clear()
