"""Conv2D on blocked tensors with the fused epilogue: the conv family's fast path.

    y = epilogue(conv2d(x, W)),  x, y blocked (kernels/blocked.py), epilogue as in
    kernels/epilogue.py (bias, residual before or after, any activation of the table)

prepare_conv_nchwc packs the weights once for the register tile (_direct.py); conv_nchwc
validates an input, works out the geometry for its shape (cached per shape and thread count)
and runs the parallel kernel. Groups are supported when each group's input and output channels
are whole blocks (a depthwise conv has its own kernel, _dwconv.py); with one group any channel
counts work (the last block is zero-padded).

    >>> plan = prepare_conv_nchwc(w, b, pads=(1, 1, 1, 1), activation="relu")
    >>> yb = conv_nchwc(to_blocked(x), plan)       # [N, ceil(M/8), OH, OW, 8]
"""

import dataclasses
import functools
import math

import numpy as np

from . import _direct as d
from . import _dwconv
from .blocked import BLOCK, block_size
from .config import get_threads, slp_vectorize
from .epilogue import RESIDUALS
from .machine import cache_bytes
from .simd import Lanes
from .simd.activation import encode
from .windows import conv_output_shape, window_attributes
from .workspace import per_thread

# Relative speed of the three register tiles (3x4, 6x2, 12x1) when none computes padding: per
# 12 FMAs the 3x4 tile loads 3 broadcasts and 4 weight vectors, the 12x1 tile 12 broadcasts
# and 1 vector. Only the order matters (which tile to try first); where another tile wastes
# fewer slots, both are offered and timed (tile_options; bench/NOTES.md, "Blocked layout and
# tactics").
_TILE_SPEED = {4: 1.0, 2: 0.6, 1: 0.4}
LANES = Lanes(BLOCK)  # the epilogue's vectors: one block's channels


