"""`cgp launch -np R [--min-ranks M] [--hostfile F] -- train ...`: elastic training. Reads
the options, finds the snapshot prefix of the train command, chooses the snapshot interval
where none is given (a step and a snapshot timed on one process), then hands over to the
supervisor (cgp.comm.elastic), which does the launching."""
import argparse
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from cgp.errors import CgpError

DEFAULT_MTBF_HOURS = 24.0


def add_launch(sub):
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
    p.add_argument("--snapshot-every", type=int, default=None, metavar="N",
                   help="snapshot every N iterations")
    p.add_argument("--snapshot-seconds", type=float, default=None, metavar="T",
                   help="snapshot every T seconds (default, where the train command sets "
                        "neither: chosen from a step and a snapshot timed at start-up)")
    p.add_argument("--mtbf", type=float, default=DEFAULT_MTBF_HOURS, metavar="HOURS",
                   help="the mean time between failures that the chosen snapshot interval "
                        f"assumes (default {DEFAULT_MTBF_HOURS:g})")
    p.add_argument("--hang-floor", type=float, default=30.0, metavar="S",
                   help="a rank hangs when rank 0's heartbeat stands still this long, or 10 "
                        "times the longest pause between heartbeats if that is longer "
                        "(default 30)")
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                   help="a launch hangs when no heartbeat comes this long after it starts "
                        "(default 300: the ranks start, load the data and the kernels)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- train --solver S ...: the cgp command line to run")
    p.set_defaults(run=cmd_launch)


def cmd_launch(args, log=print):
    from cgp.comm.elastic import Settings, Supervisor

    train = list(args.command)
    if train[:1] == ["--"]:
        train = train[1:]
    if train[:1] != ["train"]:
        raise CgpError("cgp launch runs a train command: cgp launch -np R -- train --solver "
                       "S ... (got " + (" ".join(train) or "nothing") + " after the options)")
    if args.ranks < 1 or not 1 <= args.min_ranks <= args.ranks:
        raise CgpError(f"-np {args.ranks} --min-ranks {args.min_ranks}: want "
                       "1 <= min-ranks <= np")
    if args.snapshot_every is not None and args.snapshot_seconds is not None:
        raise CgpError("give --snapshot-every or --snapshot-seconds, not both")
    options = parse_train(train)
    if options.snapshot and options.weights:
        raise CgpError("give --snapshot to resume training or --weights to fine-tune, not both")
    train = without(train, ("--snapshot", "--weights"))
    if args.snapshot_every is not None:
        train += ["--snapshot-every", str(args.snapshot_every)]
    elif args.snapshot_seconds is not None:
        train += ["--snapshot-seconds", str(args.snapshot_seconds)]
    elif options.snapshot_every is None and options.snapshot_seconds is None:
        seconds = choose_interval(train, args.mtbf, args.hang_floor, log)
        train += ["--snapshot-seconds", f"{seconds:.3g}"]
    settings = Settings(ranks=args.ranks, min_ranks=args.min_ranks, train=train,
                        prefix=snapshot_prefix(options), resume=options.snapshot,
                        weights=options.weights, hostfile=args.hostfile,
                        hang_floor=args.hang_floor, start_timeout=args.start_timeout)
    return Supervisor(settings, log).run()


def parse_train(train):
    """The options of a train command line, as `cgp train` reads them."""
    from cgp.cli import build_parser
    try:
        return build_parser().parse_args(train)
    except SystemExit:   # argparse has said what is wrong
        raise CgpError("the train command after `--` is not one that cgp train takes "
                       "(see above)") from None


def snapshot_prefix(options):
    """The prefix the trainer snapshots to: --snapshot-prefix, the solver's, else the
    solver file's name (Trainer.snapshot_prefix)."""
    from cgp.options import solver_file
    from cgp.prototxt import read_solver

    path = solver_file(options)
    return (options.snapshot_prefix or read_solver(path).snapshot_prefix
            or str(Path(path).with_suffix("")))


def without(argv, names):
    """argv less the options `names` and their values ('--name V' or '--name=V')."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in names:
            skip = True
        elif not any(word.startswith(f"{n}=") for n in names):
            kept.append(word)
    return kept


def measure(train):
    """(seconds a step, seconds a snapshot) of the train command on one process, its tests
    left out: a step to load the kernels, then steps for about a second, then one snapshot
    written to a temporary folder."""
    from cgp.cli import run_config
    from cgp.options import solver_file
    from cgp.prototxt import read_solver
    from cgp.train import Trainer

    options = parse_train(train)
    path = solver_file(options)
    sp = read_solver(path)
    sp.test_interval = 0
    folder = Path(tempfile.mkdtemp(prefix="cgp-launch-"))
    config = replace(run_config(options), snapshot_prefix=str(folder / "probe"),
                     progress=False, heartbeat=None, snapshot_seconds=None, max_iter=None)
    trainer = Trainer(sp, path, config, log=lambda line: None)
    try:
        trainer.step()
        began, steps = time.perf_counter(), 0
        while steps < 50 and (steps < 3 or time.perf_counter() - began < 1.0):
            trainer.step()
            steps += 1
        step = (time.perf_counter() - began) / steps
        began = time.perf_counter()
        trainer.snapshot()
        return step, time.perf_counter() - began
    finally:
        trainer.close()
        shutil.rmtree(folder, ignore_errors=True)


def choose_interval(train, mtbf_hours, hang_floor, log):
    """The snapshot interval in seconds for a run that sets none (young_interval), and the
    work a failure is expected to cost, said."""
    from cgp.comm.elastic import young_interval

    log("cgp launch: no snapshot interval given: timing a step and a snapshot on one process")
    step, snap = measure(train)
    seconds = young_interval(step, snap, mtbf_hours * 3600)
    log(f"cgp launch: snapshots every {seconds:.3g} s (a step {step:.3g} s, a snapshot "
        f"{snap:.3g} s on one process; sqrt(2 x snapshot x MTBF {mtbf_hours:g} h), at least "
        f"10 steps and 1 s): a failure loses {seconds / 2:.3g} s of training on average, "
        f"{seconds:.3g} s at most, plus the time to notice it (a death: about a second; a "
        f"hang: {hang_floor:g} s or more) and to start again")
    return seconds
