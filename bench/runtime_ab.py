"""Interleaved A/B of whole training steps against another git revision's runtime: the
Python that cuts a step into tasks and hands them to the workers (cgp/train.py, engine.py,
procs.py, comm.py, solver.py), the layers and kernels the working tree's. Unlike
engine_ab.py and step_kernels_ab.py, the workers may be processes: the base trainer is built
from the revision's modules before its workers fork. Two trainers train from one seed in one
process, their steps run as Trainer.solve runs them (Trainer.steps, so the revision must
have it) and their rounds interleaved; they must end with bitwise equal weights.

    python bench/runtime_ab.py --base REV [mnist|cifar10] [--threads 2] [--rounds 15]
                               [--steps 8] [--workers processes] [--merged] [--data-dir DIR]

--merged runs both with each update merged into the next step's run (Trainer.fuse off), as
a solver whose Step needs the gradient does (clip_gradients, iter_size > 1).
"""
import argparse
import sys
import tempfile

# bench/, on the path
from interleave import ab_pair, add_pair_options, import_revisions, pair_trainer

# In the order they import each other.
FILES = ["cgp/comm.py", "cgp/engine.py", "cgp/procs.py", "cgp/solver.py", "cgp/train.py"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--base", required=True,
                        help="git revision to compare against, or a folder of its files "
                             "(git archive REV | tar -x -C DIR)")
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    parser.add_argument("--merged", action="store_true",
                        help="each update in the next step's run (Trainer.fuse off)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        try:
            base = import_revisions(args.base, FILES, folder)["train"]
        except Exception as err:  # git's message, or a revision these files do not fit
            sys.exit(f"runtime_ab: {args.base}: {getattr(err, 'stderr', '') or err}")
        pair = [pair_trainer(args, args.workers, base.Trainer, base.RunConfig),
                pair_trainer(args, args.workers)]
    if args.merged:
        for trainer in pair:
            trainer.fuse = False
    print(f"workers as {args.workers}" + (", each update merged into the next run"
                                           if args.merged else ""))
    ab_pair(pair, (args.base, "working tree"), args, runs=[t.steps for t in pair])


if __name__ == "__main__":
    main()
