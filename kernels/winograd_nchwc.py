"""Winograd F(2x2, 3x3) / F(4x4, 3x3) convolution on blocked tensors, with conv_nchwc's epilogue.

    y = epilogue(conv3x3(x, W)),  x, y blocked [N, ceil(C/b), H, W, b] (kernels/blocked.py)

For 3x3, stride 1, dilation 1, group 1 convs, any pads and channel counts (the last block
zero-padded). The math and the work split: _winograd_blocked.py. F(2x2) does 16 products per
4 outputs where the direct conv does 36; F(4x4) 36 per 16 (4x fewer), at about 10x F(2x2)'s
float32 error (bench/NOTES.md, Winograd), so the tactic offers it up to MAX_F4_CHANNELS.
Where a transformed input is inf or NaN the direct kernel (conv_nchwc) runs instead, so NaN and
inf reach the outputs they reach in onnxruntime.

    >>> plan = prepare_winograd_nchwc(w, b, pads=(1, 1, 1, 1), activation="relu", tile=2)
    >>> yb = winograd_nchwc(to_blocked(x, block=plan.block), plan)
"""

import dataclasses
import math

import numpy as np

from . import _winograd_blocked as k
from .config import entry_point, get_threads
from .conv_nchwc import (
    ConvPlan,
    conv_nchwc,
    output_shape,
    part_blocks,
    prepare_conv_nchwc,
    tile_blocks,
)
from .machine import cache_bytes
from .simd import lanes
from .simd import tile as tiles
from .windows import conv_output_shape
from .workspace import allocator, empty, output, per_thread

MAX_F4_CHANNELS = 256  # F(4x4)'s error grows with C (kernels/conv2d: _WINOGRAD4_MAX_CHANNELS)

