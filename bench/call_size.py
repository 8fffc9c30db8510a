"""What a layer call costs by its size, layer by layer, forward and backward, one thread: an
empty call (no samples: the layer calls' Python, Numba's dispatch, and kernel work that does
not depend on the samples, such as a convolution's weight repacking), a call of one chunk
(LeNet's 4 samples of 16 chunks: the call each of 16 workers makes), and that chunk's share
of a call of --group chunks (8: LeNet's 32 samples, a 2-worker call), the same samples'
worth. The sizes alternate within each round, so that a change of the machine's speed hits
them all alike; prints medians over the rounds in microseconds per one-chunk call, and the
difference between the small call and its share of the large one: what a small call pays
for its size (the fixed cost, and the weights it reads for fewer samples).

The empty call's time is also an upper bound on the part of a call that holds the
interpreter lock (part of it is compiled work that releases it): N worker threads, each
making such calls, run at most (one-chunk call / empty call) times as fast as one, whatever
the cores; worker processes have no such bound.

    python bench/call_size.py [mnist|cifar10] [--chunks 16] [--group 8] [--rounds 15]
                              [--data-dir DIR]

Each call is laid out for its size as a worker's call is (Net.forward and Net.backward over
a Workspace), on the net's initial weights and its first batch; parameter gradients are kept
per chunk, and weights that the engine lets hand their gradient over as factors (Net.factorable:
InnerProduct's rows of dy and x) do so, as in training.
"""
import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from cgp import models
from cgp.engine import chunk_bounds
from cgp.layers import Chunk, Factors
from cgp.net import RunOptions, Workspace, build_net
from cgp.proto import caffe_pb2
from cgp.prototxt import read_net, read_solver
from cgp.runtime.memory import aligned_zeros


def load_net(model, data_dir, seed=1701):
    """The TRAIN net of a bundled model with its initial weights, and its first batch
    (source blob id -> array)."""
    path = models.FOLDER / read_solver(models.solver_path(model)).net
    net = build_net(read_net(path), str(path), caffe_pb2.TRAIN, RunOptions(data_dir))
    net.init_params(seed)
    batch = {}
    for entry in net.sources:
        for blob, array in zip(entry.tops, entry.layer.load(0, 0, seed)):
            batch[blob] = np.asarray(array, np.float32)
    return net, batch


def call_chunk(net, bounds, batch):
    """The Chunk of one call over consecutive chunks, bounds [(first, n), ...], each a part."""
    first, n = bounds[0][0], sum(size for _, size in bounds)
    return Chunk(n=n, first=first, batch=net.batch_size, batch_tops=net.batch_tops(batch),
                 part_starts=tuple(f - first for f, _ in bounds) + (n,))


def grad_views(net, grads, bounds):
    """Per entry the views that a call of these parts adds its parameter gradients into:
    rows of `grads` (parts, n_params), and for each factorable weight (Net.factorable) a
    Factors for the call's rows of its two factors, as the engine hands them over."""
    views = net.param_views(grads[:len(bounds)])
    samples = sum(n for _, n in bounds)
    for index in net.factorable:
        rows, J, L = net.entries[index].layer.factor_shape()
        views[index][0] = Factors(aligned_zeros((samples * rows, J), np.float32),
                                  aligned_zeros((samples * rows, L), np.float32))
    return views


def time_calls(net, batch, layouts, rounds):
    """layouts: {name: (bounds of its parts, calls per round)}. Runs each layout's forward
    and backward `calls` times per round, the layouts in turn; returns {name: per round, the
    seconds per call of each layer, forward then backward ((rounds, 2 * layers))}."""
    parts = max(len(bounds) for bounds, _ in layouts.values())
    ws = Workspace(net, max(sum(n for _, n in b) for b, _ in layouts.values()), parts=parts,
                   part_max=max(n for b, _ in layouts.values() for _, n in b))
    params = net.param_views(net.params)
    grads = np.zeros((parts, net.n_params), np.float32)   # a row per part, as in the engine
    layers = len(net.entries)
    times = {name: [] for name in layouts}
    for _ in range(rounds):
        for name, (bounds, calls) in layouts.items():
            chunk = call_chunk(net, bounds, batch)
            diffs = grad_views(net, grads, bounds)
            clock = np.zeros(2 * layers)
            for _ in range(calls):
                data = net.forward(ws, chunk, batch, params, clock=clock[:layers])
                net.backward(ws, chunk, data, params, diffs, clock=clock[layers:])
            times[name].append(clock / calls)
    return {name: np.array(rows) for name, rows in times.items()}


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--chunks", type=int, default=16, help="the batch's fixed split")
    parser.add_argument("--group", type=int, default=8, help="chunks in the large call")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    if not 1 <= args.group <= args.chunks:
        parser.error(f"--group must be 1 to --chunks ({args.chunks})")
    return args


def main():
    args = parse_args()
    net, batch = load_net(args.model, args.data_dir)
    bounds = chunk_bounds(net.batch_size, args.chunks)
    group = min(args.group, len(bounds))   # a batch smaller than --chunks has fewer
    small, large = bounds[0][1], sum(n for _, n in bounds[:group])
    # About as many samples per round at each size; the empty call as often as the small.
    layouts = {"empty": ([(0, 0)], 4 * group), "small": (bounds[:1], 4 * group),
               "large": (bounds[:group], 4)}
    with threadpool_limits(limits=1):
        time_calls(net, batch, layouts, 1)   # warm-up: compilation, first touches
        started = time.perf_counter()
        times = time_calls(net, batch, layouts, args.rounds)
        seconds = time.perf_counter() - started
    per_call = {name: np.median(rows, axis=0) * 1e6 for name, rows in times.items()}
    empty, alone = per_call["empty"], per_call["small"]
    share = per_call["large"] * small / large   # per one-chunk call's samples
    layers = len(net.entries)
    print(f"{args.model}, {args.chunks} chunks: an empty call, a {small}-sample call, and its "
          f"share of a {large}-sample call ({group} chunks); us per call, medians of "
          f"{args.rounds} rounds ({seconds:.1f} s)")
    print(f"  {'layer':10s} {'forward: empty':>15s} {'alone':>7s} {'share':>7s} {'diff':>7s}"
          f"   {'backward: empty':>15s} {'alone':>7s} {'share':>7s} {'diff':>7s}")
    for i, entry in enumerate(net.entries):
        cells = []
        for k in (i, layers + i):
            cells.append(f"{empty[k]:15.1f} {alone[k]:7.1f} {share[k]:7.1f} "
                         f"{alone[k] - share[k]:+7.1f}")
        print(f"  {entry.layer.name:10s} {cells[0]}   {cells[1]}")
    e, a, s = empty.sum(), alone.sum(), share.sum()
    print(f"  whole call: empty {e:.1f}, alone {a:.1f}, share {s:.1f}: the {small}-sample call "
          f"takes {a / s:.2f}x the time per sample")
    print(f"  the empty call is {e / a:.1%} of the {small}-sample call (an upper bound on its "
          f"share that holds the interpreter lock): {args.chunks} worker threads making such "
          f"calls run at most {min(args.chunks, a / e):.1f}x as fast as one")


if __name__ == "__main__":
    main()
