"""Where the numbers come from: the CPU, the vector ISA the kernels are compiled for, cores
and threads, library versions, load, and the exact command. Every result names it.

    info = machine()          # a dict, the "machine" object of every JSON result
    machine_lines(info)       # the same for a terminal, a Markdown file or a plot's caption
"""

from __future__ import annotations

import os
import platform
import shlex
import sys

import numpy as np
import onnx
import onnxruntime as ort

from fusion_kernels.machine import cpu_identity

ISA = ("avx512f", "avx2", "fma", "avx")  # the vector features the kernels' code can use


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: `fusion bench m.onnx`, `python bench/run.py --quick`."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0]:
        return ""
    head = argv[0]
    if head == "-c":
        head = "python -c"
    elif head.endswith("__main__.py"):  # python -m package
        head = f"python -m {os.path.basename(os.path.dirname(head))}"
    elif head.endswith(".py"):
        head = f"python {os.path.relpath(head) if os.path.isabs(head) else head}"
    else:
        head = os.path.basename(head)
    return " ".join([head, *(shlex.quote(a) for a in argv[1:])])


def _physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs of /proc/cpuinfo (Linux), else None."""
    cores, physical = set(), "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    physical = value.strip()
                elif key.strip() == "core id":
                    cores.add((physical, value.strip()))
    except OSError:
        return None
    return len(cores) or None


def _llvm_target() -> tuple[str, list[str]]:
    """The CPU name LLVM (so Numba) compiles for, and which of ISA it enables."""
    try:
        import llvmlite.binding as ll  # Numba's compiler: what the kernels are built for

        features = ll.get_host_cpu_features()
        return ll.get_host_cpu_name(), [f for f in ISA if features.get(f)]
    except Exception:  # no llvmlite, or a platform it cannot query
        return "", []


def machine(command: str | None = None) -> dict:
    """CPU model name, family/model/stepping (kernels.machine.cpu_identity), the LLVM target
    and vector ISA the kernels are compiled for, cores and threads, versions of the libraries
    timed, load average, and the command line."""
    cpu = cpu_identity()  # the CPU as the kernels and their timing caches name it
    llvm_cpu, isa = _llvm_target()
    try:
        import numba  # heavy: only to report its version

        numba_version = numba.__version__
    except ImportError:
        numba_version = None
    threads = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else threads
    return {
        "cpu": cpu["model_name"],
        "vendor": cpu["vendor"],
        "cpu_family": _int(cpu["family"]),
        "cpu_model": _int(cpu["model"]),
        "stepping": _int(cpu["stepping"]),
        "cpu_isa": cpu["isa"],  # what the CPU offers (its flags)
        "llvm_cpu": llvm_cpu,
        "isa": isa,  # what Numba's code generator enables for the kernels
        "cores": _physical_cores() or threads,
        "threads": threads,
        "usable_threads": usable,
        "nproc": threads,
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "numba": numba_version,
        "onnx": onnx.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": command_line() if command is None else command,
    }


def _int(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() else None


def cpu_line(info: dict) -> str:
    """`AMD EPYC (family 23 model 1 stepping 2, znver1: avx2 fma), 2 cores, 2 threads`."""
    fms = ", ".join(
        f"{k} {info[key]}"
        for k, key in (("family", "cpu_family"), ("model", "cpu_model"), ("stepping", "stepping"))
        if info.get(key) is not None
    )
    target = info.get("llvm_cpu") or ""
    isa = " ".join(info.get("isa") or []) or "no AVX"
    detail = "; ".join(x for x in (fms, f"{target}: {isa}" if target else isa) if x)
    return f"{info['cpu']} ({detail}), {info['cores']} cores, {info['threads']} threads"


def machine_lines(info: dict) -> list[str]:
    """Three lines naming the machine, the libraries and the command."""
    load = " ".join(f"{x:.2f}" for x in info.get("load_average") or [])
    lines = [
        f"CPU: {cpu_line(info)}",
        f"onnxruntime {info['onnxruntime']}, numba {info['numba']}, numpy {info['numpy']}, "
        f"Python {info['python']}" + (f"; load {load}" if load else ""),
    ]
    if info.get("command"):
        lines.append(f"command: {info['command']}")
    return lines
