"""Data layer kernels: Caffe's DataTransformer arithmetic over a batch of records.

Records arrive as (N, D) rows, D = C*H*W, of uint8 or float32 (uint8 values convert to
float32 exactly). One compiled pass writes the float32 batch: NumPy's conversion and then its
operations, one pass each, took longer, and the main process reads each batch while the
workers wait for it or beside its own share of their work.
"""
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def transform(x, mean, scale, out):
    """x: (N, D) uint8 or float32 records; mean: (D,) float32, or (0,) for none; scale: a
    float32 scalar; out: (N, D) float32. out = (float32(x) - mean) * scale, Caffe's order,
    each operation rounded to float32 (a scale of 1 multiplies exactly, as if skipped)."""
    N, D = x.shape
    if mean.size == 0:
        for n in range(N):
            for d in range(D):
                out[n, d] = np.float32(x[n, d]) * scale
    else:
        for n in range(N):
            for d in range(D):
                out[n, d] = (np.float32(x[n, d]) - mean[d]) * scale
