"""The coarse-grain batch-parallel engine: one iteration of a Net over a fixed set of
chunks on a pool of threads (or of worker processes, cgp.procs).

The batch is cut into `chunks` pieces by batch size and chunk count alone. Each chunk
runs forward and backward single-threaded through nogil Numba kernels and writes its
own private gradient buffer (or, for weights whose gradient is a product of two per-row
matrices, those factors); the communicator then sums the chunks in a fixed order.
Which thread runs which chunk never matters, so results are bitwise the same for any
thread count. The engine knows nothing about solvers.

A worker runs a *group* of consecutive chunks per call: each layer runs once over the
group's samples, while parameter gradients and loss shares stay per chunk (see Chunk and
Layer), so grouping changes the speed, never a result. Fewer, larger calls hand the
interpreter lock over less often and let kernels run on more samples at once, until a
call's buffers no longer fit in the caches: see group_size.
"""
import functools
import os
import threading
import time

import numpy as np

from cgp.comm import FactoredGrad
from cgp.errors import CgpError
from cgp.kernels import fpenv, spin
from cgp.kernels.reduce import OUTER_PAD, sum_rows
from cgp.layers import Chunk, Factors, aligned_zeros
from cgp.net import Workspace


# About the most bytes of activations and their gradients one call should hold: beyond it
# the buffers stream from memory instead of the caches. LeNet (160 KB per sample) ran
# fastest with 32 to 64 samples per call, cifar10_quick (620 KB) with 12 to 25
# (bench/grouping.py).
CALL_BYTES = 8 << 20


