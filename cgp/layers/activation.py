"""Activation layers (Caffe's neuron layers): ReLU, Sigmoid, TanH, AbsVal, Dropout, ELU, BNLL,
Exp, Log, Power, Threshold, Clip, Swish and PReLU, with Caffe's formulas and parameters.

Each works elementwise on one bottom and one top of the same shape. Caffe nets often run them
"in place" (top named like the bottom); the net builder gives every top its own buffer, except
a ReLU's where sharing changes no bit (Layer.in_place), so the others never see aliased
arrays. Dropout draws its mask from a counter-based stream keyed by (seed, iteration, global
sample, layer index, element), so any split of the batch draws the same mask.
"""
import math

import numpy as np

from cgp.kernels import activation as K
from cgp.layers.base import (DeviceOp, Layer, device_op, flat, no_backward, onnx_converter,
                             part_span, register, view)
from cgp.proto import caffe_pb2


class _Elementwise(Layer):
    """One bottom, one top of the same shape, no parameters."""

    def setup(self, bottom_shapes):
        self.shape = tuple(bottom_shapes[0])
        return [self.shape]


class _Neuron(_Elementwise):
    """An elementwise layer run by one forward and one backward kernel, whose scalar
    parameters (if any) are in the arrays' dtype, as Caffe's Dtype: forward_args and
    backward_args give them for a dtype."""
    # (forward kernel, backward kernel), in a tuple: a Numba kernel as a class attribute
    # would bind as a method.
    kernels = (None, None)
    backward_reads = ("x", "dy")   # what the backward kernel takes before dx: x, y, dy

    def forward_args(self, dtype):
        return ()

    def backward_args(self, dtype):
        return self.forward_args(dtype)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        x = bottom[0]
        yield self.kernels[0], (flat(x), flat(top[0]), *self.forward_args(x.dtype.type))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        arrays = {"x": bottom[0], "y": top[0], "dy": top_diff[0]}
        reads = [flat(arrays[a]) for a in self.backward_reads]
        yield self.kernels[1], (*reads, flat(bottom_diff[0]),
                                *self.backward_args(bottom[0].dtype.type))


@register("ReLU")
class ReLU(_Neuron):
    """y = x where x > 0, else negative_slope * x; backward uses the bottom x (the top y
    when it runs in place, as Caffe's does)."""
    params_read = ("relu_param",)
    kernels = (K.relu_forward, K.relu_backward)

    def setup(self, bottom_shapes):
        self.slope = float(self.lp.relu_param.negative_slope)
        # Backward then reads the top for the bottom: y > 0 exactly where x > 0 (a slope
        # below 0 would make negative x positive), so dx is bitwise the same.
        self.in_place = self.slope >= 0
        return super().setup(bottom_shapes)

    def forward_args(self, dtype):
        return (dtype(self.slope),)


@register("Sigmoid")
class Sigmoid(_Neuron):
    """y = 1 / (1 + exp(-x)); backward uses the top y, as Caffe does."""
    params_read = ("sigmoid_param",)   # its engine only, which cgp ignores
    kernels = (K.sigmoid_forward, K.sigmoid_backward)
    backward_reads = ("y", "dy")


@register("TanH")
class TanH(_Neuron):
    """y = tanh(x); backward uses the top y, as Caffe does."""
    params_read = ("tanh_param",)      # its engine only, which cgp ignores
    kernels = (K.tanh_forward, K.tanh_backward)
    backward_reads = ("y", "dy")


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


@register("ELU")
class ELU(_Neuron):
    """y = x where x > 0, else alpha * (exp(x) - 1); backward reads x and y, as Caffe's."""
    params_read = ("elu_param",)
    kernels = (K.elu_forward, K.elu_backward)
    backward_reads = ("x", "y", "dy")

    def forward_args(self, dtype):
        return (dtype(self.lp.elu_param.alpha),)


@register("BNLL")
class BNLL(_Neuron):
    """y = log(1 + exp(x)) (binomial normal log likelihood), computed as Caffe does."""
    kernels = (K.bnll_forward, K.bnll_backward)
    backward_reads_top = False

    def backward_args(self, dtype):
        return (dtype(K.BNLL_THRESHOLD),)


