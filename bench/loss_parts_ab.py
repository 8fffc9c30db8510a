"""Interleaved A/B of whole training steps with the SoftmaxWithLoss layer run once per part of
a call, by the layer of another git revision (cgp/layers/loss.py, from before it took a
call's parts at once: Layer.takes_parts), against the working tree's, which runs once per
call. Everything else is the working tree's. Two trainers train from one seed in one
process, their steps interleaved round by round, so a change of the machine's speed hits both
alike. Prints the median time of a step for each and the working tree's speed as the median
of the per-round ratios; the two must end with bitwise equal weights.

    python bench/loss_parts_ab.py --base REV [mnist|cifar10] [--threads 2] [--rounds 15]
                                  [--steps 8] [--data-dir DIR]
"""
import argparse
import sys
import tempfile

from cgp.layers.base import REGISTRY
# bench/, on the path
from interleave import ab_pair, add_pair_options, import_revision, pair_trainer


def base_loss_layer(rev, folder):
    """SoftmaxWithLoss of git revision `rev`, imported from a copy in `folder` without
    registering it in place of the working tree's."""
    registered = dict(REGISTRY)
    module = import_revision(rev, "cgp/layers/loss.py", folder, "loss_parts_ab")
    REGISTRY.clear()
    REGISTRY.update(registered)
    if getattr(module.SoftmaxWithLoss, "takes_parts", False):
        sys.exit(f"loss_parts_ab: the loss layer of {rev} already takes a call's parts at once")
    return module.SoftmaxWithLoss


def per_part(trainer, old):
    """Runs the trainer's loss layers one part at a time with the methods of class `old`,
    and gives its workers the per-part scratch that takes."""
    net, engine = trainer.net, trainer.engine
    for i, entry in enumerate(net.entries):
        if entry.layer.type_name == "SoftmaxWithLoss":
            entry.layer.forward = old.forward.__get__(entry.layer)
            entry.layer.backward = old.backward.__get__(entry.layer)
            net.whole_calls[i] = False
    engine.workspaces = [engine.new_workspace() for _ in engine.workspaces]
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--base", required=True, help="git revision to compare against")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        old = base_loss_layer(args.base, folder)
    ab_pair([per_part(pair_trainer(args, "threads"), old), pair_trainer(args, "threads")],
            (f"{args.base}'s loss", "working tree"), args)


if __name__ == "__main__":
    main()
