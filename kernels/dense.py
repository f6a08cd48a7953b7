"""y = x W^T for a small 2-D x: a CNN's classifier head and squeeze-excitation's 1x1 convs.

    y[n, j] = sum_k x[n, k] wt[j, k]      x [N, K], wt [M, K] (W stored by output row)

Why not NumPy's matmul: its BLAS keeps its own threads spinning after each call, on the cores
the next fused kernel needs (a classifier head's matmul made every conv of resnet18 1.5-4x
slower on a 2-core machine). Work items are output columns j, each a dot product per row of x:
disjoint outputs; the K loop vectorizes (FASTMATH reassociates the sum).

    >>> y = dense(x, wt)          # float32 [N, M]
"""

import numba
import numpy as np

from .config import PARALLEL


@numba.jit(**PARALLEL)
def _dense(x, wt, y):
    n_len, k_len = x.shape
    for j in numba.prange(wt.shape[0]):
        for n in range(n_len):
            acc = np.float32(0.0)
            for k in range(k_len):
                acc += x[n, k] * wt[j, k]
            y[n, j] = acc


def dense(x, wt, out=None):
    """x [N, K] float32 times wt [M, K] transposed: [N, M] float32 (into `out` if given)."""
    if x.ndim != 2 or wt.ndim != 2 or x.shape[1] != wt.shape[1]:
        raise ValueError(f"x {x.shape} and wt {wt.shape} do not share the inner size")
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], wt.shape[0]), np.float32) if out is None else out
    if y.size:
        _dense(x, np.ascontiguousarray(wt, dtype=np.float32), y)
    return y
