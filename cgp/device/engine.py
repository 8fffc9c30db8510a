"""The device engine: cgp.engine's run, with each call's layers run by the device ops
(cgp.device.ops) on one chunk's arrays on the device instead of by Numba kernels on a worker.

Everything around the calls is the CPU engine's own code: the task list, the sums over the
batch (BatchNorm: each chunk's share comes back to the host, the Sync task adds them in the
fixed tree and the layer finishes them, the totals go back to the device), the chunks'
gradients summed in the communicator's fixed tree over chunk index (on one machine, or with
the other ranks', each rank driving its own GPU), the solver's update of the host's weights,
which the next run copies to the device. Or, made resident by cgp.device.step.DeviceStep
(keep_on_device, one rank): the chunks' gradients stay on the device, summed there in the
same tree (tree_sum), and the weights are the step's, on the device. So the weights are
bitwise the same for any number of ranks (devices) of one kind, and the CPU and GPU engines
differ only by the rounding of their layers' arithmetic.

One call is one chunk (group 1), on arrays of exactly that chunk's shape (see ops), and one
worker drives the device: its tasks run in the list's order.
"""
import numpy as np

from cgp.device.ops import make_op, unsupported
from cgp.engine import Engine, Sum
from cgp.errors import CgpError, NetError
from cgp.layers import Chunk
from cgp.runtime import spin


class DeviceWorkspace:
    """The device buffers of calls of up to n samples: data and diff of every blob (a batch
    value, a loss, as a 0-d array), the chunk's parameter gradient, each layer's op (which
    keeps what its backward reads) and its shares of the sums over the batch."""

    def __init__(self, engine, n):
        net, xp, dtype = engine.net, engine.backend.xp, engine.dtype

        def alloc(blob):
            shape = net.blob_shapes[blob]
            return xp.zeros(() if blob in net.batch_values else (n,) + shape[1:], dtype)

        blobs = range(len(net.blob_names))
        self.data = [alloc(b) for b in blobs]
        self.diff = [alloc(b) for b in blobs] if engine.backward else None
        self.grad = xp.zeros(net.n_params, dtype) if engine.backward else None
        self.grad_views = net.param_views(self.grad) if engine.backward else None
        self.ops = [make_op(e.layer, engine.backend.xp) for e in net.entries]
        # Each op's scratch, as a layer's: "sums", its shares (one row: one chunk per call)
        # and the batch's totals, where it sums over the batch.
        self.scratch = [{"sums": [(xp.zeros((1, m), np.float64), total) for m, total in
                                  zip(e.layer.sum_sizes(), engine.device_totals[i])]}
                        if i in engine.device_totals else {}
                        for i, e in enumerate(net.entries)]
        # The ops' forwards and backwards paused at a SYNC, by entry (the generators that
        # the next segment resumes).
        self.paused = {}
        self._batch_values = net.batch_values

    def views(self, arrays, n):
        return [a if b in self._batch_values else a[:n] for b, a in enumerate(arrays)]


