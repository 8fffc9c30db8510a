"""Interleaved A/B of whole training steps with the calls in threads against the same in
worker processes (`--workers processes`, cgp/procs.py). Two trainers train from one seed in
one process, their steps interleaved round by round, so a change of the machine's speed hits
both alike. Prints the median time of a step for each and the processes' speed as the median
of the per-round ratios; the two must end with bitwise equal weights.

    python bench/workers_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                               [--data-dir DIR]
"""
import argparse

from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
from interleave import ab_pair, add_pair_options  # bench/, on the path when run as a script


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    args = parser.parse_args()
    path = models.solver_path(args.model)
    pair = [Trainer(read_solver(path), path,
                    RunConfig(threads=args.threads, progress=False, data_dir=args.data_dir,
                              workers=workers), log=lambda line: None)
            for workers in ("threads", "processes")]
    ab_pair(pair, ("threads", "processes"), args)


if __name__ == "__main__":
    main()
