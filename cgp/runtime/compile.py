"""A first run's kernels compiled on every core: before `cgp train` starts, forked processes
each train the same net for two iterations on a Trainer of their own (one thread) and share
out the compiling, so that the run itself finds Numba's on-disk cache (cache=True) filled.
Not here: what the kernels compute, or where the cache lives (cgp.runtime's locators).

How the work is shared: the first process to call a kernel from Python claims it (a file
created with O_EXCL in a folder they share) and compiles it, with everything it calls. A
process that finds a kernel claimed by another skips the call where the kernel returns
nothing (its outputs are then stale, which changes no type and so no later compile), and
waits where a value comes back until the claimer has it, and then loads it from the cache
(or, after a minute, compiles it for itself without saving it). Only a kernel's claimer
writes its cache entries: Numba's index of a function is rewritten whole by whoever saves an
overload of it, and two processes saving overloads of one function at once could pair an
index entry with the other's machine code.

So that the processes' work is balanced and each callee compiles once, they also leave
kernels unclaimed (Share): the second begins with an iteration that only notes the kernels
returning nothing, then compiles them largest first while the first walks the net from its
test pass; a process leaves a file's kernels to another that is compiling a kernel of that
file that shares callees with the one met (SHARED_SOURCE), and takes at its end what no one
did; a kernel returning a value that is not a process's own may run as Python over small
arrays instead of being compiled or awaited (conv's shape functions at the set-up).

Nothing here can make stale code run: what the run loads is decided by Numba's cache index,
which keys each entry by the signature and the CPU (name and features) and is thrown away
when the defining file's time stamp or size, Numba's version, or (cgp.runtime.SourceStamp)
any compiled source of cgp changes. The processes only fill it. A file in the cache folder
(`cgp-compiled-<key>`) records that this net was compiled for those sources, that CPU and
that Numba, so that later runs do not start the processes; where it is wrong (the cache
deleted, say) the run compiles what it misses itself, as without this module.
"""
import ast
import functools
import hashlib
import inspect
import os
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

# More processes than this share out too few kernels (LeNet's training calls 28 from
# Python) to be worth a Trainer each.
MOST = 8
# Below this many cores the processes are not started unless asked for. On 2 quiet cores
# two processes cut a cold LeNet run from 26 - 28 s to 18 - 21 s (bench/README.md, the first
# run's compile); where other jobs hold the cores, they gain little.
FEWEST = 2
# Python runs a kernel's loops some hundred times slower than its machine code: a kernel
# runs as Python (Share.interpreting) only over arrays this small in all (conv's sizes,
# LeNet's loss), where that is quicker than the compile.
PYTHON_ELEMENTS = 1 << 16
# A process that has claimed or finished nothing for this long is stopped.
STALLED_SECONDS = 300
# Two kernels of one file compile side by side in two processes where they share callees of
# fewer characters of source than this (shared_source), which then compile in both: conv's
# _dx_columns beside its other backward kernels (1,321: _tile_unit, _valid_range, ...), fc's
# bias_parts and pooling's backward beside their forward kernels (0). Conv's forward and
# backward kernels (5,600 - 12,700: widen, the tile choice) stay with one process.
SHARED_SOURCE = 2000


def precompile(sp, solver_path, config, log, processes=None):
    """Compiles the kernels that training `sp` (a SolverParameter) with RunConfig `config`
    calls, in `processes` processes (None: one per core, on FEWEST cores or more), unless the
    cache holds them already (by its marker) or there is no use: a GPU, no fork(), MPI ranks
    (each would start its own). With fewer than 2 processes, where the run's workers are
    forked processes, in this process before they are forked: each worker would otherwise
    compile every kernel it runs, as many compiles as workers (a cold LeNet run on 2 workers
    took 56 s of CPU against 31 s on one; bench/README.md). Returns the number of kernels
    compiled."""
    from cgp.runtime.procs import forks

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if processes is None:
        processes = cores if cores >= FEWEST else 0
    processes = min(processes, MOST)
    ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
    here = processes < 2 and forks(config.workers, config.threads)
    if (processes < 2 and not here) or config.device != "cpu" or not hasattr(os, "fork") \
            or ranks > 1:
        return 0
    folder = cache_folder()
    if folder is None:
        return 0
    marker = folder / f"cgp-compiled-{cache_key(sp, solver_path, config)}"
    if marker.exists():
        return 0
    if here:
        count, finished = _compile_here(sp, solver_path, config, log), True
    else:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="cgp-compile-") as claims:
            count, seconds, finished = _share_out(sp, solver_path, config, Path(claims),
                                                  processes, log)
        if count:
            log(f"compiled {count} kernels in {processes} processes in {seconds:.1f} s "
                "(cached for later runs)")
    if finished:
        try:
            marker.write_text("")
        except OSError:
            pass   # a cache folder that cannot be written: Numba says so itself
    return count


