"""Conv2D (NCHW, float32) with bias and activation fused into the output epilogue.

    y[n, m] = act(bias[m] + sum_{c in group(m), i, j} w[m, c, i, j] * x_pad[n, c, oh*s + i*d, ...])

act is identity, relu (clip to [0, inf)) or clip to [clip_min, clip_max], applied to each output
tile while it is still in L1 (no extra pass over memory). prepare_conv2d packs the weights once;
conv2d_bias_act validates, works out padding and output size (ONNX rules) and runs one of two
kernels:

- winograd: 3x3, stride 1, dilation 1, group 1, C >= 8 (see _winograd.py);
- im2col:   every other convolution (see _im2col.py).

Example:
    >>> w = np.ones((8, 3, 3, 3), np.float32)
    >>> plan = prepare_conv2d(w, np.zeros(8, np.float32), pads=(1, 1, 1, 1), activation="relu")
    >>> conv2d_bias_act(np.ones((1, 3, 5, 5), np.float32), plan).shape
    (1, 8, 5, 5)
"""

import dataclasses
import math

import numpy as np

from . import _gemm, _im2col, _winograd
from .config import slp_vectorize

AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")
ACTIVATIONS = (None, "relu", "clip")
_WINOGRAD_MIN_CHANNELS = 8  # below this the GEMMs are too thin to pay for the transforms


@dataclasses.dataclass(frozen=True)
class Conv2DPlan:
    """Everything about one Conv node that does not depend on the input: packed weights,
    folded bias and the attributes. Build it with prepare_conv2d."""

    out_channels: int
    in_channels: int  # C = C/group * group
    group: int
    kernel: tuple
    strides: tuple
    dilations: tuple
    pads: tuple  # (top, left, bottom, right); ignored unless auto_pad == "NOTSET"
    auto_pad: str
    clip: tuple  # (lo, hi) as float32
    bias: np.ndarray  # [M] float32, zeros when the node has none
    method: str  # "winograd" or "im2col"
    packed: np.ndarray  # weights packed for `method`
    im2col_packed: np.ndarray  # weights packed for im2col: every plan can take that path


def _pair(name, value, minimum):
    t = tuple(int(v) for v in value)
    if len(t) != 2 or min(t) < minimum:
        raise ValueError(f"{name} must be 2 integers >= {minimum}, got {value!r}")
    return t


