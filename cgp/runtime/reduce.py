"""Gradient reduction kernels: the fixed-order sum of per-chunk gradient buffers
(tree_sum), and of per-chunk gradients held as factors A_c^T @ B_c (outer_tree_sum), which
forms each chunk's product a register tile at a time and adds the tiles in the same tree as it
goes, in registers and on a small stack in the L1 cache.

Only the order of additions matters for bitwise results, never which thread adds:
each kernel call handles a column range [lo, hi) of every buffer (or rows [j0, j1) of a
factored gradient), and any cut gives the same sums.
"""
import functools

from numba import literally, njit

from cgp.runtime.simd import SHAPES, VECTOR_BYTES, choose, folded_tile, lanes

# Elements a factored operand must extend past its last row (tiles read up to T - 1 past a
# row of A and KV vectors past a row of B; counted in float32, which has the most lanes).
OUTER_PAD = max(max(T, KV * VECTOR_BYTES // 4) for T, KV in SHAPES)
# Elements per level of outer_tree_sum's stack of partial sums: the largest register tile
# (counted in float32, which has the most lanes; a whole number of cache lines).
OUTER_LEVEL = max(T * KV for T, KV in SHAPES) * VECTOR_BYTES // 4

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
def outer_stack_size(k):
    """Elements of outer_tree_sum's stack for k chunks: OUTER_LEVEL per bit of k (the stack
    holds at most popcount(c) + 1 tiles while chunk c < k - 1 is added)."""
    levels = 0
    while (1 << levels) <= k:
        levels += 1
    return levels * OUTER_LEVEL


def outer_tree_sum(a, b, J, L, starts, j0, j1, stack, out):
    """A factored gradient's tree sum. Chunk c's gradient is G_c = A_c^T @ B_c, where A_c and
    B_c are rows starts[c]:starts[c + 1] of A (M, J) and B (M, L), held row-major in the flat
    arrays a and b, which must extend OUTER_PAD elements past M * J and M * L (register tiles
    read past the last row). Each element of G_c is one chain of fused multiply-adds over
    the chunk's rows in order, from 0: what fc.add_outer_rows builds in a chunk's own buffer.
    For rows j in [j0, j1): out[j * L:(j + 1) * L] = the tree sum over c of G_c[j], in
    tree_sum's order: bitwise what tree_sum gives over the k materialised chunk gradients.
    One register tile of the output at a time, chunk by chunk, on a stack of partial sums
    that merges as a binary counter carries: chunk c's product, still in registers, adds the
    top tiles of the stack, one for each trailing zero bit of c + 1 (the pairs tree_sum
    adds), and goes on the stack; the last chunk's adds every tile left, top down (tree_sum's
    last levels), and goes to out. So a chunk's product is stored once, in the L1 cache, and
    the sums cost no pass of their own.
    stack: outer_stack_size(k) elements for k chunks, on a cache line (a tile stored across
    two lines costs two stores).
    The tile shape is chosen here, in Python, and only its compiled loop is called: one
    compiled function holding the loops of all six shapes cost a first run 12 s of LLVM
    on 2 cores, where a net uses one or two of them (bench/README.md, the first run)."""
    _OUTER[_shape(j1 - j0, L, a.itemsize)](a, b, J, L, starts, j0, j1, stack, out)


@functools.lru_cache(maxsize=None)
def _shape(rows, L, itemsize):
    """The register tile (T, KV) of outer_tree_sum's loop for blocks of `rows` rows of L."""
    T, KV = choose(rows, L, lanes(itemsize), True)
    return int(T), int(KV)


# One compiled loop per tile shape, each given its shape as a constant: a shape chosen inside
# the loop costs a dispatch per tile, which for chunks of a few rows takes longer than the tile.
@njit(cache=True, nogil=True)
def _outer_12x2(a, b, J, L, starts, j0, j1, stack, out):
    _outer_blocks(12, 2, a, b, J, L, starts, j0, j1, stack, out)


@njit(cache=True, nogil=True)
def _outer_8x2(a, b, J, L, starts, j0, j1, stack, out):
    _outer_blocks(8, 2, a, b, J, L, starts, j0, j1, stack, out)


@njit(cache=True, nogil=True)
def _outer_6x2(a, b, J, L, starts, j0, j1, stack, out):
    _outer_blocks(6, 2, a, b, J, L, starts, j0, j1, stack, out)


@njit(cache=True, nogil=True)
def _outer_8x3(a, b, J, L, starts, j0, j1, stack, out):
    _outer_blocks(8, 3, a, b, J, L, starts, j0, j1, stack, out)


@njit(cache=True, nogil=True)
def _outer_6x4(a, b, J, L, starts, j0, j1, stack, out):
    _outer_blocks(6, 4, a, b, J, L, starts, j0, j1, stack, out)


@njit(cache=True, nogil=True)
def _outer_3x4(a, b, J, L, starts, j0, j1, stack, out):
    _outer_blocks(3, 4, a, b, J, L, starts, j0, j1, stack, out)


_OUTER = {(12, 2): _outer_12x2, (8, 2): _outer_8x2, (6, 2): _outer_6x2, (8, 3): _outer_8x3,
          (6, 4): _outer_6x4, (3, 4): _outer_3x4}
if tuple(_OUTER) != SHAPES:
    raise ImportError("outer_tree_sum's loops must list simd.SHAPES")


@njit(cache=True, nogil=True)
def _outer_blocks(T, KV, a, b, J, L, starts, j0, j1, stack, out):
    literally(T)
    literally(KV)
    k = starts.size - 1
    KVV = KV * lanes(a.itemsize)
    n = T * KVV  # elements per tile on the stack
    for jb in range(j0, j1, T):
        t_valid = min(T, j1 - jb)
        for lb in range(0, L, KVV):
            depth = 0  # tiles on the stack: popcount(c)
            for c in range(k - 1):
                carries = 0
                while (c + 1) >> carries & 1 == 0:
                    carries += 1
                # The whole tile, rows and lanes past the block included (their operands are
                # readable: OUTER_PAD), so that the stack never holds stale values.
                folded_tile(T, KV, stack, (depth - carries) * n, KVV, T, KVV,
                            a, starts[c] * J + jb, 1, 0, J, b, starts[c] * L + lb, 0, L,
                            1, starts[c + 1] - starts[c], stack, (depth - 1) * n, KVV, -n,
                            carries)
                depth += 1 - carries
            c = k - 1
            folded_tile(T, KV, out, jb * L + lb, L, t_valid, L - lb,
                        a, starts[c] * J + jb, 1, 0, J, b, starts[c] * L + lb, 0, L,
                        1, starts[c + 1] - starts[c], stack, (depth - 1) * n, KVV, -n, depth)


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


@njit(cache=True, nogil=True)
def merge_rows(rows, pairs, lo, hi):
    """rows: (S, P) partial sums of whole subtrees of the chunk tree; pairs: (M, 2) int64.
    For each (dst, src) in order: rows[dst, lo:hi] += rows[src, lo:hi]: the additions that
    complete the tree from those subtrees (cgp.comm.local.merge_pairs), each element the same
    float additions tree_sum would make."""
    for m in range(pairs.shape[0]):
        d = rows[pairs[m, 0], lo:hi]
        s = rows[pairs[m, 1], lo:hi]
        for j in range(hi - lo):
            d[j] += s[j]
