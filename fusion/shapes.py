"""Shape computations a fused node takes in with it (Rule.absorb_shapes).

TorchScript exports compute a Reshape's target from the Shape of a value, sometimes a value
the match computes itself (GPT-2's attention reads Shape(Split output) to reshape it). Such a
Shape, and the integer arithmetic below it (Gather, Unsqueeze, Concat, ...), would make the
match's inner value escape. When everything that arithmetic computes is read only by the match
(and by itself), it joins the match: the fused node's body computes it, the kernel ignores it.

The same reading of shape tensors gives GraphView the sizes ONNX shape inference leaves unknown
(refine_types). Every `view` here is a fusion.graph.GraphView (not imported: graph.py imports
this module).
"""

from __future__ import annotations

import math
from dataclasses import replace

from onnx import TensorProto
from onnx.numpy_helper import to_array as onnx_numpy

SHAPE_OPS = frozenset({
    "Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Div", "Mul", "Add",
    "Sub", "Reshape", "ConstantOfShape", "Equal", "Where", "Expand", "Range", "Max", "Min", "Neg",
    "Identity",
})  # fmt: skip
INTEGER = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL})


def absorb_shapes(view, nodes: list[int], outputs) -> tuple[list[int], set, list[str]]:
    """(nodes with the shape computations that read them, the values those compute, the
    non-constant values they read from outside, in graph order). Every Shape of a value the
    match computes starts one; the integer nodes below it join while each is a SHAPE_OPS node
    with integer outputs that are not graph outputs. If any of them falls outside that, none
    joins (the match's escape check then names the reader)."""
    inside, kept = set(nodes), set(outputs)
    stack = [
        user
        for i in nodes
        for value in view.nodes[i].output
        if value and value not in kept
        for user in view.consumers.get(value, ())
        if user not in inside and view.nodes[user].op_type == "Shape"
    ]
    cone: set[int] = set()
    while stack:
        index = stack.pop()
        if index in cone:
            continue
        node = view.nodes[index]
        if node.op_type not in SHAPE_OPS or node.domain not in ("", "ai.onnx"):
            return nodes, set(), []
        for value in node.output:
            vt = view.type_of(value) if value else None
            if value and (vt is None or vt.elem_type not in INTEGER or view.is_graph_output(value)):
                return nodes, set(), []
            stack += [u for u in view.consumers.get(value, ()) if u not in inside and u not in cone]
        cone.add(index)
    computed = {value for i in cone for value in view.nodes[i].output if value}
    produced = computed | {value for i in nodes for value in view.nodes[i].output if value}
    reads = []
    for i in sorted(cone):
        for value in view.nodes[i].input:
            if (
                value
                and value not in produced
                and value not in reads
                and view.constant(value) is None
            ):
                reads.append(value)
    return sorted(inside | cone), computed, reads


Entry = int | tuple[str, int] | None  # a constant, (value, axis): that value's dim, or unknown
Known = dict  # (value, axis) -> its size, where a rule knows it (a head tensor's head size)


def _div(a: int, b: int) -> int | None:
    """ONNX's integer Div: the quotient rounded toward zero (Python's // rounds down)."""
    if not b:
        return None
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


_ARITH = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
          "Div": _div, "Equal": lambda a, b: int(a == b)}  # fmt: skip