@dataclasses.dataclass(frozen=True)
class ConvPlan:
    """A Conv node's weights packed for the blocked kernel, and its attributes."""

    in_channels: int
    out_channels: int
    group: int
    kernel: tuple
    strides: tuple
    dilations: tuple
    pads: tuple  # (top, left, bottom, right)
    auto_pad: str
    in_block: int  # BI: channels per input block
    out_blocks_per_group: int  # MBG
    in_blocks_per_group: int  # CBG
    fb: int  # output blocks per register tile
    depthwise: bool  # group == C == M: the depthwise kernel (_dwconv.py)
    packed: np.ndarray  # [G, OGG, CBG, KH, KW, BI, FB*8] flat; depthwise: [CB, KH, KW, 8]
    bias: np.ndarray  # [G * OGG * FB * 8]
    act: tuple  # (kind, a, b): kernels/simd/activation.py
    residual: int  # epilogue.NO_RESIDUAL / BEFORE / AFTER
    geometry: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def out_blocks(self) -> int:
        if self.depthwise:
            return -(-self.out_channels // BLOCK)
        return self.group * self.out_blocks_per_group


def is_depthwise(weight_shape, group: int) -> bool:
    """One filter per channel: group == C == M (MobileNet's 3x3 and 5x5 convs)."""
    m, cg, _, _ = weight_shape
    return group > 1 and cg == 1 and m == group


def supports(weight_shape, group: int) -> str | None:
    """Why the blocked kernels cannot run this conv, or None when they can."""
    m, cg, _, _ = weight_shape
    if group == 1 or is_depthwise(weight_shape, group):
        return None
    if cg % BLOCK or (m // group) % BLOCK:
        return (f"grouped conv with {cg} input and {m // group} output channels per group: the "
                f"blocked kernel needs whole blocks of {BLOCK}")  # fmt: skip
    return None


def _pick_fb(mbg: int) -> int:
    """Output blocks per tile: the fewest tile-slots (padding included) per unit of speed."""
    return min((4, 2, 1), key=lambda fb: (-(-mbg // fb) * fb / _TILE_SPEED[fb], -fb))


def tile_options(weight_shape, group: int = 1) -> tuple[int, ...]:
    """Output blocks per register tile worth timing for a conv, likeliest first: the pick by
    speed, and the tile that computes the fewest padding slots when that is another one (M =
    24: 3x4 with a padded block, or 12x1 with none; which wins depends on the CPU)."""
    m = weight_shape[0]
    if is_depthwise(weight_shape, group):
        return (1,)
    mbg = -(-(m // group) // BLOCK)
    first = _pick_fb(mbg)
    tight = min((4, 2, 1), key=lambda fb: (-(-mbg // fb) * fb, -fb))
    return (first,) if tight == first else (first, tight)


def prepare_conv_nchwc(
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
    residual=None,
    tile=None,
):
    """Pack a Conv's weights [M, C/group, kh, kw] (float32) and bias for conv_nchwc.

    activation, alpha, beta, clip_min, clip_max: the activation, as kernels.simd.activation's
    encode takes it; residual: None, "before" (added before the activation) or "after"; tile:
    output blocks per register tile (4, 2 or 1; default the first of tile_options)."""
    if not isinstance(weight, np.ndarray) or weight.dtype != np.float32 or weight.ndim != 4:
        raise ValueError(f"weight must be a float32 array [M, C/group, kh, kw], got {weight!r:.80}")
    m, cg, kh, kw = weight.shape
    group = int(group)
    if group < 1 or m % group or min(weight.shape) < 1:
        raise ValueError(f"bad weight shape {weight.shape} for group={group}: M % group must be 0")
    reason = supports(weight.shape, group)
    if reason:
        raise ValueError(reason)
    strides, dilations, pads = window_attributes(strides, dilations, pads, auto_pad)
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {list(RESIDUALS)}, got {residual!r}")
    act = encode(activation, alpha, beta, clip_min, clip_max)
    if bias is not None:
        bias = np.asarray(bias)
        if bias.dtype != np.float32 or bias.size != m:
            raise ValueError(f"bias must be {m} float32 values, got {bias.dtype} {bias.shape}")
    common = dict(
        in_channels=cg * group, out_channels=m, group=group, kernel=(kh, kw), strides=strides,
        dilations=dilations, pads=pads, auto_pad=auto_pad, act=act,
        residual=RESIDUALS[residual],
    )  # fmt: skip
    if is_depthwise(weight.shape, group):
        blocks = -(-m // BLOCK)
        wp = np.zeros((blocks * BLOCK, kh, kw), np.float32)
        wp[:m] = weight.reshape(m, kh, kw)
        bp = np.zeros(blocks * BLOCK, np.float32)
        bp[:m] = 0 if bias is None else bias.reshape(m)
        packed = wp.reshape(blocks, BLOCK, kh, kw).transpose(0, 2, 3, 1)
        return ConvPlan(
            **common, in_block=BLOCK, out_blocks_per_group=1, in_blocks_per_group=1, fb=1,
            depthwise=True, packed=np.ascontiguousarray(packed).ravel(), bias=bp,
        )  # fmt: skip
    c = cg * group
    bi = block_size(c) if group == 1 else BLOCK
    mg = m // group
    cbg, mbg = -(-cg // bi), -(-mg // BLOCK)
    fb = _pick_fb(mbg) if tile is None else int(tile)
    if fb not in _TILE_SPEED:
        raise ValueError(f"tile must be one of {sorted(_TILE_SPEED)} output blocks, got {tile!r}")
    ogg = -(-mbg // fb)
    wp = np.zeros((group, ogg * fb * BLOCK, cbg * bi, kh, kw), np.float32)
    wp[:, :mg, :cg] = weight.reshape(group, mg, cg, kh, kw)
    wp = wp.reshape(group, ogg, fb * BLOCK, cbg, bi, kh, kw).transpose(0, 1, 3, 5, 6, 4, 2)
    bp = np.zeros((group, ogg * fb * BLOCK), np.float32)
    if bias is not None:
        bp[:, :mg] = bias.reshape(group, mg)
    return ConvPlan(
        **common, in_block=bi, out_blocks_per_group=mbg, in_blocks_per_group=cbg, fb=fb,
        depthwise=False, packed=np.ascontiguousarray(wp).ravel(), bias=bp.ravel(),
    )  # fmt: skip


def output_shape(x_shape, plan: ConvPlan):
    """The blocked output shape [N, MB, OH, OW, 8] for a blocked input shape."""
    n, _, h, w, _ = x_shape
    (_, _, oh, ow), _ = conv_output_shape((n, plan.in_channels, h, w), plan)
    return (n, plan.out_blocks, oh, ow, BLOCK)


@functools.lru_cache(maxsize=8)
def _budgets():
    """(bytes of packed weights below which K is not cut, bytes of one chunk when it is): a
    filter group's weights are read once per tile, so they should stay in L2 (from L3 a tile
    would wait on them); a smaller budget (L1) would mean more chunks, each parking and
    reloading every tile's accumulators."""
    l2 = cache_bytes(2)
    return l2 // 2, l2 // 4


def _geometry(plan: ConvPlan, x_shape, threads: int) -> np.ndarray:
    n, cb, h, w, bi = x_shape
    (_, _, oh, ow), (pt, pl, _, _) = conv_output_shape((n, plan.in_channels, h, w), plan)
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    fb = plan.fb
    pw = _dwconv.TILE if plan.depthwise else d.ACC // fb
    ogg = -(-plan.out_blocks_per_group // fb)
    # Columns whose every tap is inside the row: ow >= a, ow < b.
    a = min(ow, -(-pl // sw))
    last = w - 1 - (kw - 1) * dw + pl
    b = max(a, min(ow, last // sw + 1)) if last >= 0 else a
    whole, part = _budgets()
    per_block = kh * kw * bi * fb * BLOCK * 4  # bytes of packed weights per input block
    cbg = plan.in_blocks_per_group
    chunk = cbg if per_block * cbg <= whole else max(1, min(cbg, part // per_block))
    others = max(1, n * (cb if plan.depthwise else plan.group * ogg))  # n = 0: nothing to split
    rb_len = min(oh, max(1, -(-4 * threads // others)))
    rows = -(-oh // rb_len)
    if plan.depthwise:  # the padded input rows of an item stay within a quarter of L2
        row_bytes = ((-(-ow // pw) * pw - 1) * sw + (kw - 1) * dw + 1) * BLOCK * 4 * sh
        rows = max(1, min(rows, cache_bytes(2) // 4 // max(1, row_bytes)))
    g = np.zeros(d.N_GEO, np.int64)
    values = {
        d.N: n, d.CB: cb, d.BI: bi, d.H: h, d.W: w, d.KH: kh, d.KW: kw, d.SH: sh, d.SW: sw,
        d.DH: dh, d.DW: dw, d.PT: pt, d.PL: pl, d.MB: plan.out_blocks, d.OH: oh, d.OW: ow,
        d.G: plan.group, d.CBG: cbg, d.MBG: plan.out_blocks_per_group, d.FB: fb, d.PW: pw,
        d.OGG: ogg, d.COL_A: a, d.COL_B: b, d.CHUNK: chunk, d.ROWS: rows,
        d.RESIDUAL: plan.residual, d.ACT: plan.act[0],
    }  # fmt: skip
    for k, v in values.items():
        g[k] = v
    return g


@dataclasses.dataclass
class _Launch:
    """What a call on one input shape needs, worked out on the first such call."""

    shape: tuple  # the output's
    geometry: np.ndarray
    run: object  # the compiled entry point
    scratch: int  # floats of per-thread scratch (depthwise), else 0
    empty: bool  # batch 0: nothing to compute
    warm: bool = False  # called once: compiled, so no need for the SLP switch


def _launch(plan: ConvPlan, xb, threads: int) -> _Launch:
    """Validate an input shape against the plan and work out its launch (ValueError if bad)."""
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    n, cb, _, _, bi = xb.shape
    want_cb = plan.out_blocks if plan.depthwise else plan.group * plan.in_blocks_per_group
    if bi != plan.in_block or cb != want_cb:
        raise ValueError(
            f"x has {cb} blocks of {bi} channels; the conv reads {plan.in_channels} channels "
            f"({want_cb} blocks of {plan.in_block})"
        )
    shape = output_shape(xb.shape, plan)
    if min(shape[2:]) < 1:
        raise ValueError(f"output shape {shape} is empty for input {xb.shape}")
    g = _geometry(plan, xb.shape, threads)
    if plan.depthwise:
        return _Launch(shape, g, _dwconv.dwconv_nchwc, _dwconv.scratch_size(g), n == 0)
    return _Launch(shape, g, d.entry(plan.fb, plan.in_block), 0, n == 0)


def conv_nchwc(xb, plan: ConvPlan, out=None, residual=None):
    """y = epilogue(conv(xb)) for a blocked float32 input; returns the blocked output.

    residual: a blocked array of the output's shape when the plan adds one. The per-shape work
    (checks, geometry) is done on a shape's first call; a later call costs a dict look-up."""
    key = (xb.shape, get_threads()) if isinstance(xb, np.ndarray) else None
    launch = plan.geometry.get(key)
    if launch is None or xb.dtype != np.float32:
        launch = plan.geometry[key] = _launch(plan, xb, key[1] if key else 1)
    shape = launch.shape
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    if launch.empty:
        return out
    xf, yf = np.ascontiguousarray(xb).reshape(-1), out.reshape(-1)
    if plan.residual:
        if not isinstance(residual, np.ndarray) or residual.shape != shape:
            raise ValueError(f"the residual must be a blocked array of shape {shape}")
        res = np.ascontiguousarray(residual, dtype=np.float32).reshape(-1)
    else:
        res = yf  # not read
    _, a, b = plan.act
    g = launch.geometry
    last = per_thread(launch.scratch) if launch.scratch else plan.in_block
    if launch.warm:
        launch.run(LANES, xf, plan.packed, plan.bias, yf, res, g, a, b, last)
        return out
    with slp_vectorize():  # the first call may compile: with LLVM's SLP vectorizer
        launch.run(LANES, xf, plan.packed, plan.bias, yf, res, g, a, b, last)
    launch.warm = True
    return out
