"""Elementwise activation kernels (Caffe's neuron layers): ReLU (leaky), Sigmoid, TanH, AbsVal,
inverted Dropout, ELU, BNLL, Exp, Log, Power, Threshold, Clip, Swish and PReLU.

Forward/backward pairs over preallocated arrays, Caffe's formulas in Caffe's order of
operations (where Caffe mixes in a double constant, the same mix here). Dropout's mask comes
from the counter-based stream in cgp.runtime.philox; nothing here keeps state or allocates.
Scalar parameters come in the arrays' dtype, as Caffe's Dtype.

Dimension letters: N samples in the chunk, D elements per sample, M = N*D (a flat view);
PReLU: C channels (axis 1) and I elements per channel (the axes after it).
"""
import numpy as np
from numba import njit

from cgp.runtime.philox import random_block, word_to_uniform


@njit(cache=True, nogil=True)
def relu_forward(x, y, slope):
    """x, y: (M,), apart or one array (in place). y = x where x > 0, else slope * x
    (slope 0: plain ReLU)."""
    if x.ctypes.data == y.ctypes.data:
        # One array for both: LLVM vectorises the loop only where it can tell they do not
        # overlap, so in place it would run element by element, several times slower.
        _relu_in_place(y, slope)
        return
    for i in range(x.size):
        v = x[i]
        y[i] = v if v > 0 else slope * v


@njit(cache=True, nogil=True)
def _relu_in_place(y, slope):
    for i in range(y.size):
        v = y[i]
        y[i] = v if v > 0 else slope * v


@njit(cache=True, nogil=True)
def relu_backward(x, dy, dx, slope):
    """x, dy, dx: (M,); dy and dx apart or one array (in place). dx = dy where x > 0, else
    slope * dy; overwrites dx. The kink x = 0 takes the slope side, as Caffe does."""
    if dy.ctypes.data == dx.ctypes.data:
        _relu_backward_in_place(x, dx, slope)   # vectorised, as relu_forward's
        return
    for i in range(x.size):
        dx[i] = dy[i] if x[i] > 0 else slope * dy[i]


@njit(cache=True, nogil=True)
def _relu_backward_in_place(x, d, slope):
    for i in range(x.size):
        v = d[i]
        d[i] = v if x[i] > 0 else slope * v


@njit(cache=True, nogil=True)
def sigmoid_forward(x, y):
    """x, y: (M,). y = 1 / (1 + exp(-x)), computed as Caffe does, 0.5 * tanh(0.5 x) + 0.5,
    which cannot overflow for large |x|."""
    for i in range(x.size):
        y[i] = 0.5 * np.tanh(0.5 * x[i]) + 0.5


@njit(cache=True, nogil=True)
def sigmoid_backward(y, dy, dx):
    """y, dy, dx: (M,). dx = dy * y * (1 - y), from the top y (Caffe's choice: backward needs
    only the output); overwrites dx."""
    for i in range(y.size):
        s = y[i]
        dx[i] = dy[i] * s * (1 - s)


@njit(cache=True, nogil=True)
def tanh_forward(x, y):
    """x, y: (M,). y = tanh(x)."""
    for i in range(x.size):
        y[i] = np.tanh(x[i])


@njit(cache=True, nogil=True)
def tanh_backward(y, dy, dx):
    """y, dy, dx: (M,). dx = dy * (1 - y^2), from the top y; overwrites dx."""
    for i in range(y.size):
        t = y[i]
        dx[i] = dy[i] * (1 - t * t)


@njit(cache=True, nogil=True)
def absval_forward(x, y):
    """x, y: (M,). y = |x|."""
    for i in range(x.size):
        y[i] = abs(x[i])


@njit(cache=True, nogil=True)
def absval_backward(x, dy, dx):
    """x, dy, dx: (M,). dx = sign(x) * dy, sign 1, -1 or 0 (x = 0, also NaN), as Caffe's
    sign then product: 0 * dy keeps the sign of zero and NaN of an infinite dy; overwrites dx."""
    for i in range(x.size):
        v, d = x[i], dy[i]
        dx[i] = d if v > 0 else (-d if v < 0 else d * 0)