def _compile_here(sp, solver_path, config, log):
    """Compiles, in this process, what training `sp` calls (exercise, on one thread); says
    how far it is as a first run does (compile_notice). Returns the kernels compiled. An
    error is left to the run, which meets it again and reports it."""
    from cgp.commands.timing import compile_notice

    with compile_notice(log) as notice:
        try:
            exercise(sp, solver_path, replace(config, threads=1, workers="threads",
                                              heartbeat=None))
        except Exception:   # noqa: BLE001  (the run raises it again, as its own)
            pass
    return notice.count


def exercise(sp, solver_path, config):
    """Calls every kernel that training `sp` with `config` calls: one batch of each test net
    and two training iterations, on a Trainer that writes nothing (no snapshot, no log)."""
    from threadpoolctl import threadpool_limits

    from cgp.train import Trainer

    trainer = Trainer(one_test_batch(sp), solver_path, replace(config, progress=False),
                      log=lambda line: None)
    try:
        with threadpool_limits(limits=1):
            for i in range(len(trainer.test_nets)):
                trainer.test(i)
            trainer.steps(2)
    finally:
        trainer.close()


def one_test_batch(sp):
    """A copy of SolverParameter `sp` whose test passes are one batch each: a whole pass
    calls no other kernel, and on one thread a large net's could take minutes."""
    short = type(sp)()
    short.CopyFrom(sp)
    for i in range(len(short.test_iter)):
        short.test_iter[i] = 1
    return short


def cache_folder():
    """Where Numba caches the layers' kernels (the folder of one of them), or None: the
    marker goes where their cache goes, and is cleared with it."""
    from cgp.kernels import elementwise
    try:
        return Path(elementwise.copy._cache._cache_path)
    except AttributeError:
        return None


def cache_key(sp, solver_path, config):
    """What the compiled kernels depend on, hashed: the nets (their text after reading),
    the settings that shape the calls, cgp's compiled sources, Numba and the CPU (Numba's)."""
    import llvmlite.binding as llvm
    import numba
    from numba.core import config as numba_config

    from cgp.runtime import compiled_sources, sources_hash
    from cgp.training.solver_files import solver_nets

    train, tests = solver_nets(sp, solver_path)
    digest = hashlib.sha256()
    for part in ([str(train[0])] + [str(t[0]) for t in tests]
                 + [str(config.chunks), str(config.staleness), config.denormals,
                    config.workers, sources_hash(compiled_sources()), numba.__version__,
                    # The CPU that Numba compiles for, as its cache index keys it:
                    # NUMBA_CPU_NAME and NUMBA_CPU_FEATURES where set, else the host's.
                    numba_config.CPU_NAME or llvm.get_host_cpu_name(),
                    numba_config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()]):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:24]


def _share_out(sp, solver_path, config, claims, n, log):
    """Forks n processes that train and compile (_compile_in_child), and waits for them,
    saying how far they are; returns (kernels compiled, seconds, whether every process
    finished its training)."""
    started = time.perf_counter()
    log(f"compiling kernels in {n} processes (first run only; cached afterwards)")
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:   # the child: never returns
                _compile_in_child(sp, solver_path, config, claims, len(children))
            children.append(pid)
        said, changed, done, finished = 0, time.perf_counter(), 0, True
        while children:
            time.sleep(0.2)
            for pid in list(children):
                ended, status = os.waitpid(pid, os.WNOHANG)
                if ended:
                    children.remove(pid)
                    finished = finished and os.waitstatus_to_exitcode(status) == 0
            finished = len(list(claims.glob("*.done")))
            if finished != done:
                done, changed = finished, time.perf_counter()
            if done >= said + 10:
                said = done - done % 10
                log(f"compiling kernels: {said} compiled, {time.perf_counter() - started:.0f} s")
            if time.perf_counter() - changed > STALLED_SECONDS:
                finished = False
                break   # the run compiles what is left
    finally:
        for pid in children:
            try:
                os.kill(pid, 15)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return done, time.perf_counter() - started, finished


def _compile_in_child(sp, solver_path, config, claims, index=0):
    """A forked process's life: train two iterations and test once with the kernels shared
    out (Share), then exit without running the parent's exit handlers. The first process
    runs its set-up's sizes as Python (Share.interpreting) and starts the test pass's
    kernels at once; the others compile those sizes, then begin at the other end: one
    iteration that calls no kernel returning nothing, only notes it (Share.deferring), then
    those kernels compiled largest first, while the first compiles the forward ones. Each
    compiles at the end what it left to another (Share.leaves) and no one has taken."""
    status = 1
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        share = Share(claims)
        share.install()
        from cgp.train import Trainer
        share.interpreting = not index   # the set-up's sizes; see Share.__init__
        trainer = Trainer(one_test_batch(sp), solver_path,
                          replace(config, threads=1, download=False, progress=False),
                          log=lambda line: None)
        share.interpreting = False
        try:
            if index:
                share.deferring = share.interpreting = True
                _try(trainer.steps, 1)
                share.deferring = share.interpreting = False
                share.compile_deferred()
            for i in range(len(trainer.test_nets)):
                _try(trainer.test, i)
            _try(trainer.steps, 2)
            share.compile_deferred(wait=True)   # those left to another that it has not taken
        finally:
            trainer.close()
        status = 0
    finally:
        os._exit(status)


