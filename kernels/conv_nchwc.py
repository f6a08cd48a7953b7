"""Conv2D on blocked tensors with the fused epilogue: the conv family's fast path.

    y = epilogue(conv2d(x, W)),  x, y blocked (kernels/blocked.py), epilogue as in
    kernels/epilogue.py (bias, residual before or after, any activation of the table)

prepare_conv_nchwc packs the weights once for the register tile (_direct_blocked.py) at a block b,
the SIMD width the kernel computes at (default kernels.simd.width(): 8 with AVX2, 16 with
AVX-512); conv_nchwc validates an input, works out the geometry and the tile for its shape
(cached per shape and thread count) and runs the parallel kernel. Groups are supported when
each group's input and output channels are whole blocks (a depthwise conv has its own kernel,
_depthwise_blocked.py), or when groups of as many outputs as inputs divide a block (RegNet's
width 8 at 16 lanes: block_diagonal); with one group any channel counts work (the last block
is zero-padded).

    >>> plan = prepare_conv_nchwc(w, b, pads=(1, 1, 1, 1), activation="relu")
    >>> yb = conv_nchwc(to_blocked(x, block=plan.in_block), plan)  # [N, ceil(M/b), OH, OW, b]

Register tiles. A tile is PW pixels x FB output blocks of accumulators (simd.Tile); per input
channel and tap it does PW FB FMAs for PW broadcasts of x and FB weight vectors. For each FB in
(4, 2, 1), capped at the output blocks per group, PW is the tallest worth running: the most the
register file holds, one-column tiles at half as many rows as registers (simd.tile.tallest:
3x4, 6x2, 8x1 with AVX2 at 8 lanes; 6x4, 14x2, 16x1 with AVX-512 at 16),
and the tiles rank by useful FMAs per load: PW FB / (PW + FB) times the share of the FB-block
filter groups that is not padding (M = 24 at 8 lanes: 4x3, no padding, before a padded 3x4).
The plan packs for FB; PW is chosen per input shape, narrower when a row's interior is narrow
(tile_rows: a 5-column interior is not left to the one-pixel path by an 8-pixel tile).
"""

import dataclasses
import functools
import math
import operator

import numpy as np

from . import _blocked_geometry as geo
from . import _depthwise_blocked
from . import _direct_blocked as d
from ._first_class import Item
from .config import entry_point, get_threads
from .epilogue import RESIDUALS
from .machine import cache_bytes
from .simd import lanes, width
from .simd import tile as tiles
from .simd.activation import encode
from .windows import conv_output_shape, window_attributes
from .workspace import allocator, disjoint, empty, per_thread

