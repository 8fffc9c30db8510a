"""Interleaved A/B of whole training steps with the reduction in a pool run of its own after
the chunks' calls (Engine(overlap=False)) against the default, where its tasks run in the
calls' run, each as soon as every call's backward has written the gradients it sums: a
worker done with its call sums the last layers' gradients while the others still run
backward through the first ones, and a step hands over to the workers once less. Two
trainers train from one seed in one process, their steps interleaved round by round; they
must end with bitwise equal weights.

    python bench/overlap_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                               [--workers processes] [--group N] [--data-dir DIR]

--group N runs N chunks per call instead of the engine's default (cgp.engine.group_size):
more, smaller calls per worker, as many workers would run (a call of 4 samples, --group 1,
is what each of 16 workers runs per LeNet step).
"""
import argparse

from interleave import ab_pair, add_pair_options, pair_trainer, use_group  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2, group=True)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    args = parser.parse_args()
    use_group(args)
    pair = [pair_trainer(args, args.workers) for _ in range(2)]
    pair[0].engine.overlap = False
    # Both with the update merged into the next run: a reduction in a run of its own cannot
    # take the update along (Trainer.fuse), and the A/B is of the overlap alone.
    pair[1].fuse = False
    ab_pair(pair, ("separate", "overlapped"), args)


if __name__ == "__main__":
    main()
