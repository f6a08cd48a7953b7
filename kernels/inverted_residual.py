"""The inverted residual block (MobileNetV2/V3, EfficientNet, MnasNet) in one pass, depth first.

    e = act_e(conv1x1(x, We) + be)              C -> E (absent: expansion 1, e = x)
    d = act_d(depthwise_kxk(e, Wd, stride s) + bd)
    y = act_p(conv1x1(d, Wp) + bp [+ x]) [+ x]  E -> M, the residual (before or after act_p)
                                                when s = 1 and M = C

Op by op, e (E = 6 C channels) is written to memory and read back by the depthwise conv, whose
output is written and read back by the projection: 4 E H W floats of traffic that are most of a
depthwise-heavy model's time on a core with 1 MB of L2. Here a work item walks a run of output
rows in bands through all three convs, with e and d of the band in a per-thread scratch sized
to L2 (_inverted_residual_blocked.py), so each tensor touching memory is x, the weights and y;
the three convs run on the blocked conv family's register tiles (kernels/conv_nchwc.py), whose
plans this one holds (the op-by-op plan runs the same packed weights through memory).

    >>> plan = prepare_inverted_residual(we, be, wd, bd, wp, bp, stride=1, pads=(1, 1, 1, 1),
    ...                                  acts=(("clip", 0, 6), ("clip", 0, 6), None),
    ...                                  residual=True)
    >>> yb = inverted_residual(to_blocked(x), plan)     # [N, ceil(M/b), OH, OW, b]

Weights are float32 NCHW-conv shaped: we [E, C, 1, 1] (or None), wd [E, 1, k, k], wp [M, E, 1,
1]; biases [E], [E], [M] or None (BatchNorm folded by the caller); acts: three (name, a, b)
tuples (positional) or dicts (keywords) of kernels.simd.activation.encode's arguments (None:
identity); b = kernels.simd.width().
"""

import dataclasses
import inspect

import numpy as np

from . import _blocked_geometry as geo
from . import _inverted_residual_blocked as ir
from .blocked import block_size, from_blocked, to_blocked
from .config import entry_point, get_threads
from .conv_nchwc import (
    ConvPlan,
    busiest,
    depthwise_counts,
    pixels_geometry,
    prepare_conv_nchwc,
    tile_item,
)
from .machine import cache_bytes
from .simd import lanes, width
from .simd.activation import encode
from .windows import conv_output_shape
from .workspace import allocator, cached_launch, empty, output, per_thread

L2_SHARE = 2  # the band's two scratches take at most 1 / L2_SHARE of L2 (x, y, weights: the rest)
ACT_KEYS = tuple(inspect.signature(encode).parameters)  # activation, alpha, beta, clip_min, ...


@dataclasses.dataclass(frozen=True)
class InvertedResidualPlan:
    in_channels: int  # C
    expanded: int  # E
    out_channels: int  # M
    kernel: int  # k
    stride: int
    residual: str | None  # the block's input added "before" or "after" act_p, or None
    block: int
    expand: ConvPlan | None  # C -> E 1x1, None for expansion 1
    depthwise: ConvPlan  # E -> E kxk
    project: ConvPlan | None  # E -> M 1x1, the residual added before or after its activation;
    # None: the block stops at d (y = d, M = E: the part before a squeeze-excitation)
    project_weight: np.ndarray | None = dataclasses.field(compare=False, repr=False)
    launches: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def convs(self) -> list:
        """The block's conv plans in order, for the op-by-op plan (conv_nchwc)."""
        return [c for c in (self.expand, self.depthwise, self.project) if c is not None]


def _keywords(a) -> dict:
    """An activation as prepare_conv_nchwc's keywords, from encode's arguments (a tuple, in
    order, or a dict) or None (identity)."""
    if isinstance(a, dict):
        return dict(a)
    a = tuple(a or (None,))
    return dict(zip(ACT_KEYS[: len(a)], a, strict=True))


