"""`cgp bench speedup`: training throughput of one solver at several thread counts, and
optionally of the same network in PyTorch, measured in one run so the ratios are fair.

The configurations (each thread count; PyTorch in both memory formats) are timed round-robin,
the order rotated every repetition, so slow drift on a shared machine hits them all alike;
each figure is the median over the repetitions (the statistics: cgp.tools.stats). Results go
to JSON, CSV and (with matplotlib) a PNG, named by model and UTC time, with a description of
the machine (cgp.tools.machine), into ./cgp-results/ or --out. Not here: the kernels.
"""
import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cgp.options import (EPILOG, add_denormals_option, add_device_option, add_workers_option,
                         check_threads, solver_file, thread_list, worker_list)
from cgp.tools.machine import (MATMUL_SIZE, ForeignLoad, machine_info, matmul_gflops,
                               steal_seconds)
from cgp.tools.stats import _paired, _with_ci, summarise, table

# csv, json and statistics are imported where used: the command line imports this module for
# its options on every run, and `cgp train` should start fast.

# Where the results go by default: a folder of the working directory, never the package's.
OUT = "cgp-results"


def add_bench(sub):
    p = sub.add_parser("bench", help="measure training speed")
    kinds = p.add_subparsers(dest="bench", required=True)
    s = kinds.add_parser(
        "speedup", epilog=EPILOG,
        help="images/s, speedup and parallel efficiency against the thread count",
        description="Times --repeats x --iters training iterations per thread count, the "
                    "counts interleaved round-robin; prints medians, speedup over 1 thread "
                    "(also as the median of the ratios within each round) and efficiency, "
                    "and writes JSON, CSV and a PNG plot into --out.")
    s.add_argument("model", nargs="?", help="short name of a bundled model (mnist, cifar10, ...)")
    s.add_argument("--solver", help="solver prototxt (Caffe's format)")
    s.add_argument("--model", dest="net_file", metavar="FILE",
                   help="a net prototxt instead (a deploy net of the model zoo, say), trained "
                        "with plain momentum SGD on synthetic input: its Input layers get "
                        "seeded standard-normal values, labels random classes. A net without "
                        "a loss is timed as it would train, in cgp and PyTorch alike: an "
                        "output made by Softmax becomes SoftmaxWithLoss against the labels, "
                        "any other output is summed into the loss, and BatchNorm computes "
                        "batch statistics")
    s.add_argument("--batch", type=int, default=None,
                   help="with --model: the batch size, set on the net's Input shapes and "
                        "data layers (default: the net's own)")
    s.add_argument("--threads", default=None,
                   help="comma-separated thread counts (default: 1, 2, 4, ... up to the "
                        "logical cores); 1 is always added, the baseline of the speedups")
    s.add_argument("--chunks", type=int, default=16,
                   help="fixed pieces each batch is cut into (default 16), as for cgp train")
    add_workers_option(s, listed=True)
    add_denormals_option(s)
    s.add_argument("--data-dir", default=None,
                   help="folder holding the data set (overrides CGP_DATA_DIR and the bundled copy)")
    s.add_argument("--no-download", action="store_true", help="never download a missing data set")
    s.add_argument("--seed", type=int, default=None, help="overrides the solver's random_seed")
    s.add_argument("--iters", type=int, default=20, help="iterations per timing (default 20)")
    s.add_argument("--repeats", type=int, default=5,
                   help="timings per configuration; the median counts (default 5)")
    s.add_argument("--min-seconds", type=float, default=0.5,
                   help="each timing runs at least this long (default 0.5): where --iters "
                        "would take less by the last warm-up iteration, a configuration's "
                        "timings run more iterations (said, and in the results' iters); a "
                        "timing of a tenth of a second measures the scheduler and the other "
                        "programs as much as the training. 0: --iters alone")
    s.add_argument("--warmup", type=int, default=3,
                   help="untimed iterations per configuration first (default 3)")
    s.add_argument("--lead-in", type=int, default=3,
                   help="untimed iterations at the start of every timing (default 3): a CPU "
                        "left idle while the other configurations ran needs a few "
                        "iterations to regain its speed, which training never pays")
    s.add_argument("--compare", choices=("torch",), default=None,
                   help="also time the same network in PyTorch (needs torch installed)")
    s.add_argument("--torch-denormals", choices=("keep", "flush"), default="keep",
                   help="with --compare torch: subnormal floats in PyTorch's arithmetic kept "
                        "(PyTorch's default) or flushed to zero (torch.set_flush_denormal, "
                        "as cgp's default --denormals flush); default keep")
    s.add_argument("--torch-layout", choices=("channels_last", "contiguous"), default=None,
                   help="with --compare torch: time PyTorch in this memory format only "
                        "(default: both; one copy of a large net at a large batch may be "
                        "all the memory holds)")
    s.add_argument("--ceiling", action="store_true",
                   help="also time the machine's ceiling: for each thread count N > 1, N "
                        "copies of the 1-thread training at once, each in a process of its "
                        "own (fork: Linux, macOS; N copies of the net in memory), in the same "
                        "rounds; reports each speedup also as a share of it")
    s.add_argument("--ranks", default="1",
                   help="comma-separated numbers of MPI ranks: each above 1 also runs every "
                        "thread count as that many ranks x threads (mpirun on this machine; "
                        "pip install -e \".[mpi]\"), with its communication time per step, the "
                        "share of it hidden behind backward, and bytes moved")
    add_device_option(s, "; with gpu or numpy, --compare torch times PyTorch on the same "
                         "device (CUDA for gpu) in its default mode and with "
                         "torch.use_deterministic_algorithms(True)")
    s.add_argument("--out", default=OUT,
                   help=f"folder for the JSON, CSV and PNG results (default ./{OUT}/ under "
                        "the working directory)")
    s.set_defaults(run=cmd_speedup)


