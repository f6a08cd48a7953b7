"""fusion: catalog-based pattern fusion for ONNX models, with Numba kernels checked against
onnxruntime.

    import fusion
    result = fusion.rewrite(onnx.load("model.onnx"))   # RewriteResult: .model, .counts()
    print(result.explain())                             # near-misses and why
"""

from fusion.catalog import DOMAIN, Catalog, CatalogError, Rule, default_catalog
from fusion.check import CheckReport, check_pattern
from fusion.io import FusionError, load_model, save_model
from fusion.matcher import Match
from fusion.pattern import Alt, Const, Op, Opt, Var, op
from fusion.registry import load_plugin, register_pattern
from fusion.rewriter import Explanation, NearMiss, RewriteResult, explain, rewrite
from fusion.runtime import Session
from fusion.timing import compare
from fusion.verify import VerifyReport, verify

__all__ = [
    "DOMAIN",
    "Alt",
    "Catalog",
    "CatalogError",
    "CheckReport",
    "Const",
    "FusionError",
    "Match",
    "Op",
    "Opt",
    "Explanation",
    "NearMiss",
    "RewriteResult",
    "Session",
    "VerifyReport",
    "Rule",
    "Var",
    "check_pattern",
    "compare",
    "default_catalog",
    "explain",
    "load_model",
    "load_plugin",
    "op",
    "register_pattern",
    "rewrite",
    "save_model",
    "verify",
]
