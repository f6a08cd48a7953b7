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
match (Match.shape_entries), so the match is the same computation at every shape.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion_patterns.linear import (
    check_linear,
    linear_attributes,
    linear_inputs,
    linear_nd,
    linear_params,
    onnx_reshape,
)
from fusion_patterns.linear_gelu import residual_follows

PROJECTIONS = ("q", "k", "v", "qkv", "o")
LINEARS = tuple(
    name for p in PROJECTIONS for name in (*linear_inputs(f"W{p}", p), f"{p}_flat", f"{p}_unflat")
)
SLICES = tuple(f"{t}_{half}_{part}" for t in "qk" for half in ("lo", "hi")
               for part in ("starts", "ends", "axes", "steps"))  # fmt: skip
SHAPES = ("q_shape", "k_shape", "v_shape", "merge_shape", "kt_flat_shape", "kt_shape",
          "ctx_shape", *SLICES, "k_rep_axes", "k_rep_shape", "k_rep_flat", "v_rep_axes",
          "v_rep_shape", "v_rep_flat")  # fmt: skip
ROTARY = ("cos", "sin")
INPUTS = ("x", *LINEARS, *SHAPES, *ROTARY, "mask", "residual")
SCALES = ("scale", "q_scale", "k_scale")


def last_axis(axis) -> str | None:
    return None if axis in (-1, 3) else f"axis={axis}, attention's Softmax is over the keys"


def heads(v, tag: str, perm, name: str | None = None):
    return op.Transpose(op.Reshape(v, Var(f"{tag}_shape"), _name=f"{tag}_heads"), perm=perm,
                        _name=name)  # fmt: skip


def scaled(v, name: str):
    """v * s or v / s (captured as `{name}_mul` / `{name}_div`), or v unscaled."""
    return Alt(op.Mul(v, Const(f"{name}_mul")), op.Div(v, Const(f"{name}_div")), v)


def rotary(t, tag: str, cos, sin):
    """Llama's rotary embedding of heads t [B, H, S, D] in the rotate-half form,
    t cos + concat(-t[..., D/2:], t[..., :D/2]) sin, cos and sin [B, 1, S, D] (computed from
    the positions by the model: fused inputs), or t itself."""

    def half(name):
        parts = [Var(f"{tag}_{name}_{p}") for p in ("starts", "ends")]
        return op.Slice(t, *parts, Opt(Var(f"{tag}_{name}_axes")), Opt(Var(f"{tag}_{name}_steps")))

    rotated = op.Concat(op.Neg(half("hi")), half("lo"), axis=last_axis, _name=f"{tag}_rot")
    return Alt(op.Add(op.Mul(t, cos), op.Mul(rotated, sin), _name=f"{tag}_rope"), t)


def repeated(t, tag: str):
    """Grouped-query heads t [B, Hkv, S, D] repeated to [B, H, S, D] as transformers'
    repeat_kv writes it (Unsqueeze at 2, Expand to [B, Hkv, H / Hkv, S, D], Reshape), or t."""
    unsqueezed = op.Unsqueeze(t, Const(f"{tag}_rep_axes"), _name=f"{tag}_rep_unsqueeze")
    expanded = op.Expand(unsqueezed, Var(f"{tag}_rep_shape"))
    return Alt(op.Reshape(expanded, Var(f"{tag}_rep_flat"), _name=f"{tag}_rep"), t)


def transposed_keys(k, cos, sin):
    """K^T per head, [B, H, D, S]: one Transpose of the [B, S, H, D] keys; heads [B, H, S, D]
    (rotated, repeated) then their last two axes swapped; or flattened to [B H, S, D], swapped
    in 3-D and unflattened (dynamo's sdpa)."""

    def keys():
        return repeated(rotary(heads(k, "k", [0, 2, 1, 3], "k_t"), "k", cos, sin), "k")

    flat = op.Reshape(keys(), Var("kt_flat_shape"), _name="kt_flat")
    return Alt(heads(k, "k", [0, 2, 3, 1]), op.Transpose(keys(), perm=[0, 1, 3, 2]),
               op.Reshape(op.Transpose(flat, perm=[0, 2, 1]), Var("kt_shape")))  # fmt: skip


def core(q, k, v):
    """The attention of projections q, k, v ([B, S, H*D] each) with the output linear."""
    cos, sin = Var("cos", dtype="float32"), Var("sin", dtype="float32")  # one pair: Q's and K's
    q_heads = scaled(rotary(heads(q, "q", [0, 2, 1, 3], "q_t"), "q", cos, sin), "q_scale")
    k_t = scaled(transposed_keys(k, cos, sin), "k_scale")
    scores = scaled(op.MatMul(q_heads, k_t, _name="qk"), "scale")
    masked = Alt(op.Add(scores, Var("mask", dtype="float32"), _name="mask_add"), scores)
    probs = op.Softmax(masked, axis=last_axis, _name="softmax")
    guarded = Alt(op.Where(op.IsNaN(probs), Const("nan_fill"), probs, _name="nan_guard"), probs)
    as_float = Alt(op.Cast(op.Cast(guarded, to=1), to=1), op.Cast(guarded, to=1), guarded)
    values = repeated(heads(v, "v", [0, 2, 1, 3], "v_t"), "v")
    context = op.MatMul(as_float, values, _name="context")
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
    reason = rotation(m, d) or regrouping(m, d)
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


