"""Where a training step's time goes: per parallel phase (the chunks' forward and backward,
the reduction, the solver update), its wall time, the threads' busy time and their
utilisation, and the time outside the phases (data loading, the solver's preparation,
Python glue), which runs on one thread. Busy time that grows with the thread count is work
that gets slower when threads run side by side (shared caches, the interpreter lock).

    python bench/engine_phases.py [mnist|cifar10] [--threads 1,2] [--steps 200] [--no-factor]
                                  [--group 1] [--overlap]

--no-factor builds every chunk's InnerProduct weight gradient in its own buffer, as before
the factored gradients (the same bits), to show what factoring saves. --group N runs N
chunks per layer call (1: one chunk per call, as before grouped execution; the same bits)
instead of the engine's default. The reduction runs as a phase of its own unless --overlap,
where its tasks run in the chunks' phase as the engine runs them by default (Engine.overlap).
Threads only; bench/process_phases.py times worker processes.
"""
import argparse
import sys
import threading
import time

from threadpoolctl import threadpool_limits

from cgp import models
from cgp.engine import Engine, Pool
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


class TimedPool(Pool):
    """A Pool that adds up, per calling function, the wall time of run() and its tasks'."""

    def __init__(self, threads):
        super().__init__(threads)
        self.phases = {}   # caller's name -> [wall, busy]
        self._lock = threading.Lock()

    def run(self, fn, tasks, *args, first=None):
        name = sys._getframe(1).f_code.co_name
        busy = [0.0]

        def timed(worker, i):
            started = time.perf_counter()
            fn(worker, i, *args)
            with self._lock:
                busy[0] += time.perf_counter() - started

        started = time.perf_counter()
        super().run(timed, tasks, first=first)
        phase = self.phases.setdefault(name, [0.0, 0.0])
        phase[0] += time.perf_counter() - started
        phase[1] += busy[0]


PHASES = {"run": "chunks (forward, backward)", "__call__": "reduction", "flush": "solver update"}


def measure(model, threads, steps, data_dir, factor, group, overlap):
    # Trainer resolves the solver's net relative to the solver file.
    path = models.solver_path(model)
    config = RunConfig(threads=threads, progress=False, data_dir=data_dir, workers="threads")
    trainer = Trainer(read_solver(path), path, config, log=lambda line: None)
    pool = TimedPool(threads)
    trainer.pool.close()
    trainer.pool = trainer.engine.comm.pool = pool
    trainer.engine = Engine(trainer.net, trainer.config.chunks, pool, trainer.engine.comm,
                            factor=factor, group=group, overlap=overlap)
    trainer.fuse = False   # the solver update as a phase of its own (the rebuilt engine has none)
    with threadpool_limits(limits=1):
        for _ in range(10):
            trainer.step()
        pool.phases.clear()
        started = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        total = time.perf_counter() - started
    trainer.close()
    pool.close()
    groups = len(trainer.engine.groups)
    print(f"{model}, {threads} thread(s){'' if factor else ', unfactored'}, {groups} calls"
          f"{', the reduction overlapped' if overlap else ''}: "
          f"{1e3 * total / steps:.2f} ms per step")
    inside = 0.0
    for name, (wall, busy) in pool.phases.items():
        inside += wall
        label = "chunks and reduction" if overlap and name == "run" else PHASES.get(name, name)
        print(f"  {label:<28} wall {1e3 * wall / steps:6.2f} ms   busy "
              f"{1e3 * busy / steps:6.2f} ms   utilisation {busy / (threads * wall):.2f}")
    print(f"  {'outside the phases':<28} wall {1e3 * (total - inside) / steps:6.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--no-factor", action="store_true")
    parser.add_argument("--group", type=int, default=None)
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    for threads in map(int, args.threads.split(",")):
        measure(args.model, threads, args.steps, args.data_dir, not args.no_factor, args.group,
                args.overlap)


if __name__ == "__main__":
    main()
