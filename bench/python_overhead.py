"""An upper bound on the share of a layer call's time that is Python (layer calls, Numba
dispatch) rather than compiled kernels that release the GIL. Runs one net's forward and
backward over the engine's first call at --threads (a group of chunks, see
cgp.engine.group_size: the more threads, the smaller the calls), with its samples and with
none, single-threaded, with the layer calls bound once as a worker's are (Net.bind), and
for comparison bound anew at every call, as every call built its arguments before
BoundCall. The empty call also runs kernel work that does not depend on the samples (conv's
weight repacking), which releases the GIL, so the true GIL-held share is lower. With N
threads, N such calls each hold the GIL that long, one at a time: when that adds up to more
than one call's time, the interpreter lock, not the cores, sets the pace.

    python bench/python_overhead.py [mnist|cifar10] [--chunks 16] [--threads 1]
"""
import argparse
import time

from threadpoolctl import threadpool_limits

from cgp import models
from cgp.engine import call_chunk
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
from interleave import first_call_grad_views  # bench/, on the path


def best(fn, reps, rounds=5):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="the thread count whose calls to measure (only their size)")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    # Trainer resolves the solver's net relative to the solver file.
    path = models.solver_path(args.model)
    config = RunConfig(chunks=args.chunks, data_dir=args.data_dir, threads=args.threads,
                       workers="threads")
    trainer = Trainer(read_solver(path), path, config, log=lambda line: None)
    net, engine = trainer.net, trainer.engine
    c0, c1 = engine.groups[0]
    bounds = engine.bounds[c0:c1]
    samples = engine.samples(engine.groups[0])[1]
    with threadpool_limits(limits=1):
        trainer.step()
        batch = trainer._batch(trainer.engine, 0, 0)
        ws = engine.workspaces[0]

        def bind(bounds, views):
            chunk = call_chunk(bounds, batch=net.batch_size, batch_tops={})
            return chunk, net.bind(ws, chunk, net.call_views(ws, chunk, batch), engine.params,
                                   views)

        def call(chunk, bound):
            bound.forward(chunk)
            bound.backward(chunk)

        empty_bounds = [(0, 0)] * len(bounds)   # the same parts, no samples
        empty = best(lambda b=bind(empty_bounds, first_call_grad_views(engine, 0)): call(*b),
                     200)
        unbound = best(lambda: call(*bind(empty_bounds, first_call_grad_views(engine, 0))), 200)
        full = best(lambda b=bind(bounds, first_call_grad_views(engine, samples)): call(*b), 10)
    calls = len(net.entries) + sum(e.backward for e in net.entries)
    threads = args.threads
    print(f"{args.model}, {args.chunks} chunks, the engine's calls on {threads} thread(s): "
          f"{len(bounds)} chunks ({samples} samples) per call, {calls} layer calls each")
    print(f"  Python overhead per call: {empty * 1e6:.0f} us "
          f"({empty * 1e6 / calls:.1f} us per layer call; {unbound * 1e6:.0f} us with the "
          f"calls bound anew each time)")
    print(f"  whole call (forward+backward): {full * 1e3:.2f} ms")
    print(f"  empty-call share: {empty / full:.1%} (an upper bound on the GIL-held share)")
    if threads > 1:
        # Each thread's call holds the GIL for `empty` at most; the GIL serves one at a time.
        bound = min(threads, full / empty)
        print(f"  {threads} threads: up to {threads * empty * 1e3:.2f} ms of GIL per round of "
              f"{threads} calls of {full * 1e3:.2f} ms: at most {bound:.1f}x as fast as the same "
              f"calls one after another (efficiency {bound / threads:.2f}), before any other "
              f"cost")
    trainer.close()


if __name__ == "__main__":
    main()
