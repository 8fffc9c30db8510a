"""Worker processes (`--workers processes`): a pool like cgp.runtime.pool.Pool whose workers are
forked processes, so no two workers ever wait for the same Python interpreter lock. Threads
share one: the Python between kernel calls of all workers runs one at a time, which bounds
the speedup as threads grow (bench/python_overhead.py).

Every phase of a step runs on the workers: the engine's calls, the reduction, the update.
A process cannot be handed a new Python function, so a run's function is a *program*,
registered before start() forks the workers, which each inherit it with the nets, the
workspaces and the compiled kernels. What crosses between processes lives in shared memory
allocated before the fork (aligned_zeros(shared=True)): the parameters, the batch, chunk
gradients and factors, loss shares, solver histories, and the pool's own counters. A run is
posted and its end announced through those counters, which the waiting side watches (as
Pool's threads do, cgp/runtime/spin.py) before it sleeps on a semaphore; no message crosses a
pipe unless a task fails. Tasks are handed out in index order to whichever worker asks next,
so which process runs which task is left to timing and never changes a bit.
"""
import functools
import multiprocessing
import os
import pickle
import select
import signal
import sys
import traceback
import warnings

import numpy as np

from cgp.errors import CgpError
from cgp.runtime import fpenv, spin
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.pool import CallerPin, CallersWork, Pool, RunCancelled, spin_count

# Where the pool's counters sit in its shared int64 array; those that different workers write
# at once each have a 64-byte cache line of their own.
_POSTED = 0     # runs posted so far: the number of the latest
_TICKET = 8     # run << 32 | the next task to hand out (spin.take_ticket)
_DONE = 16      # tasks of the latest run done (or skipped after an error)
_FAILED = 24    # whether a task of the latest run raised
_TASKS, _PROGRAM, _ARG_BYTES = 25, 26, 27   # the latest run's task count, program, arguments
_SLEEP = 32     # + 8 * w: worker w sleeps on its semaphore (w = 0: the caller, for a run's end)

_STOP, _REST = -1, -2   # programs that end the workers, or send them to sleep at once

ARGS_BYTES = 4096   # room for a run's pickled arguments (a few numbers: iteration, seed, step)

# How long a sleeping worker waits before it checks that the main process still exists.
_PARENT_CHECK_SECONDS = 1.0


