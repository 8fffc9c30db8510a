"""The data-parallel training step: the solver's update wrapped around the engine and the
communicator, as ChainerMN's multi-node optimizer wraps a local one. The solver never sees
chunks, workers or ranks.

One step has one shape (DataParallelStep.__call__ reads in this order):
  iter_size passes of the engine: its chunks' forward and backward, and the fixed-order sums
    of the chunks this process owns (cgp.engine, cgp.comm.local);
  the communicator's exchange: nothing on one machine; across ranks, the rest of the same
    tree (the point between "local sums done" and "update");
  the solver's update of the blocks of parameters this process updates;
  the new parameters shared (nothing on one machine).

With staleness S (deterministic staleness, --staleness), the update of iteration t applies the
gradient made at iteration t - S (the first S iterations update nothing): a fixed delay, so
the weights are still bitwise the same for any workers and ranks at a given S.

What is done with a pass's summed columns (added to the passes before, kept for a later
update, the update itself) is one typed hand-off, a PassPlan, which the Updater carries out
on any columns. Where it runs is chosen once, in DataParallelStep.__init__: where each of the
engine's reduction tasks leaves the batch's sum (one process), the engine hands the task's
columns to the Updater in that task, while they are still in the cache of the core that
summed them; the update too where the Step needs no gradient (no clip_gradients): the
workers done with their calls update while the slowest finishes, and a step hands over to
the workers once (`fused`). Otherwise each piece is a pool run of its own over the update
blocks, after the exchange. Every piece is elementwise over its columns, so both give the
same bits (a test compares them).
"""
import math
from dataclasses import dataclass

import numpy as np

from cgp.comm.local import update_blocks
from cgp.errors import CgpError
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.update import all_finite, claim
from cgp.solver import Step


class Diverged(Exception):
    """A step found a value that is not finite: the loss of pass `index` (forward; the
    weights were left as they were before the step), or, with `column`, a weight that the
    update made infinite or NaN (backward: its gradient was not finite)."""

    def __init__(self, iteration, index=0, loss=None, column=None):
        super().__init__(f"iteration {iteration}: not finite")
        self.iteration, self.index, self.loss, self.column = iteration, index, loss, column


@dataclass(frozen=True)
class PassPlan:
    """What the Updater does to columns of a pass's summed gradient, in this order. Worker
    processes receive it pickled with a run's arguments: plain fields alone."""

    pass_index: int = 0         # which of iter_size's passes: the first starts their sum
    accumulate: bool = False    # add the pass into the sum over the passes (iter_size > 1)
    stash_slot: int = None      # staleness: keep the gradient made in this slot
    step: tuple = None          # the update to make (Step.plain()); None: none
    apply_slot: int = None      # the gradient it applies: a stashed one's slot; None: this one


class Updater:
    """The elementwise work of a PassPlan on columns lo:hi of this process's gradient,
    parameters and solver histories: what the engine hands each reduction task's columns to
    (Engine.hand_sums_to), and the program of the step's own pool runs over its update
    blocks. Made before the pool starts: worker processes inherit it. What the workers found
    not finite goes to `found`: [0] the loss (an update in the reduction's tasks then skips its
    columns), [1] 1 + a column whose update made a weight infinite or NaN."""

    def __init__(self, engine, solver, blocks, iter_size, staleness):
        pool, net = engine.pool, engine.net
        self.solver, self.params, self.blocks = solver, net.params, blocks
        self.shares, self.result = engine.shares, engine.reduction.result
        shared = pool.shared_memory
        # The gradients made and not applied yet (staleness): iteration t's in slot t % (S + 1).
        self.slots = [aligned_zeros(net.n_params, net.params.dtype, shared)
                      for _ in range(staleness + 1)] if staleness else []
        # The sum over iter_size passes.
        self.accum = aligned_zeros(net.n_params, net.params.dtype, shared) if iter_size > 1 \
            else None
        self.gradient = self.accum if self.accum is not None else self.result
        self.found = aligned_zeros(2, np.int64, shared)
        # One worker has no other core to take the update's cache lines from.
        self.prefetches = pool.threads > 1
        # A run takes its Step in plain form (Step.plain), made a Step again once per run in
        # each process: the latest (plain, Step).
        self._made = ((), None)
        self.program = pool.program(self.block)

    def block(self, worker, i, plan):
        """The step's own pool run: update block i."""
        lo, hi = self.blocks[i]
        self.columns(lo, hi, plan)

    def prefetch(self, lo, hi, plan):
        """Before a reduction task sums columns lo:hi that it then updates: asks for the
        cache lines the update will write (cgp.runtime.update.claim), which every worker's
        calls have just read, so that taking them from the other cores overlaps the sum
        instead of stalling the update's stores."""
        if self.prefetches and plan.step is not None:
            for a in (self.params, *self.solver.histories):
                claim(a, lo, hi)

    def columns(self, lo, hi, plan):
        """Columns lo:hi of the pass's sum (self.result): added to the passes before, kept in
        a slot, and the update made, as the plan says."""
        if plan.accumulate:
            if plan.pass_index == 0:
                self.accum[lo:hi] = self.result[lo:hi]
            else:
                self.accum[lo:hi] += self.result[lo:hi]
        if plan.stash_slot is not None:
            self.slots[plan.stash_slot][lo:hi] = self.gradient[lo:hi]
        if plan.step is not None:
            made = self._made
            if made[0] is not plan.step:
                made = self._made = (plan.step, Step.of(plan.step))
            gradient = self.gradient if plan.apply_slot is None else self.slots[plan.apply_slot]
            # Every call's forward is done: the loss shares are all written.
            if not all_finite(self.shares):
                self.found[0] = 1   # the weights stay as they were, for the diagnosis
            elif not self.solver.apply(made[1], self.params, gradient, lo, hi):
                self.found[1] = lo + 1


