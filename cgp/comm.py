"""Communicators: how the per-chunk gradients of one iteration become one gradient.

The sum runs over chunk index in a fixed binary tree, so the result depends on the
number of chunks alone, never on threads (or, later, on how chunks map to MPI ranks:
a rank will own a contiguous range of chunks).
"""
import numpy as np

from cgp.kernels.reduce import TILE, tree_sum

BLOCK = 1 << 15  # columns per task: large enough to amortise a call, small enough to balance


def blocks(size, block=BLOCK):
    """A fixed cut of range(size) into (lo, hi) blocks; independent of the thread count."""
    return [(lo, min(lo + block, size)) for lo in range(0, size, block)]


class ThreadCommunicator:
    """Tree-sums chunk buffers in parallel over column blocks on a Pool."""

    def __init__(self, pool):
        self.pool = pool
        self._scratch = {}

    def reduce(self, bufs):
        """bufs: (K, P), one row per chunk. Returns the sum, written into row 0."""
        parts = blocks(bufs.shape[1])
        key = (bufs.shape[0], bufs.dtype)
        if key not in self._scratch:  # one tile of partial sums per worker
            self._scratch[key] = np.zeros((self.pool.threads, bufs.shape[0], TILE), bufs.dtype)
        scratch = self._scratch[key]
        self.pool.run(lambda worker, i: tree_sum(bufs, *parts[i], scratch[worker]), len(parts))
        return bufs[0]


def reference_reduce(bufs):
    """The naive reference: the same tree in plain NumPy, one level at a time."""
    bufs = np.array(bufs)
    stride = 1
    while stride < len(bufs):
        for c in range(0, len(bufs) - stride, 2 * stride):
            bufs[c] = bufs[c] + bufs[c + stride]
        stride *= 2
    return bufs[0]
