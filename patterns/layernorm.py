"""LayerNorm:      y = (x - mean(x)) / sqrt(var(x) + eps) * g + b      over the last axis
SkipLayerNorm:  s = x + r,  y = LayerNorm(s)                          (outputs y and s)
RMSNorm:        y = x / sqrt(mean(x^2) + eps) * g                     (Llama, T5)

LayerNorm is the LayerNormalization op (opset 17) or its primitive form (ReduceMean, Sub, Pow
or Mul, ReduceMean, Add eps, Sqrt, Div or Reciprocal + Mul, then scale and shift). RMSNorm is
only ever primitive: Pow(x, 2) or x * x, ReduceMean, Add eps, Sqrt, then Div, or Mul by
Reciprocal or by 1 / sqrt; Llama's float32 Casts around it (identities in float32) fold in.
"""

from __future__ import annotations

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion_patterns.linear_gelu import near


def float_cast(v):
    """v, or Cast(v, to=float): the identity an fp16-ready export writes around a norm."""
    return Alt(op.Cast(v, to=1), v)


def mean_last(v, name):
    """ReduceMean over the last axis, keepdims: axes as attribute (opset < 18) or input."""
    return op.ReduceMean(v, Opt(Const(f"{name}_axes")), keepdims=1, _name=name)


def inv_scale(v, std):
    """v / std, v * (1 / std) or v * Reciprocal(std)."""
    return Alt(op.Div(v, std), op.Mul(v, op.Reciprocal(std)),
               op.Mul(v, op.Div(Const("one", where=near(1.0)), std)))  # fmt: skip


def square(v):
    return Alt(op.Pow(v, Const("two", where=near(2.0))), op.Mul(v, v))


def primitive_layer_norm(x):
    d = op.Sub(x, mean_last(x, "mean"))
    std = op.Sqrt(op.Add(mean_last(square(d), "var"), Const("eps")))
    scaled = op.Mul(inv_scale(d, std), Const("gamma"), _name="scale")
    return Alt(op.Add(scaled, Const("beta")), scaled)


def layer_norm(x):
    return Alt(op.LayerNormalization(x, Const("gamma"), Opt(Const("beta")), _name="ln"),
               primitive_layer_norm(x))  # fmt: skip


def rms_norm(x):
    xc = float_cast(x)
    std = op.Sqrt(op.Add(mean_last(square(xc), "var"), Const("eps")))
    return op.Mul(float_cast(inv_scale(xc, std)), Const("gamma"), _name="scale")


def last_axis_only(m, x: str = "x") -> str | None:
    """Why the match does not normalize over the last axis only, if it does not."""
    rank = m.type(x).rank if m.type(x) is not None else None
    if "ln" in m.node_index:
        axis = m.attrs("ln")["axis"]
        if axis != -1 and (rank is None or axis != rank - 1):
            return f"LayerNormalization axis={axis}: kernels normalize the last axis only"
    for name in ("mean", "var"):
        if name not in m.node_index:
            continue
        axes = m.const(f"{name}_axes")
        axes = list(axes.reshape(-1)) if axes is not None else m.attrs(name).get("axes")
        if (
            axes is None
            or len(axes) != 1
            or axes[0] not in (-1, None if rank is None else rank - 1)
        ):
            return f"ReduceMean over axes {axes}: kernels normalize the last axis only"
    for name in ("gamma", "beta"):
        value = m.const(name)
        if value is not None and sum(d > 1 for d in value.shape) > 1:
            return f"{name} of shape {list(value.shape)} is not a vector over the last axis"
    return None


def attributes(m) -> dict:
    eps = m.attrs("ln")["epsilon"] if "ln" in m.node_index else float(m.const("eps").reshape(-1)[0])
    return {"epsilon": float(eps)}


def row_tactics(run_with):
    """The kernel run_with(None) (rows in parallel from kernels/layernorm.py's SERIAL_MAX values
    on, a threshold measured on one CPU), with tactics that time both drivers on the node's
    shape: "rows" (that default), "rows-parallel", "rows-serial"."""
    run = run_with(None)
    run.tactics = [Tactic("rows", run), Tactic("rows-parallel", run_with(True)),
                   Tactic("rows-serial", run_with(False))]  # fmt: skip
    return run


def make_kernel(attrs: dict, constants: list, rms: bool = False):
    """LayerNorm (or RMSNorm) of x with g (and b)."""
    from fusion_kernels.layernorm import layer_norm as norm  # heavy (Numba): at build time

    eps = attrs["epsilon"]

    def run_with(parallel):
        def run(x, g, b=None):
            return (norm(x, g, None if rms else b, eps, rms=rms, parallel=parallel),)

        return run

    return row_tactics(run_with)


def make_rms_kernel(attrs: dict, constants: list):
    return make_kernel(attrs, constants, rms=True)


def make_skip_kernel(attrs: dict, constants: list):
    """LayerNorm of x + r, and x + r."""
    from fusion_kernels.layernorm import layer_norm as norm  # heavy (Numba): at build time

    eps = attrs["epsilon"]

    def run_with(parallel):
        def run(x, r, g, b=None):
            return norm(x, g, b, eps, residual=r, return_sum=True, parallel=parallel)

        return run

    return row_tactics(run_with)


x, r = Var("x", dtype="float32"), Var("residual", dtype="float32")
SHARED = dict(attributes=attributes, check=last_axis_only, explain_after="ReduceMean")
RULES = [
    Rule(
        "SkipLayerNorm",
        Alt(layer_norm(op.Add(x, r, _name="skip")), name="ln_out"),
        inputs=("x", "residual", "gamma", "beta"),
        outputs=("ln_out", "skip"),
        prepare=make_skip_kernel,
        **SHARED,
        priority=-12,
        description="Add + LayerNorm (the op or primitives) over the last axis; outputs y, x + r",
    ),
    Rule(
        "LayerNorm",
        layer_norm(x),
        inputs=("x", "gamma", "beta"),
        prepare=make_kernel,
        **SHARED,
        priority=-13,
        description="LayerNormalization or ReduceMean/Sub/Pow/Sqrt/Div over the last axis",
    ),
    Rule(
        "RMSNorm",
        rms_norm(x),
        inputs=("x", "gamma"),
        prepare=make_rms_kernel,
        **SHARED,
        priority=-13,
        description="x / sqrt(mean(x^2) + eps) * g (Div, Reciprocal or 1/sqrt; Casts folded)",
    ),
]
