"""Channel gathers: ShuffleNet's channel shuffle, the Concat before it and the Split after it.

    y[n, j, h, w] = z[n, src[j], h, w]        z = the channels of a, then those of b

A channel shuffle of g groups over C channels is the gather with
src[j] = (j % g) * (C / g) + j // g (Reshape [N, g, C/g, H, W], swap axes 1 and 2, Reshape
back); a Split after it takes consecutive runs of that map, one output each. Nothing is
computed: each output channel is one plane copied from where it lies, so the only cost is one
pass over memory, the pass onnxruntime's Transpose makes too, but in process and, in the
blocked layout ([N, C/b, H, W, b], kernels/blocked.py), without converting to NCHW and back.

Blocked, output lane l of block cb at pixel p reads lane src % b_in of block src // b_in at the
same pixel: each pixel's b output channels come from the input's pixel, in a few source
blocks. With blocks of the vectors' width, each source block gives its lanes by one
permute (vpermute) and a select; other widths are gathered lane by lane. The lanes past the
output's channels are written 0, as the layout requires.
"""

import functools

import numba
import numpy as np

from .config import JIT, PARALLEL, entry_point
from .simd import WIDTHS, lanes, vload, vpermute, vselect, vstore, vzero


def shuffle_map(channels: int, groups: int) -> np.ndarray:
    """src of the channel shuffle of `groups` groups: y[j] = x[(j % g) (C / g) + j // g].

    >>> shuffle_map(6, 2).tolist()
    [0, 3, 1, 4, 2, 5]
    """
    if groups <= 0 or channels <= 0 or channels % groups:
        raise ValueError(f"{channels} channels do not split into {groups} groups")
    j = np.arange(channels, dtype=np.int64)
    return (j % groups) * (channels // groups) + j // groups


@numba.jit(**PARALLEL)
def _gather_nchw(a, b, ca, src, y):
    """y[n, j, :] = a[n, src[j], :] if src[j] < ca else b[n, src[j] - ca, :] (planes [N, C, P])."""
    cy = y.shape[1]
    for item in numba.prange(y.shape[0] * cy):
        n, j = item // cy, item % cy
        s = src[j]
        if s < ca:
            y[n, j, :] = a[n, s, :]
        else:
            y[n, j, :] = b[n, s - ca, :]


RUN = 64  # pixels a work item writes of one output block: 64 x W floats, 4 KB at W = 16


@numba.jit(**JIT)
def _permute_plan(ca, src, w):
    """How output block cb of the gather by src (z = a's ca channels, then b's) is made from
    W-lane source blocks: entries cb W .. cb W + count[cb] - 1, each a source block (part: 0 a,
    1 b; blk), the output lanes it gives (mask: 1.0) and the lane each takes (lane_map)."""
    cy = src.shape[0]
    cb_len = -(-cy // w)
    count = np.zeros(cb_len, np.int64)
    part = np.zeros(cb_len * w, np.int64)
    blk = np.zeros(cb_len * w, np.int64)
    lane_map = np.zeros(cb_len * w * w, np.int32)
    mask = np.zeros(cb_len * w * w, np.float32)
    for j in range(cy):
        cb, s = j // w, src[j]
        pt, t = (0, s) if s < ca else (1, s - ca)
        e = cb * w
        while e < cb * w + count[cb] and (part[e] != pt or blk[e] != t // w):
            e += 1
        if e == cb * w + count[cb]:
            part[e], blk[e] = pt, t // w
            count[cb] += 1
        lane_map[e * w + j % w] = t % w
        mask[e * w + j % w] = 1.0
    return count, part, blk, lane_map, mask


@functools.lru_cache(maxsize=256)
def _plan(ca: int, total: int, w: int, srcs: tuple[bytes, ...]):
    """The _permute_plan of each map (its int64 bytes) joined, with each output's first block
    (first[o], first[-1] = every output's blocks), kept: a model calls each gather with the
    same maps every run, and building and checking them costs more than the copy."""
    plans = [_permute_plan(ca, _checked_src(np.frombuffer(s, np.int64), total), w) for s in srcs]
    first = np.cumsum([0] + [len(p[0]) for p in plans]).astype(np.int64)
    return (*(np.concatenate([p[k] for p in plans]) for k in range(5)), first)


@numba.jit(**PARALLEL)
def _gather_permute(L, a, b, plan, ys):
    """Blocked arrays [N, CB, P, W], every block the vectors' width W: for each output o,
    ys[o][n, j // W, p, j % W] = z[n, src_o[j], p], 0 past the channels src_o names, by the
    joined plans of _plan (global block g = first[o] + the block of ys[o]).

    An output block's W channels come from a few source blocks (two, in either half of
    ShuffleNet's 116-channel shuffle). A pixel's output vector is those blocks' vectors at that
    pixel, each permuted (vpermute, one vpermps) and merged by its mask, so the gather moves
    whole vectors. Each work item, a run of RUN pixels of one output block, merges its source
    blocks one after another into the run (4 KB at W = 16, in L1). Every output in one launch:
    a launch costs about what a small gather does."""
    count, part, blk, lane_map, mask, first = plan
    w = L.width
    n_len, p_len, blocks = a.shape[0], a.shape[2], first[-1]
    af, bf = a.reshape(n_len, -1), b.reshape(n_len, -1)
    runs = -(-p_len // RUN)
    items = n_len * blocks * runs
    for item in numba.prange(items):
        n, rest = item // (blocks * runs), item % (blocks * runs)
        g, r = rest // runs, rest % runs
        o = 0
        while first[o + 1] <= g:
            o += 1
        p0, p1 = r * RUN, min(p_len, (r + 1) * RUN)
        out, at = ys[o][n].reshape(-1), (g - first[o]) * p_len * w
        for e in range(g * w, g * w + count[g]):
            x = af[n] if part[e] == 0 else bf[n]
            m = vload(L, mask, e * w) > 0.5
            base = blk[e] * p_len * w
            if e == g * w:  # the first source block: the other lanes start at 0
                for p in range(p0, p1):
                    v = vpermute(vload(L, x, base + p * w), lane_map, e * w)
                    vstore(out, at + p * w, vselect(m, v, vzero(L)))
            else:
                for p in range(p0, p1):
                    v = vpermute(vload(L, x, base + p * w), lane_map, e * w)
                    vstore(out, at + p * w, vselect(m, v, vload(L, out, at + p * w)))


@numba.jit(**PARALLEL)
def _gather_lanes(a, b, ca, src, y):
    """The same gather for blocks of any widths (a's, b's and y's may differ): lane by lane,
    each output lane copied down a run of pixels from the one source lane it reads."""
    ba, bb = a.shape[3], b.shape[3]
    cb_len, p_len, by, cy = y.shape[1], y.shape[2], y.shape[3], src.shape[0]
    runs = -(-p_len // RUN)
    items = y.shape[0] * cb_len * runs
    for item in numba.prange(items):
        n, rest = item // (cb_len * runs), item % (cb_len * runs)
        cb, r = rest // runs, rest % runs
        p0, p1 = r * RUN, min(p_len, (r + 1) * RUN)
        out = y[n, cb]
        for k in range(by):
            j = cb * by + k
            if j >= cy:
                for p in range(p0, p1):
                    out[p, k] = 0.0
                continue
            s = src[j]
            if s < ca:
                plane, lane = a[n, s // ba], s % ba
            else:
                plane, lane = b[n, (s - ca) // bb], (s - ca) % bb
            for p in range(p0, p1):
                out[p, k] = plane[p, lane]


def _sources(parts, ndim: int, what: str):
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"one or two inputs are gathered from, got {len(parts)}")
    for x in parts:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != ndim:
            raise ValueError(
                f"inputs must be float32 {what} arrays, got {getattr(x, 'shape', x)!r}"
            )
    first = parts[0].shape
    if any(x.shape[0] != first[0] or x.shape[2:4] != first[2:4] for x in parts):
        raise ValueError(f"inputs differ in batch or plane: {[x.shape for x in parts]}")
    return [np.ascontiguousarray(x) for x in parts]


def _checked_src(src, total: int) -> np.ndarray:
    src = np.ascontiguousarray(src, dtype=np.int64)
    if src.ndim != 1 or (src.size and (src.min() < 0 or src.max() >= total)):
        raise ValueError(f"the channel map must index the {total} input channels")
    return src


def channel_gather(parts, src) -> np.ndarray:
    """NCHW: y[:, j] = concat(parts, axis=1)[:, src[j]] for one or two float32 [N, C_k, H, W]
    parts, without building the concatenation.

    >>> x = np.arange(6, dtype=np.float32).reshape(1, 6, 1, 1)
    >>> channel_gather([x], shuffle_map(6, 3)).ravel().tolist()
    [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    parts = _sources(parts, 4, "NCHW")
    a, b = parts[0], parts[-1]
    n, ca, h, w = a.shape
    src = _checked_src(src, sum(x.shape[1] for x in parts))
    y = np.empty((n, src.size, h, w), np.float32)
    if y.size:
        _gather_nchw(a.reshape(n, ca, h * w), b.reshape(n, b.shape[1], h * w), ca, src,
                     y.reshape(n, src.size, h * w))  # fmt: skip
    return y


def channel_gather_blocked(parts, channels, src, block: int) -> np.ndarray:
    """Blocked: the gather of channel_gather on blocked parts [N, CB_k, H, W, b_k] holding
    `channels[k]` channels each (any block each); the output [N, CB, H, W, block], its padding
    lanes 0 (a block of the process's width even for few channels, as the convs read them)."""
    return channel_gathers_blocked(parts, channels, [src], block)[0]


def channel_gathers_blocked(parts, channels, srcs, block: int) -> tuple[np.ndarray, ...]:
    """channel_gather_blocked for each map of `srcs` (a Split's outputs), in one pass."""
    parts = _sources(parts, 5, "blocked [N, CB, H, W, b]")
    if len(channels) != len(parts):
        raise ValueError(f"{len(parts)} parts, {len(channels)} channel counts")
    for x, c in zip(parts, channels, strict=True):
        if c <= 0 or -(-c // x.shape[4]) != x.shape[1]:
            raise ValueError(f"{x.shape[1]} blocks of {x.shape[4]} cannot hold {c} channels")
    a, b = parts[0], parts[-1]
    n, _, h, w, _ = a.shape
    by, total = int(block), sum(channels)
    srcs = [np.ascontiguousarray(s, dtype=np.int64) for s in srcs]
    ys = tuple(np.empty((n, -(-s.size // by), h, w, by), np.float32) for s in srcs)
    flat = [x.reshape(n, x.shape[1], h * w, x.shape[4]) for x in (a, b)]
    if a.shape[4] == b.shape[4] == by and by in WIDTHS:
        plan = _plan(int(channels[0]), total, by, tuple(s.tobytes() for s in srcs))
        if n and h * w:
            outs = tuple(y.reshape(n, y.shape[1], h * w, by) for y in ys)
            _gather_permute(lanes(by), *flat, plan, outs)
        return ys
    for s, y in zip(srcs, ys, strict=True):
        s = _checked_src(s, total)
        if y.size:
            _gather_lanes(*flat, channels[0], s, y.reshape(n, y.shape[1], h * w, by))
    return ys


def bind_channel_gathers_blocked(parts, channels, srcs, block: int):
    """channel_gathers_blocked(parts, channels, srcs, block) specialized for parts of these
    shapes: f(parts) -> the outputs, their shapes and the gather's plan worked out once and the
    kernel called through its compiled entry point (as kernels/conv_nchwc.bind_conv_nchwc).
    Parts of another width than `block` keep the general call."""
    ys = channel_gathers_blocked(parts, channels, srcs, block)  # checks them
    a, b = parts[0], parts[-1]
    n, _, h, w, _ = a.shape
    by = int(block)
    if not (a.shape[4] == b.shape[4] == by and by in WIDTHS and n and h * w):
        return lambda parts: channel_gathers_blocked(parts, channels, srcs, block)
    srcs = [np.ascontiguousarray(s, dtype=np.int64) for s in srcs]
    plan = _plan(int(channels[0]), sum(channels), by, tuple(s.tobytes() for s in srcs))
    shapes = [y.shape for y in ys]
    views = [(n, y.shape[1], h * w, by) for y in ys]
    flat_a, flat_b = (n, a.shape[1], h * w, by), (n, b.shape[1], h * w, by)
    L = lanes(by)
    outs = tuple(y.reshape(v) for y, v in zip(ys, views, strict=True))
    run = entry_point(_gather_permute, (L, a.reshape(flat_a), b.reshape(flat_b), plan, outs))

    def call(parts):
        ys = tuple(np.empty(shape, np.float32) for shape in shapes)
        a, b = (np.ascontiguousarray(x) for x in (parts[0], parts[-1]))  # as _sources does
        run(L, a.reshape(flat_a), b.reshape(flat_b), plan,
            tuple(y.reshape(v) for y, v in zip(ys, views, strict=True)))  # fmt: skip
        return ys

    return call
