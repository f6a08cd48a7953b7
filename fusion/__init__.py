"""fusion: catalog-based pattern fusion for ONNX models, with Numba kernels checked against
onnxruntime.

    import fusion
    result = fusion.rewrite(onnx.load("model.onnx"))   # RewriteResult: .model, .counts()
    print(result.explain())                             # near-misses and why

The public front only: importing it loads neither Numba (imported when a session first builds a
kernel) nor the benchmark harness, and changes no environment variable.
"""

from fusion import rewriter
from fusion.catalog import DOMAIN, Catalog, Rule
from fusion.check import CheckReport, check_pattern
from fusion.coverage import Coverage, Explanation, coverage, explain
from fusion.errors import CatalogError, FusionError, FusionWarning, KernelError
from fusion.matcher import Match
from fusion.modelfile import load_model, save_model
from fusion.pattern import Alt, Const, Op, Opt, Var, op
from fusion.registry import default_catalog, load_plugin, register_pattern
from fusion.rewriter import NearMiss, RewriteResult, RolledBack
from fusion.runtime import Session
from fusion.verify import Rollback, VerifyReport, rollback, verify

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
    "RolledBack",
    "Rollback",
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
    "rollback",
    "save_model",
    "verify",
]


def rewrite(
    model,
    catalog: Catalog | None = None,
    only: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    skip: dict[str, str] | None = None,
    standard_ops: bool = False,
    *,
    verify: bool = False,
    inputs=None,
) -> RewriteResult:
    """Fuse every safe match of the catalog's patterns (fusion.rewriter.rewrite: the arguments
    before `verify` are its); the input model is not modified.

    verify: what `fusion rewrite --verify` does (fusion.rollback): every fused node checked
    against onnxruntime on a real run (on `inputs`, else seeded random ones), each tactic its
    kernel offers, and the fusions that disagree undone (`result.rolled_back` says which and
    why); then, with standard_ops, the standard ops written and checked against the original.
    A FusionError if something still disagrees (a standard op, a fused node the input had).

    >>> result = fusion.rewrite(model, verify=True)
    >>> [(r.node, r.reason) for r in result.rolled_back]
    """
    if not verify:
        return rewriter.rewrite(model, catalog, only, exclude, skip, standard_ops)
    catalog = (catalog if catalog is not None else default_catalog()).select(only, exclude)
    result = rewriter.rewrite(model, catalog, skip=skip)
    if not result.fusions:
        return result
    done = rollback(model, result, catalog, inputs, skip=skip, standard_ops=standard_ops)
    if not done.ok:
        raise FusionError(f"verified, and still disagrees with onnxruntime: {done.disagreeing[0]}")
    return done.result


def __getattr__(name: str):
    # fusion.compare is the benchmark harness's timing front (runners, SGEMM reference, report
    # tables): heavy, so it is imported on first use, not with `import fusion`.
    if name == "compare":
        from fusion.bench.compare import compare

        return compare
    raise AttributeError(f"module 'fusion' has no attribute {name!r}")
