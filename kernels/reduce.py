"""Gradient reduction kernels: the fixed-order sum of per-chunk gradient buffers.

Only the order of additions matters for bitwise results, never which thread adds:
each kernel call handles a column range [lo, hi) of every buffer, and any cut of the
columns gives the same sums.
"""
from numba import njit


@njit(cache=True, nogil=True)
def tree_sum(bufs, lo, hi):
    """bufs: (K, P) chunk gradients. Sums rows pairwise in a fixed binary tree over the
    chunk index (stride 1, 2, 4, ...) for columns [lo, hi); the total ends in bufs[0]."""
    k = bufs.shape[0]
    stride = 1
    while stride < k:
        for c in range(0, k - stride, 2 * stride):
            a = bufs[c]
            b = bufs[c + stride]
            for j in range(lo, hi):
                a[j] += b[j]
        stride *= 2


@njit(cache=True, nogil=True)
def add_into(total, part, lo, hi):
    """total[lo:hi] += part[lo:hi] (gradient accumulation over iter_size passes)."""
    for j in range(lo, hi):
        total[j] += part[j]