def default_threads():
    """1, 2, 4, ... up to the logical cores, and the core count itself."""
    cores = os.cpu_count() or 1
    counts, t = [], 1
    while t < cores:
        counts.append(t)
        t *= 2
    return counts + [cores]


# -- arithmetic rate -----------------------------------------------------------------
# Layers counted in a training step's floating-point work: the standard count is the
# multiply-adds of convolutions and inner products, two FLOPs each; the other layers add
# little arithmetic.
COUNTED = {"Convolution": "convolution_param", "InnerProduct": "inner_product_param"}


def training_flops(net):
    """FLOPs per image of one training step: per convolution or inner product, its forward
    multiply-adds (each output element takes weight size / num_output of them), as many again
    for the weight gradient, and as many again for the input gradient where one flows; two
    FLOPs per multiply-add."""
    import math

    total = 0
    for entry in net.entries:
        field = COUNTED.get(entry.layer.type_name)
        if field is None or not entry.params:
            continue
        weight = net.param_blobs[entry.params[0]]
        outputs = math.prod(net.blob_shapes[entry.tops[0]][1:])
        macs = outputs * weight.size // getattr(entry.layer.lp, field).num_output
        passes = 1 + (entry.backward + bool(entry.propagate and entry.propagate[0])
                      if net.loss_weights else 0)
        total += 2 * macs * passes
    return total

# -- timing ------------------------------------------------------------------------
@dataclass
class Config:
    """One timed configuration: `impl` cgp, torch or ceiling (Copies), a thread count, and
    torch's layout (cgp's: None for threads, "processes"). `copies` trainings run at once
    (the ceiling's: one per thread), each of the same images."""
    impl: str
    threads: int
    layout: str = None
    copies: int = 1
    run: object = None                 # run(iterations): trains that many iterations
    context: object = None             # () -> the context manager that run() needs, untimed
    save: object = None                # save(): remember the training state ...
    restore: object = None             # restore(): ... and go back to it, untimed
    pause: object = lambda: None       # pause(): after a timing, untimed: its workers sleep
                                       # (they must not spin while the next one is timed)
    iters: int = 0                     # iterations per timing (interleaved sets it)
    rates: list = field(default_factory=list)   # images/s of each repetition
    steals: list = field(default_factory=list)  # the share of the CPUs' time the hypervisor
                                                # withheld during each repetition (steal)

    @property
    def label(self):
        return self.impl + (f"/{self.layout}" if self.layout else "") + f" x{self.threads}"

