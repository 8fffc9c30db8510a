"""Interleaved A/B of whole training steps: each update merged into the next iteration's
pool run (Engine.merge_updates, on two workers or more; an update run of its own on one)
against each update fused into its own iteration's reduction tasks (Engine.fuse_updates,
Trainer.fuse, the default where the solver allows it). Two trainers train from one seed in
one process, their rounds interleaved; they must end with bitwise equal weights.

    python bench/fused_update_ab.py [mnist|cifar10] [--threads 2] [--rounds 15] [--steps 8]
                                    [--workers processes] [--data-dir DIR]
"""
import argparse

from interleave import ab_pair, add_pair_options, pair_trainer  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    args = parser.parse_args()
    merged, fused = pair = [pair_trainer(args, args.workers) for _ in range(2)]
    merged.fuse = False
    if not fused.fuse:
        parser.error("this solver's updates cannot be fused (clip_gradients or iter_size)")
    print(f"workers as {args.workers}")
    ab_pair(pair, ("merged", "fused"), args, runs=[merged.steps, fused.steps])


if __name__ == "__main__":
    main()
