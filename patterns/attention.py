"""Attention:  y = concat_h(softmax(s Q_h K_h^T + M) V_h) Wo + bo (+ r),  Q = x Wq + bq, ...

as Hugging Face's attention exports, eager or sdpa (torch's scaled_dot_product_attention,
transformers' default), from BERT, DistilBERT, GPT-2 (TorchScript and dynamo):
Q, K, V as three linears of one x, or one linear cut by Split (GPT-2's c_attn); each reshaped
to [B, S, H, D] and transposed to heads. K^T straight to [B, H, D, S], or heads transposed
again, or (dynamo's sdpa) heads flattened to [B H, S, D], transposed in 3-D and unflattened.
The scale s as Mul or Div, on the product, on Q, or split as sqrt(s) on Q and on K^T (sdpa);
an additive mask M (any value: padding, causal or both, built once per model and shared by
the layers; sdpa's boolean mask made additive by Where(m, 0, -inf) is such a value);
Softmax on the last axis, then sdpa's guard Where(IsNaN(p), 0, p), which turns the NaN rows
of queries with every key masked into zeros (one or two Casts to float after it fold in); times V;
an optional no-op Reshape of the heads' output (TorchScript's sdpa: [B, -1, S, D]); heads
merged by Transpose + Reshape; the output linear; an optional residual Add. Every linear is
patterns/linear.py's linear_nd.

The head size comes from the head Reshape's shape: its last entry must be a constant (the
exporters write [B, S, -1, D] or [B, S, H, D] with D constant). The shapes themselves are
fused inputs the kernel ignores; where TorchScript reads them from values inside the match
(Shape of the Split's outputs), the rule absorbs those shape computations (Rule.absorb_shapes).
The reshapes that only regroup the heads (the flattened K^T, the no-op Reshape) are checked
entry by entry: each target entry must be the size of the right axis of a head tensor of the
match (fusion.shapes.shape_entries), so the match is the same computation at every shape.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion.shapes import shape_entries
from patterns.linear import (
    check_linear,
    linear_attributes,
    linear_inputs,
    linear_nd,
    linear_params,
    onnx_reshape,
)
from patterns.linear_gelu import residual_follows

PROJECTIONS = ("q", "k", "v", "qkv", "o")
LINEARS = tuple(
    name for p in PROJECTIONS for name in (*linear_inputs(f"W{p}", p), f"{p}_flat", f"{p}_unflat")
)
SHAPES = ("q_shape", "k_shape", "v_shape", "merge_shape", "kt_flat_shape", "kt_shape",
          "ctx_shape")  # fmt: skip
SCALES = ("scale", "q_scale", "k_scale")


def last_axis(axis) -> str | None:
    return None if axis in (-1, 3) else f"axis={axis}, attention's Softmax is over the keys"


def heads(v, tag: str, perm, name: str | None = None):
    return op.Transpose(op.Reshape(v, Var(f"{tag}_shape"), _name=f"{tag}_heads"), perm=perm,
                        _name=name)  # fmt: skip


def scaled(v, name: str):
    """v * s or v / s (captured as `{name}_mul` / `{name}_div`), or v unscaled."""
    return Alt(op.Mul(v, Const(f"{name}_mul")), op.Div(v, Const(f"{name}_div")), v)


def transposed_keys(k):
    """K^T per head, [B, H, D, S]: one Transpose of the [B, S, H, D] keys; heads [B, H, S, D]
    then their last two axes swapped; or heads flattened to [B H, S, D], swapped in 3-D and
    unflattened (dynamo's sdpa)."""
    flat = op.Reshape(heads(k, "k", [0, 2, 1, 3], "k_t"), Var("kt_flat_shape"))
    return Alt(heads(k, "k", [0, 2, 3, 1]),
               op.Transpose(heads(k, "k", [0, 2, 1, 3]), perm=[0, 1, 3, 2]),
               op.Reshape(op.Transpose(flat, perm=[0, 2, 1]), Var("kt_shape")))  # fmt: skip


def core(q, k, v):
    """The attention of projections q, k, v ([B, S, H*D] each) with the output linear."""
    q_heads = scaled(heads(q, "q", [0, 2, 1, 3], "q_t"), "q_scale")
    k_t = scaled(transposed_keys(k), "k_scale")
    scores = scaled(op.MatMul(q_heads, k_t, _name="qk"), "scale")
    masked = Alt(op.Add(scores, Var("mask", dtype="float32"), _name="mask_add"), scores)
    probs = op.Softmax(masked, axis=last_axis, _name="softmax")
    guarded = Alt(op.Where(op.IsNaN(probs), Const("nan_fill"), probs, _name="nan_guard"), probs)
    as_float = Alt(op.Cast(op.Cast(guarded, to=1), to=1), op.Cast(guarded, to=1), guarded)
    context = op.MatMul(as_float, heads(v, "v", [0, 2, 1, 3], "v_t"),
                        _name="context")  # fmt: skip
    regrouped = Alt(op.Reshape(context, Var("ctx_shape")), context)
    merged = op.Reshape(op.Transpose(regrouped, perm=[0, 2, 1, 3]), Var("merge_shape"))
    out = linear_nd(merged, "Wo", "o")
    return Alt(op.Add(out, Var("residual", dtype="float32"), _name="residual_add"), out)


def pattern():
    x = Var("x", dtype="float32", rank=3)
    separate = (linear_nd(x, f"W{p}", p) for p in "qkv")
    split = op.Split(linear_nd(x, "Wqkv", "qkv"), Opt(Const("qkv_sizes")), _name="qkv_split")
    return Alt(core(*separate), core(split[0], split[1], split[2]))


def shape_tail(view, value: str) -> list | None:
    """The entries of a 1-D shape tensor, None where not constant; None if unknown. Reads a
    constant, or a Concat of constants and computed scalars (the exporters' [B, S, -1, D])."""
    const = view.constant(value)
    if const is not None:
        return [int(d) for d in const.reshape(-1)]
    producer = view.producer.get(value)
    if producer is None or view.nodes[producer[0]].op_type != "Concat":
        return None
    dims: list = []
    for part in view.nodes[producer[0]].input:
        part_const = view.constant(part)
        vt = view.type_of(part)
        if part_const is not None:
            dims += [int(d) for d in part_const.reshape(-1)]
        elif vt is not None and vt.shape is not None and vt.shape in ((1,), ()):
            dims.append(None)
        else:
            return None
    return dims


def widths(m) -> dict:
    """Output columns of the Q, K, V products."""
    if "qkv_split" in m.node_index:
        n = _columns(m, "qkv")
        return {"q": n // 3, "k": n // 3, "v": n // 3}
    return {p: _columns(m, p) for p in "qkv"}


def _columns(m, p: str) -> int:
    trans = linear_attributes(m, p)[f"{p}_linear"][0]
    return m.const(f"W{p}").shape[0 if trans else 1]


def head_dim(m) -> int | str:
    dims = shape_tail(m.view, m["q_shape"])
    if not dims or len(dims) != 4 or not dims[3] or dims[3] < 1:
        return f"the head Reshape's shape {dims} does not end in a constant head size"
    return dims[3]


def scale(m) -> float:
    s = 1.0
    for name in SCALES:
        if m[f"{name}_mul"] is not None:
            s *= float(np.reshape(m.const(f"{name}_mul"), -1)[0])
        if m[f"{name}_div"] is not None:
            s /= float(np.reshape(m.const(f"{name}_div"), -1)[0])
    return s


def check(m) -> str | None:
    for p in ("qkv",) if "qkv_split" in m.node_index else ("q", "k", "v"):
        reason = check_linear(m, f"W{p}", p)
        if reason:
            return reason
    reason = check_linear(m, "Wo", "o") or residual_follows(m, "o")
    if reason:
        return reason
    for name in (f"{s}_{how}" for s in SCALES for how in ("mul", "div")):
        if m[name] is not None and m.const(name).size != 1:
            return f"the scale {m[name]} is not a scalar"
    if m["nan_fill"] is not None:
        fill = m.const("nan_fill")
        if fill.size != 1 or float(fill.reshape(-1)[0]) != 0.0:
            return f"the Softmax's NaN guard fills {fill.reshape(-1)[:4]}, not 0"
    if "qkv_split" in m.node_index:
        split = m.node("qkv_split")
        sizes = m.const("qkv_sizes") if m["qkv_sizes"] else m.attrs("qkv_split").get("split")
        axis = m.attrs("qkv_split")["axis"]
        unequal = sizes is not None and len(set(list(sizes))) > 1
        if axis not in (-1, 2) or len(split.output) != 3 or unequal:
            return "the Split must cut Q, K, V into three equal parts of the last axis"
    d = head_dim(m)
    if isinstance(d, str):
        return d
    reason = regrouping(m, d)
    if reason:
        return reason
    w = widths(m)
    if w["q"] % d or w["k"] % d or w["k"] != w["v"] or (w["q"] // d) % (w["k"] // d):
        return f"Q, K, V widths {w['q']}, {w['k']}, {w['v']} do not form heads of {d}"
    if m.const("residual") is not None:
        return f"{m['residual']} is a constant: a bias, not a residual"
    mask = m.type("mask")
    if mask is not None and mask.rank is not None and mask.rank > 4:
        return f"the mask has rank {mask.rank}, more than [batch, heads, queries, keys]"
    return None


def _target(m, name: str, want: list, constants: dict) -> str | None:
    """Why Reshape target `name` is not `want` (entry k: one of want[k], (tensor, axis) pairs
    or -1, or the number constants[k]), else None."""
    got = shape_entries(m.view, m[name])
    ok = got is not None and len(got) == len(want)
    for k, e in enumerate(got if ok else []):
        ok = ok and (e in want[k] or (k in constants and e == constants[k]))
    return None if ok else f"the Reshape to {got} regroups the heads' values, not only their axes"


def regrouping(m, d: int) -> str | None:
    """The Reshapes between the head tensors must only regroup axes: K^T's flattening to
    [B H, S, D] and back to [B, H, D, S], the heads' output reshaped to itself."""
    if m["kt_shape"] is not None:
        kt = m.node("k_t").output[0]
        flat = [[-1], [(kt, 2)], [(kt, 3)]]
        reason = _target(m, "kt_flat_shape", flat, {2: d})
        unflat = [[(kt, 0), -1], [(kt, 1), -1], [(kt, 3)], [(kt, 2)]]
        reason = reason or _target(m, "kt_shape", unflat, {2: d})
        if reason:
            return reason
    if m["ctx_shape"] is not None:
        q_t, v_t, ctx = (m.node(n).output[0] for n in ("q_t", "v_t", "context"))
        same = [[(t, k) for t in (q_t, v_t, ctx)] for k in range(4)]
        same[1] = [(q_t, 1), (ctx, 1), -1]  # V's axis 1 holds the key/value heads
        heads_ = widths(m)["q"] // d
        return _target(m, "ctx_shape", same, {1: heads_, 3: d})
    return None


def attributes(m) -> dict:
    d = head_dim(m)
    w = widths(m)
    names = ("qkv", "o") if "qkv_split" in m.node_index else ("q", "k", "v", "o")
    linear = {}
    for p in names:
        linear.update(linear_attributes(m, p))
    return {"heads": w["q"] // d, "kv_heads": w["k"] // d, "scale": scale(m),
            "nan_to_zero": int(m["nan_fill"] is not None), **linear}  # fmt: skip


def make_kernel(attrs: dict, constants: list):
    """Concatenate the Q, K, V weights once; the kernel runs the whole block."""
    from kernels.attention import attention  # heavy (Numba): at build time

    named = dict(zip(("x", *LINEARS, *SHAPES, "mask", "residual"), constants, strict=False))
    if "qkv_linear" in attrs:
        w_qkv, b_qkv = linear_params(
            attrs["qkv_linear"], *(named[k] for k in linear_inputs("Wqkv", "qkv"))
        )
    else:
        parts = [linear_params(attrs[f"{p}_linear"], *(named[k] for k in linear_inputs(f"W{p}", p)))
                 for p in "qkv"]  # fmt: skip
        w_qkv = np.ascontiguousarray(np.concatenate([w for w, _ in parts], axis=1))
        b_qkv = np.concatenate([b for _, b in parts])
    w_out, b_out = linear_params(attrs["o_linear"], *(named[k] for k in linear_inputs("Wo", "o")))
    heads_, kv_heads, s = attrs["heads"], attrs["kv_heads"], attrs["scale"]
    nan_to_zero = bool(attrs.get("nan_to_zero", 0))
    names = ("x", *LINEARS, *SHAPES, "mask", "residual")

    def run(x, *rest):
        given = dict(zip(names[1:], rest, strict=False))
        batch, seq, _ = x.shape
        shape = (batch, seq, w_out.shape[0])  # heads merged, then as the Reshapes say
        for name in ("merge_shape", "o_flat"):
            if given.get(name) is not None:
                shape = onnx_reshape(np.empty(shape, np.bool_), given[name]).shape
        shape = (*shape[:-1], w_out.shape[1])
        if given.get("o_unflat") is not None:
            shape = onnx_reshape(np.empty(shape, np.bool_), given["o_unflat"]).shape
        y = attention(x, w_qkv, b_qkv, heads_, kv_heads, s, w_out, b_out, given.get("mask"),
                      given.get("residual"), out_shape=shape, nan_to_zero=nan_to_zero)  # fmt: skip
        return (y,)

    return run


RULE = Rule(
    "Attention",
    pattern(),
    inputs=("x", *LINEARS, *SHAPES, "mask", "residual"),
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=-1,
    description="multi-head attention: Q, K, V linears (or one + Split), heads, scale (on the "
    "scores, on Q, or on Q and K), additive mask, Softmax (NaN guard optional), times V, heads "
    "merged, output linear, optional residual",
    explain_after="Softmax",
    absorb_shapes=True,
)
