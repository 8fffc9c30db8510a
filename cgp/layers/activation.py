"""Activation layers: ReLU, Sigmoid, TanH, AbsVal and Dropout, with Caffe's formulas and
parameters.

Each works elementwise on one bottom and one top of the same shape. Caffe nets often run them
"in place" (top named like the bottom); the net builder gives every top its own buffer, except
a ReLU's where sharing changes no bit (Layer.in_place), so the others never see aliased
arrays. Dropout draws its mask from a counter-based stream keyed by (seed, iteration, global
sample, layer index, element), so any split of the batch draws the same mask.
"""
from cgp.kernels import activation as K
from cgp.layers.base import Layer, flat, register
from cgp.proto import caffe_pb2


class _Elementwise(Layer):
    """One bottom, one top of the same shape, no parameters."""

    def setup(self, bottom_shapes):
        self.shape = tuple(bottom_shapes[0])
        return [self.shape]


@register("ReLU")
class ReLU(_Elementwise):
    """y = x where x > 0, else negative_slope * x; backward uses the bottom x (the top y
    when it runs in place, as Caffe's does)."""
    params_read = ("relu_param",)

    def setup(self, bottom_shapes):
        self.slope = float(self.lp.relu_param.negative_slope)
        # Backward then reads the top for the bottom: y > 0 exactly where x > 0 (a slope
        # below 0 would make negative x positive), so dx is bitwise the same.
        self.in_place = self.slope >= 0
        return super().setup(bottom_shapes)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        x = bottom[0]
        yield K.relu_forward, (flat(x), flat(top[0]), x.dtype.type(self.slope))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        x = bottom[0]
        yield K.relu_backward, (flat(x), flat(top_diff[0]), flat(bottom_diff[0]),
                                x.dtype.type(self.slope))


@register("Sigmoid")
class Sigmoid(_Elementwise):
    """y = 1 / (1 + exp(-x)); backward uses the top y, as Caffe does."""
    params_read = ("sigmoid_param",)   # its engine only, which cgp ignores

    def forward_calls(self, bottom, top, params, scratch, chunk):
        yield K.sigmoid_forward, (flat(bottom[0]), flat(top[0]))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is not None:
            yield K.sigmoid_backward, (flat(top[0]), flat(top_diff[0]), flat(bottom_diff[0]))


@register("TanH")
class TanH(_Elementwise):
    """y = tanh(x); backward uses the top y, as Caffe does."""
    params_read = ("tanh_param",)      # its engine only, which cgp ignores

    def forward_calls(self, bottom, top, params, scratch, chunk):
        yield K.tanh_forward, (flat(bottom[0]), flat(top[0]))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is not None:
            yield K.tanh_backward, (flat(top[0]), flat(top_diff[0]), flat(bottom_diff[0]))


@register("AbsVal")
class AbsVal(Layer):
    """y = |x|; dy/dx = sign(x), 0 at x = 0 (Caffe's AbsValLayer). The minimal path of
    cgp.layers.base, whose docstring shows this class. Backward reads the bottom x, whose sign
    |x| has lost: the layer keeps in_place off, so a prototxt that names its top like its
    bottom (which Caffe refuses for AbsVal) gets the top its own buffer."""

    def setup(self, bottom_shapes):
        return [tuple(bottom_shapes[0])]

    def forward_calls(self, bottom, top, params, scratch, chunk):
        yield K.absval_forward, (flat(bottom[0]), flat(top[0]))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is not None:
            yield K.absval_backward, (flat(bottom[0]), flat(top_diff[0]),
                                      flat(bottom_diff[0]))


@register("Dropout")
class Dropout(_Elementwise):
    """Caffe's inverted dropout. TRAIN: keep each element with probability 1 - dropout_ratio
    and scale the kept ones by 1 / (1 - dropout_ratio); TEST: the identity.

    The mask comes from Philox4x32-10 keyed by (chunk.seed, chunk.iteration, chunk.first + i,
    self.index, element), never by thread or chunk; it is kept in scratch["mask"] (scale or 0
    per element) for backward. Caffe's DropoutParameter has no other field (BVLC Caffe has no
    scale_train; its dropout always scales at train time)."""
    params_read = ("dropout_param",)
    calls_each_time = True   # the mask is keyed by the call's seed and iteration

    def setup(self, bottom_shapes):
        ratio = float(self.lp.dropout_param.dropout_ratio)
        if not 0.0 <= ratio < 1.0:
            raise self.error(f"dropout_ratio must be in [0, 1), got {ratio}")
        self.ratio = ratio
        self.scale = 1.0 / (1.0 - ratio)
        self.train = self.phase == caffe_pb2.TRAIN
        return super().setup(bottom_shapes)

    def scratch_shapes(self, n):
        return {"mask": (n,) + self.shape[1:]} if self.train else {}

    def forward(self, bottom, top, params, scratch, chunk):
        x, y = bottom[0], top[0]
        if not self.train:
            y[...] = x
            return
        n = chunk.n
        d = x[0].size if n else 0
        rows = [flat(a).reshape(n, d) for a in (x, y, scratch["mask"][:n])]
        K.dropout_forward(*rows, self.ratio, x.dtype.type(self.scale), chunk.seed,
                          chunk.iteration, chunk.first, self.index)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        dx = bottom_diff[0]
        if dx is None:
            return
        if not self.train:
            dx[...] = top_diff[0]
            return
        mask = scratch["mask"][:chunk.n]
        K.dropout_backward(flat(mask), flat(top_diff[0]), flat(dx))
