"""The data-parallel training step: the solver's update wrapped around the engine and the
communicator, as ChainerMN's multi-node optimizer wraps a local one. The solver never sees
chunks, workers or ranks.

One step has one shape:
  iter_size passes of the engine: its chunks' forward and backward, and the fixed-order sums
    of the chunks this process owns (cgp.engine, cgp.comm.local);
  the communicator's exchange: nothing on one machine; across ranks, the rest of the same
    tree (the point between "local sums done" and "update");
  the solver's update of the blocks of parameters this process updates;
  the new parameters shared (nothing on one machine).

With staleness S (deterministic staleness, --staleness), the update of iteration t applies the
gradient made at iteration t - S (the first S iterations update nothing): a fixed delay, so
the weights are still bitwise the same for any workers and ranks at a given S.

Where the sums are the batch's as soon as each reduction task has run (one process) and the
Step needs no gradient (no clip_gradients), the update of each task's columns runs inside
that task (Engine.on_sums), with iter_size's sum over passes: the workers done with their
calls update while the slowest finishes, with the summed gradient still in the cache of the
core that summed it, and a step hands over to the workers once. Otherwise the update is a pool
run of its own after the exchange. Every update is elementwise over its columns, so both give
the same bits (a test compares them).
"""
import math

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


class DataParallelStep:
    """One training iteration of a solver over an engine's chunks (see the module). A step
    whose loss or new weights are not finite raises Diverged: the loss is checked before any
    update of the step (in the reduction's tasks too), the weights by the update kernels as
    they write them, so the check reads nothing twice and a finite run's bits are as they
    were."""

    def __init__(self, engine, solver, comm, iter_size=1, staleness=0):
        """Before the pool starts: worker processes must inherit the update's functions."""
        self.engine, self.solver, self.comm = engine, solver, comm
        pool, net = engine.pool, engine.net
        self.pool, self.params = pool, net.params
        self.iter_size = iter_size
        if staleness < 0 or (staleness and iter_size > 1):
            raise CgpError(f"--staleness {staleness}: a staleness of 0 or more, with iter_size "
                           f"1 (the solver's iter_size is {iter_size})")
        # The gradients made and not applied yet (staleness): iteration t's in slot
        # t % (S + 1).
        self.staleness = staleness
        self.slots = [aligned_zeros(net.n_params, net.params.dtype, pool.shared_memory)
                      for _ in range(staleness + 1)] if staleness else []
        # The fixed blocks the update runs in, and over which the clipping norm is added up.
        self.blocks = update_blocks(net.n_params, comm.rank, comm.size)
        # The sum over iter_size passes (written by the reduction's tasks or the workers).
        self.accum = (aligned_zeros(net.n_params, net.params.dtype, pool.shared_memory)
                      if iter_size > 1 else None)
        self.gradient = self.accum if self.accum is not None else engine.reduction.result
        self.fused = engine.final_sums and not solver.needs_norm
        # One worker has no other core to take the update's cache lines from.
        engine.on_sums(self._columns, self._claim if pool.threads > 1 else None)
        self._update = pool.program(self._update_block)
        self._accumulate = pool.program(self._accumulate_block)
        self._stash = pool.program(self._stash_block)
        # What the workers found not finite: [0] the loss (a fused update then skips its
        # columns), [1] 1 + a column whose update made a weight infinite or NaN.
        self.found = aligned_zeros(2, np.int64, pool.shared_memory)
        # A run takes its Step in plain form (Step.plain), made a Step again once per run in
        # each process: the latest (plain, Step).
        self._made = ((), None)

    def __call__(self, it, batches, seed, first=None):
        """Iteration `it`: returns (loss averaged over the passes, the last pass's outputs, the
        learning rate). batches(k) -> (batch, iteration number of its data) for pass k;
        first: the caller's own work during the last pass's run (Pool.run's)."""
        S = self.staleness
        made, applied = (it % (S + 1), (it - S) % (S + 1) if it >= S else None) if S \
            else (None, -1)
        updates = applied is not None
        step = self.solver.prepare(it) if self.fused and updates else None
        loss, size = 0.0, self.iter_size
        self.found[:] = 0
        for k in range(size):
            last = k == size - 1
            batch, data_iteration = batches(k)
            fused = step.plain() if step is not None and last else None
            arg = ((k, fused, made, applied) if self.accum is not None or fused is not None
                   or (S and self.fused) else None)
            outputs, pass_loss, _ = self.engine.run(batch, data_iteration, seed,
                                                    first if last else None, arg)
            if self.found[0] or not math.isfinite(pass_loss):
                raise Diverged(it, k, pass_loss)
            loss += pass_loss
            # With staleness this step's exchange is awaited only after its update (of an
            # older gradient) and the parameters' all-gather, which it so overlaps.
            if not self.engine.final_sums and not S:
                self.comm.exchange(self.engine.reduction)
                if self.accum is not None:
                    self.pool.run(self._accumulate, len(self.blocks), k)
        if step is None and updates:
            gradient = self.slots[applied] if S else self.gradient
            statistics = (self.comm.gather_values(
                self.solver.statistics(self.params, gradient, self.blocks))
                if self.solver.needs_norm else None)
            step = self.solver.prepare(it, statistics)
            self.pool.run(self._update, len(self.blocks), step.plain(), applied)
        bad = self.comm.max(int(self.found[1]))   # any process's column
        if bad:
            raise Diverged(it, column=bad - 1)
        self.comm.share(self.params)
        if S and not self.fused:
            if not self.engine.final_sums:
                self.comm.exchange(self.engine.reduction)
            self.pool.run(self._stash, len(self.blocks), made)
        rate = step.rate if step is not None else self.solver.learning_rate(it)
        return loss / size, outputs, rate

    def pending(self, it):
        """[(iteration, its gradient made and not applied yet), ...] after iteration it - 1
        (what a snapshot at `it` must keep, with staleness)."""
        return [(j, self.slots[j % (self.staleness + 1)])
                for j in range(max(0, it - self.staleness), it)]

    # -- what workers run ----------------------------------------------------------------
    def _step_of(self, plain):
        made = self._made
        if made[0] is not plain:
            made = self._made = (plain, Step.of(plain))
        return made[1]

    def _columns(self, worker, lo, hi, arg):
        """Columns lo:hi of the batch's sum of pass k, in the reduction task that made them:
        added to the passes before, kept in slot `made` (staleness), and with the Step
        `fused` updated, from the gradient of slot `applied` (-1: this one)."""
        k, fused, made, applied = arg
        if self.accum is not None:
            self._add_pass(k, lo, hi)
        if made is not None:
            self.slots[made][lo:hi] = self.gradient[lo:hi]
        if fused is not None:
            gradient = self.gradient if applied < 0 else self.slots[applied]
            # Every call's forward is done: the loss shares are all written.
            if not all_finite(self.engine.shares):
                self.found[0] = 1   # the weights stay as they were, for the diagnosis
            elif not self.solver.apply(self._step_of(fused), self.params, gradient, lo, hi):
                self.found[1] = lo + 1

    def _claim(self, lo, hi, arg):
        """Asks for the cache lines that the fused update will write (cgp.runtime.update.claim),
        which every worker's calls have just read: taking them from the other cores then
        overlaps the sum instead of stalling the update's stores."""
        if arg[1] is not None:
            for a in (self.params, *self.solver.histories):
                claim(a, lo, hi)

    def _add_pass(self, k, lo, hi):
        grad = self.engine.reduction.result
        if k == 0:
            self.accum[lo:hi] = grad[lo:hi]
        else:
            self.accum[lo:hi] += grad[lo:hi]

    def _accumulate_block(self, worker, i, k):
        self._add_pass(k, *self.blocks[i])

    def _stash_block(self, worker, i, made):
        lo, hi = self.blocks[i]
        self.slots[made][lo:hi] = self.gradient[lo:hi]

    def _update_block(self, worker, i, plain, applied):
        lo, hi = self.blocks[i]
        gradient = self.gradient if applied < 0 else self.slots[applied]
        if not self.solver.apply(self._step_of(plain), self.params, gradient, lo, hi):
            self.found[1] = lo + 1
