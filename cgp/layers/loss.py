"""Softmax, SoftmaxWithLoss, InfogainLoss and Accuracy layers, with Caffe's semantics.

The losses and Accuracy reduce the batch: each chunk writes its share, its own sum over
its samples divided by the batch-wide normaliser, and the engine adds the shares. A normaliser
that counts non-ignored labels needs the whole batch's labels, which the engine passes in
chunk.batch_tops when the label blob comes from a data layer. Other losses live elsewhere.
"""
from math import prod

import numpy as np

from cgp.errors import shorten
from cgp.kernels import loss as K
from cgp.layers.base import (DeviceOp, Layer, check_axis, device_op, onnx_converter, register,
                             view)
from cgp.proto import caffe_pb2
from cgp.snapshot import read_blob

LossP = caffe_pb2.LossParameter
# Caffe's kLOG_THRESHOLD: InfogainLoss clamps a probability to it before its log.
LOG_THRESHOLD = 1e-20


def normalization_mode(layer, p, default):
    """Caffe's normalization mode from loss_param `p`: `normalization` where set, else the
    old `normalize` (true: VALID, false: BATCH_SIZE), else `default`."""
    if p.HasField("normalization"):
        mode = p.normalization
    elif p.HasField("normalize"):
        mode = LossP.VALID if p.normalize else LossP.BATCH_SIZE
    else:
        mode = default
    if mode not in (LossP.FULL, LossP.VALID, LossP.BATCH_SIZE, LossP.NONE):
        raise layer.error(f"unknown normalization {mode}")
    return mode


def normaliser(mode, positions, outer, valid):
    """Caffe's get_normalizer for the whole batch, as a float of at least 1: FULL, all
    `positions`; VALID, valid() (the batch's count of positions not ignored; called only
    then); BATCH_SIZE, `outer`; NONE, 1. Some nets give a batch no labels to turn a loss
    off: the max() avoids 0 / 0."""
    if mode == LossP.FULL:
        value = positions
    elif mode == LossP.VALID:
        value = valid()
    elif mode == LossP.BATCH_SIZE:
        value = outer
    else:
        value = 1
    return max(1.0, float(value))


