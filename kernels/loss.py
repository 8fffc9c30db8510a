"""Softmax, softmax cross-entropy (SoftmaxWithLoss), infogain (InfogainLoss) and top-k accuracy
kernels over one chunk.

Caffe's formulas. The kernels know nothing of the global batch: the layers divide the chunk's
sums by the batch-wide normaliser, so every chunk's scalar is its share of the batch value.

Dimension letters: O outer positions (the chunk's samples times the axes before the class axis),
C classes (the softmax / label axis), I inner positions (the axes after it). Labels are (O, I)
float arrays, as Caffe stores them, read as integers by truncation toward zero, as Caffe does.
"""
import math

import numpy as np
from numba import njit

# Caffe clamps a probability to FLT_MIN before taking its log, in float and double alike.
FLT_MIN = 1.1754943508222875e-38

IGNORED = -1   # _class_of: the label equals ignore_label
BAD = -2       # _class_of: the label is not a class index (NaN, negative, >= C)


@njit(cache=True, nogil=True)
def _class_of(v, C, has_ignore, ignore):
    """The class index named by the label value v, IGNORED, or BAD."""
    # Range test on the float first: converting NaN or a huge value to int is undefined.
    if not (v > -2147483649.0 and v < 2147483648.0):
        return BAD
    label = int(v)
    if has_ignore and label == ignore:
        return IGNORED
    if label < 0 or label >= C:
        return BAD
    return label


@njit(cache=True, nogil=True)
def softmax_forward(x, y, work):
    """x, y: (O, C, I); work: (I,) scratch. y = exp(x - max_c x) / sum_c exp(x - max_c x)
    along C, for each (o, i). Subtracting the maximum keeps exp from overflowing."""
    O, C, I = x.shape
    for o in range(O):
        for i in range(I):
            work[i] = x[o, 0, i]
        for c in range(1, C):
            for i in range(I):
                if x[o, c, i] > work[i]:
                    work[i] = x[o, c, i]
        for c in range(C):
            for i in range(I):
                y[o, c, i] = math.exp(x[o, c, i] - work[i])
        # work now holds the sums; every class adds in order c = 0, 1, ... (fixed order).
        for i in range(I):
            work[i] = 0
        for c in range(C):
            for i in range(I):
                work[i] += y[o, c, i]
        for c in range(C):
            for i in range(I):
                y[o, c, i] /= work[i]


@njit(cache=True, nogil=True)
def softmax_backward(y, dy, dx, work):
    """y, dy, dx: (O, C, I); work: (I,) scratch. dx = (dy - sum_c dy * y) * y, from the top y
    (Caffe's form: backward needs only the output); overwrites dx."""
    O, C, I = y.shape
    for o in range(O):
        for i in range(I):
            work[i] = 0
        for c in range(C):
            for i in range(I):
                work[i] += dy[o, c, i] * y[o, c, i]
        for c in range(C):
            for i in range(I):
                dx[o, c, i] = (dy[o, c, i] - work[i]) * y[o, c, i]


@njit(cache=True, nogil=True)
def softmax_loss_forward(prob, label, has_ignore, ignore):
    """prob: (O, C, I) softmax output; label: (O, I). Returns (loss, bad): loss is
    -sum log(max(prob[o, label, i], FLT_MIN)) over the positions whose label is not ignored,
    summed in float64 in position order; bad is the flat (o * I + i) index of the first label
    that is not a class (the sum stops there), or -1."""
    O, C, I = prob.shape
    loss = 0.0
    for o in range(O):
        for i in range(I):
            k = _class_of(label[o, i], C, has_ignore, ignore)
            if k == BAD:
                return loss, o * I + i
            if k == IGNORED:
                continue
            loss -= math.log(max(prob[o, k, i], FLT_MIN))
    return loss, -1


@njit(cache=True, nogil=True)
def softmax_loss_backward(prob, label, has_ignore, ignore, scale, dx):
    """prob, dx: (O, C, I); label: (O, I). dx = (prob - onehot(label)) * scale, and 0 at
    ignored positions (scale: the top's diff over the normaliser); overwrites dx.
    Returns the flat index of the first label that is not a class (its column is zeroed,
    never indexed), or -1."""
    O, C, I = prob.shape
    bad = -1
    for o in range(O):
        for c in range(C):
            for i in range(I):
                dx[o, c, i] = prob[o, c, i] * scale
        for i in range(I):
            k = _class_of(label[o, i], C, has_ignore, ignore)
            if k >= 0:
                # Caffe subtracts 1 before scaling: the same rounding as (p - 1) * scale.
                dx[o, k, i] = (prob[o, k, i] - 1) * scale
            else:
                for c in range(C):
                    dx[o, c, i] = 0
                if k == BAD and bad < 0:
                    bad = o * I + i
    return bad


@njit(cache=True, nogil=True)
def softmax_loss_forward_parts(x, prob, work, label, has_ignore, ignore, starts, per, norm, out):
    """softmax_forward(x, prob, work), then softmax_loss_forward for each part of a call at
    once: x, prob: (O, C, I); label: (O, I); starts: (parts + 1,) the parts' first samples,
    then the call's samples; per: outer positions per sample; out: (parts,), overwritten with
    each part's sum, as softmax_loss_forward gives it for that part alone, over norm (divided
    in float64, then rounded to out's dtype). One call for the layer's whole forward pass:
    each call from Python costs microseconds, which 16 workers' small calls feel. Returns the
    flat (o * I + i) index of the first label that is not a class (no part after it is
    summed), or -1."""
    softmax_forward(x, prob, work)
    I = prob.shape[2]
    for k in range(len(starts) - 1):
        lo, hi = starts[k] * per, starts[k + 1] * per
        loss, bad = softmax_loss_forward(prob[lo:hi], label[lo:hi], has_ignore, ignore)
        out[k] = loss / norm
        if bad >= 0:
            return lo * I + bad
    return -1


