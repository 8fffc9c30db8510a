"""Inner-product (fully connected) kernels, Caffe's InnerProduct: y = x @ W^T + b, or x @ W when
the weight is stored transposed. Only the 2-d matrix product; the layer flattens the axes.

BLAS may take a different path for a different number of rows (OpenBLAS routes one or two
rows through other kernels, with other rounding), so a GEMM over a whole chunk would give a
sample a result that depends on its chunk. Instead the rows are cut into blocks of exactly
BLOCK rows aligned to *global* row indices (block b holds rows b*BLOCK .. b*BLOCK + BLOCK - 1 of
the whole batch); a block that the chunk holds only part of is padded with zero rows through
scratch. Every GEMM then has the same shape and every row sits in the same place within it
whatever the split, and rows of a GEMM never mix: a row's result depends on that row alone.

Dimension letters: M rows in the chunk (samples times rows per sample), C inputs per row,
K outputs per row, B = BLOCK rows per GEMM.
"""
import numpy as np
# Numba's np.dot calls the BLAS that SciPy ships, and loads it only when a kernel first runs.
# Loading it now, on import, puts it in place before the trainer pins BLAS to one thread
# (threadpoolctl limits only libraries already loaded); loaded later, it would run threads of
# its own inside each worker, with results that then depend on the thread count.
import scipy.linalg.cython_blas  # noqa: F401
from numba import njit

# Rows per GEMM: large enough for BLAS to run near full speed on LeNet/CIFAR sizes, small enough
# that a chunk of a few samples pads little.
BLOCK = 16


@njit(cache=True, nogil=True)
def _next_block(lo, M, first, B):
    """The block holding chunk row lo: (hi, lane) where rows lo..hi-1 of the chunk sit at rows
    lane..lane + hi - lo - 1 of their global block."""
    lane = (first + lo) % B
    hi = min(lo + B - lane, M)
    return hi, lane


@njit(cache=True, nogil=True)
def _rows_times(a, w, out, w_transposed):
    """out = a @ w^T (w: (out columns, a columns)), or a @ w when w_transposed."""
    if w_transposed:
        np.dot(a, w, out)
    else:
        np.dot(a, w.T, out)


@njit(cache=True, nogil=True)
def _blocked_product(a, w, out, ab, ob, first, w_transposed):
    """out (M, L) = a (M, J) @ w^T, or a @ w when w_transposed, in global blocks of B rows;
    ab (B, J) and ob (B, L) are scratch for partial blocks."""
    M = a.shape[0]
    B = ab.shape[0]
    lo = 0
    while lo < M:
        hi, lane = _next_block(lo, M, first, B)
        if lane == 0 and hi - lo == B:
            _rows_times(a[lo:hi], w, out[lo:hi], w_transposed)
        else:
            ab[:] = 0
            ab[lane:lane + hi - lo] = a[lo:hi]
            _rows_times(ab, w, ob, w_transposed)
            out[lo:hi] = ob[lane:lane + hi - lo]
        lo = hi


@njit(cache=True, nogil=True)
def fc_forward(x, w, b, y, xb, yb, first, transpose):
    """x: (M, C); w: (K, C), or (C, K) when transpose; b: (K,), or (0,) for no bias;
    y: (M, K); xb: (B, C), yb: (B, K) scratch; first: global index of row 0.
    y = x @ w^T (x @ w when transpose), then y[m] += b."""
    _blocked_product(x, w, y, xb, yb, first, transpose)
    if b.size > 0:
        M, K = y.shape
        for m in range(M):
            ym = y[m]
            for k in range(K):
                ym[k] += b[k]


@njit(cache=True, nogil=True)
def fc_backward(x, w, dy, dx, dw, db, xb, yb, wtmp, first, transpose, need_dx):
    """x: (M, C); w: (K, C), or (C, K) when transpose; dy: (M, K); dx: (M, C), OVERWRITTEN
    (any array when not need_dx); dw: like w and db: (K,) or (0,) are ADDED to;
    xb: (B, C), yb: (B, K), wtmp: like w, scratch; first: global index of row 0.
    db += rows of dy one at a time in row order; dw += dy^T @ x (x^T @ dy when transpose)
    one global block at a time in row order, each block's product formed in wtmp and then
    added, so the sum's order is fixed by the blocks; dx = dy @ w (dy @ w^T when transpose)."""
    M, K = dy.shape
    B = xb.shape[0]
    if db.size > 0:
        for m in range(M):
            dym = dy[m]
            for k in range(K):
                db[k] += dym[k]
    lo = 0
    while lo < M:
        hi, lane = _next_block(lo, M, first, B)
        if lane == 0 and hi - lo == B:
            xs = x[lo:hi]
            dys = dy[lo:hi]
        else:
            # Zero rows add exact zeros: a partial block sums like its rows alone, in the
            # same BLAS shape as a full one.
            xb[:] = 0
            yb[:] = 0
            xb[lane:lane + hi - lo] = x[lo:hi]
            yb[lane:lane + hi - lo] = dy[lo:hi]
            xs = xb
            dys = yb
        if transpose:
            np.dot(xs.T, dys, wtmp)
        else:
            np.dot(dys.T, xs, wtmp)
        R, L = dw.shape
        for r in range(R):
            dwr = dw[r]
            tr = wtmp[r]
            for l in range(L):
                dwr[l] += tr[l]
        lo = hi
    if need_dx:
        # dx = dy @ w is the forward product with the weight's roles swapped.
        _blocked_product(dy, w, dx, yb, xb, first, not transpose)
