"""2-d max and average pooling kernels with Caffe's window rules (Caffe's Pooling layer).
Stochastic pooling is not here.

Window (p, q) covers input rows p*stride_h - pad_h + [0, R) and columns q*stride_w - pad_w + [0, S),
clipped to the image: padded cells never take part (a max never comes from the padding).
An average divides by the window clipped to the *padded* image, as Caffe does, so windows that
overhang the padding (ceil rounding) divide by fewer cells, while cells of the padding itself
count as zeros.

Forward runs in two passes per plane, through a scratch of H x Q row results: first every
input row's window columns (the max and where it is, or the sum), then down each window's R
rows. The first pass is one long loop over the whole plane when the columns tile it
(W == stride_w * Q, as in Caffe's nets), with the window width and stride as literals for the
common 2- and 3-wide windows, so it compiles to SIMD code; windows that overhang the image's
left or right edge are then redone one by one. A window-by-window loop with R*S selects in a
chain was several times slower.

- MAX: taking each row's first max, then the first of the rows' maxima, is the row-major
  first max over the window, so the tie rule (a later cell must be strictly greater) is
  Caffe's exactly. 2x2 windows with stride 2 (LeNet's) do not overlap and take one pass,
  vectorised across each output row: faster there than two.
- AVE: the window's sum is its row sums added top to bottom, where Caffe adds all cells in
  row-major order: the same sum, rounded differently (a few units in the last place of float32).

Dimension letters: N samples in the chunk, C channels, H W input height and width, P Q output
height and width, R S window height and width.
"""
import numpy as np
from numba import njit

# Caffe starts every max at -FLT_MAX (for float and double alike), so a window of -inf or NaN
# reports -FLT_MAX.
_LOWEST = -3.4028234663852886e38


