"""The layering: imports among project modules go one way (no cycle, function-level imports
included), and `import fusion` + `fusion.rewrite` stay light (no Numba, no benchmark harness,
no change to the environment)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# import name -> folder (kernels/ and patterns/ install as fusion_kernels and fusion_patterns:
# pyproject.toml)
PACKAGES = {"fusion": "fusion", "fusion_kernels": "kernels", "fusion_patterns": "patterns"}
FOLDERS = {folder: name for name, folder in PACKAGES.items()}


def project_modules() -> dict[str, Path]:
    """Module name (as imported) -> file, for every module of the project's packages."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict) -> set[str]:
    """The project modules `name` imports anywhere in its file (functions included). `from a
    import b` is an edge to a.b when that is a module, else to a; never to a's parents."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]  # fmt: skip
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_among_project_modules():
    modules = project_modules()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert sum(len(edges) for edges in graph.values()) > 100  # the walk sees the imports
    assert "fusion.registry" in graph["fusion.rewriter"]  # a top-level edge
    assert "fusion_kernels.conv2d" in graph["fusion_patterns.conv"]  # a function-level (lazy) edge
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_patterns_use_the_engine_only_and_kernels_no_fusion():
    """patterns/ import the pattern language, catalog data, the matcher and the graph view
    (never the registry, rewriter or runtime); kernels/ know nothing of fusion or of the
    catalog."""
    modules = project_modules()
    allowed = {"fusion.pattern", "fusion.catalog", "fusion.matcher", "fusion.graph"}
    for name, path in modules.items():
        found = imported(name, path, modules)
        engine = {m for m in found if m.split(".")[0] == "fusion"}
        if name.startswith("fusion_patterns"):
            assert engine <= allowed, (name, engine - allowed)
        if name.startswith("fusion_kernels"):
            catalog = {m for m in found if m.split(".")[0] == "fusion_patterns"}
            assert not engine and not catalog, (name, engine | catalog)


def test_no_runtime_module_imports_the_session():
    """The session is the runtime's front: the choice, the steps, the feed checks below it take
    what they need as arguments and callables."""
    modules = project_modules()
    for name, path in modules.items():
        if name.startswith("fusion.runtime.") and name != "fusion.runtime.session":
            assert "fusion.runtime.session" not in imported(name, path, modules), name


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


LIGHT = """
import os, sys
before = dict(os.environ)
import numpy as np
from onnx import helper
import fusion
from fusion.models import conv_stack

model = conv_stack(blocks=1, channels=4, size=8)
out = model.graph.output[0]
model.graph.node.append(
    helper.make_node("MaxPool", [out.name], ["pooled"], kernel_shape=[2, 2], strides=[2, 2])
)
out.name = "pooled"
del out.type.tensor_type.shape.dim[:]
result = fusion.rewrite(model)
assert result.counts() == {"ConvBiasRelu": 1, "MaxPool2D": 1}, result.counts()
heavy = sorted(m for m in sys.modules if m == "numba" or m.startswith(("numba.", "fusion.bench")))
assert not heavy, heavy
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
print("light")
"""


def test_import_and_rewrite_load_neither_numba_nor_the_bench_nor_touch_the_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LIGHT)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "light", proc.stderr


def test_the_runtime_applies_the_thread_settings_before_numba_starts():
    """The settings import used to set are set by the first Session with kernels, and a user's
    own value wins."""
    code = """
        import os
        import numpy as np
        import fusion
        from fusion.models import conv_stack
        assert "OMP_WAIT_POLICY" not in os.environ
        fusion.Session(conv_stack(blocks=1, channels=4, size=8), threads=1)
        print(os.environ["OMP_WAIT_POLICY"], os.environ["GOMP_SPINCOUNT"])
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["GOMP_SPINCOUNT"] = "7"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["PASSIVE", "7"]


