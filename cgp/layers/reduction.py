"""Per-sample statistics layers: Reduction, ArgMax and MVN, with Caffe's parameters.

Each reduces or normalises within a sample (MVN: per sample, or per channel of a sample), so
no statistic couples the samples of a batch. The one exception is Caffe's default Reduction,
axis 0, which sums the whole batch into one value: in cgp a batch value like a loss, each
chunk's share summed by the engine in chunk order.
"""
import math

import numpy as np

from cgp.kernels import reduction as K
from cgp.layers.base import (Layer, check_axis, flat, no_backward, onnx_converter, register,
                             view)
from cgp.proto import caffe_pb2

OPS = {caffe_pb2.ReductionParameter.SUM: K.SUM, caffe_pb2.ReductionParameter.ASUM: K.ASUM,
       caffe_pb2.ReductionParameter.SUMSQ: K.SUMSQ, caffe_pb2.ReductionParameter.MEAN: K.MEAN}


@register("Reduction")
class Reduction(Layer):
    """Reduces the axes from reduction_param.axis (default 0) on with `operation` (SUM, ASUM:
    sum of magnitudes, SUMSQ: sum of squares, MEAN), times coeff (default 1): top shape is the
    bottom's axes before `axis`. Axis 0 reduces the whole batch to one value (a batch value:
    each call gives its share, summed in float64, which a loss_weight may make a loss).
    It runs each call in Python (calls_each_time): whether it is a batch value depends on its
    axis, and a class says once how the net calls it."""
    params_read = ("reduction_param",)
    calls_each_time = True
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.reduction_param
        shape = tuple(bottom_shapes[0])
        if p.operation not in OPS:
            raise self.error(f"unknown reduction_param.operation {p.operation}")
        self.op = OPS[p.operation]
        ndim = len(shape)
        if not -ndim <= p.axis < ndim:
            raise self.error(f"axis {p.axis} is out of range for a {ndim}-d blob")
        self.axis = p.axis % ndim
        self.reduces_batch = self.axis == 0
        self.rows = math.prod(shape[1:self.axis]) if self.axis else 1
        self.dim = math.prod(shape[max(self.axis, 1):])   # elements reduced per row
        return [shape[:self.axis]]

    def _coeff(self, dtype, batch):
        """Caffe's coeff_ in the dtype: coeff, divided for MEAN by the count reduced (the
        whole batch's, for axis 0)."""
        coeff = dtype(self.lp.reduction_param.coeff)
        if self.op == K.MEAN:
            coeff = dtype(coeff / dtype(self.dim * (batch if self.reduces_batch else 1)))
        return coeff

    def forward(self, bottom, top, params, scratch, chunk):
        n, x = chunk.n, bottom[0]
        rows = view(x, (n * self.rows, self.dim))
        coeff = self._coeff(x.dtype.type, chunk.batch_size)
        if self.reduces_batch:
            top[0][...] = float(coeff) * K.reduction_total(rows, self.op)
        else:
            K.reduction_forward(rows, flat(top[0]), self.op, coeff)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        if bottom_diff[0] is None:
            return
        n, x = chunk.n, bottom[0]
        dy = top_diff[0].reshape(-1)
        # A batch value's one gradient serves every row: a stride-0 view of it.
        if self.reduces_batch:
            dy = np.broadcast_to(dy, (n,))
        K.reduction_backward(view(x, (n * self.rows, self.dim)), dy,
                             view(bottom_diff[0], (n * self.rows, self.dim)), self.op,
                             self._coeff(x.dtype.type, chunk.batch_size))


