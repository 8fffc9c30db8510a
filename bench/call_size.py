"""What small calls cost, layer by layer: a call of one chunk (LeNet's 4 samples, a 16-worker
call) against its share of a call of --group chunks (8: LeNet's 32 samples, a 2-worker call),
the same samples' worth, forward and backward per layer, one thread. The two sizes alternate
round by round, so a change of the machine's speed hits both alike; prints medians in
microseconds per one-chunk call, and the difference: the fixed cost of a layer call
(Python, dispatch, work that does not depend on the samples, such as a convolution's weight
repacking) and the weights a small call reads for fewer samples.

    python bench/call_size.py [mnist|cifar10] [--group 8] [--rounds 15] [--data-dir DIR]
"""
import argparse

import numpy as np
from threadpoolctl import threadpool_limits

from cgp.engine import call_chunk
from interleave import first_call_grad_views, grouped_trainer  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--group", type=int, default=8, help="chunks in the large call")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    # One worker thread whose workspace fits the large call.
    trainer = grouped_trainer(args.model, 1, args.group, args.data_dir, workers="threads")
    net, engine = trainer.net, trainer.engine
    c0, c1 = engine.groups[0]
    bounds = engine.bounds[c0:c1]
    samples = engine.samples(engine.groups[0])[1]

    entries = len(net.entries)
    small = bounds[0][1]
    with threadpool_limits(limits=1):
        trainer.step()
        batch = trainer._batch(trainer.engine, 0, 0)
        ws = engine.workspaces[0]
        # (chunks, samples, calls per round): about as many samples each way.
        sizes = [(bounds[:1], small, 4 * len(bounds)), (bounds, samples, 4)]
        # Each size's layer calls bound once, as a worker's are (Net.bind).
        bound = []
        for part, size, _ in sizes:
            chunk = call_chunk(part, batch=net.batch_size, batch_tops={})
            bound.append((chunk, net.bind(ws, chunk, net.call_views(ws, chunk, batch),
                                          engine.params, first_call_grad_views(engine, size))))
        times = [[], []]
        for _ in range(args.rounds):
            for (_, size, reps), (chunk, call), out in zip(sizes, bound, times):
                clock = np.zeros(2 * entries)
                for _ in range(reps):
                    call.forward(chunk, clock=clock[:entries])
                    call.backward(chunk, clock=clock[entries:])
                out.append(clock / reps * small / size)   # per one-chunk call's samples
    alone, share = (np.median(t, axis=0) * 1e6 for t in times)
    print(f"{args.model}: a {small}-sample call alone, and its share of a {samples}-sample call "
          f"(us, medians of {args.rounds} rounds): alone / share / difference")
    for i, entry in enumerate(net.entries):
        f, b = i, entries + i
        print(f"  {entry.layer.name:10s} forward {alone[f]:7.1f} {share[f]:7.1f} "
              f"{alone[f] - share[f]:+7.1f}   backward {alone[b]:7.1f} {share[b]:7.1f} "
              f"{alone[b] - share[b]:+7.1f}")
    print(f"  whole call {alone.sum():.1f} against {share.sum():.1f}: "
          f"{alone.sum() / share.sum():.2f}x the time per sample")
    trainer.close()


if __name__ == "__main__":
    main()
