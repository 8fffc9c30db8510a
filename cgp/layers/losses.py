"""Losses other than the softmax-based ones (cgp.layers.loss): EuclideanLoss,
SigmoidCrossEntropyLoss, HingeLoss and ContrastiveLoss, with Caffe's semantics.

Each reduces the batch as SoftmaxWithLoss does: a call gives its share, its own sum over the
*global* batch's normaliser, and the engine adds the shares in chunk order. A normaliser that
counts the targets not ignored needs the whole batch's, which the engine passes in
chunk.batch_tops when they come from a data layer.
"""
from math import prod

import numpy as np

from cgp.kernels import losses as K
from cgp.layers.base import Layer, flat, register, view
from cgp.layers.loss import LossP, normalization_mode, normaliser
from cgp.proto import caffe_pb2


class _Loss(Layer):
    """A loss: one batch-value top, weight 1 by default, run per call; its backward reads
    the top's diff, never the top."""
    bottoms = (2, 2)   # the scores and what they are scored against
    reduces_batch = True
    calls_each_time = True
    default_loss_weight = 1.0
    backward_reads_top = False

    def _shapes(self, bottom_shapes):
        """The bottoms' shapes as tuples. Chunks cut every bottom along axis 0: their first
        axes must agree."""
        shapes = [tuple(s) for s in bottom_shapes]
        for i, shape in enumerate(shapes[1:], 1):
            if shape[0] != shapes[0][0]:
                raise self.error(f"bottom {i} {shape} and bottom 0 {shapes[0]} must have "
                                 f"the same first (batch) dimension")
        return shapes

    def _no_gradient_to(self, bottom_diff, indices, what):
        if any(bottom_diff[i] is not None for i in indices):
            raise self.error(f"cannot backpropagate to {what}")


@register("EuclideanLoss")
class EuclideanLoss(_Loss):
    """loss = sum((a - b)^2) / N / 2, N the batch. Both bottoms get a gradient,
    +-(a - b) * top diff / N, as Caffe allows."""

    def setup(self, bottom_shapes):
        a, b = self._shapes(bottom_shapes)
        if prod(a[1:]) != prod(b[1:]):
            raise self.error(f"inputs must have the same dimension: {a} and {b}")
        return [()]

    def forward(self, bottom, top, params, scratch, chunk):
        top[0][...] = K.squared_distance(flat(bottom[0]), flat(bottom[1])) / chunk.batch_size / 2

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        a, b = flat(bottom[0]), flat(bottom[1])
        dtype = a.dtype.type
        for sign, dx in zip((1, -1), bottom_diff):
            if dx is not None:
                alpha = dtype(sign * dtype(top_diff[0]) / dtype(chunk.batch_size))
                K.scaled_difference(a, b, alpha, flat(dx))


@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(_Loss):
    """The cross-entropy of sigmoid(x) against targets t in [0, 1] (same count as x):
    loss = -sum(t log p + (1 - t) log(1 - p)) over the elements whose target is not
    loss_param.ignore_label, in Caffe's overflow-free form, over the normaliser
    (loss_param.normalization; unset: the old normalize, else BATCH_SIZE, Caffe's default
    here). Gradient (p - t) * top diff / normaliser; none to the targets."""
    batch_bottoms = (1,)   # the targets, where VALID counts those not ignored
    params_read = ("loss_param",)

    def setup(self, bottom_shapes):
        x, t = self._shapes(bottom_shapes)
        if prod(x) != prod(t):
            raise self.error(f"inputs must have the same count: {x} and {t}")
        p = self.lp.loss_param
        self.has_ignore = p.HasField("ignore_label")
        self.ignore = int(p.ignore_label)
        self.normalization = normalization_mode(self, p, LossP.BATCH_SIZE)
        self.inner = prod(x[1:])
        return [()]

    def normaliser(self, chunk):
        positions = chunk.batch_size * self.inner
        return normaliser(self.normalization, positions, chunk.batch_size,
                          lambda: self._valid(chunk, positions))

    def _valid(self, chunk, positions):
        """The batch's targets that are not ignored."""
        if not self.has_ignore:
            return positions
        name = self.lp.bottom[1]
        targets = chunk.batch_tops.get(name)
        if targets is None:
            raise self.error(f"normalization VALID with an ignore_label needs the whole "
                             f"batch's targets, but blob '{name}' is not a data layer's top: "
                             f"feed the targets straight from a data layer")
        return K.kept(np.ascontiguousarray(targets).reshape(-1), True, self.ignore)

    def forward(self, bottom, top, params, scratch, chunk):
        x = flat(bottom[0])
        loss, _ = K.sigmoid_ce_forward(x, flat(bottom[1]), self.has_ignore, self.ignore,
                                       x.dtype.type(1))
        top[0][...] = loss / self.normaliser(chunk)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        self._no_gradient_to(bottom_diff, (1,), "the targets (bottom 1)")
        if bottom_diff[0] is None:
            return
        x = flat(bottom[0])
        scale = x.dtype.type(float(top_diff[0]) / self.normaliser(chunk))
        K.sigmoid_ce_backward(x, flat(bottom[1]), self.has_ignore, self.ignore, scale,
                              flat(bottom_diff[0]))


