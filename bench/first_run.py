"""What a cold first run of `cgp train` compiles, and what else it does before its first
iteration (issue 53): every Numba compilation (its "numba:compile" event) with its
signature and its own seconds (those of the kernels it compiled inside left out), per
kernel the signatures and seconds, then the phases (import, the Trainer, a test pass, the
first steps). Numba's cache is an empty temp folder unless NUMBA_CACHE_DIR is set.
With `--processes N`, the compile of `cgp train` in N forked processes (cgp.runtime.compile)
instead: per process a timeline of its set-up, each kernel it compiled (claimed), its waits
for another's claim, its skips, and its idle end, then the functions compiled in more than
one process (the callees that kernels claimed in both share).

    python bench/first_run.py [mnist] [--threads 1] [--steps 2] [--top 25] [--processes 2]
                              [--data-dir DIR]
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
    p.add_argument("--processes", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    if args.processes:
        return timeline(args.model, args.processes, args.data_dir)
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
                                          data_dir=args.data_dir, progress=False),
                      log=lambda line: None)
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


def timeline(model, n, data_dir=None):
    """Runs precompile in n processes with its hooks wrapped to record, per process, what it
    did when (one line an event, appended to a file that the forked processes share), then
    prints each process's timeline and the duplicated compiles."""
    import cgp.cli   # noqa: F401
    from cgp.models import solver_path
    from cgp.prototxt import read_solver
    from cgp.runtime import compile as cc
    from cgp.train import RunConfig, Trainer

    log_path = os.path.join(os.environ["NUMBA_CACHE_DIR"], "timeline.txt")
    t0 = time.perf_counter()

    def note(*parts):   # one write(2) a line: the processes' lines do not interleave
        line = " ".join([str(os.getpid()), f"{time.perf_counter() - t0:.4f}",
                         f"{time.process_time():.4f}", *map(str, parts)])
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(fd, (line + "\n").encode())
        os.close(fd)

    class Events(event.Listener):
        def on_start(self, ev):
            py = getattr(ev.data.get("dispatcher"), "py_func", None)
            note("cstart", f"{getattr(py, '__module__', '?')}.{getattr(py, '__qualname__', '?')}",
                 str(ev.data.get("args")).replace(" ", ""))

        def on_end(self, ev):
            note("cend")

    def wrap(owner, name, before, after=None):
        original = getattr(owner, name)

        def wrapped(*a, **k):
            before(*a)
            try:
                return original(*a, **k)
            finally:
                if after:
                    after(*a)
        setattr(owner, name, wrapped)

    wrap(cc, "_compile_in_child", lambda *a: note("forked"))
    wrap(Trainer, "__init__", lambda *a: note("trainer"), lambda *a: note("trainer_done"))
    wrap(Trainer, "test", lambda *a: note("phase", "test"))
    wrap(Trainer, "steps", lambda *a: note("phase", "steps"))
    wrap(Trainer, "close", lambda *a: note("end"))
    wrap(cc.Share, "wait_for", lambda self, name, *a: note("wstart", name),
         lambda *a: note("wend"))
    returns_nothing = cc.returns_nothing

    def noting(py_func):
        nothing = returns_nothing(py_func)
        if nothing:
            note("skip", f"{py_func.__module__}.{py_func.__qualname__}")
        return nothing
    cc.returns_nothing = noting
    event.register("numba:compile", Events())

    path = str(solver_path(model))
    sp = read_solver(path)
    config = RunConfig(threads=1, data_dir=data_dir, progress=False)
    started = time.perf_counter()
    cc.precompile(sp, path, config, print, processes=n)
    print(f"precompile: {time.perf_counter() - started:.1f} s wall")
    report_timeline(log_path, time.perf_counter() - t0)


def report_timeline(log_path, total):
    """Per process: set-up, compiles by claimed kernel (top level, with their seconds), waits,
    skips, idle end; then the functions compiled in more than one process."""
    lines, cpus, ends = defaultdict(list), {}, []
    with open(log_path) as f:
        for line in f:
            pid, t, cpu, kind, *rest = line.split()
            lines[int(pid)].append((float(t), kind, rest))
            cpus[int(pid)] = float(cpu)
    compiled = defaultdict(lambda: defaultdict(float))   # function -> pid -> own seconds
    for pid, events in sorted(lines.items(), key=lambda kv: kv[1][0][0]):
        if not any(kind == "forked" for _, kind, _ in events):
            continue   # the parent: loads only
        print(f"\nprocess {pid}")
        stack, sums, waiting, last = [], defaultdict(float), None, events[0][0]
        for t, kind, rest in events:
            if kind == "cstart":
                stack.append([rest[0], t, 0.0])
            elif kind == "cend":
                name, began, nested = stack.pop()
                compiled[name][pid] += t - began - nested
                if stack:
                    stack[-1][2] += t - began
                else:
                    sums["compile"] += t - began
                    print(f"  {began:7.2f} {t - began:6.2f} s compile {name}")
            elif kind == "wstart":
                waiting = (t, rest[0])
            elif kind == "wend":
                sums["wait"] += t - waiting[0]
                print(f"  {waiting[0]:7.2f} {t - waiting[0]:6.2f} s WAIT for {waiting[1]}")
            elif kind == "skip":
                sums["skips"] += 1
            elif kind in ("forked", "trainer_done", "phase", "end"):
                print(f"  {t:7.2f}        {kind} {' '.join(rest)}")
            last = t
        first = events[0][0]
        setup = next(t for t, k, _ in events if k == "trainer_done") - first
        print(f"  set-up (fork to Trainer) {setup:.2f} s, compiling {sums['compile']:.2f} s, "
              f"waiting {sums['wait']:.2f} s, {int(sums['skips'])} skips, ended {last:.2f} s, "
              f"idle at the end {total - last:.2f} s; CPU {cpus[pid]:.2f} s")
        ends.append(cpus[pid])
    # Where the processes contend with other jobs for the cores, their wall time tells
    # little; their CPU seconds (the forked ones' from the fork) do not depend on the load,
    # and on free cores the longest, plus its waits, is the compile's wall time.
    print(f"\nthe processes' CPU: {', '.join(f'{c:.2f}' for c in ends)} s; "
          f"the longest {max(ends):.2f} s, in all {sum(ends):.2f} s")
    twice = {name: by for name, by in compiled.items() if len(by) > 1}
    print(f"\ncompiled in more than one process: {len(twice)} functions, "
          f"{sum(min(by.values()) for by in twice.values()):.2f} s (the smaller share each)")
    for name, by in sorted(twice.items(), key=lambda kv: -min(kv[1].values())):
        print(f"  {min(by.values()):6.2f}  {name}")


if __name__ == "__main__":
    sys.exit(main())
