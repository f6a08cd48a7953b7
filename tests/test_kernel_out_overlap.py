"""An `out` that overlaps what a blocked kernel reads is refused, saying which input it overlaps.

The kernels read x (and a residual, per-image weights) in tiles while other threads write out,
and some tiles are written twice (the overlapping tile at a row's end adds the residual again):
out = x or out = residual would give wrong values, not an in-place result (workspace.disjoint).
"""

import numpy as np
import pytest

from fusion_kernels.blocked import to_blocked
from fusion_kernels.conv_nchwc import conv_nchwc, prepare_conv_nchwc
from fusion_kernels.inverted_residual import inverted_residual, prepare_inverted_residual
from fusion_kernels.pool import maxpool_blocked, prepare_maxpool
from fusion_kernels.preact_conv import preact_conv, prepare_preact_conv
from fusion_kernels.simd import width
from fusion_kernels.simd.activation import encode
from fusion_kernels.squeeze_excite import prepare_squeeze_excite, squeeze_excite_blocked
from fusion_kernels.winograd_nchwc import prepare_winograd_nchwc, winograd_nchwc

C, HW = 16, 9  # channels in and out, image size: every kernel's output has its input's shape
RELU6 = ("clip", None, None, 0.0, 6.0)


def weights(rng, *shape):
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def image(rng):
    return to_blocked(rng.standard_normal((1, C, HW, HW)).astype(np.float32), block=width())


def shifted(xb):
    """An array of xb's shape and values whose memory starts half a plane into xb's: a partial
    overlap, not xb itself."""
    flat = np.empty(xb.size + xb.size // 2, np.float32)
    flat[: xb.size] = xb.reshape(-1)
    return flat[: xb.size].reshape(xb.shape), flat[xb.size // 2 :].reshape(xb.shape)


@pytest.mark.parametrize("kernel", ["direct", "winograd"])
def test_a_conv_refuses_an_out_over_its_input_or_residual(kernel):
    rng = np.random.default_rng(1)
    w, b = weights(rng, C, C, 3, 3), weights(rng, C)
    if kernel == "direct":
        plan, run = prepare_conv_nchwc(w, b, pads=(1, 1, 1, 1), residual="after"), conv_nchwc
    else:
        plan = prepare_winograd_nchwc(w, b, tile=2, pads=(1, 1, 1, 1), residual="after")
        run = winograd_nchwc
    xb, res = image(rng), image(rng)
    want = run(xb, plan, residual=res)
    with pytest.raises(ValueError, match="out must not overlap x"):
        run(xb, plan, out=xb, residual=res)
    with pytest.raises(ValueError, match="out must not overlap the residual"):
        run(xb, plan, out=res, residual=res)
    x_part, out_part = shifted(xb)
    with pytest.raises(ValueError, match="out must not overlap x"):
        run(x_part, plan, out=out_part, residual=res)
    out = np.empty_like(want)  # a separate out is written as before
    assert run(xb, plan, out=out, residual=res) is out
    np.testing.assert_array_equal(out, want)


def test_a_conv_refuses_an_out_over_its_images_own_weights():
    rng = np.random.default_rng(2)
    plan = prepare_conv_nchwc(weights(rng, C, C, 1, 1))
    xb = image(rng)
    out = np.empty(max(plan.packed.size, xb.size), np.float32)
    own = out[: plan.packed.size].reshape(1, -1)  # image 0's weights live in out's memory
    own[:] = plan.packed.reshape(1, -1)
    with pytest.raises(ValueError, match="out must not overlap the weights"):
        conv_nchwc(xb, plan, out=out[: xb.size].reshape(xb.shape), weights=own)


def test_a_residual_the_plan_does_not_add_is_not_read_nor_tested():
    rng = np.random.default_rng(3)
    plan = prepare_conv_nchwc(weights(rng, C, C, 1, 1))
    xb, out = image(rng), np.empty((1, C // width(), HW, HW, width()), np.float32)
    np.testing.assert_array_equal(conv_nchwc(xb, plan, out=out, residual=out), conv_nchwc(xb, plan))


def block_kernel(name, rng):
    """(run(xb, out), name) for one of the block kernels, its weights drawn from rng."""
    if name == "squeeze-excitation":
        se = prepare_squeeze_excite(weights(rng, 4, C), None, weights(rng, C, 4), None,
                                    encode("relu"), encode("sigmoid"))  # fmt: skip
        return lambda xb, out: squeeze_excite_blocked(xb, se, out=out)
    if name == "inverted residual":
        e = 4 * C
        ir = prepare_inverted_residual(weights(rng, e, C, 1, 1), weights(rng, e),
                                       weights(rng, e, 1, 3, 3), weights(rng, e),
                                       weights(rng, C, e, 1, 1), weights(rng, C),
                                       acts=(RELU6, RELU6, None), residual=True)  # fmt: skip
        return lambda xb, out: inverted_residual(xb, ir, out=out)
    if name == "pre-activated conv":
        pc = prepare_preact_conv(weights(rng, C), weights(rng, C), weights(rng, C, C, 1, 1),
                                 norm_act={"activation": "relu"})  # fmt: skip
        return lambda xb, out: preact_conv(xb, pc, out=out)
    pool = prepare_maxpool((3, 3), (1, 1), (1, 1, 1, 1))
    return lambda xb, out: maxpool_blocked(xb, pool, out=out)


@pytest.mark.parametrize(
    "name", ["squeeze-excitation", "inverted residual", "pre-activated conv", "max pool"]
)
def test_block_and_pool_kernels_refuse_an_out_over_their_input(name):
    rng = np.random.default_rng(4)
    run, xb = block_kernel(name, rng), image(rng)
    want = run(xb, None)
    with pytest.raises(ValueError, match="out must not overlap x"):
        run(xb, xb)
    x_part, out_part = shifted(xb)
    with pytest.raises(ValueError, match="out must not overlap x"):
        run(x_part, out_part)
    out = np.empty_like(want)
    assert run(xb, out) is out
    np.testing.assert_array_equal(out, want)
