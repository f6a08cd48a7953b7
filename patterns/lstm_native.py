"""LSTMOp:  the ONNX LSTM op,  Y, Y_h, Y_c = LSTM(X, W, R, B, -, initial_h, initial_c)

    [i o f c] = X_t W^T + H_{t-1} R^T + Wb + Rb,   C_t = f C_{t-1} + i c,   H_t = o tanh(C_t)

One op, run on the project's sequence kernel (kernels/lstm.py) with its weights repacked once
into the kernel's gate order i, f, g, o: forward, reverse (the kernel runs the reversed
sequence) and bidirectional (one plan per direction), initial states given or zero. What the
kernel does not do is refused with a reason: sequence_lens, peepholes (P), clip, input_forget,
activations other than Sigmoid/Tanh/Tanh, layout 1 (which onnxruntime does not run, so
nothing could check the kernel against it).
A single op is no pattern of several nodes, so the rule has a finder anchored on LSTM; its
outputs are the op's present ones (`present` records which). With one direction, the
Unsqueeze of the initial states and the Squeeze of the outputs around it (PyTorch's export)
fold in, so the session runs it as one kernel call with no onnxruntime island.
"""

from __future__ import annotations

import numpy as np
import onnx

from fusion.catalog import Rule
from fusion.graph import GraphView
from fusion.matcher import Match
from fusion_patterns.rnn_steps import native_matches, shaped_outputs

INPUTS = ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")
FUSED_INPUTS = ("X", "initial_h", "initial_c", "W", "R", "B")
ONNX_TO_IFGO = [0, 2, 3, 1]  # ONNX's gate blocks i, o, f, c -> the kernel's i, f, g, o
DEFAULT_ACTIVATIONS = ["Sigmoid", "Tanh", "Tanh"]
STATES = ("initial_h", "initial_c")


def refusal(view: GraphView, node: onnx.NodeProto) -> str | None:
    """Why the kernel cannot run this LSTM node, if it cannot."""
    attrs = view.attributes(node)
    inputs = dict(zip(INPUTS, node.input, strict=False))
    dirs = 2 if attrs.get("direction", "forward") == "bidirectional" else 1
    for name in ("sequence_lens", "P"):
        if inputs.get(name):
            return f"{name} given: the kernel runs every sequence to its full length, no peepholes"
    if attrs.get("clip") is not None:
        return f"clip={attrs['clip']}: the kernel does not clip the cell input"
    if attrs.get("input_forget", 0):
        return "input_forget=1: the kernel has a separate forget gate"
    activations = attrs.get("activations")
    if activations is not None and [a.lower() for a in activations] != [
        a.lower() for a in DEFAULT_ACTIVATIONS * dirs
    ]:
        return f"activations {list(activations)}: the kernel runs Sigmoid, Tanh, Tanh"
    if attrs.get("activation_alpha") or attrs.get("activation_beta"):
        return "activation_alpha/beta given: the kernel's activations take no parameters"
    if attrs.get("layout", 0) != 0:
        return "layout=1 (batch first): onnxruntime, the oracle, does not run it either"
    x = view.type_of(node.input[0])
    if x is None or x.elem_type != onnx.TensorProto.FLOAT:
        return f"X is {x.dtype_name if x else 'of unknown type'}, kernels are float32-only"
    for name in ("W", "R", "B"):
        if inputs.get(name) and view.constant(inputs[name]) is None:
            return f"{name} is not a constant"
    return None


def find(view: GraphView, index: int) -> list[Match] | str:
    return refusal(view, view.nodes[index]) or native_matches(
        view, index, "lstm", INPUTS, FUSED_INPUTS, STATES, (1, 0, 0)
    )


def attributes(m: Match) -> dict:
    """direction; present: which of Y, Y_h, Y_c exist; squeezed: which of them are the Squeeze
    after them and unsqueezed: which initial states the Unsqueeze before them (fold_native)."""
    attrs = m.attrs("lstm")
    node = m.node("lstm")
    outputs = [v for v in node.output if v]
    return {
        "direction": attrs.get("direction", "forward"),
        "present": [int(bool(v)) for v in (list(node.output) + ["", "", ""])[:3]],
        "squeezed": [int(v not in outputs) for v in m["outputs"]],
        "unsqueezed": [
            int(bool(m[k]) and m[k] not in node.input) for k in ("initial_h", "initial_c")
        ],
    }


def onnx_weights(w, r, b, direction: int, hidden: int):
    """(Wx [I, 4H], Wh [H, 4H], bias [4H]) in the kernel's gate order, of one direction of the
    ONNX LSTM's W [D, 4H, I], R [D, 4H, H], B [D, 8H] (or None)."""
    cols = np.concatenate([np.arange(k * hidden, (k + 1) * hidden) for k in ONNX_TO_IFGO])
    bias = np.zeros(4 * hidden, np.float32) if b is None else b[direction, : 4 * hidden]
    bias = bias + (0 if b is None else b[direction, 4 * hidden :])
    return w[direction][cols].T, r[direction][cols].T, bias[cols]


def make_kernel(attrs: dict, constants: list):
    """Pack each direction's weights once; the returned function runs the whole op."""
    from fusion_kernels.lstm import lstm_sequence, prepare_lstm  # heavy (Numba): only when built

    w, r, b = (list(constants) + [None] * 6)[3:6]
    hidden, dirs = r.shape[-1], r.shape[0]
    plans = [prepare_lstm(*onnx_weights(w, r, b, d, hidden)) for d in range(dirs)]
    reverse = attrs["direction"] == "reverse"
    wanted, squeezed = attrs["present"], attrs.get("squeezed", [0, 0, 0])
    unsqueezed = attrs.get("unsqueezed", [0, 0])

    def run(x, h0=None, c0=None, *_weights):
        h0 = h0[None] if h0 is not None and unsqueezed[0] else h0
        c0 = c0[None] if c0 is not None and unsqueezed[1] else c0
        zeros = np.zeros((x.shape[1], hidden), np.float32)
        ys, hn, cn = [], [], []
        for d, plan in enumerate(plans):
            backward = reverse or d == 1
            xd = x[::-1] if backward else x
            hs, cs = lstm_sequence(
                xd, zeros if h0 is None else h0[d], zeros if c0 is None else c0[d], plan
            )
            ys.append(hs[::-1] if backward else hs)
            hn.append(hs[-1] if len(hs) else (zeros if h0 is None else h0[d]))
            cn.append(cs[-1] if len(cs) else (zeros if c0 is None else c0[d]))
        return shaped_outputs(ys, [hn, cn], wanted, squeezed)

    return run


RULE = Rule(
    "LSTMOp",
    None,
    inputs=("X", "initial_h", "initial_c", "W", "R", "B"),
    outputs=("outputs",),
    prepare=make_kernel,
    attributes=attributes,
    finder=find,
    anchor_ops=("LSTM",),
    priority=10,
    description="the ONNX LSTM op (any direction) on the LSTM sequence kernel",
)