class _ClassAxis(Layer):
    """Shared by the layers here: bottom 0 seen as (O, C, I) around the class axis, where
    O = samples * `per_sample` (the axes between the batch axis and the class axis)."""

    def _split_axis(self, shape, axis):
        self.axis = check_axis(self, axis, len(shape))
        self.per_sample = prod(shape[1:self.axis])
        self.classes = int(shape[self.axis])
        self.inner = prod(shape[self.axis + 1:])

    def _scores(self, a, n):
        return view(a, (n * self.per_sample, self.classes, self.inner))

    def _labels(self, a, n):
        return view(a, (n * self.per_sample, self.inner))

    def _check_labels(self, shapes):
        """Caffe's rule: one label per (outer, inner) position. cgp also needs the labels'
        batch axis to match, since chunks cut both bottoms along axis 0."""
        scores, labels = (tuple(s) for s in shapes)
        if labels[0] != scores[0]:
            raise self.error(f"scores {scores} and labels {labels} must have the same first "
                             f"(batch) dimension")
        if prod(labels) != scores[0] * self.per_sample * self.inner:
            raise self.error(
                f"number of labels must match number of predictions: scores {scores} with class "
                f"axis {self.axis} need {scores[0] * self.per_sample * self.inner} labels, "
                f"labels {labels} hold {prod(labels)}")

    def _read_ignore(self, param):
        self.has_ignore = param.HasField("ignore_label")
        self.ignore = int(param.ignore_label) if self.has_ignore else 0

    def _positions(self, chunk):
        """Caffe's outer_num * inner_num for the whole batch."""
        return chunk.batch_size * self.per_sample * self.inner

    def _bad_label(self, labels, index, first):
        """The error for the label at flat `index` of `labels`, a block starting at sample
        `first` of the batch."""
        per = self.per_sample * self.inner
        value = labels.reshape(-1)[index]
        return self.error(f"label {float(value):g} (sample {first + index // per} of the batch, "
                          f"position {index % per}) is not a class: labels must be integers "
                          f"in [0, {self.classes})"
                          + (f" or the ignore_label {self.ignore}" if self.has_ignore else ""))

    def _batch_label_counts(self, chunk, why):
        """Per-class counts of the whole batch's labels (ignored ones excluded), from
        chunk.batch_tops; `why` says in the error what needs them."""
        name = self.lp.bottom[1]
        labels = chunk.batch_tops.get(name)
        if labels is None:
            raise self.error(f"{why} needs the whole batch's labels, but label blob "
                             f"'{shorten(name)}' "
                             f"is not a data layer's top: feed the labels straight from a data "
                             f"layer")
        labels = np.ascontiguousarray(labels).reshape(-1)
        if labels.size != self._positions(chunk):
            raise self.error(f"the batch's label blob '{shorten(name)}' holds {labels.size} "
                             f"labels, expected {self._positions(chunk)}")
        counts = np.zeros(self.classes, np.int64)
        bad = K.label_counts(labels, self.classes, self.has_ignore, self.ignore, counts)
        if bad >= 0:
            raise self._bad_label(labels, bad, 0)
        return counts

    def normaliser(self, chunk):
        """Caffe's get_normalizer for the whole batch, as a float (losses: their
        self.normalization)."""
        return normaliser(self.normalization, self._positions(chunk),
                          chunk.batch_size * self.per_sample, lambda: self._valid(chunk))

    def _valid(self, chunk):
        """The batch's positions whose label is not ignored."""
        if not self.has_ignore:
            return self._positions(chunk)
        return int(self._batch_label_counts(
            chunk, "normalization VALID with an ignore_label").sum())


@register("Softmax")
class Softmax(_ClassAxis):
    """y = exp(x) / sum exp(x) along softmax_param.axis (default 1), with the maximum
    subtracted first. Scratch "work": one (I,) plane of maxima and sums."""
    params_read = ("softmax_param",)

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        self._split_axis(shape, self.lp.softmax_param.axis)
        return [shape]

    def scratch_shapes(self, n):
        return {"work": (self.inner,)}

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n = chunk.n
        yield K.softmax_forward, (self._scores(bottom[0], n), self._scores(top[0], n),
                                  scratch["work"])

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        n = chunk.n
        yield K.softmax_backward, (self._scores(top[0], n), self._scores(top_diff[0], n),
                                   self._scores(bottom_diff[0], n), scratch["work"])