class DeviceEngine(Engine):
    """cgp.engine.Engine on a backend (cgp.device.ArrayBackend)."""

    def __init__(self, net, chunks, pool, comm, backend, backward=True, params=None):
        """As Engine's (params: a float64 copy runs the ops in float64), on `backend`."""
        missing = unsupported(net)
        if missing:
            raise NetError(f"--device {backend.name} cannot run layer(s) " + "; ".join(
                f"'{name}' ({kind}: {why})" for name, kind, why in missing)
                + ": run this net with --device cpu")
        if pool.threads != 1 or pool.shared_memory:
            raise CgpError(f"--device {backend.name}: one worker drives the device; run more "
                           f"ranks (one device each), not more --threads")
        self.backend = backend
        xp = backend.xp
        # The batch's totals of each sum over the batch, on the device (every chunk reads
        # them): set before the workspaces, which read them.
        self.device_totals = {i: [xp.zeros(m, np.float64) for m in e.layer.sum_sizes()]
                              for i, e in enumerate(net.entries)
                              if any(e.layer.batch_sums)}
        super().__init__(net, chunks, pool, comm, backward=backward, params=params,
                         factor=False, group=1)
        self.host_params = net.params if params is None else params
        self.device_params = xp.zeros(net.n_params, self.dtype)
        self.device_param_views = net.param_views(self.device_params)
        self.forward_plan, syncs = _stages(net, False)
        backward_plan, back_syncs = _stages(net, True)
        self.backward_plan = backward_plan if backward else []
        if syncs != net.forward_syncs or (backward and back_syncs != net.backward_syncs):
            raise AssertionError("the device ops' stages do not match the layers' batch sums")
        # Whether the step keeps the gradient and the weights on the device (keep_on_device).
        self.resident = False

    def keep_on_device(self):
        """For cgp.device.step.DeviceStep, before the pool starts: each chunk's gradient
        stays in its row of device_chunk_grads, run() adds the rows on the device in the one
        tree over chunk index and returns that sum (a device array), and the weights on the
        device are the step's to keep (run() no longer copies the host's in). Only where
        this process computes every chunk (one rank): the communicator's Sum tasks, which
        would sum host rows, are dropped."""
        if self.comm.size != 1 or not self.backward:
            raise ValueError("keep_on_device: one rank's training engine only")
        xp, net = self.backend.xp, self.net
        self.resident = True
        self.tasks = [task for task in self.tasks if type(task) is not Sum]
        self.device_chunk_grads = xp.zeros((len(self.own), net.n_params), self.dtype)
        self.device_grad_views = [net.param_views(row) for row in self.device_chunk_grads]
        for ws in self.workspaces:   # their own gradient rows are not written any more
            ws.grad = ws.grad_views = None

    def new_workspace(self, group=None, shared=False):
        return DeviceWorkspace(self, max(n for _, n in self.own))

    def run(self, batch, iteration, seed, first=None, pass_plan=None):
        if not self.resident:   # the weights the host's solver left, for this run's calls
            self.backend.copy_in(self.device_params, self.host_params)
        values, loss, grad = super().run(batch, iteration, seed, first, pass_plan)
        if self.resident:
            grad = tree_sum(self.device_chunk_grads)
        return values, loss, grad

    def _call(self, worker, task, iteration, seed, slot):
        """Segment `task.segment` of the forward and backward of one chunk on the device,
        as Engine._call does it on a worker; each segment that ends at a sum over the batch
        sends the chunk's share back, and the last the chunk's gradient."""
        net, g, s = self.net, task.group, task.segment
        c0, _ = self.groups[g]
        first, n = self.own[c0]
        k0 = self.owned.start
        chunk = Chunk(n=n, first=first, batch=net.batch_size, iteration=iteration, seed=seed,
                      batch_tops=self._batch_tops[slot])
        ws = self.workspaces[g if self.syncs else worker]
        data = ws.views(ws.data, n)
        diff = ws.views(ws.diff, n) if self.backward else None
        if s:
            self._wait(self.synced, s - 1, s, 1)
        forward = self.forward_segments
        if s == 0:
            at = first - self.rows.start
            for t in net.source_names:
                self.backend.copy_in(data[t], self.inputs[slot][t][at:at + n])
        if s <= forward:
            for i, stage in self.forward_plan[s]:
                e = net.entries[i]
                if stage == 0:
                    ws.paused[i] = ws.ops[i].forward(
                        [data[b] for b in e.bottoms], [data[t] for t in e.tops],
                        self.device_param_views[i], ws.scratch[i], chunk)
                _resume(ws.paused, i)
        if s == forward:   # the loss shares are made, backward begins
            for j, (blob, _) in enumerate(self.tracked):
                self.shares[k0 + c0, j] = float(data[blob])
        if self.backward and s >= forward:
            b = s - forward
            grad, grad_views = ((self.device_chunk_grads[c0], self.device_grad_views[c0])
                                if self.resident else (ws.grad, ws.grad_views))
            if b == 0:
                grad[...] = 0
                for blob, weight in net.loss_weights.items():
                    diff[blob][...] = weight
            for i, stage in self.backward_plan[b]:
                e = net.entries[i]
                if stage == 0:
                    ws.paused[i] = ws.ops[i].backward(
                        [data[t] for t in e.tops], [diff[t] for t in e.tops],
                        [data[x] for x in e.bottoms],
                        [diff[x] if f else None for x, f in zip(e.bottoms, e.propagate)],
                        self.device_param_views[i], grad_views[i], ws.scratch[i], chunk)
                _resume(ws.paused, i)
            if b == len(self.backward_plan) - 1:
                if not self.resident:
                    self.backend.copy_out(self.chunk_grads[c0], ws.grad)
                self.progress += 1   # one worker: every entry of this chunk is done
        if s < len(self.syncs):
            i, k = self.syncs[s]
            self.backend.copy_out(self.sums[i][k][0][k0 + c0], ws.scratch[i]["sums"][k][0][0])
            spin.fetch_add(self.reached, s, 1)

    def _sync(self, s):
        """Engine's sum over the batch, then its totals to the device (before the calls of the
        next segment, which the one worker runs after this task). Where the weights live on
        the device (resident), the layer's blobs, which its sync() may update (BatchNorm's
        moving averages), go to the host for it and back."""
        i, _ = self.syncs[s]
        blobs = list(zip(self.params[i], self.device_param_views[i])) if self.resident else []
        for host, device in blobs:
            self.backend.copy_out(host, device)
        super()._sync(s)
        for host, device in blobs:
            self.backend.copy_in(device, host)
        for (_, total), device in zip(self.sums[i], self.device_totals[i]):
            self.backend.copy_in(device, total)


def tree_sum(bufs):
    """bufs: (K, n) rows, one per chunk, on the device -> bufs[0], their sum in the one tree
    over chunk index (cgp.runtime.reduce.tree_sum's: stride 1, 2, 4, ...; each addition
    elementwise, so the host's bits), one array addition per level. Rows other than the
    first are overwritten."""
    k, stride = bufs.shape[0], 1
    while stride < k:
        bufs[0:k - stride:2 * stride] += bufs[stride:k:2 * stride]
        stride *= 2
    return bufs[0]


def _resume(paused, i):
    """Runs op i's paused forward or backward on to its next SYNC, or to its end: an op
    without sums over the batch has made its whole call already (it returned None)."""
    calls = paused.get(i)
    if calls is not None and next(calls, None) is None:
        paused[i] = None


def _stages(net, backward):
    """The segments of the net's calls as [[(entry, stage), ...], ...], cut where a layer's
    calls meet a sum over the batch (its batch_sums: stage k runs after k sums), and those
    sums [(entry, the layer's sum index), ...] in the order the engine makes them: forward
    in entry order, backward in reverse (sums numbered after forward's)."""
    order = range(len(net.entries))
    if backward:
        order = [i for i in reversed(order) if net.entries[i].backward]
    segments, syncs = [[]], []
    for i in order:
        layer = net.entries[i].layer
        base = layer.batch_sums[0] if backward else 0
        for stage in range(layer.batch_sums[1 if backward else 0] + 1):
            if stage:
                segments.append([])
                syncs.append((i, base + stage - 1))
            segments[-1].append((i, stage))
    return segments, syncs