def _try(fn, *args):
    """Runs fn; a failure (stale outputs of a skipped kernel can make a check fail) ends
    only this part: the run compiles whatever it then misses."""
    try:
        fn(*args)
    except Exception:   # noqa: BLE001
        pass


class Share:
    """The hooks of one compiling process into Numba: claim a kernel called from Python, or
    skip or compile it unsaved (see the module's note); save the cache entries of claimed
    kernels alone."""

    def __init__(self, claims, prefix="cgp."):
        self.claims, self.prefix = claims, prefix
        self.mine = set()
        # While deferring, a kernel that returns nothing and is not this process's is not
        # claimed but skipped, and noted with its argument types for compile_deferred; so
        # is one of a file another process compiles from (leaves): a file's kernels share
        # callees, which would compile in both.
        self.deferring = False
        self.deferred = {}   # (name, argument types) -> dispatcher, in the order met
        self.left = set()    # modules whose kernels are left to another process (leaves)
        # While interpreting, a kernel that returns a value and is not this process's nor
        # ready runs as Python (with whatever it calls), neither claimed nor awaited: the
        # Trainer's set-up asks conv for its scratch sizes, whose compile would keep the
        # first process from its test pass for seconds; the others compile them. Where
        # Python cannot run it, or its arrays are large (small), it is claimed (or
        # awaited) as any other.
        self.interpreting = False
        self.in_python = False   # a kernel is running as Python now
        self.not_in_python = set()

    def install(self):
        from numba.core import caching
        from numba.core.dispatcher import Dispatcher

        compile_for_args = Dispatcher._compile_for_args
        save_overload = caching.Cache.save_overload
        share = self

        def claiming_compile(dispatcher, *args, **kws):
            name = share.name(dispatcher.py_func)
            if name is None:
                return compile_for_args(dispatcher, *args, **kws)
            if share.in_python:   # called by a kernel that runs as Python
                return dispatcher.py_func
            if name not in share.mine and not kws and returns_nothing(dispatcher.py_func) \
                    and (share.deferring or share.leaves(dispatcher.py_func)):
                types = tuple(dispatcher.typeof_pyval(a) for a in args)
                share.deferred.setdefault((name, types), dispatcher)
                return _skip
            if share.interpreting and name not in share.mine | share.not_in_python \
                    and small(args) and not (share.claims / f"{name}.ready").exists():
                return share.in_python_else_awaited(name, dispatcher)
            if share.claim(name):
                return share.compiled(name, dispatcher,
                                      lambda: compile_for_args(dispatcher, *args, **kws))
            if returns_nothing(dispatcher.py_func):
                return _skip
            # Its claimer is compiling it now: loaded from the cache once it is there, it
            # costs no second compile (unsaved, where the claimer takes too long).
            share.wait_for(name)
            return compile_for_args(dispatcher, *args, **kws)

        def saving_claimed(cache, sig, data):
            if share.name(cache._py_func) in share.mine:
                save_overload(cache, sig, data)

        Dispatcher._compile_for_args = claiming_compile
        caching.Cache.save_overload = saving_claimed

    def compiled(self, name, dispatcher, compile):
        """compile() of claimed kernel `name`, its outcome marked for the other processes
        (ready: compiled, loaded or failed; done: compiled, not loaded)."""
        misses = sum(dispatcher._cache_misses.values())
        try:
            return compile()
        finally:
            (self.claims / f"{name}.ready").touch()
            if sum(dispatcher._cache_misses.values()) > misses:
                (self.claims / f"{name}.done").touch()

    def in_python_else_awaited(self, name, dispatcher):
        """A call of kernel `name` that runs its Python function, or (where Python cannot
        run it) the machine code, claimed and compiled, or awaited."""
        def call(*args):
            self.in_python = True
            try:
                return dispatcher.py_func(*args)
            except Exception:   # noqa: BLE001  (numba's own functions, say)
                self.not_in_python.add(name)
            finally:
                self.in_python = False
            return dispatcher(*args)   # claimed, or awaited, now
        return call

    def leaves(self, py_func):
        """Whether this process leaves the kernels of py_func's module to another: one that
        was compiling a kernel of it that shares callees with py_func (beside_another) when
        this process first met one it had not claimed."""
        module = py_func.__module__
        if module not in self.left and self.beside_another(py_func):
            self.left.add(module)
        return module in self.left

    def beside_another(self, py_func):
        """Whether another process is compiling now a kernel of py_func's module that
        shares SHARED_SOURCE or more characters of callees with it (shared_source; one that
        cannot be found counts as sharing them all): both would compile those."""
        module = py_func.__module__
        names = {path.name for path in self.claims.iterdir()}
        return any(name.startswith(f"{module}.") and name not in self.mine
                   and not name.endswith((".ready", ".done")) and f"{name}.ready" not in names
                   and shared_source(py_func, kernel(name[len(module) + 1:], module))
                   >= SHARED_SOURCE
                   for name in names)

    def compile_deferred(self, wait=False):
        """Compiles the kernels noted while deferring that no other process has claimed,
        the largest first (source_size). One of a file that another process is compiling
        from now is kept for later, or where `wait`, compiled once that is done (at most a
        minute on): the other may take it, its callees compiled. A failure leaves the
        kernel to the run, which meets it again."""
        noted = sorted(self.deferred.items(), key=lambda kv: -source_size(kv[1].py_func))
        self.deferred = {}
        deadline = time.perf_counter() + 60.0
        while noted:
            noted = [kv for kv in noted
                     if kv[0][0] in self.mine or not (self.claims / kv[0][0]).exists()]
            free = [kv for kv in noted if not self.beside_another(kv[1].py_func)]
            if noted and not free:
                if not wait:
                    self.deferred = dict(noted)
                    return
                if time.perf_counter() < deadline:
                    time.sleep(0.02)
                    continue
            for (name, types), dispatcher in (free or noted)[:1]:
                noted.remove(((name, types), dispatcher))
                if self.claim(name):
                    try:
                        self.compiled(name, dispatcher, lambda: dispatcher.compile(types))
                    except Exception:   # noqa: BLE001
                        pass

    def name(self, py_func):
        """The kernel's claim name (its module and qualified name), None if not cgp's."""
        module = getattr(py_func, "__module__", "") or ""
        if not module.startswith(self.prefix):
            return None
        return f"{module}.{py_func.__qualname__}".replace("<", "(").replace(">", ")")

    def wait_for(self, name, seconds=60.0):
        """Waits until the claimer of kernel `name` has it, at most `seconds`."""
        ready = self.claims / f"{name}.ready"
        deadline = time.perf_counter() + seconds
        while not ready.exists() and time.perf_counter() < deadline:
            time.sleep(0.02)

    def claim(self, name):
        """Whether this process compiles kernel `name`: it claimed it, now or before."""
        if name in self.mine:
            return True
        try:
            os.close(os.open(self.claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        self.mine.add(name)
        return True


def small(args):
    """Whether a kernel's array arguments hold at most PYTHON_ELEMENTS elements in all."""
    return sum(getattr(a, "size", 0) for a in args if hasattr(a, "dtype")) <= PYTHON_ELEMENTS


def _skip(*args, **kws):
    """A skipped kernel's call."""
    return None


def source_size(py_func):
    """The characters of a kernel's source and of the jitted functions it calls, each
    counted once: roughly how long it takes to compile. 0 where a source cannot be read."""
    return sum(compiled_with(py_func).values())


def shared_source(a, b):
    """The characters of source that kernels a and b (Python functions) both compile (their
    callees in common, or one of them where the other calls it); a's all where b is None."""
    if b is None:
        return source_size(a)
    theirs = compiled_with(b)
    return sum(size for f, size in compiled_with(a).items() if f in theirs)


@functools.cache
def compiled_with(py_func):
    """What compiling kernel py_func compiles, {function: characters of its source}: itself
    and the jitted functions it calls, through its module's globals, each once; only those
    whose source can be read (nothing where py_func's cannot)."""
    found, todo = {}, [py_func]
    while todo:
        f = todo.pop()
        if f in found:
            continue
        try:
            found[f] = len(inspect.getsource(f))
        except (OSError, TypeError):
            continue
        space = getattr(f, "__globals__", {})
        for name in getattr(getattr(f, "__code__", None), "co_names", ()):
            callee = getattr(space.get(name), "py_func", None)
            if callee is not None:
                todo.append(callee)
    return found


def kernel(qualname, module):
    """The Python function of kernel `qualname` of `module` (a claim's name), or None where
    it is not a module-level kernel of an imported module."""
    return getattr(getattr(sys.modules.get(module), qualname, None), "py_func", None)


@functools.cache   # a skipped kernel asks again at every call: its source parsed once
def returns_nothing(py_func):
    """Whether a kernel's source has no `return value` (so a skipped call's None is what it
    returns); False where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(py_func)))
    except (OSError, TypeError, SyntaxError):
        return False
    return not any(isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom))
                   and getattr(node, "value", None) is not None for node in ast.walk(tree))
