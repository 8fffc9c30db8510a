"""Where each process's CPU goes in a training step on N worker processes (issue 53): the
calls (forward and backward), the reduction's sum tasks (the tree sums, the factored sums,
the update's claims and the update in them, their own Python), the sum tasks' waits for the
calls' progress, the caller's work during the run (the next batch and Step), and the rest:
the waits between runs and for a run's last task, and the caller's Python between runs.
Against one worker's, this says how far the N-worker step is from N times as fast, in CPU
time, which a machine shared with other work moves far less than wall time.

    python bench/step_waits.py [mnist] [--threads 2] [--steps 300] [--rounds 3]
                               [--data-dir DIR]

The engine's methods are wrapped (in this process only, before the workers are forked, so
they inherit the wrappers) with each thread's CPU clock, their figures added in shared
memory; each process's whole CPU time is read from /proc (Linux). A wait spins in compiled
code for up to 10 ms before it sleeps, so a wait's CPU is about its wall time.
"""
import argparse
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

import cgp.comm.local
import cgp.engine
import cgp.step
from cgp import models
from cgp.prototxt import read_solver
from cgp.runtime import pool as thread_pool
from cgp.runtime.memory import aligned_zeros
from cgp.train import RunConfig, Trainer

PHASES = ("calls", "tree sums", "factored sums", "update claims", "update",
          "sum tasks' own", "sum waits", "caller's work")
TICK = os.sysconf("SC_CLK_TCK")
MAX_WORKERS = 16


def cpu_of(pid):
    """CPU seconds (user + system) of process pid so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def instrument(seconds, worker_of):
    """Wraps the engine's calls, sum tasks and waits, the reduction's sums, the update and
    its claims, and the caller's work: each adds its thread CPU time, exclusive of the
    wrapped functions it calls, into seconds[worker_of(), phase]."""
    stack = []   # this process's open phases: the time of the phases they called

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            stack.append(0.0)
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                seconds[worker_of(), PHASES.index(phase)] += spent - stack.pop()
                if stack:
                    stack[-1] += spent
        return wrapper
    E, U, L = cgp.engine.Engine, cgp.step.Updater, cgp.comm.local
    E._call = timed("calls", E._call)
    E._sum = timed("sum tasks' own", E._sum)
    E._wait = timed("sum waits", E._wait)
    # The reduction's tasks look these up in their module when they run.
    L.tree_sum = timed("tree sums", L.tree_sum)
    L.outer_tree_sum = timed("factored sums", L.outer_tree_sum)
    U.prefetch = timed("update claims", U.prefetch)
    U.columns = timed("update", U.columns)
    thread_pool.CallersWork.__call__ = timed("caller's work", thread_pool.CallersWork.__call__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    # In shared memory, made before the workers are forked: the figures, and the pids by
    # which a worker finds its row (written once they exist).
    seconds = aligned_zeros((MAX_WORKERS, len(PHASES)), np.float64, True)
    pids = aligned_zeros(MAX_WORKERS, np.int64, True)
    pids[0] = os.getpid()
    instrument(seconds, lambda: int(np.flatnonzero(pids == os.getpid())[0]))
    path = models.solver_path(args.model)
    trainer = Trainer(read_solver(path), path, RunConfig(threads=args.threads, progress=False,
                                                               data_dir=args.data_dir),
                      log=lambda line: None)
    procs = [p.pid for p in getattr(trainer.pool, "procs", [])]
    pids[1:1 + len(procs)] = procs
    n, workers, rows = args.steps, 1 + len(procs), []
    with threadpool_limits(limits=1):
        trainer.steps(20)
        for _ in range(args.rounds):
            seconds[...] = 0
            cpu0 = [cpu_of(p) for p in pids[:workers]]
            started = time.perf_counter()
            trainer.steps(n)
            wall = time.perf_counter() - started
            cpu = [cpu_of(p) - c for p, c in zip(pids[:workers], cpu0)]
            rows.append((wall, cpu, seconds[:workers].copy()))
    trainer.close()
    print(f"{args.model}, {args.threads} worker(s), {args.rounds} rounds of {n} steps; ms per "
          f"step, medians over the rounds: wall {np.median([r[0] for r in rows]) / n * 1e3:.3f}")
    for w in range(workers):
        total = np.median([r[1][w] for r in rows]) / n * 1e3
        parts = [np.median([r[2][w, k] for r in rows]) / n * 1e3 for k in range(len(PHASES))]
        print(f"  worker {w}: CPU {total:.3f} = " + ", ".join(
            f"{name} {ms:.3f}" for name, ms in zip(PHASES + ("the rest",),
                                                    parts + [total - sum(parts)])))


if __name__ == "__main__":
    main()
