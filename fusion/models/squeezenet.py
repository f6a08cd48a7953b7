"""SqueezeNet 1.0 and 1.1 (torchvision's architectures) as PyTorch's exporter writes them.

No download: seeded random weights with He scale (std sqrt(2 / fan_in)), so activations stay
O(1) through the ReLUs, and small random biases. The graph is what `torch.onnx.export` of
`torchvision.models.squeezenet1_x().eval()` gives at opset 17 with a dynamic batch: Conv with
its bias as third input, Relu, MaxPool(3, stride 2, ceil_mode=1), Concat(axis=1) per Fire
module, Dropout folded away (eval), the classifier's 1x1 conv + Relu, GlobalAveragePool (from
AdaptiveAvgPool2d((1, 1))) and Flatten; node names like /features/features.3/squeeze/Conv.

    >>> model = squeezenet("1.1", size=224)            # input [batch_size, 3, 224, 224]
    >>> fire_modules("1.1")[0]
    ('features.3', 64, 16, 64, 64)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from fusion.models.builder import GraphBuilder

# (layer index, kind, args): "conv" (out, kernel, stride), "pool", "fire" (squeeze, e1x1, e3x3)
FEATURES = {
    "1.0": [
        (0, "conv", (96, 7, 2)), (2, "pool", ()),
        (3, "fire", (16, 64, 64)), (4, "fire", (16, 64, 64)), (5, "fire", (32, 128, 128)),
        (6, "pool", ()),
        (7, "fire", (32, 128, 128)), (8, "fire", (48, 192, 192)), (9, "fire", (48, 192, 192)),
        (10, "fire", (64, 256, 256)),
        (11, "pool", ()),
        (12, "fire", (64, 256, 256)),
    ],
    "1.1": [
        (0, "conv", (64, 3, 2)), (2, "pool", ()),
        (3, "fire", (16, 64, 64)), (4, "fire", (16, 64, 64)),
        (5, "pool", ()),
        (6, "fire", (32, 128, 128)), (7, "fire", (32, 128, 128)),
        (8, "pool", ()),
        (9, "fire", (48, 192, 192)), (10, "fire", (48, 192, 192)), (11, "fire", (64, 256, 256)),
        (12, "fire", (64, 256, 256)),
    ],
}  # fmt: skip
CLASSES = 1000


def fire_modules(version: str = "1.1") -> list[tuple[str, int, int, int, int]]:
    """(name, in channels, squeeze, expand 1x1, expand 3x3) of each Fire module."""
    out, channels = [], 3
    for index, kind, args in FEATURES[version]:
        if kind == "conv":
            channels = args[0]
        elif kind == "fire":
            out.append((f"features.{index}", channels, *args))
            channels = args[1] + args[2]
    return out


class _Exporter(GraphBuilder):
    """Writes nodes, initializers and value names the way torch.onnx.export names them."""

    def scoped(self, op_type: str, scope: str, inputs: list[str], **attrs) -> str:
        return self.node(op_type, inputs, name=f"{scope}/{op_type}", **attrs)

    def conv_relu(self, x: str, module: str, act: str, cin: int, cout: int, k: int, s=1, p=0):
        fan_in = cin * k * k
        w = self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / fan_in)
        b = self.rng.standard_normal(cout) * 0.05
        self.const(w.astype(np.float32), f"{module}.weight")
        self.const(b.astype(np.float32), f"{module}.bias")
        y = self.scoped(
            "Conv",
            _scope(module),
            [x, f"{module}.weight", f"{module}.bias"],
            dilations=[1, 1],
            group=1,
            kernel_shape=[k, k],
            pads=[p] * 4,
            strides=[s, s],
        )
        return self.scoped("Relu", _scope(act), [y])


def _scope(module: str) -> str:
    """features.3.squeeze -> /features/features.3/squeeze (the exporter's module path)."""
    path, prefix = [], ""
    for part in module.split("."):
        path.append(f"{prefix}.{part}" if part.isdigit() else part)
        prefix = f"{prefix}.{part}" if prefix else part
    return "/" + "/".join(path)


def squeezenet(
    version: str = "1.1",
    size: int = 224,
    batch: int | str = "batch_size",
    classes: int = CLASSES,
    opset: int = 17,
    seed: int = 0,
) -> onnx.ModelProto:
    """SqueezeNet `version` ("1.0" or "1.1") on a [batch, 3, size, size] input."""
    if version not in FEATURES:
        raise ValueError(f"unknown SqueezeNet version {version!r} (1.0 or 1.1)")
    ex = _Exporter(opset, seed)
    x, channels = "input", 3
    for index, kind, args in FEATURES[version]:
        layer = f"features.{index}"
        if kind == "conv":
            cout, k, s = args
            x = ex.conv_relu(x, layer, f"features.{index + 1}", channels, cout, k, s)
            channels = cout
        elif kind == "pool":
            x = ex.scoped(
                "MaxPool", _scope(layer), [x], ceil_mode=1, kernel_shape=[3, 3], pads=[0] * 4,
                strides=[2, 2],
            )  # fmt: skip
        else:
            sq, e1, e3 = args
            s = ex.conv_relu(x, f"{layer}.squeeze", f"{layer}.squeeze_activation", channels, sq, 1)
            a = ex.conv_relu(s, f"{layer}.expand1x1", f"{layer}.expand1x1_activation", sq, e1, 1)
            b = ex.conv_relu(
                s, f"{layer}.expand3x3", f"{layer}.expand3x3_activation", sq, e3, 3, p=1
            )
            x = ex.scoped("Concat", _scope(layer), [a, b], axis=1)
            channels = e1 + e3
    x = ex.conv_relu(x, "classifier.1", "classifier.2", channels, classes, 1)
    x = ex.scoped("GlobalAveragePool", _scope("classifier.3"), [x])
    ex.nodes.append(helper.make_node("Flatten", [x], ["output"], "/Flatten", axis=1))
    model = ex.model({"input": [batch, 3, size, size]}, {"output": [batch, classes]})
    model.ir_version = 8  # what torch 2.x writes at opset 17
    model.producer_name, model.producer_version = "pytorch", "2.1.0"
    return model


def squeezenet_flops(version: str = "1.1", size: int = 224, batch: int = 1) -> dict[str, int]:
    """Multiply-adds x 2 per Fire module (by name) and in total, for GFLOP/s figures."""
    model = onnx.shape_inference.infer_shapes(squeezenet(version, size, batch=batch))
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in model.graph.value_info}  # fmt: skip
    inits = {t.name: t.dims for t in model.graph.initializer}
    flops: dict[str, int] = {"total": 0}
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        m, c, kh, kw = inits[node.input[1]]
        n, _, oh, ow = shapes[node.output[0]]
        f = 2 * n * m * c * kh * kw * oh * ow
        flops["total"] += f
        parts = node.name.split("/")
        if len(parts) > 3 and parts[2].startswith("features."):  # a Fire module's conv
            key = parts[2]
            flops[key] = flops.get(key, 0) + f
    return flops
