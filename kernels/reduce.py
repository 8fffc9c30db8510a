"""Gradient reduction kernels: the fixed-order sum of per-chunk gradient buffers
(tree_sum), and of per-chunk gradients held as factors A_c^T @ B_c (outer_tree_sum), which
forms each chunk's product a panel of register tiles at a time and sums the panels in the same
tree.

Only the order of additions matters for bitwise results, never which thread adds:
each kernel call handles a column range [lo, hi) of every buffer (or rows [j0, j1) of a
factored gradient), and any cut gives the same sums.
"""
from numba import literally, njit

from cgp.kernels.tile import SHAPES, T_MAX, VECTOR_BYTES, choose, lanes, tile

# Elements a factored operand must extend past its last row (tiles read up to T - 1 past a
# row of A and KV vectors past a row of B; counted in float32, which has the most lanes).
OUTER_PAD = max(max(T, KV * VECTOR_BYTES // 4) for T, KV in SHAPES)
# Columns of a factored gradient per panel (a multiple of every tile's width, in float32 and
# float64), and the elements per chunk of outer_tree_sum's panel scratch: one panel of the
# tallest tile's rows.
OUTER_COLUMNS = 960
OUTER_SCRATCH = T_MAX * OUTER_COLUMNS

# Columns per pass of the whole tree: the partial sums of one tile stay in a small
# cache-resident scratch, so each chunk buffer is read once and only row 0 is written.
TILE = 1024


@njit(cache=True, nogil=True)
def tree_sum(bufs, lo, hi, scratch):
    """bufs: (K, P) chunk gradients; scratch: (K, TILE). Sums the rows pairwise in a
    fixed binary tree over the chunk index (stride 1, 2, 4, ...) for columns [lo, hi);
    the total ends in bufs[0, lo:hi]. The other rows are left as they were.

    The loops index views from 0: an index that may be negative (start + j) costs Numba a
    wrap-around test per element, which keeps the loop from being vectorised."""
    k = bufs.shape[0]
    k4 = k - k % 4
    for start in range(lo, hi, TILE):
        n = min(TILE, hi - start)
        end = start + n
        # Strides 1 and 2 at once, four buffers per pass: ((a + b) + (d + e)) is exactly what
        # those two levels compute, and each buffer is still read once, with a quarter of the
        # scratch traffic. The last group may hold fewer than four rows.
        for c in range(0, k4, 4):
            s = scratch[c, :n]
            a, b = bufs[c, start:end], bufs[c + 1, start:end]
            d, e = bufs[c + 2, start:end], bufs[c + 3, start:end]
            for j in range(n):
                s[j] = (a[j] + b[j]) + (d[j] + e[j])
        if k - k4 == 1:
            s, a = scratch[k4, :n], bufs[k4, start:end]
            for j in range(n):
                s[j] = a[j]
        elif k - k4 == 2:
            s, a, b = scratch[k4, :n], bufs[k4, start:end], bufs[k4 + 1, start:end]
            for j in range(n):
                s[j] = a[j] + b[j]
        elif k - k4 == 3:
            s, a, b, d = scratch[k4, :n], bufs[k4, start:end], bufs[k4 + 1, start:end], \
                bufs[k4 + 2, start:end]
            for j in range(n):
                s[j] = (a[j] + b[j]) + d[j]
        stride = 4
        while stride < k:
            for c in range(0, k - stride, 2 * stride):
                s = scratch[c, :n]
                t = scratch[c + stride, :n]
                for j in range(n):
                    s[j] += t[j]
            stride *= 2
        out = bufs[0, start:end]
        total = scratch[0, :n]
        for j in range(n):
            out[j] = total[j]


@njit(cache=True, nogil=True)
def outer_tree_sum(a, b, J, L, starts, j0, j1, partials, scratch, out):
    """A factored gradient's tree sum. Chunk c's gradient is G_c = A_c^T @ B_c, where A_c and
    B_c are rows starts[c]:starts[c + 1] of A (M, J) and B (M, L), held row-major in the flat
    arrays a and b, which must extend OUTER_PAD elements past M * J and M * L (register tiles
    read past the last row). Each element of G_c is one chain of fused multiply-adds over
    the chunk's rows in order, from 0: what fc.add_outer_rows builds in a chunk's own buffer.
    For rows j in [j0, j1): out[j * L:(j + 1) * L] = the tree sum over c of G_c[j], in
    tree_sum's order: bitwise what tree_sum gives over the k materialised chunk gradients,
    one panel (T rows by up to OUTER_COLUMNS columns) at a time, so that they are never
    written to memory: each chunk's register tiles fill its row of `partials`, then one
    tree_sum over the panel (a tree per register tile cost more than the tiles).
    partials: (k, OUTER_SCRATCH) and scratch: (k, TILE), for k chunks."""
    T, KV = choose(j1 - j0, L, lanes(a.itemsize), True)
    # One tile shape per compiled loop, given as a constant: a shape chosen inside the loop
    # costs a dispatch per tile, which for chunks of a few rows takes longer than the tile.
    # The cases are tile.SHAPES (checked at import below).
    if T == 12 and KV == 2:
        _outer_blocks(12, 2, a, b, J, L, starts, j0, j1, partials, scratch, out)
    elif T == 8 and KV == 2:
        _outer_blocks(8, 2, a, b, J, L, starts, j0, j1, partials, scratch, out)
    elif T == 6 and KV == 2:
        _outer_blocks(6, 2, a, b, J, L, starts, j0, j1, partials, scratch, out)
    elif T == 8 and KV == 3:
        _outer_blocks(8, 3, a, b, J, L, starts, j0, j1, partials, scratch, out)
    elif T == 6 and KV == 4:
        _outer_blocks(6, 4, a, b, J, L, starts, j0, j1, partials, scratch, out)
    elif T == 3 and KV == 4:
        _outer_blocks(3, 4, a, b, J, L, starts, j0, j1, partials, scratch, out)


if SHAPES != ((12, 2), (8, 2), (6, 2), (8, 3), (6, 4), (3, 4)):
    raise ImportError("outer_tree_sum's cases must list tile.SHAPES")


@njit(cache=True, nogil=True)
def _outer_blocks(T, KV, a, b, J, L, starts, j0, j1, partials, scratch, out):
    literally(T)
    literally(KV)
    k = starts.size - 1
    KVV = KV * lanes(a.itemsize)
    width = partials.shape[1]
    flat = partials.reshape(-1)
    for jb in range(j0, j1, T):
        t_valid = min(T, j1 - jb)
        for l0 in range(0, L, OUTER_COLUMNS):
            cols = min(OUTER_COLUMNS, L - l0)
            # Chunk c's panel: rows t < T of G_c, columns l0:l0 + cols, at partials[c, t*cols].
            for c in range(k):
                for lb in range(0, cols, KVV):
                    tile(T, KV, flat, c * width + lb, cols, t_valid, cols - lb, False,
                         a, starts[c] * J + jb, 1, 0, J, b, starts[c] * L + l0 + lb, 0, L,
                         1, starts[c + 1] - starts[c])
            tree_sum(partials, 0, t_valid * cols, scratch)
            total = partials[0]
            for t in range(t_valid):
                o = (jb + t) * L + l0
                out[o:o + cols] = total[t * cols:(t + 1) * cols]


@njit(cache=True, nogil=True)
def sum_rows(rows, total):
    """rows: (K, J); total: (J,), overwritten with rows[0] + rows[1] + ... + rows[K-1], added
    in row order in total's dtype (the loss shares of a batch: the same sums as a NumPy loop
    of total += row, and no interpreter time per row)."""
    for j in range(total.shape[0]):
        total[j] = 0
    for k in range(rows.shape[0]):
        for j in range(total.shape[0]):
            total[j] = total[j] + rows[k, j]
