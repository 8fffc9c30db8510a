"""Where one thread's training step goes, phase by phase, in CPU time (issue 53): the layers'
forward and backward in the engine's calls, and everything around them: the call's own
Python (zeroing the chunk gradients, the loss shares), each reduction task's tree sum and
factored-gradient sum, the solver update and its finite checks, the caller's work for the
next step (the data layer's read and transform, the copy into the workers' inputs, the next
Step), the pool's and the engine's own Python, and the trainer's loop.

    python bench/step_phases.py [mnist|cifar10] [--steps 40] [--rounds 5] [--data-dir DIR]

One worker thread (workers as threads), so that every phase runs on the calling thread and
its CPU clock (time.thread_time) times it. Each phase is a wrapper around a function of the
step (monkeypatched into this process only), timed exclusive of the phases it calls; a
round first times --steps steps without the wrappers (the step as trained), then as many
with them. What the wrappers cost is the difference between the two step times, printed
too; it lands in the phases that call wrapped functions (the engine's and the pool's own
Python). The steps without the wrappers also give the run's tail, from the end of its last
call to the end of the run (one worker runs the tasks in turn: the reduction's sums and
the update in them), timed by three clock readings a step. Medians over the rounds.
"""
import argparse
import time
from collections import defaultdict

import numpy as np
from threadpoolctl import threadpool_limits

import cgp.comm.local
import cgp.engine
import cgp.net
import cgp.step
from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


class Phases:
    """Exclusive CPU time and calls of each named phase: a phase's time leaves out the time
    of the phases it calls."""

    def __init__(self):
        self.seconds, self.calls, self._stack = defaultdict(float), defaultdict(int), []
        self.on = False

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                inner = self._stack.pop()
                self.seconds[name] += spent - inner
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += spent
        return timed

    def patch(self, owner, attribute, name):
        setattr(owner, attribute, self.wrap(name, getattr(owner, attribute)))


def instrument(trainer, phases):
    """Wraps the step's functions; returns the phase names in the order of the table."""
    engine, step = trainer.engine, trainer.train_step
    updater, solver = step.updater, trainer.solver
    p = phases.patch
    p(trainer, "steps", "trainer loop")
    p(cgp.step.DataParallelStep, "__call__", "DataParallelStep")
    p(engine, "run", "Engine.run")
    p(engine.pool, "run", "Pool.run")
    p(engine, "_call", "call: zero grads, shares")
    p(cgp.net.BoundCall, "forward", "layers forward")
    p(cgp.net.BoundCall, "backward", "layers backward")
    p(engine, "_sum", "sum task: wait, counters")
    p(cgp.comm.local, "tree_sum", "tree_sum (chunk buffers)")
    p(cgp.comm.local, "outer_tree_sum", "outer_tree_sum (ip factors)")
    p(updater, "prefetch", "updater.prefetch")
    p(updater, "columns", "updater.columns")
    p(cgp.step, "all_finite", "all_finite (loss shares)")
    p(solver, "apply", "solver.apply")
    p(solver, "_kernel", "update kernel")
    p(cgp.engine, "sum_rows", "loss totals")
    p(trainer, "_work_ahead", "work ahead")
    p(solver, "prepare_ahead", "next Step")
    p(trainer, "_batch", "batch")
    for entry in engine.net.sources:
        p(entry.layer, "load", "data layer load")
        if hasattr(entry.layer, "transform"):
            p(entry.layer, "transform", "data transform")
    p(engine, "_copy_in", "copy batch in")
    return list(phases.seconds) or None


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--steps", type=int, default=40, help="steps per round and side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--data-dir", default=None)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    path = models.solver_path(args.model)
    trainer = Trainer(read_solver(path), path,
                      RunConfig(threads=1, chunks=args.chunks, progress=False,
                                workers="threads", data_dir=args.data_dir),
                      log=lambda line: None)
    phases = Phases()
    instrument(trainer, phases)
    engine, tail = trainer.engine, [0.0, 0.0]   # [end of the latest call, the tails' sum]
    call, run = engine._call, engine.pool.run

    def call_then_mark(*args):
        call(*args)
        tail[0] = time.thread_time()

    def run_then_tail(*args, **kwargs):
        run(*args, **kwargs)
        tail[1] += time.thread_time() - tail[0]
    engine._call, engine.pool.run = call_then_mark, run_then_tail
    plain, wrapped, tails, table = [], [], [], []
    with threadpool_limits(limits=1):
        trainer.steps(5)   # warm-up: compilation, first touches, bound calls
        for _ in range(args.rounds):
            phases.on = False
            tail[1] = 0.0
            started = time.thread_time()
            trainer.steps(args.steps)
            plain.append((time.thread_time() - started) / args.steps)
            tails.append(tail[1] / args.steps)
            phases.seconds.clear()
            phases.calls.clear()
            phases.on = True
            started = time.thread_time()
            trainer.steps(args.steps)
            wrapped.append((time.thread_time() - started) / args.steps)
            table.append({name: (s / args.steps, phases.calls[name] / args.steps)
                          for name, s in phases.seconds.items()})
    trainer.close()
    names = list(table[-1])
    ms = {name: np.median([row.get(name, (0, 0))[0] for row in table]) * 1e3 for name in names}
    calls = {name: table[-1][name][1] for name in names}
    step, timed = np.median(plain) * 1e3, np.median(wrapped) * 1e3
    layers = ms.get("layers forward", 0) + ms.get("layers backward", 0)
    print(f"{args.model}, 1 thread, {args.chunks} chunks, CPU time per step, medians of "
          f"{args.rounds} rounds of {args.steps} steps: step {step:.3f} ms as trained, "
          f"{timed:.3f} ms with the wrappers ({timed - step:+.3f}); the layers {layers:.3f} "
          f"ms, the rest {timed - layers:.3f} ms ({(timed - layers) / timed:.1%})")
    print(f"  the run's tail after its last call, as trained: {np.median(tails) * 1e3:.3f} ms "
          f"(rounds {' '.join(f'{t * 1e3:.3f}' for t in tails)})")
    print(f"  {'phase':34s} {'ms':>7s} {'step':>6s} {'calls':>6s}")
    for name in sorted(names, key=lambda n: -ms[n]):
        print(f"  {name:34s} {ms[name]:7.3f} {ms[name] / timed:6.1%} {calls[name]:6.1f}")


if __name__ == "__main__":
    main()
