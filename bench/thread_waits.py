"""Where a 2-thread step loses time inside its chunk phase: per layer call (a task), its wall
time, the CPU time its thread got, and the difference (time spent waiting: for the interpreter
lock between kernels, or descheduled); how far apart the threads' calls start and finish; the
context switches per step; and the steal time (CPU time the hypervisor gave to other guests).
One thread runs the same calls with nothing to wait for.

    python bench/thread_waits.py [mnist|cifar10] [--threads 1,2] [--steps 300] [--data-dir DIR]
"""
import argparse
import os
import resource
import statistics
import sys
import time

from threadpoolctl import threadpool_limits

from cgp import models
from cgp.bench import steal_seconds
from cgp.engine import Pool
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


class TracingPool(Pool):
    """A Pool that records, for each run() called by the engine's chunk phase, every task's
    start, wall time and thread CPU time."""

    def __init__(self, threads):
        super().__init__(threads)
        self.runs = []

    def run(self, fn, tasks, *args, first=None):
        if sys._getframe(1).f_code.co_name != "run":   # the update: untraced
            return super().run(fn, tasks, *args, first=first)
        records, started = [], time.perf_counter()

        def traced(worker, i):
            wall, cpu = time.perf_counter(), time.thread_time()
            fn(worker, i, *args)
            if i < self.calls:   # the reduction's tasks that follow: untraced
                records.append((wall - started, time.perf_counter() - wall,
                                time.thread_time() - cpu))

        super().run(traced, tasks, first=first)
        self.runs.append((time.perf_counter() - started, records))


def measure(model, threads, steps, data_dir):
    path = models.solver_path(model)
    trainer = Trainer(read_solver(path), path, RunConfig(threads=threads, progress=False,
                                                         data_dir=data_dir, workers="threads"),
                      log=lambda l: None)
    pool = TracingPool(threads)
    trainer.pool.close()
    trainer.pool = trainer.engine.comm.pool = trainer.engine.pool = pool
    pool.calls = len(trainer.engine.groups)
    try:
        with threadpool_limits(limits=1):
            for _ in range(10):
                trainer.step()
            pool.runs.clear()
            before = resource.getrusage(resource.RUSAGE_SELF)
            stolen, started = steal_seconds(), time.perf_counter()
            for _ in range(steps):
                trainer.step()
            stolen = (steal_seconds() - stolen) / (time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        trainer.close()
        pool.close()
    # A task record: (start after the phase began, wall time, its thread's CPU time).
    tasks = [r for _, records in pool.runs for r in records]

    def median_ms(values):
        return 1e3 * statistics.median(values)

    wall, cpu = median_ms([t[1] for t in tasks]), median_ms([t[2] for t in tasks])
    waiting = max(0.0, median_ms([t[1] - t[2] for t in tasks]))
    print(f"{model}, {threads} thread(s), {len(pool.runs[0][1])} calls per step, {steps} steps:")
    print(f"  chunk phase          {median_ms([w for w, _ in pool.runs]):7.2f} ms per step "
          "(with the reduction's tasks, which overlap the calls' ends)")
    print(f"  a call: wall         {wall:7.2f} ms, its thread's CPU {cpu:.2f} ms, "
          f"waiting {waiting:.2f} ms")
    if threads > 1:
        runs = [records for _, records in pool.runs if len(records) > 1]
        last_start = median_ms([max(r[0] for r in rs) for rs in runs])
        ends = [[r[0] + r[1] for r in rs] for rs in runs]
        apart = median_ms([max(e) - min(e) for e in ends])
        print(f"  last call starts     {last_start:7.2f} ms after the phase; calls end "
              f"{apart:.2f} ms apart")
    print(f"  context switches     {(after.ru_nvcsw - before.ru_nvcsw) / steps:7.1f} voluntary, "
          f"{(after.ru_nivcsw - before.ru_nivcsw) / steps:.1f} involuntary per step")
    print(f"  steal time           {stolen:7.3f} of {os.cpu_count()} CPUs withheld by the "
          "hypervisor")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    for threads in map(int, args.threads.split(",")):
        measure(args.model, threads, args.steps, args.data_dir)


if __name__ == "__main__":
    main()
