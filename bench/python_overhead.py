"""An upper bound on the share of a chunk's time that is Python (layer calls, Numba
dispatch) rather than compiled kernels that release the GIL. Runs one net's forward and
backward on an empty chunk and on a real chunk, single-threaded. The empty chunk also
runs per-chunk kernel work that does not depend on the samples (conv's weight repacking),
which releases the GIL, so the true GIL-held share is lower.

    python bench/python_overhead.py [mnist|cifar10] [--chunks 16]
"""
import argparse
import time

from threadpoolctl import threadpool_limits

from cgp import models
from cgp.layers import Chunk, Factors
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


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
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    sp = read_solver(models.solver_path(args.model))
    sp.net = str(models.FOLDER / sp.net)
    trainer = Trainer(sp, None, RunConfig(chunks=args.chunks, data_dir=args.data_dir),
                      log=lambda line: None)
    net, engine = trainer.net, trainer.engine
    n = engine.bounds[0][1]
    with threadpool_limits(limits=1):
        trainer.step()
        batch = trainer._batch(net, 0, 0)
        ws = engine.workspaces[0]

        group_n = engine.samples(engine.groups[0])[1]

        def grad_views(size):
            # The first chunk's: factored weight gradients take the chunk's rows of their
            # factors, the others the first part of the first group's gradients.
            return [[Factors(v.a[:size * len(v.a) // group_n], v.b[:size * len(v.b) // group_n])
                     if isinstance(v, Factors) else v[:1] for v in layer]
                    for layer in engine.group_grad_views[0]]

        def chunk_pass(size, views):
            chunk = Chunk(n=size, batch=net.batch_size)
            data = net.forward(ws, chunk, batch, engine.params)
            net.backward(ws, chunk, data, engine.params, views)

        empty_views, full_views = grad_views(0), grad_views(n)
        empty = best(lambda: chunk_pass(0, empty_views), 200)
        full = best(lambda: chunk_pass(n, full_views), 10)
    calls = len(net.entries) + sum(e.backward for e in net.entries)
    print(f"{args.model}, {args.chunks} chunks of {n} samples: {calls} layer calls per chunk")
    print(f"  Python overhead per chunk: {empty * 1e6:.0f} us ({empty * 1e6 / calls:.1f} us per call)")
    print(f"  whole chunk (forward+backward): {full * 1e3:.2f} ms")
    print(f"  empty-chunk share: {empty / full:.1%} (an upper bound on the GIL-held share)")
    trainer.close()


if __name__ == "__main__":
    main()
