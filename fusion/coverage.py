"""How much of a model the catalog covers: convs fused, convs left and why, onnxruntime islands.

    cov = coverage(onnx.load("resnet18.onnx"))
    print(cov.summary())        # "convs: 20 of 20 fused; onnxruntime islands: 0"
    print(explain("resnet18.onnx"))   # per rule: fused, near-misses; then every conv left out

A conv left unfused is reported with the first reason the catalog gives for it: the near-miss
recorded at that Conv node (the conv rule tries every Conv), else any near-miss naming it.
Islands are counted on the run plan a Session would make with every fused node on its kernel
(tactics="kernel"): the same cut into steps (fusion/runtime/plan.py), computed without building
a kernel or running anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from fusion.catalog import DOMAIN, Catalog
from fusion.errors import CatalogError
from fusion.graph import GraphView, node_label
from fusion.modelfile import as_model
from fusion.registry import default_catalog
from fusion.rewriter import RewriteResult, rewrite
from fusion.runtime.plan import IslandPlan, plan

CONV_OPS = ("Conv",)


@dataclass
class Coverage:
    convs: int  # Conv nodes of the main graph
    fused: int  # of them inside a fused node that a kernel runs
    islands: int  # onnxruntime sessions a run takes, every fused node on its kernel
    unfused: list[tuple[str, str]] = field(default_factory=list)  # (conv label, first reason)

    def summary(self) -> str:
        return f"convs: {self.fused} of {self.convs} fused; onnxruntime islands: {self.islands}"

    def to_dict(self) -> dict:
        return {
            "convs": self.convs,
            "fused_convs": self.fused,
            "islands": self.islands,
            "unfused_convs": [{"conv": c, "reason": r} for c, r in self.unfused],
        }

    def __str__(self) -> str:
        lines = [f"  {conv}: {reason}" for conv, reason in self.unfused]
        head = "convs left unfused:" if lines else ""
        return "\n".join([*([head] if head else []), *lines, self.summary()])


def coverage(model, catalog: Catalog | None = None,
             result: RewriteResult | None = None) -> Coverage:  # fmt: skip
    """Coverage of `model` by `catalog` (the default one); `result`: its rewrite, if made."""
    model = as_model(model)
    catalog = catalog if catalog is not None else default_catalog()
    result = result if result is not None else rewrite(model, catalog)
    convs = [node_label(n) for n in model.graph.node if _is_conv(n)]
    left = [node_label(n) for n in result.model.graph.node if _is_conv(n)]
    # A fused node runs a kernel when its rule has one; a Conv inside a node without one (a
    # rule that only rewrites) still runs in onnxruntime.
    in_bodies = sum(
        sum(_is_conv(n) for n in _body(result.model, node).node)
        for node in result.model.graph.node
        if node.domain == DOMAIN and not _has_kernel(catalog, node)
    )
    unfused = [(conv, _reason(result, conv)) for conv in left]
    return Coverage(len(convs), len(convs) - len(left) - in_bodies, islands(result.model, catalog),
                    unfused)  # fmt: skip


def islands(fused: onnx.ModelProto, catalog: Catalog) -> int:
    """onnxruntime islands of a fused model's run with every fused node on its kernel."""
    steps = plan(GraphView(fused), lambda node: _has_kernel(catalog, node))
    return sum(isinstance(step, IslandPlan) for step in steps)


def _is_conv(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in CONV_OPS


def _has_kernel(catalog: Catalog, node: onnx.NodeProto) -> bool:
    rule = catalog.get(node.op_type) if node.domain == DOMAIN else None
    return rule is not None and rule.prepare is not None


def _body(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.FunctionProto:
    key = (node.domain, node.op_type, node.overload)
    return next(f for f in model.functions if (f.domain, f.name, f.overload) == key)


def _reason(result: RewriteResult, conv: str) -> str:
    """The first near-miss recorded at `conv`, else the first that names it."""
    at = [n for n in result.near_misses if n.at == conv]
    named = [n for n in result.near_misses if conv in n.reason]
    found = (at or named or [None])[0]
    if found is None:
        return "no rule matched it"
    return f"{found.reason.removeprefix(conv + ': ')} ({found.rule})"


class Explanation(list):
    """Near-misses (NearMiss: rule, at, reason) as data, with the model's Coverage; str() gives
    the printable text."""

    def __init__(self, misses, text: str, cover: Coverage | None = None):
        super().__init__(misses)
        self.text, self.coverage = text, cover

    def __str__(self) -> str:
        return self.text


def explain(model, pattern: str | None = None, catalog: Catalog | None = None) -> Explanation:
    """Why `pattern` (or every pattern) did not fire where it nearly did; without a pattern,
    also every conv left unfused with its first reason, and the summary line.

    >>> print(fusion.explain("model.onnx", pattern="ConvBiasRelu"))
    ConvBiasRelu: 3 fused, 1 not fused
      Conv /conv7: dtype float16, kernels are float32-only
    """
    model = as_model(model)
    catalog = catalog if catalog is not None else default_catalog()
    if pattern is not None and pattern not in catalog:
        raise CatalogError(f"no pattern named {pattern!r}")
    result = rewrite(model, catalog)
    misses = [n for n in result.near_misses if pattern is None or n.rule == pattern]
    if pattern is not None:
        return Explanation(misses, result.explain(pattern))
    cover = coverage(model, catalog, result)
    return Explanation(misses, f"{result.explain()}\n{cover}", cover)
