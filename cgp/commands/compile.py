"""`cgp compile`: a net's kernels compiled ahead of its first training (at install time, say),
into Numba's on-disk cache, where `cgp train` then finds them. Not here: what the cache
holds or when an entry is stale (cgp.runtime's SourceStamp, Numba's index: the sources,
Numba's version, the CPU), or the compile processes (cgp.runtime.compile).
"""
import time
from dataclasses import replace

from threadpoolctl import threadpool_limits


def add_compile(sub):
    p = sub.add_parser(
        "compile", help="compile a net's kernels now, so that its first training starts at once",
        description="Compiles the kernels that training a solver's net calls (its test nets "
                    "too) into Numba's cache beside the package, as a first `cgp train` would: "
                    "a two-worker Trainer runs each test net once and trains two iterations, "
                    "writing no snapshot and no log. Run once after installing; a later change "
                    "of cgp's compiled sources, of Numba or of the CPU makes `cgp train` "
                    "compile again (it never loads code compiled for other sources or another "
                    "CPU).")
    p.add_argument("model", nargs="?", default=None,
                   help="short name of a bundled model (default mnist)")
    p.add_argument("--solver", help="solver prototxt (Caffe's format) instead of a model")
    p.add_argument("--data-dir", default=None,
                   help="folder holding the data set (overrides CGP_DATA_DIR and the bundled copy)")
    p.add_argument("--processes", type=int, default=None, metavar="N",
                   help="share the compiling out among N forked processes (default: one per "
                        "core where there are 4 or more, at most 8)")
    p.set_defaults(run=cmd_compile)


def cmd_compile(args, log=print):
    from cgp.commands.timing import compile_notice
    from cgp.options import solver_file
    from cgp.prototxt import read_solver
    from cgp.runtime.compile import cache_folder, precompile
    from cgp.train import RunConfig

    if args.model is None and args.solver is None:
        args.model = "mnist"
    path = solver_file(args)
    sp = read_solver(path)
    config = RunConfig(threads=2, data_dir=args.data_dir, download=False, progress=False)
    started = time.perf_counter()
    shared = precompile(sp, path, config, log, args.processes)
    with compile_notice(log) as compiling:   # what the processes left, or everything
        exercise(sp, path, config)
    seconds = time.perf_counter() - started
    if shared or compiling.count:
        log(f"cgp compile: {path}: kernels compiled in {seconds:.1f} s, cached in "
            f"{cache_folder()}")
    else:
        log(f"cgp compile: {path}: every kernel was in the cache already ({cache_folder()})")
    return 0


def exercise(sp, path, config):
    """Calls every kernel that training `sp` with `config` calls: each test net once and two
    training iterations, on a Trainer that writes nothing. Two workers at least: workers
    as processes wait on kernels of their own (cgp.runtime.spin)."""
    from cgp.train import Trainer

    trainer = Trainer(sp, path, replace(config, threads=max(2, config.threads), progress=False),
                      log=lambda line: None)
    try:
        with threadpool_limits(limits=1):
            for i in range(len(trainer.test_nets)):
                trainer.test(i)
            trainer.steps(2)
    finally:
        trainer.close()
