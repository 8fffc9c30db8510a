"""Interleaved A/B of whole training steps: each update in a pool run of its own
(Trainer.step, step after step) against each update merged into the next iteration's run
(Trainer.steps with Trainer.fuse off, as Trainer.solve ran them before 90877f4); with
--fused, the merged update against each update fused into its own iteration's reduction
tasks (Engine.fuse_updates, Trainer.fuse, the default where the solver allows it). Two
trainers train from one seed in one process, their rounds interleaved; they must end with
bitwise equal weights.

    python bench/merged_update_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                                     [--workers processes] [--fused] [--data-dir DIR]
"""
import argparse

from interleave import ab_pair, add_pair_options, pair_trainer  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    parser.add_argument("--fused", action="store_true",
                        help="compare the merged update with the fused one instead")
    args = parser.parse_args()
    a, b = pair = [pair_trainer(args, args.workers) for _ in range(2)]
    if not b.fuse:
        parser.error("this solver's updates are never fused (clip_gradients or iter_size)")
    a.fuse = False
    print(f"workers as {args.workers}")
    if args.fused:
        ab_pair(pair, ("merged", "fused"), args, runs=[a.steps, b.steps])
    else:
        b.fuse = False
        ab_pair(pair, ("update runs of their own", "merged"), args,
                runs=[lambda n: [a.step() for _ in range(n)], b.steps])


if __name__ == "__main__":
    main()
