"""Many short MPI trainings in a row, to count crashes (issue 49): `cgp train` of a bundled
model on 2 to 4 ranks x 1 or 2 workers (mpirun on this machine), the layouts taken in turn,
--jobs of them at once, optionally beside --load busy loops, until --runs runs or --minutes
have passed. A run that ends with a non-zero status, or without Caffe's "Optimization Done.", is a
failure; one that a signal ended (Open MPI's "exited on signal", a segmentation fault) is a
crash. Prints each failure's last lines and, at the end, the counts by layout.

    python bench/rank_stress.py mnist --runs 300 --minutes 30 --iters 60 --jobs 2 --load 2
                                [--layouts 2x1,3x1,4x1,2x2] [--thread-level serialized]
                                [--checkout DIR] [--data-dir DIR]

--checkout runs another copy of the package (a folder holding a `cgp` package, e.g. `git
archive REV | tar -x -C DIR`): the processes start there, so `python -m cgp` is that copy's.
"""
import itertools
import multiprocessing
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from staleness import job_parser, quiet_solver  # noqa: E402

from cgp.comm import mpi  # noqa: E402

CRASH = re.compile(r"exited on signal|Segmentation fault|signal 11|core dumped", re.I)


def busy(seconds):
    """A busy loop for --load: the machine loaded by others."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def one_run(n, layout, args, solver, folder):
    """(layout, outcome, last lines): outcome "ok", "crash" or "failure"."""
    ranks, threads = layout
    train = ["-m", "cgp", "train", "--solver", str(solver), "--threads", str(threads),
             "--iters", str(args.iters), "--no-log",
             "--snapshot-prefix", str(Path(folder) / f"run{n}" / "s")]
    if args.data_dir:
        train += ["--data-dir", args.data_dir]
    argv, env = mpi.local_job(ranks, train)
    if args.thread_level:
        env["CGP_MPI_THREAD_LEVEL"] = args.thread_level
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                              cwd=args.checkout or folder)
    except subprocess.TimeoutExpired:
        return layout, "failure", "timed out after 600 s"
    text = done.stdout + done.stderr
    last = "\n".join(text.strip().splitlines()[-12:])
    if done.returncode == 0 and "Optimization Done." in done.stdout:
        return layout, "ok", ""
    return layout, "crash" if CRASH.search(text) or done.returncode < 0 else "failure", last


def report(result, counts):
    """Counts one run's outcome; prints a failure's last lines, and every tenth run a tally."""
    layout, outcome, last = result
    counts[layout][outcome] += 1
    if outcome != "ok":
        print(f"run {layout[0]}x{layout[1]}: {outcome}:\n  " + last.replace("\n", "\n  "),
              flush=True)
    total = sum(sum(c.values()) for c in counts.values())
    if total % 10 == 0:
        print(f"{total} runs so far, {sum(c['crash'] for c in counts.values())} crashes",
              flush=True)


def parse_args(argv=None):
    parser = job_parser(__doc__, "2x1,3x1,4x1,2x2")   # the layouts taken in turn
    parser.add_argument("--runs", type=int, default=300, help="runs at most (default 300)")
    parser.add_argument("--minutes", type=float, default=30,
                        help="no run starts after this (default 30)")
    parser.add_argument("--iters", type=int, default=60, help="iterations a run (default 60)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--load", type=int, default=0,
                        help="busy loops beside the runs, for the whole time (default 0)")
    parser.add_argument("--thread-level", choices=mpi.THREAD_LEVELS, default=None,
                        help="CGP_MPI_THREAD_LEVEL for the ranks (default: cgp's)")
    parser.add_argument("--checkout", default=None,
                        help="a folder holding another copy of the cgp package, run instead")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.jobs < 1 or args.iters < 1 or args.load < 0:
        parser.error("--runs, --jobs, --iters at least 1; --load at least 0")
    return args


def main():
    args = parse_args()
    display = max(1, args.iters // 3)   # cgp train prints a speed every third of the run
    loads = [multiprocessing.Process(target=busy, args=(args.minutes * 60 + 600,), daemon=True)
             for _ in range(args.load)]
    for proc in loads:
        proc.start()
    counts = {lay: {"ok": 0, "crash": 0, "failure": 0} for lay in args.layouts}
    deadline = time.monotonic() + 60 * args.minutes
    print(f"rank_stress.py: {args.model}, {args.iters} iterations a run, layouts "
          f"{', '.join(f'{r}x{t}' for r, t in args.layouts)}, {args.jobs} at once, "
          f"{args.load} busy loops, thread level {args.thread_level or 'default'}"
          f"{', checkout ' + args.checkout if args.checkout else ''}", flush=True)
    try:
        with tempfile.TemporaryDirectory() as folder:
            sp = Path(folder) / "solver"
            sp.mkdir()
            solver = quiet_solver(args.model, display, sp)
            order = itertools.cycle(args.layouts)
            with ThreadPoolExecutor(args.jobs) as pool:
                running, started = set(), 0
                while running or (started < args.runs and time.monotonic() < deadline):
                    while (len(running) < args.jobs and started < args.runs
                           and time.monotonic() < deadline):
                        running.add(pool.submit(one_run, started, next(order), args, solver,
                                                folder))
                        started += 1
                    finished, running = wait(running, return_when=FIRST_COMPLETED)
                    for done in finished:
                        report(done.result(), counts)
    finally:
        for proc in loads:
            proc.terminate()
    print("| ranks x workers | runs | ok | crashes | other failures |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for (r, t), c in counts.items():
        print(f"| {r} x {t} | {sum(c.values())} | {c['ok']} | {c['crash']} | {c['failure']} |")
    crashes = sum(c["crash"] for c in counts.values())
    failures = sum(c["failure"] for c in counts.values())
    print(f"{sum(sum(c.values()) for c in counts.values())} runs: {crashes} crashes, "
          f"{failures} other failures")
    sys.exit(1 if crashes or failures else 0)


if __name__ == "__main__":
    main()
