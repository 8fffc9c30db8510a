"""Caffe's solver loop around the engine: test, forward/backward, display, update,
snapshot, resume. The Solver does the arithmetic and knows nothing about threads;
the Engine runs the chunks; this module only sequences them.

Every source of randomness is a pure function of (seed, iteration, ...), and the data
position is a pure function of the iteration, so a run resumed from a snapshot
continues bit for bit as if it had not stopped. cgp's .solverstate carries what Caffe's
lacks for that (seed, data position, chunks; see cgp/proto/cgp.proto); a .solverstate
that Caffe wrote resumes as Caffe resumes, with the data back at the first record.
"""
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
from threadpoolctl import threadpool_limits

from cgp.device import check_device, make_engine, select_backend
from cgp.engine import group_size
from cgp.errors import CgpError
from cgp.data.hdf5 import require_h5py
from cgp.layers import Chunk, scratch_specs
from cgp.net import RunOptions, Workspace, build_net
from cgp.comm import make_communicator, make_schedule
from cgp.step import DataParallelStep, Diverged
from cgp.proto import caffe_pb2, cgp_pb2
from cgp.prototxt import read_net
from cgp.runtime.procs import default_workers, make_pool
from cgp.runtime.update import all_finite
from cgp.snapshot import (layers_without, load_weights, lock_prefix, read_solverstate,
                          recover_snapshot, recover_snapshots, snapshot_paths,
                          writable_folder, write_snapshot)
from cgp.solver import Solver, check_values

DEFAULT_SEED = 1701  # used when neither --seed nor the solver's random_seed is set


SHARING = ("sync", "async", "hybrid")   # --sharing


@dataclass(frozen=True)
class RunConfig:
    """Run settings from the command line; the prototxt owns everything else."""
    threads: int = 1
    chunks: int = 16
    seed: int = None          # overrides the solver's random_seed
    data_dir: str = None
    download: bool = True
    max_iter: int = None      # overrides the solver's max_iter
    progress: bool = True     # a progress bar when stderr is a terminal
    snapshot_prefix: str = None
    sigint_effect: str = "stop"       # Caffe's --sigint_effect: stop, snapshot or none
    sighup_effect: str = "snapshot"   # Caffe's --sighup_effect
    sigterm_effect: str = "stop"      # a batch scheduler's notice before it kills the job
    affinity: bool = False    # pin workers to cores
    # Run the workers as "threads" or as forked "processes" (default: procs.default_workers).
    workers: str = field(default_factory=default_workers)
    denormals: str = "flush"  # subnormal floats: "flush" to zero (fast) or "keep" (IEEE)
    staleness: int = 0        # the update of iteration t applies iteration t - S's gradient
    # How ranks share the weights: "sync" (every rank computes its share of every batch),
    # "async" or "hybrid" in `groups` groups (cgp.comm.sharing: not reproducible).
    sharing: str = "sync"
    groups: int = 0
    # Where the chunks compute: "cpu", "gpu" (CuPy) or "numpy" (the GPU path on the host).
    device: str = "cpu"
    device_id: int = None     # the GPU's CUDA index (default: the local rank's)

    def __post_init__(self):
        # Refused before anything runs: a seed out of range would otherwise fail only when
        # the first snapshot records it, after the training.
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise CgpError(f"--seed must be from 0 to 2**63 - 1 (Caffe's random_seed is a "
                           f"64-bit signed integer), got {self.seed}")
        if self.max_iter is not None and self.max_iter < 0:
            raise CgpError(f"--iters must be at least 0, got {self.max_iter}")
        if self.sharing not in SHARING:
            raise CgpError(f"--sharing {self.sharing}: expected one of {', '.join(SHARING)}")
        if self.groups and self.sharing != "hybrid":
            raise CgpError(f"--groups {self.groups} is for --sharing hybrid (this run has "
                           f"--sharing {self.sharing})")
        if self.sharing == "hybrid" and not self.groups:
            raise CgpError("--sharing hybrid needs --groups G: the ranks are cut into G groups, "
                           "synchronous within, asynchronous between them")
        check_device(self.device, self.threads)
        if self.staleness and self.sharing != "sync":
            raise CgpError(f"--staleness {self.staleness} delays the updates of synchronous "
                           f"training by a fixed count; --sharing {self.sharing} has delays of "
                           "its own, set by timing: give one or the other")


SIGNAL_EFFECTS = ("stop", "snapshot", "none")
REQUESTS = (None, "snapshot", "stop")   # what a signal asks of training, weakest first
WORKERS = ("threads", "processes")


def resolve(name, base_dir, what):
    """A path named inside a prototxt: relative to the working directory as in Caffe,
    then relative to the folder of the file that names it (so bundled models work from
    anywhere)."""
    path = Path(name)
    if path.exists():
        return path
    if path.is_absolute():
        raise CgpError(f"{what} '{name}' not found")
    if base_dir is not None and (Path(base_dir) / name).exists():
        return Path(base_dir) / name
    where = f"{Path.cwd()}" + (f" and {base_dir}" if base_dir is not None else "")
    raise CgpError(f"{what} '{name}' not found (looked in {where})")


