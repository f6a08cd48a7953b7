"""Conv2D (NCHW, float32) with bias and activation fused into the output epilogue.

    y[n, m] = act(bias[m] + sum_{c in group(m), i, j} w[m, c, i, j] * x_pad[n, c, oh*s + i*d, ...])

act is a clip: identity, relu (clip to [0, inf)) or clip to [clip_min, clip_max] (the kinds
of kernels/simd/activation.py that are one, CLIPPING), applied to each output tile while it is
still in L1 (no extra pass over memory); other activations run after it (kernels/pointwise).
prepare_conv2d packs the weights once; conv2d_bias_act validates, works out padding and output
size (ONNX rules) and runs one of four kernels:

- winograd:  F(2x2, 3x3) for 3x3, stride 1, dilation 1, group 1, C >= 8 (_winograd_f2_nchw.py);
- winograd4: F(4x4, 3x3) for the same with C <= 256, opt-in: winograd_tile=4 (_winograd_f4_nchw.py);
- depthwise: group == C == M, direct (_depthwise_nchw.py);
- im2col:    every other convolution, 1x1 stride 1 unpadded reading the input in place
  (_im2col_nchw.py).

Inputs holding inf or NaN take the im2col path (see conv2d_bias_act).

Example:
    >>> w = np.ones((8, 3, 3, 3), np.float32)
    >>> plan = prepare_conv2d(w, np.zeros(8, np.float32), pads=(1, 1, 1, 1), activation="relu")
    >>> conv2d_bias_act(np.ones((1, 3, 5, 5), np.float32), plan).shape
    (1, 8, 5, 5)
"""

import dataclasses
import math

import numba
import numpy as np

from . import _depthwise_nchw, _gemm, _im2col_nchw, _winograd_f2_nchw, _winograd_f4_nchw
from .config import JIT, get_threads
from .simd.activation import CLIPPING, KINDS, clip_bounds, encode
from .windows import conv_output_shape as output_shape
from .windows import window_attributes

