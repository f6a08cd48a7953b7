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
    >>> from kernels import prepare_conv2d
    >>> sq = prepare_conv2d(np.ones((2, 3, 1, 1), np.float32), activation="relu")
    >>> e1 = prepare_conv2d(np.ones((4, 2, 1, 1), np.float32), activation="relu")
    >>> e3 = prepare_conv2d(np.ones((5, 2, 3, 3), np.float32), pads=(1, 1, 1, 1))
    >>> fire(np.ones((1, 3, 6, 6), np.float32), prepare_fire(sq, e1, e3)).shape
    (1, 9, 6, 6)
"""

import dataclasses

from .conv2d import Conv2DPlan, conv2d_bias_act
from .conv_concat import conv_concat


@dataclasses.dataclass(frozen=True)
class FirePlan:
    squeeze: Conv2DPlan
    expands: tuple  # Conv2DPlans, in output channel order
    out_channels: int


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
    s = conv2d_bias_act(x, plan.squeeze)  # validates x
    return conv_concat([s] * len(plan.expands), plan.expands, out)
