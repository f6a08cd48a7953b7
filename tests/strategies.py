"""Random models for hypothesis: catalog patterns, their variants and near-misses, chained.

`models()` draws (model, {fused node name: rule}, batch size to run with). A catalog family
plugs in by adding a generator to FAMILIES: `generate(draw, g, x) -> Block` appends one block
reading `x` to the GraphBuilder `g` and says whether it must fuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from helpers import GraphBuilder, conv_block
from hypothesis import strategies as st
from onnx import TensorProto


@dataclass
class Tensor:
    """The value a block reads or writes: NCHW float32 with `channels` and a square `size`."""

    name: str
    channels: int
    size: int


@dataclass
class Block:
    out: Tensor
    fused: str | None = None  # the fused node's name when the block must fuse, else None
    rule: str = ""
    outputs: list[str] = field(default_factory=list)  # extra graph outputs
    inputs: dict[str, tuple] = field(default_factory=dict)  # extra graph inputs: name -> shape


# ---- ConvBiasRelu ----------------------------------------------------------------------------
CONV_NEAR_MISSES = (
    "graph_output",  # a value inside the chain is also a graph output: the chain up to it fuses
    "side_use",  # ... or is read by a node outside it: the same
    "width_bias",  # Add of a [W] constant (broadcasts along the width): the Conv fuses alone
    "weight_input",  # the weight is a graph input, not a constant: nothing fuses
    "clip_input",  # Clip's upper bound is a graph input: the chain before the Clip fuses
    "float16",  # the block computes in float16 between two Casts: nothing fuses
)
VARIANTS = ("no_activation", "leaky")  # a projection conv; LeakyRelu: both fuse whole


def conv_bias_relu(draw, g: GraphBuilder, x: Tensor) -> Block:
    kind = draw(st.sampled_from(("clean",) * 4 + VARIANTS + CONV_NEAR_MISSES))
    cout = draw(st.sampled_from([1, 2, 3, 4]))
    k = draw(st.sampled_from([1, 3] + ([5] if x.size >= 5 else [])))
    attrs: dict = {}
    pad = draw(st.sampled_from(["same", "none", "auto", "asym"]))
    if pad == "same":
        attrs["pads"] = [k // 2] * 4
    elif pad == "asym":
        attrs["pads"] = [k // 2, 0, 0, k // 2]
    elif pad == "auto":
        attrs["auto_pad"] = draw(st.sampled_from(["SAME_UPPER", "SAME_LOWER"]))
    if x.size >= 4 and draw(st.booleans()):
        attrs["strides"] = [2, draw(st.sampled_from([1, 2]))]
    if k == 3 and pad == "same" and draw(st.booleans()):
        attrs["dilations"], attrs["pads"] = [2, 2], [2] * 4
    if x.channels % 2 == 0 and cout % 2 == 0 and draw(st.booleans()):
        attrs["group"] = 2
    bias = draw(st.sampled_from(["input", "add", "both", "none"]))
    bias_shape = draw(st.sampled_from([None, (cout, 1, 1), (1,)]))
    act = draw(st.sampled_from(["relu", "clip", "relu6"]))
    size = out_size(x.size, k, attrs)
    if size < 1:  # too small, or not square: a plain same-size convolution
        attrs, size = {"pads": [k // 2] * 4}, x.size
    block = Block(Tensor("", cout, size))
    if kind == "width_bias" and size == 1:
        kind = "clean"  # a [1] constant is a scalar: a fine bias
    if kind == "width_bias":
        bias, bias_shape = "add", (size,)
    if kind in ("no_activation", "leaky"):
        act = "none"
    if kind == "clip_input":
        act = draw(st.sampled_from(["clip", "relu6"]))  # with bounds as inputs (opset >= 11)
    src = x.name
    if kind == "float16":
        src = g.node("Cast", [src], to=TensorProto.FLOAT16)
    before = len(g.nodes)
    y = conv_block(
        g, src, x.channels, cout, k=k, bias=bias, bias_shape=bias_shape, act=act, **attrs
    )
    nodes = g.nodes[before:]
    conv, inner = nodes[0], [n.output[0] for n in nodes[:-1]]
    root = nodes[-1]  # the last node of the chain that fuses (None: nothing does)
    if kind == "float16":
        for node in nodes:  # every constant the block reads becomes float16
            for name in node.input[1:]:
                to_float16(g, name)
        y = g.node("Cast", [y], to=TensorProto.FLOAT)
        root = None
    elif kind == "leaky":
        y = g.node("LeakyRelu", [y], alpha=0.1)
        root = g.nodes[-1]
    elif kind == "weight_input":
        block.inputs[conv.input[1]] = drop_initializer(g, conv.input[1])
        root = None
    elif kind == "clip_input":
        block.inputs[nodes[-1].input[2]] = drop_initializer(g, nodes[-1].input[2])
        root = nodes[-2]
    elif kind == "width_bias":
        root = conv
    elif kind in ("graph_output", "side_use") and inner:
        value = draw(st.sampled_from(inner))
        root = next(n for n in nodes if n.output[0] == value)
        if kind == "graph_output":
            block.outputs.append(value)
        else:
            block.outputs.append(g.node("Sigmoid", [value]))
    if root is not None:
        block.fused, block.rule = root.name, "ConvBiasRelu"
    block.out.name = y
    return block


def out_size(size: int, k: int, attrs: dict) -> int:
    """The output's height and width when they are equal, else -1 (the chain stays square)."""
    sides = set()
    for axis in (0, 1):
        stride = attrs.get("strides", [1, 1])[axis]
        if "auto_pad" in attrs:
            sides.add(-(-size // stride))
            continue
        span = attrs.get("dilations", [1, 1])[axis] * (k - 1) + 1
        pads = attrs.get("pads", [0] * 4)
        sides.add((size + pads[axis] + pads[axis + 2] - span) // stride + 1)
    return sides.pop() if len(sides) == 1 else -1


def to_float16(g: GraphBuilder, name: str) -> None:
    for i, t in enumerate(g.inits):
        if t.name == name and t.data_type == TensorProto.FLOAT:
            array = onnx.numpy_helper.to_array(t).astype(np.float16)
            g.inits[i] = onnx.numpy_helper.from_array(array, name)


def drop_initializer(g: GraphBuilder, name: str) -> tuple:
    """Turn a constant into a graph input of the same shape; returns the shape."""
    (t,) = [t for t in g.inits if t.name == name]
    g.inits.remove(t)
    return tuple(t.dims)


# ---- other nodes between blocks --------------------------------------------------------------
def plain(draw, g: GraphBuilder, x: Tensor) -> Block:
    """Nodes no rule fuses: the graph around the patterns (no activation an epilogue takes, no
    Add a residual could be: its other input reads x, inside the chain)."""
    if draw(st.sampled_from(["softsign", "residual"])) == "softsign":
        return Block(Tensor(g.node("Softsign", [x.name]), x.channels, x.size))
    return Block(Tensor(g.node("Add", [x.name, g.node("Abs", [x.name])]), x.channels, x.size))


def max_pool(draw, g: GraphBuilder, x: Tensor) -> Block:
    """A lone MaxPool (MaxPool2D): padded 2x2 stride 1, or SqueezeNet's 3x3 stride 2 ceil_mode
    (whose size rule drops a last window that would start past the image)."""
    if x.size < 3 or draw(st.booleans()):
        y = g.node("MaxPool", [x.name], kernel_shape=[2, 2], pads=[1, 1, 1, 1], strides=[1, 1])
        size = x.size + 1
    else:
        y = g.node("MaxPool", [x.name], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
        size = -(-(x.size - 3) // 2) + 1
        size -= (size - 1) * 2 >= x.size
    return Block(Tensor(y, x.channels, size), fused=y.removesuffix("_out"), rule="MaxPool2D")


Generator = Callable[..., Block]
FAMILIES: dict[str, Generator] = {"ConvBiasRelu": conv_bias_relu, "MaxPool2D": max_pool}
OTHERS: list[Generator] = [plain]


@st.composite
def models(draw):
    """(model, {fused node name: rule}, batch size to run with)."""
    opset = draw(st.sampled_from([11, 13, 17, 18]))
    g = GraphBuilder(opset=opset, seed=draw(st.integers(0, 2**16)))
    channels, size = draw(st.sampled_from([1, 2, 4])), draw(st.integers(3, 8))
    batch = draw(st.sampled_from(["N", 1, 2]))
    x = Tensor("x", channels, size)
    generators = list(FAMILIES.values()) + OTHERS
    expected, outputs, inputs = {}, [], {"x": [batch, channels, size, size]}
    for _ in range(draw(st.integers(1, 4))):
        block = draw(st.sampled_from(generators))(draw, g, x)
        if block.fused:
            expected[block.fused] = block.rule
        outputs += block.outputs
        inputs.update(block.inputs)
        x = block.out
    model = g.model(inputs, [x.name, *outputs])
    return model, expected, batch if isinstance(batch, int) else draw(st.sampled_from([1, 3]))
