"""linear(x, W, b):  y = x W + b,  x [.., K], W [K, N], b [N] (or none)

The sub-pattern every catalog entry with a matrix product is written on. Exporters write it as
MatMul(x, W) with or without a following Add of the bias, or as Gemm(x, W, C) with
transB (W stored [N, K]), alpha and beta (y = alpha x W + beta C), the bias as Gemm's C, as a
separate Add, or both; weights are constants (initializers or Constant nodes, seen through
Identity). The input may itself be a pattern: `linear(op.Concat(x, h), "W", "xh")` is the
TF/Keras form of an RNN's gates. A match records per product the attribute `{prefix}_linear`
= [transB, alpha, beta], from which `linear_params` makes the canonical W [K, N] and b [N]
once, when a kernel is built:

    fc = linear(Var("x", dtype="float32"), "W", "fc")        # captures W, fc_c, fc_b, fc_mm
    rule = Rule("LinearGelu", gelu(fc), inputs=("x", *linear_inputs("W", "fc")), ...,
                attributes=lambda m: linear_attributes(m, "fc"), check=...)
"""

from __future__ import annotations

import numpy as np

from fusion.pattern import Alt, Const, Opt, Pattern, Var, op


def product(x: Pattern, w: str, prefix: str, where=None) -> Pattern:
    """x W without a separate bias Add: MatMul, or Gemm (its C captured as `{prefix}_c`).
    where(m, node): a constraint on the product node (the op's `_where`)."""
    weight = Const(w)
    options = {"_name": f"{prefix}_mm", **({"_where": where} if where else {})}
    return Alt(
        op.MatMul(x, weight, **options),
        op.Gemm(x, weight, Opt(Const(f"{prefix}_c")), transA=0, **options),
    )


def linear(x: Pattern, w: str, prefix: str, where=None) -> Pattern:
    """x W + b in every exporter form: product(x, W), optionally followed by Add of a constant
    bias captured as `{prefix}_b`."""
    mm = product(x, w, prefix, where)
    return Alt(op.Add(mm, Const(f"{prefix}_b")), mm)


def linear_nd(x: Pattern, w: str, prefix: str) -> Pattern:
    """linear(x, W) on x [..., K] of any rank: as MatMul writes it, or flattened to [M, K] for
    a Gemm and reshaped back, as PyTorch's exporters write nn.Linear on a 3-D input
    (Reshape(Gemm(Reshape(x, `{prefix}_flat`)), `{prefix}_unflat`)), or only reshaped after
    (x already 2-D). The fused kernel reshapes with the captured shapes (onnx_reshape), so
    they are inputs of the fused node."""
    flat = op.Reshape(x, Var(f"{prefix}_flat"), _name=f"{prefix}_flatten")

    def unflat(y):
        return op.Reshape(y, Var(f"{prefix}_unflat"), _name=f"{prefix}_unflatten")

    return Alt(unflat(linear(flat, w, prefix)), unflat(linear(x, w, prefix)), linear(x, w, prefix))


def onnx_reshape(a: np.ndarray, shape, allowzero: int = 0) -> np.ndarray:
    """numpy's reshape with ONNX's rules: a 0 copies the input's size on that axis (unless
    allowzero), -1 is inferred."""
    dims = [int(d) for d in np.asarray(shape).reshape(-1)]
    if not allowzero:
        dims = [a.shape[k] if d == 0 and k < a.ndim else d for k, d in enumerate(dims)]
    return a.reshape(dims)


def linear_inputs(w: str, prefix: str) -> tuple[str, str, str]:
    """The constants of one linear, in the order linear_params takes them."""
    return (w, f"{prefix}_c", f"{prefix}_b")


def linear_attributes(m, prefix: str) -> dict:
    """{`{prefix}_linear`: [transB, alpha, beta]} of the matched product (MatMul: [0, 1, 1])."""
    node = m.node(f"{prefix}_mm")
    if node.op_type == "MatMul":
        return {f"{prefix}_linear": [0.0, 1.0, 1.0]}
    gemm = m.attrs(f"{prefix}_mm")
    return {f"{prefix}_linear": [float(gemm["transB"]), float(gemm["alpha"]), float(gemm["beta"])]}


def check_linear(m, w: str, prefix: str) -> str | None:
    """Why the matched product is not x [.., K] times a 2-D W plus a bias of N values, if not."""
    weight = m.const(w)
    if weight is None or weight.ndim != 2:
        return f"{w} of shape {list(np.shape(weight))} is not a 2-D weight"
    trans = linear_attributes(m, prefix)[f"{prefix}_linear"][0]
    n = weight.shape[0] if trans else weight.shape[1]
    for name in (f"{prefix}_c", f"{prefix}_b"):
        value = m.const(name)
        if value is not None and not _is_row(value, n):
            return f"bias {m[name]} of shape {list(value.shape)} is not a row of {n} values"
    return None


def _is_row(value: np.ndarray, n: int) -> bool:
    return value.size in (1, n) and all(d == 1 for d in value.shape[:-1])


def out_features(m, w: str, prefix: str) -> int:
    """N, the number of output columns of the matched product."""
    trans = linear_attributes(m, prefix)[f"{prefix}_linear"][0]
    return m.const(w).shape[0 if trans else 1]


def linear_params(attr, w: np.ndarray, c: np.ndarray | None, b: np.ndarray | None):
    """(W [K, N], bias [N]) in float32 from a match's constants and its [transB, alpha, beta].

    >>> linear_params([1, 2.0, 1.0], np.eye(2), None, np.ones(2))  # Gemm(transB, alpha=2) + 1
    """
    trans, alpha, beta = attr
    weight = np.asarray(w.T if trans else w, np.float32) * np.float32(alpha)
    n = weight.shape[1]
    bias = np.zeros(n, np.float32)
    if c is not None:
        bias += np.float32(beta) * np.broadcast_to(np.reshape(c, -1), n).astype(np.float32)
    if b is not None:
        bias += np.broadcast_to(np.reshape(b, -1), n).astype(np.float32)
    return np.ascontiguousarray(weight), bias