def check_solver_fields(sp, solver_path, log):
    """Solver fields that would change what Caffe writes or prints and that cgp does not
    implement: refused, or said once, never silently ignored. (solver_mode, device_id
    and layer_wise_reduce choose Caffe's hardware and change no result.)"""
    if sp.snapshot_diff:
        raise CgpError(f"solver {solver_path}: snapshot_diff is not supported (cgp snapshots "
                       "weights, not gradients); remove it")
    if sp.debug_info:
        log("Note: debug_info is not supported; training runs without Caffe's per-layer "
            "debug output")
    if sp.snapshot_format == caffe_pb2.SolverParameter.HDF5:   # said before the training
        require_h5py(f"solver {solver_path}: snapshot_format HDF5")


def solver_nets(sp, solver_path):
    """(train net, [test net, ...]) named by a SolverParameter, each net a pair
    (NetParameter, where it came from: its file, or the solver's field), with Caffe's rules:
    one train net source; test nets from test_net_param, test_net, then the general net once
    per remaining test_iter."""
    base = Path(solver_path).parent if solver_path else None
    solver = f"solver {solver_path}" if solver_path else "the solver"
    sources = [f for f in ("train_net_param", "train_net", "net_param", "net")
               if (sp.HasField(f) if f.endswith("param") else sp.HasField(f))]
    train_sources = [f for f in sources if f.startswith("train")]
    if len(train_sources) > 1 or ("net" in sources and "net_param" in sources):
        raise CgpError(f"solver {solver_path}: give the train net once (found {', '.join(sources)})")
    if not sources:
        raise CgpError(f"solver {solver_path}: no net: set 'net' (or train_net, net_param)")

    def load(field):
        if field.endswith("param"):
            return getattr(sp, field), f"{solver} ({field})"
        path = resolve(getattr(sp, field), base, f"net file (solver field {field})")
        return read_net(path), str(path)

    general = load("net_param") if sp.HasField("net_param") else (
        load("net") if sp.HasField("net") else None)
    train = load(train_sources[0]) if train_sources else general
    tests = [(p, f"{solver} (test_net_param {i})")
             for i, p in enumerate(sp.test_net_param)]
    for name in sp.test_net:
        path = resolve(name, base, "test_net file")
        tests.append((read_net(path), str(path)))
    if general is not None:
        tests += [general] * max(0, len(sp.test_iter) - len(tests))
    if len(tests) != len(sp.test_iter):
        raise CgpError(f"solver {solver_path}: {len(tests)} test nets but {len(sp.test_iter)} "
                       "test_iter values: give one test_iter per test net")
    if tests and sp.test_interval <= 0:
        tests = []  # Caffe never tests when test_interval is 0
    return train, tests


# Private memory of one forked worker process beyond its activations: the interpreter's
# pages that it writes (reference counts) and so copies. tests/test_procs.py checks that
# the real workers of LeNet and cifar10_quick stay within it.
WORKER_PROCESS_BYTES = 32 << 20
# What a process holds once the first step has loaded Numba's compiled kernels from their
# cache: 38 MiB for LeNet's, 50 MiB for cifar10_quick's on the 2-core VM (psutil's RSS
# before and after a Trainer's first step(), less the buffers the step allocated).
# tests/test_hardening.py checks the memory line against the peak RSS of a real
# `cgp train mnist`. A first run, which compiles the kernels, holds more.
KERNEL_BYTES = 48 << 20