def interleaved(configs, iters, repeats, warmup, images_per_iter, log, each_round=None,
                lead_in=0, min_seconds=0.0, clock=time.perf_counter):
    """Warm every configuration up, then time `repeats` rounds; round r runs the
    configurations in order, rotated by r, then each_round() if given. Every timing trains
    the same iterations from the same state (the one after the warm-up): the work is
    identical in every repetition, and a net that trains itself into another regime (tiny
    gradients turning denormal, say) cannot make later repetitions slower than earlier ones.
    Each timing starts after `lead_in` untimed iterations: interleaving leaves a CPU idle
    while other configurations run, and a CPU back from idling runs slower for several
    iterations (bench/idle_ramp.py, at git tag bench-experiments-2026-11), which training,
    its CPUs never idle, does not pay.
    The timings run `iters` iterations, or more where a configuration's last warm-up
    iteration says that `iters` would take it less than `min_seconds` (c.iters: how many):
    a timing of a tenth of a second measures the scheduler's time slices and other programs
    as much as training (with --warmup 0 nothing is known, and `iters` it is). Every
    configuration then runs the most any needs, so that all train the same iterations and
    end on the same weights (which the ranks' check compares).
    Each timing also records the steal time over it, as a share of all CPUs' time.
    clock: what the timings read; time.thread_time (the calling thread's CPU time, for one
    thread's work) hardly changes with other programs on a loaded machine."""
    cpus = os.cpu_count() or 1
    for c in configs:
        with c.context():
            c.run(max(warmup - 1, 0))
            c.iters = iters
            if warmup:   # the last warm-up iteration, timed for c.iters
                started = clock()
                c.run(1)
                took = max(clock() - started, 1e-9)
                c.iters = max(iters, math.ceil(min_seconds / took))
        c.pause()
        c.save()
    most = max(c.iters for c in configs)
    for c in configs:
        c.iters = most
    if most > iters:
        log(f"  timings of at least {min_seconds:g} s (--min-seconds): {most} iterations each")
    for r in range(repeats):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            c.restore()
            with c.context():
                c.run(lead_in)
                stolen = steal_seconds()   # read before the clock starts: it costs a little
                started = clock()
                c.run(c.iters)
                took = clock() - started
                steal = steal_seconds() - stolen
                c.rates.append(c.copies * c.iters * images_per_iter / took)
                c.steals.append(steal / (took * cpus))
            c.pause()
        if each_round is not None:
            each_round()
        log(f"  repetition {r + 1}/{repeats}: " +
            ", ".join(f"{c.label} {c.rates[-1]:.0f}" for c in configs))


def cgp_config(threads, trainer, workers="threads"):
    """workers: how the trainer runs its workers (RunConfig.workers); the row's layout is
    None for threads, "processes" for processes."""
    from threadpoolctl import threadpool_limits

    saved = []

    def run(iterations):
        trainer.steps(iterations)   # as Trainer.solve runs them

    def save():
        saved[:] = [trainer.iter, trainer.solver.current_step, trainer.net.params.copy(),
                    [h.copy() for h in trainer.solver.histories]]

    def restore():
        trainer.iter, trainer.solver.current_step, params, histories = saved
        trainer.net.params[...] = params
        for h, value in zip(trainer.solver.histories, histories):
            h[...] = value

    def digest():
        import hashlib
        return hashlib.sha256(trainer.net.params.tobytes()).hexdigest()
    # As in Trainer.solve: BLAS single-threaded, the workers are the only threads.
    config = Config("cgp", threads, None if workers == "threads" else workers, run=run,
                    context=lambda: threadpool_limits(limits=1), save=save, restore=restore,
                    pause=trainer.pool.rest)
    config.digest = digest
    return config


