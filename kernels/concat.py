"""Concatenation on axis 1 that appends in place when a later concatenation extends it.

    y_k = concat_1(x_0, x_1, ..., x_k)            k = 1, 2, ...

DenseNet concatenates every earlier feature map again before each layer: the k-th layer's
input copies x_0 ... x_k, so a block of L layers copies O(L^2) maps (2.4 ms of a 29 ms
densenet121 run on a 2-core Zen 4, about what onnxruntime's own Concats cost it). With room
reserved after y_(k-1) in its buffer, y_k is the same buffer one part longer: x_k is the only
copy, and y_k a view of the buffer's first channels. The buffer's channels are axis 1 of any
layout (NCHW, or channel blocks [N, CB, H, W, b]): with N = 1 each y_k is C-contiguous; with
N > 1 it is a strided view (a kernel that wants contiguous data copies it, which is what the
whole concatenation cost before).

When may y_k take y_(k-1)'s buffer? When x_0 ... x_(k-1) are the very arrays (identity, not
equal values) placed there, nothing was appended since, and the room suffices. The kernels of
this project never write into their inputs (fusion/runtime/kernel.py: read_only_inputs guards
the others), so the placed arrays' contents are still the buffer's. Anything else, a fork
(two extensions of one y), other shapes, no room: a fresh buffer and a whole copy.

    >>> a, b, c = (np.full((1, 2, 3, 3), v, np.float32) for v in (1, 2, 3))
    >>> y1 = concat_channels([a, b], reserve=6)
    >>> y2 = concat_channels([a, b, c], reserve=6)
    >>> np.shares_memory(y1, y2), y2[0, :, 0, 0].tolist()
    (True, [1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .workspace import empty

# Buffers with room left, by the first part's id: (weak references to the parts placed, the
# buffer, the entries along axis 1 filled). An entry goes when a part it placed is freed: a
# run releases the parts after its last concatenation, and with them the buffer.
_OPEN: dict[int, tuple[list, np.ndarray, int]] = {}
_LOCK = threading.RLock()  # re-entrant: a part freed while it is held calls forget()
MAX_OPEN = 64  # buffers held at once; more are chains nobody extended (repeated timing calls)


def concat_channels(parts, reserve: int = 0) -> np.ndarray:
    """np.concatenate(parts, axis=1) for float32 arrays of one layout; with `reserve` above
    their total along axis 1 (channels, or channel blocks), written into a buffer with room
    for `reserve`, which a later call whose parts begin with these same arrays appends to.
    An append checks only the parts it adds (the others were checked when placed): DenseNet's
    deepest layers concatenate 30 and more."""
    parts = list(parts)
    if not parts:
        raise ValueError("parts must be float32 arrays of rank >= 2, at least one")
    with _LOCK:
        open_ = _OPEN.get(id(parts[0]))
        if open_ is not None:
            placed, buf, filled = open_
            k = len(placed)
            if k < len(parts) and all(r() is p for r, p in zip(placed, parts, strict=False)):
                new = parts[k:]
                _check(new, (buf.shape[0], *buf.shape[2:]))
                end = filled + sum(p.shape[1] for p in new)
                if end <= buf.shape[1]:
                    _place(buf, new, filled)
                    _remember(parts[0], placed + _refs(new, parts[0], buf), buf, end)
                    return buf[:, :end]
    _check(parts, (np.shape(parts[0])[0], *np.shape(parts[0])[2:]))
    total = sum(p.shape[1] for p in parts)
    if reserve <= total:
        return np.concatenate(parts, axis=1)
    first = parts[0]
    buf = empty((first.shape[0], int(reserve), *first.shape[2:]))
    _place(buf, parts, 0)
    with _LOCK:
        _remember(first, _refs(parts, first, buf), buf, total)
    return buf[:, :total]


def _check(parts: list, rest: tuple) -> None:
    for p in parts:
        if not isinstance(p, np.ndarray) or p.dtype != np.float32 or p.ndim < 2:
            raise ValueError(f"parts must be float32 arrays of rank >= 2, got {p!r:.60}")
        if (p.shape[0], *p.shape[2:]) != rest:
            raise ValueError(f"parts differ outside axis 1 ({p.shape} against {rest}): "
                             "cannot concatenate")  # fmt: skip


def _place(buf: np.ndarray, parts: list, at: int) -> None:
    for p in parts:
        buf[:, at : at + p.shape[1]] = p
        at += p.shape[1]


def _refs(parts: list, first, buf: np.ndarray) -> list:
    """Weak references to parts placed in buf: when one is freed, nothing can extend buf."""
    key = id(first)

    def forget(_ref, key=key, buf=buf):
        with _LOCK:
            entry = _OPEN.get(key)
            if entry is not None and entry[1] is buf:
                del _OPEN[key]

    return [weakref.ref(p, forget) for p in parts]


def _remember(first, refs: list, buf: np.ndarray, filled: int) -> None:
    """Hold buf open for an extension of the parts `refs` name (the caller holds _LOCK)."""
    key = id(first)
    if filled >= buf.shape[1]:
        _OPEN.pop(key, None)  # full
        return
    _OPEN[key] = (refs, buf, filled)
    while len(_OPEN) > MAX_OPEN:
        del _OPEN[next(iter(_OPEN))]
