"""The Scale and Bias layers: Caffe's broadcast product and sum with a blob along axes
axis .. axis + num_axes - 1 of the bottom, learnt or given as a second bottom.

A second bottom has the batch axis first, as every blob in cgp: it must apply from axis 0,
one blob per sample (a squeeze-and-excitation net's channel weights, scale_param { axis: 0 });
where Caffe would match it against other axes it would mix the samples that chunks keep
apart, and cgp refuses it. A learnt blob from axis 0 holds one row per sample of the batch,
as in Caffe; each call reads its own samples' rows.
"""
import math

import numpy as np

from cgp.kernels import scale as K
from cgp.kernels.elementwise import copy
from cgp.layers.base import DeviceOp, Layer, device_op, onnx_converter, part_span, register, view
from cgp.proto import caffe_pb2


class _Broadcast(Layer):
    """Shared by Scale and Bias: where the blob lies in the bottom, and the (O, D, I) views
    of cgp.kernels.scale."""
    bottoms = (1, 2)
    backward_reads_top = False

    def _place(self, bottom_shapes, param):
        """Set self.axis, self.blob_shape and self.learnt from the bottoms' shapes and the
        layer's scale_param or bias_param (learnt: the blob's shape from axis and num_axes;
        given: the second bottom's shape); returns the top's shape, the first bottom's."""
        shape = tuple(bottom_shapes[0])
        blob_shape = tuple(bottom_shapes[1]) if len(bottom_shapes) > 1 else None
        axis, num_axes = param.axis, param.num_axes
        self.learnt = blob_shape is None
        ndim = len(shape)
        if blob_shape is None:
            if num_axes < -1:
                raise self.error(f"num_axes must be non-negative, or -1 to extend to the end "
                                 f"of the bottom; got {num_axes}")
        if not -ndim <= axis < ndim:
            raise self.error(f"axis {axis} is out of range for a {ndim}-d bottom {shape}")
        axis %= ndim
        if blob_shape is None:
            end = ndim if num_axes == -1 else axis + num_axes
            if end > ndim:
                raise self.error(f"the blob's shape extends past the bottom's shape {shape} "
                                 f"when applied from axis {axis} over {num_axes} axes")
            blob_shape = shape[axis:end]
        else:
            if axis != 0:
                raise self.error(f"a second bottom {blob_shape} starts with the batch axis, so "
                                 f"it applies from axis 0 (one blob per sample), got axis "
                                 f"{axis}: set axis: 0")
            if tuple(shape[:len(blob_shape)]) != tuple(blob_shape):
                raise self.error(f"the second bottom's shape {blob_shape} must match the first "
                                 f"bottom's {shape} from axis 0")
        if not blob_shape:
            axis = 0   # a scalar: any axis gives the same, Caffe takes 0
        self.axis, self.blob_shape = axis, tuple(blob_shape)
        self.shape = shape
        return shape

    def _geometry(self, n, first):
        """(rows per sample, D, I, off, o_step) for a call of n samples from `first`."""
        k = len(self.blob_shape)
        if k == 0:   # one factor for everything
            return 1, 1, math.prod(self.shape[1:]), 0, 0
        inner = math.prod(self.shape[self.axis + k:])
        if self.axis == 0:
            # One row per sample: the blob's row of the call's samples.
            d = math.prod(self.blob_shape[1:])
            return 1, d, inner, first * d, d
        d = math.prod(self.blob_shape)
        rows = math.prod(self.shape[1:self.axis]) if self.axis else 1
        return rows, d, inner, 0, 0

    def _rows(self, a, n, geometry):
        rows, d, inner = geometry[:3]
        return view(a, (n * rows, d, inner))