_WINOGRAD_MIN_CHANNELS = 8  # below this the GEMMs are too thin to pay for the transforms
# F(4x4, 3x3) (opt-in: prepare_conv2d(winograd_tile=4)) up to this many input channels, F(2x2)
# above: F(4x4)'s float32 error grows with C, and past 256 channels it would no longer stay 10x
# inside the 1e-4 tolerance (error table: bench/NOTES.md, Winograd).
_WINOGRAD4_MAX_CHANNELS = 256


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
    clip: tuple  # (lo, hi) as float32: activation.clip_bounds of the activation
    bias: np.ndarray  # [M] float32, zeros when the node has none
    method: str  # "winograd4", "winograd", "depthwise" or "im2col"
    lanes: object  # the micro-kernel's width (a simd.Lanes) and tile (a simd.Tile): packed for
    tile: object  # MR = tile.rows, each kernel's B panels NR = tile.cols * lanes.width wide
    packed: np.ndarray  # weights packed for `method`
    im2col_packed: np.ndarray  # weights packed for im2col: every plan can take that path
    # (input shape, threads) -> _launch(...): the per-call arithmetic done once per shape
    launches: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)


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
    alpha=None,
    beta=None,
    clip_min=-math.inf,
    clip_max=math.inf,
    winograd_tile=2,
    width=None,
):
    """Pack a Conv node's weights once. weight: float32 [M, C/group, kh, kw]; bias: M floats in
    any shape ([M], [M,1,1], [1,M,1,1]); pads in ONNX order (top, left, bottom, right);
    activation, alpha, beta, clip_min, clip_max: as kernels.simd.activation's encode takes
    them, a kind that is a clip (identity, relu, clip).
    winograd_tile: 2 for F(2x2, 3x3), 4 for F(4x4, 3x3) (faster, ~10x larger rounding error,
    see _WINOGRAD4_MAX_CHANNELS) where a 3x3 stride-1 conv takes the Winograd path.
    width: the lanes of the GEMM micro-kernel's vectors, 8 or 16 (None: the process's,
    kernels.simd.width()); its tile is the register file's at that width (_gemm.micro_tile)."""
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
    strides, dilations, pads = window_attributes(strides, dilations, pads, auto_pad)
    kind, a, b = encode(activation, alpha, beta, clip_min, clip_max)
    if kind not in CLIPPING:
        clipping = ", ".join(KINDS[k] for k in CLIPPING)
        raise ValueError(f"conv2d's epilogue is a clip: activation must be {clipping}, got "
                         f"{activation!r} (kernels/pointwise runs the others)")  # fmt: skip
    lo, hi = map(np.float32, clip_bounds(kind, a, b))  # from Python: floats
    lanes, tile = _gemm.micro_tile(width)
    if winograd_tile not in (2, 4):
        raise ValueError(f"winograd_tile must be 2 or 4, got {winograd_tile!r}")

    winograd = (
        (kh, kw) == (3, 3)
        and strides == (1, 1)
        and dilations == (1, 1)
        and group == 1
        and cg >= _WINOGRAD_MIN_CHANNELS
    )
    # per group: [Mg, K] with k = (c * kh + i) * kw + j, packed into MR-row panels
    w2d = weight.reshape(group, m // group, cg * kh * kw)
    im2col_packed = np.concatenate([_gemm.pack_a(w2d[g], tile.rows) for g in range(group)])
    method, packed = "im2col", im2col_packed
    if group > 1 and cg == 1 and m == group:
        method, packed = "depthwise", np.ascontiguousarray(weight.reshape(m, kh, kw))
    if winograd and winograd_tile == 4 and cg <= _WINOGRAD4_MAX_CHANNELS:
        method, packed = "winograd4", _winograd_f4_nchw.pack_weights(weight, tile.rows)
    elif winograd:
        method, packed = "winograd", _winograd_f2_nchw.pack_weights(weight, tile.rows)
    return Conv2DPlan(
        out_channels=m,
        in_channels=cg * group,
        group=group,
        kernel=(kh, kw),
        strides=strides,
        dilations=dilations,
        pads=pads,
        auto_pad=auto_pad,
        clip=(lo, hi),
        bias=bias,
        method=method,
        lanes=lanes,
        tile=tile,
        packed=packed,
        im2col_packed=im2col_packed,
    )


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
    # The same memory seen as [N, M, OH*OW], the flat pixel index the kernels write. Setting
    # .shape on a view never copies (and is cheaper than as_strided); the plane check above
    # guarantees the merge of OH and OW is possible.
    out3 = out.view()
    out3.shape = (shape[0], shape[1], oh * ow)
    return out3


def m_splits(tile_panels, m, threads, mr):
    """Into how many channel-panel ranges to split each tile panel so that every thread gets
    work: with fewer tile panels than 2 per thread (a 13x13 image is one F(4x4) panel) the
    input transform is repeated per range rather than leaving a core idle. Not more often: a
    short last panel costs as much as a full one in the GEMMs, so equal item counts are
    already balanced, and a split only repeats the input transform (bench/NOTES.md). mr: the
    rows of a channel panel."""
    want, n_mb = 2 * threads, -(-m // mr)
    return max(1, min(n_mb, -(-want // tile_panels))) if tile_panels < want else 1


HALF_L2 = 256 << 10  # bytes: half of Zen1's 512 KiB L2, what one packed block may use


def _weights_past_l2(m, k):
    """Whether a group's packed weights [m, k] outgrow what the blocks leave of L2."""
    return m * k * 4 > HALF_L2


def _panel_blocks(images, panels, k, m, threads, nr):
    """Pixel-panel blocks per image and group for the im2col path (see im2col_conv): enough
    blocks that every thread gets several (the last one is often short), few enough that the
    weights, streamed once per block, are not re-read for every panel, and each packed block
    stays within half of L2 (256 KiB of Zen1's 512). nr: the pixels of a panel."""
    per_l2 = max(1, HALF_L2 // (k * nr * 4))
    big_a = _weights_past_l2(m, k)  # weights come from L3: fewer, bigger blocks
    balance = -(-(2 if big_a else 4) * threads // images)
    per_blk = -(-panels // min(panels, max(balance, -(-panels // per_l2))))
    # No empty trailing blocks: prange hands each thread an equal count of blocks, so 8 blocks
    # of 2 panels over 11 panels gave one thread 8 panels and the other 3.
    return -(-panels // per_blk)


def _uneven(blocks_per_image, panels, n_blk, threads):
    """Whether prange's equal split of the (image, block) items gives one thread over 5% more
    pixel panels than the average (blocks hold ceil(panels / n_blk), the last the rest)."""
    per = -(-panels // n_blk)
    sizes = [min(per, panels - b * per) for b in range(n_blk)] * blocks_per_image
    chunk = -(-len(sizes) // threads)
    loads = [sum(sizes[i : i + chunk]) for i in range(0, len(sizes), chunk)]
    return max(loads) * threads > 1.05 * sum(sizes)


def _launch(plan, x_shape, threads):
    """(output shape, arguments of the plan's own kernel after out3, arguments of im2col_conv
    after out3) for an input of shape x_shape: everything a call needs besides the arrays."""
    shape, (pt, pl, _, _) = output_shape(x_shape, plan)
    if min(shape) < 1:
        raise ValueError(f"output shape {shape} is empty for input {x_shape}")
    lo, hi = plan.clip
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    direct = (kh, kw, sh, sw, pt, pl) == (1, 1, 1, 1, 0, 0) and shape[2:] == x_shape[2:]
    k = plan.in_channels // plan.group * kh * kw
    L, T = plan.lanes, plan.tile
    nr = _gemm.panel_width(T, L)
    panels = -(-shape[2] * shape[3] // nr)
    mg = plan.out_channels // plan.group
    blocks_per_image = shape[0] * plan.group
    n_blk = _panel_blocks(blocks_per_image, panels, k, mg, threads, nr)
    n_ms = 1
    many_channels = direct and mg >= 32 * threads and _weights_past_l2(mg, k)
    if many_channels and _uneven(blocks_per_image, panels, n_blk, threads):
        # Weights past L2 and pixel blocks that do not split evenly between the threads (the
        # 512 -> 1000 classifier at 13x13: 11 panels in blocks of 3, 3, 3, 2, so 6 panels for
        # one thread, 5 for the other): each thread takes every block for its share of the
        # channel panels instead (a block is then packed once per share). Only for a 1x1
        # conv, whose packing is a plain copy, and with enough channels that the shares are
        # even: a gathered 3x3 im2col or a few channel panels ran slower split (bench/NOTES.md).
        n_ms = threads
    im2col = (L, T, kh, kw, sh, sw, dh, dw, pt, pl, shape[3], plan.group, lo, hi, n_blk, n_ms,
              direct)  # fmt: skip
    fast = None
    if plan.method in ("winograd4", "winograd"):
        m = 4 if plan.method == "winograd4" else 2
        tiles = -(-shape[2] // m) * -(-shape[3] // m)
        n_ms = m_splits(shape[0] * -(-tiles // nr), shape[1], threads, T.rows)
        fast = (L, T, pt, pl, shape[2], shape[3], lo, hi, n_ms)
    elif plan.method == "depthwise":
        fast = (sh, sw, dh, dw, pt, pl, shape[3], lo, hi)
    return shape, fast, im2col


def check_input(x, plan):
    """Raise ValueError unless x is a float32 C-contiguous [N, C, H, W] array for `plan`."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError(f"x must be a float32 numpy array, got {getattr(x, 'dtype', type(x))}")
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D [N, C, H, W], got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous (use np.ascontiguousarray)")
    if x.shape[1] != plan.in_channels:
        raise ValueError(f"x has {x.shape[1]} channels, the weights expect {plan.in_channels}")


def cached_launch(make, plan, x_shape):
    """make(plan, x_shape, threads) for the calling thread's thread count, cached in
    plan.launches (a Conv2DPlan's or a FirePlan's) per input shape and thread count."""
    key = (x_shape, get_threads())
    found = plan.launches.get(key)
    if found is None:
        if len(plan.launches) > 64:  # a model fed ever new shapes: do not grow without bound
            plan.launches.clear()
        found = plan.launches[key] = make(plan, x_shape, key[1])
    return found


def launch(plan, x_shape):
    """_launch for this input shape and the calling thread's thread count, cached on the plan."""
    return cached_launch(_launch, plan, x_shape)


def kernel_weights(plan):
    """(own packed weights, im2col packed weights, bias): winograd_or_im2col's `weights`."""
    return plan.packed, plan.im2col_packed, plan.bias


@numba.jit(**JIT)
def winograd_or_im2col(x, out3, weights, fast, im2col, winograd):
    """F(2x2) Winograd when `winograd` (fast: its arguments), redone by im2col if an inf or NaN
    reached its tiles (see winograd_conv); otherwise im2col (im2col: its arguments)."""
    bad = np.zeros(1, np.int32)
    if winograd:
        _winograd_f2_nchw.winograd_conv(x, weights[0], weights[2], out3, *fast, bad)
    if not winograd or bad[0]:
        _im2col_nchw.im2col_conv(x, weights[1], weights[2], out3, *im2col)


def conv2d_bias_act(x, plan, out=None):
    """y = act(conv2d(x, w) + bias) for x float32 C-contiguous [N, C, H, W]; returns `out`.

    out: optional float32 [N, M, OH, OW] array, or a channel-slice view of a bigger buffer.
    """
    check_input(x, plan)
    shape, fast, im2col = launch(plan, x.shape)
    if out is None:
        out = np.empty(shape, np.float32)
        out3 = out.reshape(shape[0], shape[1], shape[2] * shape[3])
    else:
        out3 = _check_out(out, shape, x)
    # Winograd mixes the pixels of a tile before multiplying: one inf or NaN input would poison
    # all four outputs of its tile, where a direct convolution poisons only the outputs whose
    # window holds it. Such inputs take the im2col path, as onnxruntime would: F(2x2) finds
    # them in its transformed tiles (and is then redone), F(4x4) beforehand.
    if plan.method == "winograd":
        winograd_or_im2col(x, out3, kernel_weights(plan), fast, im2col, True)
    elif plan.method == "winograd4" and _winograd_f2_nchw.all_finite(x):
        _winograd_f4_nchw.winograd4_conv(x, plan.packed, plan.bias, out3, *fast)
    elif plan.method == "depthwise":
        _depthwise_nchw.depthwise_conv(x, plan.packed, plan.bias, out3, *fast)
    else:
        _im2col_nchw.im2col_conv(x, plan.im2col_packed, plan.bias, out3, *im2col)
    return out
