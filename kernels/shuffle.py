"""Channel gathers: ShuffleNet's channel shuffle, the Concat before it and the Split after it.

    y[n, j, h, w] = z[n, src[j], h, w]        z = the channels of a, then those of b

A channel shuffle of g groups over C channels is the gather with
src[j] = (j % g) * (C / g) + j // g (Reshape [N, g, C/g, H, W], swap axes 1 and 2, Reshape
back); a Split after it takes consecutive runs of that map, one output each. Nothing is
computed: each output channel is one plane copied from where it lies, so the only cost is one
pass over memory, the pass onnxruntime's Transpose makes too, but in process and, in the
blocked layout ([N, C/b, H, W, b], kernels/blocked.py), without converting to NCHW and back.

Blocked, output lane l of block cb at pixel p reads lane src % b_in of block src // b_in at the
same pixel: each pixel's b output channels are a gather from the input's pixel, which sits in
a few cache lines; the lanes past the output's channels are written 0, as the layout requires.
"""

import numba
import numpy as np

from .config import PARALLEL


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


@numba.jit(**PARALLEL)
def _gather_blocked(a, b, ca, src, y):
    """Blocked arrays [N, CB, P, b]: y[n, j // by, p, j % by] = z[n, src[j], p], 0 past the
    channels src names (the padding lanes of the last block)."""
    ba, bb = a.shape[3], b.shape[3]
    cb_len, p_len, by, cy = y.shape[1], y.shape[2], y.shape[3], src.shape[0]
    for item in numba.prange(y.shape[0] * cb_len):
        n, cb = item // cb_len, item % cb_len
        lanes = min(by, cy - cb * by)
        for p in range(p_len):
            for lane in range(lanes):
                s = src[cb * by + lane]
                if s < ca:
                    y[n, cb, p, lane] = a[n, s // ba, p, s % ba]
                else:
                    t = s - ca
                    y[n, cb, p, lane] = b[n, t // bb, p, t % bb]
            for lane in range(lanes, by):
                y[n, cb, p, lane] = 0.0


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
    parts = _sources(parts, 5, "blocked [N, CB, H, W, b]")
    if len(channels) != len(parts):
        raise ValueError(f"{len(parts)} parts, {len(channels)} channel counts")
    for x, c in zip(parts, channels, strict=True):
        if c <= 0 or -(-c // x.shape[4]) != x.shape[1]:
            raise ValueError(f"{x.shape[1]} blocks of {x.shape[4]} cannot hold {c} channels")
    a, b = parts[0], parts[-1]
    n, _, h, w, _ = a.shape
    src = _checked_src(src, sum(channels))
    by = int(block)
    y = np.empty((n, -(-src.size // by), h, w, by), np.float32)
    if y.size:
        flat = [x.reshape(n, x.shape[1], h * w, x.shape[4]) for x in (a, b)]
        _gather_blocked(*flat, channels[0], src, y.reshape(n, y.shape[1], h * w, by))
    return y
