"""Asynchronous and hybrid sharing of the weights across MPI ranks (--sharing async, --sharing
hybrid --groups G), as ShmCaffe-A and ShmCaffe-H: not reproducible, by nature.

The ranks are cut into G groups of consecutive ranks (async: one rank each). A group trains
as a whole job of its own would: it computes whole batches (the solver's batch_size, cut
into --chunks and, in a group of several ranks, summed across them by the fixed tree of
cgp.comm.mpi), and updates its own copy of the weights with its own solver state. The groups
share the weights through a parameter buffer in MPI one-sided windows on rank 0
(ParameterBuffer): after each update a group's leader adds the update it made (new weights
less the weights it last pulled) into the buffer and pulls the buffer back, which holds every
group's updates so far; no group ever waits for another. The iterations are tickets of one
shared counter: a group computes the batch, learning rate and random numbers of the
iteration it drew, so every iteration's batch is computed once, in the order of a
synchronous run; the trainer's count is the number of updates the buffer held at the
group's last pull (Tickets: the trainer's schedule, cgp.comm.make_schedule, where lockstep
runs have cgp.comm.Lockstep). Which weights a gradient was computed on, and in what order
the updates land, depend on timing: the weights are not reproducible, even with the same
settings.

Only rank 0's group tests and writes snapshots: the weights it last pulled and its solver
history (each group keeps its own; a resumed run starts every group from it). Without
mpirun, cgp never imports mpi4py.
"""
import numpy as np

from cgp.comm.local import LocalCommunicator
from cgp.errors import CgpError
from cgp.comm.mpi import MPICommunicator

# The parameter buffer's counters: the tickets drawn, the updates added, the strongest request
# of the signals (cgp.train.REQUESTS).
TICKETS, UPDATES, REQUEST = range(3)
SNAPSHOT, STOP = 1, 2   # requests: a snapshot is taken once by rank 0's group, a stop stays


class ParameterBuffer:
    """The weights and counters that the groups share, in two windows that rank 0 holds
    (MPI.Win.Allocate: on one machine, memory that every rank reads and writes directly).
    Updates are added with Accumulate and the weights read with Get_accumulate (NO_OP), both
    under a shared lock: MPI makes accumulate operations on one element atomic, so a read
    never sees half an addition while other groups add theirs, and no group waits for
    another's whole transfer. The counters are changed by Fetch_and_op alone."""

    def __init__(self, comm, n, dtype):
        from mpi4py import MPI
        self.MPI = MPI
        self.kind = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[dtype]
        here = comm.Get_rank() == 0
        itemsize = np.dtype(dtype).itemsize
        self.weights = MPI.Win.Allocate(n * itemsize if here else 0, itemsize, comm=comm)
        self.counters = MPI.Win.Allocate(3 * 8 if here else 0, 8, comm=comm)
        self.n = n
        self._one = np.ones(1, np.int64)
        self._old = np.zeros(1, np.int64)
        self._nothing = np.zeros(1, dtype)   # a read's origin, which NO_OP ignores

    def reset(self, it, params):
        """Rank 0: the buffer holds params, `it` tickets drawn and updates added, no request."""
        MPI = self.MPI
        self.weights.Lock(0, MPI.LOCK_EXCLUSIVE)
        self.weights.Put([params, self.kind], 0)
        self.weights.Unlock(0)
        self.counters.Lock(0, MPI.LOCK_EXCLUSIVE)
        self.counters.Put([np.array([it, it, 0], np.int64), MPI.INT64_T], 0)
        self.counters.Unlock(0)

    def _counter(self, index, value, op):
        """Counter `index` before `op` with value (Fetch_and_op)."""
        MPI = self.MPI
        self._one[0] = value
        self.counters.Lock(0, MPI.LOCK_SHARED)
        self.counters.Fetch_and_op([self._one, MPI.INT64_T], [self._old, MPI.INT64_T], 0,
                                   index, op)
        self.counters.Unlock(0)
        return int(self._old[0])

    def draw(self):
        """The next ticket: the iteration whose batch the caller computes."""
        return self._counter(TICKETS, 1, self.MPI.SUM)

    def push(self, update, params):
        """Adds update into the buffer, then reads the buffer into params; returns the count
        of updates added, this one included."""
        MPI = self.MPI
        self.weights.Lock(0, MPI.LOCK_SHARED)
        self.weights.Accumulate([update, self.kind], 0, op=MPI.SUM)
        # Accumulate operations of one origin to one target keep their order (MPI's default
        # accumulate_ordering): the read sees this addition.
        self._read(params)
        self.weights.Unlock(0)
        return self._counter(UPDATES, 1, MPI.SUM) + 1

    def pull(self, params):
        """Reads the buffer into params; returns the count of updates it holds."""
        MPI = self.MPI
        self.weights.Lock(0, MPI.LOCK_SHARED)
        self._read(params)
        self.weights.Unlock(0)
        return self._counter(UPDATES, 0, MPI.NO_OP)

    def _read(self, params):
        """The weights into params, each element read atomically (within a lock epoch)."""
        self.weights.Get_accumulate([self._nothing, 0, self.kind], [params, self.kind], 0,
                                    target=(0, self.n, self.kind), op=self.MPI.NO_OP)

    def request(self, value):
        """Posts a request; returns the strongest one posted and not taken (value included)."""
        return max(value, self._counter(REQUEST, value, self.MPI.MAX))

    def take(self, value):
        """Clears the request if it still is `value` (a stop posted meanwhile stays)."""
        MPI = self.MPI
        self.counters.Lock(0, MPI.LOCK_SHARED)
        self.counters.Compare_and_swap([np.zeros(1, np.int64), MPI.INT64_T],
                                       [np.array([value], np.int64), MPI.INT64_T],
                                       [self._old, MPI.INT64_T], 0, REQUEST)
        self.counters.Unlock(0)

    def free(self):
        """Every rank at once."""
        self.weights.Free()
        self.counters.Free()


