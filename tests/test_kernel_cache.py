"""kernels/_cache.py: a kernel in Numba's on-disk cache is compiled again when a module it
imports changes (here the SIMD layer's sigmoid, in another file), not only its own file, and
is still loaded when a module it does not import changes. Run in fresh processes on a copy of
the package, so that the copy can be edited."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import numba

from .config import JIT
from .simd.approx import sigmoid


@numba.jit(**JIT)
def probe(x):
    return sigmoid(x)
"""

RUN = """
import numpy as np
import fusion_kernels
import fusion_kernels._probe as p
assert fusion_kernels.__file__.startswith({root!r}), fusion_kernels.__file__
print("value", float(p.probe(np.float32(0.0))))
"""


def test_a_change_in_an_imported_module_recompiles_and_one_elsewhere_does_not(tmp_path):
    package = tmp_path / "fusion_kernels"
    shutil.copytree(ROOT / "kernels", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               NUMBA_DEBUG_CACHE="1")  # fmt: skip

    def run():
        """(probe(0), whether the probe was compiled, whether it was loaded)"""
        code = RUN.format(root=str(package))
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stdout.splitlines() if "_probe" in line]
        value = float(done.stdout.split("value")[-1])
        return value, any("data saved" in x for x in lines), any("data loaded" in x for x in lines)

    assert run() == (0.5, True, False)  # compiled into the empty cache
    assert run() == (0.5, False, True)  # loaded
    pool = package / "pool.py"
    pool.write_text(pool.read_text() + "\n# changed\n")  # the probe does not import it
    assert run() == (0.5, False, True)
    approx = package / "simd" / "approx.py"
    text = approx.read_text()
    fit = "return vselect(x < ZERO, t * r, r)"
    assert fit in text
    approx.write_text(text.replace(fit, f"{fit} + ONE"))  # sigmoid(0) is now 1.5
    assert run() == (1.5, True, False)  # compiled again, with the new sigmoid


def test_names_after_a_comment_in_a_parenthesized_import_are_followed(tmp_path, monkeypatch):
    """`from . import (\n a,  # why\n b,\n)`: b is imported too (the comment hid it once)."""
    from fusion_kernels import _cache

    package = Path(_cache.PACKAGE)
    source = package / "_gemm.py"
    fake = tmp_path / "probe_module.py"
    fake.write_text("from . import (\n    _gemm,  # the micro-kernel\n    _winograd,\n)\n")
    monkeypatch.setattr(_cache, "PACKAGE", tmp_path)
    monkeypatch.setattr(
        _cache,
        "module_file",
        lambda name: {
            "fusion_kernels._gemm": source,
            "fusion_kernels._winograd": package / "_winograd.py",
        }.get(name),
    )
    _cache.imported.cache_clear()
    try:
        assert _cache.imported(fake) == {source, package / "_winograd.py"}
    finally:
        _cache.imported.cache_clear()


def test_the_timing_cache_key_names_settings_that_change_the_code(monkeypatch):
    from fusion_kernels.machine import CODE_SETTINGS, cpu_key

    for name in CODE_SETTINGS:  # none in force (a run under NUMBA_CPU_NAME=haswell, say)
        monkeypatch.delenv(name, raising=False)
    plain = cpu_key()
    monkeypatch.setenv("FUSION_SIMD_WIDTH", "16")
    assert cpu_key() == plain + " | FUSION_SIMD_WIDTH=16"


def test_a_cache_save_waits_for_the_lock_other_processes_hold(tmp_path):
    """Two processes adding entries to one index at once can leave it naming the other's machine
    code (numba#4807): every save takes the cache folder's lock, which another process (here,
    another open file description of the lock file) may hold."""
    import fcntl
    import threading

    from numba.core import caching

    import fusion_kernels.config  # noqa: F401 (installs the locked save)

    cache = caching.IndexDataCacheFile(str(tmp_path), "f", (0.0, 0))
    with open(tmp_path / ".kernels-cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saver = threading.Thread(target=cache.save, args=(("key",), b"data"))
        saver.start()
        saver.join(0.5)
        assert saver.is_alive()  # waiting for the lock
        assert cache.load(("key",)) is None
    saver.join(10)
    assert not saver.is_alive() and cache.load(("key",)) == b"data"


def test_each_tile_s_machine_code_is_named_by_its_tiles():
    """Numba names a function's machine code by its qualified name and a counter of the
    process that compiled it. Every tile's closure had one qualified name, so the first tile
    two processes compiled into one cache had one symbol name: a W = 8 cache filled by two
    pytest workers held the 30x1 and 14x2 tiles under one name and ran a conv into NaN, and
    ran right once the names differed. Named by their tiles, no two tiles' symbols can meet."""
    from fusion_kernels import _direct_blocked as d
    from fusion_kernels.simd import lanes
    from fusion_kernels.simd import tile as tiles

    sig = d.tile_signature(lanes(8), lanes(8))
    names = set()
    for rows, cols in [(14, 2), (30, 1)]:
        item = d.tile_item(tiles.tile(rows, cols), tiles.tile(1, cols))
        item.compile(sig)
        compiled = item.overloads[sig.args]
        assert f"item_{rows}x{cols}_1x{cols}" in compiled.fndesc.mangled_name
        names.add(compiled.fndesc.mangled_name)
    assert len(names) == 2
