"""The coarse-grain batch-parallel engine: forward and backward of a net over the chunks of a
batch that this process owns, on a pool of workers, with the chunks' parameter gradients
summed in the fixed order of the communicator (cgp.comm.local) as soon as they are written.

One run, in one place (Engine.run): the batch is cut into K chunks by batch size and chunk
count alone (chunk_bounds); this process computes chunks lo..hi of K, its range of
cgp.comm.local.partition by the communicator's rank and size (all of them on one machine).
The run is a list of typed tasks, built once per net and handed out in order to whichever
worker asks next:

  Call(group)  forward and backward of a group of consecutive chunks in the worker's own
               buffers, each chunk's parameter gradient kept apart (see Chunk and Layer);
  Sum(task)    one task of the communicator's reduction: the fixed-order sum over the owned
               chunks of some columns of the gradient, once every call has passed, in its
               backward, the first layer that writes them (backward runs the layers last to
               first, so the last layers' sums start while calls still run the first ones);
               then, where the communicator says that sum is the batch's (one process), the
               columns go at once, with the run's pass plan, to the updater that the step
               handed the engine (hand_sums_to: cgp.step.Updater, which makes the solver's
               update) while they are still in this core's cache.

Which worker runs which task never matters: each task writes buffers of its own, and the sum
of a column never depends on when it is made, so results are bitwise the same for any
number of workers. The engine knows nothing about solvers or ranks.

A call covers a *group* of consecutive chunks: each layer runs once over the group's
samples, while parameter gradients and loss shares stay per chunk (Chunk, Layer), so the
group size changes the speed, never a result. Fewer, larger calls hand the interpreter lock
over less often and let kernels run on more samples at once, until a call's buffers no
longer fit in the caches: see group_size.
"""
import time
from typing import NamedTuple, Protocol

import numpy as np

from cgp.comm.local import FactoredGrad, partition, sum_over_chunks
from cgp.errors import CgpError
from cgp.layers import Chunk, Factors
from cgp.net import Workspace, work_scratch
from cgp.runtime import spin
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.pool import spin_count, spins_per_second
from cgp.runtime.reduce import OUTER_PAD, sum_rows


# About the most bytes of activations and their gradients one call should hold: beyond it
# the buffers stream from memory instead of the caches. LeNet (160 KB per sample) ran
# fastest with 32 to 64 samples per call, cifar10_quick (620 KB) with 12 to 25
# (bench/README.md).
CALL_BYTES = 8 << 20

# How long a task that waits for other tasks' progress watches memory between checks that
# the run has not failed; with more workers than CPUs it sleeps as long instead.
WAIT_CHECK_SECONDS = 0.0005


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


class SumsUpdater(Protocol):
    """What a Sum task hands its columns lo:hi to where their sum is the batch's, with the
    run's pass plan, which the engine only hands on (Engine.hand_sums_to; cgp.step.Updater)."""

    def prefetch(self, lo, hi, pass_plan):
        """Before the sum: the update's cache lines asked for while the sum runs."""

    def columns(self, lo, hi, pass_plan):
        """After the sum: what the plan says to do with the columns."""


class Call(NamedTuple):
    """Forward and backward of the chunks of Engine.groups[group] on one worker; where the
    net sums over the batch, segment `segment` of them (see Sync)."""
    group: int
    segment: int = 0


class Sync(NamedTuple):
    """Sum `index` over the whole batch (Net.forward_syncs then backward_syncs): once every
    call has run the segment before it, its chunks' shares added in the fixed tree; the calls'
    next segments wait for it."""
    index: int


class Sum(NamedTuple):
    """Task `task` of the communicator's reduction (columns Reduction.spans[task]), once
    every call is past net entry `after` in its backward."""
    task: int
    after: int


