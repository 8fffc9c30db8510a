"""Waiting for another thread by watching memory, without the interpreter lock.

A worker that waits by sleeping (a futex, as threading's locks and events do) lets its CPU
go idle; on a virtual machine the hypervisor then takes the virtual CPU away, and waking it
costs the wait for the host to schedule it again, which Linux counts as steal time. A
training step has several hand-overs (the chunks, the reduction, the update), so a pool that
sleeps between them pays that cost several times a step. OpenMP runtimes spin for a while
before they sleep for the same reason (KMP_BLOCKTIME). The spin runs in compiled code
that releases the lock, so the thread it waits for is never held up by it.
"""
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _load_acquire(typingctx, flags, index):
    """flags[index] of a 1-d int64 array, read with an atomic acquire load: the compiler
    may not hoist it out of a loop, and later reads see what the writer wrote before it."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64 and flags.ndim == 1):
        return None
    sig = types.int64(flags, types.intp)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        pointer = builder.gep(array.data, [args[1]])
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
