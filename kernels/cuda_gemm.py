"""Matrix products for the device engine on Numba's CUDA target, whose bits for one chunk do
not depend on how many chunks share the launch: every output element is one thread's sum
over its k in index order, through a fixed TILE x TILE tile in shared memory (no split of k
across threads, no atomics). So rows (columns) of a product are the same bits whether the
launch holds one chunk's or sixteen chunks' rows (columns), and a per-part product (a
weight gradient, one per chunk) is the same for a part computed alone or among others.

Not the CPU's bits: NVVM fuses acc + a * b into one rounding (FMA), and the CPU's kernels
add in other orders; the same on every launch of one GPU model.

Letters: Z parts (chunks), M N the output's rows and columns, K the summed axis.
Launch with launch(): a grid of (ceil(N / TILE), ceil(M / TILE), Z) blocks of TILE x TILE.
Numba's simulator (NUMBA_ENABLE_CUDASIM=1) runs them on the CPU, slowly: tests use tiny
shapes (tests/test_cuda_gemm.py). Imports numba.cuda: only the device path imports this.
"""
import math

import numpy as np
from numba import cuda, float32, float64

TILE = 16


def _part_gemm(dtype):
    """The kernel for one dtype (a shared array's dtype is fixed when it compiles)."""

    @cuda.jit
    def part_gemm(a, b, starts, c, accumulate):
        """a (M, Kall), b (Kall, N), starts (Z + 1,) int64, c (Z, M, N): for each part z,
        c[z] = a[:, starts[z]:starts[z + 1]] @ b[starts[z]:starts[z + 1], :], added to c[z]
        where accumulate. Strided views are read as they are (a transposed operand needs no
        copy)."""
        sa = cuda.shared.array((TILE, TILE), dtype)
        sb = cuda.shared.array((TILE, TILE), dtype)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        col = cuda.blockIdx.x * TILE + tx
        row = cuda.blockIdx.y * TILE + ty
        z = cuda.blockIdx.z
        M, N = a.shape[0], b.shape[1]
        k_lo, k_hi = starts[z], starts[z + 1]
        acc = dtype(0.0)
        for k0 in range(k_lo, k_hi, TILE):
            # Outside the matrices the tiles hold zeros, whose products add exact zeros.
            ka, kb = k0 + tx, k0 + ty
            sa[ty, tx] = a[row, ka] if row < M and ka < k_hi else dtype(0.0)
            sb[ty, tx] = b[kb, col] if kb < k_hi and col < N else dtype(0.0)
            cuda.syncthreads()
            for kk in range(TILE):
                acc += sa[ty, kk] * sb[kk, tx]
            cuda.syncthreads()
        if row < M and col < N:
            if accumulate:
                c[z, row, col] += acc
            else:
                c[z, row, col] = acc

    return part_gemm


KERNELS = {np.dtype(np.float32): _part_gemm(float32), np.dtype(np.float64): _part_gemm(float64)}


def launch(a, b, starts, c, accumulate=False):
    """c[z] (+)= a[:, starts[z]:starts[z+1]] @ b[starts[z]:starts[z+1], :] for every part z
    (see part_gemm); a, b, c of one dtype, device arrays (CuPy's, or NumPy's in the
    simulator), starts an int64 array of Z + 1 offsets on the device."""
    M, N, Z = a.shape[0], b.shape[1], c.shape[0]
    grid = (math.ceil(N / TILE), math.ceil(M / TILE), Z)
    KERNELS[np.dtype(c.dtype)][grid, (TILE, TILE)](a, b, starts, c, accumulate)


def product(a, b, c, accumulate=False):
    """c (M, N) (+)= a (M, K) @ b (K, N): one part over the whole of K."""
    starts = np.array([0, a.shape[1]], np.int64)
    if not isinstance(c, np.ndarray):   # a device array: its offsets on the device too
        starts = cuda.to_device(starts)
    launch(a, b, starts, c.reshape((1,) + c.shape), accumulate)
