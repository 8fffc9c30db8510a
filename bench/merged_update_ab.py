"""Interleaved A/B of whole training steps: each update in a pool run of its own
(Trainer.step, step after step) against each update merged into the next iteration's run
(Trainer.steps, as Trainer.solve and `cgp bench speedup` run them). Two trainers train from
one seed in one process, their rounds interleaved; they must end with bitwise equal weights.

    python bench/merged_update_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                                     [--workers processes] [--data-dir DIR]
"""
import argparse
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
from interleave import add_pair_options, rest  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    args = parser.parse_args()
    path = models.solver_path(args.model)
    pair = [Trainer(read_solver(path), path,
                    RunConfig(threads=args.threads, progress=False, data_dir=args.data_dir,
                              workers=args.workers), log=lambda line: None)
            for _ in range(2)]
    one_by_one, merged = pair

    def separate():
        for _ in range(args.steps):
            one_by_one.step()

    runs = [separate, lambda: merged.steps(args.steps)]
    times = [[], []]
    with threadpool_limits(limits=1):
        for run, t in zip(runs, pair):
            run()   # warm-up
            rest(t)
        for _ in range(args.rounds):
            for run, t, row in zip(runs, pair, times):
                started = time.perf_counter()
                run()
                row.append(time.perf_counter() - started)
                rest(t)
    ratio = statistics.median(a / b for a, b in zip(*times))
    same = np.array_equal(one_by_one.net.params, merged.net.params)
    for t in pair:
        t.close()
    a_ms, b_ms = (1e3 * statistics.median(row) / args.steps for row in times)
    print(f"{args.model}, {args.threads} {args.workers}, {args.rounds} rounds of {args.steps} "
          f"steps: update runs of their own {a_ms:.2f} ms, merged {b_ms:.2f} ms per step; "
          f"merged x{ratio:.3f} as fast; same weights: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
