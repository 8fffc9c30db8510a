"""Where a step's time goes on worker processes (cgp/procs.py), per pool run (the engine's
calls with the reduction's tasks, or with --separate the reduction in a run of its own; the
solver update, beside which the caller reads the next batch): the run's wall time in the
caller, each worker's busy time in its tasks, how late the other workers start their first
task after the caller enters the run, and how far apart the workers finish (the run end's
imbalance). The serial part is the step's time outside the runs. The same steps at one
worker (a pool of one process, which forks nothing) show what the work costs when one core
does it all: busy time that grows at two workers is work that runs slower beside the other
worker (shared caches, memory, reading what the other core wrote).

    python bench/process_phases.py [mnist|cifar10] [--threads 1,2] [--steps 300]
                                   [--separate] [--merged] [--tasks] [--timeline]
                                   [--data-dir DIR]

--merged runs the steps as Trainer.solve does (Trainer.steps: each update in its own run's
reduction tasks, where the solver allows, else in the next step's run on two workers or
more); the step time is then from one iteration's end to the next, and a run that happens
once (the last merged update) is shown apart, not in the serial part. A fused update's time
is in its reduction tasks'.
--tasks adds each kind of task's median time: a call, an update block, a reduction task by
the layer it awaits (busy time that grows at two workers shows which work pays for sharing);
of a reduction task that applies the update to its columns (fused), also the update's part,
and on two workers or more the update's time by whether its worker had updated the same
columns the step before (whether a fixed block-to-worker assignment could keep them cached).
--timeline adds the calls' run as a path in time, medians over the steps: when the first and
the last call start, the mean and the longest call, when the last call ends and the run's
last task; then each worker's tasks in the run of the median wall time (what holds a step of
many workers back: a late start, one slow call, or the reduction's tail).

Times come from time.perf_counter (CLOCK_MONOTONIC on Linux: one clock for all processes),
written by each task into shared memory.
"""
import argparse
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

import cgp.procs
from cgp import models
from cgp.layers import aligned_zeros
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer

TASKS = 64   # room for each run's tasks

# What each program is, by its function's name.
NAMES = {"_task": "calls and reduction", "task": "reduction", "apply": "update"}


class Trace:
    """Shared buffers where the tasks of every run, in every process, write (worker, start,
    end), and where the caller writes each run's (program, entered, returned)."""

    def __init__(self, runs):
        self.tasks = aligned_zeros((runs, TASKS, 3), np.float64, shared=True)
        # (start, end) of the update within a reduction task that fuses one (run, task)
        self.updates = aligned_zeros((runs, TASKS, 2), np.float64, shared=True)
        self.engines = []
        self.runs = np.zeros((runs, 3))
        self.count = aligned_zeros(1, np.int64, shared=True)   # runs started so far
        self.names = []

    def wrap(self, fn, name):
        self.names.append(name)
        count, tasks = self.count, self.tasks

        def traced(w, i, *args):
            row = tasks[(count[0] - 1) % len(tasks), i]
            row[1] = time.perf_counter()
            fn(w, i, *args)
            row[2] = time.perf_counter()
            row[0] = w
        return traced

    def wrap_update(self, engine):
        """engine's fused update (Engine.fuse_updates), writing its times into updates at
        the index of the task that calls it in the calls' run (reduce_order, after the calls)."""
        count, updates, apply = self.count, self.updates, engine._apply_columns
        calls = len(engine.groups)
        index = {engine.reduction.spans[t]: calls + k for k, t in enumerate(engine.reduce_order)}

        def traced(w, lo, hi, step):
            row = updates[(count[0] - 1) % len(updates), index[lo, hi]]
            row[0] = time.perf_counter()
            apply(w, lo, hi, step)
            row[1] = time.perf_counter()
        return traced


def traced_pool(trace):
    """A ProcessPool class whose programs and runs write into `trace`."""
    base = cgp.procs.ProcessPool

    class TracedPool(base):
        def program(self, fn):
            owner = getattr(fn, "__self__", None)   # an Engine's task program
            if hasattr(owner, "fuse_updates"):
                trace.engines.append(owner)
            return super().program(trace.wrap(fn, getattr(fn, "__name__", "?")))

        def start(self):
            # Once the trainer has wired its engines, before the workers fork.
            for engine in trace.engines:
                if engine._apply_columns is not None:
                    engine._apply_columns = trace.wrap_update(engine)
            super().start()

        def run(self, program, tasks, *args, first=None):
            k = int(trace.count[0]) % len(trace.runs)
            trace.tasks[k] = 0
            trace.updates[k] = 0
            trace.count[0] += 1
            started = time.perf_counter()
            super().run(program, tasks, *args, first=first)
            trace.runs[k] = program, started, time.perf_counter()
    return TracedPool