class Copies:
    """n copies of one 1-thread training (a Config of cgp_config), each in a process of its
    own, the caller's being copy 0: forked from it once, so every copy starts from the same
    weights and state and trains the same iterations. Nothing is shared between them but the
    machine: run together, they time the machine's own ceiling for n workers on this very
    workload (shared cores, caches, memory bandwidth, the hypervisor), which no engine can
    beat. Fork before anything else starts threads or processes."""

    def __init__(self, n, own):
        import multiprocessing

        from cgp.errors import CgpError
        from cgp.runtime import procs
        if not procs.available():
            raise CgpError("--ceiling needs an OS that can fork() (Linux, macOS)")
        self.own, self.pipes, self.workers = own, [], []
        fork = multiprocessing.get_context("fork")
        for _ in range(n - 1):
            ours, theirs = fork.Pipe()
            worker = fork.Process(target=_serve_copy, args=(theirs, own), daemon=True)
            worker.start()
            theirs.close()
            self.pipes.append(ours)
            self.workers.append(worker)

    def config(self):
        """The Config that times all n copies at once."""
        def each(op):
            def call(*args):
                for pipe in self.pipes:
                    pipe.send((op, args))
                with self.own.context():
                    getattr(self.own, op)(*args)
                return [self._reply(pipe) for pipe in self.pipes]
            return call
        return Config("ceiling", len(self.pipes) + 1, "processes", copies=len(self.pipes) + 1,
                      run=each("run"), context=_no_context, save=each("save"),
                      restore=each("restore"))

    def digests(self):
        """SHA-256 of every copy's parameters, copy 0 first: all the same after the same
        iterations from the same state."""
        for pipe in self.pipes:
            pipe.send(("digest", ()))
        return [self.own.digest()] + [self._reply(pipe) for pipe in self.pipes]

    def _reply(self, pipe):
        from cgp.errors import CgpError
        try:
            ok, value = pipe.recv()
        except EOFError:
            raise CgpError("cgp bench: a --ceiling copy died") from None
        if not ok:
            raise CgpError(f"cgp bench: a --ceiling copy failed: {value}")
        return value

    def close(self):
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass   # it is gone already
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()


# What marks rank 0's answers in a RankJob's output (cgp.tools.rank_job prints them).
REPLY = "cgp-rank-job "


