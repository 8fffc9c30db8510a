"""Interleaved A/B of whole training steps: each update in a pool run of its own
(Trainer.step, step after step) against each update merged into the next iteration's run
(Trainer.steps, as Trainer.solve and `cgp bench speedup` ran them before the update was fused
into the reduction: both trainers with Trainer.fuse off; bench/fused_update_ab.py compares the
merged and the fused). Two trainers train from one seed in one process, their rounds
interleaved; they must end with bitwise equal weights.

    python bench/merged_update_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                                     [--workers processes] [--data-dir DIR]
"""
import argparse

from interleave import ab_pair, add_pair_options, pair_trainer  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    args = parser.parse_args()
    pair = [pair_trainer(args, args.workers) for _ in range(2)]
    separate, merged = pair
    separate.fuse = merged.fuse = False
    print(f"workers as {args.workers}")
    ab_pair(pair, ("update runs of their own", "merged"), args,
            runs=[lambda n: [separate.step() for _ in range(n)], merged.steps])


if __name__ == "__main__":
    main()
