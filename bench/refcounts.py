"""Which compiled kernels still take reference counts per call of an inlined helper: functions
whose optimized LLVM IR calls NRT_incref/NRT_decref on an inlined callee's arguments (the calls
LLVM's inliner marks !noalias). A jitted function given an array increfs it on entry and
decrefs it on exit; inlined into a loop, Numba's pruning pass usually removes the pair, but not
across a callee's branches (a register tile's store with its residual cases): two atomic calls
per tile, which cost a 1x1 conv 3-5 us a call and the blocked Winograd conv 6-30% of its
time (bench/NOTES.md, "Reference counts in the tiles' stores"). The cure is
kernels.simd.borrow.

    .venv/bin/python bench/refcounts.py [--groups blocked_conv_f2 blocked_depthwise ...]

Compiles the named warm-up groups (kernels.warmup.GROUPS, all by default) in this process,
into a fresh Numba cache (code loaded from a cache cannot be inspected), and prints each
flagged function with its count; nothing when none is. A finding to read, not a test: a
count in code that runs once per call (a driver's set-up) costs nothing.
"""

import argparse
import gc
import os
import re
import sys
import tempfile

COUNTED = re.compile(r"call void @NRT_(?:in|de)cref\([^)]*\), !noalias")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", nargs="*", help="warm-up groups (default: all)")
    args = parser.parse_args(argv)
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="refcounts-")
    import numba

    from fusion_kernels import warmup

    for name in args.groups or list(warmup.GROUPS):
        print(f"compiling {name}", file=sys.stderr, flush=True)
        warmup.GROUPS[name]()
    found = []
    for d in gc.get_objects():
        if isinstance(d, numba.core.registry.CPUDispatcher) and d.overloads:
            for ir in d.inspect_llvm().values():
                n = len(COUNTED.findall(ir))
                if n:
                    found.append((n, f"{d.py_func.__module__}.{d.py_func.__qualname__}"))
    for n, name in sorted(set(found), key=lambda f: (-f[0], f[1])):
        print(f"{n:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
