"""Local response normalisation kernels (Caffe's LRN), across channels and within a channel.

Caffe's formulas and summation order. Forward stores the denominator's base `scale` for
backward; the layer owns that buffer and a one-plane work buffer. Nothing here allocates.

Dimension letters: N samples in the chunk, C channels, H W height and width. L is local_size
(odd), and the window around a position reaches R = (L - 1) / 2 either side, cut at the borders.
"""
from numba import njit


@njit(cache=True, nogil=True)
def lrn_across_forward(x, y, scale, L, alpha_over_L, beta, k):
    """x, y, scale: (N, C, H, W). scale[c] = k + alpha / L * sum of x[c']^2 over channels
    c' in [c - R, c + R] (missing channels count 0); y = x * scale^-beta.

    As in Caffe, the window slides: scale[c] = scale[c - 1] + a * x[c + R]^2 - a * x[c - R - 1]^2,
    which costs O(C) per position instead of O(C * L)."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    for n in range(N):
        for h in range(H):
            for w in range(W):
                scale[n, 0, h, w] = k
        for c in range(min(R + 1, C)):
            for h in range(H):
                for w in range(W):
                    v = x[n, c, h, w]
                    scale[n, 0, h, w] += alpha_over_L * (v * v)
        for c in range(1, C):
            head = c + R
            tail = c - R - 1
            for h in range(H):
                for w in range(W):
                    s = scale[n, c - 1, h, w]
                    if head < C:
                        v = x[n, head, h, w]
                        s += alpha_over_L * (v * v)
                    if tail >= 0:
                        v = x[n, tail, h, w]
                        s -= alpha_over_L * (v * v)
                    scale[n, c, h, w] = s
        for c in range(C):
            for h in range(H):
                for w in range(W):
                    y[n, c, h, w] = scale[n, c, h, w] ** -beta * x[n, c, h, w]


@njit(cache=True, nogil=True)
def lrn_across_backward(x, y, dy, scale, dx, L, cache_ratio, beta, accum):
    """x, y, dy, scale, dx: (N, C, H, W); accum: (H, W) scratch. Overwrites dx with
        dx[c] = dy[c] * scale[c]^-beta
                - cache_ratio * x[c] * sum over c' in [c - R, c + R] of dy[c'] * y[c'] / scale[c'],
    cache_ratio = 2 * alpha * beta / L (Caffe's formula). The channel sum slides like forward's;
    each ratio dy * y / scale is recomputed, bitwise the same, when it leaves the window."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    for n in range(N):
        for c in range(C):
            for h in range(H):
                for w in range(W):
                    dx[n, c, h, w] = scale[n, c, h, w] ** -beta * dy[n, c, h, w]
        for h in range(H):
            for w in range(W):
                accum[h, w] = 0
        # Prime the window with channels [0, R - 1]: the loop below adds channel c + R first.
        for c in range(min(R, C)):
            for h in range(H):
                for w in range(W):
                    accum[h, w] += dy[n, c, h, w] * y[n, c, h, w] / scale[n, c, h, w]
        for c in range(C):
            head = c + R
            tail = c - R
            if head < C:
                for h in range(H):
                    for w in range(W):
                        accum[h, w] += dy[n, head, h, w] * y[n, head, h, w] / scale[n, head, h, w]
            for h in range(H):
                for w in range(W):
                    dx[n, c, h, w] -= cache_ratio * (x[n, c, h, w] * accum[h, w])
            if tail >= 0:
                for h in range(H):
                    for w in range(W):
                        accum[h, w] -= dy[n, tail, h, w] * y[n, tail, h, w] / scale[n, tail, h, w]


@njit(cache=True, nogil=True)
def lrn_within_forward(x, y, scale, L, alpha, beta):
    """x, y, scale: (N, C, H, W). scale = 1 + alpha * (sum of x^2 over the L x L window around
    the position, cut at the borders) / L^2; y = x * scale^-beta.

    This is Caffe's composition square -> AVE pooling (kernel L, stride 1, pad R) -> power
    (shift 1, scale alpha, power -beta) -> product. With stride 1 and pad R the pooling window
    never runs past the padded extent, so its divisor is always the full L * L, even at the
    borders. Caffe's power layer uses shift 1: LRNParameter.k plays no part here."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    area = L * L
    for n in range(N):
        for c in range(C):
            for h in range(H):
                h0 = max(h - R, 0)
                h1 = min(h + R + 1, H)
                for w in range(W):
                    w0 = max(w - R, 0)
                    w1 = min(w + R + 1, W)
                    # Sum into the output element so the sum rounds in the arrays' type.
                    scale[n, c, h, w] = 0
                    for hh in range(h0, h1):
                        for ww in range(w0, w1):
                            v = x[n, c, hh, ww]
                            scale[n, c, h, w] += v * v
                    scale[n, c, h, w] = 1 + alpha * (scale[n, c, h, w] / area)
                    y[n, c, h, w] = x[n, c, h, w] * scale[n, c, h, w] ** -beta


@njit(cache=True, nogil=True)
def lrn_within_backward(x, y, dy, scale, dx, L, cache_ratio, beta, ratio):
    """x, y, dy, scale, dx: (N, C, H, W); ratio: (H, W) scratch. Overwrites dx with
        dx = dy * scale^-beta - cache_ratio * x * sum over the L x L window of dy * y / scale,
    cache_ratio = 2 * alpha * beta / L^2: the chain rule through Caffe's square, pooling and
    power layers. The window is symmetric, so the positions whose window holds (h, w) are
    the window around (h, w)."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    for n in range(N):
        for c in range(C):
            for h in range(H):
                for w in range(W):
                    ratio[h, w] = dy[n, c, h, w] * y[n, c, h, w] / scale[n, c, h, w]
            for h in range(H):
                h0 = max(h - R, 0)
                h1 = min(h + R + 1, H)
                for w in range(W):
                    w0 = max(w - R, 0)
                    w1 = min(w + R + 1, W)
                    dx[n, c, h, w] = 0
                    for hh in range(h0, h1):
                        for ww in range(w0, w1):
                            dx[n, c, h, w] += ratio[hh, ww]
                    dx[n, c, h, w] = (scale[n, c, h, w] ** -beta * dy[n, c, h, w]
                                      - cache_ratio * (x[n, c, h, w] * dx[n, c, h, w]))