def _target(m, name: str, want: list, constants: dict, known=None) -> str | None:
    """Why Reshape target `name` is not `want` (entry k: one of want[k], (tensor, axis) pairs
    or -1, or the number constants[k]), else None. `known`: sizes to count as constants."""
    got = m.shape_entries(name, known)
    ok = got is not None and len(got) == len(want)
    for k, e in enumerate(got if ok else []):
        ok = ok and (e in want[k] or (k in constants and e == constants[k]))
    return None if ok else f"the Reshape to {got} regroups the heads' values, not only their axes"


def _batch_or_sequence(m, axis: int) -> list:
    """Sizes a target may take its batch (axis 0) or sequence (axis 1) from, besides the head
    tensor's own: those axes of the graph's inputs and of x, all [batch, sequence, ...]. Where
    such a size comes into the fused node from outside, the kernel checks it (make_kernel)."""
    values = [i.name for i in m.view.graph.input] + [m["x"]]
    return [(value, axis) for value in values]


def regrouping(m, d: int) -> str | None:
    """The Reshapes between the head tensors must only regroup axes: K^T's flattening to
    [B H, S, D] and back to [B, H, D, S], the heads' output reshaped to itself, grouped-query
    heads repeated to [B, H, S, D]."""
    w = widths(m)
    heads_, kv_heads = w["q"] // d, w["k"] // d
    if m["kt_shape"] is not None:
        kt = m.node("kt_flat").input[0]
        flat = [[-1], [(kt, 2)], [(kt, 3)]]
        reason = _target(m, "kt_flat_shape", flat, {2: d})
        unflat = [[(kt, 0), -1], [(kt, 1), -1], [(kt, 3)], [(kt, 2)]]
        reason = reason or _target(m, "kt_shape", unflat, {1: heads_, 2: d})
        if reason:
            return reason
    for tag in ("k", "v"):
        if m[f"{tag}_rep_flat"] is None:
            continue
        t = m.node(f"{tag}_rep_unsqueeze").input[0]  # [B, Hkv, S, D]
        axes = m.const(f"{tag}_rep_axes")
        if axes is None or axes.reshape(-1).tolist() not in ([2], [-3]):
            return f"the grouped-query heads are unsqueezed at {axes}, not at axis 2"
        known = {(t, 1): kv_heads, (t, 3): d}
        batch, seq = _batch_or_sequence(m, 0), _batch_or_sequence(m, 1)
        shape = [[(t, 0), *batch], [], [], [(t, 2), *seq], []]
        consts = {1: kv_heads, 2: heads_ // kv_heads, 4: d}
        reason = _target(m, f"{tag}_rep_shape", shape, consts, known)
        flat = [[(t, 0), *batch, -1], [], [(t, 2), *seq], []]
        reason = reason or _target(m, f"{tag}_rep_flat", flat, {1: heads_, 3: d}, known)
        if reason:
            return reason
    if m["ctx_shape"] is not None:
        # every [B, H, S, D] tensor of the match: Q's heads (rotated, scaled), the context;
        # V's heads as transposed have only Hkv heads, repeated H
        ctx = m.node("context")
        q_side = [m.node("q_t").output[0], m.node("qk").input[0], ctx.output[0]]
        if "q_rope" in m.node_index:
            q_side.append(m.node("q_rope").output[0])
        v_side = [m.node("v_t").output[0], ctx.input[1]]
        same = [[(t, k) for t in q_side + v_side] for k in range(4)]
        same[1] = [(t, 1) for t in q_side] + [-1]
        return _target(m, "ctx_shape", same, {1: heads_, 3: d})
    return None


def _entry(m, name: str, known: dict, default=None):
    """The one entry of 1-D input `name` (a Slice's starts, ends, axes or steps), or default."""
    if m[name] is None:
        return default
    got = m.shape_entries(name, known)
    return got[0] if got is not None and len(got) == 1 else None


def rotation(m, d: int) -> str | None:
    """The rotary embedding's halves must be [0, D/2) and [D/2, D) of the last axis, on both Q
    and K, and cos and sin [batch, 1, sequence, D] (or broadcast to it)."""
    if ("q_rot" in m.node_index) != ("k_rot" in m.node_index):
        return "the rotary embedding turns only one of Q and K"
    for tag in "qk" if "q_rot" in m.node_index else ():
        known = {(m.node(f"{tag}_t").output[0], 3): d}
        lo, hi = ([_entry(m, f"{tag}_{half}_{p}", known, default)
                   for p, default in (("starts", None), ("ends", None), ("axes", 0), ("steps", 1))]
                  for half in ("lo", "hi"))  # fmt: skip
        ok = (d % 2 == 0 and lo[0] == 0 and lo[1] == d // 2 and hi[0] == d // 2
              and isinstance(hi[1], int) and hi[1] >= d  # past the end: to the end
              and lo[2] in (3, -1) and hi[2] in (3, -1) and lo[3] == 1 and hi[3] == 1)  # fmt: skip
        if not ok:
            return (f"the rotary halves slice {lo[:2]} and {hi[:2]} of axis {lo[2]}, not [0, "
                    f"{d // 2}) and [{d // 2}, {d}) of the last")  # fmt: skip
    for name in ROTARY:
        vt = m.type(name)
        shape = None if vt is None else vt.shape
        if shape is not None and (len(shape) > 4 or shape[-1] not in (d, None)
                                  or (len(shape) == 4 and shape[1] not in (1, None))):  # fmt: skip
            return f"{name} of shape {list(shape)} is not [batch, 1, sequence, {d}]"
    return None


def attributes(m) -> dict:
    d = head_dim(m)
    w = widths(m)
    names = ("qkv", "o") if "qkv_split" in m.node_index else ("q", "k", "v", "o")
    linear = {}
    for p in names:
        linear.update(linear_attributes(m, p))
    return {"heads": w["q"] // d, "kv_heads": w["k"] // d, "scale": scale(m),
            "nan_to_zero": int(m["nan_fill"] is not None), "rotary": int("q_rot" in m.node_index),
            **linear}  # fmt: skip


def repeat_targets(given: dict, batch: int, seq: int, heads_: int, kv_heads: int, d: int):
    """The grouped-query repeat's Expand and Reshape targets, where they come into the node
    (dynamo reads them from the attention mask's shape, which the rule cannot prove to be
    x's batch and sequence): [batch, kv_heads, heads / kv_heads, seq, d] and [batch, heads,
    seq, d]; a KernelError-worthy ValueError otherwise."""
    wants = {"rep_shape": [batch, kv_heads, heads_ // kv_heads, seq, d],
             "rep_flat": [batch, heads_, seq, d]}  # fmt: skip
    for tag in "kv":
        for name, want in wants.items():
            got = given.get(f"{tag}_{name}")
            if got is None:
                continue
            got = [int(e) for e in np.asarray(got).reshape(-1)]
            unknown = [k for k, e in enumerate(got) if e == -1]
            if len(unknown) == 1 and len(got) == len(want):
                rest = int(np.prod([e for e in got if e != -1]))
                got[unknown[0]] = int(np.prod(want)) // rest if rest else -1
            if got != want:
                raise ValueError(f"the grouped-query heads' {name} is {got}, not {want}")


def make_kernel(attrs: dict, constants: list):
    """Concatenate the Q, K, V weights and pack both projections once; the kernel runs the
    whole block."""
    from fusion_kernels.attention import attention  # heavy (Numba): at build time
    from fusion_kernels.dense_gemm import prepare_dense

    named = dict(zip(INPUTS, constants, strict=False))
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
    qkv_plan, out_plan = prepare_dense(w_qkv, b_qkv), prepare_dense(w_out, b_out)
    heads_, kv_heads, s = attrs["heads"], attrs["kv_heads"], attrs["scale"]
    nan_to_zero = bool(attrs.get("nan_to_zero", 0))
    rotary, d = bool(attrs.get("rotary", 0)), out_plan.k // heads_

    def run(x, *rest):
        given = dict(zip(INPUTS[1:], rest, strict=False))
        batch, seq, _ = x.shape
        repeat_targets(given, batch, seq, heads_, kv_heads, d)
        shape = (batch, seq, out_plan.k)  # heads merged, then as the Reshapes say
        for name in ("merge_shape", "o_flat"):
            if given.get(name) is not None:
                shape = onnx_reshape(np.empty(shape, np.bool_), given[name]).shape
        shape = (*shape[:-1], out_plan.n)
        if given.get("o_unflat") is not None:
            shape = onnx_reshape(np.empty(shape, np.bool_), given["o_unflat"]).shape
        y = attention(x, qkv_plan, heads_, kv_heads, s, out_plan, given.get("mask"),
                      given.get("residual"), out_shape=shape, nan_to_zero=nan_to_zero,
                      rotary=(given["cos"], given["sin"]) if rotary else None)  # fmt: skip
        return (y,)

    return run


RULE = Rule(
    "Attention",
    pattern(),
    inputs=INPUTS,
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=-1,
    description="multi-head attention: Q, K, V linears (or one + Split), heads (rotary "
    "embedding and grouped-query repeat optional), scale (on the scores, on Q, or on Q and K), "
    "additive mask, Softmax (NaN guard optional), times V, heads merged, output linear, "
    "optional residual",
    explain_after="Softmax",
    absorb_shapes=True,
)
