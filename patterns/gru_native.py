"""GRUOp:  the ONNX GRU op,  Y, Y_h = GRU(X, W, R, B, -, initial_h)

    [z r h] blocks:  z, r = sig(.),  n = tanh(X_t Wh + Wbh + r (H_{t-1} Rh + Rbh)),
    H_t = (1 - z) n + z H_{t-1}            (linear_before_reset = 1, as PyTorch exports nn.GRU)

One op on the sequence kernels (kernels/gru.py), linear_before_reset 1 or 0 (n = tanh(X Wh +
(r H) Rh + Wbh + Rbh)): forward, reverse and bidirectional, initial state given or zero.
Refused with a reason: sequence_lens, clip, activations other than Sigmoid/Tanh, layout 1
(onnxruntime does not run it, so nothing could check the kernel against it).
"""

from __future__ import annotations

import numpy as np
import onnx

from fusion.catalog import Rule
from fusion.graph import GraphView
from fusion.matcher import Match
from fusion_patterns.rnn_steps import native_matches, shaped_outputs

INPUTS = ("X", "W", "R", "B", "sequence_lens", "initial_h")


def refusal(view: GraphView, node: onnx.NodeProto) -> str | None:
    """Why the kernel cannot run this GRU node, if it cannot."""
    attrs = view.attributes(node)
    dirs = 2 if attrs.get("direction", "forward") == "bidirectional" else 1
    if len(node.input) > 4 and node.input[4]:
        return "sequence_lens given: the kernel runs every sequence to its full length"
    if attrs.get("clip") is not None:
        return f"clip={attrs['clip']}: the kernel does not clip"
    activations = attrs.get("activations")
    if activations is not None and [a.lower() for a in activations] != ["sigmoid", "tanh"] * dirs:
        return f"activations {list(activations)}: the kernel runs Sigmoid, Tanh"
    if attrs.get("activation_alpha") or attrs.get("activation_beta"):
        return "activation_alpha/beta given: the kernel's activations take no parameters"
    if attrs.get("layout", 0) != 0:
        return "layout=1 (batch first): onnxruntime, the oracle, does not run it either"
    x = view.type_of(node.input[0])
    if x is None or x.elem_type != onnx.TensorProto.FLOAT:
        return f"X is {x.dtype_name if x else 'of unknown type'}, kernels are float32-only"
    for name, value in zip(INPUTS[1:4], node.input[1:4], strict=False):
        if value and view.constant(value) is None:
            return f"{name} is not a constant"
    return None


def find(view: GraphView, index: int) -> list[Match] | str:
    fused = ("X", "initial_h", "W", "R", "B")
    return refusal(view, view.nodes[index]) or native_matches(
        view, index, "gru", INPUTS, fused, ("initial_h",), (1, 0)
    )


def attributes(m: Match) -> dict:
    """As LSTMOp's (patterns/lstm_native.py)."""
    node = m.node("gru")
    outputs = [v for v in node.output if v]
    return {
        "direction": m.attrs("gru").get("direction", "forward"),
        "linear_before_reset": int(m.attrs("gru").get("linear_before_reset", 0)),
        "present": [int(bool(v)) for v in (list(node.output) + ["", ""])[:2]],
        "squeezed": [int(v not in outputs) for v in m["outputs"]],
        "unsqueezed": int(bool(m["initial_h"]) and m["initial_h"] not in node.input),
    }


def make_kernel(attrs: dict, constants: list):
    """Pack each direction's weights once; the returned function runs the whole op."""
    from fusion_kernels.gru import gru_sequence, prepare_gru  # heavy (Numba): only when built

    w, r, b = (list(constants) + [None] * 5)[2:5]
    hidden, dirs = r.shape[-1], r.shape[0]
    bias = np.zeros((dirs, 6 * hidden), np.float32) if b is None else b
    lbr = attrs.get("linear_before_reset", 1)
    plans = [
        prepare_gru(w[d].T, r[d].T, bias[d, : 3 * hidden], bias[d, 3 * hidden :], lbr)
        for d in range(dirs)
    ]
    reverse, wanted = attrs["direction"] == "reverse", attrs["present"]
    squeezed, unsqueezed = attrs.get("squeezed", [0, 0]), attrs.get("unsqueezed", 0)

    def run(x, h0=None, *_weights):
        h0 = h0[None] if h0 is not None and unsqueezed else h0
        zeros = np.zeros((x.shape[1], hidden), np.float32)
        ys, hn = [], []
        for d, plan in enumerate(plans):
            backward = reverse or d == 1
            start = zeros if h0 is None else h0[d]
            hs = gru_sequence(x[::-1] if backward else x, start, plan)
            ys.append(hs[::-1] if backward else hs)
            hn.append(hs[-1] if len(hs) else start)
        return shaped_outputs(ys, [hn], wanted, squeezed)

    return run


RULE = Rule(
    "GRUOp",
    None,
    inputs=("X", "initial_h", "W", "R", "B"),
    outputs=("outputs",),
    prepare=make_kernel,
    attributes=attributes,
    finder=find,
    anchor_ops=("GRU",),
    priority=10,
    description="the ONNX GRU op (any direction, linear_before_reset 0 or 1) on its kernels",
)
