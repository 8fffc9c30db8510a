"""The command line: `python -m cgp train ...` and friends. Parses options, builds the
objects and prints results; user mistakes end in one message and exit status 2."""
import argparse
import os
import sys
import time

# Numba builds colour-highlighted error texts at import with colorama, which then writes a
# terminal reset to stdout at exit wherever stdout looks like a terminal (mpirun's ranks):
# stray bytes after cgp's last line. Set before anything imports Numba, for `python -m cgp`
# and the `cgp` script alike.
os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")

from cgp.errors import CgpError, shorten  # noqa: E402
from cgp.options import (EPILOG, EQUIVALENCE_THREADS, add_device_option,  # noqa: E402
                         add_run_options, add_snapshot_options, check_threads, solver_file,
                         thread_list, worker_kind, worker_list)
from cgp.commands.compile import add_compile  # noqa: E402
from cgp.commands.plot import add_plot  # noqa: E402
from cgp.commands.timing import add_time, compile_notice  # noqa: E402
from cgp.tools.speedup import add_bench  # noqa: E402


def add_train(sub):
    p = sub.add_parser("train", help="train a network from a solver prototxt", epilog=EPILOG)
    p.add_argument("model", nargs="?", help="short name of a bundled model (mnist, cifar10, ...)")
    p.add_argument("--solver", help="solver prototxt (Caffe's format)")
    add_run_options(p)
    p.add_argument("--seed", type=int, default=None, help="overrides the solver's random_seed")
    add_sharing_options(p)
    add_device_option(p)
    p.add_argument("--iters", type=int, default=None,
                   help="train to this iteration instead of the solver's max_iter (which "
                   "still sets the poly policy's schedule)")
    p.add_argument("--weights", help="fine-tune from .caffemodel file(s), comma-separated, copied "
                   "by layer name (replaces the solver's `weights`)")
    p.add_argument("--snapshot", help="resume from a .solverstate")
    p.add_argument("--snapshot-prefix", default=None,
                   help="where snapshots go (overrides the solver's snapshot_prefix)")
    add_snapshot_options(p)
    p.add_argument("--compile-processes", type=int, default=None, metavar="N",
                   help="compile a first run's kernels in N processes before training (default: "
                        "one per core where there are 2 or more, at most 8; 0: the training "
                        "compiles its own)")
    p.add_argument("--heartbeat", default=None, metavar="FILE",
                   help="rank 0 rewrites FILE as training progresses (what `cgp launch` "
                        "watches for hangs)")
    for name, default in (("sigint", "stop"), ("sighup", "snapshot"), ("sigterm", "stop")):
        p.add_argument(f"--{name}-effect", default=default, choices=("stop", "snapshot", "none"),
                       help=f"what {name.upper()} does, after the current iteration (default "
                            f"{default}; 'stop' snapshots too, as Caffe's)"
                            + ("; batch schedulers (Slurm, PBS) send SIGTERM before they kill "
                               "a job" if name == "sigterm" else ""))
    p.add_argument("--log", default=None, metavar="FILE",
                   help="write the training log to FILE, in Caffe's glog format (Caffe's "
                        "parse_log.py reads it), and its values to FILE's name with .csv "
                        "(default: <snapshot prefix>_<date>-<time>.log and .csv)")
    p.add_argument("--no-log", action="store_true", help="write no log file and no CSV")
    p.set_defaults(run=cmd_train)


def add_sharing_options(p):
    """How the updates and the weights are shared: --staleness, --sharing, --groups."""
    p.add_argument("--staleness", type=int, default=0, metavar="S",
                   help="deterministic staleness: the update of iteration t applies the "
                        "gradient of iteration t - S (the first S iterations update nothing); "
                        "results depend on S, never on --threads or ranks (default 0: "
                        "synchronous SGD)")
    p.add_argument("--sharing", choices=("sync", "async", "hybrid"), default="sync",
                   help="how MPI ranks share the weights: 'sync' (default) computes every "
                        "batch across all ranks, bitwise the same for any rank count; "
                        "'async' has each rank compute whole batches and share its updates "
                        "through a parameter buffer without waiting for the others, and "
                        "'hybrid' does so between --groups groups of ranks, synchronous "
                        "within each (as ShmCaffe-A and -H). async and hybrid are NOT "
                        "reproducible: their weights depend on timing")
    p.add_argument("--groups", type=int, default=0, metavar="G",
                   help="with --sharing hybrid: the number of groups of consecutive ranks")


