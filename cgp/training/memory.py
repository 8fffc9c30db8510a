"""The memory check before a training starts: what the run will need (gradients, solver
state, activations, test nets, forked workers, compiled kernels), as a line for the log,
and a CgpError naming the options to change when it would not fit. Estimates only; it
allocates nothing."""
import math

import numpy as np
import psutil

from cgp.engine import group_size
from cgp.errors import CgpError
from cgp.layers import scratch_specs

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


def measure(net, chunks, pool, histories, test_nets):
    """check_memory's line for a run about to start on this machine: the memory available
    now, and what this process holds now (its RSS)."""
    return check_memory(net, chunks, pool.threads, histories,
                        psutil.virtual_memory().available, pool.shared_memory,
                        now=psutil.Process().memory_info().rss, test_nets=test_nets)
