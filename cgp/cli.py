"""The command line: `python -m cgp train ...` and friends. Parses options, builds the
objects and prints results; user mistakes end in one message and exit status 2."""
import argparse
import os
import sys
import time

import psutil

from cgp.bench import add_bench
from cgp.errors import CgpError, shorten
from cgp.timing import add_time, compile_notice

EPILOG = "Models: mnist (LeNet), cifar10 (cifar10_quick), cifar10_full; or --solver FILE."


def add_denormals_option(p):
    p.add_argument("--denormals", choices=("flush", "keep"), default="flush",
                   help="subnormal floats (below 1.2e-38): 'flush' them to zero (default, as "
                        "TensorFlow does; arithmetic on them is many times slower) or 'keep' "
                        "them (IEEE, as Caffe). Results depend on this, never on --threads")


WORKERS = ("threads", "processes")


def add_workers_option(p, listed=False):
    """--workers; None when not given: cgp.procs.default_workers() (imported only to run)."""
    if listed:
        p.add_argument("--workers", default=None,
                       help="'threads', 'processes' or both, comma-separated: every thread count "
                            "runs with its workers as each (default: processes on Linux, "
                            "threads elsewhere)")
    else:
        p.add_argument("--workers", choices=WORKERS, default=None,
                       help="run the --threads workers as forked processes (Linux, macOS), "
                            "which never wait for each other's Python interpreter lock, or as "
                            "threads of this process (default: processes on Linux, threads "
                            "elsewhere). Results are identical either way")


def add_run_options(p, threads_list=False):
    """How a run executes: --threads and --affinity never change what it computes;
    --chunks and --denormals do, the same for every thread count."""
    if threads_list:
        p.add_argument("--threads", default="1,2,3,4",
                       help="comma-separated thread counts to compare (default 1,2,3,4)")
    else:
        p.add_argument("--threads", type=int, default=1,
                       help="workers (default 1; processes or threads: --workers); results are "
                            "identical for any value")
    p.add_argument("--chunks", type=int, default=16,
                   help="fixed pieces each batch is cut into (default 16). Results depend on "
                        "this, never on --threads; at most this many threads do useful work")
    p.add_argument("--affinity", action="store_true",
                   help="pin each worker to its own core (Linux)")
    add_workers_option(p, listed=threads_list)
    add_denormals_option(p)
    p.add_argument("--data-dir", default=None,
                   help="folder holding the data set (overrides CGP_DATA_DIR and the bundled copy)")
    p.add_argument("--no-download", action="store_true",
                   help="never download a missing data set")


def add_train(sub):
    p = sub.add_parser("train", help="train a network from a solver prototxt", epilog=EPILOG)
    p.add_argument("model", nargs="?", help="short name of a bundled model (mnist, cifar10, ...)")
    p.add_argument("--solver", help="solver prototxt (Caffe's format)")
    add_run_options(p)
    p.add_argument("--seed", type=int, default=None, help="overrides the solver's random_seed")
    p.add_argument("--iters", type=int, default=None,
                   help="train to this iteration instead of the solver's max_iter (which "
                   "still sets the poly policy's schedule)")
    p.add_argument("--weights", help="fine-tune from .caffemodel file(s), comma-separated, copied "
                   "by layer name (replaces the solver's `weights`)")
    p.add_argument("--snapshot", help="resume from a .solverstate")
    p.add_argument("--snapshot-prefix", default=None,
                   help="where snapshots go (overrides the solver's snapshot_prefix)")
    for name, default in (("sigint", "stop"), ("sighup", "snapshot"), ("sigterm", "stop")):
        p.add_argument(f"--{name}-effect", default=default, choices=("stop", "snapshot", "none"),
                       help=f"what {name.upper()} does, after the current iteration (default "
                            f"{default}; 'stop' snapshots too, as Caffe's)"
                            + ("; batch schedulers (Slurm, PBS) send SIGTERM before they kill "
                               "a job" if name == "sigterm" else ""))
    p.set_defaults(run=cmd_train)


def denormals_text(flush):
    from cgp.kernels import fpenv
    if not flush:
        return "subnormals kept (IEEE)"
    if fpenv.SUPPORTED:
        return "subnormals flushed to zero"
    return "subnormals kept: flushing them needs an x86-64 CPU"


