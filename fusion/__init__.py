"""fusion: catalog-based pattern fusion for ONNX models, with Numba kernels checked against
onnxruntime.

    import fusion
    result = fusion.rewrite(onnx.load("model.onnx"))   # RewriteResult: .model, .counts()
    print(result.explain())                             # near-misses and why

The public front only: importing it loads neither Numba (imported when a session first builds a
kernel) nor the benchmark harness, and changes no environment variable.
"""

from fusion.catalog import DOMAIN, Catalog, Rule
from fusion.check import CheckReport, check_pattern
from fusion.coverage import Coverage, Explanation, coverage, explain
from fusion.errors import CatalogError, FusionError, FusionWarning, KernelError
from fusion.matcher import Match
from fusion.modelfile import load_model, save_model
from fusion.pattern import Alt, Const, Op, Opt, Var, op
from fusion.registry import default_catalog, load_plugin, register_pattern
from fusion.rewriter import NearMiss, RewriteResult, rewrite
from fusion.runtime import Session
from fusion.verify import VerifyReport, verify

__all__ = [
    "DOMAIN",
    "Alt",
    "Catalog",
    "CatalogError",
    "CheckReport",
    "Coverage",
    "Const",
    "FusionError",
    "FusionWarning",
    "KernelError",
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
    "coverage",
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


def __getattr__(name: str):
    # fusion.compare is the benchmark harness's timing front (runners, SGEMM reference, report
    # tables): heavy, so it is imported on first use, not with `import fusion`.
    if name == "compare":
        from fusion.bench.compare import compare

        return compare
    raise AttributeError(f"module 'fusion' has no attribute {name!r}")