def denormals_text(flush):
    from cgp.runtime import fpenv
    if not flush:
        return "subnormals kept (IEEE)"
    if fpenv.SUPPORTED:
        return "subnormals flushed to zero"
    return "subnormals kept: flushing them needs an x86-64 CPU"


def train_log(args, sp, solver_path, log):
    """The log sink of a training (cgp.trainlog.TrainLog), or None with --no-log: --log's
    file, else <snapshot prefix>_<date>-<time>.log beside the snapshots (the prefix found as
    the trainer finds it: --snapshot-prefix, the solver's, the solver file's name)."""
    from pathlib import Path

    from cgp.comm import mpi
    from cgp.trainlog import TrainLog, default_path

    if args.no_log:
        if args.log:
            raise CgpError("give --log FILE or --no-log, not both")
        return None
    if mpi.launched() and mpi.world().Get_rank() != 0:   # rank 0 writes the job's log
        return None
    prefix = args.snapshot_prefix or sp.snapshot_prefix or str(Path(solver_path).with_suffix(""))
    path = args.log or default_path(prefix)
    if log is print and sys.stderr.isatty():   # the trainer shows a progress bar: print past it
        try:
            from tqdm import tqdm
            log = tqdm.write
        except ImportError:   # the progress extra is not installed: no bar
            pass
    return TrainLog(path, echo=log)


def cmd_train(args, log=print):
    from cgp.prototxt import read_solver

    path = solver_file(args)
    sp = read_solver(path)
    if args.snapshot and args.weights:
        raise CgpError("give --snapshot to resume training or --weights to fine-tune, not both")
    if args.snapshot or args.weights:   # as Caffe: they replace the solver's `weights`
        sp.ClearField("weights")
    if args.weights:
        sp.weights.append(args.weights)
    if args.snapshot_every is not None:
        if args.snapshot_every < 0:
            raise CgpError(f"--snapshot-every must be at least 0, got {args.snapshot_every}")
        sp.snapshot = args.snapshot_every
    config = run_config(args)
    sink = train_log(args, sp, path, log)
    try:
        return train(args, sp, path, config, sink or log, sink)
    finally:
        if sink is not None:
            sink.close()
            if sink.started is not None and sink.path.exists():
                log(f"cgp: training log written to {sink.path} and {sink.csv_path}")


def run_config(args):
    """The RunConfig of `cgp train`'s options."""
    from cgp.train import RunConfig

    return RunConfig(threads=args.threads, chunks=args.chunks, seed=args.seed,
                     staleness=args.staleness, sharing=args.sharing, groups=args.groups,
                     data_dir=args.data_dir, download=not args.no_download,
                     max_iter=args.iters, snapshot_prefix=args.snapshot_prefix,
                     affinity=args.affinity, sigint_effect=args.sigint_effect,
                     sighup_effect=args.sighup_effect, sigterm_effect=args.sigterm_effect,
                     denormals=args.denormals, device=args.device,
                     workers=worker_kind(args.workers), snapshot_seconds=args.snapshot_seconds,
                     heartbeat=args.heartbeat)