# G of F(2x2, 3x3) and F(4x4, 3x3) (Lavin & Gray 2015): U = G g G^T; B^T and A^T are written
# out as sums in _winograd_blocked.py
_G2 = [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]]
_G4 = [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
       [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WinogradPlan:
    """A 3x3 s1 conv's weights transformed and packed for the blocked Winograd kernel."""

    direct: ConvPlan  # the same conv on the direct kernel (attributes, epilogue, NaN fallback)
    m: int  # outputs per tile side: 2 or 4
    fb: int  # output blocks per register tile
    packed: np.ndarray  # U [OGG, a*a, K, FB b] flat
    bias: np.ndarray  # [OGG FB b]
    geometry: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def block(self) -> int:
        return self.direct.block

    in_block = block

    @property
    def out_channels(self) -> int:
        return self.direct.out_channels


def supports(weight_shape, strides=(1, 1), dilations=(1, 1), group=1) -> str | None:
    """Why the blocked Winograd kernel cannot run this conv, or None when it can."""
    if group != 1:
        return f"group {group}: Winograd runs group 1 only"
    if tuple(weight_shape[2:]) != (3, 3):
        return f"kernel {tuple(weight_shape[2:])}: Winograd runs 3x3 only"
    if tuple(strides) != (1, 1) or tuple(dilations) != (1, 1):
        return f"strides {tuple(strides)}, dilations {tuple(dilations)}: Winograd needs 1, 1"
    return None


def prepare_winograd_nchwc(weight, bias=None, *, tile=2, fb=None, block=None, **conv):
    """Transform and pack a 3x3 Conv's weights [M, C, 3, 3] (float32) for winograd_nchwc.

    tile: 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3)); fb: output blocks per register tile (default
    conv_nchwc's first choice); block: channels per block (8 or 16, default the process's);
    conv: prepare_conv_nchwc's keywords (strides, pads, dilations, group, auto_pad, the
    activation, residual). ValueError when the conv is not 3x3 stride 1 (see supports)."""
    if tile not in (2, 4):
        raise ValueError(f"tile must be 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3)), got {tile!r}")
    direct = prepare_conv_nchwc(weight, bias, block=block, **conv)
    reason = supports(weight.shape, direct.strides, direct.dilations, direct.group)
    if reason:
        raise ValueError(reason)
    b, m_out, c = direct.block, weight.shape[0], weight.shape[1]
    mbs, kb = -(-m_out // b), -(-c // b)
    fb = tile_blocks(mbs, b)[0] if fb is None else int(fb)
    ogg = -(-mbs // fb)
    g = np.array(_G2 if tile == 2 else _G4, np.float64)
    a = tile + 2
    u = np.einsum("ai,mcij,bj->abmc", g, weight.astype(np.float64), g).reshape(a * a, m_out, c)
    up = np.zeros((a * a, ogg * fb * b, kb * b), np.float64)
    up[:, :m_out, :c] = u
    # [xi, og, f b, K] -> [og, xi, K, f b]
    up = up.reshape(a * a, ogg, fb * b, kb * b).transpose(1, 0, 3, 2)
    bp = np.zeros(ogg * fb * b, np.float32)
    if bias is not None:
        bp[:m_out] = np.asarray(bias, np.float32).reshape(-1)
    return WinogradPlan(direct, tile, fb, np.ascontiguousarray(up, np.float32).ravel(), bp)


def _launch(plan: WinogradPlan, shape, threads: int):
    """(output shape, geometry, register tile, scratch floats per thread) for an input shape."""
    d = plan.direct
    if len(shape) != 5 or shape[4] != d.block or shape[1] != -(-d.in_channels // d.block):
        raise ValueError(f"x must be blocked [N, {-(-d.in_channels // d.block)}, H, W, "
                         f"{d.block}], got {shape}")  # fmt: skip
    out = output_shape(shape, d)
    if min(out[2:]) < 1:
        raise ValueError(f"output shape {out} is empty for input {shape}")
    n, cb, h, w, b = shape
    (_, _, oh, ow), (pt, pl, _, _) = conv_output_shape((n, d.in_channels, h, w), d)
    m, a = plan.m, plan.m + 2
    tw, th = -(-ow // m), -(-oh // m)
    t_len = tw * th
    T = tiles.tile(tiles.tallest(plan.fb, b), plan.fb)
    k_len = cb * b
    # P tiles per item: V [a*a, P, K] and mt [a*a, P, FB b] within half of L2, at least one
    # register tile, and enough items for the threads.
    per_tile = 4 * a * a * (k_len + plan.fb * b)
    p = max(T.rows, (cache_bytes(2) // 2) // per_tile // T.rows * T.rows)
    p = min(p, -(-t_len // T.rows) * T.rows)
    want = 4 * threads
    while p > T.rows and n * -(-t_len // p) < want:
        p = max(T.rows, (p // 2) // T.rows * T.rows)
    n_tg = -(-t_len // p)
    ogg = len(plan.bias) // (plan.fb * b)
    n_ms = max(1, min(ogg, -(-want // max(1, n * n_tg))))
    g = np.zeros(k.N_GEO, np.int64)
    values = {
        k.N: n, k.CB: cb, k.H: h, k.W: w, k.PT: pt, k.PL: pl, k.OH: oh, k.OW: ow,
        k.MB: out[1], k.M: m, k.TW: tw, k.T_LEN: t_len, k.P: p, k.N_TG: n_tg, k.OGG: ogg,
        k.FB: plan.fb, k.N_MS: n_ms, k.RESIDUAL: d.residual, k.KIND: d.act[0], k.YMB: out[1],
    }  # fmt: skip
    for i, v in values.items():
        g[i] = v
    scratch = a * a * p * (k_len + plan.fb * b)
    return out, g, T, scratch


def winograd_nchwc(xb, plan: WinogradPlan, out=None, residual=None, at=None):
    """y = epilogue(conv3x3(xb)) for a blocked float32 input; returns the blocked output (as
    conv_nchwc: residual is a blocked array of the output's shape when the plan adds one; at:
    y written as channel blocks at, at + 1, ... of `out`, a larger blocked array, a
    concatenation's part, which Fire modules and Inception blocks otherwise copied into
    place)."""
    if not isinstance(xb, np.ndarray) or xb.dtype != np.float32 or xb.ndim != 5:
        raise ValueError(f"x must be a blocked float32 array, got {getattr(xb, 'shape', xb)!r}")
    d = plan.direct
    ymb = None if at is None else part_blocks(out, at, d)
    key = (xb.shape, get_threads(), ymb)
    launch = plan.geometry.get(key)
    if launch is None:
        launch = _launch(plan, xb.shape, key[1])
        if ymb is not None:
            launch[1][k.YMB] = ymb
        plan.geometry[key] = launch
    shape, g, T, scratch = launch
    if ymb is not None:  # y's blocks from `at` on in out (part_blocks checked its layout)
        if out.shape[0] != shape[0] or out.shape[2:] != shape[2:]:
            raise ValueError(f"out of shape {out.shape} cannot hold an output of shape {shape}")
        yf = out.reshape(-1)[at * shape[2] * shape[3] * shape[4] :]
    else:
        out = output(shape, out, {"x": xb, "the residual": residual if d.residual else None})
        yf = out.reshape(-1)
    if shape[0] == 0:
        return out
    if d.residual:
        if not isinstance(residual, np.ndarray) or residual.shape != shape:
            raise ValueError(f"the residual must be a blocked array of shape {shape}")
        res = np.ascontiguousarray(residual, dtype=np.float32).reshape(-1)
    else:
        res = yf  # not read
    bad = np.zeros(1, np.int32)
    _, a, b = d.act
    k.winograd_blocked(lanes(d.block), T, np.ascontiguousarray(xb).reshape(-1), plan.packed,
                       plan.bias, yf, res, g, a, b, per_thread(scratch), bad)  # fmt: skip
    if bad[0]:  # an inf or NaN was transformed: the direct conv gives onnxruntime's outputs
        # (C < b: the direct plan reads one block of C channels, the first C lanes of x's)
        x_direct = xb if d.in_block == d.block else np.ascontiguousarray(xb[..., : d.in_block])
        conv_nchwc(x_direct, d, out=out, residual=residual, at=at)
    return out


def bind_winograd_nchwc(xb, plan: WinogradPlan, residual=None, out=None, at=None):
    """winograd_nchwc specialized for arrays of these shapes at the calling thread's thread
    count, as conv_nchwc.bind_conv_nchwc: f(xb, residual=None) -> y, or with out and at (a
    concatenation's part) f(xb, out) -> out. The kernel is called through its compiled entry
    point (the dispatcher's typing of its arguments skipped), and an inf or NaN it transforms
    still sends the call to the direct conv, as winograd_nchwc does."""
    y = winograd_nchwc(xb, plan, out=out, residual=residual, at=at)  # checks them
    d = plan.direct
    ymb = None if at is None else part_blocks(out, at, d)
    shape, g, T, scratch = plan.geometry[(xb.shape, get_threads(), ymb)]
    if shape[0] == 0:
        return (lambda xb, out: out) if at is not None else (lambda xb, residual=None: empty(shape))
    _, a, b = d.act
    L = lanes(d.block)
    args = (L, T, xb.reshape(-1), plan.packed, plan.bias, y.reshape(-1), y.reshape(-1), g, a, b,
            per_thread(scratch), np.zeros(1, np.int32))  # fmt: skip
    run = entry_point(k.winograd_blocked, args)
    packed, bias, size, alloc = plan.packed, plan.bias, math.prod(shape), allocator()
    offset = 0 if at is None else at * math.prod(shape[2:])

    def compute(xb, yf, res):  # whether an inf or NaN was transformed (a flag per call)
        bad = np.zeros(1, np.int32)
        run(L, T, xb.reshape(-1), packed, bias, yf, res, g, a, b, per_thread(scratch), bad)
        return bad[0] != 0

    if at is not None:

        def call_at(xb, out):
            yf = out.reshape(-1)[offset:]
            if compute(xb, yf, yf):
                winograd_nchwc(xb, plan, out=out, at=at)  # again, then the direct conv
            return out

        return call_at

    def call(xb, residual=None):
        yf = alloc(size)
        if compute(xb, yf, yf if residual is None else residual.reshape(-1)):
            return winograd_nchwc(xb, plan, residual=residual)  # again, then the direct conv
        return yf.reshape(shape)

    return call


__all__ = [
    "MAX_F4_CHANNELS",
    "WinogradPlan",
    "prepare_winograd_nchwc",
    "bind_winograd_nchwc",
    "supports",
    "winograd_nchwc",
]
