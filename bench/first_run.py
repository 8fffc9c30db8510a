"""What a cold first run of `cgp train` compiles, and what else it does before its first
iteration (issue 53): every Numba compilation (its "numba:compile" event) with its
signature and its own seconds (those of the kernels it compiled inside left out), per
kernel the signatures and seconds, then the phases (import, the Trainer, a test pass, the
first steps). Numba's cache is an empty temp folder unless NUMBA_CACHE_DIR is set.

    python bench/first_run.py [mnist] [--threads 1] [--steps 2] [--top 25]
"""
import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

if __name__ == "__main__" and "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="cgp-first-run-")
from numba.core import event  # noqa: E402  (once the cache folder is chosen)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="mnist")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    marks = [("start", time.perf_counter())]   # (phase ended, when)
    phase = lambda name: marks.append((name, time.perf_counter()))   # noqa: E731

    listener, llvm = Compiles(), Held()
    event.register("numba:compile", listener)
    event.register("numba:llvm_lock", llvm)   # LLVM's share: held while LLVM works
    import cgp.cli   # noqa: F401  (imports cgp as `cgp train` does)
    from cgp.models import solver_path
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig, Trainer
    phase("import cgp")
    path = str(solver_path(args.model))
    sp = read_solver(path)
    trainer = Trainer(sp, path, RunConfig(threads=args.threads, workers="threads",
                                          progress=False), log=lambda line: None)
    phase("Trainer()")
    try:
        for i in range(len(trainer.test_nets)):
            trainer.test(i)
        phase("test pass(es)")
        trainer.steps(args.steps)
        phase(f"{args.steps} steps")
    finally:
        trainer.close()
    event.unregister("numba:compile", listener)
    event.unregister("numba:llvm_lock", llvm)
    listener.report(args.top)
    print(f"of which LLVM (numba:llvm_lock held) {llvm.seconds:.1f} s")
    print()
    for (_, before), (name, after) in zip(marks, marks[1:]):
        print(f"{name:24s} {after - before:7.2f} s")
    print(f"cache: {os.environ['NUMBA_CACHE_DIR']}")


class Held(event.Listener):
    """The seconds inside an event's start and end (a lock held), nested ones once."""

    def __init__(self):
        self.depth, self.started, self.seconds = 0, 0.0, 0.0

    def on_start(self, ev):
        if self.depth == 0:
            self.started = time.perf_counter()
        self.depth += 1

    def on_end(self, ev):
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.started


class Compiles(event.Listener):
    """numba:compile events: each compilation's own time, by kernel (module.qualname)."""

    def __init__(self):
        self.stack = []                        # [name, started, seconds of nested compiles]
        self.own = defaultdict(float)          # kernel -> own seconds
        self.sigs = defaultdict(list)          # kernel -> signatures compiled
        self.total = 0.0

    def on_start(self, ev):
        d = ev.data.get("dispatcher")
        py = getattr(d, "py_func", None)
        name = f"{getattr(py, '__module__', '?')}.{getattr(py, '__qualname__', '?')}"
        self.sigs[name].append(str(ev.data.get("args")))
        self.stack.append([name, time.perf_counter(), 0.0])

    def on_end(self, ev):
        name, started, nested = self.stack.pop()
        seconds = time.perf_counter() - started
        self.own[name] += seconds - nested
        if self.stack:
            self.stack[-1][2] += seconds
        else:
            self.total += seconds

    def report(self, top):
        n_sigs = sum(len(s) for s in self.sigs.values())
        print(f"{len(self.own)} functions, {n_sigs} compilations, {self.total:.1f} s compiling")
        print(f"{'own s':>7s} {'sigs':>4s}  kernel")
        for name, seconds in sorted(self.own.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{seconds:7.2f} {len(self.sigs[name]):4d}  {name}")


if __name__ == "__main__":
    sys.exit(main())