def shape_entries(view, value: str, known: Known | None = None,
                  depth: int = 16) -> list[Entry] | None:  # fmt: skip
    """The entries of a 1-D integer shape tensor as the exporters compute it: each a constant,
    (tensor, axis) when it is the size of `tensor` along `axis` (read by Shape, then Gather,
    Slice, Unsqueeze, Squeeze, Cast and Concat), or None when it is computed some other way.
    None when not even the number of entries is known. Sizes in `known` count as constants,
    and arithmetic on constants (Add, Sub, Mul, Div, Equal, Where, ConstantOfShape) is done.

    TorchScript writes a head Reshape's target as Concat(Unsqueeze(Gather(Shape(q), 0)), ...,
    [-1], [8]), dynamo as Concat(Shape(x, start=0, end=1), ...): either way a rule can tell
    that the target is [q's batch, q's sequence, -1, 8] without knowing those sizes. torch's
    expand writes its target t as Where(Equal(t, -1), 1, t): a size read from a tensor is
    never -1, so that is t. Only integer arithmetic is followed: a float constant, or a Cast
    to a float type (x.size(1) * 0.5 traced), gives None, never a truncated guess."""
    known = known or {}
    const = view.constant(value)
    if const is not None:
        if const.ndim > 1 or const.dtype.kind not in "iub":
            return None
        return [int(d) for d in const.reshape(-1)]
    producer = view.producer.get(value)
    if producer is None or depth == 0:
        return None
    node = view.nodes[producer[0]]
    op, attrs = node.op_type, view.attributes(node)
    ins = list(node.input)

    def entries(i):
        if len(ins) <= i or not ins[i]:
            return None
        return shape_entries(view, ins[i], known, depth - 1)

    if op == "Shape":
        vt = view.type_of(ins[0])
        rank = vt.rank if vt is not None else None
        if rank == 1 and not attrs.get("start") and attrs.get("end", 1) >= 1:
            inner = shape_entries(view, ins[0], known, depth - 1)  # the shape of a shape
            if inner is not None:
                return [len(inner)]
        if rank is None:
            return None
        start, end = attrs.get("start", 0), attrs.get("end", rank)
        dims = [(ins[0], axis) for axis in range(rank)[slice(start, end)]]
        return [known.get(d, d) for d in dims]
    if op == "Cast" and attrs.get("to") not in INTEGER:
        return None  # float arithmetic on sizes: not followed
    if op in ("Cast", "Identity", "Unsqueeze", "Squeeze"):  # a scalar is a list of one here
        return entries(0)
    if op == "Reshape":  # of a shape tensor: only to 1-D
        target = view.constant(ins[1])
        return entries(0) if target is not None and target.reshape(-1).tolist() == [-1] else None
    if op == "Concat":
        parts = [entries(i) for i in range(len(ins))]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if op == "ConstantOfShape":
        shape, fill = entries(0), attrs.get("value")
        fill = 0 if fill is None else int(onnx_numpy(fill).reshape(-1)[0])
        return None if shape is None or len(shape) != 1 or not isinstance(shape[0], int) else (
            [fill] * shape[0])  # fmt: skip
    if op in _ARITH:
        a, b = entries(0), entries(1)
        if a is None or b is None:
            return None
        if op == "Equal":
            return _broadcast(_equal, a, b)
        return _broadcast(lambda x, y: _ARITH[op](x, y) if isinstance(x, int) and
                          isinstance(y, int) else None, a, b)  # fmt: skip
    if op == "Where":
        cond, a, b = entries(0), entries(1), entries(2)
        if cond is None or a is None or b is None or None in cond:
            return None
        n = max(len(cond), len(a), len(b))
        if any(len(e) not in (1, n) for e in (cond, a, b)):
            return None
        pick = [cond[i % len(cond)] for i in range(n)]
        return [a[i % len(a)] if pick[i] else b[i % len(b)] for i in range(n)]
    if op == "Gather":
        source, index = entries(0), view.constant(ins[1]) if len(ins) > 1 else None
        if source is None or index is None or index.ndim > 1:
            return None
        picked = [int(i) for i in index.reshape(-1)]
        if any(not -len(source) <= i < len(source) for i in picked):
            return None
        return [source[i] for i in picked]
    if op == "Slice":
        source = entries(0)
        bounds = [view.constant(ins[i]) if len(ins) > i and ins[i] else None for i in (1, 2, 3, 4)]
        starts, ends, axes, steps = bounds
        if source is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if (axes is not None and int(axes.reshape(-1)[0]) not in (0, -1)) or (
            steps is not None and steps.size != 1
        ):
            return None
        step = 1 if steps is None else int(steps.reshape(-1)[0])
        big = 2**62  # INT64 max and min mean "to the end" in Slice
        start, end = (max(-big, min(big, int(b.reshape(-1)[0]))) for b in (starts, ends))
        return source[slice(start, end, step)] if step else None
    return None


