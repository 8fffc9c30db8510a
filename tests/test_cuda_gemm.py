"""The device's matrix-product kernel (cgp/kernels/cuda_gemm.py) on Numba's CUDA simulator,
in a process of its own (NUMBA_ENABLE_CUDASIM must be set before Numba starts): against
NumPy in float64, and one part's (rows', columns') bits the same alone as among others, in
float32. Tiny shapes: the simulator runs every thread of a block in Python. The GPU runs
the same checks compiled (test_the_cuda_gemm_on_the_gpu)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from test_device import GPU

CHECKS = r'''
import numpy as np
import pytest
from cgp.kernels.cuda_gemm import TILE, launch, product

rng = np.random.default_rng(7)
# Three parts of ragged extent along K (a chunk's rows of a weight gradient), across two
# k-tiles, added to what c holds.
starts = np.array([0, 7, 20, 23], np.int64)
a, b = rng.standard_normal((5, 23)), rng.standard_normal((23, 6))
c0 = rng.standard_normal((3, 5, 6))
c = c0.copy()
launch(a, b, starts, c, accumulate=True)
for z in range(3):
    lo, hi = starts[z], starts[z + 1]
    assert np.allclose(c[z], c0[z] + a[:, lo:hi] @ b[lo:hi], rtol=0, atol=1e-13), z

# float32, a transposed operand (read through its strides): each part alone (copied: the
# simulator copies host arrays over whole) gives the bits it gives among the others; rows
# 1:4 alone give the bits of those rows of the whole product.
a32 = rng.standard_normal((23, 5)).astype(np.float32).T          # (5, 23), strided
b32 = (rng.standard_normal((23, 6)) * 100).astype(np.float32)
together = np.zeros((3, 5, 6), np.float32)
launch(a32, b32, starts, together)
for z in (0, 2):
    lo, hi = starts[z], starts[z + 1]
    alone = np.zeros((5, 6), np.float32)
    product(np.ascontiguousarray(a32[:, lo:hi]), b32[lo:hi], alone)
    assert np.array_equal(alone, together[z]), z
rows = np.zeros((3, 6), np.float32)
product(np.ascontiguousarray(a32[1:4, 7:20]), b32[7:20], rows)
assert np.array_equal(rows, together[1, 1:4])
print("ok", TILE)
'''


def test_the_cuda_gemm_on_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "16"], done.stderr[-3000:]


def has_cuda():
    from cgp.device import cuda_kernels
    return cuda_kernels()[0]


@pytest.mark.skipif(not has_cuda(), reason="needs a GPU and Numba's CUDA target (NVVM)")
def test_the_cuda_gemm_on_the_gpu():
    """The simulator's checks, compiled by NVVM and run on the GPU (bench/gpu_check.sh)."""
    done = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "16"], done.stderr[-3000:]


@GPU
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cublas_gives_a_chunk_the_same_bits_among_16(dtype):
    """Whether cuBLAS qualifies for all of a device's chunks in one launch: a chunk's
    products (a convolution's forward, (K, CRS) @ (CRS, PQ), and its weight gradient) alone
    and among 16 in one batched call, and as 16 chunks' columns of one product. A failure
    here says the library call does not qualify (it picks its algorithm from the shapes);
    cgp/kernels/cuda_gemm.py's kernel does."""
    import cupy
    rng = np.random.default_rng(3)
    w = cupy.asarray(rng.standard_normal((64, 576)).astype(dtype))
    col = cupy.asarray(rng.standard_normal((16, 576, 196)).astype(dtype))
    alone = cupy.matmul(w, col[5])
    batched = cupy.matmul(w[None], col)[5]
    wide = cupy.matmul(w, cupy.concatenate(list(col), axis=1))[:, 5 * 196:6 * 196]
    assert cupy.array_equal(alone, batched) and cupy.array_equal(alone, wide)
    dy = cupy.asarray(rng.standard_normal((16, 64, 196)).astype(dtype))
    grad_alone = cupy.matmul(dy[5], col[5].T)
    grad_batched = cupy.matmul(dy, col.transpose(0, 2, 1))[5]
    assert cupy.array_equal(grad_alone, grad_batched)