TILE_BLOCKS = (4, 3, 2, 1)  # output blocks per register tile worth considering (FB)
# Independent FMA chains that keep a core's FMA units busy (two ports x 4-5 cycles of latency):
# a tile with fewer accumulators waits on latency, in proportion.
CHAINS = 10
NARROW_GAIN = 1.15  # what a narrower tile than the tallest must save (tile_rows)
# A tile's cost past its accumulator-slots, in slots: its k loop's set-up and its stores. A
# 14 x 14 1x1 conv ran 3% slower as 14 rows of a 9-pixel and a 5-pixel tile (196 slots) than
# as one 196-pixel row of 21 tiles of 9 and one overlapping (198): 141 against 137 us (Zen 4,
# bench/NOTES.md; a model constant like CHAINS, not timed on AVX2 hardware).
TILE_SETUP = 1.0


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
    block: int  # b: channels per output block, the SIMD width the kernel computes at
    in_block: int  # BI: channels per input block (b, or C when C < b and group = 1)
    out_blocks_per_group: int  # MBG
    in_blocks_per_group: int  # CBG
    fb: int  # output blocks per register tile
    pixels: int | None  # pixels per register tile when forced, else chosen per input shape
    depthwise: bool  # group == C == M: the depthwise kernel (_depthwise_blocked.py)
    packed: np.ndarray  # [G, OGG, CBG, KH, KW, BI, FB*b] flat; depthwise: [CB, KH, KW, b]
    bias: np.ndarray  # [G * OGG * FB * b]
    act: tuple  # (kind, a, b): kernels/simd/activation.py
    residual: int  # epilogue.NO_RESIDUAL / BEFORE / AFTER
    geometry: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def out_blocks(self) -> int:
        if self.depthwise:
            return -(-self.out_channels // self.block)
        return self.group * self.out_blocks_per_group


def is_depthwise(weight_shape, group: int) -> bool:
    """One filter per channel: group == C == M (MobileNet's 3x3 and 5x5 convs)."""
    m, cg, _, _ = weight_shape
    return group > 1 and cg == 1 and m == group


def is_narrow(weight_shape, group: int, block: int) -> bool:
    """Groups narrower than a block, as many outputs as inputs each, and a whole number of them
    per block (RegNet's group width 8 at 16 lanes): run as block-diagonal groups of one block."""
    m, cg, _, _ = weight_shape
    return group > 1 and cg == m // group and cg < block and block % cg == 0


def supports(weight_shape, group: int, block: int | None = None) -> str | None:
    """Why the blocked kernels cannot run this conv at `block` channels per block (default
    the process's width), or None when they can."""
    m, cg, _, _ = weight_shape
    if group == 1 or is_depthwise(weight_shape, group):
        return None
    b = width() if block is None else block
    if (cg % b or (m // group) % b) and not is_narrow(weight_shape, group, b):
        return (f"grouped conv with {cg} input and {m // group} output channels per group: the "
                f"blocked kernel needs whole blocks of {b}, or groups of as many outputs as "
                f"inputs that divide {b}")  # fmt: skip
    return None


def block_diagonal(weight: np.ndarray, group: int, block: int) -> np.ndarray:
    """The weights [M', b, kh, kw] of a narrow-grouped conv (is_narrow) as M' / b groups of
    one block (M' = M rounded up to blocks): within a block, output lane k reads input lane j
    with W[o, j'] when channels o = g' b + k and c = g' b + j are in the same group (j' is c's
    place in it), else 0. The kernel does b / (C / group) times the conv's multiplies, at
    the full width and in the layout of the convs around it."""
    m, cg, kh, kw = weight.shape
    blocks = -(-m // block)
    out = np.arange(blocks * block).reshape(blocks, block, 1)  # o
    inp = np.arange(blocks * block).reshape(blocks, 1, block)  # c, in the same block as o
    same = (out // cg == inp // cg) & (out < m)
    dense = np.zeros((blocks, block, block, kh, kw), np.float32)
    rows, lanes_o, lanes_i = np.nonzero(same)
    o = rows * block + lanes_o
    dense[rows, lanes_o, lanes_i] = weight[o, (rows * block + lanes_i) % cg]
    return dense.reshape(blocks * block, block, kh, kw)


def _padding(fb: int, mbg: int) -> int:
    """Output blocks of padding that filter groups of fb blocks compute for mbg blocks."""
    return -(-mbg // fb) * fb - mbg


def _per_vector(w: int) -> int:
    """Registers (and FMA and load instructions) per vector of w lanes: 2 for 16 lanes on AVX2."""
    return -(-w // tiles.registers()[1])


def _per_load(fb: int, w: int) -> float:
    """FMAs per load of the tallest tile of fb blocks at w lanes: PW FB / (PW + FB) (v PW FB /
    (PW + v FB) in instructions when a vector takes v registers: one broadcast serves every
    register of a row)."""
    pw, v = tiles.tallest(fb, w), _per_vector(w)
    return v * pw * fb / (pw + v * fb)


def _share(fb: int, mbg: int) -> float:
    """The share of a tile's output blocks that are not padding."""
    return mbg / (mbg + _padding(fb, mbg))


def _merit(fb: int, mbg: int, w: int) -> float:
    """Useful FMAs per load: _per_load times the share that is not padding."""
    return _per_load(fb, w) * _share(fb, mbg)


def tile_blocks(mbg: int, w: int) -> tuple[int, ...]:
    """Output blocks per tile (FB) worth timing for mbg output blocks per group at w lanes,
    likeliest first.

    First: among the tiles that load no more often than they multiply (at least one FMA per
    load: a core issues loads at least as fast as FMAs, so these wait on FMAs, not on loads),
    the one computing the least padding, then the most FMAs per load; with none such, the
    best by _merit. At 16 lanes 10 output blocks take 14x2 (no padding) before 6x4 (2 padded
    of 12): Zen 4 ran 960->160 7x7 in 82 us on 14x2 against 123-142 on 6x4; 9 blocks take 9x3
    (none padded) before 14x2 (one of 10): 24->144 1x1 at 56 x 56 ran in 160 us on 9x3, 177 on
    14x2, 96->144 at 28 x 28 106 against 117 (bench/NOTES.md).
    Then, when there is another, the one of the others that computes the fewest padding
    blocks, then the most FMAs per load (5 blocks: 9x3 with one padded of 6, then 16x1; 8
    blocks: 6x4, then 14x2 rather than 9x3's padded block). Which wins depends on the CPU and
    the shape more than these counts say (on Zen 1 the 3x4 tile beat the taller ones even with
    padding; on Zen 4 14x2 ran ResNet-50's 1x1 stride-2 1024->2048 conv at 14x14 in 1.05 ms
    against 6x4's 1.30, whose 7-wide output rows take 3-pixel tiles, and lost on 3x3 256->256
    at 14x14, 1.14 against 0.97 ms; 16->72 1x1 at 56 x 56 ran fastest on 30x1, before one-column
    tiles stopped at 16 rows (simd.tile.tallest; not timed again on AVX-512): bench/NOTES.md),
    so a "fastest" session times both."""
    fbs = sorted({min(fb, mbg) for fb in TILE_BLOCKS}, reverse=True)
    unbound = [fb for fb in fbs if _per_load(fb, w) >= 1.0]
    if unbound:
        first = max(unbound, key=lambda fb: (_share(fb, mbg), _per_load(fb, w), fb))
    else:
        first = max(fbs, key=lambda fb: (_merit(fb, mbg, w), fb))
    others = [fb for fb in fbs if fb != first]
    if not others:
        return (first,)
    return first, min(others, key=lambda fb: (_padding(fb, mbg), -_merit(fb, mbg, w), -fb))


def tile_options(weight_shape, group: int = 1, block: int | None = None) -> tuple[int, ...]:
    """tile_blocks for a conv at `block` channels per block (default the process's width)."""
    if is_depthwise(weight_shape, group):
        return (1,)
    b = width() if block is None else block
    return tile_blocks(-(-(weight_shape[0] // group) // b), b)


def tile_rows(fb: int, w: int, interior: int) -> int:
    """Pixels per tile (PW) for a row whose `interior` columns run in tiles: the tallest that
    fits (tiles.tallest), unless a narrower one, halving, covers the interior in fewer than
    1 / NARROW_GAIN of its accumulator-slots per unit of speed (a tile of fewer than CHAINS
    accumulators waits on FMA latency; a taller one streams fewer weight bytes per FMA, hence
    the margin). What whole tiles leave of a row runs on a tile of half their rows where it
    fits (_direct_blocked.half_rows), else on one more overlapping the last. 8x1 at 8 lanes
    takes 5 columns (a 7x7 3x3 conv) as tiles of 4 and 2 rather than one pixel at a time, and
    7 columns as one 7x1 (14x1's halving); 3x4 keeps 3 at 5 columns (a 3x4 and a 2x4); 6x4 at
    16 lanes keeps 6 on a 13-wide 1x1 (two 6x4 and a 3x4: 18 slots with their set-ups, four
    3x4 and a 2x4 19.5)."""
    costs = _row_costs(fb, w, interior)
    if not costs:  # no tile fits: the one-pixel path takes the row
        return tiles.tallest(fb, w)
    cheapest = min(costs.values())
    return max(pw for pw, cost in costs.items() if cost <= NARROW_GAIN * cheapest)


def _row_costs(fb: int, w: int, interior: int) -> dict:
    """{PW: the cost of covering `interior` columns in tiles of PW x fb}, for the most rows that
    fit the register file and its halvings, each at most the tallest worth running
    (tiles.tallest: 8, 7, 4, 2 for one column on AVX2), that fit in the row: accumulator-slots
    computed, over the tile's speed (a tile of fewer than CHAINS accumulators waits on FMA
    latency), plus TILE_SETUP per tile; what whole tiles leave costs a half-height tile where
    it fits, else a whole one."""
    top, cap, v = tiles.fit_rows(fb, w), tiles.tallest(fb, w), _per_vector(w)

    def slots(rows: int) -> float:  # one tile's accumulator-slots over its speed, and set-up
        return rows / min(1.0, v * rows * fb / CHAINS) + TILE_SETUP

    costs, pw = {}, top
    while True:
        rows = min(pw, cap)
        if rows <= interior:
            whole, left = divmod(interior, rows)  # what whole tiles leave: a half tile, or one
            half = d.half_rows(rows)  # overlapping the last (_direct_blocked.tile_item)
            tail = 0.0 if left == 0 else slots(half) if left <= half else slots(rows)
            costs[rows] = whole * slots(rows) + tail
        if pw <= 2:
            break
        pw = -(-pw // 2)
    return costs


def _pointwise_rows(plan: ConvPlan, n: int, h: int, w: int, threads: int):
    """(rows, columns, runs) to run a 1x1, stride-1, unpadded conv's H x W pixels as: any
    factorization of H W, since such a conv's pixel p reads x at pixel p alone and the blocked
    layout holds a block's pixels in one run; or one row cut in runs of pixels, each a work
    item (G = 1). Row tiles do not cross rows: a 7-wide row takes a 6-pixel tile and a 3-pixel
    one, where 49 pixels in one row take 8 and a 3-pixel one. The cheapest by the tiles'
    cost (_row_costs, as tile_rows ranks them) on the busiest thread (rows and runs are what
    items split: a single row of few filter groups leaves a thread idle)."""
    if plan.pixels:  # a forced tile: the conv's own rows
        return h, w, 1
    ogg = -(-plan.out_blocks_per_group // plan.fb)
    others = max(1, n * plan.group * ogg)
    pixels = h * w
    small = [r for r in range(1, math.isqrt(pixels) + 1) if pixels % r == 0]
    best = None
    for rows in sorted({*small, *(pixels // r for r in small)}):
        cols = pixels // rows
        costs = _row_costs(plan.fb, plan.block, cols)
        if not costs:
            continue  # no tile fits a row this narrow
        load = _busiest_rows(rows, others, band_rows(rows, others, threads), threads)
        cost = min(costs.values()) * load
        if best is None or cost < best[0]:
            best = (cost, rows, cols, 1)
    for runs in range(2, 2 * threads + 1) if plan.group == 1 and threads > 1 else ():
        chunk = -(-pixels // runs)
        costs = _row_costs(plan.fb, plan.block, chunk)
        if not costs or (runs - 1) * chunk >= pixels:
            continue  # no tile fits a run this short, or a run would be empty
        cost = min(costs.values()) * _busiest_rows(runs, others, 1, threads)
        if best is None or cost < best[0]:
            best = (cost, 1, pixels, runs)
    return (h, w, 1) if best is None else best[1:]


def _busiest_rows(oh: int, others: int, rows: int, threads: int) -> int:
    """Output rows of the busiest thread when `others` x bands items (bands of `rows` rows,
    the last one shorter) are cut for `threads` as a prange cuts its range: runs of equal
    item counts, t from t n / threads, in order."""
    bands = -(-oh // rows)
    items = others * bands
    last = oh - (bands - 1) * rows
    busiest = 0
    for t in range(threads):  # items a <= i < b; i % bands == bands - 1 is a last band
        a, b = t * items // threads, (t + 1) * items // threads
        lasts = b // bands - a // bands
        busiest = max(busiest, (b - a - lasts) * rows + lasts * last)
    return busiest


def band_rows(oh: int, others: int, threads: int) -> int:
    """Output rows per work item of a conv whose oh rows are cut in bands, `others` items per
    band (images x filter groups): at least 4 items a thread where there are rows for it, then
    up to twice as many bands where they lighten the busiest thread (each item has its own
    set-up: scratch, its filter group's weights): 9 filter groups of a 7 x 7 image on two
    threads ran as 9 items, 5 of them on one thread (576 -> 576 1x1, 4-block tile)."""
    base = max(1, -(-oh // min(oh, max(1, -(-4 * threads // others)))))
    best = None
    for rows in range(base, -(-base // 2) - 1, -1):  # the fewest items first on a tie
        load = _busiest_rows(oh, others, rows, threads)
        if best is None or load < best[0]:
            best = (load, rows)
    return best[1]


def busiest(items: int, threads: int) -> float:
    """The busiest thread's share of `items` equal work items over the mean share: a parallel
    loop takes as long as its busiest thread."""
    return -(-items // threads) / (items / threads)


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
    block=None,
    in_block=None,
):
    """Pack a Conv's weights [M, C/group, kh, kw] (float32) and bias for conv_nchwc.

    activation, alpha, beta, clip_min, clip_max: the activation, as kernels.simd.activation's
    encode takes it; residual: None, "before" (added before the activation) or "after"; tile:
    output blocks per register tile (FB: 1 to 4; default the first of tile_options), or a
    shape (pixels, blocks) to force (the pixels are otherwise chosen per input shape); block:
    channels per block, the SIMD width the kernel computes at (8 or 16; default the process's,
    kernels.simd.width()); in_block: the input's channels per block (default: `block`, or C
    when C < block and group is 1, as kernels.blocked.block_size gives; `block` for an input
    another blocked kernel wrote at its width whatever its channel count; 1 with group 1: an
    NCHW array read as it lies, reshaped to [N, C, H, W, 1], as a stem's image arrives)."""
    if not isinstance(weight, np.ndarray) or weight.dtype != np.float32 or weight.ndim != 4:
        raise ValueError(f"weight must be a float32 array [M, C/group, kh, kw], got {weight!r:.80}")
    m, cg, kh, kw = weight.shape
    group = int(group)
    if group < 1 or m % group or min(weight.shape) < 1:
        raise ValueError(f"bad weight shape {weight.shape} for group={group}: M % group must be 0")
    block = width() if block is None else block
    if block not in (8, 16):
        raise ValueError(f"block must be 8 or 16 channels, got {block!r}")
    reason = supports(weight.shape, group, block)
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
        residual=RESIDUALS[residual], block=block,
    )  # fmt: skip
    if is_depthwise(weight.shape, group):
        blocks = -(-m // block)
        wp = np.zeros((blocks * block, kh, kw), np.float32)
        wp[:m] = weight.reshape(m, kh, kw)
        bp = np.zeros(blocks * block, np.float32)
        bp[:m] = 0 if bias is None else bias.reshape(m)
        packed = wp.reshape(blocks, block, kh, kw).transpose(0, 2, 3, 1)
        return ConvPlan(
            **common, in_block=block, out_blocks_per_group=1, in_blocks_per_group=1, fb=1,
            pixels=None, depthwise=True, packed=np.ascontiguousarray(packed).ravel(), bias=bp,
        )  # fmt: skip
    c = cg * group
    narrow = is_narrow(weight.shape, group, block)
    if narrow:  # whole blocks in and out from here on (a single one when C < b)
        weight, group = block_diagonal(weight, group, block), -(-m // block)
        if bias is not None:
            bias = np.concatenate([bias.reshape(m), np.zeros(group * block - m, np.float32)])
        m, cg = weight.shape[:2]
        common["group"] = group
    bi = (block if c >= block else c) if group == 1 and not narrow else block
    if in_block is not None:
        plain = in_block == 1 and group == 1 and not narrow  # NCHW itself: [N, C, H, W, 1]
        if in_block not in (bi, block) and not plain:
            raise ValueError(f"in_block must be {block} or {bi} for {c} channels, got {in_block}")
        bi = in_block
    mg = m // group
    cbg, mbg = -(-cg // bi), -(-mg // block)
    fb, pixels = _tile_argument(tile, mbg, block)
    ogg = -(-mbg // fb)
    wp = np.zeros((group, ogg * fb * block, cbg * bi, kh, kw), np.float32)
    wp[:, :mg, :cg] = weight.reshape(group, mg, cg, kh, kw)
    wp = wp.reshape(group, ogg, fb * block, cbg, bi, kh, kw).transpose(0, 1, 3, 5, 6, 4, 2)
    bp = np.zeros((group, ogg * fb * block), np.float32)
    if bias is not None:
        bp[:, :mg] = bias.reshape(group, mg)
    return ConvPlan(
        **common, in_block=bi, out_blocks_per_group=mbg, in_blocks_per_group=cbg, fb=fb,
        pixels=pixels, depthwise=False, packed=np.ascontiguousarray(wp).ravel(),
        bias=bp.ravel(),
    )  # fmt: skip


def _tile_argument(tile, mbg: int, block: int) -> tuple[int, int | None]:
    """(FB, the forced PW or None) from prepare_conv_nchwc's `tile`."""
    if tile is None:
        return tile_blocks(mbg, block)[0], None
    pw, fb = tuple(tile) if isinstance(tile, (tuple, list)) and len(tile) == 2 else (None, tile)
    ints = all(isinstance(v, (int, np.integer)) for v in (fb, 1 if pw is None else pw))
    if not (ints and 1 <= fb <= max(TILE_BLOCKS) and (pw is None or 1 <= pw <= 64)):
        raise ValueError(f"tile must be 1 to {max(TILE_BLOCKS)} output blocks, or a shape "
                         f"(1 to 64 pixels, blocks), got {tile!r}")  # fmt: skip
    return int(fb), None if pw is None else int(pw)


def output_shape(x_shape, plan: ConvPlan):
    """The blocked output shape [N, MB, OH, OW, b] for a blocked input shape."""
    n, _, h, w, _ = x_shape
    (_, _, oh, ow), _ = conv_output_shape((n, plan.in_channels, h, w), plan)
    return (n, plan.out_blocks, oh, ow, plan.block)


@functools.lru_cache(maxsize=8)
def _budgets():
    """(bytes of packed weights below which K is not cut, bytes of one chunk when it is): a
    filter group's weights are read once per tile, so they should stay in L2 (from L3 a tile
    would wait on them); a smaller budget (L1) would mean more chunks, each parking and
    reloading every tile's accumulators."""
    l2 = cache_bytes(2)
    return l2 // 2, l2 // 4


def _inside(size, k, s, dil, pad, out):
    """[a, b): the outputs along one axis whose every tap is inside the input."""
    a = min(out, -(-pad // s))
    last = size - 1 - (k - 1) * dil + pad
    return a, max(a, min(out, last // s + 1)) if last >= 0 else a


def geometry(plan: ConvPlan, x_shape, threads: int) -> np.ndarray:
    """The geometry array (_blocked_geometry) of the plan's conv on a blocked input shape run
    on `threads` threads: output size, the tile's rows, K chunks, rows per work item."""
    n, cb, h, w, bi = x_shape
    (_, _, oh, ow), pads = conv_output_shape((n, plan.in_channels, h, w), plan)
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.strides, plan.dilations
    pt, pl = pads[:2]
    fb, block = plan.fb, plan.block
    ogg = -(-plan.out_blocks_per_group // fb)
    whole, part = _budgets()
    per_block = kh * kw * bi * fb * block * 4  # bytes of packed weights per input block
    cbg = plan.in_blocks_per_group
    chunk = cbg if per_block * cbg <= whole else max(1, min(cbg, part // per_block))
    # A pointwise conv runs its pixels in the rows that tile best, but not when K is cut into
    # chunks: a chunk sweeps an item's rows with the accumulators parked, so rows stay short.
    pointwise = (kh, kw, sh, sw) == (1, 1, 1, 1) and not any(pads) and not plan.depthwise
    runs = 1
    if pointwise and chunk == cbg:
        h, w, runs = _pointwise_rows(plan, n, h, w, threads)
        oh, ow = h, w
    a, b = _inside(w, kw, sw, dw, pl, ow)
    row_a, row_b = _inside(h, kh, sh, dh, pt, oh)
    pw = _depthwise_blocked.TILE if plan.depthwise else plan.pixels or tile_rows(fb, block, b - a)
    others = max(1, n * (cb if plan.depthwise else plan.group * ogg))  # n = 0: nothing to split
    # A dense conv whose last input block holds at most half a block of channels (24, 40, 72,
    # 88, 120 at 16 lanes): its taps run half the channel loop (_direct_blocked._run_all), where
    # the whole loop multiplied zeros, 25% of a 24 -> C conv's multiply-adds.
    tail = plan.in_channels % bi
    half = int(not plan.depthwise and plan.group == 1 and bi == block and 0 < tail <= bi // 2)
    rows, pad = band_rows(oh, others, threads), 0
    if plan.depthwise:
        pad, rows = _depthwise_split(plan, (h, w), (oh, ow), (pt, pl), others, threads)
    return geo.pack(
        N=n,
        CB=cb,
        BI=bi,
        H=h,
        W=w,
        KH=kh,
        KW=kw,
        SH=sh,
        SW=sw,
        DH=dh,
        DW=dw,
        PT=pt,
        PL=pl,
        MB=plan.out_blocks,
        OH=oh,
        OW=ow,
        G=plan.group,
        CBG=cbg,
        MBG=plan.out_blocks_per_group,
        FB=fb,
        PW=pw,
        OGG=ogg,
        COL_A=a,
        COL_B=b,
        CHUNK=chunk,
        ROWS=rows,
        RESIDUAL=plan.residual,
        ACT=plan.act[0],
        ROW_A=row_a,
        ROW_B=row_b,
        PAD=pad,
        XBS=h * w,
        YBS=oh * ow,
        YMB=plan.out_blocks,
        PARTS=runs,
        HALF=half,
    )


def pixels_geometry(conv: ConvPlan, x_shape, threads: int, **fields) -> np.ndarray:
    """A 1x1 conv's geometry run on one row of pixels (a depth-first kernel's band, whose
    pixel counts are set per band: _direct_blocked.pointwise_pixels), the block strides
    given, and the tallest tile of its filter groups (not tile_rows' narrower ones for short
    runs: each tile shape is compiled once, ~2 s, so one per filter-group count whatever the
    image, the same conv_nchwc runs most; a run shorter than the tile takes the one-pixel
    path)."""
    g = geometry(conv, x_shape, threads)
    pixels = fields.pop("pixels")
    fields.update(N=1, H=1, OH=1, ROWS=1, ROW_A=0, ROW_B=1, COL_A=0, W=pixels, OW=pixels,
                  COL_B=pixels, PW=tiles.tallest(conv.fb, conv.block), PARTS=1)  # fmt: skip
    for name, value in fields.items():
        g[getattr(geo, name)] = value
    return g


# The depthwise split's weights, in a tile FMA's time (with its load): a copied vector (its
# load, its store, the zeros) and an edge pixel's tap (PAD 2: a test and one FMA chain that
# waits on the FMA's latency). Fitted to one thread's times of the three ways on 3x3 and 5x5
# convs (144 x 28 and 56 s1, 240 x 28 and 672 x 14 5x5: COPY 4.3, PIXEL 5.5 at 5 wide, 10.6
# at 3; Zen 4, bench/NOTES.md); they only rank the ways against each other.
COPY, PIXEL = 4, 10


def depthwise_counts(size, out, kernel, strides, dilations, pads, b: int):
    """The depthwise kernel's ways to read (_depthwise_blocked.py, g[PAD]) counted in vector
    operations per image and block: (counts, copy_bytes), functions of the output rows per
    work item giving {PAD: count} for the ways the shape allows, and the bytes of PAD 1's copy
    of an item's rows. A count adds the tiles' FMAs (each with its load), the vectors the
    padded copies move and the edge pixels' taps (COPY, PIXEL). PAD = 1 copies an item's rows,
    halo included; PAD = 0 copies the tiles at an edge; PAD = 2 copies nothing (filter rows
    outside the image skipped, edge pixels one at a time), where a row has a tile's worth of
    columns whose taps are all inside; PAD = 3 copies nothing and has no edge pixels (the
    columns outside a row masked), where masked_edges allows it on a row of at least a tile:
    its count is the tiles' FMAs alone, the least of the four (PAD 0's too where no tile meets
    an edge: then both are the same tiles on x, and a tie goes to the lower PAD). Used by the
    split and by the depth-first block's bands (inverted_residual._pad: a band is an image of
    its own)."""
    (h, w), (oh, ow), (pt, pl) = size, out, pads
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    tile = _depthwise_blocked.TILE
    n_tiles = -(-ow // tile)
    wp = (n_tiles * tile - 1) * sw + (kw - 1) * dw + 1  # an item's padded row, pixels
    wt = (tile - 1) * sw + (kw - 1) * dw + 1  # a tile's
    span = (kh - 1) * dh + 1
    fmas = oh * n_tiles * tile * kh * kw
    columns = [_depthwise_blocked.tile_column(t, n_tiles, ow) for t in range(n_tiles)]
    ih0, iw0 = np.arange(oh) * sh - pt, np.array(columns) * sw - pl
    rows_in = (ih0 >= 0) & (ih0 + span <= h)
    cols_in = (iw0 >= 0) & (iw0 + wt <= w)
    edge_copies = int((~(rows_in[:, None] & cols_in[None, :])).sum()) * span * wt
    col_a, col_b = _depthwise_blocked.inner_columns(w, kw, sw, dw, pl, ow)
    inner = col_b - col_a
    taps_in = int((sum((dh * i + ih0 >= 0) & (dh * i + ih0 < h) for i in range(kh)) * kw).sum())
    fixed = {0: fmas + COPY * edge_copies}
    if inner >= tile:
        fixed[2] = taps_in * (-(-inner // tile) * tile + PIXEL * (ow - inner))
    if ow >= tile and _depthwise_blocked.masked_edges(kw, sw, dw, pl, w, ow, b):
        fixed[3] = taps_in * n_tiles * tile  # every column in tiles

    def counts(rows: int) -> dict[int, int]:
        bands = -(-oh // rows)
        return fixed | {1: fmas + COPY * bands * ((rows - 1) * sh + span) * wp}

    def copy_bytes(rows: int) -> int:
        return ((rows - 1) * sh + span) * wp * b * 4

    return counts, copy_bytes


def _depthwise_split(plan: ConvPlan, size, out, pads, others: int, threads: int):
    """(PAD, ROWS) for the depthwise kernel: how its tiles read and the output rows per work
    item, the cheapest by depthwise_counts on the busiest thread's rows of others x bands items
    (the busiest thread sets the time; a short last band is a short item); PAD 1's copy capped
    at a quarter of L2."""
    oh = out[0]
    counts, copy_bytes = depthwise_counts(size, out, plan.kernel, plan.strides,
                                          plan.dilations, pads, plan.block)  # fmt: skip
    best = None
    for rows in range(oh, 0, -1):  # on a tie the longest items (fewest per-item costs)
        load = _busiest_rows(oh, others, rows, threads) / oh
        for pad, work in sorted(counts(rows).items()):
            if pad == 1 and rows > 1 and copy_bytes(rows) > cache_bytes(2) // 4:
                continue
            cost = work * load
            if best is None or cost < best[0] or (cost == best[0] and pad < best[1]):
                best = (cost, pad, rows)
    return best[1], best[2]


@dataclasses.dataclass
class _Launch:
    """What a call on one input shape needs, worked out on the first such call: the kernel is
    called as run(*head, x, packed weights, bias, y, residual, geometry, act_a, act_b, tail)."""

    shape: tuple  # the output's
    geometry: np.ndarray
    run: object  # the compiled entry point
    head: tuple  # its first arguments: the Lanes, and the direct kernel's work item
    tail: object  # its last: the direct kernel's input channels; the depthwise one's scratch
    scratch: int  # floats of per-thread scratch (depthwise), else 0
    empty: bool  # batch 0: nothing to compute
    bound: bool = False  # run is the compiled entry point (config.entry_point), not the dispatcher


def _launch(plan: ConvPlan, xb, threads: int, ymb: int | None = None, own=False) -> _Launch:
    """Validate an input shape against the plan and work out its launch (ValueError if bad);
    own: each image brings its own packed weights (geometry WN)."""
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
    g = geometry(plan, xb.shape, threads)
    if ymb is not None:
        g[geo.YMB] = ymb
    if own:
        g[geo.WN] = plan.packed.size
    L = lanes(plan.block)
    if plan.depthwise:
        return _Launch(
            shape,
            g,
            _depthwise_blocked.dwconv_nchwc,
            (L,),
            None,
            _depthwise_blocked.scratch_size(g),
            n == 0,
        )
    # Whole blocks of input channels: their count is L's width, a constant the channel loop
    # unrolls on; fewer (a small-C stem): a number.
    ci = L if plan.in_block == plan.block else plan.in_block
    step = 0 if ci is L else int(g[geo.SW] * g[geo.BI])  # small C: the pixel step a constant
    run = tile_item(L, int(g[geo.PW]), plan.fb, ci, step)
    return _Launch(shape, g, d.conv_direct, (L, run), ci, 0, n == 0)


def tile_item(L, pw: int, fb: int, ci, step: int = 0) -> Item:
    """The direct kernel's serial work on tiles of pw pixels x fb blocks (and its one-pixel
    tile), compiled (or loaded from the cache) as an Item for conv_direct and the depth-first
    block: one per tile shape and ci's type (and the pixel step of a small-C conv's tiles:
    _direct_blocked.tile_item)."""
    run = d.tile_item(tiles.tile(pw, fb), tiles.tile(1, fb), step)
    return Item(run, d.tile_signature(L, ci))


def conv_nchwc(xb, plan: ConvPlan, out=None, residual=None, at=None, weights=None):
    """y = epilogue(conv(xb)) for a blocked float32 input; returns the blocked output.

    residual: a blocked array of the output's shape when the plan adds one. at: write the
    output as channel blocks at, at + 1, ... of `out`, a larger blocked array [N, CB', OH, OW,
    b] (a concatenation's part, so no copy makes it; no residual then). weights: each image's
    own packed weights, [N, plan.packed.size] float32 in the plan's packing, in place of the
    plan's (a squeeze-excitation gate folded into them: kernels/squeeze_excite.py; not for a
    depthwise plan). The per-shape work (checks, geometry, the tile) is done on a shape's
    first call; a later call costs a dict look-up."""
    ymb = None if at is None else part_blocks(out, at, plan)
    own = weights is not None
    key = (xb.shape, get_threads(), ymb, own) if isinstance(xb, np.ndarray) else None
    launch = plan.geometry.get(key)
    if launch is None or xb.dtype != np.float32:
        launch = plan.geometry[key] = _launch(plan, xb, key[1] if key else 1, ymb, own)
    if own:
        _check_weights(weights, plan, launch.shape[0])
    shape = launch.shape
    if ymb is not None:
        if out.shape[0] != shape[0] or out.shape[2:] != shape[2:]:
            raise ValueError(f"out of shape {out.shape} cannot hold an output of shape {shape}")
        if plan.depthwise or launch.empty:  # the depthwise kernel writes whole tensors
            out[:, at : at + shape[1]] = conv_nchwc(xb, plan)
            return out
        _run(launch, xb, plan, out.reshape(-1)[at * math.prod(shape[2:]) :], None, weights)
        return out
    if out is None:
        out = empty(shape)
    elif (out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous
          or not out.flags.writeable):  # fmt: skip
        raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {shape}")
    else:
        disjoint(out, {"x": xb, "the residual": residual if plan.residual else None,
                       "the weights": weights})  # fmt: skip
    if launch.empty:
        return out
    _run(launch, xb, plan, out.reshape(-1), residual, weights)
    return out


def bind_conv_nchwc(xb, plan: ConvPlan, residual=None, weights=None, out=None, at=None):
    """conv_nchwc(xb, plan, residual=, weights=) specialized for arrays of these shapes and
    dtypes at the calling thread's thread count: the function f(xb, residual=None,
    weights=None) -> y for a caller whose shapes repeat call after call (a session's step,
    fusion/runtime/steps.py), which has checked them. The checks, the launch's look-up and
    the packing of the kernel's arguments are done here, once; f allocates the output and
    calls the compiled kernel (the wrappers' Python was ~4.4 us a mobilenet_v3_small step,
    bench/NOTES.md, "Kernel steps bound"). With out and at (a part of
    a concatenation), f(xb, out) writes blocks at, at + 1, ... of an array of out's shape and
    returns it. These arrays are checked (conv_nchwc is called on them if their launch is not
    bound yet); f's are not: an array of another shape is the caller's error (a
    non-contiguous one is copied by reshape(-1), as the general call copies it)."""
    own = weights is not None
    ymb = None if at is None else part_blocks(out, at, plan)
    key = (getattr(xb, "shape", None), get_threads(), ymb, own)
    launch = plan.geometry.get(key)
    if launch is None or not launch.bound or launch.empty:
        conv_nchwc(xb, plan, out=out, residual=residual, at=at, weights=weights)
        launch = plan.geometry[key]
    if own:
        _check_weights(weights, plan, launch.shape[0])
    if plan.residual and (not isinstance(residual, np.ndarray) or residual.shape != launch.shape):
        raise ValueError(f"the residual must be a blocked array of shape {launch.shape}")
    shape, size, alloc = launch.shape, math.prod(launch.shape), allocator()
    if launch.empty or not launch.bound:  # batch 0; a depthwise part (written by a copy)
        if at is not None:
            return lambda xb, out: conv_nchwc(xb, plan, out=out, at=at)
        return lambda xb, residual=None, weights=None: conv_nchwc(
            xb, plan, residual=residual, weights=weights)  # fmt: skip
    run, head, g, tail, scratch = launch.run, launch.head, launch.geometry, launch.tail, (
        launch.scratch)  # fmt: skip
    bias, packed, (_, a, b) = plan.bias, plan.packed, plan.act
    if at is not None:
        offset = at * math.prod(shape[2:])

        def call_at(xb, out):
            yf = out.reshape(-1)[offset:]
            run(*head, xb.reshape(-1), packed, bias, yf, yf, g, a, b,
                per_thread(scratch) if scratch else tail)  # fmt: skip
            return out

        return call_at

    def call(xb, residual=None, weights=None):
        yf = alloc(size)
        run(*head, xb.reshape(-1), packed if weights is None else weights.reshape(-1), bias, yf,
            yf if residual is None else residual.reshape(-1), g, a, b,
            per_thread(scratch) if scratch else tail)  # fmt: skip
        return yf.reshape(shape)

    return call


def _check_weights(weights, plan: ConvPlan, n: int) -> None:
    """Per-image weights are [N, packed size] float32, C-contiguous, for a direct-kernel plan."""
    if plan.depthwise:
        raise ValueError("a depthwise conv takes its plan's weights, not each image's own")
    want = (n, plan.packed.size)
    if (not isinstance(weights, np.ndarray) or weights.shape != want
            or weights.dtype != np.float32 or not weights.flags.c_contiguous):  # fmt: skip
        raise ValueError(f"weights must be a C-contiguous float32 array of shape {want}, got "
                         f"{getattr(weights, 'shape', weights)!r}")  # fmt: skip


def part_blocks(out, at, plan: ConvPlan) -> int:
    """The blocks per image of `out` when the conv writes blocks [at, at + MB) of it."""
    if (not isinstance(out, np.ndarray) or out.ndim != 5 or out.dtype != np.float32
            or not out.flags.c_contiguous or not out.flags.writeable):  # fmt: skip
        raise ValueError("out must be a writeable C-contiguous float32 blocked array to write "
                         f"a part of, got {getattr(out, 'shape', out)!r}")  # fmt: skip
    if out.shape[-1] != plan.block:
        raise ValueError(f"out has blocks of {out.shape[-1]} channels, the conv's {plan.block}")
    if plan.residual:
        raise ValueError("a conv that adds a residual writes a whole tensor, not a part")
    at = operator.index(at)
    if not 0 <= at <= out.shape[1] - plan.out_blocks:
        raise ValueError(f"blocks {at}..{at + plan.out_blocks - 1} are not in out's "
                         f"{out.shape[1]}")  # fmt: skip
    return out.shape[1]


def _run(launch: _Launch, xb, plan: ConvPlan, yf, residual, weights=None):
    """Run a launch on xb into the flat output yf (the plan's residual, if any, given, and
    each image's weights when the launch takes them); the kernel's entry point bound on the
    first call."""
    xf = np.ascontiguousarray(xb).reshape(-1)
    if plan.residual:
        if not isinstance(residual, np.ndarray) or residual.shape != launch.shape:
            raise ValueError(f"the residual must be a blocked array of shape {launch.shape}")
        res = np.ascontiguousarray(residual, dtype=np.float32).reshape(-1)
    else:
        res = yf  # not read
    _, a, b = plan.act
    g = launch.geometry
    last = per_thread(launch.scratch) if launch.scratch else launch.tail
    wf = plan.packed if weights is None else weights.reshape(-1)
    args = (*launch.head, xf, wf, plan.bias, yf, res, g, a, b, last)
    launch.run(*args)
    if not launch.bound:  # the same types on every call of this launch: skip the dispatcher
        launch.run, launch.bound = entry_point(launch.run, args), True
