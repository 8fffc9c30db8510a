"""Interleaved A/B of whole training steps against another git revision's engine
(cgp/engine.py: the Pool, the Engine and how it groups chunks), the rest of the package the
working tree's. Two trainers train from one seed in one process, their steps interleaved
round by round, so a change of the machine's speed hits both alike. Prints the median time
of a step for each and the working tree's speed as the median of the per-round ratios; the
two must end with bitwise equal weights.

    python bench/engine_ab.py --base REV [mnist|cifar10] [--threads 2] [--rounds 15]
                              [--steps 8] [--data-dir DIR]
"""
import argparse
import tempfile

import cgp.procs
import cgp.train
from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
# bench/, on the path when run as a script
from interleave import ab_pair, add_pair_options, import_revision


def base_engine(rev, folder):
    """The engine module of git revision `rev`, imported from a copy in `folder`."""
    return import_revision(rev, "cgp/engine.py", folder, "engine_ab")


class _Programs:
    """A Pool of a revision before cgp.procs.ProcessPool, with the interface that the
    working tree's trainer and communicator use: program(fn), start(), run arguments."""

    def __init__(self, pool):
        self.pool = pool

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def program(self, fn):
        return fn

    def start(self):
        pass

    def run(self, fn, tasks, *args):
        self.pool.run(lambda w, i: fn(w, i, *args), tasks)


def merging(engine_class):
    """An Engine class of a revision before Engine.fuse_updates, with the interface that the
    working tree's trainer uses; the trainer must then merge each update into the next run
    (Trainer.fuse off)."""
    class Merging(engine_class):
        def fuse_updates(self, apply_columns):
            pass

        def run(self, batch, iteration, seed, pending=None, first=None, update=None):
            return super().run(batch, iteration, seed, pending, first)
    return Merging


def trainer(model, threads, data_dir, engine=None):
    """A Trainer whose Engine and Pool come from `engine` (a module; default the working
    tree's)."""
    # Where the trainer finds each: its Engine and group_size in cgp.train, its Pool in
    # cgp.procs (make_pool).
    places = [(cgp.train, "Engine"), (cgp.train, "group_size"), (cgp.procs, "Pool")]
    own = [(module, name, getattr(module, name)) for module, name in places]
    fuses = engine is None or hasattr(engine.Engine, "fuse_updates")
    if engine is not None:
        for module, name in places:
            setattr(module, name, getattr(engine, name))
        if not fuses:
            cgp.train.Engine = merging(engine.Engine)
        if not hasattr(engine.Pool, "program"):
            cgp.procs.Pool = lambda *args, **kw: _Programs(engine.Pool(*args, **kw))
    try:
        path = models.solver_path(model)
        # Threads: a revision's Pool is what is compared.
        config = RunConfig(threads=threads, progress=False, data_dir=data_dir, workers="threads")
        t = Trainer(read_solver(path), path, config, log=lambda line: None)
        t.fuse = t.fuse and fuses
        return t
    finally:
        for module, name, value in own:
            setattr(module, name, value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=2)
    parser.add_argument("--base", required=True, help="git revision to compare against")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        pair = [trainer(args.model, args.threads, args.data_dir, base_engine(args.base, folder)),
                trainer(args.model, args.threads, args.data_dir)]
    ab_pair(pair, (args.base, "working tree"), args)


if __name__ == "__main__":
    main()
