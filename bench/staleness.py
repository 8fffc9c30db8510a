"""Deterministic staleness's speed against synchronous SGD: `cgp train --staleness S` for each
S and each layout of R MPI ranks x T workers (mpirun on this machine; 1xT: one process, no
MPI), --iters iterations of the solver with its tests off. Every (layout, S) runs once per
round, in an order rotated every round, so drift on a shared machine hits them alike. A
run's speed is the median of its display speeds (iterations/s) after the first display
interval; per (layout, S): the median over rounds, and the speed relative to S = 0 on the
same layout, as the median of the ratios within each round.

    python bench/staleness.py lenet --staleness 0,1,2 --layouts 4x1,2x1 --iters 160 --rounds 5
                              [--display 20] [--data-dir DIR]

LeNet's solver with S = 2 diverges at iteration 170 (the rate and momentum are tuned for
fresh gradients), so its runs stop short of that; a run that cgp ends with an error ends
the benchmark with its message.

Speed only: the weights a staleness gives are the same for any layout (`cgp equivalence
--staleness S --ranks ...` checks it), so its accuracy is measured once per S with `cgp train`.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cgp import models
from cgp.comm import mpi
from cgp.prototxt import format_solver, read_solver
from cgp.train import resolve

DISPLAY = re.compile(r"^Iteration (\d+) \(([\d.e+-]+) iter/s, [\d.e+-]+ img/s\)", re.M)


def quiet_solver(model, display, folder):
    """The solver of a bundled model's short name (or a solver file) written into folder
    with its tests and intermediate snapshots off and the display every `display`
    iterations; returns its path."""
    path = Path(model) if model.endswith(".prototxt") else models.solver_path(model)
    sp = read_solver(path)
    sp.net = str(resolve(sp.net, path.parent, "net").resolve())
    sp.test_interval, sp.snapshot, sp.display = 0, 0, display
    sp.test_initialization = False
    out = Path(folder) / "solver.prototxt"
    out.write_text(format_solver(sp))
    return out


def layout_list(text):
    """--layouts' argparse type: 'RxT,...' -> [(ranks, workers), ...], each at least 1."""
    try:
        layouts = [tuple(int(n) for n in lay.split("x")) for lay in text.split(",")]
    except ValueError:
        layouts = []
    if not layouts or any(len(lay) != 2 or min(lay) < 1 for lay in layouts):
        raise argparse.ArgumentTypeError(f"wants RANKSxWORKERS pairs, e.g. 4x1,2x1, got {text!r}")
    return layouts


def job_parser(doc, layouts):
    """The argument parser of a benchmark of cgp train jobs, with what each takes: the model,
    --layouts (default `layouts`) and --data-dir."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("model", help="a bundled model's short name or a solver prototxt")
    parser.add_argument("--layouts", type=layout_list, default=layouts,
                        help=f"RANKSxWORKERS, comma-separated (default {layouts})")
    parser.add_argument("--data-dir", default=None, help="cgp train's --data-dir")
    return parser


def command(layout, staleness, solver, args, folder):
    """(argv, environment) of one run."""
    ranks, threads = layout
    train = ["-m", "cgp", "train", "--solver", str(solver), "--threads", str(threads),
             "--staleness", str(staleness), "--iters", str(args.iters), "--no-log",
             "--snapshot-prefix", str(Path(folder) / "snapshot")]
    if args.data_dir:
        train += ["--data-dir", args.data_dir]
    if ranks == 1:
        env = dict(os.environ)
        env.pop("OMPI_COMM_WORLD_SIZE", None)   # run alone even from inside an MPI job
        return [sys.executable, *train], env
    return mpi.local_job(ranks, train)


def speed(text, display):
    """The median of a run's display speeds after its first display interval."""
    speeds = [float(s) for it, s in DISPLAY.findall(text) if int(it) > display]
    if not speeds:
        raise SystemExit("staleness.py: a run showed no display speed after its first "
                         f"interval: give --iters above twice --display\n{text[-2000:]}")
    return statistics.median(speeds)


def run(label, argv, env, reruns, tries=3):
    """The finished process of one run. A run that crashes is rerun (Open MPI 5's
    shared-memory transport has been seen to crash now and then, in S = 0 runs as in others),
    at most `tries` times in all; each crash's last line is added to reruns, which the
    results list. A run that cgp ended with its error (a divergence) ends the benchmark."""
    for _ in range(tries):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return done
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()
                 if line.strip().strip("-")]   # not Open MPI's rules of dashes
        errors = [line for line in lines if line.startswith("cgp: error")]
        if errors:   # cgp's own verdict (a divergence, a wrong option): the same every time
            raise SystemExit(f"staleness.py: {label}: {errors[0]}")
        reruns.append(f"{label}: exit status {done.returncode}: "
                      + (lines[-1] if lines else "no output"))
        print("  failed, rerun: " + reruns[-1], flush=True)
    raise SystemExit(f"staleness.py: {' '.join(argv)} failed {tries} times:\n"
                     f"{done.stderr[-2000:]}")


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = job_parser(__doc__, "4x1,2x1")
    parser.add_argument("--staleness", default="0,1,2",
                        help="staleness values, comma-separated; 0 is always run, the "
                             "baseline (default 0,1,2)")
    parser.add_argument("--iters", type=int, default=160, help="iterations per run")
    parser.add_argument("--display", type=int, default=20,
                        help="display interval, the speed's sample (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each (layout, S)")
    args = parser.parse_args(argv)
    try:
        args.staleness = sorted({0, *(int(s) for s in args.staleness.split(","))})
    except ValueError:
        parser.error("--staleness wants whole numbers, e.g. 0,1,2")
    if (min(args.staleness) < 0 or args.rounds < 1 or args.display < 1
            or args.iters <= 2 * args.display):
        parser.error("staleness at least 0; rounds, display at least 1; "
                     "--iters above twice --display")
    return args


def main():
    args = parse_args()
    runs = [(lay, s) for lay in args.layouts for s in args.staleness]
    speeds = {run: [] for run in runs}
    reruns = []
    with tempfile.TemporaryDirectory() as folder:
        solver = quiet_solver(args.model, args.display, folder)
        print(f"{args.model}: {args.iters} iterations a run, {args.rounds} rounds of "
              f"{len(runs)} runs, each run's speed the median of its displays (every "
              f"{args.display}) after the first")
        for r in range(args.rounds):
            shift = r % len(runs)
            for lay, s in runs[shift:] + runs[:shift]:
                argv, env = command(lay, s, solver, args, folder)
                done = run(f"{lay[0]}x{lay[1]} S={s}", argv, env, reruns)
                speeds[(lay, s)].append(speed(done.stdout, args.display))
                print(f"round {r + 1}: {lay[0]}x{lay[1]} S={s}: "
                      f"{speeds[(lay, s)][-1]:.1f} iter/s", flush=True)
    print("| ranks x workers | S | iter/s (median) | iter/s (each round) | x S=0 "
          "(median of rounds' ratios) |")
    print("| --- | ---: | ---: | --- | ---: |")
    for lay, s in runs:
        mine, base = speeds[(lay, s)], speeds[(lay, 0)]
        ratio = statistics.median(a / b for a, b in zip(mine, base))
        print(f"| {lay[0]} x {lay[1]} | {s} | {statistics.median(mine):.1f} | "
              f"{', '.join(f'{v:.1f}' for v in mine)} | {ratio:.3f} |")
    if reruns:
        print(f"{len(reruns)} runs failed and were rerun; their last lines:")
        for line in reruns:
            print("  " + line)


if __name__ == "__main__":
    main()