@njit(cache=True, nogil=True)
def dropout_forward(x, y, mask, ratio, scale, seed, iteration, first, layer):
    """x, y, mask: (N, D). Inverted dropout: element d of sample n is kept when its uniform draw
    u >= ratio (probability 1 - ratio); mask = scale (= 1 / (1 - ratio)) where kept, else 0,
    and y = x * mask. The draw for (n, d) is lane d % 4 of the Philox block keyed by
    (seed, iteration, first + n, layer, d // 4): it depends on the global sample index, never on
    the chunk, so any split of the batch draws the same mask. ratio is compared in float64 so
    float32 and float64 arrays see the same mask."""
    N, D = x.shape
    zero = scale - scale   # 0 in scale's type, so the mask value has one type
    for n in range(N):
        sample = first + n
        for b in range((D + 3) // 4):
            words = random_block(seed, iteration, sample, layer, b)
            for lane in range(4):
                d = 4 * b + lane
                if d >= D:
                    break
                m = scale if word_to_uniform(words[lane]) >= ratio else zero
                mask[n, d] = m
                y[n, d] = x[n, d] * m


@njit(cache=True, nogil=True)
def dropout_backward(mask, dy, dx):
    """mask, dy, dx: (M,). dx = dy * mask (the kept elements' scale, or 0); overwrites dx."""
    for i in range(dy.size):
        dx[i] = dy[i] * mask[i]


@njit(cache=True, nogil=True)
def elu_forward(x, y, alpha):
    """x, y: (M,). y = max(x, 0) + alpha * (exp(min(x, 0)) - 1)."""
    zero = alpha - alpha   # 0 in the dtype: a literal 0 would widen min and exp to double
    for i in range(x.size):
        v = x[i]
        y[i] = max(v, zero) + alpha * (np.exp(min(v, zero)) - (zero + 1))


@njit(cache=True, nogil=True)
def elu_backward(x, y, dy, dx, alpha):
    """x, y, dy, dx: (M,). dx = dy where x > 0, dy * (alpha + y) where x <= 0 (Caffe's
    (x > 0) + (alpha + y) * (x <= 0)); overwrites dx."""
    for i in range(x.size):
        v = x[i]
        if v > 0:
            dx[i] = dy[i]
        elif v <= 0:
            dx[i] = dy[i] * (alpha + y[i])
        else:   # NaN: both of Caffe's indicators are 0
            dx[i] = dy[i] * ((alpha + y[i]) * 0)


# BNLL's backward clamps x here before exp (Caffe's kBNLL_THRESHOLD).
BNLL_THRESHOLD = 50.0


@njit(cache=True, nogil=True)
def bnll_forward(x, y):
    """x, y: (M,). y = log(1 + exp(x)), as x + log(1 + exp(-x)) for x > 0; the sum and log
    in double precision, as Caffe's 1. makes them."""
    for i in range(x.size):
        v = x[i]
        y[i] = v + np.log(1.0 + np.exp(-v)) if v > 0 else np.log(1.0 + np.exp(v))


@njit(cache=True, nogil=True)
def bnll_backward(x, dy, dx, threshold):
    """x, dy, dx: (M,); threshold: BNLL_THRESHOLD in the dtype. dx = dy * e / (e + 1),
    e = exp(min(x, threshold)), the division in double as Caffe's 1. makes it; overwrites
    dx."""
    for i in range(x.size):
        e = np.exp(min(x[i], threshold))
        dx[i] = dy[i] * e / (e + 1.0)


@njit(cache=True, nogil=True)
def exp_forward(x, y, inner, outer):
    """x, y: (M,). y = outer * exp(inner * x) (Caffe's ExpLayer with inner = log(base) *
    scale, outer = base^shift; either 1 is an exact identity)."""
    for i in range(x.size):
        y[i] = outer * np.exp(inner * x[i])


@njit(cache=True, nogil=True)
def exp_backward(y, dy, dx, inner):
    """y, dy, dx: (M,). dx = y * dy * inner, from the top y; overwrites dx."""
    for i in range(y.size):
        dx[i] = y[i] * dy[i] * inner


@njit(cache=True, nogil=True)
def log_forward(x, y, scale, shift, base_scale):
    """x, y: (M,). y = log(scale * x + shift) * base_scale (base_scale = 1 / log(base))."""
    for i in range(x.size):
        y[i] = np.log(scale * x[i] + shift) * base_scale


@njit(cache=True, nogil=True)
def log_backward(x, dy, dx, scale, shift, num_scale):
    """x, dy, dx: (M,). dx = dy * ((1 / (scale * x + shift)) * num_scale), num_scale = scale /
    log(base); overwrites dx."""
    one = scale - scale + 1
    for i in range(x.size):
        dx[i] = dy[i] * (one / (scale * x[i] + shift) * num_scale)


# power_backward's cases, Caffe's PowerLayer in its order of tests.
POWER_CONSTANT = 0    # power * scale == 0, or power == 1: dx = dy * power * scale (0: dx = 0)
POWER_SQUARE = 1      # power == 2: dx = dy * (2 scale * scale * x + 2 scale * shift)
POWER_NO_SHIFT = 2    # shift == 0: dx = dy * (y / x * power)
POWER_GENERAL = 3     # dx = dy * (y / (scale * x + shift) * power * scale)


@njit(cache=True, nogil=True)
def power_forward(x, y, power, scale, shift):
    """x, y: (M,). y = (scale * x + shift) ^ power; where power * scale == 0 the input is
    ignored, y = 1 (power 0) or shift ^ power, as in Caffe."""
    if power * scale == 0:
        value = (power - power + 1) if power == 0 else shift ** power
        for i in range(y.size):
            y[i] = value
        return
    for i in range(x.size):
        v = scale * x[i] + shift
        y[i] = v if power == 1 else v ** power


@njit(cache=True, nogil=True)
def power_backward(x, y, dy, dx, power, scale, shift, case):
    """x, y, dy, dx: (M,). The derivative of power_forward times dy in Caffe's order of
    operations, by `case` (the POWER_ constants); overwrites dx."""
    diff_scale = power * scale
    if case == POWER_CONSTANT:
        for i in range(x.size):
            dx[i] = dy[i] * diff_scale if diff_scale != 0 else diff_scale
    elif case == POWER_SQUARE:
        a, b = diff_scale * scale, diff_scale * shift
        for i in range(x.size):
            dx[i] = dy[i] * (a * x[i] + b)
    elif case == POWER_NO_SHIFT:
        for i in range(x.size):
            dx[i] = dy[i] * (y[i] / x[i] * power)
    else:
        for i in range(x.size):
            dx[i] = dy[i] * (y[i] / (scale * x[i] + shift) * diff_scale)


@njit(cache=True, nogil=True)
def threshold_forward(x, y, threshold):
    """x, y: (M,). y = 1 where x > threshold, else 0."""
    one = threshold - threshold + 1
    for i in range(x.size):
        y[i] = one if x[i] > threshold else one - one


@njit(cache=True, nogil=True)
def clip_forward(x, y, lo, hi):
    """x, y: (M,). y = max(lo, min(x, hi))."""
    for i in range(x.size):
        y[i] = max(lo, min(x[i], hi))


@njit(cache=True, nogil=True)
def clip_backward(x, dy, dx, lo, hi):
    """x, dy, dx: (M,). dx = dy where lo <= x <= hi (the bounds included, as Caffe), else 0;
    overwrites dx."""
    for i in range(x.size):
        v = x[i]
        dx[i] = dy[i] if v >= lo and v <= hi else dy[i] * 0


@njit(cache=True, nogil=True)
def swish_forward(x, y, beta):
    """x, y: (M,). y = x * s, s = sigmoid(beta * x) as sigmoid_forward gives it (computed
    in double, rounded to the dtype by storing it: Caffe's Swish keeps it in a blob)."""
    for i in range(x.size):
        v = x[i]
        y[i] = 0.5 * np.tanh(0.5 * (beta * v)) + 0.5
        y[i] = v * y[i]


@njit(cache=True, nogil=True)
def swish_backward(x, y, dy, dx, beta):
    """x, y, dy, dx: (M,). dx = dy * (beta * y + s * (1 - beta * y)), s recomputed as
    swish_forward has it (Caffe keeps it), 1 - beta * y in double as Caffe's 1. makes it;
    overwrites dx."""
    for i in range(x.size):
        dx[i] = 0.5 * np.tanh(0.5 * (beta * x[i])) + 0.5
        s = dx[i]
        by = beta * y[i]
        dx[i] = dy[i] * (by + s * (1.0 - by))


@njit(cache=True, nogil=True)
def prelu_forward(x, y, slope, shared):
    """x, y: (N, C, I); slope: (C,), or (1,) when shared. y = x where x > 0, else
    slope[c] * x."""
    N, C, I = x.shape
    for n in range(N):
        for c in range(C):
            a = slope[0] if shared else slope[c]
            for i in range(I):
                v = x[n, c, i]
                y[n, c, i] = v if v > 0 else a * v


@njit(cache=True, nogil=True)
def prelu_backward(x, dy, dx, slope, shared):
    """x, dy, dx: (N, C, I); slope: (C,) or (1,). dx = dy where x > 0, else slope[c] * dy;
    overwrites dx."""
    N, C, I = x.shape
    for n in range(N):
        for c in range(C):
            a = slope[0] if shared else slope[c]
            for i in range(I):
                d = dy[n, c, i]
                dx[n, c, i] = d if x[n, c, i] > 0 else a * d


@njit(cache=True, nogil=True)
def prelu_slope_parts(x, dy, dslopes, step, starts, shared):
    """x, dy: (N, C, I); dslopes: flat, part p's slope gradient ((C,), or (1,) when shared)
    at p * step; starts: (parts + 1,) the parts' first samples, then N. ADDS to each part's
    gradient dy * x over its elements with x <= 0, one at a time in (n, c, i) order, as
    Caffe adds them."""
    N, C, I = x.shape
    for p in range(starts.size - 1):
        base = p * step
        for n in range(starts[p], starts[p + 1]):
            for c in range(C):
                k = base if shared else base + c
                for i in range(I):
                    v = x[n, c, i]
                    if v <= 0:
                        dslopes[k] += dy[n, c, i] * v
