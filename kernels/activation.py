"""Elementwise activation kernels: ReLU (leaky), Sigmoid, TanH, AbsVal and inverted Dropout.

Forward/backward pairs over preallocated arrays, Caffe's formulas. Dropout's mask comes from the
counter-based stream in random.py; nothing here keeps state or allocates.

Dimension letters: N samples in the chunk, D elements per sample, M = N*D (a flat view).
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
