"""`check_pattern`: run a rule's kernel against onnxruntime on the rule's own subgraph.

The pattern is instantiated into a small model (first alternative, optional inputs present,
literal attribute constraints set, shapes from the caller), rewritten with that rule alone,
and run both ways on seeded random inputs: fusion.Session with the kernel, onnxruntime with the
same settings as verify's oracle (fusion.ort.REFERENCE), compared as verify compares
(fusion.numerics). A user knows the kernel is right before it touches a real model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusion.catalog import Catalog, Rule
from fusion.pattern import Alt, Const, Op, Opt, Output, Pattern, Var, walk
from fusion.rewriter import rewrite
from fusion.verify import verify


@dataclass
class CheckReport:
    rule: str
    fused: bool
    max_abs: float
    max_rel: float
    ok: bool
    reason: str = ""

    def __str__(self) -> str:
        if not self.fused:
            return f"{self.rule}: not fused on its own subgraph: {self.reason}"
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{self.rule}: {verdict} (max abs error {self.max_abs:.3g}, max rel {self.max_rel:.3g})"
        )


def check_pattern(
    rule: Rule,
    shapes: dict[str, list[int]],
    constants: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
) -> CheckReport:
    """Instantiate `rule`'s pattern with `shapes` (per Var/Const capture name), fuse, compare.

    >>> check_pattern(rule, shapes={"x": [4, 16], "W": [8, 16], "b": [8]}).ok
    True
    """
    model, feeds = instantiate(rule, shapes, constants or {}, opset, seed)
    catalog = Catalog([rule])
    result = rewrite(model, catalog)
    if not result.fusions:
        reasons = [n.reason for n in result.near_misses] or ["no match"]
        return CheckReport(rule.name, False, np.inf, np.inf, False, reasons[0])
    # verify: the kernel with each of its tactics (never the onnxruntime fallback a timed
    # session may choose), with the rule's tolerance.
    report = verify(model, result.model, inputs=feeds, rtol=rtol, atol=atol, catalog=catalog)
    outputs = [*report.outputs, *report.tactics, *report.nodes]
    return CheckReport(
        rule.name,
        True,
        max(c.max_abs for c in outputs),
        max(c.max_rel for c in outputs),
        all(c.ok for c in outputs),
    )


def instantiate(rule: Rule, shapes: dict, constants: dict, opset: int = 17, seed: int = 0):
    """A model computing exactly the rule's pattern, and random feeds for its inputs."""
    builder = _Builder(rule.pattern, shapes, constants, np.random.default_rng(seed))
    root = builder.value(rule.pattern)
    outputs = [root] + [builder.captured[n] for n in rule.outputs if builder.captured[n] != root]
    graph = helper.make_graph(
        builder.nodes,
        f"{rule.name}_check",
        builder.inputs,
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        builder.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model, builder.feeds


class _Builder:
    def __init__(self, root: Pattern, shapes: dict, constants: dict, rng: np.random.Generator):
        self.shapes, self.constants, self.rng = shapes, constants, rng
        self.n_outputs = _outputs_needed(root)
        self.next_free: dict[int, int] = {}
        self.nodes: list = []
        self.inputs: list = []
        self.inits: list = []
        self.feeds: dict = {}
        self.captured: dict[str, str] = {}
        self.memo: dict[int, str] = {}
        self.node_outputs: dict[int, list[str]] = {}

    def value(self, pat: Pattern) -> str:
        if id(pat) not in self.memo:
            self.memo[id(pat)] = self._build(pat)
            if pat.name:
                self.captured[pat.name] = self.memo[id(pat)]
        return self.memo[id(pat)]

    def _build(self, pat: Pattern) -> str:
        if isinstance(pat, (Alt, Opt)):
            return self.value(pat.options[0] if isinstance(pat, Alt) else pat.pattern)
        if isinstance(pat, Var):
            dtype = np.dtype(pat.dtype) if isinstance(pat.dtype, str) else np.dtype(np.float32)
            self.feeds[pat.name] = self.rng.standard_normal(self._shape(pat)).astype(dtype)
            elem = helper.np_dtype_to_tensor_dtype(dtype)
            self.inputs.append(helper.make_tensor_value_info(pat.name, elem, self._shape(pat)))
            return pat.name
        if isinstance(pat, Const):
            array = self.constants.get(pat.name)
            if array is None:
                array = self.rng.standard_normal(self._shape(pat)).astype(np.float32)
            self.inits.append(numpy_helper.from_array(np.asarray(array), pat.name))
            return pat.name
        if isinstance(pat, Output):
            outs = self._node(pat.node)
            if pat.index is not None:
                return outs[pat.index]
            index = self.next_free.get(id(pat.node), 0)  # any_output: the next unused one
            self.next_free[id(pat.node)] = index + 1
            return outs[index]
        if isinstance(pat, Op):
            return self._node(pat)[0]
        raise TypeError(f"cannot instantiate {pat!r}")

    def _node(self, pat: Op) -> list[str]:
        if id(pat) not in self.node_outputs:
            inputs = [self.value(p) for p in pat.inputs]
            attrs = {k: v for k, v in pat.attrs.items() if not callable(v)}
            n_out = self.n_outputs.get(id(pat), 1)
            name = f"n{len(self.nodes)}"
            outs = [f"{name}_out{k}" for k in range(n_out)]
            self.nodes.append(helper.make_node(pat.op_type, inputs, outs, name, **attrs))
            self.node_outputs[id(pat)] = outs
            if pat.name:
                self.captured[pat.name] = outs[0]
        return self.node_outputs[id(pat)]

    def _shape(self, pat) -> list[int]:
        if pat.name not in self.shapes:
            raise ValueError(
                f"check_pattern needs a shape (shapes=...) or a value (constants=...) for "
                f"{pat.name!r}"
            )
        return list(self.shapes[pat.name])


def _outputs_needed(root: Pattern) -> dict[int, int]:
    """Per Op pattern, how many outputs its node needs (a Split read by index or by role)."""
    fixed: dict[int, int] = {}
    anys: dict[int, int] = {}
    for pat in walk(root):
        if isinstance(pat, Output) and pat.index is not None:
            fixed[id(pat.node)] = max(fixed.get(id(pat.node), 1), pat.index + 1)
        elif isinstance(pat, Output):
            anys[id(pat.node)] = anys.get(id(pat.node), 0) + 1
    return {k: max(fixed.get(k, 1), anys.get(k, 0)) for k in fixed.keys() | anys.keys()}
