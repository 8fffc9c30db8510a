"""Gradient reduction kernels: the fixed-order sum of per-chunk gradient buffers.

Only the order of additions matters for bitwise results, never which thread adds:
each kernel call handles a column range [lo, hi) of every buffer, and any cut of the
columns gives the same sums.
"""
from numba import njit

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
def add_into(total, part, lo, hi):
    """total[lo:hi] += part[lo:hi] (gradient accumulation over iter_size passes)."""
    for j in range(lo, hi):
        total[j] += part[j]
