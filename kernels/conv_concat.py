"""Convolution branches written into one concatenated output (concat elision).

    y[:, c_k : c_k + M_k] = conv_k(x_k)        c_k = M_1 + ... + M_(k-1)

with each conv_k = act(conv2d(x_k, W_k) + b_k) a kernels.conv2d plan and x_k its own input.
Every branch's epilogue stores into a channel-slice view of y, so the concatenation costs
nothing. The inner loops and parallel drivers are conv2d's; this module is the validating
wrapper (fire.py is the special case of branches sharing one squeeze conv's output).

Example:
    >>> from fusion_kernels import prepare_conv2d
    >>> a = prepare_conv2d(np.ones((4, 3, 1, 1), np.float32), activation="relu")
    >>> b = prepare_conv2d(np.ones((5, 2, 3, 3), np.float32), pads=(1, 1, 1, 1))
    >>> x1, x2 = np.ones((1, 3, 6, 6), np.float32), np.ones((1, 2, 6, 6), np.float32)
    >>> conv_concat([x1, x2], [a, b]).shape
    (1, 9, 6, 6)
"""

import numpy as np

from .conv2d import conv2d_bias_act, output_shape


def conv_concat(xs, plans, out=None):
    """concat_1(conv_k(xs[k]) for each k) for float32 NCHW inputs; returns `out`.

    out: optional float32 [N, sum M_k, OH, OW] array, or a channel slice of a bigger buffer.
    """
    if len(xs) != len(plans) or not plans:
        raise ValueError(f"one input per conv plan expected, got {len(xs)} and {len(plans)}")
    shapes = []
    for k, (x, plan) in enumerate(zip(xs, plans, strict=True)):
        if not isinstance(x, np.ndarray) or x.ndim != 4:
            raise ValueError(f"input {k} must be a 4-D array [N, C, H, W], got {x!r:.60}")
        shapes.append(output_shape(x.shape, plan)[0])
    n, _, oh, ow = shapes[0]
    if any((s[0], s[2], s[3]) != (n, oh, ow) for s in shapes):
        sizes = ", ".join(f"{s[0]}x{s[2]}x{s[3]}" for s in shapes)
        raise ValueError(f"branch outputs differ in batch or size ({sizes}): cannot concatenate")
    channels = sum(s[1] for s in shapes)
    if out is None:
        out = np.empty((n, channels, oh, ow), np.float32)
    elif not isinstance(out, np.ndarray) or out.shape != (n, channels, oh, ow):
        raise ValueError(f"out must be an array of shape {(n, channels, oh, ow)}, got {out!r:.80}")
    c = 0
    for x, plan, shape in zip(xs, plans, shapes, strict=True):  # disjoint output ranges
        conv2d_bias_act(x, plan, out=out[:, c : c + shape[1]])
        c += shape[1]
    return out
