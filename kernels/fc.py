"""Inner-product (fully connected) kernels, Caffe's InnerProduct: y = x @ W^T + b, or x @ W when
the weight is stored transposed. Only the 2-d matrix product; the layer flattens the axes.

Forward and the input gradient run one BLAS matrix-vector product per row. A GEMM over the
chunk's rows would be faster for large chunks, but BLAS takes other paths, with other
rounding, for other row counts (OpenBLAS sends one or two rows through other kernels), so a
sample's result would depend on its chunk; a row-by-row product depends on the row alone. For
the few rows per chunk that the default chunking gives, it is also the faster choice: a GEMM
repacks the whole weight matrix on every call. The weight gradient needs no such care (it
sums over the chunk anyway, and the chunks are fixed): small chunks add one row at a time,
large ones form dy^T @ x with one GEMM and add it.

Dimension letters: M rows in the chunk (samples times rows per sample), C inputs per row,
K outputs per row.
"""
import numpy as np
# Numba's np.dot calls the BLAS that SciPy ships, and loads it only when a kernel first runs.
# Loading it now, on import, puts it in place before the trainer pins BLAS to one thread
# (threadpoolctl limits only libraries already loaded); loaded later, it would run threads of
# its own inside each worker, with results that then depend on the thread count.
import scipy.linalg.cython_blas  # noqa: F401
from numba import njit

# Chunks of up to this many rows add their weight gradient row by row (one pass over the
# gradient, in row order); larger ones go through one GEMM, which then wins despite its
# repacking.
ROWWISE_GRADIENT_ROWS = 8


@njit(cache=True, nogil=True)
def fc_forward(x, w, b, y, transpose):
    """x: (M, C); w: (K, C), or (C, K) when transpose; b: (K,), or (0,) for no bias;
    y: (M, K). y[m] = w @ x[m] (x[m] @ w when transpose), then y[m] += b."""
    M, K = y.shape
    for m in range(M):
        if transpose:
            np.dot(x[m], w, y[m])
        else:
            np.dot(w, x[m], y[m])
    if b.size > 0:
        for m in range(M):
            ym = y[m]
            for k in range(K):
                ym[k] += b[k]


@njit(cache=True, nogil=True)
def _add_outer_rows(a, b, g):
    """g (J, L) += sum over rows m of a[m, j] * b[m, :], adding row m = 0, 1, 2, ... in order.
    Four rows go into each element per load and store of g (the order stays m = 0, 1, ...),
    and each gradient row finishes every m before the next, while it sits in cache."""
    M, J = a.shape
    L = b.shape[1]
    M4 = M - M % 4
    for j in range(J):
        gj = g[j]
        for m in range(0, M4, 4):
            a0, a1, a2, a3 = a[m, j], a[m + 1, j], a[m + 2, j], a[m + 3, j]
            b0, b1, b2, b3 = b[m], b[m + 1], b[m + 2], b[m + 3]
            for l in range(L):
                v = gj[l]
                v += a0 * b0[l]
                v += a1 * b1[l]
                v += a2 * b2[l]
                v += a3 * b3[l]
                gj[l] = v
        for m in range(M4, M):
            amj = a[m, j]
            bm = b[m]
            for l in range(L):
                gj[l] += amj * bm[l]


@njit(cache=True, nogil=True)
def fc_backward(x, w, dy, dx, dw, db, wtmp, transpose, need_dx):
    """x: (M, C); w: (K, C), or (C, K) when transpose; dy: (M, K); dx: (M, C), OVERWRITTEN
    (any array when not need_dx); dw: like w and db: (K,) or (0,) are ADDED to; wtmp: like w,
    scratch. db += the rows of dy in row order; dw += dy^T @ x (x^T @ dy when transpose), row
    by row in row order for up to ROWWISE_GRADIENT_ROWS rows, else formed by one GEMM in wtmp
    and then added; dx[m] = dy[m] @ w (w @ dy[m] when transpose)."""
    M, K = dy.shape
    if db.size > 0:
        for m in range(M):
            dym = dy[m]
            for k in range(K):
                db[k] += dym[k]
    if M <= ROWWISE_GRADIENT_ROWS:
        if transpose:
            _add_outer_rows(x, dy, dw)
        else:
            _add_outer_rows(dy, x, dw)
    else:
        if transpose:
            np.dot(x.T, dy, wtmp)
        else:
            np.dot(dy.T, x, wtmp)
        R, L = dw.shape
        for r in range(R):
            dwr = dw[r]
            tr = wtmp[r]
            for l in range(L):
                dwr[l] += tr[l]
    if need_dx:
        for m in range(M):
            if transpose:
                np.dot(w, dy[m], dx[m])
            else:
                np.dot(dy[m], w, dx[m])