def _log_base(layer, base, dtype):
    """Caffe's log(base) in the dtype, 1 for base -1 (meaning e); refuses a base <= 0."""
    if base == -1:
        return dtype(1)
    if not base > 0:
        raise layer.error(f"base must be strictly positive (or -1 for e), got {base:g}")
    return dtype(np.log(dtype(base)))


@register("Exp")
class Exp(_Neuron):
    """y = base ^ (shift + scale * x), base -1 meaning e; backward reads y, as Caffe's."""
    params_read = ("exp_param",)
    kernels = (K.exp_forward, K.exp_backward)
    backward_reads = ("y", "dy")

    def setup(self, bottom_shapes):
        _log_base(self, self.lp.exp_param.base, np.float64)
        return super().setup(bottom_shapes)

    def forward_args(self, dtype):
        p = self.lp.exp_param
        inner = _log_base(self, p.base, dtype) * dtype(p.scale)
        if p.shift == 0:
            outer = dtype(1)
        elif p.base != -1:
            outer = dtype(np.power(dtype(p.base), dtype(p.shift)))
        else:
            outer = dtype(np.exp(dtype(p.shift)))
        return inner, outer

    def backward_args(self, dtype):
        return self.forward_args(dtype)[:1]


@register("Log")
class Log(_Neuron):
    """y = log_base(shift + scale * x), base -1 meaning e."""
    params_read = ("log_param",)
    kernels = (K.log_forward, K.log_backward)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        if _log_base(self, self.lp.log_param.base, np.float64) == 0:
            raise self.error("base 1 has no logarithms (1 / log(base) is infinite)")
        return super().setup(bottom_shapes)

    def forward_args(self, dtype):
        p = self.lp.log_param
        return dtype(p.scale), dtype(p.shift), dtype(1) / _log_base(self, p.base, dtype)

    def backward_args(self, dtype):
        p = self.lp.log_param
        return dtype(p.scale), dtype(p.shift), dtype(p.scale) / _log_base(self, p.base, dtype)


@register("Power")
class Power(_Neuron):
    """y = (shift + scale * x) ^ power; backward in Caffe's special cases (power_backward)."""
    params_read = ("power_param",)
    kernels = (K.power_forward, K.power_backward)
    backward_reads = ("x", "y", "dy")

    def forward_args(self, dtype):
        p = self.lp.power_param
        return dtype(p.power), dtype(p.scale), dtype(p.shift)

    def backward_args(self, dtype):
        power, scale, shift = self.forward_args(dtype)
        if power * scale == 0 or power == 1:
            case = K.POWER_CONSTANT
        elif power == 2:
            case = K.POWER_SQUARE
        elif shift == 0:
            case = K.POWER_NO_SHIFT
        else:
            case = K.POWER_GENERAL
        return power, scale, shift, case


class _NoGradient(_Neuron):
    """A layer Caffe gives no backward (NOT_IMPLEMENTED; no_backward)."""

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        return no_backward(self, bottom_diff)


@register("Threshold")
class Threshold(_NoGradient):
    """y = 1 where x > threshold, else 0. No backward, as in Caffe."""
    params_read = ("threshold_param",)
    kernels = (K.threshold_forward, None)
    backward_reads_top = False

    def forward_args(self, dtype):
        return (dtype(self.lp.threshold_param.threshold),)


@register("Clip")
class Clip(_Neuron):
    """y = min(max(x, min), max); the gradient passes where min <= x <= max."""
    params_read = ("clip_param",)
    kernels = (K.clip_forward, K.clip_backward)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            raise self.error("clip_param needs both min and max")
        if not p.min <= p.max:
            raise self.error(f"clip_param.min ({p.min:g}) must not exceed max ({p.max:g})")
        return super().setup(bottom_shapes)

    def forward_args(self, dtype):
        p = self.lp.clip_param
        return dtype(p.min), dtype(p.max)


@register("Swish")
class Swish(_Neuron):
    """y = x * sigmoid(beta * x); backward reads x and y."""
    params_read = ("swish_param",)
    kernels = (K.swish_forward, K.swish_backward)
    backward_reads = ("x", "y", "dy")

    def forward_args(self, dtype):
        return (dtype(self.lp.swish_param.beta),)


