"""Helpers shared by the bench scripts that compare trainers or kernels in one process:
interleaved timing, and another git revision's source."""
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer

ROOT = Path(__file__).resolve().parent.parent


def git_show(rev, path):
    """The text of `path` (from the repository root) at git revision `rev`; raises
    subprocess.CalledProcessError, with git's message in .stderr, where there is none."""
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def import_revision(rev, path, folder, script):
    """The module in file `path` (from the repository root) as of git revision `rev`,
    imported from a copy in `folder` under the name base_<file name>; exits naming `script`
    where git has no such file."""
    try:
        return import_revisions(rev, [path], folder)[Path(path).stem]
    except subprocess.CalledProcessError as err:
        sys.exit(f"{script}: git show {rev}: {err.stderr.strip()}")


def import_revisions(rev, paths, folder):
    """The modules in files `paths` (from the repository root, e.g. cgp/runtime/simd.py) as of git
    revision `rev`, imported in that order from copies in `folder` as base_<file name>. A
    copy's imports of the others (`from cgp.runtime.simd import`) are rewritten to the
    copies, so the revision's modules use each other, not the working tree's. `rev` may
    also be a folder that holds the revision's files at their paths (`git archive REV | tar
    -x -C DIR`), for a copy of the working tree without git's history (a lent machine).
    Returns {file name: module}; raises subprocess.CalledProcessError, with git's message,
    where git has no such file (OSError where the folder has none)."""
    sys.path.insert(0, str(folder))
    names = {path: Path(path).stem for path in paths}
    # cgp/x.py is cgp.x; kernels/x.py is installed as cgp.kernels.x.
    dotted = {path: "cgp." + path[:-len(".py")].replace("/", ".").removeprefix("cgp.")
              for path in paths}
    modules = {}
    for path in paths:
        text = (Path(rev) / path).read_text() if Path(rev).is_dir() else git_show(rev, path)
        for other in paths:
            text = text.replace(f"from {dotted[other]} import", f"from base_{names[other]} import")
        name = "base_" + names[path]
        copy = Path(folder) / f"{name}.py"
        copy.write_text(text)
        spec = importlib.util.spec_from_file_location(name, copy)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module   # for the copies that import it
        spec.loader.exec_module(module)
        modules[names[path]] = module
    return modules


def interleaved_rounds(trainers, rounds, steps, warmup=3, runs=None):
    """Times `steps` training steps of each trainer in turn, `rounds` times over, after
    `warmup` untimed steps each, so that a change of the machine's speed hits them all alike.
    runs: per trainer, run(n) making n steps (default: step() n times). Returns one list of
    round times (seconds) per trainer."""
    if runs is None:
        runs = [lambda n, t=t: [t.step() for _ in range(n)] for t in trainers]
    times = [[] for _ in trainers]
    with threadpool_limits(limits=1):
        for t, run in zip(trainers, runs):
            run(warmup)
            rest(t)
        for _ in range(rounds):
            for t, run, row in zip(trainers, runs, times):
                started = time.perf_counter()
                run(steps)
                row.append(time.perf_counter() - started)
                rest(t)
    return times


def rest(trainer):
    """Sends the trainer's pool threads to sleep, where its Pool can (see Pool.rest): they
    must not spin on the CPUs while the next trainer is timed."""
    if hasattr(trainer.pool, "rest"):
        trainer.pool.rest()


def pair_trainer(args, workers=None, cls=Trainer, config=RunConfig, **fields):
    """A trainer of the model, thread count and data folder that add_pair_options parsed,
    silent and without a progress bar. workers: RunConfig's (None: its default); cls and
    config: a subclass of Trainer, or another revision's Trainer and RunConfig; fields: more
    RunConfig fields."""
    path = models.solver_path(args.model)
    if workers is not None:
        fields["workers"] = workers
    return cls(read_solver(path), path,
               config(threads=args.threads, progress=False, data_dir=args.data_dir, **fields),
               log=lambda line: None)


def grouped_trainer(model, threads, group, data_dir, workers="processes", chunks=16):
    """A silent trainer whose engine makes calls of `group` chunks (None: the default,
    cgp.engine.group_size); the engine is built, and any workers forked, in the constructor,
    so that the trainer wires its update into it as training does."""
    import cgp.engine
    path = models.solver_path(model)
    config = RunConfig(threads=threads, chunks=chunks, progress=False, data_dir=data_dir,
                       workers=workers)
    default = cgp.engine.group_size
    if group is not None:
        cgp.engine.group_size = lambda net, chunks, threads: group
    try:
        return Trainer(read_solver(path), path, config, log=lambda line: None)
    finally:
        cgp.engine.group_size = default


def first_call_grad_views(engine, size):
    """The gradient views of the engine's first call, for a call of `size` of its samples:
    factored weight gradients (cgp.layers.Factors) take that many of the call's rows of
    their factors, the others are the call's per-part views as they are."""
    from cgp.layers import Factors
    samples = engine.samples(engine.groups[0])[1]
    return [[Factors(v.a[:size * len(v.a) // samples], v.b[:size * len(v.b) // samples])
             if isinstance(v, Factors) else v for v in layer]
            for layer in engine.group_grad_views[0]]


def add_pair_options(parser, threads, group=False):
    """The options of a bench script that compares two trainers (ab_pair); with group,
    --group N too (see use_group)."""
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data-dir", default=None)
    if group:
        parser.add_argument("--group", type=int, default=None)


def use_group(args):
    """Makes engines built from now on run args.group chunks per call (--group N), in place
    of cgp.engine.group_size's default; nothing when --group was not given."""
    if args.group is not None:
        import cgp.engine
        cgp.engine.group_size = lambda net, chunks, threads: args.group


def ab_pair(pair, names, args, runs=None):
    """Interleaved rounds (above) of two trainers A, B that train from one seed, as args
    (add_pair_options) ask. Prints A's and B's median time per step, B's speed relative to A
    as the median of the per-round ratios, and whether their weights came out bitwise equal;
    closes both. names: what to call A and B; runs: as interleaved_rounds'."""
    times = interleaved_rounds(pair, args.rounds, args.steps, runs=runs)
    ratio = statistics.median(a / b for a, b in zip(*times))
    same = np.array_equal(pair[0].net.params, pair[1].net.params)
    for t in pair:
        t.close()
    a_ms, b_ms = (1e3 * statistics.median(t) / args.steps for t in times)
    print(f"{args.model}, {args.threads} thread(s), {args.rounds} rounds of {args.steps} steps: "
          f"{names[0]} {a_ms:.2f} ms, {names[1]} {b_ms:.2f} ms per step; {names[1]} "
          f"x{ratio:.3f} as fast; same weights: {'yes' if same else 'NO'}")