@register("ArgMax")
class ArgMax(Layer):
    """The indices (or with out_max_val, the values) of the top_k largest elements along
    argmax_param.axis, or without an axis of each sample's elements: then the top is
    (N, 1, top_k), or (N, 2, top_k) with the indices and then the values, padded with axes of
    1 to the bottom's axes. A tie goes to the larger index, as Caffe's sort of (value, index)
    pairs gives it. No backward, as in Caffe: a net that needs one through it is refused."""
    params_read = ("argmax_param",)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.argmax_param
        shape = tuple(bottom_shapes[0])
        self.K = int(p.top_k)
        if self.K < 1:
            raise self.error(f"top_k must be at least 1, got {p.top_k}")
        if p.HasField("axis"):
            axis = check_axis(self, p.axis, len(shape))
            if self.K > shape[axis]:
                raise self.error(f"top_k ({self.K}) exceeds axis {axis} of {shape}")
            rows, D, inner = math.prod(shape[1:axis]), shape[axis], math.prod(shape[axis + 1:])
            value_only = bool(p.out_max_val)
            # (rows, D, I, o_step, k_step, idx_off, val_off) as argmax_forward takes them
            self.plan = (rows, D, inner, self.K * inner, inner,
                         -1 if value_only else 0, 0 if value_only else -1)
            return [shape[:axis] + (self.K,) + shape[axis + 1:]]
        D = math.prod(shape[1:])
        if self.K > D:
            raise self.error(f"top_k ({self.K}) exceeds the {D} elements of a sample of {shape}")
        width = 2 if p.out_max_val else 1
        self.plan = (1, D, 1, width * self.K, 1, 0, self.K if p.out_max_val else -1)
        return [(shape[0], width, self.K) + (1,) * (len(shape) - 3)]

    def forward_calls(self, bottom, top, params, scratch, chunk):
        rows, D, inner, o_step, k_step, idx_off, val_off = self.plan
        yield K.argmax_forward, (view(bottom[0], (chunk.n * rows, D, inner)), flat(top[0]),
                                 self.K, o_step, k_step, idx_off, val_off)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        return no_backward(self, bottom_diff)


@register("MVN")
class MVN(Layer):
    """Mean-variance normalisation of each sample's channels (or, across_channels, of each
    sample): y = x - mean, and with normalize_variance (default) y / (std + eps), std the
    biased deviation, eps default 1e-9. Backward is Caffe's formula, which treats std + eps
    as std (exact for eps = 0). Bottoms of up to 4 axes, as Caffe's. Scratch "std": each
    row's std + eps, from forward for backward."""
    params_read = ("mvn_param",)

    def setup(self, bottom_shapes):
        p = self.lp.mvn_param
        shape = tuple(bottom_shapes[0])
        if len(shape) > 4:
            raise self.error(f"MVN takes bottoms of up to 4 axes (num, channels, height, "
                             f"width), got {shape}")
        channels = shape[1] if len(shape) > 1 else 1
        self.rows = 1 if p.across_channels else channels
        self.dim = math.prod(shape[1:]) // self.rows
        self.normalize = bool(p.normalize_variance)
        return [shape]

    def scratch_shapes(self, n):
        return {"std": (n * self.rows,)}

    def _view(self, a, n):
        return view(a, (n * self.rows, self.dim))

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n, dtype = chunk.n, bottom[0].dtype.type
        yield K.mvn_forward, (self._view(bottom[0], n), self._view(top[0], n),
                              scratch["std"][:n * self.rows], dtype(1.0 / self.dim),
                              dtype(self.lp.mvn_param.eps), self.normalize)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        n, dtype = chunk.n, top[0].dtype.type
        yield K.mvn_backward, (self._view(top[0], n), self._view(top_diff[0], n),
                               self._view(bottom_diff[0], n), scratch["std"][:n * self.rows],
                               dtype(1.0 / self.dim), self.normalize)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@onnx_converter(Reduction)
