"""Buffers for the engine: aligned to cache lines, and shared with forked worker processes
where they must be."""
import mmap

import numpy as np


# Bytes every engine buffer's first element is aligned to: a vector load or store that
# straddles two cache lines costs two, and NumPy aligns its allocations to 16 bytes only, so
# the same buffer would run at one speed in one process and at another in the next.
ALIGN = 64


def aligned_zeros(shape, dtype, shared=False):
    """np.zeros(shape, dtype) whose data starts on an ALIGN-byte boundary. shared: in an
    anonymous shared mapping (page-aligned), which processes forked later share with this
    one: the buffers worker processes write (cgp.runtime.procs)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if shared:
        # The array's base keeps the mapping alive; the pages go when the last view does.
        return np.frombuffer(mmap.mmap(-1, max(size, 1)), np.uint8, size).view(dtype).reshape(shape)
    raw = np.zeros(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size].view(dtype).reshape(shape)