def chunk_bounds(batch, chunks):
    """[(first, n), ...]: `chunks` near-equal contiguous pieces of a batch (fewer if the
    batch is smaller). The larger pieces come last."""
    if chunks < 1:
        raise CgpError(f"--chunks must be at least 1, got {chunks}")
    chunks = min(chunks, batch)
    cuts = [c * batch // chunks for c in range(chunks + 1)]
    return [(lo, hi - lo) for lo, hi in zip(cuts, cuts[1:])]


def span(bounds):
    """(first sample, samples) of consecutive chunks, bounds [(first, n), ...]."""
    first = bounds[0][0]
    return first, bounds[-1][0] + bounds[-1][1] - first


def call_chunk(bounds, **fields):
    """The Chunk of one call over consecutive chunks, bounds [(first, n), ...], each a part;
    fields: Chunk's other fields."""
    first, n = span(bounds)
    return Chunk(n=n, first=first, part_starts=tuple(f - first for f, _ in bounds) + (n,),
                 **fields)


def _ranges(indices):
    """Sorted indices as [(lo, hi), ...], each run of consecutive ones a range."""
    out = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def group_size(net, chunks, threads):
    """Chunks per call by default: one call per thread, unless that holds more than
    CALL_BYTES, then as many calls as that takes, of even size; 1 where the net cannot
    group (Net.groupable). Whatever it returns, the results are the same."""
    bounds = chunk_bounds(net.batch_size, chunks)
    if not net.groupable:
        return 1
    fit = max(1, CALL_BYTES // (bounds[0][1] * net.sample_bytes))
    calls = max(-(-len(bounds) // fit), threads)
    return -(-len(bounds) // calls)


class RunCancelled(Exception):
    """Raised by a task that waited for another's progress after that other failed (see
    Pool.check_run); the run raises the failure itself."""


class _Run:
    """One Pool.run: hands tasks out in index order to whichever worker asks next, and
    counts them done, also into flags[1] for a caller that watches it (kernels.spin). The
    first exception stops the handing out; Pool.run re-raises it."""

    def __init__(self, fn, tasks, flags, args):
        self.fn, self.tasks, self.flags, self.args = fn, tasks, flags, args
        self.next = self.done = 0
        self.error = None
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def work(self, w, then=None):
        """Worker w's tasks until none is left. then: called once, after w's first task or when
        w finds none left (the caller's own work, Pool.run's first)."""
        while True:
            with self.lock:
                i = self.next
                if i >= self.tasks:
                    break
                self.next = i + 1
            try:
                self.fn(w, i, *self.args)
            except BaseException as error:  # Pool.run re-raises it in the caller
                with self.lock:
                    self.error = self.error or error
                    self.done += self.tasks - self.next   # the tasks nobody will start
                    self.next = self.tasks
            with self.lock:
                self.done += 1
                self.flags[1] = self.done
                if self.done == self.tasks:
                    self.finished.set()
            if then is not None:
                then()
                then = None
        if then is not None:
            then()


# How long a waiting worker watches memory before it sleeps (kernels.spin): longer than the
# interpreter's work between two runs of a step (making the next batch, the solver's
# bookkeeping), so that within a training run the pool's threads never sleep.
SPIN_SECONDS = 0.01


# How long a task that waits for other tasks' progress watches memory between checks that
# the run has not failed; with more workers than CPUs it sleeps as long instead.
WAIT_CHECK_SECONDS = 0.0005


# What Pool.rest posts in place of a run.
_REST = object()


@functools.lru_cache(maxsize=None)
def spins_per_second():
    """How many reads kernels.spin's loops make in a second on this machine."""
    flags = np.zeros(2, np.int64)
    spin.wait_while(flags, 0, 0, 1000)   # compiled or loaded from the cache first
    n = 1 << 18
    started = time.perf_counter()
    spin.wait_while(flags, 0, 0, n)
    return int(n / max(time.perf_counter() - started, 1e-6))


def spin_count(workers):
    """How many reads a waiting worker of a pool of `workers` makes before it sleeps:
    SPIN_SECONDS' worth, or none where there are more workers than CPUs to run them, where
    a spinning worker would take a CPU from a working one (or with one worker: no waits)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return int(SPIN_SECONDS * spins_per_second()) if 1 < workers <= (usable or 1) else 0


class CallersWork:
    """A pool run's `first`, the caller's own work, done once the caller has run its first
    task, or found none left for it: with as many calls as workers (16 one-chunk calls on 16
    workers) every call then starts at once, and the caller's work overlaps the other
    workers' next tasks instead of delaying its own call, which every reduction task waits
    for. It runs in the caller's own floating-point mode (state, what fpenv.set_flush
    returned as the run's tasks began), not the tasks'; call() does it the first time only,
    and error is its exception, raised once the run's tasks are done."""

    def __init__(self, first, state, flush):
        self.first, self.state, self.flush = first, state, flush
        self.error = None

    def __call__(self):
        first, self.first = self.first, None
        if first is not None:
            fpenv.restore(self.state)
            try:
                first()
            except BaseException as error:   # raised once the run's tasks are done
                self.error = error
            fpenv.set_flush(self.flush)


class Pool:
    """`threads` workers that share a list of tasks; task i of run(fn, tasks, *args) runs as
    fn(worker, i, *args). fn is any function; program(fn) returns it as it is, for callers
    that also run on a cgp.procs.ProcessPool, whose functions must be registered.
    The calling thread is worker 0 and runs tasks itself, beside threads-1 pool threads,
    and a run returns as soon as its last task is done, without waiting for a late thread
    to find nothing left. With one thread everything runs in the caller: plain sequential
    execution.
    Waiting threads (the pool's for the next run, the caller for a run's last task) watch
    memory for up to SPIN_SECONDS before they sleep, so that their CPUs do not go idle
    between the hand-overs of a step (see kernels.spin); not when there are more threads
    than CPUs, where a spinning thread would take a CPU from a working one.
    affinity: pin worker k to the k-th CPU this process may use (Linux), so the OS does not
    migrate workers between cores; results never depend on it. As OpenMP pins its master
    thread, the caller is pinned too (with more than one thread), until close(); threads it
    starts meanwhile inherit that CPU.
    flush_denormals: every task runs with subnormal floats flushed to zero (see
    cgp.kernels.fpenv), or with IEEE subnormals; the pool threads keep the mode for their
    life, the caller only while it runs tasks, so every thread count computes alike."""

    # Tasks may write ordinary memory: every worker is a thread of this process.
    shared_memory = False

    def __init__(self, threads, affinity=False, flush_denormals=True):
        if threads < 1:
            raise CgpError(f"--threads must be at least 1, got {threads}")
        self.threads = threads
        self.flush = flush_denormals
        self.pinned = []
        self._caller_cpus = None
        self._flags = aligned_zeros(2, np.int64)   # runs posted, tasks done in the latest
        self._run = None
        self._current = None   # the run in progress (or the latest)
        self._posted = threading.Condition()
        self._workers = []
        cpus = sorted(os.sched_getaffinity(0)) if affinity and hasattr(os, "sched_getaffinity") else []
        if affinity and not cpus:
            raise CgpError("--affinity needs an OS that lets threads be pinned (Linux)")
        self._spins = spin_count(threads)
        if threads == 1:
            return
        if cpus:
            self._caller_cpus = os.sched_getaffinity(0)
            self._pin(cpus[0])
        # The threads' compiled calls are compiled (or loaded) here, and the threads have
        # made their first ones before this returns: a process forked later (cgp.procs)
        # must not copy a Numba compiler lock that one of them held.
        fpenv.restore(fpenv.set_flush(self.flush))
        spin.wait_while(self._flags, 0, -1, 0)
        started = threading.Barrier(threads)
        for w in range(1, threads):
            worker = threading.Thread(target=self._serve, name=f"cgp-{w}", daemon=True,
                                      args=(w, cpus[w % len(cpus)] if cpus else None, started))
            worker.start()
            self._workers.append(worker)
        started.wait()

    def _pin(self, cpu):
        os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread only
        self.pinned.append(cpu)

    def _serve(self, w, cpu, started):
        """Pool thread w: runs its share of every run posted, until close()."""
        fpenv.set_flush(self.flush)
        if cpu is not None:
            self._pin(cpu)
        started.wait()
        seen, resting = 0, False
        while True:
            if resting or spin.wait_while(self._flags, 0, seen, self._spins) == seen:
                with self._posted:
                    while self._flags[0] == seen:
                        self._posted.wait()
            # A run posted since is taken as well; this one then has nothing left for it.
            seen, run = int(self._flags[0]), self._run
            if run is None:
                return
            resting = run is _REST
            if not resting:
                run.work(w)

    def program(self, fn):
        """fn itself: threads run any function (see cgp.procs.ProcessPool.program)."""
        return fn

    def start(self):
        """Nothing to do: the threads started with the pool (cgp.procs.ProcessPool forks
        its workers here)."""

    def run(self, fn, tasks, *args, first=None):
        """first: a function the caller runs once it has run its first task (or found none
        left): work of its own that the other workers' tasks overlap (CallersWork); its
        exception is raised after the run, in place of a task's. With no tasks nothing runs,
        first neither."""
        if tasks < 1:
            return
        run = self._current = _Run(fn, tasks, self._flags, args)
        if self._workers:
            self._post(run)
        state = fpenv.set_flush(self.flush)
        own = CallersWork(first, state, self.flush)
        try:
            run.work(0, own if first is not None else None)
        finally:
            fpenv.restore(state)
        spin.wait_for(self._flags, 1, tasks, self._spins)
        run.finished.wait()
        if own.error is not None or run.error is not None:
            raise own.error or run.error

    def check_run(self):
        """For a task that waits for another task's progress: raises RunCancelled if a task
        of the run has failed, after which no task starts and that progress may never come."""
        if self._current.error is not None:
            raise RunCancelled()

    def _post(self, run):
        with self._posted:
            self._run = run
            self._flags[1] = 0
            self._flags[0] += 1
            self._posted.notify_all()

    def rest(self):
        """Sends the pool's threads to sleep now, not SPIN_SECONDS after the last run: for
        a caller that will not run anything for a while, while something else needs the
        CPUs (another pool, in a benchmark)."""
        if self._workers:
            self._post(_REST)

    def close(self):
        if self._workers:
            self._post(None)
            for worker in self._workers:
                worker.join()
            self._workers = []
        if self._caller_cpus is not None:
            os.sched_setaffinity(0, self._caller_cpus)
            self._caller_cpus = None


class Engine:
    """Runs forward (and backward) of one net over the chunks of each batch."""

    def __init__(self, net, chunks, pool, comm, backward=True, params=None, factor=True,
                 group=None, overlap=True):
        """params: the flat parameter array to run with (default net.params); a float64
        copy runs the same kernels in float64 (the equivalence harness's reference).
        factor: let layers that can (see Layer.can_factor_param_diff) hand their weight
        gradient over as factors, which the communicator multiplies out while it sums the
        chunks; the same bits either way, with far less memory traffic.
        group: chunks per call (default: group_size); 1 where the net cannot group
        (Net.groupable).
        overlap: run the reduction's tasks in the calls' pool run, each once the calls have
        written its gradients (as below), or in a run of its own after the calls; the same
        bits either way (bench/overlap_ab.py times the two).
        On a pool of worker processes (pool.shared_memory, cgp.procs), what calls read and
        write across workers (the batch, chunk gradients and factors, loss shares) is in
        shared memory; params must then be shared too (cgp.procs.share_params)."""
        self.net, self.pool, self.comm = net, pool, comm
        self.overlap = overlap
        shared = pool.shared_memory
        self.bounds = chunk_bounds(net.batch_size, chunks)
        if group is None:
            group = group_size(net, chunks, pool.threads)
        if group < 1:
            raise CgpError(f"group must be at least 1 chunk, got {group}")
        group = group if net.groupable else 1
        # (first chunk, past the last chunk) of each group, the groups of most samples first:
        # workers take calls in this order, so the small ones come last and even out when
        # the workers finish (cifar10_quick's 100 samples make calls of 12 and 13, and in
        # chunk order the second worker took every 13). Each call writes its own buffers,
        # so the order changes no result.
        self.groups = sorted(((c, min(c + group, len(self.bounds)))
                              for c in range(0, len(self.bounds), group)),
                             key=lambda g: -self.samples(g)[1])
        flat = net.params if params is None else params
        self.dtype = flat.dtype
        self.backward = backward
        self.workspaces = [self.new_workspace() for _ in range(pool.threads)]
        self.params = net.param_views(flat)
        self.factored = []
        if backward:
            self.chunk_grads = aligned_zeros((len(self.bounds), net.n_params), self.dtype,
                                             shared)
            self.group_grad_views = [net.param_views(self.chunk_grads[c0:c1])
                                     for c0, c1 in self.groups]
            if factor:
                for index in net.factorable:
                    self.factored.append(self._factor(index, shared))
            self.reduction = comm.plan(self.chunk_grads, self.factored, self._owner_cuts())
            # The reduction's tasks run in the same pool run as the calls, after them, each
            # once every call has passed, in its backward, the layers whose gradients it sums
            # (progress[e]: calls past entry e): a worker done with its call sums the last
            # layers' gradients while the others still run backward through the first ones.
            # Backward runs the entries last to first, so a task awaits the first entry that
            # writes its columns, and the tasks of the last entries go first; each writes its
            # own columns, so the order changes no bit.
            self.progress = aligned_zeros(len(net.entries), np.int64, shared)
            self.awaited = [self._first_writer(lo, hi) for lo, hi in self.reduction.spans]
            self.reduce_order = sorted(range(len(self.awaited)), key=lambda t: -self.awaited[t])
            # Waits watch memory, as the pool's do, unless spin_count says a CPU is better
            # left to the calls awaited (more workers than CPUs; one worker never waits).
            self._wait_spins = (int(WAIT_CHECK_SECONDS * spins_per_second())
                                if spin_count(pool.threads) else 0)
        # The batch values reported: loss tops and unread scalar outputs (accuracy, ...).
        tracked = dict(net.scalar_outputs())
        for blob in net.loss_weights:
            tracked.setdefault(blob, net.blob_names[blob])
        self.tracked = list(tracked.items())
        self.shares = aligned_zeros((len(self.bounds), len(self.tracked)), np.float64, shared)
        # What run() adds up after its calls, made once: the shares in the run's dtype, their
        # totals, and (index into tracked, loss weight) of each loss.
        self._shares = np.empty(self.shares.shape, self.dtype)
        self._totals = np.empty(len(self.tracked), self.dtype)
        self._losses = [(j, self.dtype.type(net.loss_weights[blob]))
                        for j, (blob, _) in enumerate(self.tracked)
                        if blob in net.loss_weights]
        # The batch as the calls read it, in two sets: while a run's calls read one, the
        # caller may copy the next batch into the other (stage()). Calls thus always read the
        # same arrays, which their bound layer calls keep (below).
        self.inputs = [{t: aligned_zeros(net.blob_shapes[t], self.dtype, shared)
                        for t in net.source_names} for _ in range(2)]
        # What losses that count the batch's labels read (Chunk.batch_tops), for each set.
        self._batch_tops = [net.batch_tops(inputs) for inputs in self.inputs]
        self._slot = 0          # the set of inputs that the latest run read
        self._staged = None     # (batch, its set) copied by stage() for the next run
        # Per worker, the layer calls of each (group, set of inputs), bound at its first call
        # there (Net.bind): a worker's calls repeat on the same arrays at every step.
        self._bound = [{} for _ in self.workspaces]
        self._apply = None           # the solver update merged into runs (merge_updates)
        self._apply_columns = None   # the solver update fused into the reduction (fuse_updates)
        self._claim_columns = None   # asks for the lines the fused update writes (fuse_updates)
        self._tasks = pool.program(self._task)

    def merge_updates(self, apply, spans):
        """Lets run() take the previous step's solver update along (run's `pending`, a solver
        Step in the form that apply takes): apply(worker, i, step) updates the flat parameters'
        columns spans[i]. Every call's forward then waits, before each layer, until the blocks
        holding that layer's parameters are updated: one worker updates while another starts
        its call, and a step hands over to the workers once. The same arithmetic on the same
        values as an update run of its own: every read of a parameter waits for its update, and
        the run's first write of a gradient (backward, after the whole forward) comes after
        every update has read it. Before the pool starts (worker processes must see apply)."""
        net = self.net
        self._apply = apply
        self.update_spans = list(spans)
        # Per entry: the update blocks, as ranges, that hold its parameters and that no
        # earlier entry has waited for (forward runs the entries in order): one wait each.
        self.needs, seen = [], set()
        for e in range(len(net.entries)):
            new = [b for b, (lo, hi) in enumerate(self.update_spans)
                   if b not in seen and self._holds(e, lo, hi)]
            seen.update(new)
            self.needs.append(_ranges(new))
        self.updated = aligned_zeros(len(self.update_spans), np.int64, self.pool.shared_memory)
        self.merged_order = self._merged_order()

    def fuse_updates(self, apply_columns, claim_columns=None):
        """Lets run() apply this step's own solver update (run's `update`, a solver Step in the
        form that apply_columns takes) in the reduction's tasks: apply_columns(worker, lo, hi,
        step) updates the flat parameters' columns lo:hi, which a task calls on its columns
        right after summing them. A task runs once every call has passed, in its backward,
        every layer that holds those columns, and no call reads a layer's parameters after its
        backward: the same arithmetic on the same values as an update after the run. It uses
        the time that workers done with their calls would spend waiting for the slowest, with
        the summed gradient still in the cache of the core that wrote it. claim_columns(lo,
        hi), if given, runs first in such a task, before the sum: it asks for the cache lines
        that the update will write (Trainer: cgp.kernels.update.claim), which every worker's
        calls have just read, so that taking them from the other cores overlaps the sum instead
        of stalling the update's stores. Before the pool starts (worker processes must see
        apply_columns)."""
        self._apply_columns = apply_columns
        self._claim_columns = claim_columns

    def _merged_order(self):
        """The first tasks of a run with a pending update, before the reduction's: update
        block b as -1 - b, call g as g. On one worker, which cannot wait for anything, the
        whole update, then the calls. On more, the blocks that the first layer with
        parameters needs, then call 0, then the other blocks, then the other calls: one
        worker updates the first layer's blocks and another starts call 0 with them done,
        while the first (the caller, which reads the next batch after its first task:
        Pool.run's first) goes on to the blocks later layers need. (Call 0 first had its
        worker wait 0.1 ms for the first block; the whole update first left the two
        workers' memory-bound updates side by side, no faster: bench/README.)"""
        blocks = range(len(self.update_spans))
        calls = range(len(self.groups))
        if self.pool.threads == 1:
            return [-1 - b for b in blocks] + list(calls)
        lead = next(([b for lo, hi in ranges for b in range(lo, hi)]
                     for ranges in self.needs if ranges), [])
        rest = [b for b in blocks if b not in lead]
        return [-1 - b for b in lead] + list(calls[:1]) + [-1 - b for b in rest] + list(calls[1:])

    def new_workspace(self):
        """One worker's buffers, sized for this engine's calls and for how the net runs its
        layers (Net.whole_calls)."""
        return Workspace(self.net, max(self.samples(g)[1] for g in self.groups),
                         with_diff=self.backward, dtype=self.dtype,
                         parts=max(c1 - c0 for c0, c1 in self.groups),
                         part_max=max(n for _, n in self.bounds))

    def samples(self, group):
        """(first sample, samples) of a group (c0, c1) of chunks."""
        c0, c1 = group
        return span(self.bounds[c0:c1])

    def _factor(self, index, shared):
        """Batch-wide buffers for the factors of entry `index`'s weight gradient; each group's
        gradient view of that weight becomes a Factors over the group's rows of them."""
        entry = self.net.entries[index]
        rows, J, L = entry.layer.factor_shape()
        blob = self.net.param_blobs[entry.params[0]]
        M = self.net.batch_size * rows
        # Register tiles read up to OUTER_PAD elements past the last row.
        a = aligned_zeros(M * J + OUTER_PAD, self.dtype, shared)
        b = aligned_zeros(M * L + OUTER_PAD, self.dtype, shared)
        for g, group in enumerate(self.groups):
            first, n = self.samples(group)
            lo, hi = first * rows, (first + n) * rows
            self.group_grad_views[g][index][0] = Factors(a[lo * J:hi * J].reshape(-1, J),
                                                         b[lo * L:hi * L].reshape(-1, L))
        starts = np.array([first * rows for first, _ in self.bounds] + [M], np.int64)
        return FactoredGrad(blob.offset, J, L, a, b, starts)

    def run(self, batch, iteration, seed, pending=None, first=None, update=None):
        """batch: source blob id -> whole-batch array. Returns ({output name: value},
        loss, gradient or None). The gradient is the fixed-order sum over chunks.
        pending: a solver Step to apply first, in this run (merge_updates). first: the
        caller's own work during the run (Pool.run's). update: a solver Step to
        apply to the sum as the reduction's tasks make it (fuse_updates); the gradient
        returned then holds the step taken, as the update leaves it. Both in the form that
        the functions given there take. A batch given to stage() during the run before is
        read where stage() copied it."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] is batch:
            slot = staged[1]
        else:
            slot = self._copy_in(batch)
        self._slot = slot
        tasks = len(self.groups)
        if pending is not None:
            if self._apply is None:
                raise ValueError("Engine.run: a pending update needs merge_updates first")
            self.updated[:] = 0
            tasks += len(self.update_spans)
        if update is not None and not (self._apply_columns and self.backward and self.overlap):
            raise ValueError("Engine.run: an update in the reduction needs fuse_updates first, "
                             "and the reduction's tasks in the calls' run")
        if self.backward and self.overlap:
            self.progress[:] = 0
            tasks += len(self.reduce_order)
        self.pool.run(self._tasks, tasks, iteration, seed, pending, update, slot, first=first)
        if self.backward and not self.overlap:
            self.reduction()
        # Shares add up in chunk order, in the dtype of the blobs they came from.
        totals = self._totals
        self._shares[...] = self.shares
        sum_rows(self._shares, totals)
        values = {name: float(v) for (_, name), v in zip(self.tracked, totals)}
        loss = float(sum(weight * totals[j] for j, weight in self._losses))
        grad = self.reduction.result if self.backward else None
        return values, loss, grad

    def stage(self, batch):
        """Copies the batch of the next run() into the inputs that the run in progress, if
        any, does not read: the caller's work during a run (Pool.run's `first`), where it
        costs the step nothing, instead of at the start of the next run, where every worker
        waits for it. run(batch) then reads them."""
        self._staged = (batch, self._copy_in(batch))

    def _copy_in(self, batch):
        """Copies batch into the set of inputs that the latest run did not read; returns it."""
        slot = 1 - self._slot
        for b, a in batch.items():
            self.inputs[slot][b][...] = a   # cast to the run's dtype as it is copied
        return slot

    def _owner_cuts(self):
        """The columns of the flat parameters where the entries that hold them change: the
        reduction's tasks are cut there too, so that a task awaits the layer whose gradients
        it sums, not an earlier one whose columns happen to share its block (LeNet's conv2
        waited for conv1, the last layer of backward: 0.06 ms alone at the end of the run)."""
        net = self.net
        owners = {}
        for e, entry in enumerate(net.entries):
            for p in entry.params:
                owners.setdefault(p, set()).add(e)
        cuts, last = [], None
        for p in sorted(owners, key=lambda p: net.param_blobs[p].offset):
            if owners[p] != last:
                cuts.append(net.param_blobs[p].offset)
                last = owners[p]
        return cuts

    def _first_writer(self, lo, hi):
        """The first entry that writes gradients of columns lo:hi of the flat parameters
        (every column has one)."""
        return next(e for e in range(len(self.net.entries)) if self._holds(e, lo, hi))

    def _holds(self, e, lo, hi):
        """Whether any parameter of entry e lies in columns lo:hi of the flat parameters."""
        net = self.net
        return any(net.param_blobs[p].offset < hi
                   and lo < net.param_blobs[p].offset + net.param_blobs[p].size
                   for p in net.entries[e].params)

    def _task(self, worker, i, iteration, seed, pending, update, slot):
        """Task i of a run: call i, or after the calls, reduction task reduce_order[i - calls]
        once its columns' gradients are written, then with `update` its columns' update. With
        a pending update, the first tasks are the calls and the update's blocks in
        merged_order. slot: the set of inputs the calls read."""
        calls = len(self.groups)
        if pending is not None:
            if i >= len(self.merged_order):
                i -= len(self.update_spans)   # a reduction task
            elif self.merged_order[i] < 0:
                b = -1 - self.merged_order[i]
                self._apply(worker, b, pending)
                spin.fetch_add(self.updated, b, 1)
                return
            else:
                i = self.merged_order[i]
        if i < calls:
            self.work(worker, i, iteration, seed, slot,
                      self._ready if pending is not None else None)
            return
        t = self.reduce_order[i - calls]
        # Every call has been handed out before this task: each runs on a worker that waits
        # for nothing, unless the run has failed (then check_run raises).
        a = self.awaited[t]
        self._wait(self.progress, a, a + 1, calls)
        lo, hi = self.reduction.spans[t]
        if update is not None and self._claim_columns is not None:
            # Only now: a call still reading these parameters would lose its lines to it.
            self._claim_columns(lo, hi)
        self.reduction.task(worker, t)
        if update is not None:
            self._apply_columns(worker, lo, hi, update)

    def _ready(self, entry):
        """Waits until the update blocks that hold entry's parameters are done (a call's
        forward, in a run with a pending update)."""
        for lo, hi in self.needs[entry]:
            self._wait(self.updated, lo, hi, 1)

    def _wait(self, counters, lo, hi, target):
        """Waits, within a run, until counters[lo:hi] have each reached target, other tasks'
        progress; raises RunCancelled (Pool.check_run) once a task of the run has failed."""
        while spin.wait_for_all(counters, lo, hi, target, self._wait_spins) < target:
            self.pool.check_run()
            if not self._wait_spins:
                time.sleep(WAIT_CHECK_SECONDS)   # the CPU is needed by the task awaited

    def work(self, worker, g, iteration, seed, slot, ready=None):
        """One call: forward (and backward) of group g's samples in the worker's workspace,
        writing the group's loss shares and chunk gradients. slot: the set of inputs that
        holds the batch. ready: BoundCall.forward's, where a pending update runs alongside."""
        net = self.net
        c0, c1 = self.groups[g]
        chunk = call_chunk(self.bounds[c0:c1], batch=net.batch_size, iteration=iteration,
                           seed=seed, batch_tops=self._batch_tops[slot])
        bound = self._bound[worker].get((g, slot))
        if bound is None:
            ws = self.workspaces[worker]
            bound = self._bound[worker][g, slot] = net.bind(
                ws, chunk, net.call_views(ws, chunk, self.inputs[slot]), self.params,
                self.group_grad_views[g] if self.backward else None)
        bound.forward(chunk, ready=ready)
        for j, (blob, _) in enumerate(self.tracked):
            self.shares[c0:c1, j] = bound.data[blob][:c1 - c0]
        if self.backward:
            grads = self.chunk_grads[c0:c1]
            for lo, hi in net.zero_ranges:  # layers that set their gradients need no zeros
                grads[:, lo:hi] = 0
            bound.backward(chunk, progress=self.progress)
