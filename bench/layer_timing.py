"""Forward and backward time of each Convolution, Pooling and InnerProduct layer of LeNet
(batch 64) and cifar10_quick (batch 100), one thread, BLAS pinned to one thread.

The layers come from the shipped model prototxts, shapes chained from the data layer's. The
batch runs as `--chunks` pieces one after another, as one engine worker would run them
(cgp's default is 16 chunks; 1 is the whole batch at once). Prints a table of milliseconds
per whole batch: the best of `--reps` runs.

    python bench/layer_timing.py [--chunks 16] [--reps 20] [--net lenet|cifar10_quick]
"""
import argparse
import time
from importlib import resources

import numpy as np
from google.protobuf import text_format
from threadpoolctl import threadpool_limits

from cgp.engine import chunk_bounds
from cgp.layers import REGISTRY, Chunk, alloc_scratch
from cgp.proto import caffe_pb2

NETS = {"lenet": ("lenet_train_test.prototxt", (64, 1, 28, 28)),
        "cifar10_quick": ("cifar10_quick_train_test.prototxt", (100, 3, 32, 32))}
TYPES = ("Convolution", "Pooling", "InnerProduct")


def layers_of(net):
    """(layer, bottom shape) for every layer of TYPES in a chain net, TRAIN phase."""
    name, shape = NETS[net]
    text = resources.files("cgp.models").joinpath(name).read_text()
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    out = []
    for i, lp in enumerate(param.layer):
        if lp.type not in TYPES:
            continue
        layer = REGISTRY[lp.type](lp, index=i)
        top = tuple(layer.setup([shape])[0])
        out.append((layer, shape))
        shape = top
    return out


def time_layer(layer, shape, chunks, reps, first):
    """Best-of-reps (forward ms, backward ms) over one batch cut into `chunks` pieces."""
    rng = np.random.default_rng(0)
    batch = shape[0]
    bounds = chunk_bounds(batch, chunks)
    n_max = max(n for _, n in bounds)
    top_shape = layer.setup([shape])[0]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(top_shape).astype(np.float32)
    params = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in layer.param_shapes()]
    diffs = [np.zeros((1,) + p.shape, np.float32) for p in params]   # one part per chunk
    top = np.zeros(top_shape, np.float32)
    dx = np.zeros(shape, np.float32)
    scratch = alloc_scratch(layer, n_max, np.float32)
    best_f = best_b = float("inf")
    for _ in range(reps):
        t_f = t_b = 0.0
        for lo, n in bounds:
            chunk = Chunk(n=n, first=lo, batch=batch)
            xs, ts = x[lo:lo + n], top[lo:lo + n]
            t0 = time.perf_counter()
            layer.forward([xs], [ts], params, scratch, chunk)
            t1 = time.perf_counter()
            # The first layer's bottom is data: no gradient flows into it.
            layer.backward([ts], [dy[lo:lo + n]], [xs], [None if first else dx[lo:lo + n]],
                           params, diffs, scratch, chunk)
            t2 = time.perf_counter()
            t_f += t1 - t0
            t_b += t2 - t1
        best_f, best_b = min(best_f, t_f), min(best_b, t_b)
    return best_f * 1e3, best_b * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--net", choices=sorted(NETS), action="append")
    args = ap.parse_args()
    with threadpool_limits(limits=1):
        for net in args.net or sorted(NETS):
            entries = layers_of(net)
            batch = entries[0][1][0]
            print(f"\n{net}: batch {batch} in {len(chunk_bounds(batch, args.chunks))} chunk(s), "
                  f"1 thread, best of {args.reps}")
            print(f"{'layer':<8} {'bottom -> top':<36} {'fwd ms':>8} {'bwd ms':>8} {'total':>8}")
            total = 0.0
            for i, (layer, shape) in enumerate(entries):
                layer.setup([shape])  # compile outside the timing
                time_layer(layer, shape, args.chunks, 1, i == 0)
                f, b = time_layer(layer, shape, args.chunks, args.reps, i == 0)
                total += f + b
                top = tuple(layer.setup([shape])[0])
                print(f"{layer.name:<8} {str(shape[1:]) + ' -> ' + str(top[1:]):<36} "
                      f"{f:8.3f} {b:8.3f} {f + b:8.3f}")
            print(f"{'all':<45} {total:>26.3f}")


if __name__ == "__main__":
    main()
