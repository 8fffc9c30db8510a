"""Communication: the fixed-order sum over chunk rows and the collectives a run needs, and
which iterations a process computes.

local: the tree over chunk index, the Communicator protocol and the one-machine communicator;
mpi: the same tree completed across MPI ranks; sharing: groups of ranks that share weights
asynchronously, and their Tickets. make_communicator and make_schedule below are the one
place that picks among them.
"""
from cgp.errors import CgpError


def make_communicator(pool, sharing="sync", groups=0):
    """The communicator of a run on `pool`, chosen in this one place: one rank of an MPI job
    where an MPI launcher started this process as one of several (cgp.comm.mpi), else the
    workers of this machine alone; with sharing "async" (a group per rank) or "hybrid"
    (`groups` groups), a rank whose group shares weights with the others asynchronously
    (cgp.comm.sharing)."""
    from cgp.comm import mpi
    from cgp.comm.local import LocalCommunicator

    if sharing == "sync":
        if mpi.launched():
            return mpi.MPICommunicator(pool, mpi.world())
        return LocalCommunicator(pool)
    if not mpi.launched():
        raise CgpError(f"--sharing {sharing} shares weights between the ranks of an MPI job: "
                       f"launch it with mpirun -np R (R of 2 or more)")
    from cgp.comm import sharing as shared

    world = mpi.world()
    size = world.Get_size()
    if sharing == "async":
        groups = size
    elif not 2 <= groups <= size:
        raise CgpError(f"--sharing hybrid --groups {groups}: from 2 to the {size} ranks of the "
                       "job (one group is --sharing sync; one rank a group is --sharing async)")
    return shared.SharedCommunicator(pool, world, sharing, groups)


def make_schedule(comm):
    """Which iterations this process computes, for the trainer: the tickets of the groups'
    shared buffer where groups share weights asynchronously (cgp.comm.sharing.Tickets, which
    that communicator's share() feeds), else every iteration, with every process (Lockstep)."""
    from cgp.comm.sharing import SharedCommunicator

    if isinstance(comm, SharedCommunicator):
        return comm.tickets
    return Lockstep(comm)


class Lockstep:
    """The iterations where every process computes every one together: the trainer's count
    is the iteration, and a request (cgp.train.REQUESTS) is agreed with the communicator's
    max(). The protocol that cgp.comm.sharing.Tickets follows too."""

    def __init__(self, comm):
        self.comm = comm

    def begin(self, it, params):
        """Training starts, or resumes, at iteration `it` with these params (every process
        at once): returns the iteration count."""
        return it

    def claim(self, it, end):
        """The iteration whose batch this process computes next, its count being `it`; None
        where none is left before `end`."""
        return it

    def claim_ahead(self, it, end):
        """As claim(), asked during the step before (its batch is read meanwhile): the
        iteration that the next claim() returns."""
        return it

    def after(self, it):
        """The iteration count once this process's step of iteration `it` is shared."""
        return it + 1

    def request(self, value):
        """What every process acts on now of the signals' requests (cgp.train.REQUESTS: 0
        none, 1 snapshot, 2 stop; each process asks once an iteration): the strongest any
        has made."""
        return self.comm.max(value)

    def end(self, it, params):
        """This process has no iteration left, or stops: returns the final iteration count,
        params then the final weights (every process at once)."""
        return it
