"""Interleaved A/B of whole training steps with the next batch read during the update (the
caller's own work while the workers update the weights: Trainer._read_ahead) against the
batch read at the start of the step, when no worker has anything to do. Two trainers train
from one seed in one process, their steps interleaved round by round, so a change of the
machine's speed hits both alike. Prints the median time of a step for each, the read-ahead's
speed as the median of the per-round ratios (the two must end with bitwise equal weights),
and each one's serial time per step: the caller's time outside the pool's runs, which no
worker count divides.

    python bench/read_ahead_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                                  [--workers processes|threads] [--data-dir DIR]
"""
import argparse
import time

from cgp.train import Trainer
# bench/, on the path when run as a script
from interleave import ab_pair, add_pair_options, pair_trainer


class ReadAtStart(Trainer):
    """A Trainer that reads every batch when the step needs it."""

    def _read_ahead(self, it):
        pass


def time_outside_runs(trainer):
    """Makes the trainer add up its steps' wall time and the part of it inside the pool's
    runs; returns the counter [seconds inside runs, steps, seconds of steps]."""
    counter = [0.0, 0, 0.0]
    run, step = trainer.pool.run, trainer.step

    def timed_run(*args, **kw):
        started = time.perf_counter()
        try:
            return run(*args, **kw)
        finally:
            counter[0] += time.perf_counter() - started

    def timed_step():
        started = time.perf_counter()
        try:
            return step()
        finally:
            counter[1] += 1
            counter[2] += time.perf_counter() - started
    trainer.pool.run, trainer.step = timed_run, timed_step
    return counter


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--workers", default=None, choices=("threads", "processes"),
                        help="how the workers run (default: the trainer's default)")
    args = parser.parse_args()
    pair = [pair_trainer(args, args.workers, kind) for kind in (ReadAtStart, Trainer)]
    counters = [time_outside_runs(t) for t in pair]
    ab_pair(pair, ("read at the start", "read ahead"), args)
    for name, (inside, steps, total) in zip(("read at the start", "read ahead"), counters):
        print(f"  {name}: {1e3 * (total - inside) / steps:.3f} ms per step outside the "
              f"pool's runs (the mean over all {steps} of its steps, warm-up included)")


if __name__ == "__main__":
    main()
