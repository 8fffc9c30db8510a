"""`cgp compile`: a net's kernels compiled ahead of its first training (at install time, say),
into Numba's on-disk cache, where `cgp train` then finds them. Not here: what the cache
holds or when an entry is stale (cgp.runtime's SourceStamp, Numba's index: the sources,
Numba's version, the CPU), or the compile processes (cgp.runtime.compile).
"""
import time


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
                        "core where there are 2 or more, at most 8)")
    p.set_defaults(run=cmd_compile)


def cmd_compile(args, log=print):
    from cgp.commands.timing import compile_notice
    from cgp.options import solver_file
    from cgp.prototxt import read_solver
    from cgp.runtime.compile import cache_folder, exercise, precompile
    from cgp.train import RunConfig

    if args.model is None and args.solver is None:
        args.model = "mnist"
    path = solver_file(args)
    sp = read_solver(path)
    # Two workers: as processes (the default on Linux) they also wait on kernels of their
    # own (cgp.runtime.spin), compiled in the second call.
    config = RunConfig(threads=2, data_dir=args.data_dir, download=False, progress=False)
    started = time.perf_counter()
    compiled = precompile(sp, path, config, log, args.processes)   # in one or more processes
    with compile_notice(log) as compiling:   # what precompile did not: the workers' own
        exercise(sp, path, config)
    seconds = time.perf_counter() - started
    if compiled or compiling.count:
        log(f"cgp compile: {path}: kernels compiled in {seconds:.1f} s, cached in "
            f"{cache_folder()}")
    else:
        log(f"cgp compile: {path}: every kernel was in the cache already ({cache_folder()})")
    return 0