@njit(cache=True, nogil=True)
def inner_columns(Q, W, S, stride_w, pad_w):
    """(q_lo, q_hi): the outputs q in [q_lo, q_hi) have windows wholly inside columns [0, W);
    those before and after overhang the padding or the ceil-rounded edge."""
    q_lo = min((pad_w + stride_w - 1) // stride_w, Q)
    q_hi = min(max((W + pad_w - S) // stride_w + 1, q_lo), Q)
    return q_lo, q_hi


@njit(cache=True, nogil=True)
def _tiles(W, Q, stride_w, pad_w):
    """Whether the windows' columns tile the rows (W == stride_w * Q), so that window q of row
    h starts at plane index stride_w * (h*Q + q) - pad_w and one loop covers the plane. The
    loop also passes over the border windows of the rows inside the plane, reading from the
    rows beside them (and redone afterwards); pad_w + stride_w <= W keeps those reads inside
    the plane (tiling windows are narrower than 2*pad_w + 2*stride_w)."""
    return W == stride_w * Q and pad_w + stride_w <= W


# -- MAX ----------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _row_max(xf, xb, rmax, rarg, u_lo, u_hi, off, S, stride_w, lowest):
    """For u in [u_lo, u_hi): rmax[u] = the max over the plane cells off + u*stride_w + [0, S)
    (the plane starting at xf[xb]), the first in a tie, starting from `lowest`; rarg[u] = its
    plane index. Called with literal S and stride_w for the common windows."""
    for u in range(u_lo, u_hi):
        base = off + u * stride_w
        best = lowest
        at = base
        for j in range(S):
            v = xf[np.uintp(xb + base + j)]
            # Selects, not a branch: on real data the branch is a coin toss.
            greater = v > best
            at = base + j if greater else at
            best = v if greater else best
        rmax[np.uintp(u)] = best
        rarg[np.uintp(u)] = at


@njit(cache=True, nogil=True)
def _row_maxima(xf, xb, rmax, rarg, H, W, Q, S, stride_w, pad_w, lowest):
    """Pass 1 of max pooling over the plane at xf[xb]: rmax[h*Q + q], rarg[h*Q + q] = the max
    of row h over window q's columns (clipped to the image) and its plane index h*W + w."""
    q_lo, q_hi = inner_columns(Q, W, S, stride_w, pad_w)
    if _tiles(W, Q, stride_w, pad_w):
        u_lo, u_hi = q_lo, (H - 1) * Q + q_hi
        if S == 2 and stride_w == 2:
            _row_max(xf, xb, rmax, rarg, u_lo, u_hi, -pad_w, 2, 2, lowest)
        elif S == 3 and stride_w == 2:
            _row_max(xf, xb, rmax, rarg, u_lo, u_hi, -pad_w, 3, 2, lowest)
        else:
            _row_max(xf, xb, rmax, rarg, u_lo, u_hi, -pad_w, S, stride_w, lowest)
    else:
        for h in range(H):
            _row_max(xf, xb, rmax, rarg, h * Q + q_lo, h * Q + q_hi,
                     h * (W - stride_w * Q) - pad_w, S, stride_w, lowest)
    # The windows that overhang the left or right edge, clipped.
    for h in range(H):
        for q in range(Q):
            if q == q_lo:
                break
            _clipped_row_max(xf, xb, rmax, rarg, h, q, W, Q, S, stride_w, pad_w, lowest)
        for q in range(q_hi, Q):
            _clipped_row_max(xf, xb, rmax, rarg, h, q, W, Q, S, stride_w, pad_w, lowest)


@njit(cache=True, nogil=True)
def _clipped_row_max(xf, xb, rmax, rarg, h, q, W, Q, S, stride_w, pad_w, lowest):
    """rmax, rarg at h*Q + q for a window that overhangs the image's edge. A plain loop: the
    vectorised _row_max costs far more to enter than one window takes."""
    w0 = q * stride_w - pad_w
    w1 = min(w0 + S, W)
    w0 = max(w0, 0)
    best = lowest
    at = h * W + w0
    for w in range(h * W + w0, h * W + w1):
        v = xf[np.uintp(xb + w)]
        greater = v > best
        at = w if greater else at
        best = v if greater else best
    rmax[np.uintp(h * Q + q)] = best
    rarg[np.uintp(h * Q + q)] = at


@njit(cache=True, nogil=True)
def _col_max(rmax, rarg, yf, af, out, first, Q, R):
    """Pass 2 for one output row: yf[out + q], af[out + q] = the first max over the R row
    results rmax[first + i*Q + q], i = 0, 1, ... The winning row is kept as a number and its
    index read once at the end: selecting between two loaded indices compiles to a branch."""
    for q in range(Q):
        best = rmax[np.uintp(first + q)]
        which = 0
        for i in range(1, R):
            v = rmax[np.uintp(first + i * Q + q)]
            greater = v > best
            which = i if greater else which
            best = v if greater else best
        yf[np.uintp(out + q)] = best
        af[np.uintp(out + q)] = rarg[np.uintp(first + which * Q + q)]


@njit(cache=True, nogil=True)
def _max_2x2(xf, yf, af, xb, out, top, q_lo, q_hi, W):
    """Windows q in [q_lo, q_hi) of one output row of 2x2 windows with stride 2, wholly inside
    the image: rows top // W and the next, columns 2q + [0, 2), top = h0*W - pad_w. One pass
    beats two here: the windows do not overlap and the rows are short."""
    lowest = xf.dtype.type(_LOWEST)
    for q in range(q_lo, q_hi):
        base = top + 2 * q
        best = lowest
        at = base
        for i in range(2):
            for j in range(2):
                w = base + i * W + j
                v = xf[np.uintp(xb + w)]
                greater = v > best
                at = w if greater else at
                best = v if greater else best
        yf[np.uintp(out + q)] = best
        af[np.uintp(out + q)] = at


@njit(cache=True, nogil=True)
def _max_pool_2x2(xf, yf, af, planes, H, W, P, Q, pad_h, pad_w):
    """max_pool_forward for 2x2 windows with stride 2, in one pass: full windows through
    _max_2x2, those clipped by the image's edges one by one."""
    lowest = xf.dtype.type(_LOWEST)
    q_lo, q_hi = inner_columns(Q, W, 2, 2, pad_w)
    for plane in range(planes):
        xb = plane * H * W
        for p in range(P):
            h0, h1, _ = _window_rows(p, 2, 2, pad_h, H)
            out = (plane * P + p) * Q
            for q in range(Q):
                if q == q_lo and h1 - h0 == 2:
                    _max_2x2(xf, yf, af, xb, out, h0 * W - pad_w, q_lo, q_hi, W)
                if q_lo <= q < q_hi and h1 - h0 == 2:
                    continue
                w0 = 2 * q - pad_w
                w1 = min(w0 + 2, W)
                w0 = max(w0, 0)
                best = lowest
                at = h0 * W + w0
                for h in range(h0, h1):
                    for w in range(h * W + w0, h * W + w1):
                        v = xf[np.uintp(xb + w)]
                        greater = v > best
                        at = w if greater else at
                        best = v if greater else best
                yf[np.uintp(out + q)] = best
                af[np.uintp(out + q)] = at


@njit(cache=True, nogil=True)
def max_pool_forward(x, y, arg, rmax, rarg, R, S, stride_h, stride_w, pad_h, pad_w):
    """x: (N, C, H, W); y, arg: (N, C, P, Q); rmax, rarg: (H*Q,) scratch (rarg and arg
    int32). y = the window's max; arg = its index h*W + w in the (H, W) plane. Ties go to the
    first cell in row-major order (a later cell must be strictly greater), Caffe's rule. A
    window where nothing beats -FLT_MAX points at its first cell.

    Planes are indexed flat with unsigned indices (np.uintp): a signed index costs a
    wrap-around test per element and blocks vectorisation."""
    N, C, H, W = x.shape
    P, Q = y.shape[2], y.shape[3]
    xf = x.reshape(N * C * H * W)
    yf = y.reshape(N * C * P * Q)
    af = arg.reshape(N * C * P * Q)
    lowest = x.dtype.type(_LOWEST)
    if R == 2 and S == 2 and stride_h == 2 and stride_w == 2:
        _max_pool_2x2(xf, yf, af, N * C, H, W, P, Q, pad_h, pad_w)
        return
    for plane in range(N * C):
        _row_maxima(xf, plane * H * W, rmax, rarg, H, W, Q, S, stride_w, pad_w, lowest)
        for p in range(P):
            h0, h1, _ = _window_rows(p, R, stride_h, pad_h, H)
            out = (plane * P + p) * Q
            if h1 - h0 == 2:
                _col_max(rmax, rarg, yf, af, out, h0 * Q, Q, 2)
            elif h1 - h0 == 3:
                _col_max(rmax, rarg, yf, af, out, h0 * Q, Q, 3)
            else:
                _col_max(rmax, rarg, yf, af, out, h0 * Q, Q, h1 - h0)


@njit(cache=True, nogil=True)
def max_pool_backward(dy, arg, dx):
    """dy, arg: (N, C, P, Q); dx: (N, C, H, W), OVERWRITTEN: each dy goes to the cell its
    window's max came from; overlapping windows add up in (p, q) order."""
    N, C, P, Q = dy.shape
    H, W = dx.shape[2], dx.shape[3]
    dyf = dy.reshape(N * C * P * Q)
    af = arg.reshape(N * C * P * Q)
    dxf = dx.reshape(N * C * H * W)
    for plane in range(N * C):
        # Each plane is cleared just before its scatter, while it sits in cache.
        xb = plane * H * W
        dxf[xb:xb + H * W] = 0
        for i in range(plane * P * Q, (plane + 1) * P * Q):
            dxf[np.uintp(xb + int(af[i]))] += dyf[i]


@njit(cache=True, nogil=True)
def _window_rows(p, R, stride_h, pad_h, H):
    """(h0, h1, size_h): window p's image rows [h0, h1) and its height clipped to the padded
    image, the average's divisor along h."""
    h0 = p * stride_h - pad_h
    h1 = min(h0 + R, H + pad_h)
    return max(h0, 0), min(h1, H), h1 - h0


# -- AVE ----------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _row_sum(xf, xb, rsum, u_lo, u_hi, off, S, stride_w):
    """For u in [u_lo, u_hi): rsum[u] = the sum of the plane cells off + u*stride_w + [0, S),
    left to right (the plane starting at xf[xb])."""
    for u in range(u_lo, u_hi):
        base = xb + off + u * stride_w
        acc = xf[np.uintp(base)]
        for j in range(1, S):
            acc += xf[np.uintp(base + j)]
        rsum[np.uintp(u)] = acc


@njit(cache=True, nogil=True)
def _row_sums(xf, xb, rsum, H, W, Q, S, stride_w, pad_w):
    """Pass 1 of average pooling over the plane at xf[xb]: rsum[h*Q + q] = the sum of row h
    over window q's columns (clipped to the image), left to right."""
    q_lo, q_hi = inner_columns(Q, W, S, stride_w, pad_w)
    if _tiles(W, Q, stride_w, pad_w):
        u_lo, u_hi = q_lo, (H - 1) * Q + q_hi
        if S == 2 and stride_w == 2:
            _row_sum(xf, xb, rsum, u_lo, u_hi, -pad_w, 2, 2)
        elif S == 3 and stride_w == 2:
            _row_sum(xf, xb, rsum, u_lo, u_hi, -pad_w, 3, 2)
        else:
            _row_sum(xf, xb, rsum, u_lo, u_hi, -pad_w, S, stride_w)
    else:
        for h in range(H):
            _row_sum(xf, xb, rsum, h * Q + q_lo, h * Q + q_hi, h * (W - stride_w * Q) - pad_w,
                     S, stride_w)
    for h in range(H):
        for q in range(Q):
            if q == q_lo:
                break
            _clipped_row_sum(xf, xb, rsum, h, q, W, Q, S, stride_w, pad_w)
        for q in range(q_hi, Q):
            _clipped_row_sum(xf, xb, rsum, h, q, W, Q, S, stride_w, pad_w)


@njit(cache=True, nogil=True)
def _clipped_row_sum(xf, xb, rsum, h, q, W, Q, S, stride_w, pad_w):
    """rsum at h*Q + q for a window that overhangs the image's edge (a plain loop, as in
    _clipped_row_max)."""
    w0 = q * stride_w - pad_w
    w1 = min(w0 + S, W)
    w0 = max(w0, 0)
    acc = xf.dtype.type(0)
    for w in range(h * W + w0, h * W + w1):
        acc += xf[np.uintp(xb + w)]
    rsum[np.uintp(h * Q + q)] = acc


@njit(cache=True, nogil=True)
def _col_sum(rsum, yf, out, first, Q, R, size_h, W, S, stride_w, pad_w):
    """Pass 2 for one output row: yf[out + q] = (rsum[first + q] + rsum[first + Q + q] + ...,
    R rows, top to bottom) / (size_h times window q's width clipped to the padded image),
    divided in the arrays' type as Caffe does."""
    for q in range(Q):
        acc = rsum[np.uintp(first + q)]
        for i in range(1, R):
            acc += rsum[np.uintp(first + i * Q + q)]
        w0 = q * stride_w - pad_w
        size = size_h * (min(w0 + S, W + pad_w) - w0)
        yf[np.uintp(out + q)] = acc / rsum.dtype.type(size)


@njit(cache=True, nogil=True)
def ave_pool_forward(x, y, rsum, R, S, stride_h, stride_w, pad_h, pad_w):
    """x: (N, C, H, W); y: (N, C, P, Q); rsum: (H*Q,) scratch. y = (sum of the window's image
    cells: row sums, added top to bottom) / (size of the window clipped to the padded image).
    Flat unsigned indices, as in max_pool_forward."""
    N, C, H, W = x.shape
    P, Q = y.shape[2], y.shape[3]
    xf = x.reshape(N * C * H * W)
    yf = y.reshape(N * C * P * Q)
    for plane in range(N * C):
        _row_sums(xf, plane * H * W, rsum, H, W, Q, S, stride_w, pad_w)
        for p in range(P):
            h0, h1, size_h = _window_rows(p, R, stride_h, pad_h, H)
            out = (plane * P + p) * Q
            if h1 - h0 == 3:
                _col_sum(rsum, yf, out, h0 * Q, Q, 3, size_h, W, S, stride_w, pad_w)
            else:
                _col_sum(rsum, yf, out, h0 * Q, Q, h1 - h0, size_h, W, S, stride_w, pad_w)


@njit(cache=True, nogil=True)
def ave_pool_backward(dy, dx, R, S, stride_h, stride_w, pad_h, pad_w):
    """dy: (N, C, P, Q); dx: (N, C, H, W), OVERWRITTEN: each window's image cells get
    dy / (window size, as in forward); overlapping windows add up in (p, q) order, window by
    window as Caffe does, each window's share divided once."""
    N, C, P, Q = dy.shape
    H, W = dx.shape[2], dx.shape[3]
    dyf = dy.reshape(N * C * P * Q)
    dxf = dx.reshape(N * C * H * W)
    q_lo, q_hi = inner_columns(Q, W, S, stride_w, pad_w)
    for plane in range(N * C):
        xb = plane * H * W
        dxf[xb:xb + H * W] = 0
        for p in range(P):
            h0, h1, size_h = _window_rows(p, R, stride_h, pad_h, H)
            row = (plane * P + p) * Q
            # Left border windows, then the inner ones, then the right border: (p, q) order.
            for q in range(q_lo):
                _ave_window_backward(dyf, dxf, xb, row + q, W, h0, h1, size_h,
                                     q * stride_w - pad_w, S, pad_w)
            size = dy.dtype.type(size_h * S)
            for q in range(q_lo, q_hi):
                g = dyf[np.uintp(row + q)] / size
                left = xb + q * stride_w - pad_w
                for h in range(h0, h1):
                    cell = left + h * W
                    for j in range(S):
                        dxf[np.uintp(cell + j)] += g
            for q in range(q_hi, Q):
                _ave_window_backward(dyf, dxf, xb, row + q, W, h0, h1, size_h,
                                     q * stride_w - pad_w, S, pad_w)


@njit(cache=True, nogil=True)
def _ave_window_backward(dyf, dxf, xb, o, W, h0, h1, size_h, w0, S, pad_w):
    """One window's share: dxf[xb + h*W + w] += dyf[o] / size over its image cells."""
    w1 = min(w0 + S, W + pad_w)
    size = size_h * (w1 - w0)
    w0 = max(w0, 0)
    w1 = min(w1, W)
    g = dyf[np.uintp(o)] / dyf.dtype.type(size)
    for h in range(h0, h1):
        for w in range(h * W + w0, h * W + w1):
            dxf[np.uintp(xb + w)] += g
