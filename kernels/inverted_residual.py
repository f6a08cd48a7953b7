"""The inverted residual block (MobileNetV2/V3, EfficientNet, MnasNet) in one pass, depth first.

    e = act_e(conv1x1(x, We) + be)              C -> E (absent: expansion 1, e = x)
    d = act_d(depthwise_kxk(e, Wd, stride s) + bd)
    y = act_p(conv1x1(d, Wp) + bp) [+ x]        E -> M, the residual when s = 1 and M = C

Op by op, e (E = 6 C channels) is written to memory and read back by the depthwise conv, whose
output is written and read back by the projection: 4 E H W floats of traffic that are most of a
depthwise-heavy model's time on a core with 1 MB of L2. Here a work item computes a band of
output rows through all three convs, with e and d of the band in a per-thread scratch sized
to L2 (_inverted_residual_blocked.py), so each tensor touching memory is x, the weights and y.

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

import numpy as np

from . import _inverted_residual_blocked as ir
from .blocked import block_size
from .config import get_threads
from .machine import cache_bytes
from .simd import lanes, width
from .simd.activation import encode
from .workspace import empty, per_thread

L2_SHARE = 2  # the band's two scratches take at most 1 / L2_SHARE of L2 (x, y, weights: the rest)


@dataclasses.dataclass(frozen=True)
class InvertedResidualPlan:
    in_channels: int  # C
    expanded: int  # E
    out_channels: int  # M
    kernel: int  # k
    stride: int
    pads: tuple  # (top, left, bottom, right)
    expand: bool
    residual: bool
    block: int
    we: np.ndarray  # [C, EB, b] flat
    be: np.ndarray
    wd: np.ndarray  # [EB, k, k, b] flat
    bd: np.ndarray
    wp: np.ndarray  # [E, MB, b] flat
    bp: np.ndarray
    acts: np.ndarray  # [3, 3] float64: (kind, a, b) per conv
    launches: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def _rows_of(w: np.ndarray, blocks: int, b: int) -> np.ndarray:
    """[K, O] -> [K, blocks, b] flat with zeros past O: a row of output-channel vectors."""
    k, o = w.shape
    out = np.zeros((k, blocks * b), np.float32)
    out[:, :o] = w
    return out.ravel()


def _padded(v, n: int, size: int) -> np.ndarray:
    out = np.zeros(size, np.float32)
    if v is not None:
        out[:n] = np.reshape(v, -1)
    return out


def prepare_inverted_residual(we, be, wd, bd, wp, bp, *, stride=1, pads=None, acts=(None,) * 3,
                              residual=False, block=None):  # fmt: skip
    """Pack the block's weights for inverted_residual (ValueError on shapes it cannot run)."""
    b = width() if block is None else int(block)
    if b not in (8, 16):
        raise ValueError(f"block must be 8 or 16 channels, got {block!r}")
    for name, w in (("wd", wd), ("wp", wp), *((("we", we),) if we is not None else ())):
        if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 4:
            raise ValueError(f"{name} must be a float32 [O, I, kh, kw] array, got {w!r:.60}")
    e, _, kh, kw = wd.shape
    if wd.shape[1] != 1 or kh != kw:
        raise ValueError(f"wd {wd.shape} is not a square depthwise filter [E, 1, k, k]")
    c = we.shape[1] if we is not None else e
    if we is not None and (we.shape[0] != e or we.shape[2:] != (1, 1)):
        raise ValueError(f"we {we.shape} is not a 1x1 conv to the depthwise's {e} channels")
    m = wp.shape[0]
    if wp.shape[1:] != (e, 1, 1):
        raise ValueError(f"wp {wp.shape} is not a 1x1 conv from {e} channels")
    if residual and (m != c or stride != 1):
        raise ValueError(f"a residual needs stride 1 and M = C, got stride {stride}, {c} -> {m}")
    if stride not in (1, 2):
        raise ValueError(f"stride must be 1 or 2, got {stride!r}")
    pads = ((kh - 1) // 2,) * 4 if pads is None else tuple(int(p) for p in pads)
    if len(pads) != 4 or min(pads) < 0 or max(pads) >= kh:
        raise ValueError(f"pads must be 4 values in [0, k), got {pads}")
    eb, mb = -(-e // b), -(-m // b)
    codes = [encode(**a) if isinstance(a, dict) else encode(*(a or (None,))) for a in acts]
    codes = np.array(codes, np.float64)
    return InvertedResidualPlan(
        in_channels=c, expanded=e, out_channels=m, kernel=kh, stride=int(stride), pads=pads,
        expand=we is not None, residual=bool(residual), block=b,
        we=_rows_of(we[:, :, 0, 0].T, eb, b) if we is not None else np.zeros(b, np.float32),
        be=_padded(be, e, eb * b),
        wd=np.ascontiguousarray(_rows_of(wd.reshape(e, kh * kw).T, eb, b)
                                .reshape(kh * kw, eb, b).transpose(1, 0, 2)).ravel(),
        bd=_padded(bd, e, eb * b), wp=_rows_of(wp[:, :, 0, 0].T, mb, b),
        bp=_padded(bp, m, mb * b), acts=codes,
    )  # fmt: skip


def output_shape(x_shape, plan: InvertedResidualPlan) -> tuple:
    n, _, h, w, _ = x_shape
    pt, pl, pb, pr = plan.pads
    k, s = plan.kernel, plan.stride
    return (n, -(-plan.out_channels // plan.block), (h + pt + pb - k) // s + 1,
            (w + pl + pr - k) // s + 1, plan.block)  # fmt: skip


def band_rows(oh: int, ow: int, wp: int, eb: int, b: int, k: int, s: int, items_per_row: int,
              threads: int) -> int:  # fmt: skip
    """Output rows per band: the most whose scratches ((rows-1) s + k expanded rows of wp
    pixels, rows depthwise rows of ow) fit in L2 / L2_SHARE, fewer when the images alone
    would leave a thread idle (items_per_row: images)."""
    per = eb * b * 4
    budget = cache_bytes(2) // L2_SHARE
    fit = (budget // per - (k - s) * wp) // (s * wp + ow)
    rows = max(1, min(oh, fit))
    if items_per_row * -(-oh // rows) < threads:
        rows = max(1, min(rows, -(-oh * items_per_row // threads)))
    return rows


def _launch(xb, plan: InvertedResidualPlan, threads: int):
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    n, cb, h, w, bi = xb.shape
    c, b = plan.in_channels, plan.block
    want = block_size(c, b)
    if bi != want or cb != -(-c // want):
        raise ValueError(f"x has {cb} blocks of {bi} channels; the block reads {c} channels "
                         f"({-(-c // want)} blocks of {want})")  # fmt: skip
    shape = output_shape(xb.shape, plan)
    if min(shape[2:4]) < 1:
        raise ValueError(f"output shape {shape} is empty for input {xb.shape}")
    k, s = plan.kernel, plan.stride
    oh, ow = shape[2:4]
    wp = (ow - 1) * s + k
    eb = -(-plan.expanded // b)
    g = np.zeros(ir.N_GEO, np.int64)
    rows = band_rows(oh, ow, wp, eb, b, k, s, max(1, n), threads)
    values = {ir.N: n, ir.C: c, ir.BI: bi, ir.CB: cb, ir.H: h, ir.W: w, ir.E: plan.expanded,
              ir.EB: eb, ir.K: k, ir.S: s, ir.PT: plan.pads[0], ir.PL: plan.pads[1], ir.OH: oh,
              ir.OW: ow, ir.M: plan.out_channels, ir.MB: shape[1], ir.ROWS: rows, ir.WP: wp,
              ir.EXPAND: int(plan.expand), ir.RESIDUAL: int(plan.residual)}  # fmt: skip
    for key, v in values.items():
        g[key] = v
    return shape, g, ir.scratch_size(g, b)


def inverted_residual(xb, plan: InvertedResidualPlan, out=None):
    """y = the block of xb (blocked float32 [N, ceil(C/bi), H, W, bi]); returns y blocked at
    plan.block. The per-shape work is done on a shape's first call."""
    key = (getattr(xb, "shape", None), get_threads())
    launch = plan.launches.get(key)
    if launch is None or xb.dtype != np.float32:
        launch = plan.launches[key] = _launch(xb, plan, key[1])
    shape, g, scratch = launch
    if out is None:
        out = empty(shape)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    if shape[0] == 0:
        return out
    xf = np.ascontiguousarray(xb).reshape(-1)
    ir.inverted_residual_blocked(lanes(plan.block), xf, plan.we, plan.be, plan.wd, plan.bd,
                                 plan.wp, plan.bp, out.reshape(-1), g, plan.acts,
                                 per_thread(scratch))  # fmt: skip
    return out