@register("HingeLoss")
class HingeLoss(_Loss):
    """The one-versus-all hinge loss of scores x (N, D...) for labels l (one class per
    sample): with s = -1 at the label and 1 elsewhere and m = max(0, 1 + s * x),
    loss = sum(m) / N (norm L1, default) or sum(m^2) / N (L2)."""
    params_read = ("hinge_loss_param",)

    def setup(self, bottom_shapes):
        x, labels = self._shapes(bottom_shapes)
        if prod(labels) != x[0]:
            raise self.error(f"needs one label per sample: labels {labels} for scores {x}")
        self.dim = prod(x[1:])
        norm = self.lp.hinge_loss_param.norm
        if norm not in (caffe_pb2.HingeLossParameter.L1, caffe_pb2.HingeLossParameter.L2):
            raise self.error(f"unknown hinge_loss_param.norm {norm}")
        self.l2 = norm == caffe_pb2.HingeLossParameter.L2
        return [()]

    def forward(self, bottom, top, params, scratch, chunk):
        n, x = chunk.n, bottom[0]
        labels = flat(bottom[1])
        total, bad = K.hinge_forward(view(x, (n, self.dim)), labels, self.l2, x.dtype.type(1))
        if bad >= 0:
            raise self.error(f"label {float(labels[bad]):g} (sample {chunk.first + bad} of the "
                             f"batch) is not a class: labels must be integers in "
                             f"[0, {self.dim})")
        top[0][...] = total / chunk.batch_size

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        self._no_gradient_to(bottom_diff, (1,), "the labels (bottom 1)")
        if bottom_diff[0] is None:
            return
        n, dtype = chunk.n, bottom[0].dtype.type
        weight = dtype(top_diff[0])
        # Caffe's loss_weight / num, or loss_weight * 2 / num, in its Dtype.
        scale = dtype((weight * 2 if self.l2 else weight) / dtype(chunk.batch_size))
        K.hinge_backward(view(bottom[0], (n, self.dim)), flat(bottom[1]), self.l2, scale,
                         view(bottom_diff[0], (n, self.dim)))


@register("ContrastiveLoss")
class ContrastiveLoss(_Loss):
    """The contrastive loss of feature pairs a, b (N, C[, 1, 1]) with similarity y (one per
    sample, nonzero for a similar pair): loss = sum(y d^2 + (1 - y) max(margin - d, 0)^2)
    / N / 2, d the pair's distance; legacy_version takes max(margin - d^2, 0) instead.
    Both feature bottoms get a gradient (Caffe's, with its 1e-4 guard on d); y none."""
    bottoms = (3, 3)
    params_read = ("contrastive_loss_param",)

    def setup(self, bottom_shapes):
        a, b, sim = self._shapes(bottom_shapes)
        for name, shape in (("bottom 0", a), ("bottom 1", b)):
            if len(shape) < 2 or len(shape) > 4 or prod(shape[2:]) != 1:
                raise self.error(f"{name} {shape} must be (num, channels) or "
                                 f"(num, channels, 1, 1)")
        if a[1] != b[1]:
            raise self.error(f"the features must have the same channels: {a} and {b}")
        if len(sim) > 4 or prod(sim[1:]) != 1:
            raise self.error(f"the similarity (bottom 2) {sim} must hold one value per sample")
        self.channels = a[1]
        return [()]

    def _params(self, dtype):
        p = self.lp.contrastive_loss_param
        return dtype(p.margin), bool(p.legacy_version)

    def forward(self, bottom, top, params, scratch, chunk):
        n, a = chunk.n, bottom[0]
        margin, legacy = self._params(a.dtype.type)
        total = K.contrastive_forward(view(a, (n, self.channels)),
                                      view(bottom[1], (n, self.channels)), flat(bottom[2]),
                                      margin, legacy)
        top[0][...] = total / chunk.batch_size / 2

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        self._no_gradient_to(bottom_diff, (2,), "the similarity labels (bottom 2)")
        n, dtype = chunk.n, bottom[0].dtype.type
        margin, legacy = self._params(dtype)
        a, b = view(bottom[0], (n, self.channels)), view(bottom[1], (n, self.channels))
        for sign, dx in zip((1, -1), bottom_diff[:2]):
            if dx is not None:
                alpha = dtype(sign * dtype(top_diff[0]) / dtype(chunk.batch_size))
                K.contrastive_backward(a, b, flat(bottom[2]), margin, legacy, alpha,
                                       dtype(1e-4), view(dx, (n, self.channels)))
