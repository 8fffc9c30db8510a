"""The coarse-grain batch-parallel engine: one iteration of a Net over a fixed set of
chunks on a pool of threads.

The batch is cut into `chunks` pieces by batch size and chunk count alone. Each chunk
runs forward and backward single-threaded through nogil Numba kernels and writes its
own private gradient buffer (or, for weights whose gradient is a product of two per-row
matrices, those factors); the communicator then sums the chunks in a fixed order.
Which thread runs which chunk never matters, so results are bitwise the same for any
thread count. The engine knows nothing about solvers.
"""
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cgp.comm import FactoredGrad
from cgp.errors import CgpError
from cgp.kernels.reduce import OUTER_PAD
from cgp.layers import Chunk, Factors
from cgp.net import Workspace


def chunk_bounds(batch, chunks):
    """[(first, n), ...]: `chunks` near-equal contiguous pieces of a batch (fewer if the
    batch is smaller). The larger pieces come first."""
    chunks = max(1, min(chunks, batch))
    cuts = [c * batch // chunks for c in range(chunks + 1)]
    return [(lo, hi - lo) for lo, hi in zip(cuts, cuts[1:])]


class Pool:
    """`threads` workers that share a list of tasks; task i runs as fn(worker, i).
    With one thread everything runs inline in the caller: plain sequential execution.
    affinity: pin worker k to the k-th CPU this process may use (Linux), so the OS
    does not migrate workers between cores; results never depend on it. A single
    thread runs in the caller, which is left unpinned (pinning it would also pin every
    thread it starts later)."""

    def __init__(self, threads, affinity=False):
        if threads < 1:
            raise CgpError(f"--threads must be at least 1, got {threads}")
        self.threads = threads
        self.pinned = []
        cpus = sorted(os.sched_getaffinity(0)) if affinity and hasattr(os, "sched_getaffinity") else []
        if affinity and not cpus:
            raise CgpError("--affinity needs an OS that lets threads be pinned (Linux)")
        if threads == 1:
            self._executor = None
            return
        slots = itertools.count()

        def pin_worker():
            if cpus:
                self._pin(cpus[next(slots) % len(cpus)])

        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="cgp", initializer=pin_worker)

    def _pin(self, cpu):
        os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread only
        self.pinned.append(cpu)

    def run(self, fn, tasks):
        if self._executor is None or tasks == 1:
            for i in range(tasks):
                fn(0, i)
            return
        counter = itertools.count()
        lock = threading.Lock()

        def worker(w):
            while True:
                with lock:
                    i = next(counter)
                if i >= tasks:
                    return
                fn(w, i)

        futures = [self._executor.submit(worker, w) for w in range(min(self.threads, tasks))]
        for f in futures:
            f.result()  # re-raises a worker's exception here

    def close(self):
        if self._executor is not None:
            self._executor.shutdown()


class Engine:
    """Runs forward (and backward) of one net over the chunks of each batch."""

    def __init__(self, net, chunks, pool, comm, backward=True, params=None, factor=True):
        """params: the flat parameter array to run with (default net.params); a float64
        copy runs the same kernels in float64 (the equivalence harness's reference).
        factor: let layers that can (see Layer.can_factor_param_diff) hand their weight
        gradient over as factors, which the communicator multiplies out while it sums the
        chunks; the same bits either way, with far less memory traffic."""
        self.net, self.pool, self.comm = net, pool, comm
        self.bounds = chunk_bounds(net.batch_size, chunks)
        n_max = max(n for _, n in self.bounds)
        flat = net.params if params is None else params
        self.dtype = flat.dtype
        self.workspaces = [Workspace(net, n_max, with_diff=backward, dtype=self.dtype)
                           for _ in range(pool.threads)]
        self.params = net.param_views(flat)
        self.backward = backward
        self.factored = []
        if backward:
            self.chunk_grads = np.zeros((len(self.bounds), net.n_params), self.dtype)
            self.chunk_grad_views = [net.param_views(g) for g in self.chunk_grads]
            if factor:
                for index in net.factorable:
                    self.factored.append(self._factor(index))
        # The batch values reported: loss tops and unread scalar outputs (accuracy, ...).
        tracked = dict(net.scalar_outputs())
        for blob in net.loss_weights:
            tracked.setdefault(blob, net.blob_names[blob])
        self.tracked = list(tracked.items())
        self.shares = np.zeros((len(self.bounds), len(self.tracked)), np.float64)
        self.source_names = {t: name for e in net.sources for name, t in zip(e.layer.lp.top, e.tops)}

    def _factor(self, index):
        """Batch-wide buffers for the factors of entry `index`'s weight gradient; each chunk's
        gradient view of that weight becomes a Factors over the chunk's rows of them."""
        entry = self.net.entries[index]
        rows, J, L = entry.layer.factor_shape()
        blob = self.net.param_blobs[entry.params[0]]
        M = self.net.batch_size * rows
        # Register tiles read up to OUTER_PAD elements past the last row.
        a = np.zeros(M * J + OUTER_PAD, self.dtype)
        b = np.zeros(M * L + OUTER_PAD, self.dtype)
        for c, (first, n) in enumerate(self.bounds):
            lo, hi = first * rows, (first + n) * rows
            self.chunk_grad_views[c][index][0] = Factors(a[lo * J:hi * J].reshape(-1, J),
                                                         b[lo * L:hi * L].reshape(-1, L))
        starts = np.array([first * rows for first, _ in self.bounds] + [M], np.int64)
        return FactoredGrad(blob.offset, J, L, a, b, starts)

    def run(self, batch, iteration, seed):
        """batch: source blob id -> whole-batch array. Returns ({output name: value},
        loss, gradient or None). The gradient is the fixed-order sum over chunks."""
        net = self.net
        batch = {b: a.astype(self.dtype, copy=False) for b, a in batch.items()}
        by_name = {self.source_names[b]: a for b, a in batch.items()}

        def work(worker, c):
            first, n = self.bounds[c]
            chunk = Chunk(n=n, first=first, batch=net.batch_size, iteration=iteration,
                          seed=seed, batch_tops=by_name)
            ws = self.workspaces[worker]
            data = net.forward(ws, chunk, batch, self.params)
            for j, (blob, _) in enumerate(self.tracked):
                self.shares[c, j] = data[blob]
            if self.backward:
                grads = self.chunk_grads[c]
                for lo, hi in net.zero_ranges:  # layers that set their gradients need no zeros
                    grads[lo:hi] = 0
                net.backward(ws, chunk, data, self.params, self.chunk_grad_views[c])

        self.pool.run(work, len(self.bounds))
        # Shares add up in chunk order, in the dtype of the blobs they came from.
        totals = np.zeros(len(self.tracked), self.dtype)
        for row in self.shares:
            totals += row.astype(self.dtype)
        values = {name: float(v) for (_, name), v in zip(self.tracked, totals)}
        loss = float(sum(self.dtype.type(net.loss_weights[blob]) * totals[j]
                         for j, (blob, _) in enumerate(self.tracked) if blob in net.loss_weights))
        grad = self.comm.reduce(self.chunk_grads, self.factored) if self.backward else None
        return values, loss, grad
