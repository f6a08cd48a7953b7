"""ChannelConcat:  y = Concat(x_1, ..., x_k, axis=1)   float32 [N, C_i, ...]

The Concat that ConvConcat leaves: DenseNet's feature concatenation before each layer (its
inputs a pool, earlier layers' convs), ShuffleNet's branch merge. Unfused, each is an
onnxruntime island of one copy between kernels. As a kernel the copy stays in process, and in
the blocked layout ([N, C/b, H, W, b]) it is a concatenation of channel blocks when every input
but the last has whole blocks (a multiple of b channels, known from the model's shapes);
otherwise it runs NCHW. The block b is the running process's (kernels/blocked.py: 8 with AVX2,
16 with AVX-512), so the rewrite does not depend on it: the fused node is the same on every
machine, and the choice of a blocked tactic is made when the kernel is built.

DenseNet concatenates every earlier map again before each layer (layer k's Concat has inputs
x_0 ... x_k, layer k + 1's the same and x_(k+1)): the shorter one's fused node carries
`reserve`, the channels of the longest Concat that extends it, and its kernel leaves that room
in its output buffer, so the next one copies only its new input (kernels/concat.py).

A Concat has any number of inputs, which a pattern cannot state: a finder anchored on Concat,
at stage 1 after ConvConcat (which removes the copy altogether when every input is a conv's).
"""

from __future__ import annotations

import onnx

from fusion.catalog import Rule, Tactic
from fusion.graph import GraphView
from fusion.matcher import Match


def find_concat(view: GraphView, index: int) -> list[Match] | str | None:
    concat = view.nodes[index]
    axis = view.attributes(concat).get("axis")
    types = [view.type_of(v) for v in concat.input]
    if any(t is None or t.rank is None for t in types):
        return "the rank of an input is unknown"
    rank = types[0].rank
    if axis % rank != 1:
        return f"Concat on axis {axis}, not on the channels (axis 1)"
    for value, t in zip(concat.input, types, strict=True):
        if t.dtype_name != "float32":
            return f"input {value} is {t.dtype_name}, the kernel copies float32"
    values = {"parts": list(concat.input), "y": concat.output[0]}
    return [Match.of(view, values, {"concat": index}, [index])]


def _channels(view: GraphView, values) -> list[int]:
    """Each value's channel count (-1 where the model does not say)."""
    types = [view.type_of(v) for v in values]
    return [t.shape[1] if t and t.shape and isinstance(t.shape[1], int) else -1 for t in types]


def extension(view: GraphView, concat: onnx.NodeProto, rank: int) -> list[str]:
    """The inputs of the longest channel Concat whose inputs begin with this one's (DenseNet
    concatenates every earlier map again before each layer), or [] when none does. Its
    ChannelConcat then appends to this one's output in place (kernels/concat.py)."""
    parts, best = list(concat.input), []
    for i in view.consumers.get(parts[0], []):
        other = view.nodes[i]
        if (
            other.op_type == "Concat"
            and other.domain in ("", "ai.onnx")
            and view.attributes(other).get("axis", 0) % rank == 1
            and len(other.input) > max(len(parts), len(best))
            and list(other.input[: len(parts)]) == parts
        ):
            best = list(other.input)
    return best


def attributes(m: Match) -> dict:
    """The rank, each input's channel count (-1 where the model does not say), and `reserve`:
    the channels of each input of the longest concatenation that extends this one, for the
    room its kernel leaves (absent when none does)."""
    rank = m.view.type_of(m["parts"][0]).rank
    reserve = _channels(m.view, extension(m.view, m.node("concat"), rank))
    attrs = {"rank": rank, "channels": _channels(m.view, m["parts"])}
    return attrs | ({"reserve": reserve} if reserve and -1 not in reserve else {})


def why_not_blocked(rank: int, channels: list, block: int) -> str | None:
    """Why the concatenation cannot run on blocks of `block` channels, or None when it can:
    the blocks of input k + 1 must start where input k's end, so every input but the last
    fills whole blocks (the last one's padding is the output's)."""
    if rank != 4:
        return f"rank {rank}: the blocked layout is 4-D"
    for k, c in enumerate(channels):
        if c <= 0:
            return f"input {k} has {'no' if c == 0 else 'an unknown number of'} channels"
    partial = [(k, c) for k, c in enumerate(channels[:-1]) if c % block]
    if partial:
        k, c = partial[0]
        return f"input {k} has {c} channels, not whole blocks of {block}"
    return None


class ConcatKernel:
    """Tactics: blocked when every input but the last fills whole blocks of this process's
    block, then NCHW (`nchw_only` says why, when it does). The same copy serves both: blocked,
    the channel blocks of each input follow one another. With a `reserve` (a longer
    concatenation extends this one), the output has room for it in either layout."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built
        from fusion_kernels.concat import concat_channels

        channels, b = list(attrs["channels"]), block()
        reserve = list(attrs.get("reserve", []))
        room, room_blocked = sum(reserve), sum(-(-c // b) for c in reserve)  # 0: none

        def concat(*parts):
            return (concat_channels(parts, room),)

        def concat_blocked(*parts):
            return (concat_channels(parts, room_blocked),)

        self.run = concat
        self.tactics = [Tactic("nchw", concat)]
        self.nchw_only = why_not_blocked(attrs["rank"], channels, b)
        if self.nchw_only is None:
            k = len(channels)
            blocked = Tactic("blocked", concat_blocked, blocked_inputs=tuple(range(k)),
                             in_blocks=(b,) * k, blocked_outputs=(0,),
                             out_channels=(sum(channels),))  # fmt: skip
            self.tactics.insert(0, blocked)

    def __call__(self, *parts):
        return self.run(*parts)


RULE = Rule(
    "ChannelConcat",
    None,
    inputs=("parts",),
    outputs=("y",),
    prepare=ConcatKernel,
    attributes=attributes,
    finder=find_concat,
    anchor_ops=("Concat",),
    stage=1,
    priority=5,  # after ConvConcat
    description="Concat on channels, float32, in process (blocked when the channels allow)",
)
