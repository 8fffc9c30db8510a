"""2-d max and average pooling kernels with Caffe's window rules (Caffe's Pooling layer).
Stochastic pooling is not here.

Window (p, q) covers input rows p*stride_h - pad_h + [0, R) and columns q*stride_w - pad_w + [0, S),
clipped to the image: padded cells never take part (a max never comes from the padding).
An average divides by the window clipped to the *padded* image, as Caffe does, so windows that
overhang the padding (ceil rounding) divide by fewer cells, while cells of the padding itself
count as zeros.

Dimension letters: N samples in the chunk, C channels, H W input height and width, P Q output
height and width, R S window height and width.
"""
import numpy as np
from numba import njit

# Caffe starts every max at -FLT_MAX (for float and double alike), so a window of -inf or NaN
# reports -FLT_MAX.
_LOWEST = -3.4028234663852886e38


@njit(cache=True, nogil=True)
def max_pool_forward(x, y, arg, R, S, stride_h, stride_w, pad_h, pad_w):
    """x: (N, C, H, W); y, arg: (N, C, P, Q). y = the window's max; arg = its index h*W + w in
    the (H, W) plane, stored as a float (exact below 2^24 cells). Ties go to the first cell in
    row-major order (a later cell must be strictly greater), Caffe's rule. A window where
    nothing beats -FLT_MAX points at its first cell.

    Planes are indexed flat with unsigned indices (np.uintp), as in conv.im2col: a signed
    index costs a wrap-around test per element."""
    N, C, H, W = x.shape
    P, Q = y.shape[2], y.shape[3]
    xf = x.reshape(N * C * H * W)
    yf = y.reshape(N * C * P * Q)
    af = arg.reshape(N * C * P * Q)
    lowest = x.dtype.type(_LOWEST)
    for plane in range(N * C):
        xb = plane * H * W
        for p in range(P):
            h0 = p * stride_h - pad_h
            h1 = min(h0 + R, H)
            h0 = max(h0, 0)
            for q in range(Q):
                w0 = q * stride_w - pad_w
                w1 = min(w0 + S, W)
                w0 = max(w0, 0)
                best = lowest
                at = h0 * W + w0
                for h in range(h0, h1):
                    for w in range(h * W + w0, h * W + w1):
                        v = xf[np.uintp(xb + w)]
                        # Selects, not a branch: on real data the branch is a coin toss,
                        # and mispredicting it dominated the run time.
                        greater = v > best
                        at = w if greater else at
                        best = v if greater else best
                out = np.uintp((plane * P + p) * Q + q)
                yf[out] = best
                af[out] = at


@njit(cache=True, nogil=True)
def max_pool_backward(dy, arg, dx):
    """dy, arg: (N, C, P, Q); dx: (N, C, H, W), OVERWRITTEN: each dy goes to the cell its
    window's max came from; overlapping windows add up in (p, q) order."""
    N, C, P, Q = dy.shape
    H, W = dx.shape[2], dx.shape[3]
    dyf = dy.reshape(N * C * P * Q)
    af = arg.reshape(N * C * P * Q)
    dxf = dx.reshape(N * C * H * W)
    dxf[:] = 0
    for plane in range(N * C):
        for i in range(plane * P * Q, (plane + 1) * P * Q):
            dxf[np.uintp(plane * H * W + int(af[i]))] += dyf[i]


@njit(cache=True, nogil=True)
def ave_pool_forward(x, y, R, S, stride_h, stride_w, pad_h, pad_w):
    """x: (N, C, H, W); y: (N, C, P, Q). y = (sum of the window's image cells) / (size of the
    window clipped to the padded image). Flat unsigned indices, as in max_pool_forward."""
    N, C, H, W = x.shape
    P, Q = y.shape[2], y.shape[3]
    xf = x.reshape(N * C * H * W)
    yf = y.reshape(N * C * P * Q)
    zero = x.dtype.type(0)
    for plane in range(N * C):
        xb = plane * H * W
        for p in range(P):
            h0 = p * stride_h - pad_h
            h1 = min(h0 + R, H + pad_h)
            size_h = h1 - h0
            h0 = max(h0, 0)
            h1 = min(h1, H)
            for q in range(Q):
                w0 = q * stride_w - pad_w
                w1 = min(w0 + S, W + pad_w)
                size = size_h * (w1 - w0)
                w0 = max(w0, 0)
                w1 = min(w1, W)
                acc = zero
                for h in range(h0, h1):
                    for w in range(h * W + w0, h * W + w1):
                        acc += xf[np.uintp(xb + w)]
                # Divide in the arrays' type, as Caffe does (an int would promote to float64).
                yf[np.uintp((plane * P + p) * Q + q)] = acc / x.dtype.type(size)


@njit(cache=True, nogil=True)
def ave_pool_backward(dy, dx, R, S, stride_h, stride_w, pad_h, pad_w):
    """dy: (N, C, P, Q); dx: (N, C, H, W), OVERWRITTEN: each window's image cells get
    dy / (window size, as in forward); overlapping windows add up in (p, q) order."""
    N, C, P, Q = dy.shape
    H, W = dx.shape[2], dx.shape[3]
    dyf = dy.reshape(N * C * P * Q)
    dxf = dx.reshape(N * C * H * W)
    dxf[:] = 0
    for plane in range(N * C):
        xb = plane * H * W
        for p in range(P):
            h0 = p * stride_h - pad_h
            h1 = min(h0 + R, H + pad_h)
            size_h = h1 - h0
            h0 = max(h0, 0)
            h1 = min(h1, H)
            for q in range(Q):
                w0 = q * stride_w - pad_w
                w1 = min(w0 + S, W + pad_w)
                size = size_h * (w1 - w0)
                w0 = max(w0, 0)
                w1 = min(w1, W)
                g = dyf[np.uintp((plane * P + p) * Q + q)] / dy.dtype.type(size)
                for h in range(h0, h1):
                    for w in range(h * W + w0, h * W + w1):
                        dxf[np.uintp(xb + w)] += g
