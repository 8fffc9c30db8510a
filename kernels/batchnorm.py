"""Batch normalisation kernels (Caffe's BatchNorm): the per-part sums that the engine adds over
the whole batch, and the normalisation and its gradient once the sums are known.

Sums are float64, each part's in a fixed order: sample by sample, each (sample, channel) row
in LANES interleaved partial sums added in a fixed tree at the row's end (lane_sum: the
partial sums are locals, which stay in registers, and the loop vectorises; its order never
depends on the machine), the rows added in sample order.
Everything else follows Caffe's arithmetic in the blobs' dtype (float32 in training): y = (x - mean) / sqrt(var + eps), and
dx = (dy - (y * sum(dy * y) + sum(dy)) / m) / sqrt(var + eps).

Dimension letters: N samples in the call, C channels, S positions per channel (H * W, 1 for
2-d blobs), P parts (the call's chunks, bounds starts: (P + 1,)), m the batch's N * S.
"""
import numpy as np
from numba import njit

LANES = 8


# What lane_sum adds up: each element, the elements' products with another row's, or their
# squared differences from a value.
PLAIN, PRODUCT, CENTRED_SQUARE = 0, 1, 2


@njit(cache=True, nogil=True, inline="always")
def _term(a, b, m, j, kind):
    """Term j of lane_sum, in float64: a[j]; a[j] * b[j] (the product in a's dtype); or
    d * d with d = a[j] - m (the difference in a's dtype)."""
    if kind == PLAIN:
        return np.float64(a[j])
    if kind == PRODUCT:
        return np.float64(a[j] * b[j])
    d = np.float64(a[j] - m)
    return d * d


@njit(cache=True, nogil=True, inline="always")
def lane_sum(a, b, m, kind):
    """a, b: (S,) rows (b read only for PRODUCT); m: a value of a's dtype (CENTRED_SQUARE).
    The float64 sum of _term over the row in LANES (8) interleaved partial sums, element j in
    lane j % 8, added pairwise at the end: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
    The lanes are locals: in an array, each add went through memory."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    full = a.size - a.size % LANES
    for j in range(0, full, LANES):
        s0 += _term(a, b, m, j, kind)
        s1 += _term(a, b, m, j + 1, kind)
        s2 += _term(a, b, m, j + 2, kind)
        s3 += _term(a, b, m, j + 3, kind)
        s4 += _term(a, b, m, j + 4, kind)
        s5 += _term(a, b, m, j + 5, kind)
        s6 += _term(a, b, m, j + 6, kind)
        s7 += _term(a, b, m, j + 7, kind)
    rest = a.size - full
    if rest > 0:
        s0 += _term(a, b, m, full, kind)
    if rest > 1:
        s1 += _term(a, b, m, full + 1, kind)
    if rest > 2:
        s2 += _term(a, b, m, full + 2, kind)
    if rest > 3:
        s3 += _term(a, b, m, full + 3, kind)
    if rest > 4:
        s4 += _term(a, b, m, full + 4, kind)
    if rest > 5:
        s5 += _term(a, b, m, full + 5, kind)
    if rest > 6:
        s6 += _term(a, b, m, full + 6, kind)
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(cache=True, nogil=True)
def channel_sums(x, starts, shares):
    """x: (N, C, S); shares: (P, C) float64, overwritten: part p's sum of x per channel."""
    for p in range(starts.size - 1):
        for c in range(x.shape[1]):
            total = 0.0
            for n in range(starts[p], starts[p + 1]):
                total += lane_sum(x[n, c], x[n, c], 0, PLAIN)
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
                total += lane_sum(x[n, c], x[n, c], m, CENTRED_SQUARE)
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
    dy * y (products in their dtype) at [p, c], of dy at [p, C + c]. The second pass over a
    row reads it from the L1 cache."""
    C = y.shape[1]
    for p in range(starts.size - 1):
        for c in range(C):
            product = plain = 0.0
            for n in range(starts[p], starts[p + 1]):
                product += lane_sum(dy[n, c], y[n, c], 0, PRODUCT)
                plain += lane_sum(dy[n, c], dy[n, c], 0, PLAIN)
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