class RankJob:
    """A training on `ranks` MPI ranks of this machine (mpirun), timed as a configuration: a
    job of cgp.tools.rank_job started once, whose rank 0 runs each operation it is sent with
    every rank and answers it."""

    def __init__(self, ranks, solver, config, folder):
        import json
        from dataclasses import asdict

        from cgp.comm import mpi
        self.ranks, self.threads = ranks, config.threads
        spec = Path(folder) / f"rank_job_{ranks}_{config.threads}_{config.workers}.json"
        spec.write_text(json.dumps({"solver": str(solver), "config": asdict(config)}))
        argv, env = mpi.local_job(ranks, ["-m", "cgp.tools.rank_job", str(spec)])
        self.job = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        self.workers = config.workers

    def call(self, op, *args):
        import json

        from cgp.errors import CgpError
        self.job.stdin.write(json.dumps([op, list(args)]) + "\n")
        self.job.stdin.flush()
        for line in self.job.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise CgpError(f"cgp bench: the job of {self.ranks} MPI ranks ended (status "
                       f"{self.job.wait()})")

    def config(self):
        """The Config that times the job: threads counts every worker of every rank."""
        config = Config("mpi", self.ranks * self.threads, f"{self.ranks} ranks",
                        run=lambda n: self.call("run", n), context=_no_context,
                        save=lambda: self.call("save"), restore=lambda: self.call("restore"),
                        pause=lambda: self.call("pause"))
        config.digest = lambda: self.call("digest")
        config.clock = lambda: self.call("clock")
        return config

    def close(self):
        if self.job.poll() is None:
            try:
                self.job.stdin.write('["end", []]\n')
                self.job.stdin.flush()
                self.job.wait(timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.job.kill()


def _no_context():
    from contextlib import nullcontext
    return nullcontext()


def _serve_copy(pipe, config):
    """A --ceiling copy: runs config's run, save, restore and digest as the pipe asks, with
    the context they run in, and answers (True, result) or (False, the error)."""
    with config.context():
        while True:
            try:
                message = pipe.recv()
            except EOFError:   # the caller is gone
                return
            if message is None:
                return
            op, args = message
            try:
                pipe.send((True, getattr(config, op)(*args)))
            except Exception as error:   # noqa: BLE001  (reported to the caller, which raises)
                pipe.send((False, f"{type(error).__name__}: {error}"))


# What --torch-denormals does to subnormals, for the line that says how PyTorch runs.
DENORMALS_DONE = {"flush": "flushed", "keep": "kept"}


def torch_config(torch_ref, threads, layout, trainer, data_trainer, flush=False, device="cpu",
                 deterministic=False, lead_in=0):
    """Trains the PyTorch copy as a PyTorch user's loop does: zero_grad, forward, backward and
    torch.optim.SGD's step, with `threads` set by torch.set_num_threads and nothing else of
    cgp's: no BLAS or OpenMP limit (cgp's threadpool_limits covers only its own timings), no
    affinity, no environment variable, and subnormals as PyTorch keeps them unless `flush`
    (--torch-denormals flush: its own switch, torch.set_flush_denormal). The caller's
    floating-point mode is given back after each timing.
    Its batches are those of cgp's data layers, made into tensors (in the memory format) by
    save() for the iterations that every timing runs from the saved state (`lead_in` and the
    Config's iters), as a
    PyTorch DataLoader hands the loop batches made elsewhere; cgp's own step reads its batch
    inside the timing, so this leans, if anything, towards PyTorch.
    device: PyTorch's ("cuda" for a GPU); deterministic: time it with
    torch.use_deterministic_algorithms(True)."""
    from contextlib import contextmanager

    from cgp.runtime import fpenv

    state = {"iter": 0, "made": {}}
    net = data_trainer.net

    def batch(it):
        made = state["made"].get(it)
        if made is None:
            made = data_trainer._batch(data_trainer.engine, it * net.batch_size, it)
        return made

    def run(iterations):
        for _ in range(iterations):
            trainer.step(batch(state["iter"]))
            state["iter"] += 1
        torch_ref.synchronize(device)

    def save():
        first = state["iter"]
        state["saved"] = (first, trainer.save())
        state["made"] = {}   # then made now, outside the timings
        state["made"] = {it: trainer.model.inputs(batch(it))
                         for it in range(first, first + lead_in + config.iters)}

    def restore():
        state["iter"], weights = state["saved"]
        trainer.restore(weights)

    @contextmanager
    def context():
        torch_ref.set_threads(threads)
        caller = fpenv.set_flush(flush)   # the caller's mode, to go back to
        torch_ref.flush_denormal(flush)
        torch_ref.deterministic(deterministic)
        try:
            yield
        finally:
            torch_ref.deterministic(False)
            fpenv.restore(caller)
    label = layout + (f" {device}" if device != "cpu" else "") + (
        " deterministic" if deterministic else "")
    config = Config("torch", threads, label, run=run, context=context, save=save,
                    restore=restore)
    return config

# -- output ------------------------------------------------------------------------
def write_results(out, stem, report, rows, log):
    import csv
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.csv"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    columns = ["impl", "layout", "threads", "median", "min", "max", "speedup", "efficiency",
               "paired_speedup", "paired_speedup_ci", "cgp_over_torch", "paired_cgp_over_torch",
               "paired_cgp_over_torch_ci", "cgp_over_this", "paired_cgp_over_this",
               "paired_cgp_over_this_ci", "share_of_ceiling", "paired_share_of_ceiling",
               "paired_share_of_ceiling_ci", "iters", "quiet_rounds", "quiet_paired_speedup",
               "quiet_paired_speedup_ci", "images_per_s", "steal", "ranks",
               "comm_ms_per_step", "comm_exposed_ms_per_step", "comm_hidden_share",
               "bytes_sent_per_step", "bytes_received_per_step"]
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "layout": row["layout"] or "",
                             **{key: " ".join(map(str, row[key])) for key in
                                ("images_per_s", "paired_speedup_ci", "paired_cgp_over_torch_ci",
                                 "paired_cgp_over_this_ci", "paired_share_of_ceiling_ci",
                                 "quiet_paired_speedup_ci", "steal")
                                if row.get(key)}})
    png = plot(out / f"{stem}.png", report, rows, log)
    return paths + ([png] if png else [])


