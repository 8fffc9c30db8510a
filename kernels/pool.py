"""2-d max and average pooling kernels with Caffe's window rules (Caffe's Pooling layer).
Stochastic pooling is not here.

Window (p, q) covers input rows p*stride_h - pad_h + [0, R) and columns q*stride_w - pad_w + [0, S),
clipped to the image: padded cells never take part (a max never comes from the padding).
An average divides by the window clipped to the *padded* image, as Caffe does, so windows that
overhang the padding (ceil rounding) divide by fewer cells, while cells of the padding itself
count as zeros.

MAX forward runs in two passes per plane, through a scratch of H x Q row results: first every
input row's window columns (the max and where it is), then down each window's R rows, a vector
of an output row's columns at a time (tile.column_max: a row of 8 or 16 outputs is too short
for Numba's own vector loops, and this pass took half the time as a scalar loop). With stride 2
along the rows (Caffe's nets), the first pass takes a vector of outputs at a time too
(tile.stride2_row_max: the even cells of two vectors, one shuffle per window column, masked to
the row, so windows clipped by either edge need no second look); cifar10_quick's 3 x 3 pool1
ran 1.46x as fast forward as with the loop below (bench/kernel_ab.py). Other strides run one
long loop over the whole plane when the columns tile it (W == stride_w * Q), then redo the
windows that overhang the image's left or right edge one by one. A window-by-window loop with
R*S selects in a chain was several times slower. Taking each row's first max, then the first of
the rows' maxima, is the row-major first max over the window, so the tie rule (a later cell
must be strictly greater) is Caffe's exactly. 2x2 windows with stride 2 (LeNet's) do not
overlap and take one pass: stride2_row_max over both rows of each window, in row-major order.

AVE runs PLANE_BLOCK planes at a time, turned so that the planes lie innermost: every step of
a window's sum, forward and backward, is then one vector loop over the block's planes (a plane
of 8 x 8 or 16 x 16 cells is too small to vectorise by itself; this ran 1.2 - 6x as fast as
loops over each plane, with the same bits). Forward sums each of the window's rows left to
right, then the rows top to bottom, where Caffe adds all cells in row-major order: the same
sum, rounded differently (a few units in the last place of float32). Backward adds each
cell's shares in Caffe's order.

Dimension letters: N samples in the chunk, C channels, H W input height and width, P Q output
height and width, R S window height and width.
"""
import numpy as np
from numba import njit

from cgp.kernels.elementwise import copy
from cgp.runtime.simd import column_max, lanes, stride2_row_max, transpose_block

# Caffe starts every max at -FLT_MAX (for float and double alike), so a window of -inf or NaN
# reports -FLT_MAX.
_LOWEST = -3.4028234663852886e38
# Planes that AVE's kernels take at a time (see above).
PLANE_BLOCK = 64


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
    plane index."""
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
    if stride_w == 2:
        stride2_row_max(xf, xb, W, -pad_w, Q, S, rmax, rarg, 0, 0, lowest, H, 1, W)
        return
    q_lo, q_hi = inner_columns(Q, W, S, stride_w, pad_w)
    if _tiles(W, Q, stride_w, pad_w):
        _row_max(xf, xb, rmax, rarg, q_lo, (H - 1) * Q + q_hi, -pad_w, S, stride_w, lowest)
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
def _max_pool_2x2(xf, yf, af, planes, H, W, P, Q, pad_h, pad_w):
    """max_pool_forward for 2x2 windows with stride 2, in one pass (tile.stride2_row_max over
    both rows of each window): one call for each plane's output rows whose windows hold two
    image rows, one for each row clipped to one by the image's top or bottom edge."""
    lowest = xf.dtype.type(_LOWEST)
    p_lo, p_hi = inner_columns(P, H, 2, 2, pad_h)
    for plane in range(planes):
        xb = plane * H * W
        top = 2 * p_lo - pad_h
        stride2_row_max(xf, xb + top * W, W, -pad_w, Q, 2, yf, af, (plane * P + p_lo) * Q,
                        top * W, lowest, p_hi - p_lo, 2, 2 * W)
        for p in range(P):
            if p == p_lo:
                break
            _max_2x2_edge_row(xf, yf, af, xb, plane, p, H, W, P, Q, pad_h, pad_w, lowest)
        for p in range(p_hi, P):
            _max_2x2_edge_row(xf, yf, af, xb, plane, p, H, W, P, Q, pad_h, pad_w, lowest)


