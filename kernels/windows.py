"""Window attributes and output sizes of convolutions and pools, checked without Numba.

A rewrite checks these (a MaxPool the kernel cannot run is not fused, with the kernel's own
reason), so this module imports nothing heavy: no Numba, no compiled kernel.

Output sizes: a Conv follows ONNX (SAME pads for the dilated kernel). A MaxPool follows
onnxruntime (pool_attributes.h), which differs from ONNX's shape inference in places: e = H +
pads - (kh - 1) dh - 1, OH = e / sh + 1 truncated toward zero, or with ceil_mode rounded up and
then one less when the last window would start past the image and its leading padding
(PyTorch's rule); ceil_mode applies under auto_pad VALID too; SAME pads for the undilated kernel.
"""

import dataclasses

AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")


def pair(name, value, minimum):
    """`value` as a tuple of 2 ints >= minimum (a kernel, strides, dilations), else ValueError."""
    t = tuple(int(v) for v in value)
    if len(t) != 2 or min(t) < minimum:
        raise ValueError(f"{name} must be 2 integers >= {minimum}, got {value!r}")
    return t


def window_attributes(strides, dilations, pads, auto_pad):
    """(strides, dilations, pads) as int tuples, checked; a Conv's or a pool's attributes."""
    strides = pair("strides", strides, 1)
    dilations = pair("dilations", dilations, 1)
    pads = tuple(int(p) for p in pads)
    if len(pads) != 4 or min(pads) < 0:
        raise ValueError(f"pads must be 4 integers >= 0 (top, left, bottom, right), got {pads}")
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad must be one of {AUTO_PADS}, got {auto_pad!r}")
    return strides, dilations, pads


def _axis_pads(size, k, s, d, mode, begin, end):
    """(begin, end) padding of one spatial axis, with ONNX auto_pad semantics."""
    if mode == "NOTSET":
        return begin, end
    if mode == "VALID":
        return 0, 0
    total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
    small = total // 2  # SAME_UPPER puts the odd extra pixel at the end, SAME_LOWER at the start
    return (small, total - small) if mode == "SAME_UPPER" else (total - small, small)


def conv_output_shape(x_shape, plan):
    """A Conv2DPlan's (N, M, OH, OW) and pads (top, left, bottom, right) for input x_shape."""
    n, _, h, w = x_shape
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    pt, pb = _axis_pads(h, kh, sh, dh, plan.auto_pad, plan.pads[0], plan.pads[2])
    pl, pr = _axis_pads(w, kw, sw, dw, plan.auto_pad, plan.pads[1], plan.pads[3])
    oh = (h + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (w + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    return (n, plan.out_channels, oh, ow), (pt, pl, pb, pr)


@dataclasses.dataclass(frozen=True)
class MaxPoolPlan:
    """A MaxPool node's attributes, checked once. Build it with prepare_maxpool."""

    kernel: tuple
    strides: tuple
    dilations: tuple
    pads: tuple  # (top, left, bottom, right); ignored unless auto_pad == "NOTSET"
    auto_pad: str
    ceil_mode: bool
    launches: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)


def prepare_maxpool(kernel, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
                    ceil_mode=False, auto_pad="NOTSET"):  # fmt: skip
    """Check a MaxPool's attributes (pads in ONNX order: top, left, bottom, right)."""
    kernel = pair("kernel", kernel, 1)
    strides, dilations, pads = window_attributes(strides, dilations, pads, auto_pad)
    if any(p >= k for p, k in zip(pads, kernel * 2, strict=True)):
        raise ValueError(f"pads {pads} must be smaller than the kernel {kernel} (as onnxruntime)")
    return MaxPoolPlan(kernel, strides, dilations, pads, auto_pad, bool(ceil_mode))


def _div0(a, b):
    """a / b rounded toward zero, as C++ divides."""
    return a // b if a >= 0 else -(-a // b)


def _pool_axis(size, k, s, d, mode, begin, end, ceil_mode, dilated):
    """(output size, leading pad, trailing pad) of one axis, as onnxruntime computes them."""
    if mode == "VALID":
        begin = end = 0
    elif mode in ("SAME_UPPER", "SAME_LOWER"):
        total = (-(-size // s) - 1) * s + k - size  # the undilated kernel, as onnxruntime
        if total < 0 and not dilated:  # (its path for dilated pools goes on with a negative
            # trailing pad, on every axis)
            raise ValueError(f"{mode} padding of a size-{size} axis is negative (kernel {k} < "
                             f"stride {s}); onnxruntime rejects it too")  # fmt: skip
        begin = _div0(total + 1, 2) if mode == "SAME_LOWER" else _div0(total, 2)
        end = total - begin
    e = size + begin + end - (k - 1) * d - 1
    if ceil_mode:
        out = -(-e // s) + 1
        if (out - 1) * s >= size + begin:
            out -= 1  # the last window would start in the trailing padding
    else:
        out = _div0(e, s) + 1
    return out, begin, end


def maxpool_output_shape(x_shape, plan):
    """A MaxPoolPlan's (N, C, OH, OW) and pads (top, left, bottom, right) for input x_shape."""
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    mode, pads, ceil = plan.auto_pad, plan.pads, plan.ceil_mode
    dilated = plan.dilations != (1, 1)
    oh, pt, pb = _pool_axis(h, kh, sh, dh, mode, pads[0], pads[2], ceil, dilated)
    ow, pl, pr = _pool_axis(w, kw, sw, dw, mode, pads[1], pads[3], ceil, dilated)
    return (n, c, oh, ow), (pt, pl, pb, pr)
