"""Interleaved A/B of whole training steps against another git revision of the whole package
(cgp/, kernels/, models/, datasets/: layers, kernels and runtime alike), each side in a
process of its own, which imports that side's package, so that each revision's layers run
with its own kernels and runtime. The two processes train from one seed and take turns:
each round times `--steps` steps of one and then of the other (the order alternating from
round to round), so a change of the machine's speed hits both alike. A process keeps a speed of its
own, though (where its memory landed): with the same code on both sides, pairs of processes
read 0.94 – 1.03. So --pairs pairs run one after another. Prints the median time of a step
for each side, the working tree's speed as the median over the pairs of each pair's median
per-round ratio, with every pair's, and whether the two ended with bitwise equal weights.
Each side uses only what every revision's trainer offers: Trainer, RunConfig, steps(n) and
net.params. This is the check that a restructure keeps the speed.

    python bench/revision_ab.py --base REV [mnist|cifar10] [--threads 1] [--chunks 16]
                                [--workers processes] [--pairs 5] [--rounds 15] [--steps 8]
                                [--data-dir DIR] [--clock cpu]

--clock cpu times each side's steps by its process's CPU time (all its threads), which the
waits for a core on a loaded machine leave out; it needs --workers threads (worker processes'
time is not the process's) and suits one worker, where no thread waits for another.

REV is a git revision, or a folder that holds one's files at their paths: a checkout, or
`git archive REV cgp kernels models datasets | tar -x -C DIR` (a lent machine's copy has no
git history). A revision from git compiles its own kernels on first use (Numba's cache then
keeps them for the run); a folder's copy brings the Numba cache it holds.
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The repository's top-level folders that install inside the cgp package (pyproject.toml).
INSIDE = ("kernels", "models", "datasets")


def package_copy(rev, folder):
    """A folder whose cgp/ is revision `rev`'s package, laid out as installed."""
    source = Path(folder) / "source"
    source.mkdir()
    if Path(rev).is_dir():
        for name in ("cgp",) + INSIDE:
            shutil.copytree(Path(rev) / name, source / name)
    else:
        archive = subprocess.run(["git", "archive", rev, "cgp", *INSIDE], cwd=ROOT,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    for name in INSIDE:
        (source / name).rename(source / "cgp" / name)
    return source


def child(args):
    """One side: reads a command per line from stdin ("N": run N steps, "end"), answers each
    with a line of JSON on stdout."""
    from threadpoolctl import threadpool_limits

    import cgp
    from cgp import models
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig, Trainer

    path = models.solver_path(args.model)
    trainer = Trainer(read_solver(path), path,
                      RunConfig(threads=args.threads, chunks=args.chunks, progress=False,
                                data_dir=args.data_dir, workers=args.workers),
                      log=lambda line: None)
    with threadpool_limits(limits=1):
        for line in sys.stdin:
            if line.strip() == "end":
                digest = hashlib.sha256(trainer.net.params.tobytes()).hexdigest()
                print(json.dumps({"sha256": digest, "package": cgp.__file__}), flush=True)
                break
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            started = clock()
            trainer.steps(int(line))   # as training runs them
            seconds = clock() - started
            rest(trainer)
            print(json.dumps({"seconds": seconds}), flush=True)
    trainer.close()


def rest(trainer):
    """Sends the trainer's waiting workers to sleep where its pool can (Pool.rest): they must
    not spin on the CPUs while the other side is timed. A trainer without one is left be."""
    pool = getattr(trainer, "pool", None)
    if hasattr(pool, "rest"):
        pool.rest()


def ask(side, command):
    """Sends a side's process a command line and returns its answer."""
    side.stdin.write(command + "\n")
    side.stdin.flush()
    line = side.stdout.readline()
    if not line:
        sys.exit(f"revision_ab: a side ended early (exit {side.wait()})")
    return json.loads(line)


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--base", required=True,
                        help="git revision to compare against, or a folder of its files")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    parser.add_argument("--pairs", type=int, default=5,
                        help="pairs of processes, one pair after another")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock, or each side's process CPU time (--workers threads)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.workers != "threads":
        parser.error("--clock cpu times one process: give --workers threads")
    return args


def main():
    args = parse_args()
    if args.child:
        return child(args)
    forwarded = [args.model, "--base", args.base, "--threads", str(args.threads),
                 "--chunks", str(args.chunks), "--workers", args.workers, "--clock",
                 args.clock, "--child"]
    if args.data_dir is not None:
        forwarded += ["--data-dir", args.data_dir]
    times, ratios = [[], []], []
    with tempfile.TemporaryDirectory() as folder:
        try:
            base_path = package_copy(args.base, folder)
        except (subprocess.CalledProcessError, OSError) as err:
            sys.exit(f"revision_ab: {args.base}: "
                     f"{getattr(err, 'stderr', b'').decode().strip() or err}")
        # The base side finds its copy on PYTHONPATH, ahead of the installed package, which
        # the working tree's side imports as every other command does.
        own_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        for _ in range(args.pairs):
            sides = [subprocess.Popen([sys.executable, __file__, *forwarded], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for env in (dict(own_env, PYTHONPATH=str(base_path)), own_env)]
            for side in sides:
                ask(side, "3")   # warm-up: compilation, first touches
            pair = [[], []]
            for r in range(args.rounds):
                for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                    pair[i].append(ask(sides[i], str(args.steps))["seconds"])
            ends = [ask(side, "end") for side in sides]
            for side in sides:
                side.wait()
            if not ends[0]["package"].startswith(folder):
                sys.exit(f"revision_ab: the base side imported {ends[0]['package']}, not its "
                         f"copy")
            ratios.append(statistics.median(a / b for a, b in zip(*pair)))
            for row, more in zip(times, pair):
                row.extend(more)
    base_ms, own_ms = (1e3 * statistics.median(t) / args.steps for t in times)
    same = ends[0]["sha256"] == ends[1]["sha256"]
    print(f"{args.model}, {args.threads} worker(s) ({args.workers}, {args.chunks} chunks), "
          f"{'CPU time, ' if args.clock == 'cpu' else ''}"
          f"{args.pairs} pair(s) "
          f"of processes, {args.rounds} rounds of {args.steps} steps each: {args.base} "
          f"{base_ms:.2f} ms, working tree {own_ms:.2f} ms per step; working tree "
          f"x{statistics.median(ratios):.3f} as fast (each pair: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}); same weights: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
