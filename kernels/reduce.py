"""Gradient reduction kernels: the fixed-order sum of per-chunk gradient buffers
(tree_sum), and of per-chunk gradients held as factors A_c^T @ B_c (outer_tree_sum), which
forms each chunk's product a register tile at a time and sums the tiles in the same tree.

Only the order of additions matters for bitwise results, never which thread adds:
each kernel call handles a column range [lo, hi) of every buffer (or rows [j0, j1) of a
factored gradient), and any cut gives the same sums.
"""
from numba import literally, njit

from cgp.kernels.tile import SHAPES, VECTOR_BYTES, choose, lanes, tile

# Elements a factored operand must extend past its last row (tiles read up to T - 1 past a
# row of A and KV vectors past a row of B; counted in float32, which has the most lanes), and
# register-tile elements per chunk in outer_tree_sum's scratch, in vectors.
OUTER_PAD = max(max(T, KV * VECTOR_BYTES // 4) for T, KV in SHAPES)
OUTER_SCRATCH = max(T * KV for T, KV in SHAPES)

# Columns per pass of the whole tree: the partial sums of one tile stay in a small
# cache-resident scratch, so each chunk buffer is read once and only row 0 is written.
TILE = 1024


@njit(cache=True, nogil=True)
def tree_sum(bufs, lo, hi, scratch):
    """bufs: (K, P) chunk gradients; scratch: (K, TILE). Sums the rows pairwise in a
    fixed binary tree over the chunk index (stride 1, 2, 4, ...) for columns [lo, hi);
    the total ends in bufs[0, lo:hi]. The other rows are left as they were."""
    k = bufs.shape[0]
    k4 = k - k % 4
    for start in range(lo, hi, TILE):
        n = min(TILE, hi - start)
        # Strides 1 and 2 at once, four buffers per pass: ((a + b) + (d + e)) is exactly what
        # those two levels compute, and each buffer is still read once, with a quarter of the
        # scratch traffic. The last group may hold fewer than four rows.
        for c in range(0, k4, 4):
            s = scratch[c]
            a, b, d, e = bufs[c], bufs[c + 1], bufs[c + 2], bufs[c + 3]
            for j in range(n):
                s[j] = (a[start + j] + b[start + j]) + (d[start + j] + e[start + j])
        if k - k4 == 1:
            s, a = scratch[k4], bufs[k4]
            for j in range(n):
                s[j] = a[start + j]
        elif k - k4 == 2:
            s, a, b = scratch[k4], bufs[k4], bufs[k4 + 1]
            for j in range(n):
                s[j] = a[start + j] + b[start + j]
        elif k - k4 == 3:
            s, a, b, d = scratch[k4], bufs[k4], bufs[k4 + 1], bufs[k4 + 2]
            for j in range(n):
                s[j] = (a[start + j] + b[start + j]) + d[start + j]
        stride = 4
        while stride < k:
            for c in range(0, k - stride, 2 * stride):
                s = scratch[c]
                t = scratch[c + stride]
                for j in range(n):
                    s[j] += t[j]
            stride *= 2
        out = bufs[0]
        total = scratch[0]
        for j in range(n):
            out[start + j] = total[j]


@njit(cache=True, nogil=True)
def outer_tree_sum(a, b, J, L, starts, j0, j1, partials, scratch, out):
    """A factored gradient's tree sum. Chunk c's gradient is G_c = A_c^T @ B_c, where A_c and
    B_c are rows starts[c]:starts[c + 1] of A (M, J) and B (M, L), held row-major in the flat
    arrays a and b, which must extend OUTER_PAD elements past M * J and M * L (register tiles
    read past the last row). Each element of G_c is one chain of fused multiply-adds over
    the chunk's rows in order, from 0: what fc.add_outer_rows builds in a chunk's own buffer.
    For rows j in [j0, j1): out[j * L:(j + 1) * L] = the tree sum over c of G_c[j], in
    tree_sum's order: bitwise what tree_sum gives over the k materialised chunk gradients,
    one register tile at a time, so that they are never written to memory.
    partials: (k, OUTER_SCRATCH * lanes) and scratch: (k, TILE), for k chunks."""
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
        for lb in range(0, L, KVV):
            v_valid = min(KVV, L - lb)
            for c in range(k):
                tile(T, KV, flat, c * width, KVV, t_valid, v_valid, False,
                     a, starts[c] * J + jb, 1, 0, J, b, starts[c] * L + lb, 0, L,
                     1, starts[c + 1] - starts[c])
            tree_sum(partials, 0, T * KVV, scratch)
            total = partials[0]
            for t in range(t_valid):
                o = (jb + t) * L + lb
                for v in range(v_valid):
                    out[o + v] = total[t * KVV + v]


@njit(cache=True, nogil=True)
def add_into(total, part, lo, hi):
    """total[lo:hi] += part[lo:hi] (gradient accumulation over iter_size passes)."""
    for j in range(lo, hi):
        total[j] += part[j]
