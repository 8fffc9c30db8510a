"""Counter-based random numbers for layers that draw (Dropout): Philox4x32-10.

Philox4x32-10 is the counter-based generator of Salmon, Moraes, Dror and Shaw, "Parallel random
numbers: as easy as 1, 2, 3" (SC'11), as published in their Random123 library; it is checked here
against Random123's known-answer vectors (tests/test_activation.py). A draw is a pure function of
its key, so any split of a batch into chunks, on any number of threads, draws the same numbers.
This module has no state and no seeding API: callers build the key from what they know.
"""
import numpy as np
from numba import njit

# Philox4x32 constants (Random123): round multipliers and Weyl key increments.
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_TWO = np.uint64(2)
_THREE = np.uint64(3)
# 2**-32: maps a 32-bit word to [0, 1), exactly representable in float64.
_INV_2_32 = 1.0 / 4294967296.0


@njit(cache=True, nogil=True)
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds: counter (c0..c3) and key (k0, k1), each a 32-bit word held in
    an unsigned 64-bit integer (numba widens integer arithmetic; every step masks back to 32
    bits). Returns the four 32-bit output words as a tuple of np.uint64."""
    c0 = np.uint64(c0) & _MASK32
    c1 = np.uint64(c1) & _MASK32
    c2 = np.uint64(c2) & _MASK32
    c3 = np.uint64(c3) & _MASK32
    k0 = np.uint64(k0) & _MASK32
    k1 = np.uint64(k1) & _MASK32
    for r in range(10):
        if r > 0:
            # Random123 bumps the key between rounds, not before the first one.
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0           # < 2**64: both factors are 32-bit
        p1 = _M1 * c2
        hi0 = p0 >> _SHIFT32
        lo0 = p0 & _MASK32
        hi1 = p1 >> _SHIFT32
        lo1 = p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@njit(cache=True, nogil=True)
def random_block(seed, iteration, sample, layer, block):
    """Four uniform 32-bit words for elements 4*block .. 4*block+3 of one sample's stream.

    Key layout: counter = (block, sample, iteration, layer), Philox key = the 64-bit seed split
    into two 32-bit words. Each counter word keeps the low 32 bits of its value."""
    s = np.uint64(seed)
    return philox4x32_10(block, sample, iteration, layer, s & _MASK32, s >> _SHIFT32)


@njit(cache=True, nogil=True)
def word_to_uniform(word):
    """A 32-bit word -> float64 in [0, 1) (multiples of 2**-32)."""
    return np.float64(word) * _INV_2_32


@njit(cache=True, nogil=True)
def uniform(seed, iteration, sample, layer, element):
    """One uniform float64 in [0, 1), a pure function of the key
    (seed, iteration, global sample index, layer index, element index within the sample).

    Element e is lane e % 4 of Philox block e // 4, so a kernel that walks a sample's elements
    in blocks of four (as dropout_forward does) draws exactly these numbers."""
    e = np.uint64(element)
    words = random_block(seed, iteration, sample, layer, e >> _TWO)
    lane = e & _THREE
    if lane == 0:
        w = words[0]
    elif lane == 1:
        w = words[1]
    elif lane == 2:
        w = words[2]
    else:
        w = words[3]
    return word_to_uniform(w)


@njit(cache=True, nogil=True)
def uniform_fill(seed, iteration, sample, layer, out):
    """out: (D,). out[d] = uniform(seed, iteration, sample, layer, d) for every element d of
    one sample's stream, one Philox block per four elements."""
    D = out.shape[0]
    for b in range((D + 3) // 4):
        words = random_block(seed, iteration, sample, layer, b)
        for lane in range(4):
            d = 4 * b + lane
            if d >= D:
                break
            out[d] = word_to_uniform(words[lane])
