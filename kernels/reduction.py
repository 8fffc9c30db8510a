"""Per-row statistics kernels: Reduction (SUM, ASUM, SUMSQ, MEAN), ArgMax and MVN (mean and
variance normalisation), Caffe's formulas.

Every row is one sample's (or one channel of one sample's) elements, so no kernel here sums
across samples; sums run in float64 in element order and are rounded to the arrays' dtype
once, the same bits for any split of the batch.

Dimension letters: O rows, D elements reduced per row, I inner positions (ArgMax: the axes
after its axis; each (o, i) has its own D values, D apart), K the top_k of ArgMax.
"""
import numpy as np
from numba import njit

# reduction_param.operation (Caffe's ReductionParameter.ReductionOp values).
SUM, ASUM, SUMSQ, MEAN = 1, 2, 3, 4


@njit(cache=True, nogil=True)
def _row_total(row, op):
    """The float64 sum, in order, of row's elements (SUM, MEAN), their magnitudes (ASUM) or
    squares (SUMSQ)."""
    t = 0.0
    for d in range(row.size):
        v = float(row[d])
        if op == ASUM:
            t += abs(v)
        elif op == SUMSQ:
            t += v * v
        else:
            t += v
    return t


@njit(cache=True, nogil=True)
def reduction_forward(x, y, op, coeff):
    """x: (O, D); y: (O,). y[o] = coeff * (the row's total), coeff already divided by D for
    MEAN."""
    for o in range(x.shape[0]):
        y[o] = coeff * _row_total(x[o], op)


@njit(cache=True, nogil=True)
def reduction_total(x, op):
    """x: (O, D). The float64 total of every row, rows in order (a batch-value Reduction's
    share)."""
    t = 0.0
    for o in range(x.shape[0]):
        t += _row_total(x[o], op)
    return t


@njit(cache=True, nogil=True)
def reduction_backward(x, dy, dx, op, coeff):
    """x, dx: (O, D); dy: (O,), one top gradient per row. With g = dy[o] * coeff (in the
    dtype): dx = g for SUM and MEAN, sign(x) * g for ASUM (sign 0 at 0), 2g * x for SUMSQ;
    overwrites dx."""
    O, D = x.shape
    for o in range(O):
        g = dy[o] * coeff
        for d in range(D):
            if op == ASUM:
                v = x[o, d]
                dx[o, d] = g if v > 0 else (-g if v < 0 else g * 0)
            elif op == SUMSQ:
                dx[o, d] = (2 * g) * x[o, d]
            else:
                dx[o, d] = g


@njit(cache=True, nogil=True)
def argmax_forward(x, y, K, o_step, k_step, idx_off, val_off):
    """x: (O, D, I); y: flat. For each (o, i), the K largest of x[o, :, i] in descending order,
    a tie going to the larger index d (Caffe sorts (value, index) pairs): the j-th one's index
    d, as a float, to y[o*o_step + j*k_step + i + idx_off] and its value to the same place +
    val_off (each only where its offset is >= 0)."""
    O, D, I = x.shape
    for o in range(O):
        for i in range(I):
            pv, pd = x[o, 0, i], D   # the previous pick; none yet (pd = D)
            for j in range(K):
                bv, bd = pv, -1
                for d in range(D):
                    v = x[o, d, i]
                    # Below the previous pick in (value, index) order, above the best so far.
                    below = pd == D or v < pv or (v == pv and d < pd)
                    if below and (bd < 0 or v > bv or (v == bv and d > bd)):
                        bv, bd = v, d
                at = o * o_step + j * k_step + i
                if idx_off >= 0:
                    y[at + idx_off] = bd
                if val_off >= 0:
                    y[at + val_off] = bv
                pv, pd = bv, bd


@njit(cache=True, nogil=True)
def mvn_forward(x, y, std, inv_dim, eps, normalize):
    """x, y: (O, D); std: (O,), written for backward (normalize only). y = x - mean, mean =
    (the row's sum) * inv_dim; with normalize, then y /= std + eps, std = sqrt(the row's sum of
    squares of y * inv_dim) (Caffe adds eps to the deviation, not the variance)."""
    O, D = x.shape
    for o in range(O):
        mean = x.dtype.type(_row_total(x[o], SUM)) * inv_dim
        for d in range(D):
            y[o, d] = x[o, d] - mean
        if normalize:
            var = y.dtype.type(_row_total(y[o], SUMSQ)) * inv_dim
            s = np.sqrt(var) + eps
            std[o] = s
            for d in range(D):
                y[o, d] = y[o, d] / s


@njit(cache=True, nogil=True)
def mvn_backward(y, dy, dx, std, inv_dim, normalize):
    """y, dy, dx: (O, D); std: (O,) from forward. normalize: dx = (dy - inv_dim * (y * a + b))
    / std with a = the row's sum of y * dy and b that of dy (Caffe's formula, in its order);
    else dx = dy - b * inv_dim. Overwrites dx."""
    O, D = y.shape
    for o in range(O):
        b = dy.dtype.type(_row_total(dy[o], SUM))
        if normalize:
            a = 0.0
            for d in range(D):
                a += float(y[o, d] * dy[o, d])
            a = dy.dtype.type(a)
            s = std[o]
            for d in range(D):
                dx[o, d] = (dy[o, d] - inv_dim * (y[o, d] * a + b)) / s
        else:
            m = b * inv_dim
            for d in range(D):
                dx[o, d] = dy[o, d] - m
