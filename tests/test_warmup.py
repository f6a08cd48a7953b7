"""fusion_kernels.warmup: a warmed cache serves later calls without compiling; bad arguments
refused; the kernels compile once per argument type, not once per literal value passed between
them."""

import os
import subprocess
import sys

import pytest

from fusion_kernels.warmup import main, warm_up

# A Fire-style call after warm-up: a fresh output and a channel slice at batch 2.
USE = """
import numpy as np
from fusion_kernels.conv2d import conv2d_bias_act, prepare_conv2d
plan = prepare_conv2d(np.ones((6, 1, 3, 3), np.float32), pads=(1, 1, 1, 1), group=6)
conv2d_bias_act(np.ones((1, 6, 7, 7), np.float32), plan)
out = np.empty((2, 9, 5, 5), np.float32)[:, 2:8]
conv2d_bias_act(np.ones((2, 6, 5, 5), np.float32), plan, out=out)
"""


def test_warmed_cache_serves_later_calls_without_compiling(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_DEBUG_CACHE="1")
    run = [sys.executable, "-m", "fusion_kernels.warmup", "--group", "depthwise"]
    warm = subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    assert "data saved" in warm.stdout  # it did compile into the fresh cache
    later = subprocess.run([sys.executable, "-c", USE], env=env, capture_output=True, text=True)
    assert later.returncode == 0, later.stderr
    assert "data loaded" in later.stdout and "data saved" not in later.stdout, later.stdout


def test_unknown_group_is_refused():
    with pytest.raises(ValueError, match="unknown warm-up groups \\['nope'\\]"):
        warm_up(groups=["nope"])


def test_bad_jobs_gives_one_line_error_and_exit_code(capsys):
    assert main(["--jobs", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: jobs must be >= 1") and err.count("\n") == 1


def _kernel_modules():
    import importlib
    import pkgutil

    import fusion_kernels
    import fusion_kernels.simd

    for package in (fusion_kernels, fusion_kernels.simd):
        for info in pkgutil.iter_modules(package.__path__):
            yield importlib.import_module(f"{package.__name__}.{info.name}")


def _literal_arguments(module) -> list[str]:
    """Calls, inside the module's jitted functions, of a jitted function that Numba compiles on
    its own (not inline="always", which is typed in its caller) with a literal int or bool
    argument: "module:line callee(...)"."""
    import ast
    import inspect

    from numba.core.registry import CPUDispatcher

    jitted = {v.py_func.__name__ for v in vars(module).values() if isinstance(v, CPUDispatcher)}

    def callee(func):
        if isinstance(func, ast.Name):
            return vars(module).get(func.id)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            return getattr(vars(module).get(func.value.id), func.attr, None)
        return None

    def literal(arg):
        if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub):
            arg = arg.operand
        return isinstance(arg, ast.Constant) and isinstance(arg.value, (bool, int))

    found = []
    tree = ast.parse(inspect.getsource(module))
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name not in jitted:
            continue
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call):
                continue
            target = callee(call.func)
            if not isinstance(target, CPUDispatcher):
                continue
            if target.targetoptions.get("inline", "never") == "always":
                continue
            if any(literal(a) for a in [*call.args, *(k.value for k in call.keywords)]):
                found.append(f"{module.__name__}:{call.lineno} {ast.unparse(call.func)}(...)")
    return found


def test_calls_between_kernels_pass_no_literal_ints():
    """A literal int or bool passed from one jitted kernel to another is typed Literal[int]
    (Literal[bool]), and Numba compiles the callee, with all it calls and inlines, once per
    value and once more for int64: the depthwise item three times in mobilenet_v3_small's
    cold start, the blocked Winograd's row helper ten times (bench/NOTES.md). Such arguments
    go as kernels.config.I64[k] / ZERO_I64 / TRUE (typed int64, bool). Checked on the source:
    a compiled signature only shows in a process that compiled the caller, not one that
    loaded it from Numba's cache."""
    found = [c for module in _kernel_modules() for c in _literal_arguments(module)]
    assert not found, "\n".join(found)
