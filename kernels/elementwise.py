"""Blob-plumbing kernels: copies, sums and products of whole blobs (Split, Flatten, Reshape,
Eltwise) and the strided copies of Concat.

Every kernel works on flat (M,) views unless its docstring says otherwise, and writes its
output in full (no kernel here accumulates into a parameter gradient). Sums over several
bottoms are built from pairwise kernels called in bottom order, so the order is fixed.

Dimension letters: M elements (a flat view of a whole chunk), R rows (N samples times the
product of the axes before the concat axis), E and F elements per row of a bottom and the top.
"""
from numba import njit


@njit(cache=True, nogil=True)
def copy(x, y):
    """x, y: (M,). y = x. Kernels copy with this loop, not with Numba's slice assignment
    (y[i:j] = x[k:l]), which took 3.5 to 8 times as long, from 16 elements to 25,000
    (`python bench/slice_copy.py`; average pooling's forward, whose window sums copy short
    rows, ran 1.6 times as fast with the loop)."""
    for i in range(x.size):
        y[i] = x[i]


@njit(cache=True, nogil=True)
def scaled_copy(x, c, y):
    """x, y: (M,), c a scalar of their dtype. y = c * x."""
    for i in range(x.size):
        y[i] = c * x[i]


@njit(cache=True, nogil=True)
def scaled_copies(x, c0, y0, c1, y1):
    """x, y0, y1: (M,), c0, c1 scalars of their dtype. y0 = c0 * x and y1 = c1 * x: the bits
    of two scaled_copy calls, reading x once (Eltwise SUM's gradient for two bottoms)."""
    for i in range(x.size):
        v = x[i]
        y0[i] = c0 * v
        y1[i] = c1 * v


@njit(cache=True, nogil=True)
def copies(x, y0, y1):
    """x, y0, y1: (M,). y0 = x and y1 = x, reading x once (Split's forward, two tops at a
    time)."""
    for i in range(x.size):
        v = x[i]
        y0[i] = v
        y1[i] = v


@njit(cache=True, nogil=True)
def axpy(x, c, y):
    """x, y: (M,), c a scalar of their dtype. y += c * x (one step of a sum over bottoms)."""
    for i in range(x.size):
        y[i] += c * x[i]


@njit(cache=True, nogil=True)
def add(a, b, y):
    """a, b, y: (M,). y = a + b; y may be a (a running sum)."""
    for i in range(y.size):
        y[i] = a[i] + b[i]


@njit(cache=True, nogil=True)
def add3(a, b, c, y):
    """a, b, c, y: (M,). y = (a + b) + c, in that order: the bits of add(a, b, y) then
    add(y, c, y), in one pass; y may be a (a running sum)."""
    for i in range(y.size):
        y[i] = (a[i] + b[i]) + c[i]


@njit(cache=True, nogil=True)
def multiply(a, b, y):
    """a, b, y: (M,). y = a * b; y may be a or b (a running product)."""
    for i in range(y.size):
        y[i] = a[i] * b[i]


@njit(cache=True, nogil=True)
def divide_multiply(a, b, c, y):
    """a, b, c, y: (M,). y = a / b * c, in that order (Eltwise PROD's gradient without
    stable_prod_grad: top / bottom * top_diff). Infinite or NaN where b is 0, as in Caffe."""
    for i in range(y.size):
        y[i] = a[i] / b[i] * c[i]


@njit(cache=True, nogil=True)
def max_first(a, b, y, idx):
    """a, b, y, idx: (M,). y = max(a, b), idx = 0 where a > b, else 1: a tie goes to the
    second bottom, Caffe's rule for the first pair. idx holds small integers in y's dtype."""
    for i in range(y.size):
        if a[i] > b[i]:
            y[i] = a[i]
            idx[i] = 0
        else:
            y[i] = b[i]
            idx[i] = 1


@njit(cache=True, nogil=True)
def max_next(x, k, y, idx):
    """x, y, idx: (M,), k the index of bottom x (k >= 2). Where x > y, y = x and idx = k: later
    bottoms win only when strictly greater, so a tie keeps the earlier bottom (Caffe's rule)."""
    for i in range(y.size):
        if x[i] > y[i]:
            y[i] = x[i]
            idx[i] = k


@njit(cache=True, nogil=True)
def max_backward(dy, idx, k, dx):
    """dy, idx, dx: (M,). dx = dy where bottom k won the max, else 0; overwrites dx."""
    for i in range(dy.size):
        dx[i] = dy[i] if idx[i] == k else 0


@njit(cache=True, nogil=True)
def concat_forward(x, y, offset):
    """x: (R, E) one bottom, y: (R, F) the top, F >= offset + E. y[:, offset:offset+E] = x."""
    R, E = x.shape
    for r in range(R):
        for e in range(E):
            y[r, offset + e] = x[r, e]


@njit(cache=True, nogil=True)
def concat_backward(dy, dx, offset):
    """dy: (R, F) the top's gradient, dx: (R, E) one bottom's. dx = dy[:, offset:offset+E];
    overwrites dx."""
    R, E = dx.shape
    for r in range(R):
        for e in range(E):
            dx[r, e] = dy[r, offset + e]