@register("Scale")
class Scale(_Broadcast):
    """y = s * x, the factors s broadcast along the other axes: a learnt blob (default filler:
    constant 1), or the second bottom. bias_term adds a learnt Bias after (its blob: the
    scale's axes, filled by bias_filler, default 0), as Caffe's Scale runs its own Bias.
    Blobs: [scale, bias], or [bias] with a second bottom."""
    params_read = ("scale_param",)

    def setup(self, bottom_shapes):
        shape = self._place(bottom_shapes, self.lp.scale_param)
        self.bias_term = bool(self.lp.scale_param.bias_term)
        return [shape]

    def param_shapes(self):
        return ([self.blob_shape] if self.learnt else []) + (
            [self.blob_shape] if self.bias_term else [])

    def param_fillers(self):
        p = self.lp.scale_param
        scale = p.filler if p.HasField("filler") else caffe_pb2.FillerParameter(
            type="constant", value=1)
        return ([scale] if self.learnt else []) + ([p.bias_filler] if self.bias_term else [])

    def _factors(self, bottom, params, n, geometry):
        """The factors' flat array and its (off, o_step): the learnt blob, or the second
        bottom's rows of the call (its own samples, from offset 0)."""
        if self.learnt:
            return view(params[0], -1), geometry[3], geometry[4]
        return view(bottom[1], -1), 0, geometry[1]

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n = chunk.n
        g = self._geometry(n, chunk.first)
        s, off, step = self._factors(bottom, params, n, g)
        x, y = self._rows(bottom[0], n, g), self._rows(top[0], n, g)
        if self.bias_term:
            yield K.scale_bias_forward, (x, s, off, step, view(params[-1], -1), g[3], g[4], y)
        else:
            yield K.scale_forward, (x, s, off, step, y)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        n = chunk.n
        g = self._geometry(n, chunk.first)
        x, dy = self._rows(bottom[0], n, g), self._rows(top_diff[0], n, g)
        starts = chunk.starts * g[0]
        if self.bias_term:
            db, db_step = part_span(param_diff[-1].reshape(param_diff[-1].shape[0], -1))
        if self.learnt:
            ds, ds_step = part_span(param_diff[0].reshape(param_diff[0].shape[0], -1))
        if self.bias_term and self.learnt and bottom_diff[0] is not None:
            # The usual case (BatchNorm's learnt scale and shift): dx in the sums' pass.
            s = view(params[0], -1)
            dx = self._rows(bottom_diff[0], n, g)
            yield K.product_and_row_sums_then_scale, (dy, x, s, ds, db, g[3], g[4], starts,
                                                      ds_step, db_step, dx)
            return
        if self.bias_term and self.learnt:
            yield K.product_and_row_sums, (dy, x, ds, db, g[3], g[4], starts, ds_step, db_step)
        elif self.bias_term:
            yield K.row_sums, (dy, db, g[3], g[4], starts, db_step, True)
        elif self.learnt:
            yield K.product_sums, (dy, x, ds, g[3], g[4], starts, ds_step, True)
        if not self.learnt and bottom_diff[1] is not None:
            # The second bottom's gradient: each element once, for the call's own rows.
            whole = np.array([0, n * g[0]], np.int64)
            yield K.product_sums, (dy, x, view(bottom_diff[1], -1), 0, g[1], whole, 0, False)
        if bottom_diff[0] is not None:
            s, off, step = self._factors(bottom, params, n, g)
            yield K.scale_forward, (dy, s, off, step, self._rows(bottom_diff[0], n, g))


