"""What the kernels need to know about the CPU they run on, read without Numba: cache sizes
(they size the work a kernel keeps hot) and an identity (model, family, ISA) that names a
machine in timing caches and benchmark reports.

    >>> cache_bytes(2)        # 524288 on a Zen 1 core, 1310720 on an Ice Lake server core
    >>> cpu_identity()["isa"] # "avx2+fma"
"""

from __future__ import annotations

import functools
import os
import platform
import re
from pathlib import Path

_DEFAULT_CACHE = {1: 32 * 1024, 2: 512 * 1024, 3: 8 * 1024 * 1024}  # when /sys says nothing
_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


def _parse_size(text: str) -> int | None:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*B?\s*", text, re.IGNORECASE)
    if not m:
        return None
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m[2].upper()]
    return int(m[1]) * scale


@functools.cache
def cache_bytes(level: int) -> int:
    """Size in bytes of one core's data (or unified) cache at `level` (1, 2 or 3)."""
    try:
        for index in sorted(_SYS_CACHE.glob("index*")):
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            size = _parse_size((index / "size").read_text())
            if size:
                return size
    except (OSError, ValueError):
        pass
    return _DEFAULT_CACHE[level]


def vector_isa(flags) -> str:
    """The vector ISA a set of CPU feature names allows ("avx512f+fma", "avx2+fma", "avx",
    ...), named as /proc/cpuinfo names the features; LLVM's names ("sse4.2") work too. The one
    rule: cpu_identity applies it to this CPU, kernels.simd to the CPU Numba compiles for."""
    flags = {f.replace(".", "_") for f in flags}
    isa = [f for f in ("avx512f", "avx2", "fma", "avx", "sse4_2", "neon", "asimd") if f in flags]
    if "avx512f" in isa:
        isa = ["avx512f", "fma"]
    elif "avx2" in isa:
        isa = ["avx2", "fma"] if "fma" in isa else ["avx2"]
    return "+".join(isa[:2]) or platform.machine()


@functools.cache
def cpu_identity() -> dict:
    """model name, vendor, family, model, stepping, the vector ISA the kernels can use, cores."""
    info = {"model_name": platform.processor() or platform.machine(), "vendor": "",
            "family": "", "model": "", "stepping": "", "flags": set()}  # fmt: skip
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    first = text.split("\n\n", 1)[0]
    keys = {"model name": "model_name", "vendor_id": "vendor", "cpu family": "family",
            "model": "model", "stepping": "stepping"}  # fmt: skip
    for line in first.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in keys:
            info[keys[key]] = value.strip()
        elif key == "flags":
            info["flags"] = set(value.split())
    info["isa"] = vector_isa(info.pop("flags"))
    info["cores"] = os.cpu_count() or 1
    info["machine"] = platform.machine()
    return info


# Settings that change the code the kernels run on one CPU (the SIMD width, the CPU Numba
# compiles for): timings taken under them are not this CPU's default code's.
CODE_SETTINGS = ("FUSION_SIMD_WIDTH", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")


def cpu_key() -> str:
    """One line naming the CPU as timing caches key it: model, family/model/stepping, ISA, and
    any of CODE_SETTINGS in force."""
    c = cpu_identity()
    forced = "".join(f" | {k}={os.environ[k]}" for k in CODE_SETTINGS if os.environ.get(k))
    return (f"{c['model_name']} | {c['vendor']} family {c['family']} model {c['model']} "
            f"stepping {c['stepping']} | {c['isa']}{forced}")  # fmt: skip
