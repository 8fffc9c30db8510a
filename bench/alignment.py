"""What aligned buffers buy: whole training steps with every engine buffer (blobs, layer
scratch, chunk gradients, factors, the communicator's scratch) on a 64-byte cache line, as the
engine allocates them, against the same buffers 16 bytes past one (where NumPy's own
allocations often land), the two trainers' steps interleaved round by round in one process.
Prints the median time of a step for each and the aligned speed as the median of the
per-round ratios; both train from one seed, and their weights must come out bitwise equal.

    python bench/alignment.py [mnist|cifar10] [--threads 1] [--rounds 15] [--steps 8]
                              [--data-dir DIR]
"""
import argparse

import numpy as np

import cgp.comm
import cgp.engine
import cgp.layers.base
import cgp.net
from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
from interleave import ab_pair, add_pair_options  # bench/, on the path when run as a script

# The modules that allocate engine buffers through aligned_zeros.
ALLOCATORS = (cgp.layers.base, cgp.net, cgp.engine, cgp.comm)
ALIGNED = cgp.layers.base.aligned_zeros


def off_line(shape, dtype, shared=False):
    """Like aligned_zeros, but 16 bytes past a cache line; private memory only (the trainers
    run their workers as threads)."""
    assert not shared
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(size + 128, np.uint8)
    start = -raw.ctypes.data % 64 + 16
    return raw[start:start + size].view(dtype).reshape(shape)


def trainer(model, threads, data_dir, alloc):
    for module in ALLOCATORS:
        module.aligned_zeros = alloc
    try:
        path = models.solver_path(model)
        config = RunConfig(threads=threads, progress=False, data_dir=data_dir, workers="threads")
        return Trainer(read_solver(path), path, config, log=lambda line: None)
    finally:
        for module in ALLOCATORS:
            module.aligned_zeros = ALIGNED


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=1)
    args = parser.parse_args()
    pair = [trainer(args.model, args.threads, args.data_dir, alloc)
            for alloc in (off_line, ALIGNED)]
    ab_pair(pair, ("16 bytes off", "aligned"), args)


if __name__ == "__main__":
    main()