@register("PReLU")
class PReLU(Layer):
    """y = x where x > 0, else a * x, with a learnt slope per channel (axis 1; blob (C,)) or
    one for all (channel_shared; blob of shape ()), filled with 0.25 unless prelu_param.filler
    says otherwise. Each part's slope gradient adds dy * x over its elements with x <= 0."""
    params_read = ("prelu_param",)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) < 2:
            raise self.error(f"the bottom needs at least 2 axes (num, channels), got {shape}")
        self.shape = shape
        self.shared = bool(self.lp.prelu_param.channel_shared)
        return [shape]

    def param_shapes(self):
        return [() if self.shared else (self.shape[1],)]

    def param_fillers(self):
        p = self.lp.prelu_param
        if p.HasField("filler"):
            return [p.filler]
        return [caffe_pb2.FillerParameter(type="constant", value=0.25)]

    def _rows(self, a, n):
        return view(a, (n, self.shape[1], math.prod(self.shape[2:])))

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n = chunk.n
        yield K.prelu_forward, (self._rows(bottom[0], n), self._rows(top[0], n),
                                view(params[0], -1), self.shared)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        n = chunk.n
        x, dy = self._rows(bottom[0], n), self._rows(top_diff[0], n)
        dslopes, step = part_span(param_diff[0].reshape(param_diff[0].shape[0], -1))
        # The slope gradient first: it reads x, never dx.
        yield K.prelu_slope_parts, (x, dy, dslopes, step, chunk.starts, self.shared)
        if bottom_diff[0] is not None:
            yield K.prelu_backward, (x, dy, self._rows(bottom_diff[0], n), view(params[0], -1),
                                     self.shared)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(ReLU)
class ReLUOp(DeviceOp):
    """In place (top = bottom), the bottom holds y, whose sign is x's for a slope >= 0."""

    def forward(self, bottom, top, params, scratch, chunk):
        x = bottom[0]
        slope = x.dtype.type(self.layer.slope)
        top[0][...] = self.xp.where(x > 0, x, x * slope)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is not None:
            x, dy = bottom[0], top_diff[0]
            slope = dy.dtype.type(self.layer.slope)
            bottom_diff[0][...] = self.xp.where(x > 0, dy, dy * slope)


@device_op(Sigmoid)
class SigmoidOp(DeviceOp):

    def forward(self, bottom, top, params, scratch, chunk):
        x = bottom[0]
        one = x.dtype.type(1)
        top[0][...] = one / (one + self.xp.exp(-x))

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is not None:
            y = top[0]
            bottom_diff[0][...] = top_diff[0] * y * (y.dtype.type(1) - y)


@device_op(TanH)
class TanHOp(DeviceOp):

    def forward(self, bottom, top, params, scratch, chunk):
        top[0][...] = self.xp.tanh(bottom[0])

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is not None:
            y = top[0]
            bottom_diff[0][...] = top_diff[0] * (y.dtype.type(1) - y * y)


@device_op(Dropout)
class DropoutOp(DeviceOp):
    """The CPU layer's mask, drawn on the host by its Philox kernel (keyed by sample, never by
    chunk or device) and copied over; TEST: the identity."""

    def forward(self, bottom, top, params, scratch, chunk):
        L, x = self.layer, bottom[0]
        if not L.train:
            top[0][...] = x
            return
        rows = (x.shape[0], x[0].size)
        ones, mask = np.ones(rows, x.dtype), np.empty(rows, x.dtype)
        K.dropout_forward(ones, np.empty(rows, x.dtype), mask, L.ratio, x.dtype.type(L.scale),
                        chunk.seed, chunk.iteration, chunk.first, L.index)
        self.mask = self.xp.asarray(mask).reshape(x.shape)
        top[0][...] = x * self.mask

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is not None:
            dy = top_diff[0]
            bottom_diff[0][...] = dy * self.mask if self.layer.train else dy


@onnx_converter(ReLU)
def relu_onnx(g, e, bottoms, tops, params, read):
    if e.layer.slope == 0:
        g.node("Relu", bottoms, tops)
    else:
        g.node("LeakyRelu", bottoms, tops, alpha=e.layer.slope)


@onnx_converter(PReLU)
def prelu_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    slope = params[0] if layer.shared else params[0].reshape(
        (layer.shape[1],) + (1,) * (len(layer.shape) - 2))
    g.node("PRelu", [bottoms[0], g.constant(f"{layer.name}/slope", slope)], tops)


