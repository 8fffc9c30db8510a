"""Batch normalisation kernels (Caffe's BatchNorm): the per-part sums that the engine adds over
the whole batch, and the normalisation and its gradient once the sums are known.

Sums are float64, each part's in a fixed order: sample by sample, each (sample, channel) row
in LANES interleaved partial sums added in a fixed tree at the row's end (plain_sum and
the others: one vector of float64 lanes; its order never depends on the machine), the rows
added in sample order.
Everything else follows Caffe's arithmetic in the blobs' dtype (float32 in training): y = (x - mean) / sqrt(var + eps), and
dx = (dy - (y * sum(dy * y) + sum(dy)) / m) / sqrt(var + eps).

Dimension letters: N samples in the call, C channels, S positions per channel (H * W, 1 for
2-d blobs), P parts (the call's chunks, bounds starts: (P + 1,)), m the batch's N * S.
"""
import numpy as np
from numba import njit

from cgp.runtime.simd import (SUM_CENTRED_SQUARE, SUM_PLAIN, SUM_PRODUCT, lane_sums,
                              product_and_plain_lane_sums)

LANES = 8


# The sums of rows in LANES (8) interleaved float64 partial sums, term j in lane j % 8 in
# order, the lanes added pairwise at the end: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 +
# s7)); one vector of lanes (cgp.runtime.simd.lane_sums: as eight scalars, the loop never
# vectorised). Rows: (S,) contiguous, of one float dtype; terms in that dtype, then widened.

@njit(cache=True, nogil=True, inline="always")
def plain_sum(a):
    """The float64 sum of a's elements in lanes."""
    return lane_sums(a, a, 0, SUM_PLAIN)


@njit(cache=True, nogil=True, inline="always")
def product_sum(a, b):
    """The float64 sum of a[j] * b[j] (the product in the rows' dtype) in lanes."""
    return lane_sums(a, b, 0, SUM_PRODUCT)


@njit(cache=True, nogil=True, inline="always")
def centred_square_sum(a, m):
    """The float64 sum of d * d, d = a[j] - m (the difference in a's dtype; m a value of
    it), in lanes."""
    return lane_sums(a, a, m, SUM_CENTRED_SQUARE)


@njit(cache=True, nogil=True, inline="always")
def product_and_plain_sums(a, b):
    """(product_sum(a, b), plain_sum(a)) in one pass, the same bits: two vectors of lanes
    that the CPU adds side by side."""
    return product_and_plain_lane_sums(a, b)


@njit(cache=True, nogil=True)
def channel_sums(x, starts, shares):
    """x: (N, C, S); shares: (P, C) float64, overwritten: part p's sum of x per channel."""
    for p in range(starts.size - 1):
        for c in range(x.shape[1]):
            total = 0.0
            for n in range(starts[p], starts[p + 1]):
                total += plain_sum(x[n, c])
            shares[p, c] = total


@njit(cache=True, nogil=True)
def centred_square_sums(x, mean, starts, shares):
    """x: (N, C, S); mean: (C,) float64 (holding a value of x's dtype); shares: (P, C)
    float64, overwritten: part p's sum per channel of (x - mean)^2, the difference in x's
    dtype."""
    for p in range(starts.size - 1):
        for c in range(x.shape[1]):
            m = x.dtype.type(mean[c])
            total = 0.0
            for n in range(starts[p], starts[p + 1]):
                total += centred_square_sum(x[n, c], m)
            shares[p, c] = total


@njit(cache=True, nogil=True)
def normalize(x, mean, std, y):
    """x, y: (N, C, S); mean, std: (C,) float64 holding values of x's dtype.
    y = (x - mean) / std."""
    for c in range(x.shape[1]):
        m, d = x.dtype.type(mean[c]), x.dtype.type(std[c])
        for n in range(x.shape[0]):
            xr, yr = x[n, c], y[n, c]
            for s in range(xr.size):
                yr[s] = (xr[s] - m) / d


@njit(cache=True, nogil=True)
def gradient_sums(y, dy, starts, shares):
    """y, dy: (N, C, S); shares: (P, 2C) float64, overwritten: part p's sum per channel of
    dy * y (products in their dtype) at [p, c], of dy at [p, C + c]."""
    C = y.shape[1]
    for p in range(starts.size - 1):
        for c in range(C):
            product = plain = 0.0
            for n in range(starts[p], starts[p + 1]):
                row_product, row_plain = product_and_plain_sums(dy[n, c], y[n, c])
                product += row_product
                plain += row_plain
            shares[p, c] = product
            shares[p, C + c] = plain


@njit(cache=True, nogil=True)
def normalize_backward(y, dy, sums, m, std, dx):
    """y, dy, dx: (N, C, S); sums: (2C,) float64, the batch's sums of dy * y and of dy; m: the
    batch's N * S; std: (C,). As Caffe: t = y * a + b; t = dy - t / m (as dy + (-1/m) t); dx =
    t / std, in the blobs' dtype."""
    C = y.shape[1]
    f = y.dtype.type
    scale = f(-1.0) / f(m)
    for c in range(C):
        a, b, d = f(sums[c]), f(sums[C + c]), f(std[c])
        for n in range(y.shape[0]):
            yr, dr, xr = y[n, c], dy[n, c], dx[n, c]
            for s in range(yr.size):
                t = yr[s] * a + b
                xr[s] = (dr[s] + scale * t) / d


@njit(cache=True, nogil=True)
def scale_backward(dy, std, dx):
    """Global statistics: dx = dy / std per channel. dy, dx: (N, C, S); std: (C,)."""
    for c in range(dy.shape[1]):
        d = dy.dtype.type(std[c])
        for n in range(dy.shape[0]):
            dr, xr = dy[n, c], dx[n, c]
            for s in range(dr.size):
                xr[s] = dr[s] / d


@njit(cache=True, nogil=True)
def global_stats(mean, variance, factor, eps, stats):
    """Caffe's use_global_stats: stats[0] = mean / factor, stats[1] = sqrt(variance / factor
    + eps), per channel (0 where the factor is 0), in the blobs' dtype; stats: (2, C) float64.
    mean, variance: (C,); factor: (1,)."""
    f = mean.dtype.type
    scale = f(0.0) if factor[0] == 0 else f(1.0) / factor[0]
    for c in range(mean.size):
        stats[0, c] = scale * mean[c]
        stats[1, c] = np.sqrt(scale * variance[c] + f(eps))
