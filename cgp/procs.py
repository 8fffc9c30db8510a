"""Worker processes for the engine's calls: with `--workers processes` each worker runs its
calls in a process of its own, so no two workers ever wait for the same Python interpreter
lock. Threads share one: the Python between kernel calls of all workers runs one at a
time, which bounds the speedup as threads grow (bench/python_overhead.py).

The workers are forked once, after the engines exist. A worker inherits the nets, its
workspace and the compiled kernels, and shares with the main process only what crosses
between them: the parameters, the batch, the chunk gradients and factors and the loss
shares, each allocated in shared memory before the fork (Engine(shared=True)). The main
process is worker 0, as in Pool; the reduction and the update stay on the main process's
Pool, whose kernels hold no interpreter lock. Calls are handed out in index order by a
counter in shared memory to whichever worker asks next, so which worker runs which call is
left to timing and never changes a bit: the same calls write the same buffers as with
threads.
"""
import multiprocessing
import os
import signal
import traceback
import warnings

import numpy as np

from cgp.errors import CgpError
from cgp.kernels import fpenv
from cgp.layers import aligned_zeros


def available():
    """Whether this OS can fork the workers (Linux, macOS; not Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


def share_params(net):
    """Moves net.params into shared memory, where worker processes forked later read the
    weights that the main process writes; before any view of them is taken (engines)."""
    params = aligned_zeros(net.n_params, net.params.dtype, shared=True)
    params[...] = net.params
    net.params = params


class Processes:
    """threads - 1 forked worker processes that, with the caller as worker 0, run the calls
    of the given engines (each built with shared=True over a net whose params are shared).
    affinity and flush_denormals as in Pool: worker k is pinned to the k-th CPU this process
    may use, and every call runs with subnormals flushed or kept alike."""

    def __init__(self, threads, engines, affinity=False, flush_denormals=True):
        if not available():
            raise CgpError("--workers processes needs an OS that can fork() (Linux, macOS); "
                           "use --workers threads")
        for engine in engines:
            if engine.inputs is None:
                raise CgpError("an engine run by worker processes must be built with "
                               "shared=True")
        self.threads, self.flush = threads, flush_denormals
        self.engines = list(engines)
        self.broken = None
        # next call to hand out, calls in this run
        self.counter = aligned_zeros(2, np.int64, shared=True)
        ctx = multiprocessing.get_context("fork")
        self.lock = ctx.Lock()
        pinnable = affinity and hasattr(os, "sched_getaffinity")
        cpus = sorted(os.sched_getaffinity(0)) if pinnable else []
        pipes = [ctx.Pipe() for _ in range(threads - 1)]
        self.procs, self.conns = [], [mine for mine, _ in pipes]
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a process with threads may deadlock the child if
            # another thread holds a lock the child then takes. The only other threads here are
            # idle ones (BLAS's, other pools' workers) and the child never takes their locks.
            warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
            for w in range(1, threads):
                proc = ctx.Process(target=_serve, name=f"cgp-worker-{w}", daemon=True,
                                   args=(w, pipes, self.engines, self.counter, self.lock,
                                         flush_denormals))
                proc.start()
                if cpus:
                    os.sched_setaffinity(proc.pid, {cpus[w % len(cpus)]})
                self.procs.append(proc)
        for _, theirs in pipes:  # so that a worker's death reads as the end of its pipe
            theirs.close()
        for engine in self.engines:
            engine.procs = self

    def run(self, engine, iteration, seed):
        """Every call of one engine run, the caller taking its share. Returns when all are
        done; the first exception raised in any worker is raised here."""
        if self.broken:
            raise CgpError(self.broken)
        tasks = len(engine.groups)
        self.counter[:] = 0, tasks
        index = self.engines.index(engine)
        error, sent = None, []
        for w, conn in enumerate(self.conns[:max(0, min(self.threads, tasks) - 1)], 1):
            try:
                conn.send((index, iteration, seed))
                sent.append((w, conn))
            except OSError:
                error = error or self._lost(w)
        state = fpenv.set_flush(self.flush)
        try:
            if error is None:
                _take_calls(engine, 0, iteration, seed, self.counter, self.lock)
        except BaseException as e:  # re-raised below, once the workers have stopped
            error = e
        finally:
            fpenv.restore(state)
        for w, conn in sent:
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                reply = self._lost(w)
            error = error or reply
        if error is not None:
            raise error

    def _lost(self, w):
        """The error for worker w found dead; every later run raises it too."""
        proc = self.procs[w - 1]
        proc.join(timeout=1)
        code = proc.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}" if code is not None else "no exit code")
        self.broken = f"worker process {w} ended unexpectedly ({how}); the run cannot go on"
        return CgpError(self.broken)

    def close(self):
        """Ends the workers."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            conn.close()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self.procs, self.conns = [], []
        for engine in self.engines:
            engine.procs = None


def _take_calls(engine, w, iteration, seed, counter, lock):
    """Runs calls of the current run until none is left; the first exception stops the
    handing out of calls, as in Pool."""
    while True:
        with lock:
            g = int(counter[0])
            if g >= counter[1]:
                return
            counter[0] = g + 1
        try:
            engine.work(w, g, iteration, seed, engine.inputs)
        except BaseException:
            with lock:
                counter[0] = counter[1]
            raise


def _serve(w, pipes, engines, counter, lock, flush):
    """A worker process's life: run calls of the engine each message names, reply with
    None or the exception raised, end at None or when the main process's end closes."""
    # Ctrl-C and a hang-up reach the whole process group: the main process decides what
    # they do (cgp train's --sigint-effect, --sighup-effect) and then closes the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    conn = pipes[w - 1][1]
    for k, (mine, theirs) in enumerate(pipes):   # only its own end stays open here
        mine.close()
        if k != w - 1:
            theirs.close()
    fpenv.set_flush(flush)
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=1)   # a forked BLAS would start threads of its own
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, iteration, seed = message
        try:
            _take_calls(engines[index], w, iteration, seed, counter, lock)
            reply = None
        except BaseException as error:
            reply = error
        try:
            conn.send(reply)
        except OSError:     # the main process has gone: nobody to reply to
            return
        except Exception:   # an exception that cannot be pickled arrives as its text
            conn.send(RuntimeError(f"worker process {w}:\n"
                                   + "".join(traceback.format_exception(reply))))
