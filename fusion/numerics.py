"""The one array comparison and the one tolerance rule (verify, check_pattern, bench, tests).

A float element passes when |got - want| <= atol + rtol * |want| (NaN matches NaN, an infinity
the same infinity); integers and booleans must be equal, and so must shapes and dtypes. The
reported relative error is |got - want| / max(|want|, atol / rtol): below atol / rtol the
absolute tolerance is what counts, so values near zero do not make it meaningless, and a
passing output has max_rel <= 2 * rtol.

The tolerance of a fused model is the loosest rtol and atol among the rules whose fused nodes
it holds (each rule states what its kernel promises), unless the caller gives one. With
`scaled` (a rule whose kernel accumulates: Rule.accumulates) atol is at least rtol times the
largest finite |want|: a float32 sum of thousands of products in another order than
onnxruntime's errs by a small fraction of the output's scale, which an element near zero
cannot absorb (bench/NOTES.md, "Tolerance of accumulating kernels").

    >>> compare_arrays("y", got, want, *tolerance(rules)).ok
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

DEFAULT_RTOL = 1e-4  # a rule's tolerance unless it states its own
DEFAULT_ATOL = 1e-5


@dataclass
class Comparison:
    """One compared value: a graph output, or one output of one fused node."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    shape: tuple = ()
    note: str = ""  # why it failed beyond the numbers (shape or dtype mismatch)
    node: str = ""  # per-node comparisons: the fused node's label (for display)
    node_name: str = ""  # and its name, which a rewrite keeps unique (rollback keys on it)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAIL {self.note}".rstrip()
        where = f"{self.node} -> {self.name}" if self.node else self.name
        return f"{where}: max abs error {self.max_abs:.3g}, max rel {self.max_rel:.3g}: {verdict}"


def compare_arrays(
    name: str, got, want, rtol: float, atol: float, check_dtype: bool = True, scaled: bool = False
) -> Comparison:
    """Compare `got` with the reference `want` (see the module doc for the rule).

    check_dtype=False compares the values only (a float64 NumPy reference, a Python list);
    scaled=True raises atol to rtol x the largest finite |want| (an accumulating kernel).
    """
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        note = f"shape {list(got.shape)}, expected {list(want.shape)}"
        return Comparison(name, np.inf, np.inf, False, tuple(want.shape), note)
    same_dtype = got.dtype == want.dtype or not check_dtype
    note = "" if same_dtype else f"dtype {got.dtype}, expected {want.dtype}"
    if got.size == 0 or got.dtype.kind != "f" or want.dtype.kind != "f":
        ok = np.array_equal(got, want) and not note  # integers, booleans: exactly
        return Comparison(name, 0.0 if ok else np.inf, 0.0 if ok else np.inf, ok, got.shape, note)
    a, b = got.astype(np.float64), want.astype(np.float64)
    if scaled:
        finite = np.abs(b[np.isfinite(b)])
        atol = max(atol, rtol * float(finite.max(initial=0.0)))
    floor = atol / rtol if rtol > 0 else atol or np.finfo(np.float64).tiny
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))  # equal infinities and NaNs agree
        err = np.where(same, 0.0, np.abs(a - b))
        err[np.isnan(err)] = np.inf  # NaN against a number is as bad as it gets
        rel = err / np.where(same, 1.0, np.maximum(np.abs(b), floor))
        ok = bool(np.all(same | (err <= atol + rtol * np.abs(b)))) and not note
    return Comparison(name, float(err.max()), float(rel.max()), ok, got.shape, note)


def accumulating(rules: Iterable) -> bool:
    """Whether any of the rules' kernels accumulates (compare with scaled=True)."""
    return any(getattr(r, "accumulates", False) for r in rules)


def tolerance(
    rules: Iterable, rtol: float | None = None, atol: float | None = None
) -> tuple[float, float]:
    """(rtol, atol): the loosest of the rules' (objects with .rtol and .atol), or the given."""
    rules = list(rules)
    loosest_rtol = max([r.rtol for r in rules], default=DEFAULT_RTOL)
    loosest_atol = max([r.atol for r in rules], default=DEFAULT_ATOL)
    return (
        loosest_rtol if rtol is None else rtol,
        loosest_atol if atol is None else atol,
    )
