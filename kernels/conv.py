"""2-d convolution kernels (Caffe's Convolution): im2col into a scratch matrix, then one BLAS
GEMM per sample and group; col2im brings the input gradient back. No N-d convolution here.

Every GEMM has the same shape for every sample, so a sample's output never depends on which
other samples share its chunk, and parameter gradients add up one sample at a time in sample
order (each sample's product goes through a scratch matrix, then is added).

Dimension letters: N samples in the chunk, C input channels, K output channels (filters),
G groups (C/G and K/G channels per group), H W input height and width, P Q output height and
width, R S kernel height and width. CRS = C*R*S is the column matrix's height, and
CgRS = (C/G)*R*S the length of one filter.
"""
import numpy as np
# Numba's np.dot calls the BLAS that SciPy ships, and loads it only when a kernel first runs.
# Loading it now, on import, puts it in place before the trainer pins BLAS to one thread
# (threadpoolctl limits only libraries already loaded); loaded later, it would run threads of
# its own inside each worker, with results that then depend on the thread count.
import scipy.linalg.cython_blas  # noqa: F401
from numba import njit


@njit(cache=True, nogil=True)
def _valid_range(off, stride, size, count):
    """The output positions i in [0, count) whose input position i*stride + off lies in
    [0, size): returns (lo, hi). Floor division rounds toward -inf, which is what makes the
    bounds right for negative offsets (inside the padding)."""
    lo = -(off // stride) if off < 0 else 0
    hi = (size - 1 - off) // stride + 1
    if hi > count:
        hi = count
    if hi < lo:
        hi = lo
    return lo, hi


@njit(cache=True, nogil=True)
def im2col(x, col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q):
    """x: (C, H, W) one sample; col: (C*R*S, P*Q). Row (c*R + r)*S + s holds, for every output
    position (p, q), the input x[c, p*stride_h - pad_h + r*dil_h, q*stride_w - pad_w + s*dil_w],
    or 0 where that falls in the padding.

    Indexing is flat and unsigned (np.uintp): every index here is non-negative by construction,
    and a signed index would cost a wrap-around test per element (Python's negative indices)
    that keeps the copies from being vectorised; this runs about three times faster."""
    C, H, W = x.shape
    PQ = P * Q
    xf = x.reshape(C * H * W)
    cf = col.reshape(col.size)
    for c in range(C):
        for r in range(R):
            off_h = r * dil_h - pad_h
            p_lo, p_hi = _valid_range(off_h, stride_h, H, P)
            for s in range(S):
                base = ((c * R + r) * S + s) * PQ
                off_w = s * dil_w - pad_w
                q_lo, q_hi = _valid_range(off_w, stride_w, W, Q)
                for i in range(base, base + p_lo * Q):
                    cf[np.uintp(i)] = 0
                for i in range(base + p_hi * Q, base + PQ):
                    cf[np.uintp(i)] = 0
                for p in range(p_lo, p_hi):
                    dst = base + p * Q
                    # Input index of output column q: src + q * stride_w (>= 0 for q >= q_lo).
                    src = (c * H + p * stride_h + off_h) * W + off_w
                    for q in range(q_lo):
                        cf[np.uintp(dst + q)] = 0
                    if stride_w == 1:
                        d = np.uintp(dst + q_lo)
                        t = np.uintp(src + q_lo)
                        for i in range(q_hi - q_lo):
                            cf[d + np.uintp(i)] = xf[t + np.uintp(i)]
                    else:
                        for q in range(q_lo, q_hi):
                            cf[np.uintp(dst + q)] = xf[np.uintp(src + q * stride_w)]
                    for q in range(q_hi, Q):
                        cf[np.uintp(dst + q)] = 0


@njit(cache=True, nogil=True)
def col2im(col, dx, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q):
    """The adjoint of im2col: col (C*R*S, P*Q) -> dx (C, H, W), one sample. Overwrites dx;
    overlapping windows add up in the fixed order (c, r, s, p, q). Unsigned flat indices, as
    in im2col."""
    C, H, W = dx.shape
    PQ = P * Q
    dxf = dx.reshape(C * H * W)
    cf = col.reshape(col.size)
    dxf[:] = 0
    for c in range(C):
        for r in range(R):
            off_h = r * dil_h - pad_h
            p_lo, p_hi = _valid_range(off_h, stride_h, H, P)
            for s in range(S):
                base = ((c * R + r) * S + s) * PQ
                off_w = s * dil_w - pad_w
                q_lo, q_hi = _valid_range(off_w, stride_w, W, Q)
                for p in range(p_lo, p_hi):
                    src = base + p * Q
                    dst = (c * H + p * stride_h + off_h) * W + off_w
                    if stride_w == 1:
                        d = np.uintp(dst + q_lo)
                        t = np.uintp(src + q_lo)
                        for i in range(q_hi - q_lo):
                            dxf[d + np.uintp(i)] += cf[t + np.uintp(i)]
                    else:
                        for q in range(q_lo, q_hi):
                            dxf[np.uintp(dst + q * stride_w)] += cf[np.uintp(src + q)]


@njit(cache=True, nogil=True)
def _is_pointwise(R, S, stride_h, stride_w, pad_h, pad_w):
    """A 1x1 kernel with stride 1 and no padding: the column matrix is the input itself."""
    return R == 1 and S == 1 and stride_h == 1 and stride_w == 1 and pad_h == 0 and pad_w == 0


@njit(cache=True, nogil=True)
def conv_forward(x, w, b, y, col, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, group):
    """x: (N, C, H, W); w: (K, C/G, R, S); b: (K,), or (0,) for no bias; y: (N, K, P, Q);
    col: (C*R*S, P*Q) scratch. Per sample n and group g (G = group):
    y[n, g's K/G filters] = w[g's filters] @ col[g's C/G channels], then y[n, k] += b[k]."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = y.shape[2], y.shape[3]
    CgRS = Cg * R * S
    Kg = K // group
    w2 = w.reshape((K, CgRS))
    pointwise = _is_pointwise(R, S, stride_h, stride_w, pad_h, pad_w)
    for n in range(N):
        if pointwise:
            cols = x[n].reshape((C, H * W))
        else:
            im2col(x[n], col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q)
            cols = col
        yn = y[n].reshape((K, P * Q))
        for g in range(group):
            np.dot(w2[g * Kg:(g + 1) * Kg], cols[g * CgRS:(g + 1) * CgRS], yn[g * Kg:(g + 1) * Kg])
        if b.size > 0:
            for k in range(K):
                bk = b[k]
                yk = yn[k]
                for i in range(P * Q):
                    yk[i] += bk


@njit(cache=True, nogil=True)
def conv_backward(x, w, dy, dx, dw, db, col, wtmp, stride_h, stride_w, pad_h, pad_w,
                  dil_h, dil_w, group, need_dx):
    """x: (N, C, H, W); w: (K, C/G, R, S); dy: (N, K, P, Q); dx: like x (any array when not
    need_dx), OVERWRITTEN; dw: like w and db: (K,) or (0,) are ADDED to, one sample at a time
    in sample order; col: (C*R*S, P*Q) and wtmp: (K, C/G*R*S) scratch. Per sample n:
    db += sums of dy[n] over (P, Q); dw += dy[n] @ col^T by group (through wtmp, so that the
    sum runs in sample order); dx[n] = col2im(w^T @ dy[n]) by group."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    CgRS = Cg * R * S
    Kg = K // group
    w2 = w.reshape((K, CgRS))
    dw2 = dw.reshape((K, CgRS))
    pointwise = _is_pointwise(R, S, stride_h, stride_w, pad_h, pad_w)
    for n in range(N):
        dyn = dy[n].reshape((K, PQ))
        if db.size > 0:
            for k in range(K):
                dyk = dyn[k]
                acc = dyk[0] * 0
                for i in range(PQ):
                    acc += dyk[i]
                db[k] += acc
        if pointwise:
            cols = x[n].reshape((C, H * W))
        else:
            im2col(x[n], col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q)
            cols = col
        for g in range(group):
            np.dot(dyn[g * Kg:(g + 1) * Kg], cols[g * CgRS:(g + 1) * CgRS].T,
                   wtmp[g * Kg:(g + 1) * Kg])
        for k in range(K):
            dwk = dw2[k]
            tk = wtmp[k]
            for j in range(CgRS):
                dwk[j] += tk[j]
        if need_dx:
            # The column gradient goes straight into dx when the columns are the input itself.
            dcols = dx[n].reshape((C, H * W)) if pointwise else col
            for g in range(group):
                np.dot(w2[g * Kg:(g + 1) * Kg].T, dyn[g * Kg:(g + 1) * Kg],
                       dcols[g * CgRS:(g + 1) * CgRS])
            if not pointwise:
                col2im(col, dx[n], R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q)
