"""The CPU's treatment of subnormal (denormal) floats, per thread.

Arithmetic that produces or reads subnormals (float32 below 1.2e-38) runs through a slow
microcode path on x86 CPUs, tens of times slower per operation. Training reaches them when
gradients underflow, e.g. once a net fits its data: cifar10_quick on an easy data set ran 10x
slower per step after 30 iterations. x86-64's MXCSR register has two bits that avoid it:
FTZ (flush results that would be subnormal to zero) and DAZ (read subnormal inputs as zero).
TensorFlow sets both for its threads; Caffe and PyTorch leave them off by default.

They are per thread, so the engine sets them in each of its workers and around work it runs
in the calling thread (cgp.runtime.pool.Pool); every thread count runs the same arithmetic.
"""
import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")
FLUSH_BITS = (1 << 15) | (1 << 6)   # FTZ, DAZ


def _mxcsr_call(builder, name, slot):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]), name)
    builder.call(fn, [builder.bitcast(slot, ir.IntType(8).as_pointer())])


@intrinsic
def _read_mxcsr(typingctx):
    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        _mxcsr_call(builder, "llvm.x86.sse.stmxcsr", slot)
        return builder.zext(builder.load(slot), ir.IntType(64))
    return types.int64(), codegen


@intrinsic
def _write_mxcsr(typingctx, value):
    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        builder.store(builder.trunc(args[0], ir.IntType(32)), slot)
        _mxcsr_call(builder, "llvm.x86.sse.ldmxcsr", slot)
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@njit(cache=True, nogil=True)
def _set_flush(on):
    old = _read_mxcsr()
    _write_mxcsr(old | FLUSH_BITS if on else old & ~FLUSH_BITS)
    return old


@njit(cache=True, nogil=True)
def _restore(state):
    _write_mxcsr(state)


def set_flush(on):
    """Turn flushing of subnormals on or off for the calling thread; returns the previous
    state for restore(). A no-op (returning None) on CPUs other than x86-64."""
    return _set_flush(on) if SUPPORTED else None


def restore(state):
    if state is not None:
        _restore(state)


def flushing():
    """Whether the calling thread flushes subnormals (FTZ and DAZ both set)."""
    return SUPPORTED and _read_state() & FLUSH_BITS == FLUSH_BITS


@njit(cache=True, nogil=True)
def _read_state():
    return _read_mxcsr()