@pytest.mark.parametrize("switch", ["", "FUSION_MALLOC=0", "MALLOC_ARENA_MAX=2"])
def test_the_runtime_sets_glibc_memory_reuse_unless_told_not_to(switch):
    """The first Session with kernels asks glibc to serve large tensors from its heap and keep
    them (kernels/config.py: a 38.5 MB tensor otherwise faulted in every page on every run);
    FUSION_MALLOC=0 or a MALLOC_* variable of the user's leaves glibc alone. Importing does
    nothing."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    code = """
        import fusion
        import fusion_kernels.config as c
        from fusion.models import conv_stack
        before = c._memory["applied"]
        fusion.Session(conv_stack(blocks=1, channels=4, size=8), threads=1)
        print(before, c._memory["applied"])
    """
    mine = ("FUSION_MALLOC", "GLIBC_TUNABLES")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in mine}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if switch:
        key, value = switch.split("=")
        env[key] = value
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False" if switch else "True"]


def test_kernels_export_every_family_without_shadowing_a_module():
    """Every wrapper kernels/__init__ names exists; each public family module has its exports
    there (or is one whose wrapper shares its name); no export hides a module."""
    code = textwrap.dedent("""
        import importlib, pkgutil, types
        import fusion_kernels
        names = {n: getattr(fusion_kernels, n) for n in fusion_kernels.__all__}
        assert all(callable(v) for v in names.values())
        helpers = {"config", "epilogue", "machine", "simd", "warmup", "windows", "workspace"}
        for info in pkgutil.iter_modules(fusion_kernels.__path__):
            if info.name.startswith("_") or info.name in helpers:
                continue
            module = importlib.import_module(f"fusion_kernels.{info.name}")
            home = {n for n, v in names.items() if getattr(v, "__module__", "") == module.__name__}
            assert home or callable(getattr(module, info.name, None)), info.name
            assert isinstance(getattr(fusion_kernels, info.name), types.ModuleType), info.name
        import fusion_kernels.fire as fire_module
        assert isinstance(fire_module, types.ModuleType)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert done.stdout.strip() == "ok", done.stderr


def test_foreign_top_level_kernels_and_patterns_packages_change_nothing(tmp_path):
    """Hugging Face's `kernels` (transformers 5 requires it), and any other `patterns`, found
    first on the path: fusion's own are `fusion_kernels` and `fusion_patterns` (pyproject.toml's
    package-dir), so a session runs its catalog and kernels all the same. The foreign packages
    here raise when imported: no project module may import a top-level `kernels` or
    `patterns`."""
    for name in ("kernels", "patterns"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('a foreign {name}')\n")
    code = textwrap.dedent("""
        import numpy as np
        import fusion
        from fusion.models import conv_stack
        session = fusion.Session(conv_stack(blocks=1, channels=16, size=8, batch=1), threads=1,
                                 tactics="kernel")
        x = np.ones((1, 16, 8, 8), np.float32)
        (y,) = session.run(None, {session.get_inputs()[0].name: x})
        assert "kernel" in [s.kind for s in session.steps] and y.shape == (1, 16, 8, 8)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)  # fmt: skip
    assert done.stdout.strip() == "ok", done.stderr


def test_no_project_file_imports_a_top_level_kernels_and_every_package_installs():
    """Static: no import of a top-level `kernels` or `patterns` in the project's code, tests or
    bench (they are `fusion_kernels` and `fusion_patterns`); and pyproject.toml's package list
    names every folder that holds an __init__.py (it lists them by hand, as package-dir
    requires)."""
    found = []
    for folder in ("fusion", "kernels", "patterns", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and not node.level else [])  # fmt: skip
                found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                          if n.split(".")[0] in ("kernels", "patterns")]  # fmt: skip
    assert not found, found
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    packages = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    folders = {
        ".".join([FOLDERS[p.parts[0]], *p.parts[1:]])
        for p in (init.parent.relative_to(ROOT) for init in ROOT.glob("*/**/__init__.py"))
        if p.parts[0] in FOLDERS
    }  # fmt: skip
    assert packages == folders