@onnx_converter(ELU)
def elu_onnx(g, e, bottoms, tops, params, read):
    g.node("Elu", bottoms, tops, alpha=e.layer.lp.elu_param.alpha)


def _one_op_onnx(op):
    """The converter of a layer that is one ONNX op of the same input and output."""
    def convert(g, e, bottoms, tops, params, read):
        g.node(op, bottoms, tops)
    return convert


for _layer, _op in ((Sigmoid, "Sigmoid"), (TanH, "Tanh"), (AbsVal, "Abs"), (BNLL, "Softplus")):
    onnx_converter(_layer)(_one_op_onnx(_op))


@onnx_converter(Power)
def power_onnx(g, e, bottoms, tops, params, read):
    """y = (shift + scale * x) ^ power, each step only where it changes x; where power *
    scale is 0, Caffe's constant (1 for power 0, else shift ^ power) of x's shape."""
    layer, x = e.layer, bottoms[0]
    name = layer.name
    p, scale, shift = layer.forward_args(np.float32)
    if p * scale == 0:
        value = np.float32(1) if p == 0 else np.float32(shift ** p)
        shape = g.op("Shape", [x], f"{name}/shape")
        g.node("ConstantOfShape", [shape], tops, value=g.onnx.numpy_helper.from_array(
            np.array([value], np.float32)))
        return
    steps = [("Mul", scale, scale != 1), ("Add", shift, shift != 0), ("Pow", p, p != 1)]
    g.chain(name, x, [(op, value) for op, value, needed in steps if needed], tops[0])


@onnx_converter(Exp)
def exp_onnx(g, e, bottoms, tops, params, read):
    """y = outer * exp(inner * x), inner = log(base) * scale and outer = base ^ shift, as
    cgp's Exp takes them."""
    name = e.layer.name
    inner, outer = e.layer.forward_args(np.float32)
    x = bottoms[0]
    if inner != 1:
        x = g.op("Mul", [x, g.scalar(f"{name}/inner", inner)], f"{name}/inner")
    g.then_scaled("Exp", x, "outer", outer, tops, name)


@onnx_converter(Log)
def log_onnx(g, e, bottoms, tops, params, read):
    """y = log(scale * x + shift) / log(base), as cgp's Log takes them."""
    name = e.layer.name
    scale, shift, base_scale = e.layer.forward_args(np.float32)
    x = bottoms[0]
    steps = [("Mul", scale, scale != 1), ("Add", shift, shift != 0)]
    for op, value, needed in steps:
        if needed:
            x = g.op(op, [x, g.scalar(f"{name}/{op.lower()}", value)], f"{name}/{op.lower()}")
    g.then_scaled("Log", x, "base_scale", base_scale, tops, name)


@onnx_converter(Threshold)
def threshold_onnx(g, e, bottoms, tops, params, read):
    """y = 1 where x > threshold, else 0 (NaN too)."""
    name = e.layer.name
    above = g.op("Greater", [bottoms[0], g.scalar(f"{name}/threshold",
                                                  e.layer.lp.threshold_param.threshold)],
                 f"{name}/above")
    g.node("Cast", [above], tops, to=g.onnx.TensorProto.FLOAT)


@onnx_converter(Clip)
def clip_onnx(g, e, bottoms, tops, params, read):
    p, name = e.layer.lp.clip_param, e.layer.name
    g.node("Clip", [bottoms[0], g.scalar(f"{name}/min", p.min), g.scalar(f"{name}/max", p.max)],
           tops)


@onnx_converter(Swish)
def swish_onnx(g, e, bottoms, tops, params, read):
    """y = x * sigmoid(beta * x)."""
    name, x = e.layer.name, bottoms[0]
    beta = np.float32(e.layer.lp.swish_param.beta)
    scaled = x if beta == 1 else g.op("Mul", [x, g.scalar(f"{name}/beta", beta)],
                                      f"{name}/scaled")
    gate = g.op("Sigmoid", [scaled], f"{name}/gate")
    g.node("Mul", [x, gate], tops)


@onnx_converter(Dropout)
def dropout_onnx(g, e, bottoms, tops, params, read):
    """Dropout at test time, Caffe's identity."""
    g.node("Identity", bottoms, tops)
