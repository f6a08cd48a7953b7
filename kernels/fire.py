"""Convolution branches of one input, each written into its channel range of one output.

    s = conv_0(x);   y[:, c_k : c_k + M_k] = conv_k(s)   k = 1..B,  c_k = M_1 + ... + M_(k-1)

with each conv_k = act(conv2d(., W_k) + b_k) a kernels.conv2d plan. SqueezeNet's Fire module
is B = 2 (a 1x1 and a 3x3 expand conv after a 1x1 squeeze conv); the concatenation costs
nothing, because every branch's epilogue stores into a channel-slice view of y, and the
squeeze output s is computed once and read by all branches: Fire is the squeeze conv followed
by conv_concat (conv_concat.py) with every branch reading s. The inner loops and the parallel
drivers are conv2d's; this module is the validating wrapper.

Example:
    >>> import numpy as np
    >>> from fusion_kernels import prepare_conv2d
    >>> sq = prepare_conv2d(np.ones((2, 3, 1, 1), np.float32), activation="relu")
    >>> e1 = prepare_conv2d(np.ones((4, 2, 1, 1), np.float32), activation="relu")
    >>> e3 = prepare_conv2d(np.ones((5, 2, 3, 3), np.float32), pads=(1, 1, 1, 1))
    >>> fire(np.ones((1, 3, 6, 6), np.float32), prepare_fire(sq, e1, e3)).shape
    (1, 9, 6, 6)
"""

import dataclasses

import numba
import numpy as np

from ._im2col_nchw import im2col_conv
from .config import JIT
from .conv2d import (
    Conv2DPlan,
    _check_out,
    cached_launch,
    check_input,
    conv2d_bias_act,
    kernel_weights,
    launch,
    winograd_or_im2col,
)
from .conv_concat import conv_concat

# One compiled call per Fire module when its convs take these paths (SqueezeNet's always do):
# the Python between its convs costs tens of microseconds per module (bench/overheads.py).
_ONE_CALL = {"squeeze": ("im2col",), "expand": ("im2col", "winograd")}


@dataclasses.dataclass(frozen=True)
class FirePlan:
    squeeze: Conv2DPlan
    expands: tuple  # Conv2DPlans, in output channel order
    out_channels: int
    # (input shape, threads) -> _launch(...), as Conv2DPlan.launches
    launches: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def one_call(self) -> bool:
        return (
            len(self.expands) == 2
            and self.squeeze.method in _ONE_CALL["squeeze"]
            and all(e.method in _ONE_CALL["expand"] for e in self.expands)
        )


def prepare_fire(squeeze: Conv2DPlan, *expands: Conv2DPlan) -> FirePlan:
    """A squeeze plan and the expand plans in the order their outputs are concatenated."""
    if not expands:
        raise ValueError("a Fire module needs at least one expand conv")
    for k, plan in enumerate(expands):
        if plan.in_channels != squeeze.out_channels:
            raise ValueError(
                f"expand {k} reads {plan.in_channels} channels, the squeeze conv writes "
                f"{squeeze.out_channels}"
            )
    return FirePlan(squeeze, tuple(expands), sum(p.out_channels for p in expands))


def fire(x, plan: FirePlan, out=None):
    """y = concat_1(conv_k(conv_0(x)) for each expand k) for x float32 [N, C, H, W].

    out: optional float32 [N, M, OH, OW] array, or a channel slice of a bigger buffer.
    """
    if not plan.one_call:
        s = conv2d_bias_act(x, plan.squeeze)  # validates x
        return conv_concat([s] * len(plan.expands), plan.expands, out)
    check_input(x, plan.squeeze)
    s_shape, shape, ma, args = cached_launch(_launch, plan, x.shape)
    n, m, oh, ow = shape
    if out is None:
        out = np.empty(shape, np.float32)
        y3 = out.reshape(n, m, oh * ow)
        ya, yb = y3[:, :ma], y3[:, ma:]
    elif not isinstance(out, np.ndarray) or out.shape != shape:
        raise ValueError(f"out must be an array of shape {shape}, got {out!r:.80}")
    else:
        ya = _check_out(out[:, :ma], (n, ma, oh, ow), x)
        yb = _check_out(out[:, ma:], (n, m - ma, oh, ow), x)
    s = np.empty(s_shape, np.float32)
    squeeze = plan.squeeze
    _fire_one_call(x, s, s.reshape(s_shape[0], s_shape[1], -1), squeeze.im2col_packed,
                   squeeze.bias, ya, yb, *args)  # fmt: skip
    return out


def _launch(plan, x_shape, _threads):
    """(squeeze output shape, output shape, channels of the first expand, the arguments of
    _fire_one_call after yb) for an input of shape x_shape (cached by cached_launch; each conv's
    own launch() reads the same thread count)."""
    s_shape, _, s_args = launch(plan.squeeze, x_shape)
    a, b = plan.expands
    (n, ma, oh, ow), a_fast, a_args = launch(a, s_shape)
    b_shape, b_fast, b_args = launch(b, s_shape)
    if b_shape[2:] != (oh, ow):
        sizes = f"{n}x{oh}x{ow}, {n}x{b_shape[2]}x{b_shape[3]}"
        raise ValueError(f"branch outputs differ in batch or size ({sizes}): cannot concatenate")
    args = (s_args, kernel_weights(a), _fast_args(a, a_fast), a_args, a.method == "winograd",
            kernel_weights(b), _fast_args(b, b_fast), b_args, b.method == "winograd")  # fmt: skip
    return s_shape, (n, ma + b_shape[1], oh, ow), ma, args


def _fast_args(plan, fast):
    """Winograd's arguments, or same-typed placeholders for a conv that has none."""
    return fast if plan.method == "winograd" else (plan.lanes, plan.tile, 0, 0, 1, 1, *plan.clip, 1)


@numba.jit(**JIT)
def _fire_one_call(x, s, s3, sq_w, sq_b, ya, yb, sq_args, a, a_fast, a_args, a_winograd,
                   b, b_fast, b_args, b_winograd):  # fmt: skip
    """s = squeeze(x) by im2col (s3: s as [N, M, P]), then each expand into its channel range
    of y (ya, yb: [N, M, P] views) by conv2d.winograd_or_im2col. Arguments as launch() gives
    them."""
    im2col_conv(x, sq_w, sq_b, s3, *sq_args)
    winograd_or_im2col(s, ya, a, a_fast, a_args, a_winograd)
    winograd_or_im2col(s, yb, b, b_fast, b_args, b_winograd)
