"""A pool of worker threads that share a list of tasks (Pool), and what it shares with the
pool of worker processes (cgp.runtime.procs): the caller's own work in a run (CallersWork),
how long a waiting worker watches memory before it sleeps (spin_count), and the exception
of a task whose run failed (RunCancelled). Pools know nothing of nets or gradients: a run is
`tasks` calls of one function, handed out in index order to whichever worker asks next.
"""
import functools
import os
import threading
import time

import numpy as np

from cgp.errors import CgpError
from cgp.runtime import fpenv, spin
from cgp.runtime.memory import aligned_zeros


class RunCancelled(Exception):
    """Raised by a task that waited for another's progress after that other failed (see
    Pool.check_run); the run raises the failure itself."""


class _Run:
    """One Pool.run: hands tasks out in index order to whichever worker asks next, and
    counts them done, also into flags[1] for a caller that watches it (runtime.spin). The
    first exception stops the handing out; Pool.run re-raises it."""

    def __init__(self, fn, tasks, flags, args):
        self.fn, self.tasks, self.flags, self.args = fn, tasks, flags, args
        self.next = self.done = 0
        self.error = None
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def work(self, w, then=None):
        """Worker w's tasks until none is left. then: called once, after w's first task or when
        w finds none left (the caller's own work, Pool.run's first)."""
        while True:
            with self.lock:
                i = self.next
                if i >= self.tasks:
                    break
                self.next = i + 1
            try:
                self.fn(w, i, *self.args)
            except BaseException as error:  # Pool.run re-raises it in the caller
                with self.lock:
                    self.error = self.error or error
                    self.done += self.tasks - self.next   # the tasks nobody will start
                    self.next = self.tasks
            with self.lock:
                self.done += 1
                self.flags[1] = self.done
                if self.done == self.tasks:
                    self.finished.set()
            if then is not None:
                then()
                then = None
        if then is not None:
            then()


# How long a waiting worker watches memory before it sleeps (runtime.spin): longer than the
# interpreter's work between two runs of a step (making the next batch, the solver's
# bookkeeping), so that within a training run the pool's threads never sleep.
SPIN_SECONDS = 0.01


# What Pool.rest posts in place of a run.
_REST = object()


@functools.lru_cache(maxsize=None)
def spins_per_second():
    """How many reads runtime.spin's loops make in a second on this machine."""
    flags = np.zeros(2, np.int64)
    spin.wait_while(flags, 0, 0, 1000)   # compiled or loaded from the cache first
    n = 1 << 18
    started = time.perf_counter()
    spin.wait_while(flags, 0, 0, n)
    return int(n / max(time.perf_counter() - started, 1e-6))


# Where MPI launchers say how many ranks of the job run on this node (Open MPI, MPICH's
# Hydra, Slurm).
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def ranks_on_this_node():
    """How many ranks of an MPI job run on this node, as the launcher says (1 without one)."""
    for variable in LOCAL_SIZE_VARIABLES:
        try:
            return max(1, int(os.environ[variable]))
        except (KeyError, ValueError):
            continue
    return 1


def cores_of_this_process():
    """The cores this process's workers may take: those it may run on (its affinity: what
    mpirun's binding, taskset or a batch system gave it); where that is every core of the
    node while an MPI launcher placed several ranks here (no binding), their share of it."""
    usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count()) or 1
    here = ranks_on_this_node()
    if here > 1 and usable >= (os.cpu_count() or 1):
        usable = max(1, usable // here)
    return usable


def spin_count(workers):
    """How many reads a waiting worker of a pool of `workers` makes before it sleeps:
    SPIN_SECONDS' worth, or none where the workers outnumber the cores this process may
    take (cores_of_this_process: under MPI, the rank's share of the node), where a spinning
    worker would take a core from a working one (or with one worker: no waits). A rank's
    exchange thread is not counted: it sleeps between its looks (cgp.comm.mpi)."""
    return (int(SPIN_SECONDS * spins_per_second())
            if 1 < workers <= cores_of_this_process() else 0)


class CallersWork:
    """A pool run's `first`, the caller's own work, done once the caller has run its first
    task, or found none left for it: with as many calls as workers (16 one-chunk calls on 16
    workers) every call then starts at once, and the caller's work overlaps the other
    workers' next tasks instead of delaying its own call, which every reduction task waits
    for. It runs in the caller's own floating-point mode (state, what fpenv.set_flush
    returned as the run's tasks began), not the tasks'; call() does it the first time only,
    and error is its exception, raised once the run's tasks are done."""

    def __init__(self, first, state, flush):
        self.first, self.state, self.flush = first, state, flush
        self.error = None

    def __call__(self):
        first, self.first = self.first, None
        if first is not None:
            fpenv.restore(self.state)
            try:
                first()
            except BaseException as error:   # raised once the run's tasks are done
                self.error = error
            fpenv.set_flush(self.flush)


class CallerPin:
    """The calling thread pinned to one CPU while a pool's workers live (affinity), as
    OpenMP pins its master thread: pin() keeps the CPUs it may run on, and release() gives
    them back (nothing where it was not pinned)."""

    def __init__(self):
        self._cpus = None

    def pin(self, cpu):
        self._cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})   # pid 0: the calling thread only

    def release(self):
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)
            self._cpus = None


