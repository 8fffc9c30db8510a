"""What aligned buffers buy: whole training steps with every engine buffer (blobs, layer
scratch, chunk gradients, factors, the communicator's scratch) on a 64-byte cache line, as the
engine allocates them, against the same buffers 16 bytes past one (where NumPy's own
allocations often land), the two trainers' steps interleaved round by round in one process.
Prints the median time of a round of steps for each and the aligned speed as the median of the
per-round ratios; both train from one seed, and their weights must come out bitwise equal.

    python bench/alignment.py [mnist|cifar10] [--threads 1] [--rounds 15] [--steps 8]
                              [--data-dir DIR]
"""
import argparse
import statistics

import numpy as np

import cgp.comm
import cgp.engine
import cgp.layers.base
import cgp.net
from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
from interleave import interleaved_rounds  # bench/, on the path when run as a script

# The modules that allocate engine buffers through aligned_zeros.
ALLOCATORS = (cgp.layers.base, cgp.net, cgp.engine, cgp.comm)
ALIGNED = cgp.layers.base.aligned_zeros


def off_line(shape, dtype):
    """Like aligned_zeros, but 16 bytes past a cache line."""
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
        config = RunConfig(threads=threads, progress=False, data_dir=data_dir)
        return Trainer(read_solver(path), path, config, log=lambda line: None)
    finally:
        for module in ALLOCATORS:
            module.aligned_zeros = ALIGNED


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    pair = [trainer(args.model, args.threads, args.data_dir, alloc)
            for alloc in (ALIGNED, off_line)]
    times = interleaved_rounds(pair, args.rounds, args.steps)
    ratio = statistics.median(b / a for a, b in zip(*times))
    same = np.array_equal(pair[0].net.params, pair[1].net.params)
    print(f"{args.model}, {args.threads} thread(s), {args.rounds} rounds of {args.steps} steps: "
          f"aligned {1e3 * statistics.median(times[0]):.1f} ms, 16 bytes off "
          f"{1e3 * statistics.median(times[1]):.1f} ms; aligned x{ratio:.3f} as fast; "
          f"same weights: {'yes' if same else 'NO'}")
    for t in pair:
        t.close()


if __name__ == "__main__":
    main()