def _equal(x: Entry, y: Entry) -> int | None:
    """x == y for entries; a size read from a tensor is never negative."""
    if isinstance(x, int) and isinstance(y, int):
        return int(x == y)
    number = x if isinstance(x, int) else y
    return 0 if isinstance(number, int) and number < 0 else None


def _broadcast(fn, a: list, b: list) -> list | None:
    """fn entry by entry, a list of one broadcast against the other."""
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    n = max(len(a), len(b))
    return [fn(a[i % len(a)], b[i % len(b)]) for i in range(n)]


# ---- sizes ONNX's inference leaves unknown -------------------------------------------------------
_BIG = 2**62  # INT64 max and min mean "to the end" in Slice
_ROUNDS = 64


def unknown(dim) -> bool:
    """A dim no rule can use: missing, a name ONNX's inference made up for it, or a negative
    number (a model may declare -1)."""
    if isinstance(dim, int):
        return dim < 0
    return dim is None or (isinstance(dim, str) and dim.startswith("unk__"))


def refine_types(view, types: dict, infer) -> None:
    """Fill in, in `types` (value -> ValueType, what `view.type_of` reads), the sizes that ONNX
    shape inference leaves unknown behind a Reshape or Slice whose target or bounds the graph
    computes from Shape: TorchScript writes ShuffleNet's chunk as two Slices ending at
    Shape(x)[1] // 2 and its shuffle's Reshape targets from Shape(x), so every channel count
    after the first shuffle is `unk__N` and no rule can prove a shuffle or pack a conv's input.
    Each round reads those shape tensors (shape_entries, with every size known so far) and
    hands what it found to `infer` (value -> dims to declare; returns the types ONNX's
    inference derives from them), which carries them on through the ops below; rounds go on
    while a round finds a size. The same rounds name the spatial sizes of a Conv or pool on
    named planes (_window_dims: a model exported with a symbolic H and W), carried on within
    the round through the elementwise ops below them (_elementwise_dims)."""
    found: dict[str, tuple] = {}
    for _ in range(_ROUNDS):
        known = {(value, axis): d for value, t in types.items() if t.shape
                 for axis, d in enumerate(t.shape) if isinstance(d, int) and d >= 0}  # fmt: skip
        new = {}
        # a window's named sizes carried on within the round, in graph order, through the
        # elementwise ops between windows (else each round names one conv deeper: ResNet-101
        # with symbolic H and W needs 100 rounds of ONNX's inference of the whole graph)
        ahead = dict(types)
        for node in view.nodes:
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in ("Reshape", "Slice"):
                dims = _computed_dims(view, node, types, known)
            elif node.op_type in WINDOW_OPS:
                dims = _window_dims(view, node, ahead)
            elif node.op_type in ELEMENTWISE_OPS and node.output:
                dims = _elementwise_dims(node, ahead)
            else:
                continue
            if dims is not None:
                new[node.output[0]] = dims
                if node.output[0] in ahead:
                    ahead[node.output[0]] = replace(ahead[node.output[0]], shape=dims)
        if not new:
            return
        found |= new
        changed = False
        for value, dims in new.items():  # what ONNX may not take (a graph output's hint)
            old = types.get(value)
            if old is not None and (old.shape is None or _better(dims, old.shape)):
                types[value], changed = replace(old, shape=dims), True
        for value, vt in infer(found).items():
            old = types.get(value)
            if old is None or old.shape is None or _better(vt.shape, old.shape):
                types[value], changed = vt, True
        if not changed:
            return