def train(args, sp, path, config, log, sink):
    """cmd_train's run once its options are read: log receives every line, sink (a TrainLog
    or None) is told when the training starts."""
    from cgp.runtime.compile import precompile
    from cgp.runtime.procs import worker_noun
    from cgp.train import Trainer

    check_threads(args.threads, log, config.workers)
    started = time.perf_counter()
    precompile(sp, path, config, log, args.compile_processes)   # a first run's kernels
    trainer = Trainer(sp, path, config, log=log)
    try:
        net, engine, comm = trainer.net, trainer.engine, trainer.comm
        ranks = len(engine.parts)
        workers = f"{args.threads} {worker_noun(trainer.workers, args.threads)}"
        if trainer.backend is not None:
            workers = f"{trainer.backend.description} (one worker)"
        where = (workers if ranks == 1 else f"{ranks} ranks x {workers}")
        if not comm.reproducible:
            where = f"{comm.describe()}, each rank with {workers}"
        log(f"cgp: solver {shorten(path)} ({trainer.solver.type}), net "
            f"'{shorten(net.name)}', batch {net.batch_size} in {len(engine.bounds)} chunks on "
            f"{where}, seed {trainer.seed}"
            f"{'' if args.seed is not None or sp.random_seed >= 0 else ' (no random_seed set)'}"
            f", {denormals_text(trainer.pool.flush)}")
        if ranks > 1:
            sent, received = trainer.comm.bytes_per_step()
            log(f"cgp: chunks by rank{' of a group' if not comm.reproducible else ''}: "
                + ", ".join(
                f"{r}: {p.start}-{p.stop - 1}" if len(p) else f"{r}: none"
                for r, p in enumerate(engine.parts))
                + f"; per step each rank sends up to {sent / 2**20:.2f} MiB and receives up to "
                  f"{received / 2**20:.2f} MiB (gradient {4 * net.n_params / 2**20:.2f} MiB)")
            layout = getattr(getattr(comm, "inner", comm), "layout", None)
            if layout is not None:   # cgp.comm.mpi.Layout: the cores, and a warning
                log(f"cgp: layout: {layout.describe()}")
        if not comm.reproducible:
            log(f"cgp: --sharing {config.sharing}: NOT reproducible: each group of ranks "
                f"computes whole batches of {net.batch_size} on the weights it last pulled "
                "from a parameter buffer (MPI one-sided windows on rank 0) and adds its "
                "update there without waiting for the others, so the weights depend on "
                "timing; an iteration is one group's update, and rank 0's group tests and "
                "snapshots (which resume, not bit for bit). Per step a group's leader adds "
                f"{4 * net.n_params / 2**20:.2f} MiB to the buffer and reads as much back")
        log(f"cgp: {trainer.memory_line}")
        if args.snapshot:
            trainer.restore(args.snapshot)
            log(f"Resuming from {args.snapshot} at iteration {trainer.iter}")
        # Says so on a first run, and the display's speed leaves out the compiling.
        with compile_notice(lambda line: trainer.log(line)) as compiling:
            trainer.clock = lambda: time.perf_counter() - compiling.seconds
            if sink is not None:
                sink.start(net.name)
            results = trainer.solve()
            if trainer.heartbeat is not None:   # cgp launch: what is left is the exit
                trainer.heartbeat.finish(trainer.iter)
    finally:
        trainer.close()
    elapsed = time.perf_counter() - started
    # "name value", not "name = value": a log line with ", loss = " is a training loss to
    # Caffe's parse_log.sh.
    summary = ", ".join(f"{k} {v:.4f}" for k, v in results.items())
    if summary and trainer.last_test_iter != trainer.iter:
        # Stopped early (Ctrl-C): as Caffe, no test of the final weights; the last test's
        # figures are older and say so.
        summary = (f"stopped early, the final weights untested (the last test, at iteration "
                   f"{trainer.last_test_iter}: {summary})")
    elif summary:
        summary = f"test {summary}"
    log(f"cgp: trained to iteration {trainer.iter} in {elapsed:.1f} s"
        + (f"; {summary}" if summary else ""))
    computed = getattr(trainer.comm, "computed_by_group", None)
    if computed:
        log("cgp: iterations computed by each group: " + ", ".join(map(str, computed)))
    if getattr(trainer, "weights_path", None):
        log(f"cgp: weights written to {trainer.weights_path}")
    return 0


def add_launch(sub):
    from cgp.commands import launch

    p = sub.add_parser(
        "launch", help="run `cgp train` on MPI ranks that survive lost ranks, bit for bit",
        description="Runs the cgp command after `--` (a train command line) as mpirun ranks. "
                    "When a rank dies or hangs, the job is ended and started again on one "
                    "rank fewer (with --hostfile: without the host that failed), down to "
                    "--min-ranks, from its last snapshot; SIGUSR1 to this process, or a "
                    "change of the host file, grows it back at the next snapshot. The "
                    "final weights, every loss and the test results are those of an "
                    "uninterrupted run.")
    p.add_argument("-np", "--np", dest="ranks", type=int, required=True, metavar="R",
                   help="ranks to run on (the most)")
    p.add_argument("--min-ranks", type=int, default=1, metavar="M",
                   help="stop rather than run on fewer ranks than this (default 1)")
    p.add_argument("--hostfile", default=None, metavar="F",
                   help="Open MPI host file ('host slots=N' lines); re-read on SIGUSR1 or "
                        "when it changes. Without it, the ranks run on this machine")
    add_snapshot_options(p, " (default, where the train command sets neither: chosen from a "
                            "step and a snapshot timed at start-up; given to the train "
                            "command)")
    p.add_argument("--mtbf", type=float, default=launch.DEFAULT_MTBF_HOURS, metavar="HOURS",
                   help="the mean time between failures that the chosen snapshot interval "
                        f"assumes (default {launch.DEFAULT_MTBF_HOURS:g})")
    p.add_argument("--hang-floor", type=float, default=30.0, metavar="S",
                   help="a rank hangs when rank 0's heartbeat stands still this long, or 3 "
                        "times the longest pause between heartbeats if that is longer "
                        "(default 30)")
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                   help="a launch hangs when no heartbeat comes this long after it starts "
                        "(default 300: the ranks start, load the data and the kernels)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- train --solver S ...: the cgp command line to run")
    p.set_defaults(run=cmd_launch)


