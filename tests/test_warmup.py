"""kernels.warmup: a warmed cache serves later calls without compiling; bad arguments refused."""

import os
import subprocess
import sys

import pytest

from kernels.warmup import main, warm_up

# A Fire-style call after warm-up: a fresh output and a channel slice at batch 2.
USE = """
import numpy as np
from kernels.conv2d import conv2d_bias_act, prepare_conv2d
plan = prepare_conv2d(np.ones((6, 1, 3, 3), np.float32), pads=(1, 1, 1, 1), group=6)
conv2d_bias_act(np.ones((1, 6, 7, 7), np.float32), plan)
out = np.empty((2, 9, 5, 5), np.float32)[:, 2:8]
conv2d_bias_act(np.ones((2, 6, 5, 5), np.float32), plan, out=out)
"""


def test_warmed_cache_serves_later_calls_without_compiling(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_DEBUG_CACHE="1")
    run = [sys.executable, "-m", "kernels.warmup", "--group", "depthwise"]
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

    import kernels
    import kernels.simd

    for package in (kernels, kernels.simd):
        for info in pkgutil.iter_modules(package.__path__):
            yield importlib.import_module(f"{package.__name__}.{info.name}")


def test_kernels_compile_once_per_argument_type_not_per_literal():
    """A literal int in a call between kernels is typed Literal[int], and Numba compiles the
    callee (and all it inlines) once per value and once more for int64: the depthwise item
    three times in mobilenet_v3_small's cold start, the blocked Winograd's row helper ten
    times. After the paths that call across kernels (the depth-first block, the depthwise
    conv, the pre-activated conv, im2col's GEMM, squeeze-excitation, the blocked Winograd, the
    recurrent cells), no kernel holds two signatures that differ only by literals."""
    from numba.core import types
    from numba.core.registry import CPUDispatcher

    from kernels import warmup

    groups = ("inverted_residual", "blocked_depthwise", "preact_conv", "im2col", "pool",
              "blocked_winograd_f2", "lstm", "gru")  # fmt: skip
    for group in groups:
        warmup.GROUPS[group]()
    twice, checked = [], set()
    for module in _kernel_modules():
        for disp in vars(module).values():
            if not isinstance(disp, CPUDispatcher) or id(disp) in checked:
                continue
            checked.add(id(disp))
            seen = {}
            for sig in disp.signatures:
                plain = tuple(types.unliteral(t) for t in sig)
                if plain in seen and seen[plain] != sig:
                    twice.append(f"{disp.py_func.__module__}.{disp.py_func.__name__}: {sig}")
                seen[plain] = sig
    assert not twice, "\n".join(twice)
