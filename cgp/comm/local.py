"""Communicators: how the per-chunk gradients of one iteration become the batch's gradient.

The sum runs over chunk index in one fixed binary tree (stride 1, 2, 4, ...), so the result
depends on the number of chunks alone, never on how many workers, processes or ranks compute
them. A process computes a contiguous range of the K chunks (owned: all of them on one
machine) and its communicator sums them in that tree, column block by column block, as the
engine's backward passes finish each layer; a communicator across processes (MPI, later)
then completes the tree with the other ranks' partial sums before any update (exchange).
A chunk's gradient comes either as a row of a (chunks, parameters) buffer or, for a weight
whose gradient is a product A^T @ B (InnerProduct), as its factors: the product is then
formed inside the reduction, with the same bits, and never stored once per chunk.

The protocol that cgp.engine, cgp.step and cgp.train rely on is Communicator below: the
collectives over chunk rows alone; who computes which chunks and updates which columns is
planned by the free functions partition() and update_blocks(). cgp.comm.make_communicator()
picks the implementation: LocalCommunicator (the threads or worker processes of one machine)
or, under mpirun, cgp.comm.mpi.MPICommunicator; or, with --sharing async or hybrid,
cgp.comm.sharing.SharedCommunicator, whose groups of ranks compute iterations of their own
(their schedule is cgp.comm.sharing.Tickets, not a communicator's). The naive twin that tests
compare with is ReferenceCommunicator.
"""
from typing import NamedTuple, Protocol

import numpy as np

from cgp.runtime.memory import aligned_zeros
from cgp.runtime.reduce import TILE, outer_stack_size, outer_tree_sum, tree_sum

BLOCK = 1 << 15  # columns per task: large enough to amortise a call, small enough to balance
# Chunk-gradient elements a tree-sum task reads, about: LeNet's 16 chunks of conv2 (25,050
# columns) in one task took 67 µs at the end of a 2-worker run while the other worker had
# nothing left to take; in tasks of 8,192 columns they split between the workers that are free.
SUM_ELEMENTS = 1 << 17
# Rows of a factored gradient per task: a multiple of every register tile's height.
ROW_GRAIN = 24
# With one worker nothing needs balancing, and each task costs the interpreter's work of a
# task (about 10 µs in a LeNet step, its data out of the caches): tasks this many times as large.
# LeNet's step then has 6 reduction tasks in place of 29, and its sums and updates after the
# calls take 0.2 ms less (bench/README.md, "Outside the layers").
ALONE = 16


class FactoredGrad(NamedTuple):
    """A parameter gradient held as factors: chunk c's share is A_c^T @ B_c, over rows
    starts[c]:starts[c + 1] of A (M, J) and B (M, L), whose row-major elements lead the flat
    arrays a and b (see runtime.reduce.outer_tree_sum). It fills the (J, L) block of the
    flat gradient at offset."""
    offset: int
    J: int
    L: int
    a: np.ndarray
    b: np.ndarray
    starts: np.ndarray


def blocks(size, block=BLOCK):
    """A fixed cut of range(size) into (lo, hi) blocks; independent of the thread count."""
    return [(lo, min(lo + block, size)) for lo in range(0, size, block)]


