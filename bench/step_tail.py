"""How uneven a training's steps are, per worker count: each of --steps iterations timed on
its own (Trainer.steps, as training runs them), then the median, the mean, the 90th and 99th
percentiles and the longest, and the tail's share: how much of the whole time the steps
spent beyond the median. A step of many workers waits for the slowest, so any worker that
loses its CPU for a while (another process's turn in this OS, or the hypervisor's: steal
time) holds up all of them, where one worker alone loses only its own time. Beside the times:
the CPU time the hypervisor withheld from this machine during the steps (steal, in CPUs),
and how often this OS took a worker's CPU from it (involuntary context switches of the
caller and the worker processes, per step).

    python bench/step_tail.py [mnist|cifar10] [--threads 1,16] [--steps 500] [--chunks 16]
                              [--data-dir DIR]
"""
import argparse
import statistics
import time

import numpy as np
import psutil
from threadpoolctl import threadpool_limits

from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


def switches(processes):
    """Involuntary context switches of these processes, summed."""
    return sum(p.num_ctx_switches().involuntary for p in processes)


def steal():
    """The machine's steal time so far, in CPU-seconds (0 where the OS does not count it)."""
    return getattr(psutil.cpu_times(), "steal", 0.0)


def measure(model, threads, chunks, steps, data_dir):
    path = models.solver_path(model)
    trainer = Trainer(read_solver(path), path,
                      RunConfig(threads=threads, chunks=chunks, progress=False,
                                data_dir=data_dir),
                      log=lambda line: None)
    try:
        processes = [psutil.Process()] + psutil.Process().children()   # the worker processes
        times = np.empty(steps)
        with threadpool_limits(limits=1):
            trainer.steps(10)   # warm: the first steps after the workers start run slow
            stolen, switched, began = steal(), switches(processes), time.perf_counter()
            for k in range(steps):
                start = time.perf_counter()
                trainer.steps(1)
                times[k] = time.perf_counter() - start
            wall = time.perf_counter() - began
            stolen, switched = steal() - stolen, switches(processes) - switched
    finally:
        trainer.close()
    return times, stolen / wall, switched / steps


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--data-dir", default=None)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    print(f"{args.model}, {args.chunks} chunks: {args.steps} steps at each worker count, each "
          f"timed (ms)")
    print("workers  median    mean     p90     p99     max  tail share  steal (CPUs)  "
          "preempted/step")
    for threads in [int(t) for t in args.threads.split(",")]:
        times, stolen, switched = measure(args.model, threads, args.chunks, args.steps,
                                           args.data_dir)
        median = statistics.median(times)
        tail = np.maximum(times - median, 0).sum() / times.sum()
        ms = times * 1e3
        print(f"{threads:7d} {median * 1e3:7.3f} {ms.mean():7.3f} {np.percentile(ms, 90):7.3f} "
              f"{np.percentile(ms, 99):7.3f} {ms.max():7.3f} {tail:10.1%} {stolen:13.3f} "
              f"{switched:15.2f}", flush=True)


if __name__ == "__main__":
    main()