def measure(model, threads, steps, data_dir, overlap=True, merged=False):
    trace = Trace(runs=3 * steps + 16)
    cgp.procs.ProcessPool = traced_pool(trace)
    path = models.solver_path(model)
    config = RunConfig(threads=threads, progress=False, data_dir=data_dir, workers="processes")
    # One worker never forks: trace it through a pool of one process anyway.
    cgp.procs.forks = lambda workers, threads: workers == "processes"
    trainer = Trainer(read_solver(path), path, config, log=lambda line: None)
    trainer.engine.overlap = overlap
    # The caller's own work in a run: reading the next batch ahead.
    read_ahead, trace.read_ahead = trainer._read_ahead, []

    def timed_read_ahead(it):
        started = time.perf_counter()
        read_ahead(it)
        trace.read_ahead.append(time.perf_counter() - started)
    trainer._read_ahead = timed_read_ahead
    names = {i: "calls" if name == "_task" and not overlap else NAMES.get(name, name)
             for i, name in enumerate(trace.names)}
    with threadpool_limits(limits=1):
        for _ in range(10):
            trainer.step()
        trace.count[0] = 0
        step_times = []
        if merged:
            last = [time.perf_counter()]

            def each(it, loss, outputs, rate):
                now = time.perf_counter()
                step_times.append(now - last[0])
                last[0] = now
            trainer.steps(steps, each)
        for _ in range(0 if merged else steps):
            started = time.perf_counter()
            trainer.step()
            step_times.append(time.perf_counter() - started)
    trainer.close()
    return names, trace, step_times, trainer.engine


def task_kind(engine, name, i, tasks):
    """What task i of a run of `tasks` tasks of the program called `name` did: "call", "update
    block", or "reduction <layer>" (the layer whose backward it awaited)."""
    def reduction(t):
        return "reduction " + engine.net.entries[engine.awaited[t]].layer.name
    if name == "update":
        return "update block"
    if name == "reduction":
        return reduction(i)
    calls = len(engine.groups)
    reductions = len(engine.reduce_order) if engine.overlap else 0   # in the calls' run
    if engine._apply is not None and tasks == calls + len(engine.update_spans) + reductions:
        # a run with the previous step's update merged in
        if i < len(engine.merged_order):
            return "update block" if engine.merged_order[i] < 0 else "call"
        i -= len(engine.update_spans)
    # The calls' run hands its reduction tasks out in reduce_order (Engine._task).
    return "call" if i < calls else reduction(engine.reduce_order[i - calls])


def summarise_tasks(names, trace, step_times, engine):
    """Per kind of task (task_kind): its median time, how many run per step, and their time
    per step, over every traced run; of the tasks that fuse an update, the update's part,
    and its time by whether the task's worker had updated the same columns in the previous
    run that updated them."""
    kinds, parts, last, same, other = {}, {}, {}, [], []
    for k in range(int(trace.count[0])):
        rows, updates = trace.tasks[k], trace.updates[k]
        tasks = int((rows[:, 1] > 0).sum())
        for i in range(tasks):
            kind = task_kind(engine, names.get(int(trace.runs[k][0])), i, tasks)
            kinds.setdefault(kind, []).append(rows[i, 2] - rows[i, 1])
            if updates[i, 0] > 0:
                took = updates[i, 1] - updates[i, 0]
                parts.setdefault(kind, []).append(took)
                if i in last:
                    (same if last[i] == rows[i, 0] else other).append(took)
                last[i] = rows[i, 0]
    for kind, times in sorted(kinds.items()):
        each, per_step = 1e6 * statistics.median(times), len(times) / len(step_times)
        update = (f" (the update in it {1e6 * statistics.median(parts[kind]):6.1f} µs)"
                  if kind in parts else "")
        print(f"    {kind:<22} {each:8.1f} µs x {per_step:4.1f} per step = "
              f"{each * per_step / 1e3:6.3f} ms{update}")
    if same and other:
        print(f"    a fused update whose worker updated the same columns the step before: "
              f"{1e6 * statistics.median(same):.1f} µs (median of {len(same)}); whose "
              f"columns another worker updated: {1e6 * statistics.median(other):.1f} µs "
              f"({len(other)})")