def sum_block(chunks, scale=1):
    """Columns per tree-sum task over `chunks` rows: about scale * SUM_ELEMENTS elements,
    whole TILEs."""
    return max(TILE, scale * SUM_ELEMENTS // chunks // TILE * TILE)


def uncovered(size, factored):
    """The (lo, hi) ranges of range(size) that no factored gradient covers, in order."""
    ranges, lo = [], 0
    for f in sorted(factored, key=lambda f: f.offset):
        if f.offset > lo:
            ranges.append((lo, f.offset))
        lo = f.offset + f.J * f.L
    if lo < size:
        ranges.append((lo, size))
    return ranges


def split(ranges, cuts):
    """The (lo, hi) ranges, each cut at the columns of cuts that lie strictly inside it."""
    out = []
    for lo, hi in ranges:
        for c in sorted(c for c in set(cuts) if lo < c < hi):
            out.append((lo, c))
            lo = c
        out.append((lo, hi))
    return out


def subtrees(lo, hi, chunks):
    """Chunks lo..hi cut into whole subtrees of the tree over `chunks` chunks, in order, each
    as (first chunk, past its last). A node of that tree (tree_sum's stride-doubling tree)
    covers chunks [c, min(c + w, chunks)) where its width w, a power of two, divides c; each
    piece here is the widest node that starts where the last ended and fits. Summed alone, a
    piece gives the bits of that node of the whole tree; merge_pairs adds the pieces up the
    rest of the way."""
    nodes, c = [], lo
    while c < hi:
        width = 1
        while width < chunks and c % (2 * width) == 0 and min(c + 2 * width, chunks) <= hi:
            width *= 2
        nodes.append((c, min(c + width, chunks)))
        c = nodes[-1][1]
    return nodes


def merge_pairs(nodes, chunks):
    """The additions that finish the tree from whole subtrees covering all `chunks` chunks in
    order (`nodes`, as subtrees() gives them): (dst, src) indices into nodes, to be made in
    order, each `dst += src`, leaving the sum of every chunk in nodes[0]. Level by level, as
    tree_sum: a node of width w starting at c, a multiple of 2w, adds the node after it."""
    at = {c0: (i, c1) for i, (c0, c1) in enumerate(nodes)}   # first chunk -> (index, past)
    pairs, stride = [], 1
    while stride < chunks:
        for c in range(0, chunks - stride, 2 * stride):
            left = at.get(c)
            if left is not None and left[1] == c + stride:   # else inside a wider node
                right = at.pop(c + stride)
                pairs.append((left[0], right[0]))
                at[c] = (left[0], right[1])
        stride *= 2
    return pairs


def partition(chunks, size):
    """Every process's range of the `chunks` chunks of a batch, lo..hi, in process order: `size`
    contiguous, near-equal ranges (one process: all of them)."""
    return [range(r * chunks // size, (r + 1) * chunks // size) for r in range(size)]


def update_ranges(n, size):
    """Every process's blocks of n parameters, the fixed blocks(n) cut into `size` contiguous
    runs: the columns each process updates (and, across ranks, owns in the exchange)."""
    every = blocks(n)
    return [every[r * len(every) // size:(r + 1) * len(every) // size] for r in range(size)]


def update_blocks(n, rank, size):
    """The fixed blocks (lo, hi) of n parameters that process `rank` of `size` updates."""
    return update_ranges(n, size)[rank]


class Communicator(Protocol):
    """The collectives that the engine and the data-parallel step need, over the rows of
    chunk gradients. Processes (ranks) `0..size - 1` compute contiguous ranges of the K chunks,
    in order (partition(K, size)), and update contiguous runs of the parameters' blocks
    (update_blocks(n, rank, size)): the planning is those free functions, the same for every
    communicator. A run of the engine computes its chunks and runs plan()'s tasks, each once
    its columns are written; the step then calls exchange(), updates its blocks with the
    solver and share()s the result. Which iterations a process computes is not the
    communicator's business: cgp.comm.make_schedule."""

    rank: int             # this process's index among the `size` that share each batch
    size: int
    takes_factors: bool   # whether plan() takes FactoredGrad blocks
    final_in_task: bool   # whether a task's columns hold the batch's sum once it has run
    leader: bool          # whether this process writes snapshots and prints progress
    leader_group: bool    # whether this process takes part in the tests and snapshots
    reproducible: bool    # whether the weights are a function of the run's settings alone

    def plan(self, bufs, chunks, factored=(), cuts=()):
        """A Reduction: the fixed-order sum of bufs' rows (one per owned chunk of `chunks`)
        and of the factored blocks, cut into tasks once, each ending at the columns `cuts`
        too."""

    def settle(self):
        """Returns once nothing of an earlier run is in flight: the engine may then reset the
        counters that run's exchange was reading (Engine.run)."""

    def start(self, engine):
        """A run of the engine begins, its counters reset: a communicator across processes
        starts exchanging what the run makes as soon as it is made (the other processes'
        shares of each sum over the batch, which the engine's Sync tasks await; each
        reduction task's columns, which exchange() then completes)."""

    def exchange(self, reduction):
        """The step between "local sums done" and "update": makes the reduction's result
        hold the batch's sum of every column of this process's update blocks, in the same
        tree."""

    def share(self, params):
        """After the update of each process's blocks: every process holds all the new params."""

    def gather(self, array, parts):
        """array's rows parts[i] (ranges, in process order) were written by process i: fills
        in those of the others."""

    def gather_values(self, values):
        """This process's list of floats -> every process's lists, concatenated in process
        order (per-block values of its update blocks, which are contiguous runs of blocks)."""

    def collect(self, array):
        """Gives the leader every process's update-block columns of a (n,) array (the
        solver's histories, before the leader snapshots them)."""

    def max(self, value):
        """The largest of every process's int value (every process must ask, at the same
        point): how processes agree, e.g. on a column that went infinite."""


class Reduction:
    """A reduction cut into tasks once (Communicator.plan): task(w, i), run by worker w,
    writes the sum over the owned chunks of the columns spans[i] = (lo, hi) of the flat
    gradient into result[lo:hi], reading the chunks' gradients (or factors) of those columns
    alone. Called, it runs every task on the pool and returns result; the engine instead runs
    the tasks within its calls' run, each once the chunks' gradients of its columns are
    written."""

    def __init__(self, pool, tasks, spans, result):
        self.tasks, self.spans, self.result = tasks, spans, result
        self.pool = pool
        self._program = pool.program(self.task)
        # Per task: 1 once its sum is made in the current run (the engine counts them, for
        # a communicator that exchanges columns as their sums are ready).
        self.done = aligned_zeros(len(tasks), np.int64, pool.shared_memory)

    def task(self, w, i):
        self.tasks[i](w)

    def __call__(self):
        self.pool.run(self._program, len(self.tasks))
        return self.result


class LocalCommunicator:
    """One process owns every chunk: tree-sums chunk buffers in parallel over column blocks on
    a pool (cgp.runtime.pool.Pool's threads, or cgp.runtime.procs.ProcessPool's processes,
    the buffers then in shared memory); each task's sum is the batch's, and every collective
    is nothing or the identity."""

    rank, size = 0, 1
    takes_factors = True
    final_in_task = True
    leader = leader_group = True
    reproducible = True

    def __init__(self, pool):
        self.pool = pool
        self._scratch = {}

    def _worker_scratch(self, k, dtype):
        """Per worker: the tree's tile of partial sums, and a factored gradient's stack of
        partial sums, for k chunks."""
        key = (k, dtype)
        if key not in self._scratch:
            threads = self.pool.threads
            self._scratch[key] = (aligned_zeros((threads, k, TILE), dtype),
                                  aligned_zeros((threads, outer_stack_size(k)), dtype))
        return self._scratch[key]

    def plan(self, bufs, chunks=None, factored=(), cuts=()):
        """The reduction of bufs and factored (as in reduce), cut into its tasks once, for a
        caller that reduces the same buffers every iteration (the engine): a Reduction.
        cuts: columns where a task must end besides every sum_block columns (the engine's
        layer boundaries, so that no task waits for a layer whose columns it does not sum).
        Tasks are ALONE times as large on a pool of one worker. Any cut gives the same sums."""
        sums, stacks = self._worker_scratch(bufs.shape[0], bufs.dtype)
        scale = ALONE if self.pool.threads == 1 else 1
        tasks, spans = [], []  # each task a function of the worker that runs it (whose
                               # scratch it uses), and the columns it sums
        for lo, hi in split(uncovered(bufs.shape[1], factored), cuts):
            for a, b in blocks(hi - lo, sum_block(bufs.shape[0], scale)):
                tasks.append(lambda w, lo=lo + a, hi=lo + b: tree_sum(bufs, lo, hi, sums[w]))
                spans.append((lo + a, lo + b))
        for f in factored:
            out = bufs[0, f.offset:f.offset + f.J * f.L]
            rows = max(ROW_GRAIN, scale * BLOCK // f.L // ROW_GRAIN * ROW_GRAIN)
            for j0, j1 in blocks(f.J, rows):
                tasks.append(lambda w, f=f, out=out, j0=j0, j1=j1: outer_tree_sum(
                    f.a, f.b, f.J, f.L, f.starts, j0, j1, stacks[w], out))
                spans.append((f.offset + j0 * f.L, f.offset + j1 * f.L))
        return Reduction(self.pool, tasks, spans, bufs[0])

    def reduce(self, bufs, factored=()):
        """bufs: (K, P), one row per chunk; factored: FactoredGrad blocks of the gradient that
        the rows of bufs leave out. Returns the sum, written into row 0, in one fixed tree
        over chunk index for every element."""
        return self.plan(bufs, len(bufs), factored)()

    def settle(self):
        """Nothing in flight: every chunk is here."""

    def start(self, engine):
        """Nothing to exchange: every chunk is here."""

    def exchange(self, reduction):
        """Nothing to exchange: every chunk is here."""

    def share(self, params):
        """Nothing to share: every worker reads these parameters."""

    def gather(self, array, parts):
        """Nothing to gather: every row is this process's."""

    def gather_values(self, values):
        return list(values)

    def collect(self, array):
        """Nothing to collect: this process updates every column."""

    def max(self, value):
        return value


class ReferenceCommunicator(LocalCommunicator):
    """The naive twin of LocalCommunicator: the whole gradient in one task, summed level by
    level in plain NumPy (reference_reduce), never from factors. Bitwise the same sums (a
    test trains through both); slow, for tests."""

    takes_factors = False

    def plan(self, bufs, chunks=None, factored=(), cuts=()):
        if factored:
            raise ValueError("ReferenceCommunicator sums materialised chunk gradients only")

        def task(w):
            bufs[0] = reference_reduce(bufs)
        return Reduction(self.pool, [task], [(0, bufs.shape[1])], bufs[0])


def sum_over_chunks(shares, total):
    """total[:] = the rows of shares (one per chunk, in chunk order) added in the one tree
    over chunk index (tree_sum's): a sum over the whole batch (Layer.batch_sums), however
    the batch was cut. Row 0 of shares is overwritten."""
    tree_sum(shares, 0, shares.shape[1], np.empty((shares.shape[0], TILE), shares.dtype))
    total[:] = shares[0]


def reference_reduce(bufs):
    """The naive reference: the same tree in plain NumPy, one level at a time."""
    bufs = np.array(bufs)
    stride = 1
    while stride < len(bufs):
        for c in range(0, len(bufs) - stride, 2 * stride):
            bufs[c] = bufs[c] + bufs[c + stride]
        stride *= 2
    return bufs[0]