def solver_file(args):
    from cgp.models import solver_path
    if args.solver and args.model:
        raise CgpError("give a model name or --solver, not both")
    if args.solver:
        return args.solver
    if args.model:
        return str(solver_path(args.model))
    raise CgpError("name a model (mnist, cifar10, cifar10_full) or give --solver FILE")


def physical_cores():
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


# Thread workers beyond which more ran slower on the 16-core machine measured (README, "On 16
# cores": LeNet 2.21x one thread at 4 threads, 2.08x at 8, 0.78x at 16): they share one
# interpreter lock, which each call's Python takes.
THREAD_WORKERS_SCALE = 4


def check_threads(threads, log, workers=None):
    """Warns of a --threads that cannot be faster: more than the physical cores, or, with
    workers "threads", more than THREAD_WORKERS_SCALE; refuses fewer than 1, before any
    work (loading weights, building nets)."""
    if threads < 1:
        raise CgpError(f"--threads must be at least 1, got {threads}")
    cores = physical_cores()
    if threads > cores:
        log(f"Warning: --threads {threads} exceeds the {cores} physical cores of this "
            "machine; results stay identical, speed will not improve")
    if workers == "threads" and threads > THREAD_WORKERS_SCALE:
        log(f"Warning: --threads {threads} with --workers threads: past "
            f"{THREAD_WORKERS_SCALE} threads, workers that share the interpreter lock ran "
            "slower, not faster, on 16 cores; --workers processes scales further, with "
            "identical results")


def cmd_train(args, log=print):
    from cgp.procs import worker_noun
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig, Trainer

    path = solver_file(args)
    sp = read_solver(path)
    if args.snapshot and args.weights:
        raise CgpError("give --snapshot to resume training or --weights to fine-tune, not both")
    if args.snapshot or args.weights:   # as Caffe: they replace the solver's `weights`
        sp.ClearField("weights")
    if args.weights:
        sp.weights.append(args.weights)
    config = RunConfig(threads=args.threads, chunks=args.chunks, seed=args.seed,
                       data_dir=args.data_dir, download=not args.no_download,
                       max_iter=args.iters, snapshot_prefix=args.snapshot_prefix,
                       affinity=args.affinity, sigint_effect=args.sigint_effect,
                       sighup_effect=args.sighup_effect, sigterm_effect=args.sigterm_effect,
                       denormals=args.denormals,
                       workers=worker_kind(args.workers))
    check_threads(args.threads, log, config.workers)
    started = time.perf_counter()
    trainer = Trainer(sp, path, config, log=log)
    try:
        net = trainer.net
        log(f"cgp: solver {shorten(path)} ({trainer.solver.type}), net "
            f"'{shorten(net.name)}', batch {net.batch_size} in {len(trainer.engine.bounds)} "
            f"chunks on {args.threads} {worker_noun(config.workers, args.threads)}, seed "
            f"{trainer.seed}"
            f"{'' if args.seed is not None or sp.random_seed >= 0 else ' (no random_seed set)'}"
            f", {denormals_text(trainer.pool.flush)}")
        log(f"cgp: {trainer.memory_line}")
        if args.snapshot:
            trainer.restore(args.snapshot)
            log(f"Resuming from {args.snapshot} at iteration {trainer.iter}")
        with compile_notice(lambda line: trainer.log(line)):  # says so on a first run
            results = trainer.solve()
    finally:
        trainer.close()
    elapsed = time.perf_counter() - started
    summary = ", ".join(f"{k} = {v:.4f}" for k, v in results.items())
    if summary and trainer.last_test_iter != trainer.iter:
        # Stopped early (Ctrl-C): as Caffe, no test of the final weights; the last test's
        # figures are older and say so.
        summary = (f"stopped early, the final weights untested (the last test, at iteration "
                   f"{trainer.last_test_iter}: {summary})")
    elif summary:
        summary = f"test {summary}"
    log(f"cgp: trained to iteration {trainer.iter} in {elapsed:.1f} s"
        + (f"; {summary}" if summary else ""))
    if getattr(trainer, "weights_path", None):
        log(f"cgp: weights written to {trainer.weights_path}")
    return 0


