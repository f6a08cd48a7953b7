"""Compile the Numba kernels once, in parallel, before any test process needs them.

Without this, each pytest-xdist worker compiled every kernel it met (both workers the same
ones, at the same time: most of a 14-minute cold run). kernels.warmup compiles each group of
kernel paths in its own process into the on-disk cache, where the workers then find them; on a
warm cache it only loads them (about 9 s). Only for parallel runs (`-n`): a single-process run
compiles just what its tests use. FUSION_NO_WARMUP=1 skips it.

Property tests (hypothesis) draw the same examples on every run, so that the suite passes or
fails the same way on every machine and a failure reproduces; FUSION_FUZZ_RANDOM=1 draws new
ones (with FUSION_FUZZ_EXAMPLES / FUSION_FUZZ_CORRUPTIONS for long hunts, see test_fuzz.py).
"""

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("random")
settings.load_profile("random" if os.environ.get("FUSION_FUZZ_RANDOM") == "1" else "fixed")

# Sessions run their kernels' first tactic, untimed: a test of a kernel must run that kernel,
# whatever the machine's timings say (tests of the choice itself ask for "fastest"), and no
# test writes the user's timing cache.
os.environ.setdefault("FUSION_TACTICS", "kernel")
# No compile helper process (fusion/runtime/precompile.py) beside the test workers, which
# already keep both cores busy; tests/test_compile_helper.py turns it on where it is tested.
os.environ.setdefault("FUSION_COMPILE_HELPER", "0")
# A fresh timing cache per run, removed at its end by the process that made it (xdist workers
# inherit the variable, and with it the folder).
OWN_CACHE = None
if "FUSION_CACHE_DIR" not in os.environ:
    OWN_CACHE = os.environ["FUSION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusion-test-cache-")


def pytest_configure(config):
    # Tests call kernels directly, outside a fusion.Session: give their Numba thread pool the
    # settings a session applies (kernels.config.apply_thread_settings), in every process.
    from fusion_kernels.config import apply_thread_settings

    apply_thread_settings()
    if hasattr(config, "workerinput") or os.environ.get("FUSION_NO_WARMUP") == "1":
        return  # an xdist worker: the controller has done it
    if not config.getoption("numprocesses", None):
        return
    from fusion_kernels.warmup import warm_up

    try:
        warm_up(jobs=max(1, min(4, os.cpu_count() or 1)))
    except RuntimeError as err:  # the tests compile and report it themselves, with context
        warnings.warn(f"{err}", stacklevel=1)


def pytest_unconfigure(config):
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)


@pytest.fixture
def model_file(tmp_path) -> Path:
    """A small conv model (helpers.small_model) saved as in.onnx in the test's folder."""
    from helpers import small_model  # fusion and onnx only when a test asks for the fixture

    from fusion.modelfile import save_model

    path = tmp_path / "in.onnx"
    save_model(small_model(), path)
    return path