WINDOW_OPS = frozenset({"Conv", "MaxPool", "AveragePool"})
# ops whose output 0 is their inputs broadcast (numpy's rules), the ones between a CNN's windows
ELEMENTWISE_OPS = frozenset({
    "Abs", "Add", "BatchNormalization", "Clip", "Div", "Dropout", "Elu", "Erf", "Exp", "Gelu",
    "HardSigmoid", "HardSwish", "Identity", "LeakyRelu", "Max", "Min", "Mish", "Mul", "Neg",
    "PRelu", "Relu", "Selu", "Sigmoid", "Softplus", "Sqrt", "Sub", "Sum", "Tanh",
})  # fmt: skip
_PER_CHANNEL_INPUTS = {"BatchNormalization": 1, "Clip": 1}  # inputs past the first not broadcast


def _elementwise_dims(node, types: dict) -> tuple | None:
    """Output 0's dims of an elementwise op whose inputs' sizes are named where its own are
    unknown: per axis (right-aligned) the one size its inputs have other than 1, when every
    input's size there is known; None when that tells nothing new."""
    out = types.get(node.output[0])
    if out is None or out.shape is None or not any(unknown(d) for d in out.shape):
        return None
    names = node.input[: _PER_CHANNEL_INPUTS.get(node.op_type, len(node.input))]
    shapes = [types[v].shape if v in types else None for v in names if v]
    if not shapes or any(sh is None or len(sh) > len(out.shape) for sh in shapes):
        return None
    dims = list(out.shape)
    for axis in range(1, len(dims) + 1):
        sizes = {sh[-axis] for sh in shapes if len(sh) >= axis}
        if not unknown(dims[-axis]) or any(unknown(d) for d in sizes):
            continue
        wide = sizes - {1}
        if len(wide) <= 1:
            dims[-axis] = wide.pop() if wide else 1
    dims = tuple(dims)
    return dims if _better(dims, out.shape) else None


def _window_dims(view, node, types: dict) -> tuple | None:
    """The output dims of a Conv or pool whose input's spatial sizes are named (a model exported
    with a symbolic H and W) where ONNX's inference names the output's afresh (`unk__N`): each
    as a name of its own input name and the window's arithmetic, out = floor((in + pads -
    dilation (k - 1) - 1) / stride) + 1 (ceil with ceil_mode), the input's own name where that
    is the identity (stride 1, the pads the window's span, as 'same' convs have). Two values
    computed by the same windows from the same size get the same name, so a residual Add's two
    inputs are the same shape again (without it every residual fusion of such a model is
    refused); a name is never shared by two different sizes."""
    out, source = types.get(node.output[0]), types.get(node.input[0])
    if source is None or source.shape is None or out is None or out.shape is None:
        return None
    rank = len(source.shape)
    if rank < 3 or len(out.shape) != rank or not any(unknown(d) for d in out.shape[2:]):
        return None
    attrs = view.attributes(node)
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", ""):
        return None
    if node.op_type == "Conv":
        weight = types.get(node.input[1]) if len(node.input) > 1 else None
        if weight is None or weight.shape is None or len(weight.shape) != rank:
            return None
        kernel = list(attrs.get("kernel_shape") or weight.shape[2:])
    else:
        kernel = list(attrs.get("kernel_shape") or [])
    n = rank - 2
    if len(kernel) != n or not all(isinstance(k, int) and k > 0 for k in kernel):
        return None
    strides = list(attrs.get("strides") or [1] * n)
    dilations = list(attrs.get("dilations") or [1] * n)
    pads = list(attrs.get("pads") or [0] * (2 * n))
    ceil = bool(attrs.get("ceil_mode", 0))
    dims = list(out.shape)
    for axis in range(n):
        size, old = source.shape[2 + axis], out.shape[2 + axis]
        if not unknown(old) or not isinstance(size, str) or unknown(size):
            continue
        span = dilations[axis] * (kernel[axis] - 1) + 1
        extra = pads[axis] + pads[axis + n] - span + 1  # out = (in + extra) / stride, rounded
        if strides[axis] == 1 and extra == 0:
            dims[2 + axis] = size
        else:
            dims[2 + axis] = f"({size}{extra:+d})/{strides[axis]}{'^' if ceil else ''}"
    dims = tuple(dims)
    return dims if _better(dims, out.shape) else None