def plot(path, report, rows, log):
    """Speedup against threads with the ideal line; None (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("cgp bench: matplotlib is not installed: the PNG plot was skipped "
            "(pip install 'cgp[plot]')")
        return None
    series = {}
    for row in rows:
        series.setdefault((row["impl"], row["layout"]), []).append(row)
    top = max(row["threads"] for row in rows)
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=110)
    ax.plot([1, top], [1, top], "--", color="grey", label="ideal")
    for (impl, layout), points in series.items():
        points.sort(key=lambda r: r["threads"])
        ax.plot([r["threads"] for r in points], [r["speedup"] for r in points], "o-",
                label=impl + (f" ({layout})" if layout else ""))
    ax.set_xticks(sorted({row["threads"] for row in rows}))
    ax.set_xlabel("threads")
    ax.set_ylabel("speedup over 1 thread (ratio of medians)")
    ax.set_title(f"{report['model']} ({report['net']}), batch {report['batch']}, "
                 f"{report['chunks']} chunks\n{report['machine']['cpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- the command -------------------------------------------------------------------
def model_name(args, path):
    if args.model:
        return args.model
    if args.net_file:
        from cgp.tools.net_bench import run_name
        return run_name(args.net_file)
    stem = Path(path).stem
    return stem[:-len("_solver")] if stem.endswith("_solver") else stem


def solver(args, log):
    """(the solver file or None, the SolverParameter) that the run trains: a bundled model's
    or --solver's, or one made around --model's net (cgp.tools.net_bench)."""
    from cgp.errors import CgpError
    from cgp.prototxt import read_solver

    if args.net_file:
        if args.model or args.solver:
            raise CgpError("give a model name, --solver or --model, only one of them")
        from cgp.net import RunOptions
        from cgp.tools.net_bench import bench_solver
        return None, bench_solver(args.net_file, args.batch,
                                  RunOptions(args.data_dir, not args.no_download), log)
    if args.batch is not None:
        raise CgpError("--batch goes with --model FILE; a solver's net sets its own batch_size")
    path = solver_file(args)
    return path, read_solver(path)


def cmd_speedup(args, log=print):
    import statistics

    from cgp.errors import CgpError
    from cgp.commands.timing import fill_inputs
    from cgp.train import RunConfig, Trainer

    path, sp = solver(args, log)
    threads = thread_list(args.threads) if args.threads else default_threads()
    threads = sorted(set(threads) | {1})   # speedups are over 1 thread
    workers = worker_list(args.workers)
    if args.device != "cpu":
        if threads != [1] or args.ceiling or args.ranks != "1":
            raise CgpError(f"--device {args.device}: one worker drives the device; give "
                           f"--threads 1, and no --ceiling or --ranks")
        workers = ["threads"]
        # cuBLAS is deterministic only with this set before CUDA starts (PyTorch's note on
        # reproducibility); it changes neither cgp nor PyTorch's default mode otherwise.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for name in ("iters", "repeats"):
        if getattr(args, name) < 1:
            raise CgpError(f"--{name} must be at least 1")
    for name in ("warmup", "lead_in"):
        if getattr(args, name) < 0:
            raise CgpError(f"--{name.replace('_', '-')} must be at least 0")
    torch_ref = None
    if args.compare == "torch":
        from cgp.tools import torch_ref
    check_threads(max(threads), log, "threads" if "threads" in workers else None)
    load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    started = time.gmtime()
    trainers = {}   # (workers, threads) -> Trainer; ("ceiling", n) -> the copies' copy 0
    ceilings = []   # Copies, one per thread count above 1
    ranks = [r for r in thread_list(args.ranks, "--ranks") if r > 1]
    if ranks and path is None:
        raise CgpError("--ranks runs a solver file in each rank: give --solver, not --model")
    jobs = []       # RankJob, one per (ranks, workers, threads)

    def trainer(t, kind):
        config = RunConfig(threads=t, chunks=args.chunks, seed=args.seed,
                           data_dir=args.data_dir, download=not args.no_download,
                           progress=False, denormals=args.denormals, workers=kind,
                           device=args.device)
        made = Trainer(sp, path, config, log=lambda line: None)
        if args.net_file:   # before a --ceiling copy forks from it
            fill_inputs(made.net, made.seed)
        return made
    try:
        # The copies fork first, while this process has no other threads to carry over.
        for t in threads[1:] if args.ceiling else ():
            trainers["ceiling", t] = trainer(1, "threads")
            ceilings.append(Copies(t, cgp_config(1, trainers["ceiling", t])))
        for kind in workers:
            for t in threads:
                trainers[kind, t] = trainer(t, kind)
        folder = tempfile.mkdtemp(prefix="cgp-bench-")
        for r in ranks:
            for kind in workers:
                for t in threads:
                    jobs.append(RankJob(r, path, trainers[kind, t].config, folder))
        first = trainers[workers[0], 1]
        net = first.net
        images = net.batch_size * sp.iter_size
        configs = [cgp_config(t, trainers[kind, t], kind) for kind in workers for t in threads]
        configs += [copies.config() for copies in ceilings]
        configs += [job.config() for job in jobs]
        if torch_ref is not None:
            if first.solver.type != "SGD":
                log(f"cgp bench: note: PyTorch runs momentum SGD; the solver is "
                    f"{first.solver.type}")
            device = "cuda" if args.device == "gpu" else "cpu"
            modes = (False, True) if args.device != "cpu" else (False,)
            for layout in [args.torch_layout] if args.torch_layout else torch_ref.LAYOUTS:
                configs += [torch_config(torch_ref, t, layout,
                                         torch_ref.TorchTrainer(net, sp, layout, device), first,
                                         args.torch_denormals == "flush", device, mode,
                                         lead_in=args.lead_in)
                            for t in threads for mode in modes]
        from cgp.snapshot import writable_folder
        writable_folder(Path(args.out) / "results.json")   # found out now, not after the timing
        torch_note = (f"; PyTorch {torch_ref.version()} (its own loop and settings, "
                      f"subnormals {DENORMALS_DONE[args.torch_denormals]})" if torch_ref else "")
        on = (f" on {first.backend.description}" if first.backend is not None else "")
        log(f"cgp bench speedup: {path or args.net_file}, net '{net.name}', batch {images} in "
            f"{len(first.engine.bounds)} chunks{on}; threads {','.join(map(str, threads))}"
            f" as {' and as '.join(workers)}"
            f"{torch_note}"
            f"{'; the machine ceiling' if ceilings else ''}; {args.warmup} warm-up "
            f"+ {args.repeats} x ({args.lead_in} untimed + {args.iters}) iterations each, "
            f"each timing at least {args.min_seconds:g} s, interleaved")
        matmul = []  # NumPy's matmul rate, timed in every round like the configurations
        with ForeignLoad() as foreign:
            interleaved(configs, args.iters, args.repeats, args.warmup, images, log,
                        each_round=lambda: matmul.append(matmul_gflops()),
                        lead_in=args.lead_in, min_seconds=args.min_seconds)
        # Every configuration ended on the same iterations from the same state: the copies
        # too, or they did not time the training that cgp runs.
        for copies in ceilings:
            if len(set(copies.digests())) != 1:
                raise CgpError("cgp bench: the --ceiling copies ended on different weights")
        # The ranks end on the weights of one process, bit for bit: the guarantee, checked.
        for c in configs:
            if c.impl == "mpi" and c.digest() != configs[0].digest():
                raise CgpError(f"cgp bench: {c.label} ended on other weights than 1 thread")
        clocks = {id(c): c.clock() for c in configs if c.impl == "mpi"}
    finally:
        for copies in ceilings:
            copies.close()
        for job in jobs:
            job.close()
        for t in trainers.values():
            t.close()
    rows, best = summarise(configs)
    for row, c in zip(rows, configs):
        row["iters"] = c.iters   # per timing: --iters, or more for --min-seconds
        if c.impl == "mpi":
            clock = clocks[id(c)]
            steps = max(clock["steps"], 1)
            row.update(ranks=int(c.layout.split()[0]),
                       comm_ms_per_step=round(1e3 * clock["busy"] / steps, 4),
                       comm_exposed_ms_per_step=round(1e3 * clock["exposed"] / steps, 4),
                       comm_hidden_share=round(max(0.0, 1 - clock["exposed"]
                                                   / max(clock["busy"], 1e-12)), 4),
                       bytes_sent_per_step=clock["bytes"][0],
                       bytes_received_per_step=clock["bytes"][1])
    for line in table(rows, best):
        log(line)
    if args.device != "cpu":   # both PyTorch modes, each against cgp
        mine = next(c for c in configs if c.impl == "cgp")
        for row, c in zip(rows, configs):
            if c.impl == "torch":
                paired, ci = _paired(mine.rates, c.rates)
                row["cgp_over_this"] = round(statistics.median(mine.rates) / row["median"], 4)
                row["paired_cgp_over_this"], row["paired_cgp_over_this_ci"] = round(paired, 4), ci
                log(f"cgp / PyTorch {c.layout}: {row['cgp_over_this']:.2f} (paired "
                    f"{_with_ci(paired, ci)}); PyTorch {row['median']:.1f} images/s")
    flops = training_flops(net)
    numpy_rate = statistics.median(matmul)
    one = next(r for r in rows if r["impl"] == "cgp" and r["threads"] == 1)
    rate = one["median"] * flops / 1e9
    log(f"arithmetic: {flops / 1e6:.1f} MFLOP per training image (convolution and "
        f"inner-product multiply-adds, 2 FLOPs each); cgp on 1 thread {rate:.1f} GFLOP/s = "
        f"{100 * rate / numpy_rate:.0f}% of NumPy's single-threaded float32 matmul "
        f"({numpy_rate:.1f} GFLOP/s, median of {len(matmul)} rounds of {MATMUL_SIZE} x "
        f"{MATMUL_SIZE} products, {min(matmul):.0f}-{max(matmul):.0f})")
    if foreign.steal > 0.05:
        log(f"cgp bench: note: the hypervisor withheld {foreign.steal:.2f} of "
            f"{os.cpu_count()} CPUs' time from this machine during the run (steal time): "
            "a virtual machine's timings then measure its host's other guests too")
    if foreign.cores > 0.25:
        log(f"cgp bench: note: other processes kept {foreign.cores:.1f} of "
            f"{os.cpu_count()} cores busy during the run; timings with more threads than "
            "the idle cores measure the neighbours, not cgp")
    model = model_name(args, path)
    extra = {"torch": torch_ref.version()} if torch_ref else {}
    report = {"model": model, "solver": path and str(path), "net_file": args.net_file,
              "net": net.name, "batch": images,
              "chunks": len(first.engine.bounds), "denormals": args.denormals,
              "torch_denormals": args.torch_denormals if torch_ref else None,
              "device": args.device,
              "device_description": first.backend.description if first.backend else "CPU",
              "workers": workers,
              "iters": args.iters, "min_seconds": args.min_seconds,
              "repeats": args.repeats, "warmup": args.warmup, "lead_in": args.lead_in,
              "seed": first.seed,
              "threads": threads, "ranks": [1] + ranks, "compare": args.compare,
              "ceiling": args.ceiling,
              "training_flops_per_image": flops,
              "numpy_matmul_gflops": [round(r, 2) for r in matmul],
              "cgp_1_thread_gflops": round(rate, 2),
              "cgp_1_thread_share_of_matmul": round(rate / numpy_rate, 4),
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", started),
              # Every rate (median, min, max, images_per_s) is training images per second,
              # over the whole step: forward, backward, reduction and update.
              "units": {"rates": "images/s", "training_flops_per_image": "FLOP",
                        "gflops": "1e9 FLOP/s",
                        "steal": "share of the CPUs' time withheld, per repetition",
                        "steal_cores, foreign_load_cores": "CPUs' worth of time"},
              "machine": {**machine_info(extra), "load_average_before": load_before,
                          "foreign_load_cores": round(foreign.cores, 3),
                          "steal_cores": round(foreign.steal, 3)},
              "results": rows}
    stem = f"speedup_{model}_{time.strftime('%Y%m%dT%H%M%SZ', started)}"
    for written in write_results(Path(args.out), stem, report, rows, log):
        log(f"cgp bench: wrote {written}")
    return 0
