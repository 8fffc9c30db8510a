"""Where a run computes, chosen in this one place: the CPU engine (cgp.engine, Numba kernels
on worker threads or processes) or the device engine (cgp.device.engine: each chunk's layers
as array operations on a GPU through CuPy, or on the host through NumPy standing in for
CuPy, which is how the GPU path is tested without a GPU).

    backend = select_backend(device)          # None for "cpu"
    engine = make_engine(backend, net, chunks, pool, comm, backward=True)
    step = make_step(engine, solver, comm, iter_size, staleness)

The rest of a run (the fixed-order sums, the exchange across ranks, the solver's update,
snapshots) is the same code for every device: the device engine hands each chunk's
gradient to the communicator as the CPU engine does.
"""
import os

from cgp.engine import Engine
from cgp.errors import CgpError, require

DEVICES = ("cpu", "gpu", "numpy")

# The launchers' variables that say which rank of its node a process is (Open MPI's first).
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


class ArrayBackend:
    """An array module and its copies between host (NumPy) and device arrays."""

    def __init__(self, name, xp, to_numpy, description):
        self.name, self.xp, self.description = name, xp, description
        self._to_numpy = to_numpy

    def copy_in(self, device, host):
        """device[...] = host, across to the device."""
        device[...] = self.xp.asarray(host)

    def copy_out(self, host, device):
        """host[...] = device, back to the host."""
        host[...] = self._to_numpy(device)

    def to_numpy(self, device):
        """A host (NumPy) array of device's values (device itself with NumPy)."""
        return self._to_numpy(device)


def check_device(device, threads):
    """Refuses an unknown device, and more than one worker with a device: one worker per
    rank drives it (more devices come from more ranks)."""
    if device not in DEVICES:
        raise CgpError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if device != "cpu" and threads != 1:
        raise CgpError(f"--device {device}: one worker per rank drives the device; --threads "
                       f"must be 1 (run more ranks for more devices)")


def local_rank():
    """This process's rank among those of its node (0 where no launcher says)."""
    for name in LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def select_backend(device, device_id=None):
    """None for the CPU engine, else the ArrayBackend of `device`: "gpu" (CuPy; GPU
    `device_id`, by default the local rank's, as Horovod and Caffe-MPI give one GPU per rank)
    or "numpy"."""
    if device == "cpu":
        return None
    if device == "numpy":
        import numpy
        return ArrayBackend("numpy", numpy, numpy.asarray,
                            "NumPy standing in for CuPy: the GPU path on the host")
    if device != "gpu":
        raise CgpError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    cupy = require("cupy", "gpu", "--device gpu", package="cupy-cuda12x")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise CgpError(f"--device gpu: CUDA finds no usable GPU here ({error})") from None
    if count < 1:
        raise CgpError("--device gpu: CUDA finds no GPU on this machine")
    index = local_rank() % count if device_id is None else device_id
    if not 0 <= index < count:
        raise CgpError(f"GPU {index}: CUDA finds {count} GPU(s) here, numbered 0 to {count - 1}")
    cupy.cuda.Device(index).use()
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    return ArrayBackend("gpu", cupy, cupy.asnumpy, f"GPU {index} of {count} ({name})")


def cuda_kernels():
    """(True, description) where Numba's CUDA target compiles and runs cgp's device kernels
    here (cgp/kernels/cuda_gemm.py: a GPU, and NVVM, which some images lack), else (False,
    why). The one place that says whether they can run; bench/gpu_check.sh records it.
    The ops still make their products with cuBLAS, one chunk per call (DESIGN.md 19)."""
    try:
        import numpy
        from numba import cuda
        if not cuda.is_available():
            return False, "Numba finds no CUDA GPU"
        from cgp.kernels.cuda_gemm import product
        a = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
        c = numpy.zeros((2, 2), numpy.float32)
        product(a, a.T.copy(), c)
        if not numpy.array_equal(c, a @ a.T):
            return False, f"a test product came out wrong: {c.tolist()}"
        import numba
        where = "its simulator" if numba.config.ENABLE_CUDASIM else "a GPU"
        return True, f"Numba {numba.__version__} compiled and ran a test product on {where}"
    except Exception as error:   # NVVM missing, a driver too old: say which
        return False, f"{type(error).__name__}: {error}"


def make_step(engine, solver, comm, iter_size=1, staleness=0):
    """The training step over `engine`, chosen here once: cgp.device.step.DeviceStep (the
    batch's gradient, the update and the weights kept on the device) for a device engine of
    one rank without staleness or layer-wise rates, else cgp.step.DataParallelStep (each
    chunk's gradient copied to the host, summed, exchanged across ranks and applied there;
    the weights copied to the device at each run). Both give the same bits."""
    from cgp.step import DataParallelStep
    if (getattr(engine, "backend", None) is not None and comm.size == 1 and not staleness
            and not solver.layerwise):
        from cgp.device.step import DeviceStep
        return DeviceStep(engine, solver, comm, iter_size)
    return DataParallelStep(engine, solver, comm, iter_size, staleness)


def make_engine(backend, net, chunks, pool, comm, backward=True, params=None):
    """The engine of one net on `backend` (select_backend's); params: a copy of the net's
    parameters to run on instead of net.params (a float64 one runs in float64)."""
    if backend is None:
        return Engine(net, chunks, pool, comm, backward=backward, params=params)
    from cgp.device.engine import DeviceEngine
    return DeviceEngine(net, chunks, pool, comm, backend, backward=backward, params=params)