class Engine:
    """Runs forward (and backward) of one net over the chunks of each batch that the
    communicator gives this process."""

    def __init__(self, net, chunks, pool, comm, backward=True, params=None, factor=True,
                 group=None):
        """chunks: K, the fixed pieces of each batch (fewer where the batch is smaller).
        params: the flat parameter array to run with (default net.params); a float64 copy runs
        the same kernels in float64 (the equivalence harness's reference).
        factor: let layers that can (Layer.can_factor_param_diff) hand their weight gradient
        over as factors, which the reduction multiplies out while it sums the chunks, where
        the communicator takes factors; the same bits either way, with far less memory
        traffic.
        group: chunks per call (default: group_size); 1 where the net cannot group
        (Net.groupable).
        On a pool of worker processes (pool.shared_memory, cgp.runtime.procs), what calls read
        and write across workers (the batch, chunk gradients and factors, loss shares) is in
        shared memory; params must then be shared too (cgp.runtime.procs.share_params)."""
        self.net, self.pool, self.comm = net, pool, comm
        shared = pool.shared_memory
        self.bounds = chunk_bounds(net.batch_size, chunks)
        # The chunks each process computes, lo..hi of K, and their samples; this one's.
        self.parts = partition(len(self.bounds), comm.size)
        self.owned = self.parts[comm.rank]
        self.sample_parts = [self._samples_of(part) for part in self.parts]
        self.rows = self.sample_parts[self.parts.index(self.owned)]
        own = self.bounds[self.owned.start:self.owned.stop]
        if group is None:
            group = group_size(net, chunks, pool.threads)
        if group < 1:
            raise CgpError(f"group must be at least 1 chunk, got {group}")
        group = group if net.groupable else 1
        # (first chunk, past the last chunk) of each group, as indices into the owned chunks,
        # the groups of most samples first: workers take calls in this order, so the small
        # ones come last and even out when the workers finish (cifar10_quick's 100 samples
        # make calls of 12 and 13, and in chunk order the second worker took every 13).
        self.groups = sorted(((c, min(c + group, len(own))) for c in range(0, len(own), group)),
                             key=lambda g: -span(own[g[0]:g[1]])[1])
        self.own = own
        flat = net.params if params is None else params
        self.dtype = flat.dtype
        self.backward = backward
        self.params = net.param_views(flat)
        # Where the net sums over the batch (BatchNorm), each call pauses at each sum until
        # every call has reached it (Sync): its buffers must outlive the pause, so each group
        # has a workspace of its own, which any worker may take on (shared between worker
        # processes), and the sums' shares are rows of batch-wide arrays. The layers' work
        # scratch (Layer.work_scratch), which no call reads across a pause, stays one per
        # worker (ResNet-50's: ~0.4 GB, which every call of the batch would hold).
        syncs = net.forward_syncs + (net.backward_syncs if backward else [])
        self.syncs, self.forward_segments = syncs, len(net.forward_syncs)
        if syncs:
            # A row of shares per chunk of the batch: this process's calls write theirs, the
            # communicator brings the other processes' (Communicator.start).
            self.sums = {i: [(aligned_zeros((len(self.bounds), m), np.float64, shared),
                              aligned_zeros(m, np.float64, shared))
                             for m in net.entries[i].layer.sum_sizes()] for i, _ in syncs}
            self.workspaces = [self.new_workspace(group, shared) for group in self.groups]
            n_max = max((self.samples(group)[1] for group in self.groups), default=0)
            self.work = [work_scratch(net, n_max, self.dtype) for _ in range(pool.threads)]
            self.reached = aligned_zeros(len(syncs), np.int64, shared)   # calls at sum s
            self.synced = aligned_zeros(len(syncs), np.int64, shared)    # sum s made
            self.gathered = aligned_zeros(len(syncs), np.int64, shared)  # others' shares in
        else:
            self.workspaces = [self.new_workspace() for _ in range(pool.threads)] if own else []
        self.factored = []
        # Every group's segments in order, each sum after the segment before it.
        self.tasks = [Call(g) for g in range(len(self.groups))]
        for s in range(len(syncs)):
            self.tasks += [Sync(s)] + [Call(g, s + 1) for g in range(len(self.groups))]
        if backward:
            # One row of the flat gradient per owned chunk.
            self.chunk_grads = aligned_zeros((len(own), net.n_params), self.dtype, shared)
            self.group_grad_views = [net.param_views(self.chunk_grads[c0:c1])
                                     for c0, c1 in self.groups]
            if factor and comm.takes_factors and own:
                self.factored = [self._factor(index, shared) for index in net.factorable]
            self.reduction = comm.plan(self.chunk_grads, len(self.bounds), self.factored,
                                       self._owner_cuts())
            self.progress = aligned_zeros(len(net.entries), np.int64, shared)
            # The last entries' sums first: backward reaches them first.
            after = [self._first_writer(lo, hi) for lo, hi in self.reduction.spans]
            self.tasks += sorted((Sum(t, a) for t, a in enumerate(after)), key=lambda s: -s.after)
        # Waits (for the calls' progress, and for sums over the batch) watch memory, as the
        # pool's do, unless spin_count says a CPU is better left to the calls awaited (more
        # workers than CPUs; one worker never waits).
        self._wait_spins = (int(WAIT_CHECK_SECONDS * spins_per_second())
                            if spin_count(pool.threads) else 0)
        # The batch values reported: loss tops and unread scalar outputs (accuracy, ...).
        tracked = dict(net.scalar_outputs())
        for blob in net.loss_weights:
            tracked.setdefault(blob, net.blob_names[blob])
        self.tracked = list(tracked.items())
        # Every chunk's share of them, this process's rows written by its calls and the
        # others' by the communicator (Communicator.gather).
        self.shares = aligned_zeros((len(self.bounds), len(self.tracked)), np.float64, shared)
        # What run() adds up after its calls, made once: the shares in the run's dtype, their
        # totals, and (index into tracked, loss weight) of each loss.
        self._shares = np.empty(self.shares.shape, self.dtype)
        self._totals = np.empty(len(self.tracked), self.dtype)
        self._losses = [(j, self.dtype.type(net.loss_weights[blob]))
                        for j, (blob, _) in enumerate(self.tracked)
                        if blob in net.loss_weights]
        # This process's samples of the batch as the calls read them, in two sets: while a
        # run's calls read one, the caller may copy the next batch into the other (stage()).
        # Calls thus always read the same arrays, which their bound layer calls keep (below).
        self.inputs = [{t: aligned_zeros((len(self.rows),) + net.blob_shapes[t][1:],
                                         self.dtype, shared)
                        for t in net.source_names} for _ in range(2)]
        # What losses that count the batch's labels read (Chunk.batch_tops), for each set:
        # the inputs themselves where this process computes every chunk, else whole-batch
        # copies that the communicator completes with the other processes' samples.
        whole = len(self.parts) == 1
        self._batch = [{t: inputs[t] if whole else aligned_zeros(net.blob_shapes[t], self.dtype)
                        for t in net.batch_read} for inputs in self.inputs]
        self._batch_tops = [net.batch_tops(batch) for batch in self._batch]
        self._slot = 0          # the set of inputs that the latest run read
        self._staged = None     # (batch, its set) copied by stage() for the next run
        # Per worker, the layer calls of each (group, set of inputs), bound at its first call
        # there (Net.bind): a worker's calls repeat on the same arrays at every step.
        self._bound = [{} for _ in range(pool.threads)]
        self.updater = None   # what Sum tasks hand their columns to (hand_sums_to)
        self._tasks = pool.program(self._task)

    def hand_sums_to(self, updater: SumsUpdater):
        """Where the communicator says that each Sum task's sum is the batch's (final_sums),
        lets run() hand its columns lo:hi to the updater in that task, right after the sum:
        updater.prefetch(lo, hi, pass_plan) before the sum (the update's cache lines asked
        for while the sum runs), updater.columns(lo, hi, pass_plan) after it, for a run given
        a pass_plan (cgp.step.PassPlan, which the engine only hands on). The same values as
        the update made after the run: no call reads a layer's parameters after its backward,
        which every call has passed before the task starts. Before the pool starts: worker
        processes must inherit the updater."""
        self.updater = updater

    @property
    def final_sums(self):
        """Whether run()'s Sum tasks leave the batch's sum (and so hand it to the updater)."""
        return self.backward and self.comm.final_in_task

    def new_workspace(self, group=None, shared=False):
        """One worker's buffers, sized for this engine's calls and for how the net runs its
        layers (Net.whole_calls); or, with a group, that group's own (its rows of the sums),
        without the layers' work scratch (self.work: the workers')."""
        groups = self.groups if group is None else [group]
        k0 = self.owned.start
        sums = None if group is None else {
            i: [(shares[k0 + group[0]:k0 + group[1]], total) for shares, total in self.sums[i]]
            for i in self.sums}
        return Workspace(self.net, max(self.samples(g)[1] for g in groups),
                         with_diff=self.backward, dtype=self.dtype,
                         parts=max(c1 - c0 for c0, c1 in groups),
                         part_max=max(n for _, n in self.own), shared=shared,
                         sums=None if sums is None else
                         [sums.get(i) for i in range(len(self.net.entries))],
                         work=group is None)

    def samples(self, group):
        """(first sample, samples) of a group (c0, c1) of owned chunks."""
        c0, c1 = group
        return span(self.own[c0:c1])

    def _factor(self, index, shared):
        """Buffers for the factors of entry `index`'s weight gradient over the owned samples;
        each group's gradient view of that weight becomes a Factors over the group's rows."""
        entry = self.net.entries[index]
        rows, J, L = entry.layer.factor_shape()
        blob = self.net.param_blobs[entry.params[0]]
        first, samples = span(self.own)
        M = samples * rows
        # Register tiles read up to OUTER_PAD elements past the last row.
        a = aligned_zeros(M * J + OUTER_PAD, self.dtype, shared)
        b = aligned_zeros(M * L + OUTER_PAD, self.dtype, shared)
        for g, group in enumerate(self.groups):
            start, n = self.samples(group)
            lo, hi = (start - first) * rows, (start - first + n) * rows
            self.group_grad_views[g][index][0] = Factors(a[lo * J:hi * J].reshape(-1, J),
                                                         b[lo * L:hi * L].reshape(-1, L))
        starts = np.array([(f - first) * rows for f, _ in self.own] + [M], np.int64)
        return FactoredGrad(blob.offset, J, L, a, b, starts)

    # -- a run ---------------------------------------------------------------------------
    def run(self, batch, iteration, seed, first=None, pass_plan=None):
        """One forward (and backward) of the batch: source blob id -> array of this process's
        samples of the batch (self.rows: the whole batch on one machine). Returns ({output name: value}, loss,
        gradient or None): values and loss summed over every chunk of the batch in chunk
        order; the gradient is the reduction's result (the batch's sum where final_sums, else
        this process's part of it, which the communicator's exchange completes).
        first: the caller's own work during the run (Pool.run's). pass_plan: handed with each
        Sum task's columns to the updater (hand_sums_to), where final_sums; None: nothing is.
        A batch given to stage() during the run before is read where stage() copied it."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] is batch:
            slot = staged[1]
        else:
            slot = self._copy_in(batch)
        self._slot = slot
        if pass_plan is not None and self.updater is None:
            raise ValueError("Engine.run: a pass_plan needs hand_sums_to first")
        # The counters restart once no exchange of an earlier run reads them any more.
        self.comm.settle()
        self.reset()
        self.comm.start(self)
        if self.tasks:
            self.pool.run(self._tasks, len(self.tasks), iteration, seed, slot, pass_plan,
                          first=first)
        elif first is not None:
            first()
        self.comm.gather(self.shares, self.parts)
        # Shares add up in chunk order, in the dtype of the blobs they came from.
        totals = self._totals
        self._shares[...] = self.shares
        sum_rows(self._shares, totals)
        values = {name: float(v) for (_, name), v in zip(self.tracked, totals)}
        loss = float(sum(weight * totals[j] for j, weight in self._losses))
        grad = self.reduction.result if self.backward else None
        return values, loss, grad

    def reset(self):
        """Zeroes the counters by which a run's tasks (and a communicator) follow each other."""
        if self.backward:
            self.progress[:] = 0
            self.reduction.done[:] = 0
        if self.syncs:
            self.reached[:] = 0
            self.synced[:] = 0
            self.gathered[:] = 0

    def stage(self, batch):
        """Copies the batch of the next run() into the inputs that the run in progress, if
        any, does not read: the caller's work during a run (Pool.run's `first`), where it
        costs the step nothing, instead of at the start of the next run, where every worker
        waits for it. run(batch) then reads them."""
        self._staged = (batch, self._copy_in(batch))

    def _copy_in(self, batch):
        """Copies batch (this process's samples: self.rows of the batch) into the set of
        inputs that the latest run did not read; returns it. Where other processes compute
        the other samples, the blobs read batch-wide are completed with theirs (a collective
        of the communicator's: every process stages and runs alike)."""
        slot = 1 - self._slot
        for b, a in batch.items():
            self.inputs[slot][b][...] = a   # cast to the run's dtype as it is copied
        if len(self.parts) > 1:
            for b, whole in self._batch[slot].items():
                whole[self.rows.start:self.rows.stop] = self.inputs[slot][b]
                self.comm.gather(whole, self.sample_parts)
        return slot

    def _samples_of(self, chunks):
        """The samples of a range of chunks, as a range of the batch."""
        first = self.bounds[chunks.start][0] if chunks.start < len(self.bounds) else \
            self.net.batch_size
        return range(first, first + sum(n for _, n in self.bounds[chunks.start:chunks.stop]))

    def _task(self, worker, i, iteration, seed, slot, pass_plan):
        """Task i of a run, as the list says; slot: the set of inputs the calls read."""
        task = self.tasks[i]
        kind = type(task)
        if kind is Call:
            self._call(worker, task, iteration, seed, slot)
        elif kind is Sum:
            self._sum(worker, task, pass_plan)
        else:
            self._sync(task.index)

    def _call(self, worker, task, iteration, seed, slot):
        """Forward (and backward) of group g's samples, writing the group's loss shares and
        chunk gradients, and counting each entry done in progress: in the worker's workspace,
        or where the net sums over the batch, segment s of them in the group's own, once the
        sum before it is made (Sync)."""
        net, g, s = self.net, task.group, task.segment
        c0, c1 = self.groups[g]
        chunk = call_chunk(self.own[c0:c1], batch=net.batch_size, iteration=iteration,
                           seed=seed, batch_tops=self._batch_tops[slot])
        bound = self._bound[worker].get((g, slot))
        if bound is None:
            ws = self.workspaces[g if self.syncs else worker]
            bound = self._bound[worker][g, slot] = net.bind(
                ws, chunk, net.call_views(ws, chunk, self.inputs[slot], self.rows.start),
                self.params, self.group_grad_views[g] if self.backward else None,
                scratch=ws.with_work(self.work[worker]) if self.syncs else None)
        if s:
            self._wait(self.synced, s - 1, s, 1)
        forward = self.forward_segments
        if s <= forward:
            bound.forward(chunk, segment=s if self.syncs else None)
        if s == forward:   # forward is done: the loss shares are written, backward begins
            k0 = self.owned.start
            for j, (blob, _) in enumerate(self.tracked):
                self.shares[k0 + c0:k0 + c1, j] = bound.data[blob][:c1 - c0]
        if self.backward and s >= forward:
            if s == forward:
                grads = self.chunk_grads[c0:c1]
                for lo, hi in net.zero_ranges:  # layers that set their gradients need no zeros
                    grads[:, lo:hi] = 0
            bound.backward(chunk, progress=self.progress,
                           segment=s - forward if self.syncs else None)
        if s < len(self.syncs):
            spin.fetch_add(self.reached, s, 1)

    def _sync(self, s):
        """Sum s over the whole batch, once every call has reached it (and, across processes,
        the communicator has brought the others' shares): the chunks' shares added in the
        fixed tree, finished by the layer (Layer.sync)."""
        self._wait(self.reached, s, s + 1, len(self.groups))
        if len(self.parts) > 1:
            self._wait(self.gathered, s, s + 1, 1)
        i, k = self.syncs[s]
        shares, total = self.sums[i][k]
        sum_over_chunks(shares, total)
        self.net.entries[i].layer.sync(k, [t for _, t in self.sums[i]], self.params[i])
        spin.fetch_add(self.synced, s, 1)

    def _sum(self, worker, task, pass_plan):
        """A Sum task: waits until every call is past the first entry that writes its columns
        (each call runs on a worker that waits for nothing, unless the run has failed: then
        check_run raises), sums them, and hands them to the updater where the sum is final."""
        self._wait(self.progress, task.after, task.after + 1, len(self.groups))
        lo, hi = self.reduction.spans[task.task]
        hand_on = pass_plan is not None and self.comm.final_in_task
        if hand_on:
            # Only now: a call still reading these parameters would lose its lines to it.
            self.updater.prefetch(lo, hi, pass_plan)
        self.reduction.task(worker, task.task)
        spin.fetch_add(self.reduction.done, task.task, 1)   # for a communicator that watches
        if hand_on:
            self.updater.columns(lo, hi, pass_plan)

    def _wait(self, counters, lo, hi, target):
        """Waits, within a run, until counters[lo:hi] have each reached target, other tasks'
        progress; raises RunCancelled (Pool.check_run) once a task of the run has failed."""
        while spin.wait_for_all(counters, lo, hi, target, self._wait_spins) < target:
            self.pool.check_run()
            if not self._wait_spins:
                time.sleep(WAIT_CHECK_SECONDS)   # the CPU is needed by the task awaited

    # -- how the reduction's tasks are cut and ordered -------------------------------------
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
        net = self.net
        return next(e for e, entry in enumerate(net.entries)
                    if any(net.param_blobs[p].offset < hi
                           and lo < net.param_blobs[p].offset + net.param_blobs[p].size
                           for p in entry.params))