def cmd_launch(args, log=print):
    from cgp.commands import launch

    train = list(args.command)
    if train[:1] == ["--"]:
        train = train[1:]
    if train[:1] != ["train"]:
        raise CgpError("cgp launch runs a train command: cgp launch -np R -- train --solver "
                       "S ... (got " + (" ".join(train) or "nothing") + " after the options)")
    try:
        options = build_parser().parse_args(train)
    except SystemExit:   # argparse has said what is wrong
        raise CgpError("the train command after `--` is not one that cgp train takes "
                       "(see above)") from None
    return launch.run(args, train, options, run_config(options), log)


def add_equivalence(sub):
    p = sub.add_parser("equivalence", epilog=EPILOG,
                       help="prove training bitwise identical across thread counts")
    p.add_argument("model", nargs="?", help="short name of a bundled model (mnist, cifar10, ...)")
    p.add_argument("--solver", help="solver prototxt (Caffe's format)")
    add_run_options(p, threads_list=True)
    p.add_argument("--seed", type=int, default=None, help="overrides the solver's random_seed")
    add_sharing_options(p)
    p.add_argument("--iters", type=int, default=100, help="iterations per run (default 100)")
    p.add_argument("--ranks", default="1",
                   help="comma-separated numbers of MPI ranks: every thread count also runs on "
                        "each, launched with mpirun on this machine (default 1: no MPI; "
                        "pip install -e \".[mpi]\")")
    add_device_option(p)
    p.set_defaults(run=cmd_equivalence)


def cmd_equivalence(args, log=print):
    from cgp.commands import equivalence
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig

    if args.sharing != "sync":
        raise CgpError(equivalence.refusal(args.sharing))
    path = solver_file(args)
    sp = read_solver(path)
    # A device is driven by one worker per rank: its runs vary the ranks alone.
    threads = thread_list("1" if args.device != "cpu" and args.threads == EQUIVALENCE_THREADS
                          else args.threads)
    ranks = thread_list(args.ranks, "--ranks")
    workers = worker_list(args.workers) if args.device == "cpu" else ["threads"]
    config = RunConfig(chunks=args.chunks, seed=args.seed, data_dir=args.data_dir,
                       staleness=args.staleness,
                       download=not args.no_download, affinity=args.affinity,
                       denormals=args.denormals, device=args.device)
    log(f"cgp equivalence: {path}, {args.iters} iterations, {args.chunks} chunks, "
        f"threads {','.join(map(str, threads))} in {' and '.join(workers)}"
        + (f", on {','.join(map(str, ranks))} MPI ranks" if ranks != [1] else ""))
    return equivalence.run(sp, path, config, threads, args.iters, log=log, workers=workers,
                           ranks=ranks)


def add_test(sub):
    p = sub.add_parser("test", help="score a model's TEST-phase net, like `caffe test`")
    p.add_argument("--model", required=True, help="net prototxt (its TEST phase is run)")
    p.add_argument("--weights", required=True, help=".caffemodel file(s), comma-separated")
    p.add_argument("--iterations", type=int, default=50, help="batches to run (default 50)")
    add_run_options(p)
    add_device_option(p)
    p.set_defaults(run=cmd_test)