@register("Bias")
class Bias(_Broadcast):
    """y = x + b, the addends b broadcast along the other axes: a learnt blob (bias_param's
    filler, default constant 0) or the second bottom."""
    params_read = ("bias_param",)

    def setup(self, bottom_shapes):
        return [self._place(bottom_shapes, self.lp.bias_param)]

    def param_shapes(self):
        return [self.blob_shape] if self.learnt else []

    def param_fillers(self):
        return [self.lp.bias_param.filler] if self.learnt else []

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n = chunk.n
        g = self._geometry(n, chunk.first)
        if self.learnt:
            b, off, step = view(params[0], -1), g[3], g[4]
        else:
            b, off, step = view(bottom[1], -1), 0, g[1]
        yield K.bias_forward, (self._rows(bottom[0], n, g), b, off, step,
                               self._rows(top[0], n, g))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        n = chunk.n
        g = self._geometry(n, chunk.first)
        dy = self._rows(top_diff[0], n, g)
        if bottom_diff[0] is not None:
            yield copy, (view(top_diff[0], -1), view(bottom_diff[0], -1))
        if self.learnt:
            db, step = part_span(param_diff[0].reshape(param_diff[0].shape[0], -1))
            yield K.row_sums, (dy, db, g[3], g[4], chunk.starts * g[0], step, True)
        elif bottom_diff[1] is not None:
            whole = np.array([0, n * g[0]], np.int64)
            yield K.row_sums, (dy, view(bottom_diff[1], -1), 0, g[1], whole, 0, False)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(Scale)
class ScaleOp(DeviceOp):
    """A learnt scale (and bias) broadcast over the other axes."""

    @staticmethod
    def refuses(layer):
        if not layer.learnt:
            return "a second bottom as the scale"
        if layer.axis == 0 and layer.blob_shape:
            return "a scale blob along the batch axis"
        return None

    def __init__(self, layer, xp):
        super().__init__(layer, xp)
        L, k = layer, len(layer.blob_shape)
        # The blob's shape broadcast against a chunk's arrays, and the axes it sums over.
        self.shape = (1,) * L.axis + tuple(L.blob_shape) + (1,) * (len(L.shape) - L.axis - k)
        self.axes = tuple(a for a in range(len(L.shape)) if not L.axis <= a < L.axis + k)

    def forward(self, bottom, top, params, scratch, chunk):
        out = bottom[0] * params[0].reshape(self.shape)
        if self.layer.bias_term:
            out = out + params[1].reshape(self.shape)
        top[0][...] = out

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        dy = top_diff[0]
        if self.layer.bias_term:
            param_diff[1] += dy.sum(axis=self.axes).reshape(param_diff[1].shape)
        param_diff[0] += (dy * bottom[0]).sum(axis=self.axes).reshape(param_diff[0].shape)
        if bottom_diff[0] is not None:
            bottom_diff[0][...] = dy * params[0].reshape(self.shape)


def _broadcast_onnx(g, e, array, base):
    """A Scale's or Bias's learnt blob shaped to broadcast from the layer's axis."""
    layer = e.layer
    trailing = len(layer.shape) - layer.axis - len(layer.blob_shape)
    return g.constant(base, array.reshape(layer.blob_shape + (1,) * trailing))


def _given_blob_onnx(g, e, x):
    """A Scale's or Bias's second bottom, (N, ...), with axes of 1 after its own."""
    layer = e.layer
    k, ndim = len(layer.blob_shape), len(layer.shape)
    if k == ndim:
        return x
    return g.op("Unsqueeze", [x, g.ints(f"{layer.name}/axes", list(range(k, ndim)))],
                f"{layer.name}/factors")


@onnx_converter(Scale)
def scale_onnx(g, e, bottoms, tops, params, read):
    """y = x * s (+ b with bias_term), s the learnt blob or the second bottom."""
    layer, name = e.layer, e.layer.name
    s = (_broadcast_onnx(g, e, params[0], f"{name}/scale") if layer.learnt
         else _given_blob_onnx(g, e, bottoms[1]))
    if not layer.bias_term:
        g.node("Mul", [bottoms[0], s], tops)
        return
    product = g.op("Mul", [bottoms[0], s], f"{name}/product")
    g.node("Add", [product, _broadcast_onnx(g, e, params[-1], f"{name}/bias")], tops)


@onnx_converter(Bias)
def bias_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    b = (_broadcast_onnx(g, e, params[0], f"{layer.name}/bias") if layer.learnt
         else _given_blob_onnx(g, e, bottoms[1]))
    g.node("Add", [bottoms[0], b], tops)