def _call_samples(net, chunks, threads):
    """Samples in one call of a worker (see group_size)."""
    return group_size(net, chunks, threads) * -(-net.batch_size // chunks)


def _scratch_bytes(net, n, work=None):
    """The layers' scratch buffers (Layer.scratch_shapes) of a workspace for calls of n
    samples, in float32 where a layer gives no dtype; work: the layers' work scratch alone
    (True), the rest (False), or all (None)."""
    total = 0
    for entry in net.entries:
        for shape, kind in scratch_specs(entry.layer, n, np.float32, work).values():
            total += math.prod(shape) * np.dtype(kind).itemsize
    return total


def _activation_bytes(net, chunks, threads, syncs):
    """Data, diff and scratch of the workspaces an engine holds at once: one per thread, for
    one call's samples; or, where the net sums over the batch (syncs: BatchNorm), one per
    call of the batch, since every call then pauses at each sum with its buffers kept
    (Engine: a workspace per group of chunks), less the layers' work scratch, which stays
    one per thread."""
    n = _call_samples(net, chunks, threads)
    if not syncs:
        return threads * (n * net.sample_bytes + _scratch_bytes(net, n))
    calls = -(-chunks // group_size(net, chunks, threads))
    return (calls * (n * net.sample_bytes + _scratch_bytes(net, n, work=False))
            + threads * _scratch_bytes(net, n, work=True))


def _batch_bytes(net):
    """The engine's two copies of a batch of the data layers' tops (Engine.inputs)."""
    return 2 * 4 * sum(math.prod(net.blob_shapes[t]) for t in net.source_names)


def check_memory(net, chunks, threads, histories, available, processes=False, now=0,
                 test_nets=()):
    """The memory a run needs, as a line for the log; CgpError before running out.
    Private gradients are one buffer per chunk (never per sample), so they grow with
    --chunks, not with the batch; factored weight gradients (InnerProduct) keep instead
    their two factors for the batch, which never touch the per-chunk buffers' pages;
    activations (data, diff and the layers' scratch) are one set per thread, for the
    samples of one call (see group_size), or the whole batch's where the net sums over it
    (BatchNorm);
    processes: the workers are forked processes, each with WORKER_PROCESS_BYTES more.
    now: what the process holds already (its RSS: interpreter, libraries, the data sets,
    the parameters), with KERNEL_BYTES to come, or 0 to leave both out; test_nets: their
    activations, without gradients, count too."""
    n, chunks = net.n_params, min(chunks, net.batch_size)
    dense, factors = n, 0
    for index in net.factorable:
        rows, J, L = net.entries[index].layer.factor_shape()
        dense -= J * L
        factors += net.batch_size * rows * (J + L) * 4
    gradients = chunks * dense * 4 + factors
    state = (2 + histories) * n * 4  # parameters, the reduced gradient, solver history
    whole = bool(net.forward_syncs or net.backward_syncs)
    activations = _activation_bytes(net, chunks, threads, whole) + _batch_bytes(net)
    # A test net's workspaces have no diff: about half.
    tests = sum(_activation_bytes(t, chunks, threads, t.forward_syncs) // 2 + _batch_bytes(t)
                for t in test_nets)
    workers = (threads - 1) * WORKER_PROCESS_BYTES if processes else 0
    kernels = KERNEL_BYTES if now else 0
    more = gradients + state + activations + tests + workers + kernels
    need = now + more
    line = (f"memory: {need / 2**20:.1f} MiB = "
            + (f"this process now ({now / 2**20:.1f} MiB: interpreter, libraries, data, "
               f"parameters) + kernels ({kernels / 2**20:.0f} MiB) + " if now else "")
            + f"gradients {chunks} chunks x {dense} parameters"
            f"{f' + factors of {len(net.factorable)} weights' if net.factorable else ''} "
            f"({gradients / 2**20:.1f} MiB) + solver state ({state / 2**20:.1f} MiB) + activations "
            + ("of the whole batch (sums over the batch keep every call's) " if whole else
               f"of {threads} {'process(es)' if processes else 'thread(s)'} ")
            + f"({activations / 2**20:.1f} MiB)"
            + (f" + test nets ({tests / 2**20:.1f} MiB)" if test_nets else "")
            + (f" + {threads - 1} forked worker(s) ({workers / 2**20:.0f} MiB)" if workers else "")
            + f"; {available / 2**30:.1f} GiB available")
    if more > 0.9 * available:
        raise CgpError(f"not enough memory: {line}. Use fewer --chunks or --threads"
                       + (", or a smaller batch_size." if whole else "."))
    return line


def fmt(value):
    return f"{value:.6g}"


def loss_note(net, name, value):
    """Caffe's " (* w = w*value loss)" after an output that is a loss of weight w."""
    weight = next((w for b, w in net.loss_weights.items() if net.blob_names[b] == name), 0)
    return f" (* {fmt(weight)} = {fmt(weight * value)} loss)" if weight else ""


class Trainer:
    """Trains one solver; `log` receives Caffe-style lines."""

    restored_iter = None   # the iteration of the .solverstate restored, if any
    snapshot_iter = None   # the iteration of the latest snapshot written
    _prefix_held = False   # hold_prefix has run
    _lock = None           # this run's share of its snapshot prefix's lock

    def __init__(self, sp, solver_path=None, config=RunConfig(), log=print):
        self.sp, self.config, self.log = sp, config, log
        self.solver_path = solver_path
        check_solver_fields(sp, solver_path, log)
        check_values(sp, solver_path, log)
        if config.max_iter is None and sp.max_iter < 0:   # Caffe would train to iteration 0
            raise CgpError(f"solver {solver_path}: max_iter must be at least 0, got "
                           f"{sp.max_iter}")
        self.seed = config.seed if config.seed is not None else (
            sp.random_seed if sp.random_seed >= 0 else DEFAULT_SEED)
        options = RunOptions(config.data_dir, config.download)
        train_param, test_params = solver_nets(sp, solver_path)
        self.net = build_net(*train_param, caffe_pb2.TRAIN, options,
                             stages=sp.train_state.stage, level=sp.train_state.level)
        self.test_nets = []
        for i, param in enumerate(test_params):
            state = sp.test_state[i] if i < len(sp.test_state) else caffe_pb2.NetState()
            self.test_nets.append(build_net(*param, caffe_pb2.TEST, options,
                                            stages=state.stage, level=state.level))
        self.net.init_params(self.seed)
        if config.workers not in WORKERS:
            raise CgpError(f"--workers {config.workers}: expected one of {', '.join(WORKERS)}")
        for effect in (config.sigint_effect, config.sighup_effect, config.sigterm_effect):
            if effect not in SIGNAL_EFFECTS:
                raise CgpError(f"signal effect '{effect}': expected one of "
                               f"{', '.join(SIGNAL_EFFECTS)}")
        # The device first: a GPU is taken before any worker exists.
        self.backend = select_backend(config.device, config.device_id)
        workers = config.workers if self.backend is None else "threads"
        self.pool = make_pool(workers, config.threads, [self.net] + self.test_nets,
                              config.affinity, config.denormals == "flush")
        # Histories in shared memory where workers write them (processes).
        self.solver = Solver(sp, self.net.lr_mult, self.net.decay_mult, self.pool.shared_memory,
                             [(b.offset, b.size) for b in self.net.param_blobs])
        self.comm = comm = make_communicator(self.pool, config.sharing, config.groups)
        self.schedule = make_schedule(comm)   # which iterations this process computes
        self._check_memory(config.chunks)
        self.engine = make_engine(self.backend, self.net, config.chunks, self.pool, comm)
        self.test_engines = [make_engine(self.backend, n, config.chunks, self.pool, comm,
                                         backward=False) for n in self.test_nets]
        self.train_step = DataParallelStep(self.engine, self.solver, comm, sp.iter_size,
                                           config.staleness)
        self.pool.start()   # workers forked once everything they run exists
        self.iter = 0
        # The iteration whose batch starts at record 0: 0, or the iteration of a Caffe
        # .solverstate resumed from (Caffe's data layers start again at the first record).
        self.data_origin = 0
        self.max_iter = config.max_iter if config.max_iter is not None else sp.max_iter
        self.losses = []          # the window of Caffe's smoothed (average_loss) loss
        self.last_test = {}
        self.last_test_iter = None
        self._stop = False
        self._ahead = None        # (what _batch was asked, the batch) read ahead by step()
        self._request = None      # what a signal asked for: "stop" or "snapshot"
        self._told_to_stop = False   # a signal asked this process to stop
        self.drained = False      # every iteration to max_iter is claimed (cgp.comm.sharing)
        self._from = 0            # the iteration count where the latest steps() began
        self._heard = []             # what the signal handler has to say (_agree says it)
        self.clock = time.perf_counter   # the display's speed; cgp train's leaves out compiling
        # Caffe's solver field `weights` (the command line's --weights replaces it).
        base = Path(solver_path).parent if solver_path else None
        for names in sp.weights:
            for name in names.split(","):
                self.load_weights(resolve(name, base, "weights file (solver field weights)"))

    def _check_memory(self, chunks):
        self.memory_line = check_memory(self.net, chunks, self.pool.threads,
                                        len(self.solver.histories),
                                        psutil.virtual_memory().available,
                                        self.pool.shared_memory,
                                        now=psutil.Process().memory_info().rss,
                                        test_nets=self.test_nets)

    # -- data ----------------------------------------------------------------------
    def _pass(self, it, k):
        """(record position, iteration number of the data) of pass k of training iteration
        it: iter_size passes per iteration, the data counted from the data origin."""
        size = self.sp.iter_size
        return ((it - self.data_origin) * size + k) * self.net.batch_size, it * size + k

    def _batch(self, engine, position, iteration):
        """Source blob id -> array of the engine's samples (Engine.rows: the whole batch but
        where other ranks compute the rest) of the batch at a record position: the one read
        ahead (_work_ahead) when it is that one."""
        key = (engine, position, iteration, self.seed)
        if self._ahead is not None and self._ahead[0] == key:
            batch, self._ahead = self._ahead[1], None
            return batch
        batch = {}
        for entry in engine.net.sources:
            arrays = entry.layer.load(position, iteration, self.seed, engine.rows)
            batch.update(zip(entry.tops, arrays))
        return batch

    def _work_ahead(self, it):
        """The caller's work for iteration `it`, done during the last run of the one before
        (Pool.run's `first`), where it would otherwise be a serial part of the next step:
        its first batch, copied where the workers will read it (Engine.stage), and its Step
        (Solver.prepare_ahead). A batch is a function of its position, iteration and seed
        alone, so reading it early changes nothing; _batch uses it only if the next request
        is for that very batch (not after a restore or a jump back). A data error is left to
        the step that needs the batch, which then reads it again and raises it."""
        self._ahead = None
        if it is None:   # no iteration left to claim (cgp.comm.sharing)
            return
        self.solver.prepare_ahead(it)
        position, iteration = self._pass(it, 0)
        try:
            batch = self._batch(self.engine, position, iteration)
        except Exception:   # noqa: BLE001  (raised again where the batch is needed)
            return
        self._ahead = ((self.engine, position, iteration, self.seed), batch)   # as _batch asks
        self.engine.stage(batch)

    def tests_before(self, it):
        """How many test passes Caffe runs from the data origin up to iteration `it`: the
        test data reader goes on from where the previous pass stopped."""
        interval = self.sp.test_interval
        if not self.test_nets or interval <= 0:
            return 0

        def points(end):  # iterations 0, interval, 2 * interval, ... < end
            return (end - 1) // interval + 1 if end > 0 else 0
        done = points(it) - points(self.data_origin)
        if self.data_origin == 0 and not self.sp.test_initialization:
            done -= min(done, 1)   # no test at iteration 0
        return done

    # -- one iteration -------------------------------------------------------------
    def step(self):
        """One training iteration: forward/backward, update, iter += 1."""
        return self.steps(1)

    def steps(self, n, each=None):
        """Up to n training iterations (DataParallelStep); returns the last one's (loss,
        outputs, rate). each(it, loss, outputs, rate), if given, is called after iteration
        `it` and ends the run early by returning True. The caller's work for the next
        iteration (its first batch and Step) runs during each iteration's last run, which
        would otherwise keep every worker waiting; the weights are up to date whenever an
        iteration has returned.
        Where groups of ranks share weights asynchronously (cgp.comm.sharing), the communicator
        says which iteration this process computes and what the count is after it (the
        updates of every group): steps run until the count has grown by n, or no iteration
        is left to claim (drained); `it` given to each() is then the count of the weights
        that the step's loss was computed on."""
        result, end = None, self.iter + n
        self._from = self.iter
        while self.iter < end:
            it = self.schedule.claim(self.iter, self.max_iter)
            if it is None:
                self.drained = True
                break
            try:
                result = self.train_step(
                    it, lambda k: self._pass_batch(it, k), self.seed,
                    first=lambda: self._work_ahead(self.schedule.claim_ahead(it + 1, self.max_iter)))
            except Diverged as d:
                raise CgpError(self._divergence(d)) from None
            before, self.iter = self.iter, self.schedule.after(it)
            if each is not None and each(before, *result):
                break
        return result

    def _divergence(self, d):
        """The message for a step that found a value not finite (Diverged): the iteration, and
        where it first appeared: the first layer whose output is not finite (the loss; a
        forward pass of that batch on the weights before the step, which the step left), or
        the parameter blob whose update went infinite or NaN (its gradient)."""
        if d.column is not None:
            blob = next(b for b in self.net.param_blobs
                        if b.offset <= d.column < b.offset + b.size)
            where = (f"the gradient of layer '{blob.layer}' blob {blob.index} {blob.shape} is not "
                     "finite, and so are weights its update wrote")
        else:
            where = (f"the loss is {d.loss:g}" if d.loss is not None else "the loss is not finite")
            where += f" ({self._first_not_finite(d.iteration, d.index)})"
        return (f"training diverged at iteration {d.iteration}: {where}. Training stopped; no "
                "snapshot was written of these weights (the last snapshot, if any, is intact). "
                "A smaller base_lr, clip_gradients or finite input data may help")

    def _first_not_finite(self, it, k):
        """Where a forward pass of pass k of iteration `it`, on one worker and the current
        weights, first gives a value that is not finite."""
        net = self.net
        position, iteration = self._pass(it, k)
        batch = {}
        for entry in net.sources:
            batch.update(zip(entry.tops, entry.layer.load(position, iteration, self.seed)))
            for name, top in zip(entry.layer.lp.top, entry.tops):
                if not all_finite(np.asarray(batch[top])):
                    return f"the data of layer '{entry.layer.name}', top '{name}', is not finite"
        ws = Workspace(net, net.batch_size, with_diff=False)
        chunk = Chunk(n=net.batch_size, batch=net.batch_size, iteration=iteration,
                      seed=self.seed, batch_tops=net.batch_tops(batch))
        params = net.param_views(net.params)
        data = net.forward(ws, chunk, batch, params)
        for entry, views in zip(net.entries, params):
            if any(not all_finite(data[t]) for t in entry.tops):
                bad = [i for i, v in enumerate(views) if not all_finite(v)]
                cause = (f"its blob(s) {', '.join(map(str, bad))} hold non-finite weights" if bad
                         else "its input and weights are finite")
                return (f"the first output that is not finite is layer '{entry.layer.name}' "
                        f"({entry.layer.type_name})'s: {cause}")
        return "a forward pass on one worker gives finite values throughout"

    def _pass_batch(self, it, k):
        """(batch, iteration number of its data) of pass k of training iteration it."""
        position, iteration = self._pass(it, k)
        return self._batch(self.engine, position, iteration), iteration

    def test(self, index=0):
        """One test pass of test net `index`: (outputs averaged over test_iter batches, the
        loss likewise), or None when a signal asked to stop meanwhile: as Caffe, the requests
        are acted on between batches (a snapshot at once), and a stop ends the test."""
        net, engine = self.test_nets[index], self.test_engines[index]
        copy_shared(self.net, net)
        iters = self.sp.test_iter[index]
        first = self.tests_before(self.iter) * iters
        sums, loss = {}, 0.0
        for k in range(iters):
            self._act_on_request()
            if self._stop:
                return None
            batch = self._batch(engine, (first + k) * net.batch_size, first + k)
            outputs, batch_loss, _ = engine.run(batch, first + k, self.seed)
            loss += batch_loss
            for name, value in outputs.items():
                sums[name] = sums.get(name, 0.0) + value
        return {name: value / iters for name, value in sums.items()}, loss / iters

    # -- the loop ------------------------------------------------------------------
    def _test_all(self):
        if not self.comm.leader_group:   # cgp.comm.sharing: rank 0's group tests
            return
        for i, net in enumerate(self.test_nets):
            self.log(f"Iteration {self.iter}, Testing net (#{i})")
            result = self.test(i)
            if result is None:
                self.log("Test interrupted.")
                return
            self.last_test, loss = result
            self.last_test_iter = self.iter
            if self.sp.test_compute_loss:
                self.log(f"Test loss: {fmt(loss)}")
            for j, (name, value) in enumerate(self.last_test.items()):
                self.log(f"    Test net output #{j}: {name} = {fmt(value)}"
                         f"{loss_note(net, name, value)}")

    def _smoothed(self, loss):
        window = max(1, self.sp.average_loss)
        self.losses.append(loss)
        del self.losses[:-window]
        return sum(self.losses) / len(self.losses)

    def solve(self):
        """Train to max_iter; returns the final test outputs (if any)."""
        sp = self.sp
        if self.restored_iter is not None and self.iter >= self.max_iter:
            # Caffe would snapshot again, rewriting the files it resumed from.
            self.log(f"Note: resumed at iteration {self.iter}, max_iter is {self.max_iter}: "
                     "nothing to train; no snapshot written")
            return self.last_test
        if self.comm.leader:   # one run per prefix: the leader writes the job's snapshots
            self.hold_prefix()
        if (sp.snapshot or sp.snapshot_after_train) and self.comm.leader:   # found out now
            writable_folder(f"{self.snapshot_prefix()}_iter_{self.iter}.caffemodel")
        # Where groups share weights (cgp.comm.sharing): the buffer starts from these weights.
        self.iter = self._from = self.schedule.begin(self.iter, self.net.params)
        with threadpool_limits(limits=1), self._sigint(), self._progress() as bar:
            last = self.clock()
            last_iter = self.iter

            def done(it, loss, outputs, rate):
                nonlocal last, last_iter
                smoothed = self._smoothed(loss)
                bar.update(self.iter - it)
                # A multiple of display passed: it itself, where the count grows by one.
                if sp.display and (self.iter - 1) // sp.display > (it - 1) // sp.display:
                    now = self.clock()
                    speed = max(1, self.iter - last_iter) / max(now - last, 1e-9)
                    self.log(f"Iteration {it} ({speed:.3g} iter/s, "
                             f"{speed * self.net.batch_size * sp.iter_size:.0f} img/s), "
                             f"loss = {fmt(smoothed)}")
                    for j, (name, value) in enumerate(outputs.items()):
                        self.log(f"    Train net output #{j}: {name} = {fmt(value)}"
                                 f"{loss_note(self.net, name, value)}")
                    self.log(f"Iteration {it}, lr = {fmt(rate)}")
                    last, last_iter = now, self.iter
                return self._agree() is not None   # a signal's request: acted on now

            while self.iter < self.max_iter and not self._stop:
                if (self.test_nets and self._reached(sp.test_interval)
                        and (self.iter > 0 or sp.test_initialization)):
                    self._test_all()
                    if self._stop:   # Ctrl-C during the test: no more training, as Caffe
                        break
                # The iterations up to the next test, snapshot or the end, in one steps().
                n = self.max_iter - self.iter
                for interval in (sp.test_interval if self.test_nets else 0, sp.snapshot):
                    if interval > 0:
                        n = min(n, interval - self.iter % interval)
                self.steps(n, done)
                if self.drained:   # cgp.comm.sharing: the count once every group's updates are in
                    self.iter = self.schedule.end(self.iter, self.net.params)
                self._act_on_request(snapshot_due=self._reached(sp.snapshot))
            self.iter = self.schedule.end(self.iter, self.net.params)   # after a stop, likewise
            if (sp.snapshot_after_train and (not sp.snapshot or self.iter % sp.snapshot != 0)
                    and self.snapshot_iter != self.iter):
                self.snapshot()   # a stop asked meanwhile changes nothing
        if self._stop:
            self.log("Optimization stopped early.")
            return self.last_test
        if sp.display and self.iter % sp.display == 0:
            # Caffe's last display: the loss of the final weights on the next batch, one
            # forward pass (the first of iter_size).
            with threadpool_limits(limits=1):
                position, iteration = self._pass(self.iter, 0)
                _, loss, _ = self.engine.run(self._batch(self.engine, position, iteration),
                                             iteration, self.seed)
            self.log(f"Iteration {self.iter}, loss = {fmt(self._smoothed(loss))}")
        # Caffe tests at the end only on a test_interval boundary; cgp always reports
        # the final weights' test results.
        if self.test_nets and self.last_test_iter != self.iter:
            with threadpool_limits(limits=1), self._sigint():
                self._test_all()
        self.log("Optimization stopped early." if self._stop else "Optimization Done.")
        return self.last_test

    def _act_on_request(self, snapshot_due=False):
        """Takes what a signal asked for since the last call (_agree): a snapshot is written
        (once, also when one is due anyway), a stop sets _stop."""
        request, self._request = self._agree(), None
        if snapshot_due or request == "snapshot":
            self.snapshot()
        if request == "stop":
            self._stop = True

    def _agree(self):
        """The request that every process acts on now: the strongest any of them has (under
        MPI a signal may reach one rank only, or the ranks at different iterations), so that
        all stop, or snapshot, at the same iteration."""
        while self._heard:
            self.log(self._heard.pop(0))
        self._request = REQUESTS[self.schedule.request(REQUESTS.index(self._request))]
        return self._request

    def _reached(self, interval):
        """Whether the iteration count is at a multiple of interval (> 0), or, where it grows
        by more than one a step (cgp.comm.sharing), has passed one since the latest steps() began
        (until every iteration is claimed: the final count is then taken as it is)."""
        if interval <= 0:
            return False
        return self.iter % interval == 0 or (not self.drained
                                             and self.iter // interval > self._from // interval)

    def _sigint(self):
        """Caffe's signal effects, acted on after the current iteration: SIGINT (Ctrl-C)
        'stop' by default: stop, and snapshot as at the end of training (when
        snapshot_after_train is on, Caffe's default); SIGHUP 'snapshot' by default:
        snapshot and go on; SIGTERM, which batch schedulers (Slurm, PBS) send some time
        before they kill a job, as SIGINT. A second Ctrl-C or SIGTERM while stopping
        interrupts at once."""
        trainer = self
        effects = {signal.SIGINT: self.config.sigint_effect,
                   signal.SIGTERM: self.config.sigterm_effect}
        if hasattr(signal, "SIGHUP"):
            effects[signal.SIGHUP] = self.config.sighup_effect

        class Handler:
            def __enter__(self):
                def handle(signum, frame):
                    effect = effects[signum]
                    if effect == "none":
                        return
                    if (signum in (signal.SIGINT, signal.SIGTERM) and effect == "stop"
                            and trainer._told_to_stop):
                        raise KeyboardInterrupt
                    # This process's own stop (another rank's reaches it through _agree).
                    trainer._told_to_stop |= effect == "stop"
                    trainer._request = max(trainer._request, effect, key=REQUESTS.index)
                    # Said at the next iteration's end (_agree): the handler may interrupt
                    # the log in the middle of a line, which a write here would corrupt.
                    name = signal.Signals(signum).name
                    again = "Ctrl-C" if signum == signal.SIGINT else name
                    trainer._heard.append(
                        f"{name}: {'stopping' if effect == 'stop' else 'snapshotting'} after "
                        "this iteration" + (f" ({again} again to abort)" if effect == "stop"
                                            else ""))
                self.old = {}
                try:
                    for signum in effects:
                        self.old[signum] = signal.signal(signum, handle)
                except ValueError:  # not the main thread: leave signals alone
                    pass
                return self

            def __exit__(self, *exc):
                for signum, old in self.old.items():
                    signal.signal(signum, old)
        return Handler()

    def _progress(self):
        try:
            from tqdm import tqdm
        except ImportError:  # optional: no bar
            tqdm = None
        enabled = self.config.progress and sys.stderr.isatty() and tqdm is not None
        if not enabled:
            class NoBar:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    pass

                def update(self, n):
                    pass
            return NoBar()
        bar = tqdm(total=self.max_iter, initial=self.iter, unit="it", dynamic_ncols=True,
                   leave=False)
        log = self.log
        self.log = lambda line: (bar.write(line) if log is print else log(line))
        return bar

    # -- snapshots -----------------------------------------------------------------
    def snapshot_prefix(self):
        prefix = self.config.snapshot_prefix or self.sp.snapshot_prefix
        if not prefix and self.solver_path:
            prefix = str(Path(self.solver_path).with_suffix(""))
        return prefix or "cgp"

    def hold_prefix(self):
        """One run per snapshot prefix: takes its lock (snapshot.lock_prefix) for as long as
        this trainer runs, before it can write a snapshot (solve, snapshot), so that a
        second run is refused (CgpError naming the first) and a trainer that never writes
        one (equivalence, bench) takes none; then finishes or removes what an interrupted
        run left half written there. Once."""
        if not self._prefix_held:
            self._prefix_held = True
            self._lock = lock_prefix(self.snapshot_prefix())
            recover_snapshots(self.snapshot_prefix(), self.log)

    def snapshot(self):
        """Write <prefix>_iter_<N>.caffemodel and .solverstate (.caffemodel.h5 and
        .solverstate.h5 with snapshot_format HDF5), a pair that appears whole or not at all
        (snapshot.write_snapshot), from the leader process alone; returns the model's path
        (None outside the leader's group, which writes none: cgp.comm.sharing)."""
        if not self.comm.leader_group:
            return None
        pending = self.train_step.pending(self.iter)
        # Each process holds its columns' (MPI).
        for array in self.solver.histories + [gradient for _, gradient in pending]:
            self.comm.collect(array)
        h5 = self.sp.snapshot_format == caffe_pb2.SolverParameter.HDF5
        model, state = snapshot_paths(self.snapshot_prefix(), self.iter, h5)
        if self.comm.leader:
            self.hold_prefix()
            model = write_snapshot(self.snapshot_prefix(), self.iter, self.net, self.solver,
                                   resume=self.resume_state(), h5=h5)
        kind = "HDF5" if h5 else "binary proto"
        self.log(f"Snapshotting to {kind} file {model}")
        self.log(f"Snapshotting solver state to {kind} file {state}")
        self.weights_path = model
        self.snapshot_iter = self.iter
        return model

    def resume_state(self):
        """What cgp's .solverstate adds to Caffe's to resume bit for bit (cgp.proto)."""
        return cgp_pb2.ResumeState(
            data_origin=self.data_origin, seed=self.seed, chunks=len(self.engine.bounds),
            recent_loss=self.losses, staleness=self.train_step.staleness,
            stale_gradient=[cgp_pb2.StaleGradient(iteration=j, value=gradient)
                            for j, gradient in self.train_step.pending(self.iter)])

    def restore(self, path):
        """Resume from a .solverstate and the .caffemodel it names (its learned_net,
        relative to the working directory as in Caffe, else to the .solverstate's folder).

        A cgp .solverstate continues exactly: iteration, solver history, seed, data
        position and loss window all come back. One that Caffe wrote restores the
        iteration, history and learning-rate schedule, and the data restarts at the
        first record, as `caffe train --snapshot` does."""
        recover_snapshot(path, self.log)   # a commit of this very pair that a kill cut short
        state, resume = read_solverstate(path, self.solver, self.net)
        if state.learned_net:
            weights = resolve(state.learned_net, Path(path).parent, "learned_net of the solver state")
            self.load_weights(weights, quiet=True)
        else:
            self.log(f"Note: {path} names no weights file (its learned_net is empty): the "
                     "weights start from the net's fillers")
        self.iter = self.restored_iter = state.iter
        if resume is None:
            self.data_origin = state.iter
            self.log(f"{path} holds no cgp resume record (Caffe wrote it): the data restarts at "
                     "the first record, as in Caffe")
            return
        self.data_origin = resume.data_origin
        self.losses = list(resume.recent_loss)[-max(1, self.sp.average_loss):]
        self._restore_pending(path, resume)
        if resume.HasField("seed") and resume.seed != self.seed:
            self.log(f"Resuming with the snapshot's seed {resume.seed} (not {self.seed}), so "
                     "that the run continues as it would have")
            self.seed = resume.seed
        if resume.chunks and resume.chunks != len(self.engine.bounds):
            self.log(f"Warning: the snapshot was trained with {resume.chunks} chunks per batch, "
                     f"this run uses {len(self.engine.bounds)}: it continues with different "
                     "rounding, not bit for bit (use --chunks "
                     f"{resume.chunks})")

    def _restore_pending(self, path, resume):
        """The gradients a run with staleness had made and not applied yet."""
        step = self.train_step
        if resume.staleness != step.staleness:
            raise CgpError(f"{path} was written with --staleness {resume.staleness}; resume it "
                           f"with the same (this run has {step.staleness})")
        want = [j for j, _ in step.pending(self.iter)]
        if [g.iteration for g in resume.stale_gradient] != want:
            raise CgpError(f"{path}: the gradients pending at iteration {self.iter} should be "
                           f"those of iterations {want}; it holds "
                           f"{[g.iteration for g in resume.stale_gradient]}")
        for (_, slot), stored in zip(step.pending(self.iter), resume.stale_gradient):
            if len(stored.value) != slot.size:
                raise CgpError(f"{path}: a pending gradient of {len(stored.value)} values for "
                               f"{slot.size} parameters")
            slot[...] = stored.value

    def load_weights(self, path, quiet=False):
        copied = load_weights(self.net, path, None if quiet else self.log)
        missing = layers_without(self.net, copied)
        if missing and not quiet:
            self.log(f"Kept initial weights for: {', '.join(missing)}")

    def close(self):
        self.pool.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        for net in [self.net] + self.test_nets:
            for entry in net.sources:
                if hasattr(entry.layer, "close"):
                    entry.layer.close()


def copy_shared(train, test):
    """Test nets use the train net's weights, matched by layer name as Caffe's
    ShareTrainedLayersWith does."""
    for blob in test.param_blobs:
        for source in train.blob_param(blob.layer)[blob.index:blob.index + 1]:
            if source.shape != blob.shape:
                raise CgpError(f"layer '{blob.layer}' blob {blob.index}: shape {blob.shape} in "
                               f"the test net, {source.shape} in the train net")
            test.params[blob.offset:blob.offset + blob.size] = \
                train.params[source.offset:source.offset + source.size]