def groups_of(size, groups):
    """The ranks of each of `groups` groups of `size` ranks: consecutive, near-equal."""
    return [range(g * size // groups, (g + 1) * size // groups) for g in range(groups)]


class SharedCommunicator:
    """One rank of a job whose groups of ranks share weights asynchronously (see the module):
    within its group, the group's communicator (cgp.comm.mpi.MPICommunicator on the group's
    ranks, or cgp.comm.local.LocalCommunicator for a group of one), which every collective of
    the engine and the step is handed to; between groups, the ParameterBuffer, after each
    update (share). rank and size are the group's: a group computes whole batches alone.
    Which iterations the group computes is its Tickets' (tickets; cgp.comm.make_schedule)."""

    reproducible = False

    def __init__(self, pool, world, mode, groups):
        world_size, world_rank = world.Get_size(), world.Get_rank()
        self.mode, self.world_size = mode, world_size
        self.ranks = groups_of(world_size, groups)
        group_index = next(g for g, ranks in enumerate(self.ranks) if world_rank in ranks)
        group = world.Split(group_index, world_rank)
        self.inner = (LocalCommunicator(pool) if group.Get_size() == 1
                      else MPICommunicator(pool, group))
        self.rank, self.size = self.inner.rank, self.inner.size
        self.takes_factors = self.inner.takes_factors
        self.final_in_task = self.inner.final_in_task
        self.leader = world_rank == 0
        self.leader_group = group_index == 0
        self.tickets = Tickets(world, group, self.leader_group, mode, self.inner)

    def describe(self):
        """The start-up line's words for the ranks."""
        sizes = sorted({len(r) for r in self.ranks})
        each = " or ".join(map(str, sizes))
        return (f"{self.world_size} ranks in {len(self.ranks)} group(s) of {each} rank(s), "
                f"--sharing {self.mode}")

    @property
    def computed_by_group(self):
        """Every group's count of iterations computed, once training has ended (Tickets.end)."""
        return self.tickets.computed_by_group

    # -- the collectives: the group's own -------------------------------------------------
    def plan(self, bufs, chunks, factored=(), cuts=()):
        return self.inner.plan(bufs, chunks, factored, cuts)

    def settle(self):
        self.inner.settle()

    def start(self, engine):
        self.inner.start(engine)

    def exchange(self, reduction):
        self.inner.exchange(reduction)

    def gather(self, array, parts):
        self.inner.gather(array, parts)

    def gather_values(self, values):
        return self.inner.gather_values(values)

    def collect(self, array):
        self.inner.collect(array)

    def max(self, value):
        return self.inner.max(value)

    def bytes_per_step(self):
        """The group's exchange (MPICommunicator.bytes_per_step), without the buffer's."""
        return self.inner.bytes_per_step()

    def share(self, params):
        """After the group's update: the group's ranks all hold it, and then, through the
        buffer, every group's updates so far (Tickets.push)."""
        self.inner.share(params)
        self.tickets.push(params)


class Tickets:
    """The iterations of a group that shares weights asynchronously (see the module), as the
    trainer asks for them (the protocol of cgp.comm.Lockstep): tickets of the ParameterBuffer's
    counter, which lives from begin() to end(); the count is the number of updates the buffer
    held at the group's last pull, which push() makes after each of the group's updates."""

    def __init__(self, world, group, leader_group, mode, inner):
        """group: this rank's group's MPI communicator, inner the group's Communicator;
        leader_group: whether it is rank 0's group, which takes the snapshots."""
        self.world, self.group, self.mode, self.inner = world, group, mode, inner
        self.leader = world.Get_rank() == 0
        self.leader_group = leader_group
        self.group_leader = group.Get_rank() == 0
        self.buffer = None      # from begin() to end()
        self._ahead = None      # a ticket drawn by claim_ahead()
        self.count = None       # updates in the buffer at the latest pull
        self.computed = 0       # iterations this group computed
        self.computed_by_group = None   # after end(): every group's

    def push(self, params):
        """After the group's update, which its ranks all hold: the group's leader adds it
        into the buffer and pulls the buffer, which the group's ranks then all take."""
        if self.buffer is None:
            raise CgpError(f"--sharing {self.mode} trains through `cgp train` (Trainer.solve) "
                           "alone")
        if self.group_leader:
            np.subtract(params, self._base, out=self._update)
            self.count = self.buffer.push(self._update, params)
            self._base[...] = params
        self._group_bcast(params)
        self.count = self._group_int(self.count)
        self.computed += 1

    def _group_bcast(self, array):
        if self.group.Get_size() > 1:
            self.group.Bcast(array, root=0)

    def _group_int(self, value):
        if self.group.Get_size() == 1:
            return value
        return self.group.bcast(value, root=0)

    def begin(self, it, params):
        """Every rank: rank 0's buffer starts from its params and count `it` (every rank
        built or restored the same weights), which every rank then pulls."""
        self.buffer = ParameterBuffer(self.world, len(params), params.dtype)
        if self.leader:
            self.buffer.reset(it, params)
        self.world.Barrier()
        self.count = self.buffer.pull(params)
        self._base = params.copy()
        self._update = np.empty_like(params)
        return self.count

    def _draw(self):
        return self._group_int(self.buffer.draw() if self.group_leader else None)

    def claim(self, it, end):
        ticket, self._ahead = self._ahead, None
        if ticket is None:
            ticket = self._draw()
        return ticket if ticket < end else None

    def claim_ahead(self, it, end):
        self._ahead = self._draw()
        return self._ahead if self._ahead < end else None

    def after(self, it):
        return self.count

    def request(self, value):
        """Agreed in the group, then posted to the buffer: a stop reaches every group and
        stays; a snapshot is taken (and cleared) by rank 0's group, which writes snapshots,
        and is nothing to the others."""
        value = self.inner.max(value)
        if self.buffer is not None and self.group_leader:
            value = self.buffer.request(value)
            if value == SNAPSHOT:
                if self.leader_group:
                    self.buffer.take(SNAPSHOT)
                else:
                    value = 0
        return self._group_int(value)

    def end(self, it, params):
        """Every rank, once its group has no iteration left or stops: once all have, the
        buffer's final weights and count to every rank; the windows are freed."""
        if self.buffer is None:
            return self.count if self.count is not None else it
        self.world.Barrier()   # every group's last update is in
        self.count = self.buffer.pull(params)
        self.computed_by_group = [c for c in self.world.allgather(
            self.computed if self.group_leader else None) if c is not None]
        self.buffer.free()
        self.buffer = None
        return self.count