def add_equivalence(sub):
    p = sub.add_parser("equivalence", epilog=EPILOG,
                       help="prove training bitwise identical across thread counts")
    p.add_argument("model", nargs="?", help="short name of a bundled model (mnist, cifar10, ...)")
    p.add_argument("--solver", help="solver prototxt (Caffe's format)")
    add_run_options(p, threads_list=True)
    p.add_argument("--seed", type=int, default=None, help="overrides the solver's random_seed")
    p.add_argument("--iters", type=int, default=100, help="iterations per run (default 100)")
    p.set_defaults(run=cmd_equivalence)


def thread_list(text):
    try:
        values = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise CgpError(f"--threads wants a comma-separated list of counts, e.g. 1,2,4; got {text!r}")
    if not values or min(values) < 1:
        raise CgpError(f"--threads counts must be at least 1; got {text!r}")
    return values


def worker_kind(value):
    """The kind of worker of a run's --workers; None (not given): the default kind."""
    from cgp.procs import default_workers
    return value or default_workers()


def worker_list(text):
    """The kinds of worker that a listed --workers names; None: the default kind."""
    if text is None:
        return [worker_kind(None)]
    kinds = [w.strip() for w in str(text).split(",") if w.strip()]
    if not kinds or not set(kinds) <= set(WORKERS):
        raise CgpError(f"--workers wants threads, processes or both, comma-separated; got "
                       f"{text!r}")
    return list(dict.fromkeys(kinds))


def cmd_equivalence(args, log=print):
    from cgp import equivalence
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig

    path = solver_file(args)
    sp = read_solver(path)
    threads = thread_list(args.threads)
    workers = worker_list(args.workers)
    config = RunConfig(chunks=args.chunks, seed=args.seed, data_dir=args.data_dir,
                       download=not args.no_download, affinity=args.affinity,
                       denormals=args.denormals)
    log(f"cgp equivalence: {path}, {args.iters} iterations, {args.chunks} chunks, "
        f"threads {','.join(map(str, threads))} in {' and '.join(workers)}")
    return equivalence.run(sp, path, config, threads, args.iters, log=log, workers=workers)


def add_test(sub):
    p = sub.add_parser("test", help="score a model's TEST-phase net, like `caffe test`")
    p.add_argument("--model", required=True, help="net prototxt (its TEST phase is run)")
    p.add_argument("--weights", required=True, help=".caffemodel file(s), comma-separated")
    p.add_argument("--iterations", type=int, default=50, help="batches to run (default 50)")
    add_run_options(p)
    p.set_defaults(run=cmd_test)


def cmd_test(args, log=print):
    from cgp.caffe_test import run_test
    check_threads(args.threads, log, worker_kind(args.workers))
    run_test(args.model, args.weights, args.iterations, threads=args.threads, chunks=args.chunks,
             data_dir=args.data_dir, download=not args.no_download, log=log,
             flush_denormals=args.denormals == "flush", workers=worker_kind(args.workers),
             affinity=args.affinity)
    return 0


def add_convert(sub):
    p = sub.add_parser("convert", help="write a data set as a Caffe LMDB, like Caffe's "
                       "convert_mnist_data / convert_cifar_data")
    p.add_argument("dataset", choices=("mnist", "cifar10"))
    p.add_argument("--to", required=True, choices=("lmdb",), help="output format")
    p.add_argument("out", help="the LMDB folder to create (it must not exist)")
    p.add_argument("--split", default="train", choices=("train", "test"))
    p.add_argument("--data-dir", default=None, help="folder holding the data set")
    p.add_argument("--no-download", action="store_true", help="never download a missing data set")
    p.add_argument("--limit", type=int, default=None, help="write only the first N records")
    p.add_argument("--mean", default=None, metavar="FILE",
                   help="also write the records' mean image as a .binaryproto, like Caffe's "
                        "compute_image_mean")
    p.set_defaults(run=cmd_convert)


def cmd_convert(args, log=print):
    from cgp.convert import convert
    convert(args.dataset, args.out, split=args.split, data_dir=args.data_dir,
            download=not args.no_download, limit=args.limit, mean=args.mean, log=log)
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="cgp", description="Coarse-grain batch-parallel CPU trainer for Caffe networks: "
        "results are bitwise identical for any thread count.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train(sub)
    add_equivalence(sub)
    add_bench(sub)
    add_time(sub)
    add_test(sub)
    add_convert(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CgpError as e:
        # Shortened once more as a last guard: a message quotes the user's data.
        print(f"cgp: error: {shorten(e, 4000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cgp: interrupted", file=sys.stderr)
        return 130