def prepare_conv2d(
    weight,
    bias=None,
    *,
    strides=(1, 1),
    pads=(0, 0, 0, 0),
    dilations=(1, 1),
    group=1,
    auto_pad="NOTSET",
    activation=None,
    clip_min=-math.inf,
    clip_max=math.inf,
):
    """Pack a Conv node's weights once. weight: float32 [M, C/group, kh, kw]; bias: M floats in
    any shape ([M], [M,1,1], [1,M,1,1]); pads in ONNX order (top, left, bottom, right)."""
    if not isinstance(weight, np.ndarray) or weight.dtype != np.float32 or weight.ndim != 4:
        raise ValueError(f"weight must be a float32 array [M, C/group, kh, kw], got {weight!r:.80}")
    m, cg, kh, kw = weight.shape
    group = int(group)
    if group < 1 or m % group or min(weight.shape) < 1:
        raise ValueError(f"bad weight shape {weight.shape} for group={group}: M % group must be 0")
    if bias is None:
        bias = np.zeros(m, np.float32)
    else:
        bias = np.asarray(bias)
        if bias.dtype != np.float32 or bias.size != m:
            raise ValueError(f"bias must be {m} float32 values, got {bias.dtype} {bias.shape}")
        bias = np.ascontiguousarray(bias.reshape(m))
    strides = _pair("strides", strides, 1)
    dilations = _pair("dilations", dilations, 1)
    pads = tuple(int(p) for p in pads)
    if len(pads) != 4 or min(pads) < 0:
        raise ValueError(f"pads must be 4 integers >= 0 (top, left, bottom, right), got {pads}")
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad must be one of {AUTO_PADS}, got {auto_pad!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    lo, hi = (-math.inf, math.inf) if activation is None else (float(clip_min), float(clip_max))
    if activation == "relu":
        lo, hi = 0.0, math.inf
    if not lo <= hi:
        raise ValueError(f"clip_min must be <= clip_max, got {lo} > {hi}")

    winograd = (
        (kh, kw) == (3, 3)
        and strides == (1, 1)
        and dilations == (1, 1)
        and group == 1
        and cg >= _WINOGRAD_MIN_CHANNELS
    )
    # per group: [Mg, K] with k = (c * kh + i) * kw + j, packed into MR-row panels
    w2d = weight.reshape(group, m // group, cg * kh * kw)
    im2col_packed = np.concatenate([_gemm.pack_a(w2d[g]) for g in range(group)])
    packed = _winograd.pack_weights(weight) if winograd else im2col_packed
    return Conv2DPlan(
        out_channels=m,
        in_channels=cg * group,
        group=group,
        kernel=(kh, kw),
        strides=strides,
        dilations=dilations,
        pads=pads,
        auto_pad=auto_pad,
        clip=(np.float32(lo), np.float32(hi)),
        bias=bias,
        method="winograd" if winograd else "im2col",
        packed=packed,
        im2col_packed=im2col_packed,
    )


def _axis_pads(size, k, s, d, mode, begin, end):
    """(begin, end) padding of one spatial axis, with ONNX auto_pad semantics."""
    if mode == "NOTSET":
        return begin, end
    if mode == "VALID":
        return 0, 0
    total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
    small = total // 2  # SAME_UPPER puts the odd extra pixel at the end, SAME_LOWER at the start
    return (small, total - small) if mode == "SAME_UPPER" else (total - small, small)


def output_shape(x_shape, plan):
    """(N, M, OH, OW) and pads (top, left, bottom, right) for an input of shape x_shape."""
    n, _, h, w = x_shape
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    pt, pb = _axis_pads(h, kh, sh, dh, plan.auto_pad, plan.pads[0], plan.pads[2])
    pl, pr = _axis_pads(w, kw, sw, dw, plan.auto_pad, plan.pads[1], plan.pads[3])
    oh = (h + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (w + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    return (n, plan.out_channels, oh, ow), (pt, pl, pb, pr)


def _check_out(out, shape, x):
    """out may be a fresh array or a channel slice of a bigger NCHW buffer (buf[:, a:b]): each
    [OH, OW] plane must be contiguous and consecutive channels evenly spaced."""
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape:
        raise ValueError(f"out must be a float32 array of shape {shape}, got {out!r:.80}")
    _, _, oh, ow = shape
    item = out.itemsize
    if (ow > 1 and out.strides[3] != item) or (oh > 1 and out.strides[2] != ow * item):
        raise ValueError(f"out planes must be contiguous [OH, OW]; strides are {out.strides}")
    if out.strides[1] < oh * ow * item or out.strides[0] < 0 or not out.flags.writeable:
        raise ValueError(f"out must be a writeable NCHW array or channel slice; {out.strides}")
    if np.may_share_memory(out, x):
        raise ValueError("out must not overlap the input x")
    # The same memory seen as [N, M, OH*OW], the flat pixel index the kernels write.
    return np.lib.stride_tricks.as_strided(
        out, (shape[0], shape[1], oh * ow), (out.strides[0], out.strides[1], item)
    )


def conv2d_bias_act(x, plan, out=None):
    """y = act(conv2d(x, w) + bias) for x float32 C-contiguous [N, C, H, W]; returns `out`.

    out: optional float32 [N, M, OH, OW] array, or a channel-slice view of a bigger buffer.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError(f"x must be a float32 numpy array, got {getattr(x, 'dtype', type(x))}")
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous (use np.ascontiguousarray)")
    if x.shape[1] != plan.in_channels:
        raise ValueError(f"x has {x.shape[1]} channels, the weights expect {plan.in_channels}")
    shape, (pt, pl, _, _) = output_shape(x.shape, plan)
    if min(shape) < 1:
        raise ValueError(f"output shape {shape} is empty for input {x.shape}")
    if out is None:
        out = np.empty(shape, np.float32)
    out3 = _check_out(out, shape, x)
    lo, hi = plan.clip
    with slp_vectorize():  # only has an effect when the kernel is compiled
        # Winograd mixes the pixels of a tile before multiplying: one inf or NaN input would
        # poison all four outputs of its tile, where a direct convolution poisons only the
        # outputs whose window holds it. Such inputs take the im2col path, as onnxruntime would.
        if plan.method == "winograd" and _winograd.all_finite(x):
            _winograd.winograd_conv(x, plan.packed, plan.bias, out3, pt, pl, *shape[2:], lo, hi)
        else:
            (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
            _im2col.im2col_conv(x, plan.im2col_packed, plan.bias, out3, kh, kw, sh, sw, dh, dw,
                                pt, pl, shape[3], plan.group, lo, hi)  # fmt: skip
    return out
