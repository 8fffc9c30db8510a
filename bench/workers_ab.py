"""Interleaved A/B of whole training steps with the workers as threads against the same as
worker processes (`--workers processes`, cgp/procs.py). Two trainers train from one seed in
one process, their steps interleaved round by round, so a change of the machine's speed hits
both alike. Prints the median time of a step for each and the processes' speed as the median
of the per-round ratios; the two must end with bitwise equal weights.

    python bench/workers_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                               [--chunks 16] [--group N] [--data-dir DIR]

--group N runs N chunks per call instead of the engine's default (cgp.engine.group_size):
small calls, whose share of Python is large, show what the interpreter lock costs threads
(a call of 4 samples, --chunks 16 --group 1, is what each of 16 workers runs per LeNet step).
"""
import argparse

from interleave import ab_pair, add_pair_options, pair_trainer, use_group  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2, group=True)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    use_group(args)
    pair = [pair_trainer(args, workers, chunks=args.chunks)
            for workers in ("threads", "processes")]
    ab_pair(pair, ("threads", "processes"), args)


if __name__ == "__main__":
    main()
