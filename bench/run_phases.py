"""Where a whole `cgp train` run goes (issue 53): the start before iteration 0 (imports, the
nets and their data, the workers' fork), the training steps, the periodic test passes, the
display lines and the snapshots, each in wall time and in CPU time of the main process and
of the worker processes together, and the first test accuracy >= --target.

    python bench/run_phases.py [mnist] [--threads 2] [--iters N] [--target 0.99]
                               [--data-dir DIR]

The trainer is cgp train's (RunConfig, Trainer.solve), with its log lines dropped and no
log files; the run's own clock starts where the interpreter starts this script. Worker
processes' CPU time is read from /proc (Linux), so the figures hold on a shared machine
where wall time does not: compare CPU seconds, and a phase's share of the run.
"""
import time

STARTED = time.perf_counter(), time.process_time()

import argparse   # noqa: E402  (after the clock: the imports are part of the start)
import os         # noqa: E402
import tempfile   # noqa: E402
from collections import defaultdict   # noqa: E402

from cgp import models                       # noqa: E402
from cgp.prototxt import read_solver         # noqa: E402
from cgp.train import RunConfig, Trainer     # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pids):
    """CPU seconds (user + system) of processes `pids` so far, from /proc."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICK


class Clocks:
    """Wall, main-process CPU and worker CPU seconds of named phases (exclusive: a phase's
    figures leave out the phases it calls)."""

    def __init__(self, workers):
        self.workers = workers   # the worker processes' ids
        self.totals = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.calls = defaultdict(int)
        self._stack = []

    def now(self, workers=True):
        return (time.perf_counter(), time.process_time(),
                cpu_of(self.workers) if workers else 0.0)

    def wrap(self, name, fn, workers=True):
        """fn timed as phase `name`; workers=False leaves the workers' CPU out (a read of
        /proc costs ~20 us: too much for a phase of every step)."""
        def timed(*args, **kwargs):
            self._stack.append([0.0, 0.0, 0.0])
            started = self.now(workers)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = [b - a for a, b in zip(started, self.now(workers))]
                inner = self._stack.pop()
                total = self.totals[name]
                for i in range(3):
                    total[i] += spent[i] - inner[i]
                    if self._stack:
                        self._stack[-1][i] += spent[i]
                self.calls[name] += 1
        return timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=None, help="max_iter (the solver's)")
    parser.add_argument("--target", type=float, default=0.99)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    path = models.solver_path(args.model)
    sp = read_solver(path)
    folder = tempfile.mkdtemp()
    trainer = Trainer(sp, path, RunConfig(threads=args.threads, max_iter=args.iters,
                                          progress=False, snapshot_prefix=f"{folder}/s",
                                          data_dir=args.data_dir),
                      log=lambda line: None)
    built = time.perf_counter(), time.process_time()
    pids = [p.pid for p in getattr(trainer.pool, "procs", [])]
    clocks = Clocks(pids)
    reached = []   # (iteration, wall seconds since the start) of the first test >= target

    def tests_then_note(trainer, run=trainer.tests.run):
        run(trainer)
        accuracy = trainer.last_test.get("accuracy", 0)
        if not reached and accuracy >= args.target:
            reached.append((trainer.iter, time.perf_counter() - STARTED[0]))
    trainer.tests.run = clocks.wrap("test passes", tests_then_note)
    trainer.steps = clocks.wrap("training steps", trainer.steps)
    trainer.progress.after_step = clocks.wrap("display, per step", trainer.progress.after_step,
                                              workers=False)
    trainer.snapshot = clocks.wrap("snapshots", trainer.snapshot)
    begun = clocks.now()
    trainer.solve()
    ended = clocks.now()
    trainer.close()
    start_wall, start_cpu = built[0] - STARTED[0], built[1] - STARTED[1]
    run_wall = ended[0] - begun[0]
    print(f"{args.model}, {args.threads} worker(s), to iteration {trainer.iter}: "
          f"{start_wall + run_wall:.1f} s wall from the interpreter's start; first test "
          f">= {args.target}: " + (f"iteration {reached[0][0]} at {reached[0][1]:.1f} s"
                                   if reached else "none"))
    print(f"  {'phase':22s} {'wall s':>8s} {'share':>6s} {'main CPU':>9s} {'workers CPU':>12s}"
          f" {'calls':>6s}")
    print(f"  {'start (to Trainer)':22s} {start_wall:8.2f} "
          f"{start_wall / (start_wall + run_wall):6.1%} {start_cpu:9.2f} {'':>12s}")
    rest = [b - a for a, b in zip(begun, ended)]
    for name, (wall, cpu, workers) in clocks.totals.items():
        rest = [r - x for r, x in zip(rest, (wall, cpu, workers))]
        print(f"  {name:22s} {wall:8.2f} {wall / (start_wall + run_wall):6.1%} {cpu:9.2f} "
              f"{workers:12.2f} {clocks.calls[name]:6d}")
    print(f"  {'the rest of solve()':22s} {rest[0]:8.2f} "
          f"{rest[0] / (start_wall + run_wall):6.1%} {rest[1]:9.2f} {rest[2]:12.2f}")


if __name__ == "__main__":
    main()
