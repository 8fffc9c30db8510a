"""Communication: the fixed-order sum over chunk rows and the collectives a run needs.

local: the tree over chunk index, the Communicator protocol and the one-machine communicator;
mpi: the same tree completed across MPI ranks; sharing: groups of ranks that share weights
asynchronously. make_communicator below is the one place that picks among them.
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
