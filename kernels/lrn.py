"""Local response normalisation kernels (Caffe's LRN), across channels and within a channel.

Caffe's formulas and summation order. Forward stores the denominator's base `scale` and its
power `power` = scale^-beta for backward, which so needs no power of its own (a power costs
more than the rest of an element's work); the layer owns those buffers and a one-plane work
buffer. Nothing here allocates. The loops run along rows (views of W elements indexed from 0),
which the compiler turns into vectors wherever no power is taken.

Dimension letters: N samples in the chunk, C channels, H W height and width. L is local_size
(odd), and the window around a position reaches R = (L - 1) / 2 either side, cut at the borders.
"""
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def lrn_across_forward(x, y, scale, power, L, alpha_over_L, beta, k):
    """x, y, scale, power: (N, C, H, W). scale[c] = k + alpha / L * sum of x[c']^2 over
    channels c' in [c - R, c + R] (missing channels count 0); power = scale^-beta;
    y = x * power.

    As in Caffe, the window slides: scale[c] = scale[c - 1] + a * x[c + R]^2 - a * x[c - R - 1]^2,
    which costs O(C) per position instead of O(C * L)."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    for n in range(N):
        for h in range(H):
            first = scale[n, 0, h]
            for w in range(W):
                first[w] = k
            for c in range(min(R + 1, C)):
                xr = x[n, c, h]
                for w in range(W):
                    v = xr[w]
                    first[w] += alpha_over_L * (v * v)
        for c in range(1, C):
            head = c + R
            tail = c - R - 1
            for h in range(H):
                prev, cur = scale[n, c - 1, h], scale[n, c, h]
                # Rows of channels head and tail, read only where those channels exist.
                xh, xt = x[n, min(head, C - 1), h], x[n, max(tail, 0), h]
                for w in range(W):
                    s = prev[w]
                    if head < C:
                        v = xh[w]
                        s += alpha_over_L * (v * v)
                    if tail >= 0:
                        v = xt[w]
                        s -= alpha_over_L * (v * v)
                    cur[w] = s
        for c in range(C):
            _power_plane(x[n, c], y[n, c], scale[n, c], power[n, c], beta)


@njit(cache=True, nogil=True)
def _power_plane(x, y, scale, power, beta):
    """One plane (H, W): power = scale^-beta, y = x * power. (The helpers here take a plane,
    not a row: a call costs tens of nanoseconds, as much as a row of 16 elements.)"""
    if beta == 0.75:
        _three_quarters_plane(x, y, scale, power)
        return
    H, W = x.shape
    for h in range(H):
        xr, yr, sr, pr = x[h], y[h], scale[h], power[h]
        for w in range(W):
            p = sr[w] ** -beta
            pr[w] = p
            yr[w] = p * xr[w]


# Square roots vectorise where a power (a call into libm, no vector maths library here) does
# not: AlexNet's and GoogLeNet's beta, 0.75, runs ~3x as fast this way. error_model "numpy":
# a scale of 0 gives inf, as the power does, and keeps the loop free of checks.
@njit(cache=True, nogil=True, error_model="numpy")
def _three_quarters_plane(x, y, scale, power):
    """_power_plane for beta = 0.75: scale^-0.75 = 1 / (sqrt(scale) * sqrt(sqrt(scale))) in
    float64, rounded once to the arrays' dtype. In float32 that is the correctly rounded
    power but for near-ties (it matched NumPy's float64 power on 4 million values, where libm's
    float32 power was one step off for 0.01 – 0.09 % of them, by the range of the scales)."""
    H, W = x.shape
    for h in range(H):
        xr, yr, sr, pr = x[h], y[h], scale[h], power[h]
        for w in range(W):
            r = np.sqrt(np.float64(sr[w]))
            p = pr.dtype.type(1.0 / (r * np.sqrt(r)))
            pr[w] = p
            yr[w] = p * xr[w]


@njit(cache=True, nogil=True)
def lrn_across_backward(x, y, dy, scale, power, dx, L, cache_ratio, accum):
    """x, y, dy, scale, power, dx: (N, C, H, W), scale and power as forward left them;
    accum: (H * W,) scratch. Overwrites dx with
        dx[c] = dy[c] * scale[c]^-beta
                - cache_ratio * x[c] * sum over c' in [c - R, c + R] of dy[c'] * y[c'] / scale[c'],
    cache_ratio = 2 * alpha * beta / L (Caffe's formula). The channel sum slides like forward's;
    each ratio dy * y / scale is recomputed, bitwise the same, when it leaves the window."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    if accum.size < H * W:
        raise ValueError("lrn_across_backward: accum too small")
    for n in range(N):
        for c in range(C):
            for h in range(H):
                pr, dyr, dxr = power[n, c, h], dy[n, c, h], dx[n, c, h]
                for w in range(W):
                    dxr[w] = pr[w] * dyr[w]
        _clear(accum[:H * W])
        a = accum[:H * W].reshape(H, W)
        # Prime the window with channels [0, R - 1]: the loop below adds channel c + R first.
        for c in range(min(R, C)):
            _add_ratios(a, dy[n, c], y[n, c], scale[n, c], 1)
        for c in range(C):
            head = c + R
            tail = c - R
            if head < C:
                _add_ratios(a, dy[n, head], y[n, head], scale[n, head], 1)
            for h in range(H):
                xr, dxr, ar = x[n, c, h], dx[n, c, h], a[h]
                for w in range(W):
                    dxr[w] -= cache_ratio * (xr[w] * ar[w])
            if tail >= 0:
                _add_ratios(a, dy[n, tail], y[n, tail], scale[n, tail], -1)


# Divisions by scale follow C (error_model "numpy"): a scale of 0, which huge inputs can
# leave in the sliding channel sums as Caffe's, gives inf or NaN as in Caffe, for the
# trainer's check of non-finite values, instead of a ZeroDivisionError from a worker.
@njit(cache=True, nogil=True, error_model="numpy")
def _add_ratios(a, dy, y, scale, sign):
    """One plane (H, W): a += dy * y / scale (sign 1) or a -= it (sign -1)."""
    H, W = a.shape
    for h in range(H):
        ar, dyr, yr, sr = a[h], dy[h], y[h], scale[h]
        if sign > 0:
            for w in range(W):
                ar[w] += dyr[w] * yr[w] / sr[w]
        else:
            for w in range(W):
                ar[w] -= dyr[w] * yr[w] / sr[w]


@njit(cache=True, nogil=True)
def plane_size(H, W, L):
    """Elements of the within-channel kernels' plane: H x W padded by (L - 1) / 2 all round."""
    return (H + L - 1) * (W + L - 1)


@njit(cache=True, nogil=True)
def _window_sums(padded, out, H, W, L):
    """padded: an H x W plane with (L - 1) / 2 zeros on every side, flat; out: (H, W),
    OVERWRITTEN with each position's sum over its L x L window of the plane, from 0, the
    window's rows in order and each row's columns in order. The zeros stand in for the
    positions a window cut at the border leaves out: adding 0 to a sum that started from 0
    changes nothing (such a sum is never -0), so every position sums in one pattern, a row of
    positions at a time as vectors."""
    Wp = W + L - 1
    for h in range(H):
        o = out[h]
        for w in range(W):
            o[w] = 0
        for i in range(L):
            for j in range(L):
                row = padded[(h + i) * Wp + j:(h + i) * Wp + j + W]
                for w in range(W):
                    o[w] += row[w]


@njit(cache=True, nogil=True)
def _clear(a):
    """a: (M,). a = 0."""
    for i in range(a.size):
        a[i] = 0


@njit(cache=True, nogil=True)
def _clear_plane(plane, H, W, L):
    """plane: scratch, refused unless it holds plane_size(H, W, L) elements; set to 0: the
    border of zeros that _window_sums reads, around the interior each kernel fills."""
    if plane.size < plane_size(H, W, L):
        raise ValueError("lrn within-channel kernel: plane too small")
    _clear(plane)


@njit(cache=True, nogil=True)
def lrn_within_forward(x, y, scale, power, plane, L, alpha, beta):
    """x, y, scale, power: (N, C, H, W); plane: plane_size(H, W, L) elements of scratch.
    scale = 1 + alpha * (sum of x^2 over the L x L window around the position, cut at the
    borders) / L^2; power = scale^-beta; y = x * power.

    This is Caffe's composition square -> AVE pooling (kernel L, stride 1, pad R) -> power
    (shift 1, scale alpha, power -beta) -> product. With stride 1 and pad R the pooling window
    never runs past the padded extent, so its divisor is always the full L * L, even at the
    borders. Caffe's power layer uses shift 1: LRNParameter.k plays no part here. Each
    window sums the squares, rounded in the arrays' type, in the window's row-major order
    (_window_sums)."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    area = L * L
    Wp = W + 2 * R
    _clear_plane(plane, H, W, L)
    for n in range(N):
        for c in range(C):
            for h in range(H):
                xr = x[n, c, h]
                sq = plane[(h + R) * Wp + R:(h + R) * Wp + R + W]
                for w in range(W):
                    v = xr[w]
                    sq[w] = v * v
            sc = scale[n, c]
            _window_sums(plane, sc, H, W, L)
            for h in range(H):
                sr = sc[h]
                for w in range(W):
                    sr[w] = 1 + alpha * (sr[w] / area)
            _power_plane(x[n, c], y[n, c], sc, power[n, c], beta)


@njit(cache=True, nogil=True, error_model="numpy")   # as _add_ratios
def lrn_within_backward(x, y, dy, scale, power, dx, L, cache_ratio, plane):
    """x, y, dy, scale, power, dx: (N, C, H, W), scale and power as forward left them;
    plane: plane_size(H, W, L) elements of scratch. Overwrites dx with
        dx = dy * scale^-beta - cache_ratio * x * sum over the L x L window of dy * y / scale,
    cache_ratio = 2 * alpha * beta / L^2: the chain rule through Caffe's square, pooling and
    power layers. The window is symmetric, so the positions whose window holds (h, w) are
    the window around (h, w); it sums as forward's does."""
    N, C, H, W = x.shape
    R = (L - 1) // 2
    Wp = W + 2 * R
    _clear_plane(plane, H, W, L)
    for n in range(N):
        for c in range(C):
            for h in range(H):
                dyr, yr, sr = dy[n, c, h], y[n, c, h], scale[n, c, h]
                ratio = plane[(h + R) * Wp + R:(h + R) * Wp + R + W]
                for w in range(W):
                    ratio[w] = dyr[w] * yr[w] / sr[w]
            dxc = dx[n, c]
            _window_sums(plane, dxc, H, W, L)
            for h in range(H):
                dxr, pr, dyr, xr = dxc[h], power[n, c, h], dy[n, c, h], x[n, c, h]
                for w in range(W):
                    dxr[w] = pr[w] * dyr[w] - cache_ratio * (xr[w] * dxr[w])
