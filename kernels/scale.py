"""Broadcast product and sum kernels (Caffe's Scale and Bias layers): a blob of factors or
addends along some middle axes of the bottom, learnt or given as a second bottom.

The bottom is seen as (O, D, I): O rows (the chunk's samples times the axes before the
broadcast axes), D broadcast elements, I inner elements (the axes after them). Element d of
row o takes the factor s[off + o*o_step + d]: o_step 0 for one blob shared by every row,
D where each row has its own (a blob that begins at the batch axis).

The gradients' sums over I run in cgp.kernels.batchnorm's lanes (8 interleaved float64
partial sums, added in a fixed tree): an order fixed by the shape alone, which vectorises
where one chain in order did not (the sums of ResNet-50's Scale layers took 2 to 3 times
as long).

Dimension letters: O, D, I as above; parts as in cgp.layers.base (starts: the parts' first
rows, then O).
"""
from numba import njit

from cgp.kernels.batchnorm import plain_sum, product_and_plain_sums, product_sum


@njit(cache=True, nogil=True)
def scale_forward(x, s, off, o_step, y):
    """x, y: (O, D, I); s: flat factors. y[o, d, i] = s[off + o*o_step + d] * x[o, d, i]."""
    O, D, I = x.shape
    for o in range(O):
        for d in range(D):
            f = s[off + o * o_step + d]
            for i in range(I):
                y[o, d, i] = f * x[o, d, i]


@njit(cache=True, nogil=True)
def scale_bias_forward(x, s, off, o_step, b, b_off, b_step, y):
    """x, y: (O, D, I); s, b: flat factors and addends. y[o, d, i] = s[off + o*o_step + d] *
    x[o, d, i] + b[b_off + o*b_step + d], the product rounded before the sum: the bits of
    scale_forward then bias_forward, in one pass."""
    O, D, I = x.shape
    for o in range(O):
        for d in range(D):
            f = s[off + o * o_step + d]
            a = b[b_off + o * b_step + d]
            for i in range(I):
                y[o, d, i] = f * x[o, d, i] + a


@njit(cache=True, nogil=True)
def bias_forward(x, b, off, o_step, y):
    """x, y: (O, D, I), y may be x; b: flat addends. y[o, d, i] = x[o, d, i] +
    b[off + o*o_step + d]."""
    O, D, I = x.shape
    for o in range(O):
        for d in range(D):
            a = b[off + o * o_step + d]
            for i in range(I):
                y[o, d, i] = x[o, d, i] + a


@njit(cache=True, nogil=True)
def product_sums(dy, x, out, off, o_step, starts, step, accumulate):
    """dy, x: (O, D, I); out: flat; starts: (parts + 1,) the parts' first rows, then O.
    For each row o of part p and each d: t = the float64 sum in lanes (cgp.kernels.batchnorm)
    over i of dy[o, d, i] * x[o, d, i] (products in their dtype), then
    out[p*step + off + o*o_step + d] += t (accumulate) or = t (each element written once:
    o_step D). The factors' gradient, Caffe's sums over I then over the rows."""
    O, D, I = dy.shape
    for p in range(starts.size - 1):
        base = p * step + off
        for o in range(starts[p], starts[p + 1]):
            for d in range(D):
                t = product_sum(dy[o, d], x[o, d])
                k = base + o * o_step + d
                out[k] = out[k] + t if accumulate else t


@njit(cache=True, nogil=True)
def product_and_row_sums(dy, x, ds, db, off, o_step, starts, ds_step, db_step):
    """product_sums(dy, x, ds, off, o_step, starts, ds_step, True) and row_sums(dy, db, off,
    o_step, starts, db_step, True) in one pass, the same bits: a learnt Scale's factors and
    bias (product_and_plain_sums)."""
    O, D, I = dy.shape
    for p in range(starts.size - 1):
        for o in range(starts[p], starts[p + 1]):
            for d in range(D):
                product, plain = product_and_plain_sums(dy[o, d], x[o, d])
                k = off + o * o_step + d
                ds[p * ds_step + k] += product
                db[p * db_step + k] += plain


@njit(cache=True, nogil=True)
def product_and_row_sums_then_scale(dy, x, s, ds, db, off, o_step, starts, ds_step, db_step,
                                    dx):
    """product_and_row_sums(dy, x, ds, db, off, o_step, starts, ds_step, db_step), then
    scale_forward(dy, s, off, o_step, dx), row by row, the same bits; dx: (O, D, I). A row's
    input gradient is written right after its sums, while dy's row is still in cache: dy is
    read from memory once, not twice (a learnt Scale with bias, ResNet-50's)."""
    O, D, I = dy.shape
    for p in range(starts.size - 1):
        for o in range(starts[p], starts[p + 1]):
            for d in range(D):
                dr, xr = dy[o, d], x[o, d]
                product, plain = product_and_plain_sums(dr, xr)
                k = off + o * o_step + d
                ds[p * ds_step + k] += product
                db[p * db_step + k] += plain
                f = s[k]
                gr = dx[o, d]
                for i in range(I):
                    gr[i] = f * dr[i]


@njit(cache=True, nogil=True)
def row_sums(dy, out, off, o_step, starts, step, accumulate):
    """dy: (O, D, I); out, starts as in product_sums. out[p*step + off + o*o_step + d] (+)=
    the float64 sum in lanes (cgp.kernels.batchnorm) over i of dy[o, d, i]: the addends'
    gradient."""
    O, D, I = dy.shape
    for p in range(starts.size - 1):
        base = p * step + off
        for o in range(starts[p], starts[p + 1]):
            for d in range(D):
                t = plain_sum(dy[o, d])
                k = base + o * o_step + d
                out[k] = out[k] + t if accumulate else t