def summarise_timeline(names, trace, engine):
    """The calls' runs (those holding calls) as a path in time from the caller's entry, in ms:
    medians over the runs, then the median-wall run's tasks, worker by worker."""
    runs = []
    for k in range(int(trace.count[0])):
        program, posted, returned = trace.runs[k]
        rows = trace.tasks[k]
        tasks = int((rows[:, 1] > 0).sum())
        kinds = [task_kind(engine, names.get(int(program)), i, tasks) for i in range(tasks)]
        calls = rows[[i for i, kind in enumerate(kinds) if kind == "call"]]
        if len(calls):
            runs.append((returned - posted, posted, rows[:tasks], kinds, calls))
    if not runs:
        return
    def ms(f):
        return 1e3 * statistics.median(f(*run) for run in runs)
    print(f"    timeline of the calls' run (ms from the caller's entry, medians of {len(runs)}): "
          f"calls start {ms(lambda w, p, r, k, c: c[:, 1].min() - p):.3f} to "
          f"{ms(lambda w, p, r, k, c: c[:, 1].max() - p):.3f}; a call takes "
          f"{ms(lambda w, p, r, k, c: (c[:, 2] - c[:, 1]).mean()):.3f} on average, the "
          f"longest {ms(lambda w, p, r, k, c: (c[:, 2] - c[:, 1]).max()):.3f}; the last call "
          f"ends at {ms(lambda w, p, r, k, c: c[:, 2].max() - p):.3f}, the last task at "
          f"{ms(lambda w, p, r, k, c: r[:, 2].max() - p):.3f}, the run returns at "
          f"{ms(lambda w, p, r, k, c: w):.3f}")
    wall, posted, rows, kinds, _ = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    for w in sorted({int(x) for x in rows[:, 0]}):
        mine = sorted((row[1], row[2], kind) for row, kind in zip(rows, kinds) if row[0] == w)
        print(f"      w{w:<3}" + "; ".join(f"{kind} {1e3 * (a - posted):.2f}-{1e3 * (b - posted):.2f}"
                                         for a, b, kind in mine))


def summarise(names, trace, step_times, engine, threads, tasks=False, timeline=False):
    n = int(trace.count[0])
    phases = {}
    for k in range(n):
        program, posted, returned = trace.runs[k]
        rows = trace.tasks[k][trace.tasks[k, :, 1] > 0]
        p = phases.setdefault(int(program), {"wall": [], "busy": [[] for _ in range(threads)],
                                             "late": [], "apart": []})
        p["wall"].append(returned - posted)
        ends = []
        for w in range(threads):
            mine = rows[rows[:, 0] == w]
            p["busy"][w].append(float((mine[:, 2] - mine[:, 1]).sum()))
            if len(mine):
                ends.append(mine[:, 2].max())
                if w:
                    p["late"].append(mine[:, 1].min() - posted)
        if len(ends) > 1:
            p["apart"].append(max(ends) - min(ends))
    def ms(xs):
        return 1e3 * statistics.median(xs) if xs else float("nan")
    step = ms(step_times)
    walls = 0.0
    print(f"{threads} worker(s): step {step:.3f} ms (median of {len(step_times)})")
    for program, p in sorted(phases.items()):
        once = len(p["wall"]) < len(step_times) / 2   # not a run of every step
        walls += 0.0 if once else ms(p["wall"])
        busy = "  ".join(f"w{w} {ms(b):.3f}" for w, b in enumerate(p["busy"]))
        ends = (f"  late {ms(p['late']):.3f}  ends apart {ms(p['apart']):.3f}"
                if threads > 1 else "")
        runs = f" ({len(p['wall'])} run(s), not in every step)" if once else ""
        print(f"  {names.get(program, program):>19}: wall {ms(p['wall']):.3f}  busy {busy}"
              f"{ends} ms{runs}")
    print(f"  serial (the step outside the runs) {step - walls:.3f} ms; the caller's reading "
          f"of the next batch, within a run, {ms(trace.read_ahead[-len(step_times):]):.3f} ms")
    if tasks:
        summarise_tasks(names, trace, step_times, engine)
    if timeline:
        summarise_timeline(names, trace, engine)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--separate", action="store_true")
    parser.add_argument("--merged", action="store_true")
    parser.add_argument("--tasks", action="store_true",
                        help="also each kind of task's time (calls, update blocks, reduction "
                             "tasks by the layer they await)")
    parser.add_argument("--timeline", action="store_true",
                        help="also the calls' run as a path in time, and the tasks of its "
                             "median run worker by worker")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    for threads in [int(t) for t in args.threads.split(",")]:
        summarise(*measure(args.model, threads, args.steps, args.data_dir, not args.separate,
                           args.merged), threads, args.tasks, args.timeline)


if __name__ == "__main__":
    main()