def _better(new: tuple | None, old: tuple) -> bool:
    """`new` knows a size `old` does not, and contradicts none that it does."""
    if new is None or len(new) != len(old):
        return False
    agree = all(unknown(o) or o == n for o, n in zip(old, new, strict=True))
    return agree and any(unknown(o) and not unknown(n) for o, n in zip(old, new, strict=True))


def _computed_dims(view, node, types: dict, known: dict) -> tuple | None:
    """The output dims of Reshape or Slice `node`, when its target or bounds tell one that its
    output's type leaves unknown; None otherwise."""
    out, source = types.get(node.output[0]), types.get(node.input[0])
    if source is None or source.shape is None:
        return None
    if out is not None and out.shape is not None and not any(unknown(d) for d in out.shape):
        return None
    dims = (_reshape_dims if node.op_type == "Reshape" else _slice_dims)(view, node, source, known)
    if dims is None:
        return None
    old = out.shape if out is not None and out.shape is not None else (None,) * len(dims)
    if len(old) != len(dims):
        return None
    merged = tuple(
        d if unknown(o) and not unknown(d) else o for o, d in zip(old, dims, strict=True)
    )
    return merged if _better(merged, old) else None


def _reshape_dims(view, node, source, known: dict) -> list | None:
    target = shape_entries(view, node.input[1], known) if len(node.input) > 1 else None
    if target is None:
        return None
    keep_zero = view.attributes(node).get("allowzero", 0)
    dims = []
    for k, entry in enumerate(target):
        if isinstance(entry, tuple):  # a size read from a tensor whose size is symbolic
            vt = view.type_of(entry[0])
            size = vt.shape[entry[1]] if vt and vt.shape and entry[1] < len(vt.shape) else None
            entry = None if unknown(size) else size
        elif entry == 0 and not keep_zero:  # 0 copies the input's size
            entry = source.shape[k] if k < len(source.shape) else None
        elif entry is not None and entry < -1:
            return None
        dims.append(entry if entry == -1 else None if unknown(entry) else entry)
    if dims.count(-1) == 1:  # the rest of the elements: symbols cancel when both sides have them
        rest = [d for d in dims if d != -1]
        known_sizes = all(d is not None and not unknown(d) for d in [*rest, *source.shape])
        symbols = [sorted(d for d in side if isinstance(d, str)) for side in (rest, source.shape)]
        have = math.prod(d for d in source.shape if isinstance(d, int))
        take = math.prod(d for d in rest if isinstance(d, int))
        ok = known_sizes and symbols[0] == symbols[1] and take > 0 and have % take == 0
        dims[dims.index(-1)] = have // take if ok else None
    return None if -1 in dims else dims


def _slice_dims(view, node, source, known: dict) -> list | None:
    rank = len(source.shape)
    ins = [*node.input, "", "", "", ""]
    starts, ends, axes, steps = (shape_entries(view, v, known) if v else None for v in ins[1:5])
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = axes if ins[3] else list(range(len(starts)))
    steps = steps if ins[4] else [1] * len(starts)
    if axes is None or steps is None or len(axes) != len(starts) or len(steps) != len(starts):
        return None
    dims = [None if unknown(d) else d for d in source.shape]
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if not isinstance(axis, int) or not -rank <= axis < rank:
            return None
        axis %= rank
        bounds = (start, end, step)
        if all(isinstance(b, int) for b in bounds) and step and isinstance(dims[axis], int):
            start, end = (max(-_BIG, min(_BIG, b)) for b in (start, end))
            dims[axis] = len(range(*slice(start, end, step).indices(dims[axis])))
        elif not (start == 0 and isinstance(end, int) and end >= _BIG and step == 1):
            dims[axis] = None  # all of a symbolic axis keeps its size; anything else is unknown
    return dims
