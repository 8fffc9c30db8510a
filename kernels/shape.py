"""Copy kernels of the shape layers: Tile's repeats and Crop's windows (Slice reuses Concat's
strided copies, cgp.kernels.elementwise).

Copies only; the one sum, Tile's gradient, adds the repeats in order. No kernel here adds
into a parameter gradient.

Dimension letters: R rows (the chunk's samples times the axes before the layer's axis),
E elements per row of the bottom, T repeats. Crop: A axes, a chunk's blob as flat arrays
with their shapes.
"""
from numba import njit


@njit(cache=True, nogil=True)
def tile_forward(x, y, T):
    """x: (R, E); y: (R, T*E). y[r, t*E + e] = x[r, e]."""
    R, E = x.shape
    for r in range(R):
        for t in range(T):
            for e in range(E):
                y[r, t * E + e] = x[r, e]


@njit(cache=True, nogil=True)
def tile_backward(dy, dx, T):
    """dy: (R, T*E); dx: (R, E), OVERWRITTEN: dx[r, e] = the sum over t in order of
    dy[r, t*E + e] (the first repeat copied, the others added, as Caffe)."""
    R, E = dx.shape
    for r in range(R):
        for e in range(E):
            dx[r, e] = dy[r, e]
        for t in range(1, T):
            for e in range(E):
                dx[r, e] += dy[r, t * E + e]


@njit(cache=True, nogil=True)
def crop_copy(big, small, big_shape, small_shape, offsets, forward):
    """big, small: flat C-order arrays of shapes big_shape and small_shape (A,) each;
    offsets: (A,). The window small[j] = big[j + offsets] (j a multi-index): copied into
    small (forward) or back into big (not forward; the rest of big is left as it is), one
    contiguous run along the last axis at a time."""
    A = big_shape.size
    last = small_shape[A - 1]
    runs = small.size // last if last > 0 else 0
    for run in range(runs):
        # The run's multi-index over the first A - 1 axes, last axis fastest.
        rest, src, mult = run, offsets[A - 1], 1
        for a in range(A - 2, -1, -1):
            j = rest % small_shape[a]
            rest //= small_shape[a]
            mult *= big_shape[a + 1]
            src += (j + offsets[a]) * mult
        dst = run * last
        if forward:
            for i in range(last):
                small[dst + i] = big[src + i]
        else:
            for i in range(last):
                big[src + i] = small[dst + i]