def cmd_test(args, log=print):
    from cgp.commands.testing import run_test
    check_threads(args.threads, log, worker_kind(args.workers))
    run_test(args.model, args.weights, args.iterations, threads=args.threads, chunks=args.chunks,
             data_dir=args.data_dir, download=not args.no_download, log=log,
             flush_denormals=args.denormals == "flush", workers=worker_kind(args.workers),
             affinity=args.affinity, device=args.device)
    return 0


def add_convert(sub):
    p = sub.add_parser("convert", help="write a data set or a list of images as a Caffe "
                       "database, like Caffe's convert_mnist_data / convert_cifar_data / "
                       "convert_imageset")
    kinds = p.add_subparsers(dest="dataset", required=True, metavar="{mnist,cifar10,imageset}")
    for name in ("mnist", "cifar10"):
        q = kinds.add_parser(name, help=f"{name} as an LMDB, like Caffe's "
                             f"convert_{'mnist' if name == 'mnist' else 'cifar'}_data")
        q.add_argument("--to", required=True, choices=("lmdb",), help="output format")
        q.add_argument("out", help="the LMDB folder to create (it must not exist)")
        q.add_argument("--split", default="train", choices=("train", "test"))
        q.add_argument("--data-dir", default=None, help="folder holding the data set")
        q.add_argument("--no-download", action="store_true",
                       help="never download a missing data set")
        q.add_argument("--limit", type=int, default=None, help="write only the first N records")
        q.add_argument("--mean", default=None, metavar="FILE",
                       help="also write the records' mean image as a .binaryproto, like "
                            "Caffe's compute_image_mean")
        q.set_defaults(run=cmd_convert)
    q = kinds.add_parser("imageset", help="the images of a list file ('path label' lines) as "
                         "an LMDB or LevelDB of Datum records, like Caffe's convert_imageset",
                         description="cgp convert imageset [options] ROOTFOLDER/ LISTFILE DB: "
                                     "Caffe's convert_imageset; its flags are also taken with "
                                     "underscores (--resize_height ...)")
    q.add_argument("root", help="prepended to each path of the list as it is (end it with /)")
    q.add_argument("listfile", help="a text file of lines 'path label'")
    q.add_argument("out", help="the database folder to create (it must not exist)")
    for flag, what in (("resize-height", "height"), ("resize-width", "width")):
        q.add_argument(f"--{flag}", f"--{flag.replace('-', '_')}", type=int, default=0,
                       help=f"resize each image to this {what} (OpenCV's INTER_LINEAR), with "
                            "the other one")
    q.add_argument("--gray", action="store_true", help="read the images as grayscale")
    q.add_argument("--shuffle", action="store_true", help="shuffle the lines (seeded: --seed)")
    q.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
    q.add_argument("--encoded", action="store_true",
                   help="store the images encoded (the files' bytes where they need no change)")
    q.add_argument("--encode-type", "--encode_type", default="",
                   help="encode as this format (jpg, png, ...; default: each file's own)")
    q.add_argument("--backend", default="lmdb", choices=("lmdb", "leveldb"))
    q.add_argument("--check-size", "--check_size", action="store_true",
                   help="refuse images of different sizes")
    q.set_defaults(run=cmd_convert_imageset)


def cmd_convert(args, log=print):
    from cgp.data.convert import convert
    convert(args.dataset, args.out, split=args.split, data_dir=args.data_dir,
            download=not args.no_download, limit=args.limit, mean=args.mean, log=log)
    return 0


def cmd_convert_imageset(args, log=print):
    from cgp.data.convert import convert_imageset
    convert_imageset(args.root, args.listfile, args.out, args.resize_height, args.resize_width,
                     gray=args.gray, shuffle=args.shuffle, encoded=args.encoded,
                     encode_type=args.encode_type, backend=args.backend,
                     check_size=args.check_size, seed=args.seed, log=log)
    return 0


def add_compute_mean(sub):
    p = sub.add_parser("compute-mean", help="the mean image of a database as a .binaryproto, "
                       "like Caffe's compute_image_mean")
    p.add_argument("db", help="an LMDB or LevelDB folder of Datum records (raw or encoded)")
    p.add_argument("out", nargs="?", default=None,
                   help="the .binaryproto to write (default: only print the channel means)")
    p.add_argument("--backend", default=None, choices=("lmdb", "leveldb"),
                   help="what the database is (default: as its files say)")
    p.set_defaults(run=cmd_compute_mean)


