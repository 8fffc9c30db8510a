"""Batch normalisation kernels (Caffe's BatchNorm): the per-part sums that the engine adds over
the whole batch, and the normalisation and its gradient once the sums are known.

Sums are float64, each part's in a fixed order: sample by sample, each (sample, channel) row
in LANES interleaved partial sums added in a fixed tree at the row's end (so the loop
vectorises and its order never depends on the machine), the rows added in sample order.
Everything else follows Caffe's arithmetic in the blobs' dtype (float32 in training): y = (x - mean) / sqrt(var + eps), and
dx = (dy - (y * sum(dy * y) + sum(dy)) / m) / sqrt(var + eps).

Dimension letters: N samples in the call, C channels, S positions per channel (H * W, 1 for
2-d blobs), P parts (the call's chunks, bounds starts: (P + 1,)), m the batch's N * S.
"""
import numpy as np
from numba import njit

LANES = 8


@njit(cache=True, nogil=True, inline="always")
def _row_sum(row):
    """float64 sum of a row in LANES interleaved sums, added pairwise."""
    acc = np.zeros(LANES, np.float64)
    full = row.size - row.size % LANES
    for j in range(0, full, LANES):
        for lane in range(LANES):
            acc[lane] += row[j + lane]
    for j in range(full, row.size):
        acc[j - full] += row[j]
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@njit(cache=True, nogil=True)
def channel_sums(x, starts, shares):
    """x: (N, C, S); shares: (P, C) float64, overwritten: part p's sum of x per channel."""
    for p in range(starts.size - 1):
        for c in range(x.shape[1]):
            total = 0.0
            for n in range(starts[p], starts[p + 1]):
                total += _row_sum(x[n, c])
            shares[p, c] = total


@njit(cache=True, nogil=True)
def centred_square_sums(x, mean, starts, shares, work):
    """x: (N, C, S); mean: (C,) float64 (holding a value of x's dtype); shares: (P, C)
    float64, overwritten: part p's sum per channel of (x - mean)^2, the difference in x's
    dtype. work: (S,) float64."""
    for p in range(starts.size - 1):
        for c in range(x.shape[1]):
            m = x.dtype.type(mean[c])
            total = 0.0
            for n in range(starts[p], starts[p + 1]):
                row = x[n, c]
                for s in range(row.size):
                    d = np.float64(row[s] - m)
                    work[s] = d * d
                total += _row_sum(work[:row.size])
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
def gradient_sums(y, dy, starts, shares, work):
    """y, dy: (N, C, S); shares: (P, 2C) float64, overwritten: part p's sum per channel of
    dy * y (products in their dtype) at [p, c], of dy at [p, C + c]. work: (S,) float64."""
    C = y.shape[1]
    for p in range(starts.size - 1):
        for c in range(C):
            product = plain = 0.0
            for n in range(starts[p], starts[p + 1]):
                yr, dr = y[n, c], dy[n, c]
                for s in range(yr.size):
                    work[s] = np.float64(dr[s] * yr[s])
                product += _row_sum(work[:yr.size])
                plain += _row_sum(dr)
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