def reduction_onnx(g, e, bottoms, tops, params, read):
    """Axes from reduction_param.axis (> 0: axis 0's batch value is left out as a loss is)
    summed, as magnitudes (ASUM) or squares (SUMSQ), times Caffe's coeff (for MEAN divided
    by the count)."""
    layer, name = e.layer, e.layer.name
    axes = list(range(layer.axis, len(g.net.blob_shapes[e.bottoms[0]])))
    coeff = layer._coeff(np.float32, 1)
    if layer.op in (K.SUM, K.MEAN):
        total = g.op("ReduceSum", [bottoms[0], g.ints(f"{name}/axes", axes)], f"{name}/total",
                     keepdims=0)
    else:
        op = "ReduceL1" if layer.op == K.ASUM else "ReduceSumSquare"
        total = g.op(op, [bottoms[0]], f"{name}/total", axes=axes, keepdims=0)
    g.chain(name, total, [("Mul", coeff)] if coeff != 1 else [], tops[0])


@onnx_converter(ArgMax)
def argmax_onnx(g, e, bottoms, tops, params, read):
    """TopK on the axis reversed, so that a tie goes to the larger index as in Caffe (TopK
    gives it to the smaller); indices as floats, after the values' rows with out_max_val and
    no axis."""
    layer, name, x = e.layer, e.layer.name, bottoms[0]
    p = layer.lp.argmax_param
    shape = g.net.blob_shapes[e.bottoms[0]]
    if p.HasField("axis"):
        axis = p.axis % len(shape)
        size = shape[axis]
    else:
        axis, size = 1, int(np.prod(shape[1:]))
        x = g.op("Flatten", [x], f"{name}/rows", axis=1)
    flipped = g.op("Slice", [x, g.ints(f"{name}/start", [-1]),
                             g.ints(f"{name}/end", [np.iinfo(np.int64).min]),
                             g.ints(f"{name}/axis", [axis]), g.ints(f"{name}/step", [-1])],
                   f"{name}/flipped")
    values, flipped_at = g.fresh(f"{name}/values"), g.fresh(f"{name}/at")
    g.node("TopK", [flipped, g.ints(f"{name}/k", [layer.K])], [values, flipped_at], axis=axis)
    at = g.op("Sub", [g.ints(f"{name}/last", size - 1), flipped_at], f"{name}/index")
    if p.HasField("axis") and p.out_max_val:
        g.node("Identity", [values], tops)
        return
    indices = g.op("Cast", [at], f"{name}/indices", to=g.onnx.TensorProto.FLOAT)
    if p.HasField("axis"):
        g.node("Identity", [indices], tops)
        return
    rows = g.op("Concat", [indices, values], f"{name}/rows", axis=1) if p.out_max_val else indices
    top_shape = [0] + list(g.net.blob_shapes[e.tops[0]][1:])
    g.node("Reshape", [rows, g.ints(f"{name}/shape", top_shape)], tops)


@onnx_converter(MVN)
def mvn_onnx(g, e, bottoms, tops, params, read):
    """Per row (a sample's channel, or with across_channels the sample): y = x - mean, and
    with normalize_variance y / (sqrt(mean of y^2) + eps), Caffe's eps on the deviation."""
    layer, name = e.layer, e.layer.name
    shape = g.net.blob_shapes[e.bottoms[0]]
    rows = g.op("Reshape", [bottoms[0], g.ints(f"{name}/rows_shape", [0, layer.rows, layer.dim])],
                f"{name}/rows")
    mean = g.op("ReduceMean", [rows], f"{name}/mean", axes=[2], keepdims=1)
    y = g.op("Sub", [rows, mean], f"{name}/centred")
    if layer.normalize:
        square = g.op("Mul", [y, y], f"{name}/square")
        variance = g.op("ReduceMean", [square], f"{name}/variance", axes=[2], keepdims=1)
        std = g.op("Sqrt", [variance], f"{name}/std")
        shifted = g.op("Add", [std, g.scalar(f"{name}/eps", layer.lp.mvn_param.eps)],
                       f"{name}/shifted")
        y = g.op("Div", [y, shifted], f"{name}/normalized")
    g.node("Reshape", [y, g.ints(f"{name}/shape", [0] + list(shape[1:]))], tops)