class DataParallelStep:
    """One training iteration of a solver over an engine's chunks (see the module). A step
    whose loss or new weights are not finite raises Diverged: the loss is checked before any
    update of the step (in the reduction's tasks too), the weights by the update kernels as
    they write them, so the check reads nothing twice and a finite run's bits are as they
    were."""

    def __init__(self, engine, solver, comm, iter_size=1, staleness=0):
        """Before the pool starts: worker processes must inherit the Updater."""
        if staleness < 0 or (staleness and iter_size > 1):
            raise CgpError(f"--staleness {staleness}: a staleness of 0 or more, with iter_size "
                           f"1 (the solver's iter_size is {iter_size})")
        self.engine, self.solver, self.comm = engine, solver, comm
        self.pool, self.params = engine.pool, engine.net.params
        self.iter_size, self.staleness = iter_size, staleness
        # The fixed blocks the update runs in, and over which the clipping norm is added up.
        self.blocks = update_blocks(engine.net.n_params, comm.rank, comm.size)
        self.updater = Updater(engine, solver, self.blocks, iter_size, staleness)
        engine.hand_sums_to(self.updater)
        # Where the work on each pass's sums runs, chosen once (see the module): in the
        # reduction's tasks where their sums are the batch's, the update too where the Step
        # needs no gradient (fused); else in runs of the step's own after the exchange.
        self.in_sums = engine.final_sums
        self.fused = self.in_sums and not solver.needs_norm

    def __call__(self, it, batches, seed, first=None):
        """Iteration `it`: returns (loss averaged over the passes, the last pass's outputs, the
        learning rate). batches(k) -> (batch, iteration number of its data) for pass k;
        first: the caller's own work during the last pass's run (Pool.run's)."""
        S, size, found = self.staleness, self.iter_size, self.updater.found
        # Staleness: the slot this iteration's gradient goes to, and the one the update
        # applies (None before iteration S: no update).
        made = it % (S + 1) if S else None
        applied = (it - S) % (S + 1) if S and it >= S else None
        updates = it >= S
        step = self.solver.prepare(it) if self.fused and updates else None
        loss = 0.0
        found[:] = 0
        for k in range(size):
            last = k == size - 1
            batch, data_iteration = batches(k)
            # Chunks -> forward/backward -> this process's fixed-order sums (with the plan's
            # work on each task's columns, where those sums are the batch's).
            plan = self._pass_plan(k, made, applied, step if last else None)
            outputs, pass_loss, _ = self.engine.run(batch, data_iteration, seed,
                                                    first if last else None, plan)
            if found[0] or not math.isfinite(pass_loss):
                raise Diverged(it, k, pass_loss)
            loss += pass_loss
            # -> across ranks, the rest of the tree. With staleness this step's exchange is
            # awaited only after its update (of an older gradient) and the parameters'
            # all-gather, which it so overlaps.
            if not self.in_sums and not S:
                self.comm.exchange(self.engine.reduction)
                if size > 1:
                    self._run(PassPlan(k, accumulate=True))
        # -> the update, where the reduction's tasks have not made it.
        if step is None and updates:
            step = self._separate_update(it, applied)
        bad = self.comm.max(int(found[1]))   # any process's column
        if bad:
            raise Diverged(it, column=bad - 1)
        self.comm.share(self.params)
        if S and not self.in_sums:
            self.comm.exchange(self.engine.reduction)
            self._run(PassPlan(stash_slot=made))
        rate = step.rate if step is not None else self.solver.learning_rate(it)
        return loss / size, outputs, rate

    def _pass_plan(self, k, made, applied, step):
        """What the reduction's tasks of pass k do with their columns (step: the update to
        make there, or None); None where they hand nothing on: their sums are not the
        batch's, or there is nothing to do."""
        if not self.in_sums or not (self.iter_size > 1 or made is not None or step is not None):
            return None
        return PassPlan(k, self.iter_size > 1, made, None if step is None else step.plain(),
                        applied)

    def _separate_update(self, it, applied):
        """The update of this process's blocks as a run of its own, with the Step made from
        every process's statistics of the gradient (clip_gradients' norm), if it needs
        them; returns the Step."""
        gradient = self.updater.gradient if applied is None else self.updater.slots[applied]
        statistics = (self.comm.gather_values(
            self.solver.statistics(self.params, gradient, self.blocks))
            if self.solver.needs_norm else None)
        step = self.solver.prepare(it, statistics)
        self._run(PassPlan(step=step.plain(), apply_slot=applied))
        return step

    def _run(self, plan):
        """The plan's work on this process's update blocks, in a pool run."""
        self.pool.run(self.updater.program, len(self.blocks), plan)

    def to_host(self):
        """Nothing to copy: the weights are the host's (cgp.device.step.DeviceStep's differ)."""

    def pending(self, it):
        """[(iteration, its gradient made and not applied yet), ...] after iteration it - 1
        (what a snapshot at `it` must keep, with staleness)."""
        return [(j, self.updater.slots[j % (self.staleness + 1)])
                for j in range(max(0, it - self.staleness), it)]