@njit(cache=True, nogil=True)
def _max_2x2_edge_row(xf, yf, af, xb, plane, p, H, W, P, Q, pad_h, pad_w, lowest):
    """Output row p of _max_pool_2x2, whose windows the image's edge clips to one row."""
    h0, h1, _ = _window_rows(p, 2, 2, pad_h, H)
    stride2_row_max(xf, xb + h0 * W, W, -pad_w, Q, 2, yf, af, (plane * P + p) * Q, h0 * W,
                    lowest, 1, h1 - h0, W)


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
            column_max(yf, af, out, rmax, rarg, h0 * Q, Q, h1 - h0)


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
def ave_sizes(H, W, P, Q):
    """Scratch of ave_pool_forward and ave_pool_backward: (float elements, int32 elements).
    Both keep the windows' sizes after (P*Q + H*W + 1) blocks' rows (_window_sizes)."""
    return (P * Q + H * W + 1) * PLANE_BLOCK + P * Q, 2 * (H + W)


@njit(cache=True, nogil=True)
def _window_sizes(planes, at, H, W, P, Q, R, S, stride_h, stride_w, pad_h, pad_w):
    """planes[at + p*Q + q] = the size of window (p, q) clipped to the padded image, the
    average's divisor."""
    for p in range(P):
        size_h = _window_rows(p, R, stride_h, pad_h, H)[2]
        for q in range(Q):
            w0 = q * stride_w - pad_w
            planes[at + p * Q + q] = size_h * (min(w0 + S, W + pad_w) - w0)


@njit(cache=True, nogil=True)
def _to_blocks(src, first, n, cells, dst, at, B):
    """dst[at + cell*B + i] = src[(first + i)*cells + cell] for i < n planes: a block of
    planes turned so that the planes lie innermost."""
    V = lanes(src.itemsize)
    for i0 in range(0, n, V):
        for c0 in range(0, cells, V):
            transpose_block(dst, at + c0 * B + i0, B, src, (first + i0) * cells + c0, cells,
                            min(V, n - i0), min(V, cells - c0), dst, 0, False)


@njit(cache=True, nogil=True)
def _from_blocks(src, at, B, dst, first, n, cells):
    """The inverse of _to_blocks: dst[(first + i)*cells + cell] = src[at + cell*B + i]."""
    V = lanes(src.itemsize)
    for c0 in range(0, cells, V):
        for i0 in range(0, n, V):
            transpose_block(dst, (first + i0) * cells + c0, cells, src, at + c0 * B + i0, B,
                            min(V, cells - c0), min(V, n - i0), src, 0, False)


@njit(cache=True, nogil=True)
def ave_pool_forward(x, y, planes, R, S, stride_h, stride_w, pad_h, pad_w):
    """x: (N, C, H, W); y: (N, C, P, Q); planes: scratch (ave_sizes). y = (sum of the
    window's image cells: each row's cells left to right, from the first cell (from 0 for a
    window that overhangs the left or right edge), then the rows top to bottom) / (size of the
    window clipped to the padded image).

    In blocks of planes (see the module's docstring)."""
    N, C, H, W = x.shape
    P, Q = y.shape[2], y.shape[3]
    HW, PQ, B = H * W, P * Q, PLANE_BLOCK
    if planes.size < (PQ + HW + 1) * B + PQ:
        raise ValueError("ave_pool_forward: scratch too small")
    # planes: the block's cells (HW rows of B planes), its outputs (PQ rows of B), one row's
    # sum (B), the windows' sizes (PQ).
    xt, yt, row, sizes = 0, HW * B, (HW + PQ) * B, (HW + PQ + 1) * B
    _window_sizes(planes, sizes, H, W, P, Q, R, S, stride_h, stride_w, pad_h, pad_w)
    xf = x.reshape(N * C * HW)
    yf = y.reshape(N * C * PQ)
    q_lo, q_hi = inner_columns(Q, W, S, stride_w, pad_w)
    for b0 in range(0, N * C, B):
        n = min(B, N * C - b0)
        _to_blocks(xf, b0, n, HW, planes, xt, B)
        r = planes[row:row + n]
        for p in range(P):
            h0, h1, _ = _window_rows(p, R, stride_h, pad_h, H)
            for q in range(Q):
                w0 = q * stride_w - pad_w
                size = planes[sizes + p * Q + q]
                c0, c1 = max(w0, 0), min(w0 + S, W)
                out = planes[yt + (p * Q + q) * B:yt + (p * Q + q) * B + n]
                for h in range(h0, h1):
                    if q_lo <= q < q_hi:
                        cell = planes[xt + (h * W + c0) * B:xt + (h * W + c0) * B + n]
                        copy(cell, r)
                        c = c0 + 1
                    else:
                        r[:] = 0
                        c = c0
                    for w in range(c, c1):
                        cell = planes[xt + (h * W + w) * B:xt + (h * W + w) * B + n]
                        for i in range(n):
                            r[i] += cell[i]
                    if h == h0:
                        copy(r, out)
                    else:
                        for i in range(n):
                            out[i] += r[i]
                for i in range(n):
                    out[i] = out[i] / size
        _from_blocks(planes, yt, B, yf, b0, n, PQ)


