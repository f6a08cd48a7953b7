"""act(t): the activation a fused epilogue applies, in every form exporters write it.

    relu          Relu(t)
    clip          Clip(t, lo, hi)                 bounds as inputs (opset >= 11) or attributes
    leaky_relu    LeakyRelu(t, alpha)
    sigmoid       Sigmoid(t)
    silu          t * Sigmoid(t)                  PyTorch SiLU, Keras swish
    hard_sigmoid  HardSigmoid(t, alpha, beta)
    hard_swish    HardSwish(t) = t * HardSigmoid(t, 1/6, 1/2) = t * Relu6(t + 3) / 6
    tanh          Tanh(t)
    gelu          Gelu(t) (opset 20) = t * (1 + erf(t / sqrt 2)) / 2
    gelu_tanh     Gelu(t, approximate="tanh") = t * (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3))) / 2
    elu           Elu(t, alpha)
    selu          Selu(t, alpha, gamma)
    softplus      Softplus(t)
    softsign      Softsign(t)
    identity      t itself (a projection conv), when asked for

The sub-pattern of every entry with an epilogue (convs, linear heads, BatchNorm + act, the
squeeze-excitation gate). `activation(t, prefix)` captures the activation's root node as
`{prefix}act`; `activation_attributes(m, prefix)` reads back what the kernels' one activation
table takes (kernels/simd/activation.py, encode): the name, alpha, beta and the clip bounds;
`activation_keywords(attrs)` gives them back from a fused node's attributes. `kinds` narrows
the forms (a kernel that only clips: `kinds=("relu", "clip")`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fusion.pattern import Alt, Const, Opt, Pattern, op

KINDS = ("relu", "clip", "leaky_relu", "sigmoid", "silu", "hard_sigmoid", "hard_swish", "tanh",
         "gelu", "gelu_tanh", "elu", "selu", "softplus", "softsign")  # fmt: skip
CLIPPING = ("relu", "clip")  # what a kernel with a clip-only epilogue (kernels/conv2d) applies


def _near(value: float, c) -> str | None:
    ok = c is not None and np.size(c) == 1 and np.allclose(c, value, rtol=1e-4)
    return None if ok else f"{np.asarray(c).tolist()} is not {value:g}"


def near(value: float):
    """A constraint: a constant (or attribute) close to `value` (a partial: rules pickle)."""
    return functools.partial(_near, value)


def _relu6(t: Pattern, prefix: str) -> Pattern:
    """min(max(t, 0), 6): Clip with bounds as inputs or attributes."""
    six = Opt(Const(f"{prefix}act_six", where=near(6.0)))
    return op.Clip(t, Opt(Const(f"{prefix}act_zero", where=near(0.0))), six,
                   _name=f"{prefix}act_relu6")  # fmt: skip


def _forms(t: Pattern, prefix: str) -> dict[str, list[Pattern]]:
    name = f"{prefix}act"
    bounds = Opt(Const(f"{prefix}clip_min")), Opt(Const(f"{prefix}clip_max"))
    # t * relu6(t + 3) / 6, with the 1/6 anywhere in the product
    r6 = _relu6(op.Add(t, Const(f"{prefix}act_three", where=near(3.0))), prefix)
    sixth = Const(f"{prefix}act_sixth", where=near(1 / 6))
    six = Const(f"{prefix}act_div6", where=near(6.0))
    # gelu: t * (1 + erf(t / sqrt 2)) * 0.5, the 0.5 on either factor
    scaled = Alt(op.Div(t, Const(f"{prefix}act_sqrt2", where=near(math.sqrt(2)))),
                 op.Mul(t, Const(f"{prefix}act_rsqrt2", where=near(1 / math.sqrt(2)))))  # fmt: skip
    one_erf = op.Add(op.Erf(scaled, _name=f"{prefix}act_erf"),
                     Const(f"{prefix}act_one", where=near(1.0)))  # fmt: skip
    half = Const(f"{prefix}act_half", where=near(0.5))
    # gelu_tanh: t * (1 + tanh(k (t + c t^3))) * 0.5, the cube as Pow or t t t
    cube = Alt(op.Pow(t, Const(f"{prefix}act_three_p", where=near(3.0))),
               op.Mul(op.Mul(t, t), t))  # fmt: skip
    inner = op.Mul(op.Add(t, op.Mul(cube, Const(f"{prefix}act_c", where=near(0.044715)))),
                   Const(f"{prefix}act_k", where=near(math.sqrt(2 / math.pi))))  # fmt: skip
    one_tanh = op.Add(op.Tanh(inner, _name=f"{prefix}act_tanh"),
                      Const(f"{prefix}act_one_t", where=near(1.0)))  # fmt: skip
    return {
        "relu": [op.Relu(t, _name=name)],
        "clip": [op.Clip(t, *bounds, _name=name)],
        "leaky_relu": [op.LeakyRelu(t, _name=name)],
        "sigmoid": [op.Sigmoid(t, _name=name)],
        "silu": [op.Mul(t, op.Sigmoid(t, _name=f"{prefix}act_sig"), _name=name)],
        "hard_sigmoid": [op.HardSigmoid(t, _name=name)],
        "hard_swish": [
            op.HardSwish(t, _name=name),
            op.Mul(t, op.HardSigmoid(t, alpha=near(1 / 6), beta=near(0.5)), _name=name),
            op.Div(op.Mul(t, r6), six, _name=name),
            op.Mul(t, op.Div(r6, six), _name=name),
            op.Mul(op.Mul(t, r6), sixth, _name=name),
            op.Mul(t, op.Mul(r6, sixth), _name=name),
        ],
        "tanh": [op.Tanh(t, _name=name)],
        "gelu": [
            op.Gelu(t, approximate="none", _name=name),
            op.Mul(op.Mul(t, one_erf), half, _name=name),
            op.Mul(op.Mul(t, half), one_erf, _name=name),
            op.Mul(t, op.Mul(one_erf, half), _name=name),
        ],
        "elu": [op.Elu(t, _name=name)],
        "selu": [op.Selu(t, _name=name)],
        "softplus": [op.Softplus(t, _name=name)],
        "softsign": [op.Softsign(t, _name=name)],
        "gelu_tanh": [
            op.Gelu(t, approximate="tanh", _name=name),
            op.Mul(op.Mul(t, one_tanh), half, _name=name),
            op.Mul(op.Mul(t, half), one_tanh, _name=name),
            op.Mul(t, op.Mul(one_tanh, half), _name=name),
        ],
    }


def activation(t: Pattern, prefix: str = "", kinds=KINDS, identity: bool = False) -> Pattern:
    """act(t) for the activations in `kinds`; with identity, t itself also matches (tried
    last, so an activation after t is taken when there is one)."""
    forms = _forms(t, prefix)
    options = [p for kind in kinds for p in forms[kind]]
    return Alt(*options, *([t] if identity else []))


def activation_kind(m, prefix: str = "") -> str:
    """Which activation a match holds ("identity" when none)."""
    if f"{prefix}act" not in m.node_index:
        return "identity"
    node = m.node(f"{prefix}act")
    by_op = {"Relu": "relu", "Clip": "clip", "LeakyRelu": "leaky_relu", "Sigmoid": "sigmoid",
             "HardSigmoid": "hard_sigmoid", "HardSwish": "hard_swish", "Tanh": "tanh",
             "Gelu": "gelu", "Elu": "elu", "Selu": "selu", "Softplus": "softplus",
             "Softsign": "softsign"}  # fmt: skip
    if node.op_type == "Gelu":
        return "gelu_tanh" if m.attrs(f"{prefix}act").get("approximate") == "tanh" else "gelu"
    if node.op_type in by_op:
        return by_op[node.op_type]
    if f"{prefix}act_sig" in m.node_index:
        return "silu"
    if f"{prefix}act_erf" in m.node_index:
        return "gelu"
    if f"{prefix}act_tanh" in m.node_index:
        return "gelu_tanh"
    return "hard_swish"  # the products with HardSigmoid or Relu6


def activation_attributes(m, prefix: str = "") -> dict:
    """{activation, alpha, beta, clip_min, clip_max} of the matched activation, as
    kernels.simd.activation.encode takes them (alpha, beta: the op's, with ONNX defaults)."""
    kind = activation_kind(m, prefix)
    lo, hi, alpha, beta = -math.inf, math.inf, 0.0, 0.0
    if kind == "clip":
        clip = m.attrs(f"{prefix}act")
        lo, hi = clip.get("min", lo), clip.get("max", hi)  # opset < 11: attributes
        if m.const(f"{prefix}clip_min") is not None:
            lo = m.const(f"{prefix}clip_min")
        if m.const(f"{prefix}clip_max") is not None:
            hi = m.const(f"{prefix}clip_max")
    elif kind in ("leaky_relu", "hard_sigmoid", "elu", "selu"):
        attrs = m.attrs(f"{prefix}act")
        default_alpha = {"leaky_relu": 0.01, "hard_sigmoid": 0.2, "elu": 1.0,
                         "selu": 1.67326319217681884765625}  # fmt: skip
        alpha = attrs.get("alpha", default_alpha[kind])
        beta = {"hard_sigmoid": attrs.get("beta", 0.5),
                "selu": attrs.get("gamma", 1.05070102214813232421875)}.get(kind, 0.0)  # fmt: skip
    return {"activation": kind, "alpha": float(alpha), "beta": float(beta),
            "clip_min": float(lo), "clip_max": float(hi)}  # fmt: skip


def check_relu6(m, prefix: str = "") -> str | None:
    """t * Relu6(t + 3) / 6 needs both Clip bounds (0 and 6), as inputs or attributes."""
    if f"{prefix}act_relu6" not in m.node_index:
        return None
    attrs = m.attrs(f"{prefix}act_relu6")
    lo = m.const(f"{prefix}act_zero")
    hi = m.const(f"{prefix}act_six")
    lo = attrs.get("min") if lo is None else lo
    hi = attrs.get("max") if hi is None else hi
    if lo is None or hi is None or not np.isclose(lo, 0.0) or not np.isclose(hi, 6.0):
        return f"Clip bounds {lo}, {hi} in t * clip(t + 3) / 6 are not 0 and 6 (not hard-swish)"
    return None


def activation_keywords(attrs: dict) -> dict:
    """The activation of a fused node's attributes as the keywords of the kernels' one
    encoding (kernels.simd.activation.encode, which every kernel wrapper that takes an
    activation calls). A node written before alpha and beta existed has only activation,
    clip_min and clip_max: alpha, beta None, which encode reads as the kind's defaults.

    >>> activation_keywords({"activation": "leaky_relu", "alpha": 0.1})["alpha"]
    0.1
    """
    return {
        "activation": attrs.get("activation", "identity"),
        "alpha": attrs.get("alpha"),
        "beta": attrs.get("beta"),
        "clip_min": attrs.get("clip_min", -math.inf),
        "clip_max": attrs.get("clip_max", math.inf),
    }