def prepare_inverted_residual(we, be, wd, bd, wp, bp, *, stride=1, pads=None, acts=(None,) * 3,
                              residual=False, block=None):  # fmt: skip
    """Pack the block's weights for inverted_residual (ValueError on shapes it cannot run).
    residual: the block's input added after act_p ("after" or True: MobileNetV2), "before" it,
    or not (None or False). wp None (and bp, act_p, residual with it): the block stops at d,
    the expand and the depthwise conv alone (we then required), y = d with E channels."""
    b = width() if block is None else int(block)
    kinds = {None: None, False: None, True: "after", "after": "after", "before": "before"}
    if residual not in kinds:
        raise ValueError(f"residual must be one of {list(kinds)}, got {residual!r}")
    residual = kinds[residual]
    if b not in (8, 16):
        raise ValueError(f"block must be 8 or 16 channels, got {block!r}")
    if wp is None and (we is None or bp is not None or residual):
        raise ValueError("without a projection the block needs we, and takes no bp or residual")
    named = (("wd", wd), ("wp", wp), ("we", we))
    for name, w in ((n, w) for n, w in named if w is not None or n == "wd"):
        if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 4:
            raise ValueError(f"{name} must be a float32 [O, I, kh, kw] array, got {w!r:.60}")
    e, _, kh, kw = wd.shape
    if wd.shape[1] != 1 or kh != kw:
        raise ValueError(f"wd {wd.shape} is not a square depthwise filter [E, 1, k, k]")
    c = we.shape[1] if we is not None else e
    if we is not None and (we.shape[0] != e or we.shape[2:] != (1, 1)):
        raise ValueError(f"we {we.shape} is not a 1x1 conv to the depthwise's {e} channels")
    m = e if wp is None else wp.shape[0]
    if wp is not None and wp.shape[1:] != (e, 1, 1):
        raise ValueError(f"wp {wp.shape} is not a 1x1 conv from {e} channels")
    if residual and (m != c or stride != 1):
        raise ValueError(f"a residual needs stride 1 and M = C, got stride {stride}, {c} -> {m}")
    if stride not in (1, 2):
        raise ValueError(f"stride must be 1 or 2, got {stride!r}")
    pads = ((kh - 1) // 2,) * 4 if pads is None else tuple(int(p) for p in pads)
    if len(pads) != 4 or min(pads) < 0 or max(pads) >= kh:
        raise ValueError(f"pads must be 4 values in [0, k), got {pads}")
    act_e, act_d, act_p = (_keywords(a) for a in (*acts, None)[:3])
    one = dict(strides=(1, 1), pads=(0,) * 4, block=b)
    return InvertedResidualPlan(
        in_channels=c, expanded=e, out_channels=m, kernel=kh, stride=int(stride),
        residual=residual, block=b,
        expand=None if we is None else prepare_conv_nchwc(we, be, **one, **act_e),
        depthwise=prepare_conv_nchwc(wd, bd, strides=(stride,) * 2, pads=pads, group=e,
                                     block=b, **act_d),
        # d is in blocks of b, E < b included (the depthwise conv's, or the scratch's)
        project=None if wp is None else prepare_conv_nchwc(wp, bp, **one, **act_p,
                                                           residual=residual, in_block=b),
        project_weight=wp,
    )  # fmt: skip


def output_shape(x_shape, plan: InvertedResidualPlan) -> tuple:
    n, _, h, w, _ = x_shape
    (_, _, oh, ow), _ = conv_output_shape((n, plan.expanded, h, w), plan.depthwise)
    return (n, -(-plan.out_channels // plan.block), oh, ow, plan.block)


def bands(n: int, oh: int, ow: int, w: int, eb: int, b: int, k: int, s: int,
          threads: int) -> tuple[int, int]:  # fmt: skip
    """(parts, rows): each image's output rows cut into `parts` runs, one work item each (the
    fewest that keep the threads evenly busy: a parallel loop takes as long as its busiest
    thread; a part's first band computes the k - s rows of e it shares with the part above
    again), and walked in bands of `rows` output rows (band_rows)."""
    parts = min(range(1, max(1, min(oh, threads)) + 1),
                key=lambda p: (busiest(max(1, n * p), threads), p))  # fmt: skip
    return parts, band_rows(-(-oh // parts), ow, w, eb, b, k, s)


def band_rows(per: int, ow: int, w: int, eb: int, b: int, k: int, s: int) -> int:
    """Output rows per band of a run of `per`: the most whose scratches ((rows - 1) s + k rows
    of e of w pixels, rows rows of d of ow) fit in L2 / L2_SHARE."""
    budget = cache_bytes(2) // L2_SHARE // (eb * b * 4)  # pixels the scratches may hold
    return max(1, min(per, (budget - (k - s) * w) // (s * w + ow)))


# A depthwise FMA's time in pointwise FMAs (its vectors come from L1, not registers): 3.7 on
# Zen 4 (64->384->64 14x14, one thread: depthwise 50 us for 0.68 M FMAs, expand 95 us for
# 4.8 M; bench/NOTES.md), a constant of that machine, not timed here.
DEPTHWISE_COST = 4
CHANNEL_GAIN = 0.95  # channel parts are taken when the count says they save 5% (a rough model)


def block_cuts(eb: int, fb: int, q: int) -> list:
    """[0, ..., eb]: eb blocks cut into at most q parts of whole groups of fb blocks."""
    groups = -(-eb // fb)
    step = -(-groups // q) * fb
    return sorted({min(eb, i * step) for i in range(q + 1)})


def channel_cuts(c: int, e: int, m: int, h: int, w: int, oh: int, ow: int, k: int, s: int,
                 parts: int, b: int, fb: int, threads: int,
                 expand: bool) -> list | None:  # fmt: skip
    """Block cuts [0, ..., EB] of the expanded channels into parts run by a thread each over
    the whole image (each part's projection summed into partial outputs, then added), or None
    to cut the image's rows into `parts` runs instead. Rows cost each run the k - s rows of e it
    shares with the next (a 7x7 image in two runs expands 6 + 5 rows of 7, the channel parts 7
    once), channel parts a pass adding the partial sums; the cheaper for the busiest thread by
    a count of FMAs (cut at the expand's filter groups of fb blocks: its tiles stay whole)."""
    eb = -(-e // b)
    cuts = block_cuts(eb, fb if expand else 1, threads)
    if parts == 1 or len(cuts) < 3:
        return None
    e_cost, o_cost = (c * e if expand else 0), k * k * DEPTHWISE_COST * e + e * m
    per = -(-oh // parts)
    by_rows = min(h, (per - 1) * s + k) * w * e_cost + per * ow * o_cost
    share = max(hi - lo for lo, hi in zip(cuts, cuts[1:], strict=False)) / eb
    by_channels = share * (h * w * e_cost + oh * ow * o_cost) + oh * ow * m * (len(cuts) + 1)
    return cuts if by_channels < CHANNEL_GAIN * by_rows else None


def _pad(w: int, ow: int, k: int, s: int, pl: int, rows: int, b: int) -> int:
    """The depthwise kernel's PAD for a band (_depthwise_blocked), the cheapest by
    conv_nchwc.depthwise_counts, the band being an image of its own: its (rows - 1) s + k rows
    of e all inside the scratch (rows outside the image are zeros there), one item of `rows`
    output rows: 3 wherever masked_edges allows it on a row of at least a tile (the least
    work: no copy, no edge pixel), but 0 where no tile meets an edge (no padding: the same
    tiles on x, nothing copied)."""
    counts = depthwise_counts(((rows - 1) * s + k, w), (rows, ow), (k, k), (s, s), (1, 1),
                              (0, pl), b)[0](rows)  # fmt: skip
    return min(counts, key=lambda pad: (counts[pad], pad))


def _channel_parts(plan: InvertedResidualPlan, cuts, band_shape, threads: int, band: dict):
    """For channel parts (cuts not None): (the parts' projections, their geometries, packed
    weights one after the other, each one's offset, a zero bias); else placeholders."""
    p = plan.project or plan.expand  # no projection: the expand's stand in, never read
    if cuts is None or plan.project is None:
        return [], [], p.packed, np.zeros(1, np.int64), p.bias
    rows, ow, b = band_shape
    e = plan.expanded
    one = dict(strides=(1, 1), pads=(0,) * 4, block=b, in_block=b, tile=p.fb)
    convs = [prepare_conv_nchwc(plan.project_weight[:, lo * b : min(e, hi * b)], None, **one)
             for lo, hi in zip(cuts, cuts[1:], strict=False)]  # fmt: skip
    gps = [pixels_geometry(conv, (1, hi - lo, rows, ow, b), threads, **band)
           for conv, lo, hi in zip(convs, cuts, cuts[1:], strict=False)]  # fmt: skip
    offsets = np.cumsum([0] + [conv.packed.size for conv in convs[:-1]]).astype(np.int64)
    return (convs, gps, np.concatenate([conv.packed for conv in convs]), offsets,
            np.zeros(convs[0].bias.size, np.float32))  # fmt: skip


@dataclasses.dataclass
class _Launch:
    shape: tuple  # the output's
    args: tuple  # the kernel's arguments but for x, y, the residual
    sizes: np.ndarray  # floats of per-thread scratch, by use
    run: object  # the dispatcher, then the compiled entry point
    epilogue: tuple  # combine_parts' arguments but for the parts, y and the residual
    bound: bool = False
    split: int = 1  # channel parts (g[SPLIT])
    scratch: int = 0  # floats of per-thread scratch, sizes summed

    def __post_init__(self):  # read on every call: Python ints, not NumPy's
        self.split, self.scratch = int(self.geometry[ir.SPLIT]), int(self.sizes.sum())

    @property
    def geometry(self) -> np.ndarray:
        """The block's geometry (_inverted_residual_blocked's N ... FBMAX)."""
        return self.args[9]


def _launch(xb, plan: InvertedResidualPlan, threads: int) -> _Launch:
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    n, cb, h, w, bi = xb.shape
    c, b, k, s = plan.in_channels, plan.block, plan.kernel, plan.stride
    want = block_size(c, b)
    if bi != want or cb != -(-c // want):
        raise ValueError(f"x has {cb} blocks of {bi} channels; the block reads {c} channels "
                         f"({-(-c // want)} blocks of {want})")  # fmt: skip
    shape = output_shape(xb.shape, plan)
    if min(shape[2:4]) < 1:
        raise ValueError(f"output shape {shape} is empty for input {xb.shape}")
    _, (pt, pl, _, _) = conv_output_shape((n, plan.expanded, h, w), plan.depthwise)
    _, mb, oh, ow, _ = shape
    eb = -(-plan.expanded // b)
    parts, rows = bands(n, oh, ow, w, eb, b, k, s, threads)
    dw, project = plan.depthwise, plan.project is not None
    p = plan.project or plan.expand  # no projection: the expand's stands in, never run
    e = plan.expand or p  # expansion 1: the project's stands in, never run
    cuts = channel_cuts(c, plan.expanded, plan.out_channels if project else 0, h, w, oh, ow, k,
                        s, parts, b, e.fb, threads, plan.expand is not None)  # fmt: skip
    if cuts is not None:
        rows = band_rows(oh, ow, w, eb, b, k, s)
    span = (rows - 1) * s + k
    in_place = plan.expand is None and bi == b
    # the depthwise conv on the band's rows of e in ex (padded rows included), or on x itself
    image = dict(H=h, PT=pt) if in_place else dict(H=span, PT=0)
    gd = geo.pack(N=1, CB=eb, BI=b, W=w, KH=k, KW=k, SH=s, SW=s, DH=1, DW=1, PL=pl, MB=eb,
                  OH=rows, OW=ow, ROWS=rows, ACT=dw.act[0], PAD=_pad(w, ow, k, s, pl, rows, b),
                  **image)  # fmt: skip
    band = dict(pixels=rows * ow, XBS=rows * ow, YBS=oh * ow)
    ge = gp = pixels_geometry(p, (1, eb, rows, ow, b), threads, **band) if project else None
    if plan.expand is not None:
        ge = pixels_geometry(e, (1, cb, h, w, bi), threads, pixels=rows * s * w, XBS=h * w,
                             YBS=span * w)  # fmt: skip
    gp = ge if gp is None else gp  # no projection: the expand's stands in, never read
    split = _channel_parts(plan, cuts, (rows, ow, b), threads, band)
    gps = split[1]
    g = np.zeros(ir.N_GEO, np.int64)
    for key, v in {ir.N: n, ir.CB: cb, ir.BI: bi, ir.H: h, ir.W: w, ir.EB: eb, ir.K: k, ir.S: s,
                   ir.PT: pt, ir.OH: oh, ir.OW: ow, ir.MB: mb, ir.ROWS: rows, ir.SPAN: span,
                   ir.PARTS: parts, ir.EXPAND: int(plan.expand is not None),
                   ir.IN_PLACE: int(in_place), ir.SPLIT: 1 if cuts is None else len(cuts) - 1,
                   ir.TAPS: max(int(x[geo.CHUNK]) for x in (ge, gp, *gps)),
                   ir.FBMAX: max(int(x[geo.FB]) for x in (ge, gp, *gps)),
                   ir.PROJECT: int(project)}.items():  # fmt: skip
        g[key] = v
    pw_e, pw_p = int(ge[geo.PW]), int(gp[geo.PW])
    sizes = np.array(ir.scratch_size(g, ge, gd, [gp, *gps], pw_e, pw_p), np.int64)
    acts = np.array([c.act for c in (e, dw, p)], np.float32)
    L = lanes(b)
    ci = L if e.in_block == b else e.in_block
    # the two 1x1 convs' work items, the direct kernel's own (conv_nchwc runs the same ones)
    re, rp = tile_item(L, pw_e, e.fb, ci), tile_item(L, pw_p, p.fb, L)
    args = (L, re, rp, e.packed, e.bias, dw.packed, dw.bias, p.packed, p.bias, g, ge, gd, gp, acts,
            ci, sizes)  # fmt: skip
    args += (np.array(cuts or [0, eb], np.int64), np.array(gps or [gp]), *split[2:])
    epi = (lanes(b), p.bias, g, np.array([p.residual, p.act[0]], np.int64), acts)
    return _Launch(shape, args, sizes, ir.inverted_residual_blocked, epi)


def inverted_residual(xb, plan: InvertedResidualPlan, out=None):
    """y = the block of xb (blocked float32 [N, ceil(C/bi), H, W, bi]); returns y blocked at
    plan.block. The per-shape work is done on a shape's first call."""
    launch = cached_launch(plan.launches, xb, lambda x, threads: _launch(x, plan, threads))
    shape = launch.shape
    out = output(shape, out, {"x": xb})
    if shape[0] == 0:
        return out
    xf, yf = np.ascontiguousarray(xb).reshape(-1), out.reshape(-1)
    rf = yf  # not read
    if plan.residual:  # x at the output's block (C < b: x's block is C)
        r = xb if xb.shape[-1] == plan.block else to_blocked(from_blocked(xb, plan.in_channels),
                                                             plan.block)  # fmt: skip
        rf = np.ascontiguousarray(r).reshape(-1)
    split = launch.split if plan.project is not None else 1  # channel parts' partial sums
    parts = empty(split * yf.size) if split > 1 else yf
    a = launch.args
    args = (*a[:3], xf, *a[3:9], yf, rf, *a[9:16], per_thread(launch.scratch), *a[16:], parts)
    launch.run(*args)
    if split > 1:
        L, bias, g, epi, acts = launch.epilogue
        ir.combine_parts(L, parts, yf, rf, bias, g, epi, acts)
    if not launch.bound:  # the same types on every call of this launch: skip the dispatcher
        launch.run, launch.bound = entry_point(launch.run, args), True
    return out


def bind_inverted_residual(xb, plan: InvertedResidualPlan):
    """inverted_residual(xb, plan) specialized for arrays of xb's shape at the calling thread's
    thread count: f(xb) -> y, as conv_nchwc.bind_conv_nchwc (the checks and the arguments'
    packing done once; f allocates and calls the compiled block). None where the residual is
    re-blocked per call (C under a block): that call keeps the general path."""
    launch = plan.launches.get((getattr(xb, "shape", None), get_threads()))
    if launch is None or not launch.bound:
        inverted_residual(xb, plan)
        launch = plan.launches[(xb.shape, get_threads())]
    shape, alloc = launch.shape, allocator()
    size = int(np.prod(shape))
    if plan.residual and xb.shape[-1] != plan.block:
        return None
    if shape[0] == 0:
        return lambda xb: alloc(0).reshape(shape)
    a, run, scratch, residual = launch.args, launch.run, launch.scratch, plan.residual
    head, consts, geos, rest = a[:3], a[3:9], a[9:16], a[16:]
    split = launch.split if plan.project is not None else 1
    combine, epilogue = ir.combine_parts, launch.epilogue

    def call(xb):
        xf, yf = xb.reshape(-1), alloc(size)
        rf = xf if residual else yf
        parts = alloc(split * size) if split > 1 else yf
        run(*head, xf, *consts, yf, rf, *geos, per_thread(scratch), *rest, parts)
        if split > 1:
            L, bias, g, epi, acts = epilogue
            combine(L, parts, yf, rf, bias, g, epi, acts)
        return yf.reshape(shape)

    return call
