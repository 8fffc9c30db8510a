"""Interleaved A/B of whole training steps with another git revision's layer kernels
(kernels/fc.py for InnerProduct, kernels/pool.py for Pooling, kernels/conv.py for Convolution,
each with that revision's tile.py) and its reduction (cgp/comm.py with its cgp/runtime/reduce.py),
against the working tree's; the rest of the package is the working tree's. Two trainers train
from one seed in one process, their steps interleaved round by round; prints the median time
of a step for each, the working tree's speed as the median of the per-round ratios, and
whether their weights came out bitwise equal (a revision whose kernels round otherwise gives
other weights). Worker threads only: the kernels are swapped in this process around each step
of the base trainer, which forked worker processes would not see.

    python bench/step_kernels_ab.py --base REV [mnist|cifar10] [--threads 1] [--rounds 15]
                                    [--steps 8] [--group N] [--data-dir DIR]

--group N makes calls of N chunks: `--threads 1 --group 1` runs a 16-worker step's 16
one-chunk calls (LeNet's 4 samples each) one after another, their kernels' whole work
without 16 cores.
"""
import argparse
import inspect
import sys
import tempfile

import cgp.layers.conv
import cgp.layers.inner_product
import cgp.layers.pool
import cgp.train
# bench/, on the path when run as a script
from interleave import ab_pair, add_pair_options, import_revisions, pair_trainer, use_group

# The layer modules whose kernels module (K: fc, pool, conv) is swapped. (Their scratch is
# sized by the working tree's kernels: a revision whose kernels need more does not fit.)
LAYERS = (cgp.layers.inner_product, cgp.layers.pool, cgp.layers.conv)


def base_modules(rev, folder):
    """The revision's kernels/fc.py, pool.py and conv.py, and its cgp/comm.py with its
    cgp/runtime/reduce.py, importing its own tile.py: (fc, pool, conv, comm) modules."""
    m = import_revisions(rev, ["cgp/runtime/simd.py", "cgp/runtime/reduce.py", "kernels/fc.py",
                               "kernels/pool.py", "kernels/conv.py", "cgp/comm.py"], folder)
    return m["fc"], m["pool"], m["conv"], m["comm"]


def base_communicator(comm):
    """The revision's ThreadCommunicator, taking the working tree engine's plan() arguments:
    a revision before 533975f cuts the reduction's tasks without the engine's layer
    boundaries (the same sums; only which task awaits which layer differs)."""
    if "cuts" in inspect.signature(comm.ThreadCommunicator.plan).parameters:
        return comm.ThreadCommunicator

    class Communicator(comm.ThreadCommunicator):
        def plan(self, bufs, factored=(), cuts=()):
            return super().plan(bufs, factored)
    return Communicator


class BaseKernels:
    """A trainer whose steps run with the base revision's layer kernels: they are swapped into
    the layer modules for the step, and back."""

    def __init__(self, trainer, kernels):
        self.__dict__.update(trainer=trainer, kernels=kernels)

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def step(self):
        own = [module.K for module in LAYERS]
        for module, kernels in zip(LAYERS, self.kernels):
            module.K = kernels
        try:
            return self.trainer.step()
        finally:
            for module, kernels in zip(LAYERS, own):
                module.K = kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=1, group=True)
    parser.add_argument("--base", required=True, help="git revision to compare against")
    args = parser.parse_args()
    use_group(args)
    with tempfile.TemporaryDirectory() as folder:
        try:
            fc, pool, conv, comm = base_modules(args.base, folder)
        except Exception as err:  # git's message, or a revision these files do not fit
            sys.exit(f"step_kernels_ab: {args.base}: {getattr(err, 'stderr', '') or err}")
        own = cgp.train.ThreadCommunicator
        cgp.train.ThreadCommunicator = base_communicator(comm)
        try:
            base = BaseKernels(pair_trainer(args, "threads"), (fc, pool, conv))
        finally:
            cgp.train.ThreadCommunicator = own
        ab_pair([base, pair_trainer(args, "threads")], (args.base, "working tree"), args)


if __name__ == "__main__":
    main()
