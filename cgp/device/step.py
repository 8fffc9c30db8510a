"""The training step on the device: cgp.step.DataParallelStep's iteration where the batch's
gradient, the solver's update and the weights stay on the device between steps.

One iteration (DeviceStep.__call__): iter_size runs of the engine (each chunk's gradient in
its row on the device, the rows added there in the fixed tree over chunk index:
cgp.device.engine.tree_sum), the passes added up on the device in pass order, the Step made
on the host (cgp.solver: the rate; with clip_gradients the gradient's norm, for which the
gradient is copied out), and the update on the device (cgp.device.update: the CPU kernels'
arithmetic, operation by operation). What crosses to the host per step: each chunk's loss
share (a scalar, which the display and the divergence check read) and one flag that every
weight is finite. The weights and the solver's histories are copied to the host only by
to_host (the Trainer's, when its steps() returns: before a test, a snapshot, the display of
the end), and back before the next step, so an edit made on the host in between (a restored
snapshot, pycaffe) is taken.

Chosen by cgp.device.make_step, once: one rank (the exchange across ranks stays the host's,
cgp.comm), no staleness, no layer-wise rates. The weights are bitwise those of
DataParallelStep: the same tree, elementwise additions, the same update arithmetic.
"""
import math

import numpy as np

from cgp.comm.local import BLOCK, blocks
from cgp.device.update import DeviceUpdate
from cgp.runtime.update import all_finite
from cgp.step import Diverged


class DeviceStep:
    """One training iteration on a resident device engine (DeviceEngine.keep_on_device)."""

    staleness = 0

    def __init__(self, engine, solver, comm, iter_size=1):
        engine.keep_on_device()
        self.engine, self.solver, self.comm, self.iter_size = engine, solver, comm, iter_size
        self.backend = backend = engine.backend
        self.update = DeviceUpdate(solver, backend.xp)
        n = engine.net.n_params
        self.accum = backend.xp.zeros(n, engine.dtype) if iter_size > 1 else None
        # The step taken (Caffe's diffs after an update), on the host after to_host (pycaffe).
        self.gradient = np.zeros(n, engine.dtype)
        self._taken = None
        self.loaded = False   # whether the device holds the weights and histories to use

    @property
    def updater(self):
        """What pycaffe reads the step taken from (DataParallelStep's Updater.gradient)."""
        return self

    def __call__(self, it, batches, seed, first=None):
        """As DataParallelStep.__call__: (loss averaged over the passes, the last pass's
        outputs, the learning rate)."""
        if not self.loaded:
            self._to_device()
        solver, engine, size = self.solver, self.engine, self.iter_size
        step = None if solver.needs_norm else solver.prepare(it)
        loss = 0.0
        for k in range(size):
            last = k == size - 1
            batch, data_iteration = batches(k)
            outputs, pass_loss, grad = engine.run(batch, data_iteration, seed,
                                                  first if last else None)
            if not (math.isfinite(pass_loss) and all_finite(engine.shares)):
                self.to_host()   # the weights as they were before the step, for the diagnosis
                raise Diverged(it, k, pass_loss)
            loss += pass_loss
            if self.accum is not None:   # the sum over the passes, in pass order
                if k == 0:
                    self.accum[...] = grad
                else:
                    self.accum += grad
        gradient = grad if self.accum is None else self.accum
        if step is None:   # clip_gradients: the norm from the gradient, on the host
            host = self.backend.to_numpy(gradient)
            step = solver.prepare(it, solver.statistics(None, host, blocks(host.size)))
        params = engine.device_params
        if not self.update.apply(step, params, gradient):
            self.to_host()
            bad = int(np.flatnonzero(~(np.abs(engine.net.params) <= np.finfo(np.float32).max))[0])
            raise Diverged(it, column=bad // BLOCK * BLOCK)
        self._taken = gradient
        return loss / size, outputs, step.rate

    def _to_device(self):
        self.backend.copy_in(self.engine.device_params, self.engine.host_params)
        self.update.to_device()
        self.loaded = True

    def to_host(self):
        """The weights, the solver's histories and the last step taken, copied to the host;
        the next step copies the host's back first."""
        if not self.loaded:
            return
        backend = self.backend
        backend.copy_out(self.engine.host_params, self.engine.device_params)
        self.update.to_host(backend.to_numpy)
        if self._taken is not None:
            backend.copy_out(self.gradient, self._taken)
        self.loaded = False

    def pending(self, it):
        """No staleness: no gradient is made and not applied."""
        return []
