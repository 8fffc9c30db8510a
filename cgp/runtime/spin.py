"""Waiting for another thread by watching memory, without the interpreter lock.

A worker that waits by sleeping (a futex, as threading's locks and events do) lets its CPU
go idle; on a virtual machine the hypervisor then takes the virtual CPU away, and waking it
costs the wait for the host to schedule it again, which Linux counts as steal time. A
training step has several hand-overs (the chunks, the reduction, the update), so a pool that
sleeps between them pays that cost several times a step. OpenMP runtimes spin for a while
before they sleep for the same reason (KMP_BLOCKTIME). The spin runs in compiled code
that releases the lock, so the thread it waits for is never held up by it.

Also the atomic operations on shared counters by which cgp.runtime.procs.ProcessPool posts runs and
hands out tasks across processes (fetch_add, exchange, take_ticket, post).
"""
from numba import njit, types
from numba.extending import intrinsic


def _counters(flags):
    """For typing: whether flags is what these operations work on, a 1-d int64 array."""
    return isinstance(flags, types.Array) and flags.dtype == types.int64 and flags.ndim == 1


def _element(context, builder, signature, args):
    """For codegen: the address of flags[index], the first two arguments."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(array.data, [args[1]])


@intrinsic
def _load_acquire(typingctx, flags, index):
    """flags[index] of a 1-d int64 array, read with an atomic acquire load: the compiler
    may not hoist it out of a loop, and later reads see what the writer wrote before it."""
    if not _counters(flags):
        return None
    sig = types.int64(flags, types.intp)

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature, args)
        return builder.load_atomic(pointer, "acquire", 8)
    return sig, codegen


@njit(cache=True, nogil=True)
def wait_while(flags, index, value, spins):
    """Watches flags[index] (int64) until it is no longer `value`, at most `spins` reads;
    returns what it read last (`value` when it gave up)."""
    for _ in range(spins):
        now = _load_acquire(flags, index)
        if now != value:
            return now
    return value


@njit(cache=True, nogil=True)
def wait_for(flags, index, target, spins):
    """Watches flags[index] (int64) until it reaches `target`, at most `spins` reads;
    returns what it read last."""
    now = _load_acquire(flags, index)
    for _ in range(spins):
        if now >= target:
            return now
        now = _load_acquire(flags, index)
    return now


@njit(cache=True, nogil=True)
def wait_for_all(flags, lo, hi, target, spins):
    """Watches flags[lo:hi] (int64), in index order, until each has reached `target`, at
    most `spins` reads after the first of each; returns `target` once all have, else the
    value below it that it read last."""
    left = spins
    for i in range(lo, hi):
        now = _load_acquire(flags, i)
        while now < target:
            if left <= 0:
                return now
            left -= 1
            now = _load_acquire(flags, i)
    return target


def _rmw_intrinsic(op):
    """An intrinsic (flags, index, value) -> old value of flags[index] (1-d int64), after an
    atomic sequentially consistent read-modify-write `op` ("add", "xchg") of it with value."""
    @intrinsic
    def rmw(typingctx, flags, index, value):
        if not _counters(flags):
            return None
        sig = types.int64(flags, types.intp, types.int64)

        def codegen(context, builder, signature, args):
            pointer = _element(context, builder, signature, args)
            return builder.atomic_rmw(op, pointer, args[2], "seq_cst")
        return sig, codegen
    return rmw


_fetch_add = _rmw_intrinsic("add")
_exchange = _rmw_intrinsic("xchg")


@intrinsic
def _compare_exchange(typingctx, flags, index, expected, value):
    """Sets flags[index] (1-d int64) to value if it holds expected, atomically (sequentially
    consistent); returns whether it did."""
    if not _counters(flags):
        return None
    sig = types.boolean(flags, types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature, args)
        pair = builder.cmpxchg(pointer, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return sig, codegen


@njit(cache=True, nogil=True)
def load(flags, index):
    """flags[index] (int64), read atomically."""
    return _load_acquire(flags, index)


@njit(cache=True, nogil=True)
def fetch_add(flags, index, value):
    """Adds value to flags[index] (int64) atomically; returns the value before."""
    return _fetch_add(flags, index, value)


@njit(cache=True, nogil=True)
def exchange(flags, index, value):
    """Sets flags[index] (int64) to value atomically; returns the value before."""
    return _exchange(flags, index, value)


@njit(cache=True, nogil=True)
def take_ticket(flags, index, run, tasks):
    """Takes the next task of run `run` from a ticket counter flags[index] (int64) that holds
    run << 32 | next task: returns the task's index, or -1 when the run has none left or is
    no longer the counter's (a later run has been posted), which leaves the counter as is.
    Tagging the count with its run keeps a worker that is late to leave one run from taking
    a task of the next with the old run's function."""
    while True:
        now = _load_acquire(flags, index)
        task = now & 0xFFFFFFFF
        if now >> 32 != run or task >= tasks:
            return -1
        if _compare_exchange(flags, index, now, now + 1):
            return task


@njit(cache=True, nogil=True)
def wake_sleepers(flags, first, stride, n, woken):
    """Clears the n sleep marks flags[first + k * stride] (int64, k < n) atomically and
    writes the k of those that were set (the workers to wake) into woken (n,) int64;
    returns how many."""
    count = 0
    for k in range(n):
        if _exchange(flags, first + k * stride, 0) != 0:
            woken[count] = k
            count += 1
    return count


@njit(cache=True, nogil=True)
def post(flags, posted, run, ticket, fields, values, args, data, marks, stride, woken):
    """Posts run number `run` to workers that watch flags[posted] (1-d int64), in one call
    rather than the interpreter's several, which every worker waits for: sets the ticket
    counter flags[ticket] to the run's first task (run << 32, atomically: a worker late to
    leave the last run takes no task of this one), flags[fields[k]] = values[k], and the
    bytes `data` into args (uint8); then flags[posted] = run, atomically, which publishes
    all of it. Then wakes: as wake_sleepers over the len(woken) sleep marks
    flags[marks + k * stride]; returns how many of them were set."""
    _exchange(flags, ticket, run << 32)
    for k in range(len(fields)):
        flags[fields[k]] = values[k]
    for i in range(len(data)):
        args[i] = data[i]
    _exchange(flags, posted, run)
    return wake_sleepers(flags, marks, stride, len(woken), woken)
