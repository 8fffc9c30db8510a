"""Loss kernels other than the softmax-based ones (cgp.kernels.loss): Euclidean, sigmoid
cross-entropy, hinge and contrastive losses, Caffe's formulas over one chunk.

As in cgp.kernels.loss, the kernels know nothing of the global batch: forward returns the
chunk's sum (in float64, element order) and the layer divides it by the batch-wide
normaliser; backward takes the scale (the top's gradient over the normaliser) in the arrays'
dtype, as Caffe's Dtype. Per-element terms are computed in the dtype, as Caffe computes them.

Dimension letters: M elements (a flat view), N samples of the chunk, D elements per sample.
"""
import numpy as np
from numba import njit

# The integer range a label or target is read in, by truncation as Caffe's static_cast<int>.
INT_LO, INT_HI = -2147483649.0, 2147483648.0


@njit(cache=True, nogil=True)
def squared_distance(a, b):
    """a, b: (M,). The float64 sum over i of (a[i] - b[i])^2, the difference in the dtype."""
    t = 0.0
    for i in range(a.size):
        d = float(a[i] - b[i])
        t += d * d
    return t


@njit(cache=True, nogil=True)
def scaled_difference(a, b, alpha, dx):
    """a, b, dx: (M,). dx = alpha * (a - b) (the Euclidean loss's gradient; alpha carries the
    sign: -... for b); overwrites dx."""
    for i in range(a.size):
        dx[i] = alpha * (a[i] - b[i])


@njit(cache=True, nogil=True)
def _ignored(t, has_ignore, ignore):
    """Whether target t, truncated to an integer, is the ignore label."""
    return has_ignore and t > INT_LO and t < INT_HI and int(t) == ignore


@njit(cache=True, nogil=True)
def kept(t, has_ignore, ignore):
    """t: (M,) targets. How many are not the ignore label."""
    count = 0
    for i in range(t.size):
        if not _ignored(t[i], has_ignore, ignore):
            count += 1
    return count


@njit(cache=True, nogil=True)
def sigmoid_ce_forward(x, t, has_ignore, ignore, one):
    """x, t: (M,) scores and targets; one: 1 in the dtype. Returns (the float64 sum over the
    elements whose target is not ignored of -(x * (t - [x >= 0]) - log(1 + exp(x - 2 x [x >= 0]))),
    the count of those elements): Caffe's overflow-free form of the cross-entropy of
    sigmoid(x) against t, each term in the dtype."""
    loss, count = 0.0, 0
    zero = one - one
    for i in range(x.size):
        if _ignored(t[i], has_ignore, ignore):
            continue
        v = x[i]
        p = one if v >= 0 else zero
        loss -= float(v * (t[i] - p) - np.log(one + np.exp(v - (v + v) * p)))
        count += 1
    return loss, count


@njit(cache=True, nogil=True)
def sigmoid_ce_backward(x, t, has_ignore, ignore, scale, dx):
    """x, t, dx: (M,). dx = scale * (sigmoid(x) - t), 0 where the target is ignored; sigmoid
    as cgp.kernels.activation.sigmoid_forward gives it (rounded to the dtype, as Caffe keeps
    it in a blob); overwrites dx."""
    for i in range(x.size):
        if _ignored(t[i], has_ignore, ignore):
            dx[i] = scale * 0
            continue
        dx[i] = 0.5 * np.tanh(0.5 * x[i]) + 0.5
        dx[i] = scale * (dx[i] - t[i])


@njit(cache=True, nogil=True)
def hinge_forward(x, label, l2, one):
    """x: (N, D) scores; label: (N,) the true class of each sample; one: 1 in the dtype. With
    s = -1 at the label and 1 elsewhere and m = max(0, 1 + s * x) in the dtype: returns (the
    float64 sum of m, or of m^2 with l2, over the chunk, the first sample whose label is not a
    class in [0, D) or -1)."""
    N, D = x.shape
    zero = one - one
    t = 0.0
    for n in range(N):
        v = label[n]
        if not (v > INT_LO and v < INT_HI) or int(v) < 0 or int(v) >= D:
            return t, n
        k = int(v)
        for d in range(D):
            m = max(zero, one + (-x[n, d] if d == k else x[n, d]))
            t += float(m * m) if l2 else float(m)
    return t, -1


@njit(cache=True, nogil=True)
def hinge_backward(x, label, l2, scale, dx):
    """x, dx: (N, D); label as in hinge_forward (already checked). dx = scale * sign(s * m)
    (L1; sign 0 at 0) or scale * (s * m) (L2, scale then 2 * the top's gradient over N);
    overwrites dx."""
    N, D = x.shape
    one = scale - scale + 1
    zero = one - one
    for n in range(N):
        k = int(label[n])
        for d in range(D):
            s = -one if d == k else one
            g = s * max(zero, one + s * x[n, d])
            if l2:
                dx[n, d] = scale * g
            else:
                dx[n, d] = scale * (one if g > 0 else (-one if g < 0 else zero))


@njit(cache=True, nogil=True)
def _distance2(a, b, n, zero):
    """The squared distance of row n of a and b, summed in the dtype in order (Caffe's dot)."""
    d2 = zero
    for c in range(a.shape[1]):
        v = a[n, c] - b[n, c]
        d2 += v * v
    return d2


@njit(cache=True, nogil=True)
def contrastive_forward(a, b, sim, margin, legacy):
    """a, b: (N, C) the pairs' features; sim: (N,) nonzero (truncated) for a similar pair;
    margin in the dtype. Returns the float64 sum of the pairs' losses: d^2 for a similar pair,
    else max(margin - d, 0)^2, or with legacy max(margin - d^2, 0); d the Euclidean distance,
    each term in the dtype."""
    zero = margin - margin
    t = 0.0
    for n in range(a.shape[0]):
        d2 = _distance2(a, b, n, zero)
        if int(sim[n]) != 0:
            t += float(d2)
        elif legacy:
            t += float(max(margin - d2, zero))
        else:
            m = max(margin - np.sqrt(d2), zero)
            t += float(m * m)
    return t


@njit(cache=True, nogil=True)
def contrastive_backward(a, b, sim, margin, legacy, alpha, eps, dx):
    """a, b, dx: (N, C); sim as in contrastive_forward; alpha: the top's gradient over the
    batch, negated for b; eps: Caffe's 1e-4 in the dtype. dx = alpha * (a - b) for a similar
    pair; for another, beta * (a - b) where margin - d (or margin - d^2, legacy) is positive,
    beta = -alpha * (margin - d) / (d + eps) (legacy: -alpha), else 0. Overwrites dx."""
    N, C = a.shape
    zero = margin - margin
    for n in range(N):
        beta, keep = alpha, True
        if int(sim[n]) == 0:
            d2 = _distance2(a, b, n, zero)
            if legacy:
                mdist = margin - d2
                beta = -alpha
            else:
                dist = np.sqrt(d2)
                mdist = margin - dist
                beta = -alpha * mdist / (dist + eps)
            keep = mdist > 0
        for c in range(C):
            dx[n, c] = beta * (a[n, c] - b[n, c]) if keep else zero