def _sigterm_in_worker(signum, frame):
    """A worker process's SIGTERM: left to the main process while that one catches SIGTERM
    itself (cgp train, which then stops and closes the workers; a batch scheduler signals
    every process of the job); otherwise what SIGTERM does by default, as when the main
    process ends its daemon workers at exit."""
    if _catches(os.getppid(), signum):
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _catches(pid, signum):
    """Whether process pid has a handler for signal signum (Linux: /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False
# How long the caller sleeps for a run's end before it checks that no worker has died.
_ALIVE_CHECK_SECONDS = 0.1


def available():
    """Whether this OS can fork the workers (Linux, macOS; not Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


@functools.lru_cache(maxsize=None)
def default_workers():
    """How workers run unless told: as processes on Linux, where no interpreter lock is
    shared and fork() is cheap and safe for the numeric libraries loaded here; as threads
    elsewhere (Windows cannot fork, and macOS's system libraries are not safe to use in a
    forked child), and where the OS refuses the semaphores the processes sleep on (a
    container without a writable /dev/shm). The same bits either way."""
    if not (sys.platform.startswith("linux") and available()):
        return "threads"
    try:
        multiprocessing.get_context("fork").Semaphore(0)
    except OSError:
        return "threads"
    return "processes"


def forks(workers, threads):
    """Whether `threads` workers of kind `workers` ("threads", "processes") run as forked
    processes: one worker never does; it runs as plain sequential code in private memory."""
    return workers == "processes" and threads > 1


def worker_noun(workers, threads):
    """What the workers are, for messages: "process(es)" or "thread(s)"."""
    return "process(es)" if forks(workers, threads) else "thread(s)"


def make_pool(workers, threads, nets=(), affinity=False, flush_denormals=True):
    """The pool that `threads` workers of kind `workers` run on: a ProcessPool where they
    fork (the nets' parameters moved into shared memory first), else a thread Pool. Its
    start() comes once the engines and every other program exist."""
    if not forks(workers, threads):
        return Pool(threads, affinity, flush_denormals)
    for net in nets:
        share_params(net)
    return ProcessPool(threads, affinity, flush_denormals)


def share_params(net):
    """Moves net.params into shared memory, where worker processes forked later read the
    weights that the main process writes; before any view of them is taken (engines)."""
    params = aligned_zeros(net.n_params, net.params.dtype, shared=True)
    params[...] = net.params
    net.params = params


class ProcessPool:
    """Pool's interface over threads - 1 worker processes and the caller as worker 0:
    run(program, tasks, *args) runs program's fn(worker, i, *args) for i < tasks and returns
    when all are done, raising the exception of the lowest failed task, if any, once every
    running task has ended (no task starts after a failure).

    program(fn) registers fn and returns its handle; every program must be registered before
    start() forks the workers. A run's args are pickled through shared memory: our own few
    numbers, never anything a user supplies. What a task writes that another process reads
    must be in shared memory (shared_memory tells engines and trainers so).
    affinity and flush_denormals as in Pool: worker k (the caller too) is pinned to the k-th
    CPU this process may use, and every task runs with subnormals flushed or kept alike."""

    shared_memory = True

    def __init__(self, threads, affinity=False, flush_denormals=True):
        if not available():
            raise CgpError("--workers processes needs an OS that can fork() (Linux, macOS); "
                           "use --workers threads")
        if threads < 1:
            raise CgpError(f"--threads must be at least 1, got {threads}")
        self.threads, self.flush, self.affinity = threads, flush_denormals, affinity
        if affinity and not hasattr(os, "sched_getaffinity"):
            raise CgpError("--affinity needs an OS that lets processes be pinned (Linux)")
        self.programs = []
        self.procs = []
        self.broken = None
        self._parent = os.getpid()
        self._started = False
        self._caller = CallerPin()
        self._flags = aligned_zeros(_SLEEP + 8 * threads, np.int64, shared=True)
        self._args = aligned_zeros(ARGS_BYTES, np.uint8, shared=True)
        self._woken = np.zeros(threads - 1, np.int64)   # the workers a post wakes
        self._failures = []  # (task, exception) of the latest run's failed tasks, read so far
        self._spins = spin_count(threads)

    def program(self, fn):
        """Registers fn(worker, i, *args); returns the handle that run() takes."""
        if self._started:
            raise RuntimeError("ProcessPool.program after start(): the workers, forked "
                               "already, would not have it")
        self.programs.append(fn)
        return len(self.programs) - 1

    def start(self):
        """Forks the workers: after every program and shared buffer exists, and before any
        thread that a child could need a lock of."""
        if self._started:
            return
        self._started = True
        if self.threads == 1:
            return
        ctx = multiprocessing.get_context("fork")
        try:
            self._wakes = [ctx.Semaphore(0) for _ in range(self.threads)]
        except OSError as error:
            raise CgpError(f"--workers processes: the OS refused a semaphore shared between "
                           f"processes ({error}); POSIX semaphores need a writable /dev/shm. "
                           "Use --workers threads") from None
        # A worker reports a failed task through a pipe of its own: the one message that is
        # not a counter (an exception is an object).
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.threads - 1)]
        self._reports = [reader for reader, _ in pipes]
        cpus = sorted(os.sched_getaffinity(0)) if self.affinity else []
        # Compiled (or loaded) here, so that no child starts by compiling.
        spin.take_ticket(self._flags, _TICKET, -1, 0)
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a process with threads may deadlock the child if
            # another thread holds a lock the child then takes. The only other threads here are
            # idle ones (BLAS's, other pools' workers) and the child never takes their locks.
            warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
            for w in range(1, self.threads):
                proc = ctx.Process(target=self._serve, name=f"cgp-worker-{w}", daemon=True,
                                   args=(w, pipes[w - 1][1], int(self._flags[_POSTED])))
                proc.start()
                if cpus:
                    os.sched_setaffinity(proc.pid, {cpus[w % len(cpus)]})
                self.procs.append(proc)
        for _, writer in pipes:
            writer.close()
        # One poll() on the workers' sentinels tells whether any has ended.
        self._ended = select.poll()
        for proc in self.procs:
            self._ended.register(proc.sentinel, select.POLLIN)
        if cpus:
            self._caller.pin(cpus[0])

    # -- the caller -----------------------------------------------------------------
    def run(self, program, tasks, *args, first=None):
        """first: as Pool.run's: the caller's work after its first task."""
        if tasks < 1:
            return
        if not self._started:
            raise RuntimeError("ProcessPool.run before start()")
        if self.broken:
            raise CgpError(self.broken)
        data = pickle.dumps(args) if args else b""
        if len(data) > ARGS_BYTES:
            raise RuntimeError(f"a run's arguments take {len(data)} bytes pickled; the pool "
                               f"has room for {ARGS_BYTES}")
        flags = self._flags
        run = int(flags[_POSTED]) + 1
        self._post(run, program, tasks, data)
        # Whether a worker has ended since the last run, asked while the workers start rather
        # than before, where every worker would wait for the answer: the run goes on without
        # it (the others take its tasks) and raises its error once done, as every later run.
        lost = self.procs and self._ended.poll(0)
        state = fpenv.set_flush(self.flush)
        own = CallersWork(first, state, self.flush)
        try:
            self._take(0, run, own if first is not None else None)
        finally:
            fpenv.restore(state)
            if self.procs:   # before the next run resets the counts, even after an interrupt
                self._wait(tasks)
        failure = self._first_failure() if flags[_FAILED] else None   # read: none left over
        if lost:
            raise self._lost()
        if own.error is not None or failure is not None:
            raise own.error or failure

    def _post(self, run, program, tasks=0, data=b""):
        """Publishes run number `run` of `tasks` tasks of a program (or _STOP, _REST) with its
        pickled arguments, and wakes the workers that sleep."""
        woken = spin.post(self._flags, _POSTED, run, _TICKET,
                          (_DONE, _FAILED, _TASKS, _PROGRAM, _ARG_BYTES),
                          (0, 0, tasks, program, len(data)), self._args, data, _SLEEP + 8, 8,
                          self._woken)
        if woken:   # in a step, rarely: the workers watch memory between runs
            for k in self._woken[:woken]:
                self._wakes[k + 1].release()

    def _wait(self, tasks):
        """Returns when `tasks` tasks of the latest run are done: watches the count, then
        sleeps until the worker that completes it wakes the caller, checking now and then
        that no worker has died."""
        flags = self._flags
        spin.wait_for(flags, _DONE, tasks, self._spins)
        while spin.load(flags, _DONE) < tasks:
            spin.exchange(flags, _SLEEP, 1)
            woke = (spin.load(flags, _DONE) < tasks
                    and self._wakes[0].acquire(timeout=_ALIVE_CHECK_SECONDS))
            if not woke and spin.exchange(flags, _SLEEP, 0) == 0:
                self._wakes[0].acquire()   # a worker cleared the mark: its wake-up is coming
            if not woke:
                self._read_reports()   # a worker's report may be longer than its pipe holds
                self._check_alive()

    def check_run(self):
        """As Pool.check_run; also, in the caller, raises the error for a worker found dead
        (whose tasks will never end), and ends a worker whose main process has gone."""
        if spin.load(self._flags, _FAILED):
            raise RunCancelled()
        if os.getpid() == self._parent:
            self._check_alive()
        else:
            self._end_if_orphaned()

    def _check_alive(self):
        """In the caller: raises the error for a worker found dead, if one is."""
        if self.procs and self._ended.poll(0):
            raise self._lost()

    def _end_if_orphaned(self):
        """In a worker: ends it if the main process has gone (nobody to work for)."""
        if os.getppid() != self._parent:
            os._exit(0)

    def _lost(self):
        """The error for a worker found dead; every later run raises it too, and the run in
        progress fails (workers waiting for the dead one's progress give up)."""
        spin.exchange(self._flags, _FAILED, 1)
        w, proc = next((w, p) for w, p in enumerate(self.procs, 1) if not p.is_alive())
        proc.join(timeout=1)
        code = proc.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}" if code is not None else "no exit code")
        self.broken = f"worker process {w} ended unexpectedly ({how}); the run cannot go on"
        return CgpError(self.broken)

    def _read_reports(self):
        for reader in self._reports if self.procs else []:
            try:
                while reader.poll():
                    self._failures.append(reader.recv())
            except EOFError:   # its worker has died (found and reported by the caller)
                pass

    def _first_failure(self):
        """The exception of the lowest failed task of the latest run, the caller's or a
        worker's; all of them are read, so that none is left for the next run."""
        self._read_reports()
        failures, self._failures = self._failures, []
        return min(failures, key=lambda f: f[0])[1]

    def rest(self):
        """Sends the workers to sleep now, not SPIN_SECONDS after the last run (see Pool)."""
        if self.procs:
            self._post(int(self._flags[_POSTED]) + 1, _REST)

    def close(self):
        """Ends the workers."""
        if self.procs:
            self._post(int(self._flags[_POSTED]) + 1, _STOP)
            for proc in self.procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.terminate()
                    proc.join()
            for reader in self._reports:
                reader.close()
        self.procs = []
        self._caller.release()

    # -- every worker, the caller too ---------------------------------------------------
    def _take(self, w, run, then=None):
        """Runs tasks of run number `run` until none is left; after a failure the tasks left
        are counted done without running. then: as _Run.work's."""
        flags = self._flags
        tasks = int(flags[_TASKS])   # a later run's count if this run has gone: then no ticket
        fn = args = None
        while True:
            i = spin.take_ticket(flags, _TICKET, run, tasks)
            if i < 0:
                break
            if fn is None:   # with a ticket, the run's program and arguments are this run's
                fn = self.programs[int(flags[_PROGRAM])]
                size = int(flags[_ARG_BYTES])
                args = pickle.loads(self._args[:size].tobytes()) if size else ()
            try:
                if not spin.load(flags, _FAILED):
                    fn(w, i, *args)
            except BaseException as error:   # run() raises it in the caller
                self._fail(w, i, error)
            finally:   # counted even if the caller is interrupted here, or run() never returns
                if (spin.fetch_add(flags, _DONE, 1) == tasks - 1
                        and spin.exchange(flags, _SLEEP, 0)):
                    self._wakes[0].release()
            if then is not None:
                then()
                then = None
        if then is not None:
            then()

    def _fail(self, w, i, error):
        spin.exchange(self._flags, _FAILED, 1)
        if w == 0:
            self._failures.append((i, error))
            return
        try:
            self._report.send((i, error))
        except Exception:   # an exception that cannot be pickled arrives as its text
            self._report.send((i, RuntimeError(
                f"worker process {w}:\n" + "".join(traceback.format_exception(error)))))

    def _serve(self, w, report, seen):
        """A worker process's life: every run posted after run number `seen` (the latest when
        it was forked: it may start late), until the program _STOP, or until the main
        process has gone."""
        # Ctrl-C, a hang-up and a scheduler's SIGTERM reach the whole process group (or
        # job): the main process decides what they do (cgp train's --sigint-effect,
        # --sighup-effect, --sigterm-effect) and then closes the workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _sigterm_in_worker)
        self._report = report
        fpenv.set_flush(self.flush)
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=1)   # a forked BLAS would start threads of its own
        flags, resting = self._flags, False
        while True:
            posted = spin.wait_while(flags, _POSTED, seen, 0 if resting else self._spins)
            seen = posted if posted != seen else self._sleep(w, seen)
            program = int(flags[_PROGRAM])
            if program == _STOP:
                return
            resting = program == _REST
            if not resting:
                self._take(w, seen)

    def _sleep(self, w, seen):
        """Sleeps until a run after `seen` is posted; returns the number of the latest.
        Marks itself asleep for the caller's _post, which clears the mark of each worker
        it wakes."""
        flags, mark = self._flags, _SLEEP + 8 * w
        spin.exchange(flags, mark, 1)
        if spin.load(flags, _POSTED) == seen or spin.exchange(flags, mark, 0) == 0:
            # Not posted yet, or posted by a caller that saw the mark: a wake-up is coming.
            while not self._wakes[w].acquire(timeout=_PARENT_CHECK_SECONDS):
                self._end_if_orphaned()
        return spin.load(flags, _POSTED)
