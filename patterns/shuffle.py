"""ChannelShuffle:  y = Reshape(Transpose(Reshape(x, [N, g, C/g, H, W]), (0, 2, 1, 3, 4)),
                                [N, C, H, W])
    y[:, j] = x[:, (j % g) (C / g) + j // g]                         float32 [N, C, H, W]

ShuffleNet v2's channel shuffle, with what stands next to it in every unit: the Concat of the
two branches before it (x = Concat(a, b, axis=1)) and the Split of the next unit after it
(Split(y, axis=1) into its halves). Unfused these are onnxruntime islands, and each forces the
blocked layout back to NCHW and into it again; fused they are one channel gather
(kernels/shuffle.py) on either layout, so the planner keeps the tensors blocked across it.

The Reshapes are proved a shuffle from their targets (Match.shape_entries): the first splits
only the channels ([N, g, C/g, H, W], each entry a constant equal to x's size or read from x's
own shape), the second merges them back ([N, C or -1, H, W]); TorchScript's Shape arithmetic
for them joins the fused node (Rule.absorb_shapes). C must be known from the model.

A finder: the Split's outputs vary in number, which a pattern cannot state.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.graph import GraphView
from fusion.matcher import Match


def _only_reader(view: GraphView, value: str, op_type: str) -> int | None:
    """The node reading `value` when it is the only reader, of `op_type`, and `value` is not a
    graph output."""
    users = view.consumers.get(value, ())
    if len(users) != 1 or view.is_graph_output(value):
        return None
    return users[0] if view.nodes[users[0]].op_type == op_type else None


def _fits(got, want, t) -> bool:
    """Reshape target entries `got` are `want`: each a constant or (x, axis), x's size on that
    axis read from its shape or the same constant; one entry at most -1 (the rest then fix it)."""
    if got is None or len(got) != len(want) or got.count(-1) > 1:
        return False
    for entry, w in zip(got, want, strict=True):
        size = t.shape[w[1]] if isinstance(w, tuple) else w
        if entry != -1 and entry != w and not (isinstance(size, int) and entry == size):
            return False
    return True


def _producer(view: GraphView, value: str) -> int | None:
    found = view.producer.get(value)
    return None if found is None else found[0]


SHAPE_OPS = frozenset({"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Div", "Mul",
                       "Add", "Slice", "Constant", "Identity"})  # fmt: skip


def shape_cone(view: GraphView, targets: list[str], readers: set[int]) -> list[int]:
    """The integer nodes computing the Reshape `targets` (TorchScript's Shape(x), Gather, Div,
    Unsqueeze, Concat) when only `readers` and each other read them, else []. They join the
    fused node, whose body then computes the targets from its own input."""
    cone, stack = set(), [t for t in targets if view.constant(t) is None]
    while stack:
        found = view.producer.get(stack.pop())
        if found is None:
            return []  # a graph input: stays an input of the fused node
        index = found[0]
        if index in cone:
            continue
        node = view.nodes[index]
        if node.op_type not in SHAPE_OPS or node.domain not in ("", "ai.onnx"):
            return []
        cone.add(index)
        if node.op_type != "Shape":
            stack += [v for v in node.input if v and view.constant(v) is None]
    inside = cone | readers
    for index in cone:
        for value in view.nodes[index].output:
            if view.is_graph_output(value) or set(view.consumers.get(value, ())) - inside:
                return []
    return sorted(cone)


def find_shuffle(view: GraphView, index: int) -> list[Match] | str | None:
    transpose = view.nodes[index]
    first = _producer(view, transpose.input[0])
    if first is None or view.nodes[first].op_type != "Reshape":
        return None  # not this rule's shape: no near-miss to report
    split_node = view.nodes[first]
    perm = view.attributes(transpose).get("perm")
    if perm is None or list(perm) != [0, 2, 1, 3, 4]:
        return (
            f"Transpose {transpose.name} with perm {perm}, not a channel shuffle's (0, 2, 1, 3, 4)"
        )
    last = _only_reader(view, transpose.output[0], "Reshape")
    if last is None:
        return f"Transpose {transpose.name}'s output is not read by one Reshape alone"
    if _only_reader(view, split_node.output[0], "Transpose") is None:
        return f"Reshape {split_node.name}'s output is also read outside the shuffle"
    x = split_node.input[0]
    t = view.type_of(x)
    if t is None or t.rank != 4 or not isinstance(t.shape[1], int):
        return f"{x}'s rank or channel count is unknown: a shuffle is proved on [N, C, H, W]"
    if t.dtype_name != "float32":
        return f"{x} is {t.dtype_name}, the kernel gathers float32"
    c = t.shape[1]
    shapes = Match.of(view, {"s1": split_node.input[1], "s2": view.nodes[last].input[1]}, {}, [])
    known = {(x, 1): c}  # C/g from x's Shape (TorchScript's Div) is then a constant
    got, want = shapes.shape_entries("s1", known), [(x, 0), None, c, (x, 2), (x, 3)]
    g = got[1] if got and len(got) == 5 else None
    if not (
        isinstance(g, int)
        and g > 0
        and c % g == 0
        and _fits(got, want[:1] + [g, c // g] + want[3:], t)
    ):
        return f"Reshape {split_node.name} to {got}, not [N, g, C/g, H, W] of {x} ({c} channels)"
    got = shapes.shape_entries("s2", known)
    if not _fits(got, [(x, 0), c, (x, 2), (x, 3)], t):
        return f"Reshape {view.nodes[last].name} to {got}, not [N, C, H, W] of {x}"
    nodes = {"first": first, "transpose": index, "last": last}
    shapes = [split_node.input[1], view.nodes[last].input[1]]
    values = {"parts": [x], "y": view.nodes[last].output[0], "s1": shapes[0], "shapes": shapes}
    concat = after = None  # the Concat before, the Split after, where they join
    cat = _producer(view, x)
    others = [u for u in view.consumers.get(x, ()) if u != first]
    if (  # TorchScript reads x's Shape for the targets: that joins the match (absorb_shapes)
        cat is not None
        and not view.is_graph_output(x)
        and all(view.nodes[u].op_type == "Shape" for u in others)
    ):
        node = view.nodes[cat]  # the Concat of the two branches
        types = [view.type_of(v) for v in node.input]
        if (
            node.op_type == "Concat"
            and view.attributes(node).get("axis") in (1, -3)
            and len(node.input) == 2
            and all(t is not None and t.rank == 4 and isinstance(t.shape[1], int) for t in types)
        ):
            concat = {"concat": cat}, {"parts": list(node.input)}
    split = _only_reader(view, values["y"], "Split")
    if (
        split is not None
        and view.attributes(view.nodes[split]).get("axis") in (1, -3)
        and split_sizes(view, view.nodes[split], c) is not None
    ):
        sizes = [v for v in view.nodes[split].input[1:] if v]
        after = {"split": split}, {"y": list(view.nodes[split].output), "shapes": shapes + sizes}
    elif (cut := slice_parts(view, values["y"], c)) is not None:  # TorchScript's chunk
        slices = [view.nodes[i] for i in cut[0]]
        bounds = dict.fromkeys(v for node in slices for v in node.input[1:] if v not in shapes)
        bounds.pop("", None)
        after = (
            {f"slice{k}": i for k, i in enumerate(cut[0])},
            {
                "y": [node.output[0] for node in slices],
                "shapes": shapes + list(bounds),
            },
        )
    # The largest match first; the Concat may be taken already (ConvConcat removes its copy).
    found = []
    for before in [concat, None] if concat else [None]:
        for behind in [after, None] if after else [None]:
            parts = [p for p in (before, behind) if p is not None]
            n = nodes | {k: v for p in parts for k, v in p[0].items()}
            vals = values | {k: v for p in parts for k, v in p[1].items()}
            cone = shape_cone(view, vals["shapes"], set(n.values()))
            if cone:  # the targets are computed inside: no shape input
                vals["shapes"] = [v for v in vals["shapes"] if view.constant(v) is not None]
            n |= {f"shape{k}": i for k, i in enumerate(cone)}
            found.append(Match.of(view, vals, n, sorted(n.values())))
    return found


def split_sizes(view: GraphView, node, channels: int) -> list[int] | None:
    """The channels of each output of Split `node` of `channels` channels (None: not known):
    its sizes input, else equal parts (the last one smaller with opset 18's num_outputs)."""
    k = len(node.output)
    if len(node.input) > 1 and node.input[1]:
        sizes = view.constant(node.input[1])
        return None if sizes is None else [int(v) for v in sizes]
    part = -(-channels // k)
    return [min(part, channels - i * part) for i in range(k)] if part * (k - 1) < channels else None


def slice_parts(view: GraphView, y: str, channels: int) -> tuple[list[int], list[int]] | None:
    """(the Slices reading `y` in channel order, the channels each takes) when every reader of
    `y` but its Shape is a Slice of axis 1, step 1, and they cut its `channels` into
    consecutive parts: TorchScript's chunk, whose bounds it computes from Shape(y)[1]."""
    if view.is_graph_output(y):
        return None
    known, parts = {(y, 1): channels}, []
    for index in view.consumers.get(y, ()):
        node = view.nodes[index]
        if node.op_type == "Shape":
            continue
        if node.op_type != "Slice" or len(node.input) < 4 or node.input[0] != y:
            return None
        names = ("starts", "ends", "axes")
        bounds = Match.of(view, dict(zip(names, node.input[1:4], strict=True)), {}, [])
        starts, ends, axes = (bounds.shape_entries(k, known) for k in names)
        step = view.constant(node.input[4]) if len(node.input) > 4 and node.input[4] else 1
        steps = None if step is None else np.reshape(step, -1).tolist()
        if axes not in ([1], [-3]) or steps != [1] or starts is None or ends is None:
            return None
        if len(starts) != 1 or not all(isinstance(b, int) for b in starts + ends):
            return None
        taken = range(channels)[slice(starts[0], min(ends[0], channels))]
        parts.append((taken.start, taken.stop, index))
    parts.sort()
    if not parts or parts[0][0] != 0 or parts[-1][1] != channels:
        return None
    if any(start >= stop for start, stop, _ in parts) or any(
        a[1] != b[0] for a, b in zip(parts, parts[1:], strict=False)
    ):
        return None
    return [index for *_, index in parts], [stop - start for start, stop, _ in parts]


def attributes(m: Match) -> dict:
    """Each part's channels, the groups, each output's channels."""
    view = m.view
    channels = [view.type_of(v).shape[1] for v in m["parts"]]
    groups = m.shape_entries("s1")[1]
    splits = [sum(channels)]
    if "split" in m.node_index:
        splits = split_sizes(view, m.node("split"), sum(channels))
    elif "slice0" in m.node_index:
        splits = slice_parts(view, m.node("last").output[0], sum(channels))[1]
    return {"channels": channels, "groups": groups, "splits": splits}


def make_kernel(attrs: dict, constants: list):
    """One gather per output, from the shuffle's map cut at the Split's sizes; tactics blocked
    (every part and output in the blocked layout), then NCHW."""
    from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built
    from fusion_kernels.shuffle import (
        bind_channel_gathers_blocked,
        channel_gather,
        channel_gathers_blocked,
        shuffle_map,
    )

    channels, splits = list(attrs["channels"]), list(attrs["splits"])
    src = shuffle_map(sum(channels), attrs["groups"])
    cuts = np.split(src, np.cumsum(splits)[:-1])
    k, b = len(channels), block()

    def nchw(*args):
        return tuple(channel_gather(args[:k], s) for s in cuts)

    def blocked(*args):
        return channel_gathers_blocked(args[:k], channels, cuts, b)

    def bind(*args):
        call = bind_channel_gathers_blocked(args[:k], channels, cuts, b)
        return lambda *args: call(args[:k])

    nchw.tactics = [
        Tactic("blocked", blocked, blocked_inputs=tuple(range(k)),
               in_blocks=(b,) * k,
               blocked_outputs=tuple(range(len(splits))), out_channels=tuple(splits),
               bind=bind),
        Tactic("nchw", nchw),
    ]  # fmt: skip
    return nchw


def check(m: Match) -> str | None:
    splits = attributes(m)["splits"]
    if sum(splits) != sum(attributes(m)["channels"]):
        return f"the Split's outputs hold {splits} channels, not the shuffle's"
    return None


RULE = Rule(
    "ChannelShuffle",
    None,
    inputs=("parts", "shapes"),  # the shapes only for the function body
    outputs=("y",),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    finder=find_shuffle,
    anchor_ops=("Transpose",),
    stage=1,
    priority=10,  # before ChannelConcat takes the Concat alone
    absorb_shapes=True,
    rtol=0.0,
    atol=0.0,
    description="channel shuffle (Reshape, Transpose, Reshape) with the Concat before it and "
    "the Split after it, float32, one channel gather on either layout (ShuffleNet)",
)
