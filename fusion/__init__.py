"""fusion: catalog-based pattern fusion for ONNX models, with Numba kernels checked against
onnxruntime.

    import fusion
    result = fusion.rewrite(onnx.load("model.onnx"))   # RewriteResult: .model, .counts()
    print(result.explain())                             # near-misses and why
"""

from fusion.catalog import DOMAIN, Catalog, CatalogError, Rule, default_catalog
from fusion.io import FusionError, load_model, save_model
from fusion.matcher import Match
from fusion.pattern import Alt, Const, Op, Opt, Var, op
from fusion.rewriter import RewriteResult, rewrite

__all__ = [
    "DOMAIN",
    "Alt",
    "Catalog",
    "CatalogError",
    "Const",
    "FusionError",
    "Match",
    "Op",
    "Opt",
    "RewriteResult",
    "Rule",
    "Var",
    "default_catalog",
    "load_model",
    "op",
    "rewrite",
    "save_model",
]