@register("SoftmaxWithLoss")
class SoftmaxWithLoss(_ClassAxis):
    """Softmax along softmax_param.axis, then the mean negative log-probability of the labels:
    loss = -sum log(max(p[label], FLT_MIN)) / normaliser, over the non-ignored positions.

    The normaliser (at least 1) follows loss_param.normalization: FULL, all positions
    (outer_num * inner_num); VALID (default), the non-ignored positions; BATCH_SIZE, outer_num;
    NONE, 1. When `normalization` is unset and the old `normalize` is set, normalize true means
    VALID and false BATCH_SIZE, as in Caffe. All counts are of the whole batch.

    Bottoms: scores, labels (one per position, batch axis first). Tops: the loss
    share, shape (); optionally the probabilities, shape of the scores. Being a batch-value
    top, that one has the whole batch's rows: each chunk writes its own rows and zeros elsewhere,
    so a sum of the shares is the whole batch's array. A buffer of just the chunk's rows (if
    the engine ever gives per-sample tops to such a layer) is filled as is.
    Scratch: "prob" (the probabilities, for backward), "work" (one (I,) plane) and "scales"
    (each part's gradient scale, in the run's dtype).
    """
    batch_bottoms = (1,)   # the labels, where a count over the whole batch's is needed
    bottoms = (2, 2)
    tops = (1, 2)
    params_read = ("softmax_param", "loss_param")   # Caffe's inner Softmax reads the first
    reduces_batch = True
    calls_each_time = True   # it checks the labels, and may count the whole batch's
    default_loss_weight = 1.0

    def setup(self, bottom_shapes):
        scores = tuple(bottom_shapes[0])
        self._split_axis(scores, self.lp.softmax_param.axis)
        self._check_labels(bottom_shapes)
        p = self.lp.loss_param
        self._read_ignore(p)
        self.normalization = normalization_mode(self, p, LossP.VALID)
        # Caffe's backward reads only the loss top's diff: a weight on the probabilities
        # would change the reported loss but not the gradient.
        if len(self.lp.loss_weight) > 1 and any(w != 0 for w in self.lp.loss_weight[1:]):
            raise self.error("a loss_weight on the probabilities top (top 1) is not supported: "
                             "Caffe backpropagates only the loss top")
        self.score_shape = scores
        return [()] + ([scores] if len(self.lp.top) > 1 else [])

    def scratch_shapes(self, n):
        return {"prob": (n,) + self.score_shape[1:], "work": (self.inner,), "scales": (n,)}

    def forward(self, bottom, top, params, scratch, chunk):
        """A call of one part: the tops as setup shaped them (see forward_parts)."""
        self.forward_parts(bottom, [t[np.newaxis] for t in top], params, scratch, chunk)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        self.backward_parts([t[np.newaxis] for t in top], [d[np.newaxis] for d in top_diff],
                            bottom, bottom_diff, params, param_diff, scratch, chunk)

    def forward_parts(self, bottom, top, params, scratch, chunk):
        """Every part of a call at once (Layer.takes_parts): top[j][k] is part k's top j."""
        n = chunk.n
        prob = scratch["prob"][:n]
        labels = self._labels(bottom[1], n)
        starts = chunk.starts
        bad = K.softmax_loss_forward_parts(self._scores(bottom[0], n), self._scores(prob, n),
                                           scratch["work"], labels, self.has_ignore,
                                           self.ignore, starts, self.per_sample,
                                           self.normaliser(chunk), top[0])
        if bad >= 0:
            raise self._bad_label(labels, bad, chunk.first)
        if len(top) > 1:
            for out, a, b in zip(top[1], starts[:-1], starts[1:]):
                if out.shape[0] == b - a:   # a per-sample buffer (or the part is the batch)
                    out[...] = prob[a:b]
                else:                       # the batch-value buffer of the contract: own rows
                    out[...] = 0
                    out[chunk.first + a:chunk.first + b] = prob[a:b]

    def backward_parts(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[1] is not None:
            raise self.error("cannot backpropagate to the labels (bottom 1)")
        if bottom_diff[0] is None:
            return
        n = chunk.n
        labels = self._labels(bottom[1], n)
        bad = K.softmax_loss_backward_parts(self._scores(scratch["prob"][:n], n), labels,
                                            self.has_ignore, self.ignore, top_diff[0],
                                            self.normaliser(chunk), scratch["scales"],
                                            chunk.starts, self.per_sample,
                                            self._scores(bottom_diff[0], n))
        if bad >= 0:
            raise self._bad_label(labels, bad, chunk.first)


@register("Accuracy")
class Accuracy(_ClassAxis):
    """The fraction of positions whose label is among the top_k scores along
    accuracy_param.axis (default 1); a tie with another class counts against, as in Caffe.
    Positions labelled ignore_label count nowhere; with none left the accuracy is 0.

    Tops: the accuracy share, shape (); optionally the per-class accuracy, shape (C,): each
    class's correct count over its number of labels in the whole batch (0 for a class with
    none), which needs the whole batch's labels (chunk.batch_tops). No backward.
    """
    batch_bottoms = (1,)   # the labels, where a count over the whole batch's is needed
    bottoms = (2, 2)
    tops = (1, 2)
    params_read = ("accuracy_param",)
    reduces_batch = True
    calls_each_time = True   # it checks the labels, and may count the whole batch's

    def setup(self, bottom_shapes):
        scores = tuple(bottom_shapes[0])
        p = self.lp.accuracy_param
        self._split_axis(scores, p.axis)
        self._check_labels(bottom_shapes)
        self._read_ignore(p)
        self.top_k = int(p.top_k)
        if not 1 <= self.top_k <= self.classes:
            raise self.error(f"top_k must be between 1 and the number of classes "
                             f"{self.classes} (scores {scores}), got {self.top_k}")
        return [()] + ([(self.classes,)] if len(self.lp.top) > 1 else [])

    def forward(self, bottom, top, params, scratch, chunk):
        n = chunk.n
        labels = self._labels(bottom[1], n)
        correct = np.zeros(self.classes, np.int64)
        total, bad = K.accuracy_forward(self._scores(bottom[0], n), labels, self.top_k,
                                        self.has_ignore, self.ignore, correct)
        if bad >= 0:
            raise self._bad_label(labels, bad, chunk.first)
        counts = None
        if self.has_ignore or len(top) > 1:
            what = "accuracy with an ignore_label" if self.has_ignore else "per-class accuracy"
            counts = self._batch_label_counts(chunk, what)
        count = int(counts.sum()) if self.has_ignore else self._positions(chunk)
        top[0][...] = total / count if count > 0 else 0.0
        if len(top) > 1:
            top[1][...] = np.where(counts > 0, correct / np.maximum(counts, 1), 0.0)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        """Accuracy has no gradient; the net never asks this layer for one."""


@register("InfogainLoss")
class InfogainLoss(_ClassAxis):
    """Softmax along infogain_loss_param.axis (default 1), then
    loss = -sum over the positions not ignored and over l of H[label, l] * log(max(p_l, 1e-20))
    over Caffe's normaliser (loss_param.normalization, default VALID; the old `normalize` is
    refused, as Caffe refuses it). H is C x C: the BlobProto file infogain_loss_param.source
    (relative to the working directory, as in Caffe), or the third bottom, of C*C elements,
    which must be a data layer's top: like labels that a loss counts, cgp reads it for the
    whole batch (chunk.batch_tops), where each chunk sees only its own rows of other blobs.
    Gradient: (p_l * sum_m H[label, m] - H[label, l]) * top diff / normaliser.
    Tops: the loss share; optionally the probabilities, as SoftmaxWithLoss gives them.
    Scratch: "prob", "work" and "sums" (H's row sums, for a third bottom)."""
    batch_bottoms = (1, 2)   # the labels (for VALID with an ignore_label) and H
    bottoms = (2, 3)
    tops = (1, 2)
    # Caffe's inner Softmax takes softmax_param (its engine; the axis is this layer's).
    params_read = ("infogain_loss_param", "loss_param", "softmax_param")
    reduces_batch = True
    calls_each_time = True   # it checks the labels, and may count the whole batch's
    default_loss_weight = 1.0

    def setup(self, bottom_shapes):
        scores = tuple(bottom_shapes[0])
        p = self.lp.infogain_loss_param
        self._split_axis(scores, p.axis)
        self._check_labels(bottom_shapes[:2])
        lossp = self.lp.loss_param
        if lossp.HasField("normalize"):
            raise self.error("loss_param.normalize is deprecated and InfogainLoss refuses it "
                             "(as Caffe's): use normalization")
        self._read_ignore(lossp)
        self.normalization = normalization_mode(self, lossp, LossP.VALID)
        if len(self.lp.loss_weight) > 1 and any(w != 0 for w in self.lp.loss_weight[1:]):
            raise self.error("a loss_weight on the probabilities top (top 1) is not supported: "
                             "Caffe backpropagates only the loss top")
        C = self.classes
        self.matrices = None
        if len(bottom_shapes) == 3:
            if prod(bottom_shapes[2]) != C * C:
                raise self.error(f"the infogain matrix (bottom 2, {tuple(bottom_shapes[2])}) "
                                 f"must hold {C}x{C} elements for the {C} classes")
        else:
            if not p.source:
                raise self.error("infogain_loss_param.source must name the infogain matrix "
                                 "file (a BlobProto), or give the matrix as a third bottom")
            H = read_blob(p.source, f"layer '{self.name}' infogain matrix")
            if H.size != C * C:
                raise self.error(f"the infogain matrix {p.source} holds {H.size} elements, "
                                 f"not {C}x{C} for the {C} classes")
            # Per dtype: H and its row sums, as Caffe sums them in its Dtype.
            self.matrices = {}
            for dtype in (np.float32, np.float64):
                h = np.ascontiguousarray(H.reshape(C, C), dtype)
                sums = np.zeros(C, dtype)
                K.matrix_row_sums(h, sums)
                self.matrices[np.dtype(dtype)] = (h, sums)
        self.score_shape = scores
        return [()] + ([scores] if len(self.lp.top) > 1 else [])

    def scratch_shapes(self, n):
        return {"prob": (n,) + self.score_shape[1:], "work": (self.inner,),
                "sums": (self.classes,)}

    def _matrix(self, chunk, dtype, scratch):
        """(H, its row sums) in the dtype: the file's, or the third bottom's of the batch."""
        if self.matrices is not None:
            return self.matrices[dtype]
        name = self.lp.bottom[2]
        H = chunk.batch_tops.get(name)
        if H is None:
            raise self.error(f"the infogain matrix, bottom '{name}', must be a data layer's "
                             f"top: cgp reads it for the whole batch")
        H = np.ascontiguousarray(H, dtype).reshape(self.classes, self.classes)
        K.matrix_row_sums(H, scratch["sums"])
        return H, scratch["sums"]

    def forward(self, bottom, top, params, scratch, chunk):
        n = chunk.n
        x = bottom[0]
        prob = scratch["prob"][:n]
        K.softmax_forward(self._scores(x, n), self._scores(prob, n), scratch["work"])
        H, _ = self._matrix(chunk, x.dtype, scratch)
        labels = self._labels(bottom[1], n)
        loss, _, bad = K.infogain_forward(self._scores(prob, n), labels, H, self.has_ignore,
                                          self.ignore, x.dtype.type(LOG_THRESHOLD))
        if bad >= 0:
            raise self._bad_label(labels, bad, chunk.first)
        top[0][...] = loss / self.normaliser(chunk)
        if len(top) > 1:
            out = top[1]
            if out.shape[0] == n:
                out[...] = prob
            else:   # the batch-value buffer (see SoftmaxWithLoss): its own rows
                out[...] = 0
                out[chunk.first:chunk.first + n] = prob

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        if any(d is not None for d in bottom_diff[1:]):
            raise self.error("cannot backpropagate to the labels or the infogain matrix "
                             "(bottoms 1 and 2)")
        if bottom_diff[0] is None:
            return
        n, x = chunk.n, bottom[0]
        H, sums = self._matrix(chunk, x.dtype, scratch)
        scale = x.dtype.type(float(top_diff[0]) / self.normaliser(chunk))
        labels = self._labels(bottom[1], n)
        bad = K.infogain_backward(self._scores(scratch["prob"][:n], n), labels, H, sums,
                                  self.has_ignore, self.ignore, scale,
                                  self._scores(bottom_diff[0], n))
        if bad >= 0:
            raise self._bad_label(labels, bad, chunk.first)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

def _softmax(xp, scores):
    """Softmax over axis 1 of (O, C, I) scores, the maximum subtracted first."""
    e = xp.exp(scores - scores.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@device_op(Softmax)
class SoftmaxOp(DeviceOp):

    def forward(self, bottom, top, params, scratch, chunk):
        n = bottom[0].shape[0]
        self.layer._scores(top[0], n)[...] = _softmax(self.xp, self.layer._scores(bottom[0], n))

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is None:
            return
        n = top[0].shape[0]
        y = self.layer._scores(top[0], n)
        dy = self.layer._scores(top_diff[0], n)
        self.layer._scores(bottom_diff[0], n)[...] = (
            dy - (dy * y).sum(axis=1, keepdims=True)) * y


class _LabelledOp(DeviceOp):
    """Labels checked as the CPU layer checks them (integers in [0, C) or the ignore_label),
    on the device; the message names the first bad one, as the CPU layer's does. A second
    top (second_top: what it is) is refused."""
    second_top = None

    @classmethod
    def refuses(cls, layer):
        return cls.second_top if len(layer.lp.top) > 1 else None

    def _labels(self, labels, n, chunk):
        """(O, I) float labels -> (int labels with ignored ones at 0, mask of counted ones)."""
        L, xp = self.layer, self.xp
        labels = L._labels(labels, n)
        whole = labels == xp.floor(labels)
        ok = whole & (labels >= 0) & (labels < L.classes)
        counted = ok
        if L.has_ignore:
            ignored = labels == L.ignore
            ok = ok | ignored
            counted = ok & ~ignored
        if not bool(ok.all()):
            raise L._bad_label(labels, int(xp.argmin(ok.reshape(-1))), chunk.first)
        return xp.where(counted, labels, 0).astype(np.int64), counted


@device_op(SoftmaxWithLoss)
class SoftmaxWithLossOp(_LabelledOp):
    second_top = "the probabilities top"

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        labels, counted = self._labels(bottom[1], n, chunk)
        prob = _softmax(xp, L._scores(bottom[0], n))                     # (O, C, I)
        picked = xp.take_along_axis(prob, labels[:, None, :], axis=1)[:, 0, :]
        f = prob.dtype.type
        logs = xp.log(xp.maximum(picked, f(np.finfo(prob.dtype).tiny)))
        self.prob, self.labels, self.counted = prob, labels, counted
        top[0][...] = -xp.where(counted, logs, f(0)).sum() / f(L.normaliser(chunk))

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        L, xp = self.layer, self.xp
        if bottom_diff[0] is None:
            return
        n = bottom[0].shape[0]
        f = self.prob.dtype.type
        classes = xp.arange(self.prob.shape[1])[None, :, None]
        grad = self.prob - (classes == self.labels[:, None, :]).astype(self.prob.dtype)
        grad = xp.where(self.counted[:, None, :], grad, f(0))
        scale = top_diff[0] / f(L.normaliser(chunk))
        L._scores(bottom_diff[0], n)[...] = grad * scale


@device_op(Accuracy)
class AccuracyOp(_LabelledOp):
    """A position is correct when fewer than top_k other classes score at least its label's
    (a tie counts against, as Caffe)."""
    second_top = "the per-class accuracy top"

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        labels, counted = self._labels(bottom[1], n, chunk)
        scores = L._scores(bottom[0], n)
        mine = xp.take_along_axis(scores, labels[:, None, :], axis=1)       # (O, 1, I)
        others = (scores >= mine).sum(axis=1) - 1
        correct = int(((others < L.top_k) & counted).sum())
        count = (int(L._batch_label_counts(chunk, "accuracy with an ignore_label").sum())
                 if L.has_ignore else L._positions(chunk))
        top[0][...] = correct / count if count > 0 else 0.0


@onnx_converter(Softmax)
def softmax_onnx(g, e, bottoms, tops, params, read):
    g.node("Softmax", bottoms, tops, axis=e.layer.axis)
