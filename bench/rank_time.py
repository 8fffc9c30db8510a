"""Where a rank's time goes: runs `cgp train` as R MPI ranks x T workers (mpirun on this
machine; R = 1: one process, no MPI) and reads, for every thread of every process of the job,
Linux's own accounts in /proc/PID/task/TID: time on a CPU and time runnable but not running
(schedstat, in ns: the run delay, preempted or waiting for a core), and voluntary and
involuntary context switches (status). Each thread is counted in a class: a rank's main
thread (`main`), its exchange thread (`exchange`, cgp.comm.mpi names it cgp-exchange), its
other threads (`other`: Open MPI's and PMIx's progress threads, libraries'), its worker
processes (`workers`), and mpirun with its daemons (`launcher`). Two readings, at the display
lines of iterations --from and --to, give per-step figures of the steady state, start-up and
compilation left out.

    python bench/rank_time.py lenet --layouts 1x2,2x1 --from 100 --to 300 [--data-dir DIR]

Per class: CPU seconds per step (summed over ranks), run delay per step, context switches per
step; `blocked` is wall time less CPU less run delay (sleeping, or waiting in the kernel).
These are load-insensitive where the speed is not: on a shared machine a step takes longer,
but the CPU a step spends spinning or polling is what it is. Beside the table, the CPU a step
costs over the job's total at 1 x 1 is what the layout adds (the work itself is the same).
"""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from staleness import command, job_parser, quiet_solver  # noqa: E402

ITERATION = re.compile(r"^Iteration (\d+) ")
CLASSES = ("main", "exchange", "other", "workers", "launcher")


def read_thread(pid, tid):
    """(CPU s, run delay s, voluntary, involuntary switches, name) of one thread, or None
    where it has gone."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as f:
            stat = f.read()
        with open(f"{base}/schedstat") as f:
            ran, delay = (int(v) / 1e9 for v in f.read().split()[:2])
        with open(f"{base}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except (OSError, ValueError, IndexError):
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    return (ran, delay, int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]), name)


def children(pid):
    """The pids of pid's children (Linux: /proc/PID/task/*/children)."""
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return found


def is_rank(pid):
    """Whether an MPI launcher started pid as a rank (its environment says)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0OMPI_COMM_WORLD_RANK=" in b"\0" + f.read()
    except OSError:
        return False


def reading(root, alone):
    """{(pid, tid): (class, cpu, delay, voluntary, involuntary)} for the job under pid root:
    the first ranks down the tree (is_rank; root itself where it runs `alone`, 1 x T), their
    children workers."""
    out, stack = {}, [(root, "rank" if alone else "launcher")]
    while stack:
        pid, kind = stack.pop()
        if kind == "launcher" and is_rank(pid):
            kind = "rank"
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            got = read_thread(pid, tid)
            if got is None:
                continue
            cpu, delay, vol, invol, name = got
            cls = kind if kind != "rank" else (
                "main" if tid == pid else "exchange" if name == "cgp-exchange" else "other")
            out[pid, tid] = (cls, cpu, delay, vol, invol)
        stack += [(c, "workers" if kind in ("rank", "workers") else kind)
                  for c in children(pid)]
    return out


def measure(layout, args, solver, folder, tries=3):
    """Runs one layout; returns ({class: (cpu, delay, vol, invol) per step}, wall per step,
    iter/s). A run that crashes is rerun, at most `tries` times in all, and said."""
    for _ in range(tries - 1):
        try:
            return measure_once(layout, args, solver, folder)
        except SystemExit as failed:
            print(f"rank_time.py: rerun after a failure: {str(failed)[-300:]}", flush=True)
    return measure_once(layout, args, solver, folder)


def measure_once(layout, args, solver, folder):
    argv, env = command(layout, 0, solver, args, folder)
    job = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    marks = {}
    errors = []
    threading.Thread(target=lambda: errors.append(job.stderr.read()), daemon=True).start()
    for line in job.stdout:
        match = ITERATION.match(line)
        if match and int(match.group(1)) in (args.start, args.stop):
            marks[int(match.group(1))] = (time.perf_counter(), reading(job.pid, layout[0] == 1))
        if len(marks) == 2:
            break
    job.stdout.read()
    job.wait()
    if job.returncode != 0 or len(marks) < 2:
        raise SystemExit(f"rank_time.py: {' '.join(argv)} ended with status {job.returncode}"
                         f"\n{''.join(errors)[-2000:]}")
    (t0, a), (t1, b) = marks[args.start], marks[args.stop]
    steps = args.stop - args.start
    per = {c: [0.0, 0.0, 0.0, 0.0] for c in CLASSES}
    for key, (cls, *now) in b.items():
        before = a.get(key, (cls, 0, 0, 0, 0))[1:]
        for i in range(4):
            per[cls][i] += (now[i] - before[i]) / steps
    return per, (t1 - t0) / steps, steps / (t1 - t0)


def parse_args(argv=None):
    parser = job_parser(__doc__, "1x1,1x2,2x1")
    parser.add_argument("--from", dest="start", type=int, default=100,
                        help="the iteration of the first reading (default 100)")
    parser.add_argument("--to", dest="stop", type=int, default=300,
                        help="the iteration of the second (default 300)")
    parser.add_argument("--display", type=int, default=None,
                        help="display interval (default: the smaller of --from and the "
                             "readings' distance)")
    args = parser.parse_args(argv)
    args.display = args.display or min(args.start, args.stop - args.start)
    if (args.stop <= args.start or args.start < 1 or args.start % args.display
            or args.stop % args.display):
        parser.error("--from and --to: multiples of --display, --from below --to")
    args.iters = args.stop + args.display
    return args


def main():
    args = parse_args()
    print(f"{args.model}: per step, readings at iterations {args.start} and {args.stop}; "
          f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    print("| layout | iter/s | wall ms | class | CPU ms | run delay ms | blocked ms | "
          "vol. switches | invol. switches |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    base = None
    with tempfile.TemporaryDirectory() as folder:
        solver = quiet_solver(args.model, args.display, folder)
        for layout in args.layouts:
            per, wall, speed = measure(layout, args, solver, folder)
            name = f"{layout[0]} x {layout[1]}"
            threads = {"main": layout[0], "exchange": layout[0] if layout[0] > 1 else 0}
            for cls in CLASSES:
                cpu, delay, vol, invol = per[cls]
                if not (cpu or delay or vol or invol or threads.get(cls)):
                    continue   # a class the layout has none of (a rank's threads: shown)
                blocked = ""
                if cls in threads:   # one such thread per rank: its wall time is known
                    blocked = f"{1e3 * (threads[cls] * wall - cpu - delay):.2f}"
                print(f"| {name} | {speed:.1f} | {1e3 * wall:.2f} | {cls} | {1e3 * cpu:.2f} | "
                      f"{1e3 * delay:.2f} | {blocked} | {vol:.1f} | {invol:.1f} |")
            total = sum(v[0] for c, v in per.items() if c != "launcher")
            if layout == (1, 1):
                base = total
            extra = f"; over 1 x 1: {1e3 * (total - base):+.2f} ms" if base is not None else ""
            print(f"| {name} | | | **all but launcher** | {1e3 * total:.2f}{extra} | | | | |",
                  flush=True)


if __name__ == "__main__":
    main()
