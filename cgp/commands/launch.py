"""`cgp launch -np R [--min-ranks M] [--hostfile F] -- train ...`: elastic training. Checks
the options (cgp.cli parses them), finds the snapshot prefix of the train command, chooses
the snapshot interval where none is given (a step and a snapshot timed on one process),
then hands over to the supervisor (cgp.comm.elastic), which does the launching."""
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from cgp.errors import CgpError

DEFAULT_MTBF_HOURS = 24.0


def run(args, train, options, config, log=print):
    """Supervises `cgp train` with the words `train` (options: as cgp train reads them,
    config: its RunConfig) as cgp launch's args ask."""
    from cgp.comm.elastic import Settings, Supervisor

    if args.ranks < 1 or not 1 <= args.min_ranks <= args.ranks:
        raise CgpError(f"-np {args.ranks} --min-ranks {args.min_ranks}: want "
                       "1 <= min-ranks <= np")
    if args.snapshot_every is not None and args.snapshot_seconds is not None:
        raise CgpError("give --snapshot-every or --snapshot-seconds, not both")
    if options.snapshot and options.weights:
        raise CgpError("give --snapshot to resume training or --weights to fine-tune, not both")
    train = without(train, ("--snapshot", "--weights"))
    if args.snapshot_every is not None:
        train += ["--snapshot-every", str(args.snapshot_every)]
    elif args.snapshot_seconds is not None:
        train += ["--snapshot-seconds", str(args.snapshot_seconds)]
    elif options.snapshot_every is None and options.snapshot_seconds is None:
        seconds = choose_interval(options, config, args.mtbf, args.hang_floor, log)
        train += ["--snapshot-seconds", f"{seconds:.3g}"]
    settings = Settings(ranks=args.ranks, min_ranks=args.min_ranks, train=train,
                        prefix=snapshot_prefix(options), resume=options.snapshot,
                        weights=options.weights, hostfile=args.hostfile,
                        hang_floor=args.hang_floor, start_timeout=args.start_timeout)
    return Supervisor(settings, log).run()


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


def measure(options, config):
    """(seconds a step, seconds a snapshot) of a train command (its options and RunConfig)
    on one process, its tests left out: a step to load the kernels, then steps for about a
    second, then one snapshot written to a temporary folder."""
    from cgp.options import solver_file
    from cgp.prototxt import read_solver
    from cgp.train import Trainer

    path = solver_file(options)
    sp = read_solver(path)
    sp.test_interval = 0
    folder = Path(tempfile.mkdtemp(prefix="cgp-launch-"))
    config = replace(config, snapshot_prefix=str(folder / "probe"),
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


def choose_interval(options, config, mtbf_hours, hang_floor, log):
    """The snapshot interval in seconds for a run that sets none (young_interval), and the
    work a failure is expected to cost, said."""
    from cgp.comm.elastic import young_interval

    log("cgp launch: no snapshot interval given: timing a step and a snapshot on one process")
    step, snap = measure(options, config)
    seconds = young_interval(step, snap, mtbf_hours * 3600)
    log(f"cgp launch: snapshots every {seconds:.3g} s (a step {step:.3g} s, a snapshot "
        f"{snap:.3g} s on one process; sqrt(2 x snapshot x MTBF {mtbf_hours:g} h), at least "
        f"10 steps and 1 s): a failure loses {seconds / 2:.3g} s of training on average, "
        f"{seconds:.3g} s at most, plus the time to notice it (a death: about a second; a "
        f"hang: {hang_floor:g} s or more) and to start again")
    return seconds
