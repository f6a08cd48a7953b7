"""An `out` that overlaps what a blocked kernel reads is refused, saying which input it overlaps.

The kernels read x (and a residual, per-image weights) in tiles while other threads write out,
and some tiles are written twice (the overlapping tile at a row's end adds the residual again):
out = x or out = residual would give wrong values, not an in-place result (workspace.disjoint).
"""

import numpy as np
import pytest

from kernels.blocked import to_blocked
from kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc
from kernels.inverted_residual import inverted_residual, prepare_inverted_residual
from kernels.pool import maxpool_blocked, prepare_maxpool
from kernels.preact_conv import preact_conv, prepare_preact_conv
from kernels.simd import width
from kernels.simd.activation import encode
from kernels.squeeze_excite import prepare_squeeze_excite, squeeze_excite_blocked
from kernels.winograd_nchwc import prepare_winograd_nchwc, winograd_nchwc

RNG = np.random.default_rng(7)
C = 16  # channels in and out: every kernel's output has its input's shape


def weights(*shape):
    return (RNG.standard_normal(shape) * 0.2).astype(np.float32)


def image(c=C, hw=9):
    return to_blocked(RNG.standard_normal((1, c, hw, hw)).astype(np.float32), block=width())


def test_a_conv_refuses_an_out_over_its_input_or_residual():
    plan = prepare_conv_nchwc(weights(C, C, 3, 3), weights(C), pads=(1, 1, 1, 1), residual="after")
    xb, res = image(), image()
    want = conv_nchwc(xb, plan, residual=res)
    with pytest.raises(ValueError, match="out must not overlap x"):
        conv_nchwc(xb, plan, out=xb, residual=res)
    with pytest.raises(ValueError, match="out must not overlap the residual"):
        conv_nchwc(xb, plan, out=res, residual=res)
    with pytest.raises(ValueError, match="overlap x"):  # a view of x's memory counts too
        conv_nchwc(xb, plan, out=xb[:, :], residual=res)
    out = np.empty_like(want)  # a disjoint out is written as before
    assert conv_nchwc(xb, plan, out=out, residual=res) is out
    np.testing.assert_array_equal(out, want)


def test_winograd_refuses_an_out_over_its_input_or_residual():
    plan = prepare_winograd_nchwc(weights(C, C, 3, 3), weights(C), tile=2, pads=(1, 1, 1, 1),
                                  residual="after")  # fmt: skip
    xb, res = image(), image()
    with pytest.raises(ValueError, match="out must not overlap x"):
        winograd_nchwc(xb, plan, out=xb, residual=res)
    with pytest.raises(ValueError, match="out must not overlap the residual"):
        winograd_nchwc(xb, plan, out=res, residual=res)
    out = np.empty_like(xb)
    np.testing.assert_array_equal(winograd_nchwc(xb, plan, out=out, residual=res),
                                  winograd_nchwc(xb, plan, residual=res))  # fmt: skip


def test_the_block_kernels_refuse_an_out_over_their_input():
    xb = image()
    relu6 = ("clip", None, None, 0.0, 6.0)
    se = prepare_squeeze_excite(weights(4, C), None, weights(C, 4), None, encode("relu"),
                                encode("sigmoid"))  # fmt: skip
    ir = prepare_inverted_residual(weights(4 * C, C, 1, 1), weights(4 * C), weights(4 * C, 1, 3, 3),
                                   weights(4 * C), weights(C, 4 * C, 1, 1), weights(C),
                                   acts=(relu6, relu6, None), residual=True)  # fmt: skip
    pc = prepare_preact_conv(weights(C), weights(C), weights(C, C, 1, 1),
                             norm_act={"activation": "relu"})  # fmt: skip
    pool = prepare_maxpool((3, 3), (1, 1), (1, 1, 1, 1))
    blocks = {
        "squeeze-excitation": lambda out: squeeze_excite_blocked(xb, se, out=out),
        "inverted residual": lambda out: inverted_residual(xb, ir, out=out),
        "pre-activated conv": lambda out: preact_conv(xb, pc, out=out),
        "max pool": lambda out: maxpool_blocked(xb, pool, out=out),
    }
    for name, run in blocks.items():
        want = run(None)
        with pytest.raises(ValueError, match="out must not overlap x"):
            run(xb)
        out = np.empty_like(want)
        assert run(out) is out, name
        np.testing.assert_array_equal(out, want, err_msg=name)