def cmd_compute_mean(args, log=print):
    from cgp.data.convert import compute_mean
    compute_mean(args.db, args.out, backend=args.backend, log=log)
    return 0


def add_export(sub):
    p = sub.add_parser("export", help="write a net and its weights as an ONNX graph",
                       description="The TEST phase of --model with --weights as ONNX (opsets 13 "
                                   "to 17), without data, loss and accuracy layers. With "
                                   "onnxruntime installed, the graph is run once on random "
                                   "input and compared with cgp's forward.")
    p.add_argument("--model", required=True, help="net prototxt (deploy or train/test)")
    p.add_argument("--weights", default=None,
                   help=".caffemodel file(s), comma-separated (default: the fillers' weights)")
    p.add_argument("--onnx", required=True, help="the .onnx file to write")
    p.add_argument("--opset", type=int, default=13, help="ONNX opset, 13 to 17 (default 13)")
    p.add_argument("--input-shape", default=None, metavar="N,C,H,W",
                   help="the shape of the Data layers' data top, which is otherwise read from "
                        "their data source")
    p.add_argument("--data-dir", default=None, help="folder holding the Data layers' data set")
    p.add_argument("--no-download", action="store_true", help="never download a missing data set")
    p.set_defaults(run=cmd_export)


def cmd_export(args, log=print):
    from cgp.commands.onnx_export import cmd_export as run
    return run(args, log)


def add_pycaffe(sub):
    from cgp.caffe.run import DESCRIPTION, add_arguments, run
    p = sub.add_parser("pycaffe", help="run a pycaffe script unchanged, with `import caffe` as cgp",
                       description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(run=run)


def add_draw(sub):
    p = sub.add_parser("draw", help="draw a net prototxt as Graphviz dot, PNG or SVG "
                                    "(Caffe's draw_net.py)")
    p.add_argument("model", help="net prototxt")
    p.add_argument("out", help="output file: .dot/.gv/.raw writes Graphviz's text; any other "
                               "extension (.png, .svg, .pdf) is made by Graphviz's `dot` program")
    p.add_argument("--rankdir", default="LR", choices=("LR", "TB", "BT", "RL"),
                   help="direction of the graph's layout (default LR)")
    p.add_argument("--phase", default="ALL", choices=("TRAIN", "TEST", "ALL"),
                   help="draw only the layers of this phase (default ALL)")
    p.add_argument("--display-lrm", action="store_true",
                   help="show the learning-rate multipliers of the layers' params")
    p.set_defaults(run=cmd_draw)


def cmd_draw(args, log=print):
    from cgp.caffe.draw import draw_prototxt
    draw_prototxt(args.model, args.out, args.rankdir, args.phase, args.display_lrm)
    log(f"wrote {args.out}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="cgp", description="Coarse-grain batch-parallel CPU trainer for Caffe networks: "
        "results are bitwise identical for any thread count.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train(sub)
    add_compile(sub)
    add_launch(sub)
    add_equivalence(sub)
    add_bench(sub)
    add_time(sub)
    add_test(sub)
    add_convert(sub)
    add_compute_mean(sub)
    add_plot(sub)
    add_export(sub)
    add_pycaffe(sub)
    add_draw(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from cgp.comm import mpi
    if mpi.launched():
        return main_rank(args, mpi)
    try:
        return args.run(args)
    except CgpError as e:
        # Shortened once more as a last guard: a message quotes the user's data.
        print(f"cgp: error: {shorten(e, 4000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cgp: interrupted", file=sys.stderr)
        return 130


def main_rank(args, mpi):
    """One rank of an MPI job (mpirun -np R python -m cgp train ...): rank 0 prints; any
    error, in any rank, ends the whole job with its message (mpi.abort), where returning
    would leave the other ranks waiting for this one for ever."""
    world = mpi.world()
    if args.command != "train":
        mpi.abort(world, 2, f"cgp {args.command} runs in one process; only cgp train runs "
                            "under mpirun")
    log = print if world.Get_rank() == 0 else (lambda line: None)
    try:
        return args.run(args, log=log)
    except CgpError as e:
        mpi.abort(world, 2, str(e))
    except KeyboardInterrupt:
        mpi.abort(world, 130, "interrupted")
    except BaseException:   # noqa: BLE001  (a bug: its traceback, then the whole job ends)
        import traceback
        traceback.print_exc()
        mpi.abort(world, 1, "ended by the error above")