@njit(cache=True, nogil=True)
def _covering(i, size, stride, pad, count):
    """(lo, hi): the windows j in [lo, hi) (of count) whose cells j*stride - pad + [0, size)
    include cell i. Floor division rounds toward -inf, as the bounds need."""
    lo = max((i + pad - size) // stride + 1, 0)
    hi = min((i + pad) // stride + 1, count)
    return lo, max(lo, hi)


@njit(cache=True, nogil=True)
def ave_pool_backward(dy, dx, planes, cover, R, S, stride_h, stride_w, pad_h, pad_w):
    """dy: (N, C, P, Q); dx: (N, C, H, W), OVERWRITTEN; scratch (ave_sizes): planes, cover
    (int32). Each window's image cells get dy / (window size, as in forward); a cell covered
    by several windows adds their shares to 0 in (p, q) order, as Caffe's window-by-window
    loop does, each share divided once. In blocks of planes (see the module's docstring)."""
    N, C, P, Q = dy.shape
    H, W = dx.shape[2], dx.shape[3]
    PQ, HW, B = P * Q, H * W, PLANE_BLOCK
    if planes.size < (PQ + HW + 1) * B + PQ or cover.size < 2 * (H + W):
        raise ValueError("ave_pool_backward: scratch too small")
    # planes: the block's shares by window (PQ rows of B planes), its cells by cell (HW rows
    # of B), one unused row (B), the windows' sizes (PQ). cover: the windows over row h,
    # [cover[2h], cover[2h+1]), then over column w, [cover[2H + 2w], cover[2H + 2w + 1]).
    gt, dxt, sizes = 0, PQ * B, (PQ + HW + 1) * B
    _window_sizes(planes, sizes, H, W, P, Q, R, S, stride_h, stride_w, pad_h, pad_w)
    for h in range(H):
        cover[2 * h], cover[2 * h + 1] = _covering(h, R, stride_h, pad_h, P)
    for w in range(W):
        cover[2 * (H + w)], cover[2 * (H + w) + 1] = _covering(w, S, stride_w, pad_w, Q)
    dyf = dy.reshape(N * C * PQ)
    dxf = dx.reshape(N * C * HW)
    for b0 in range(0, N * C, B):
        nb = min(B, N * C - b0)
        _to_blocks(dyf, b0, nb, PQ, planes, gt, B)
        for j in range(PQ):
            size = planes[sizes + j]
            g = planes[gt + j * B:gt + j * B + nb]
            for i in range(nb):
                g[i] = g[i] / size
        for h in range(H):
            for w in range(W):
                cell = planes[dxt + (h * W + w) * B:dxt + (h * W + w) * B + nb]
                cell[:] = 0
                for p in range(cover[2 * h], cover[2 * h + 1]):
                    for q in range(cover[2 * (H + w)], cover[2 * (H + w) + 1]):
                        g = planes[gt + (p * Q + q) * B:gt + (p * Q + q) * B + nb]
                        for i in range(nb):
                            cell[i] += g[i]
        _from_blocks(planes, dxt, B, dxf, b0, nb, HW)