class Pool:
    """`threads` workers that share a list of tasks; task i of run(fn, tasks, *args) runs as
    fn(worker, i, *args). fn is any function; program(fn) returns it as it is, for callers
    that also run on a cgp.runtime.procs.ProcessPool, whose functions must be registered.
    The calling thread is worker 0 and runs tasks itself, beside threads-1 pool threads,
    and a run returns as soon as its last task is done, without waiting for a late thread
    to find nothing left. With one thread everything runs in the caller: plain sequential
    execution.
    Waiting threads (the pool's for the next run, the caller for a run's last task) watch
    memory for up to SPIN_SECONDS before they sleep, so that their CPUs do not go idle
    between the hand-overs of a step (see runtime.spin); not when there are more threads
    than CPUs, where a spinning thread would take a CPU from a working one.
    affinity: pin worker k to the k-th CPU this process may use (Linux), so the OS does not
    migrate workers between cores; results never depend on it. As OpenMP pins its master
    thread, the caller is pinned too (with more than one thread), until close(); threads it
    starts meanwhile inherit that CPU.
    flush_denormals: every task runs with subnormal floats flushed to zero (see
    cgp.runtime.fpenv), or with IEEE subnormals; the pool threads keep the mode for their
    life, the caller only while it runs tasks, so every thread count computes alike."""

    # Tasks may write ordinary memory: every worker is a thread of this process.
    shared_memory = False

    def __init__(self, threads, affinity=False, flush_denormals=True):
        if threads < 1:
            raise CgpError(f"--threads must be at least 1, got {threads}")
        self.threads = threads
        self.flush = flush_denormals
        self.pinned = []
        self._caller = CallerPin()
        self._flags = aligned_zeros(2, np.int64)   # runs posted, tasks done in the latest
        self._run = None
        self._current = None   # the run in progress (or the latest)
        self._posted = threading.Condition()
        self._workers = []
        cpus = sorted(os.sched_getaffinity(0)) if affinity and hasattr(os, "sched_getaffinity") else []
        if affinity and not cpus:
            raise CgpError("--affinity needs an OS that lets threads be pinned (Linux)")
        self._spins = spin_count(threads)
        if threads == 1:
            return
        if cpus:
            self._caller.pin(cpus[0])
            self.pinned.append(cpus[0])
        # The threads' compiled calls are compiled (or loaded) here, and the threads have
        # made their first ones before this returns: a process forked later (cgp.runtime.procs)
        # must not copy a Numba compiler lock that one of them held.
        fpenv.restore(fpenv.set_flush(self.flush))
        spin.wait_while(self._flags, 0, -1, 0)
        started = threading.Barrier(threads)
        for w in range(1, threads):
            worker = threading.Thread(target=self._serve, name=f"cgp-{w}", daemon=True,
                                      args=(w, cpus[w % len(cpus)] if cpus else None, started))
            worker.start()
            self._workers.append(worker)
        started.wait()

    def _pin(self, cpu):
        os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread only
        self.pinned.append(cpu)

    def _serve(self, w, cpu, started):
        """Pool thread w: runs its share of every run posted, until close()."""
        fpenv.set_flush(self.flush)
        if cpu is not None:
            self._pin(cpu)
        started.wait()
        seen, resting = 0, False
        while True:
            if resting or spin.wait_while(self._flags, 0, seen, self._spins) == seen:
                with self._posted:
                    while self._flags[0] == seen:
                        self._posted.wait()
            # A run posted since is taken as well; this one then has nothing left for it.
            seen, run = int(self._flags[0]), self._run
            if run is None:
                return
            resting = run is _REST
            if not resting:
                run.work(w)

    def program(self, fn):
        """fn itself: threads run any function (see cgp.runtime.procs.ProcessPool.program)."""
        return fn

    def start(self):
        """Nothing to do: the threads started with the pool (cgp.runtime.procs.ProcessPool forks
        its workers here)."""

    def run(self, fn, tasks, *args, first=None):
        """first: a function the caller runs once it has run its first task (or found none
        left): work of its own that the other workers' tasks overlap (CallersWork); its
        exception is raised after the run, in place of a task's. With no tasks nothing runs,
        first neither."""
        if tasks < 1:
            return
        run = self._current = _Run(fn, tasks, self._flags, args)
        if self._workers:
            self._post(run)
        state = fpenv.set_flush(self.flush)
        own = CallersWork(first, state, self.flush)
        try:
            run.work(0, own if first is not None else None)
        finally:
            fpenv.restore(state)
        spin.wait_for(self._flags, 1, tasks, self._spins)
        run.finished.wait()
        if own.error is not None or run.error is not None:
            raise own.error or run.error

    def check_run(self):
        """For a task that waits for another task's progress: raises RunCancelled if a task
        of the run has failed, after which no task starts and that progress may never come."""
        if self._current.error is not None:
            raise RunCancelled()

    def _post(self, run):
        with self._posted:
            self._run = run
            self._flags[1] = 0
            self._flags[0] += 1
            self._posted.notify_all()

    def rest(self):
        """Sends the pool's threads to sleep now, not SPIN_SECONDS after the last run: for
        a caller that will not run anything for a while, while something else needs the
        CPUs (another pool, in a benchmark)."""
        if self._workers:
            self._post(_REST)

    def close(self):
        if self._workers:
            self._post(None)
            for worker in self._workers:
                worker.join()
            self._workers = []
        self._caller.release()


