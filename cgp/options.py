"""The command-line options that several commands share (train, equivalence, test, time,
bench speedup) and the checks of their values. Imports nothing of cgp's command modules, so
that each of them can import it: cgp.cli, cgp.commands.timing and cgp.tools.speedup."""
import os

import psutil

from cgp.errors import CgpError

EPILOG = ("Models: mnist (LeNet), cifar10 (cifar10_quick), cifar10_full, resnet20 (ResNet-20 "
          "for CIFAR-10); or --solver FILE.")
WORKERS = ("threads", "processes")


def add_denormals_option(p):
    p.add_argument("--denormals", choices=("flush", "keep"), default="flush",
                   help="subnormal floats (below 1.2e-38): 'flush' them to zero (default, as "
                        "TensorFlow does; arithmetic on them is many times slower) or 'keep' "
                        "them (IEEE, as Caffe). Results depend on this, never on --threads")


def add_workers_option(p, listed=False):
    """--workers; None when not given: cgp.runtime.procs.default_workers() (imported only to
    run)."""
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


def add_device_option(p, more=""):
    """--device (cgp.device); `more`: what the command adds to its help."""
    p.add_argument("--device", choices=("cpu", "gpu", "numpy"), default="cpu",
                   help="where the chunks compute: 'cpu' (default; Numba kernels on --threads "
                        "workers), 'gpu' (CuPy: pip install 'cgp[gpu]'; one GPU per MPI rank, "
                        "by local rank) or 'numpy' (the GPU path on the host, NumPy standing "
                        "in for CuPy: for checking it without a GPU). The weights are bitwise "
                        "the same for any rank count on one device kind; cpu and gpu agree to "
                        "rounding, not bitwise" + more)


def add_snapshot_options(p, seconds_more=""):
    """cgp train's --snapshot-every and --snapshot-seconds, which cgp launch takes too and
    hands to its train command; `seconds_more`: what the command adds to the latter's help."""
    p.add_argument("--snapshot-every", type=int, default=None, metavar="N",
                   help="snapshot every N iterations (overrides the solver's snapshot; 0: "
                        "none but the last)")
    p.add_argument("--snapshot-seconds", type=float, default=None, metavar="T",
                   help="also snapshot once T seconds have passed since the last snapshot"
                        + seconds_more)


# The thread counts `cgp equivalence` compares unless told.
EQUIVALENCE_THREADS = "1,2,3,4"


def add_run_options(p, threads_list=False):
    """How a run executes: --threads and --affinity never change what it computes;
    --chunks and --denormals do, the same for every thread count."""
    if threads_list:
        p.add_argument("--threads", default=EQUIVALENCE_THREADS,
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


def solver_file(args):
    from cgp.models import solver_path
    if args.solver and args.model:
        raise CgpError("give a model name or --solver, not both")
    if args.solver:
        return args.solver
    if args.model:
        return str(solver_path(args.model))
    raise CgpError("name a model (mnist, cifar10, cifar10_full, resnet20) or give --solver FILE")


def physical_cores():
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


# Thread workers beyond which more ran slower on the 16-core machine measured (bench/README.md,
# "On 16 cores": LeNet 2.21x one thread at 4 threads, 2.08x at 8, 0.78x at 16): they share
# one interpreter lock, which each call's Python takes.
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


def thread_list(text, option="--threads"):
    try:
        values = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise CgpError(f"{option} wants a comma-separated list of counts, e.g. 1,2,4; got "
                       f"{text!r}")
    if not values or min(values) < 1:
        raise CgpError(f"{option} counts must be at least 1; got {text!r}")
    return values


def worker_kind(value):
    """The kind of worker of a run's --workers; None (not given): the default kind."""
    from cgp.runtime.procs import default_workers
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