@njit(cache=True, nogil=True)
def softmax_loss_backward_parts(prob, label, has_ignore, ignore, top_diff, norm, scales, starts,
                                per, dx):
    """softmax_loss_backward for each part of a call at once, part k with the scale
    top_diff[k] / norm, divided in float64 and rounded to dx's dtype in scales[k] (parts,)
    (starts, per as in softmax_loss_forward_parts). Returns the flat index of the first label
    that is not a class, or -1."""
    I = prob.shape[2]
    first_bad = -1
    for k in range(len(starts) - 1):
        scales[k] = float(top_diff[k]) / norm
        lo, hi = starts[k] * per, starts[k + 1] * per
        bad = softmax_loss_backward(prob[lo:hi], label[lo:hi], has_ignore, ignore, scales[k],
                                    dx[lo:hi])
        if bad >= 0 and first_bad < 0:
            first_bad = lo * I + bad
    return first_bad


@njit(cache=True, nogil=True)
def label_counts(label, C, has_ignore, ignore, counts):
    """label: (M,) any labels (a whole batch's); counts: (C,) integers, overwritten with the
    number of labels naming each class (ignored ones count nowhere). Returns the index of the
    first label that is not a class, or -1."""
    for c in range(C):
        counts[c] = 0
    for m in range(label.size):
        k = _class_of(label[m], C, has_ignore, ignore)
        if k == BAD:
            return m
        if k >= 0:
            counts[k] += 1
    return -1


@njit(cache=True, nogil=True)
def accuracy_forward(x, label, top_k, has_ignore, ignore, correct):
    """x: (O, C, I) scores; label: (O, I); correct: (C,) integers, overwritten with the number
    of correct predictions per true class. A prediction is correct when fewer than top_k other
    classes score at least as high as the true class: Caffe's rule, so a tie counts against
    it. A position with a NaN score is never correct (Caffe's comparisons with NaN are all
    false, which would count it as a hit). Returns (total correct, flat index of the first
    label that is not a class or -1)."""
    O, C, I = x.shape
    for c in range(C):
        correct[c] = 0
    total = 0
    for o in range(O):
        for i in range(I):
            k = _class_of(label[o, i], C, has_ignore, ignore)
            if k == BAD:
                return total, o * I + i
            if k == IGNORED:
                continue
            truth = x[o, k, i]
            better = -1   # the true class scores >= itself; it is not "another" class
            c = 0
            while c < C and better < top_k:
                v = x[o, c, i]
                if v != v:   # NaN, also the true class's: never a hit
                    better = top_k
                elif v >= truth:
                    better += 1
                c += 1
            if better < top_k:
                total += 1
                correct[k] += 1
    return total, -1


@njit(cache=True, nogil=True)
def infogain_forward(prob, label, H, has_ignore, ignore, threshold):
    """prob: (O, C, I) softmax output; label: (O, I); H: (C, C) the infogain matrix;
    threshold: Caffe's kLOG_THRESHOLD (1e-20) in the dtype. Returns (loss, count, bad): loss
    is -sum over the positions not ignored and over l of H[label, l] * log(max(prob[o, l, i],
    threshold)), each term in the dtype, summed in float64 in position order; count the
    positions summed; bad the flat index of the first label that is not a class (the sum
    stops there), or -1."""
    O, C, I = prob.shape
    loss, count = 0.0, 0
    for o in range(O):
        for i in range(I):
            k = _class_of(label[o, i], C, has_ignore, ignore)
            if k == BAD:
                return loss, count, o * I + i
            if k == IGNORED:
                continue
            for l in range(C):
                loss -= float(H[k, l] * np.log(max(prob[o, l, i], threshold)))
            count += 1
    return loss, count, -1


@njit(cache=True, nogil=True)
def matrix_row_sums(H, sums):
    """H: (C, C); sums: (C,), overwritten with each row's sum in the dtype, in order."""
    for r in range(H.shape[0]):
        t = H[r, 0] - H[r, 0]
        for c in range(H.shape[1]):
            t += H[r, c]
        sums[r] = t


@njit(cache=True, nogil=True)
def infogain_backward(prob, label, H, sums, has_ignore, ignore, scale, dx):
    """prob, dx: (O, C, I); label: (O, I); H: (C, C); sums: (C,) H's row sums. dx[o, l, i] =
    scale * (prob[o, l, i] * sums[k] - H[k, l]), k the position's label, and 0 at ignored
    positions; overwrites dx. Returns the flat index of the first label that is not a class
    (its column zeroed), or -1."""
    O, C, I = prob.shape
    bad = -1
    for o in range(O):
        for i in range(I):
            k = _class_of(label[o, i], C, has_ignore, ignore)
            if k < 0:
                for l in range(C):
                    dx[o, l, i] = scale * 0
                if k == BAD and bad < 0:
                    bad = o * I + i
                continue
            for l in range(C):
                dx[o, l, i] = scale * (prob[o, l, i] * sums[k] - H[k, l])
    return bad
