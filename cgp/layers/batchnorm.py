"""The BatchNorm layer: Caffe's batch normalisation, its statistics over the WHOLE batch.

Caffe's semantics on one process: each channel's mean and variance over the batch and every
position, the blobs Caffe keeps (moving mean, moving variance, their scale factor; never
learnt, lr_mult 0), use_global_stats (default: in TEST), moving_average_fraction, eps, and
no scale or shift of its own (a Scale layer follows). Horovod and DDP compute per-worker
statistics unless told otherwise; here a call pauses at each sum (Layer.batch_sums) until
the engine has added every chunk's share in the fixed tree over chunk index, so training is
bitwise the same for any number of workers.
"""
import numpy as np

from cgp.kernels import batchnorm as K
from cgp.layers.base import SYNC, DeviceOp, Layer, device_op, onnx_converter, register, view
from cgp.proto import caffe_pb2

f32 = np.float32


@register("BatchNorm")
class BatchNorm(Layer):
    """Training (batch statistics): forward sums x per channel (sum 0: the mean), then
    (x - mean)^2 (sum 1: the variance, and Caffe's moving averages: mean + f * mean_blob,
    m / (m - 1) * variance + f * variance_blob, f * factor + 1, with f the
    moving_average_fraction and m the values per channel), then y = (x - mean) /
    sqrt(variance + eps); backward sums dy * y and dy per channel (sum 2) for dx.
    Global statistics: mean and variance are the blobs divided by the factor, no sums.

    Scratch: "stats" (2, C) float64, the mean and sqrt(variance + eps) (global statistics),
    which backward reads."""
    params_read = ("batch_norm_param",)
    batch_sums = (2, 1)

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) < 2:
            raise self.error(f"the input needs a channel axis (axis 1), got shape {shape}")
        p = self.lp.batch_norm_param
        self.global_stats = (p.use_global_stats if p.HasField("use_global_stats")
                             else self.phase == caffe_pb2.TEST)
        if self.global_stats:
            self.batch_sums = (0, 0)
        self.fraction = f32(p.moving_average_fraction)
        self.eps = float(p.eps)
        if not self.eps > 0:
            raise self.error(f"eps must be positive, got {p.eps:g}")
        self.shape = shape
        self.C = int(shape[1])
        self.S = int(np.prod(shape[2:], dtype=np.int64))
        self.m = int(shape[0]) * self.S     # values per channel in the batch
        # Caffe masks the statistics from the solver: lr_mult 0 where not given, and refuses
        # any other (BatchNormLayer::LayerSetUp).
        for i in range(3):
            if i == len(self.lp.param):
                self.lp.param.add(lr_mult=0)
            elif self.lp.param[i].lr_mult != 0:
                raise self.error("param lr_mult must be 0: the mean, variance and their factor "
                                 "are statistics, not parameters a solver may change")
        return [shape]

    def param_shapes(self):
        return [(self.C,), (self.C,), (1,)]

    def param_fillers(self):
        return [caffe_pb2.FillerParameter(type="constant", value=0)] * 3

    def scratch_shapes(self, n):
        return {"stats": ((2, self.C), np.float64)}

    def sum_sizes(self):
        return [self.C, self.C, 2 * self.C]

    def _view(self, a, chunk):
        return view(a, (chunk.n, self.C, self.S))

    def forward_calls(self, bottom, top, params, scratch, chunk):
        x, y = self._view(bottom[0], chunk), self._view(top[0], chunk)
        if self.global_stats:
            stats = scratch["stats"]
            yield K.global_stats, (params[0], params[1], params[2], self.eps, stats)
            yield K.normalize, (x, stats[0], stats[1], y)
            return
        starts, sums = chunk.starts, scratch["sums"]
        yield K.channel_sums, (x, starts, sums[0][0])
        yield SYNC
        yield K.centred_square_sums, (x, sums[0][1], starts, sums[1][0])
        yield SYNC
        yield K.normalize, (x, sums[0][1], sums[1][1], y)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        y, dy = self._view(top[0], chunk), self._view(top_diff[0], chunk)
        dx = self._view(bottom_diff[0], chunk)
        if self.global_stats:
            yield K.scale_backward, (dy, scratch["stats"][1], dx)
            return
        sums = scratch["sums"]
        yield K.gradient_sums, (y, dy, chunk.starts, sums[2][0])
        yield SYNC
        yield K.normalize_backward, (y, dy, sums[2][1], self.m, sums[1][1], dx)

    def sync(self, k, totals, params):
        """Sum 0 -> the mean; sum 1 -> sqrt(variance + eps), after the moving averages; sum 2
        (backward's) stays as it is. Statistics in the blobs' dtype (float32 in training, as
        Caffe's), kept in the float64 totals."""
        mean_blob, variance_blob, factor = params
        f = mean_blob.dtype.type
        if k == 0:
            totals[0][:] = (totals[0] / self.m).astype(f)
        elif k == 1:
            variance = (totals[1] / self.m).astype(f)
            fraction = f(self.fraction)
            factor[0] = factor[0] * fraction + f(1)
            mean_blob[:] = totals[0].astype(f) + fraction * mean_blob
            correction = f(self.m) / f(self.m - 1) if self.m > 1 else f(1)
            variance_blob[:] = correction * variance.astype(f) + fraction * variance_blob
            totals[1][:] = np.sqrt(variance + f(self.eps))


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(BatchNorm)
class BatchNormOp(DeviceOp):
    """Caffe's arithmetic as cgp.kernels.batchnorm: float64 sums of the call's samples, one
    share per chunk (part), everything else in the blobs' dtype. With batch statistics,
    forward and backward yield SYNC at each sum, as BatchNorm's forward_calls do."""

    def _view(self, a):
        return a.reshape(a.shape[0], self.layer.C, -1)

    def _stats(self, params, dtype):
        """use_global_stats: mean and std from the blobs."""
        xp = self.xp
        mean, variance, factor = params
        f = dtype.type
        # Caffe's: 0 where the factor is 0 (no statistics yet), else its inverse.
        empty = factor[0] == 0
        scale = xp.where(empty, f(0), f(1) / xp.where(empty, f(1), factor[0]))
        return scale * mean, xp.sqrt(scale * variance + f(self.layer.eps))

    def _shares(self, a, share, chunk):
        """share[k] = part k's sum of a (n, C, M) over its samples and M, in float64."""
        for k, (_, lo, hi) in enumerate(chunk.each_part):
            share[k] = a[lo:hi].astype(np.float64).sum(axis=(0, 2))

    def forward(self, bottom, top, params, scratch, chunk):
        x, y = self._view(bottom[0]), self._view(top[0])
        if self.layer.global_stats:
            mean, std = self._stats(params, x.dtype)
            y[...] = (x - mean[None, :, None]) / std[None, :, None]
            return None
        return self._batch_forward(x, y, scratch["sums"], chunk)

    def _batch_forward(self, x, y, sums, chunk):
        self._shares(x, sums[0][0], chunk)
        yield SYNC
        d = (x - sums[0][1].astype(x.dtype)[None, :, None]).astype(np.float64)
        self._shares(d * d, sums[1][0], chunk)
        yield SYNC
        mean, std = sums[0][1].astype(x.dtype), sums[1][1].astype(x.dtype)
        y[...] = (x - mean[None, :, None]) / std[None, :, None]

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is None:
            return None
        y, dy, dx = self._view(top[0]), self._view(top_diff[0]), self._view(bottom_diff[0])
        if self.layer.global_stats:
            _, std = self._stats(params, y.dtype)
            dx[...] = dy / std[None, :, None]
            return None
        return self._batch_backward(y, dy, dx, scratch["sums"], chunk)

    def _batch_backward(self, y, dy, dx, sums, chunk):
        f, C = y.dtype.type, self.layer.C
        share = sums[2][0]
        self._shares(dy * y, share[:, :C], chunk)
        self._shares(dy, share[:, C:], chunk)
        yield SYNC
        total = sums[2][1].astype(y.dtype)
        a, b = total[None, :C, None], total[None, C:, None]
        std = sums[1][1].astype(y.dtype)[None, :, None]
        scale = f(-1.0) / f(self.layer.m)
        dx[...] = (dy + scale * (y * a + b)) / std


@onnx_converter(BatchNorm)
def batch_norm_onnx(g, e, bottoms, tops, params, read):
    """Global statistics (TEST's default): BatchNormalization with Caffe's blobs divided by
    their scale factor (0 where the factor is 0, as Caffe's). Batch statistics
    (use_global_stats: false): the batch's mean and biased variance per channel, composed."""
    layer, x = e.layer, bottoms[0]
    name, f = layer.name, np.float32
    C, ndim = layer.C, len(layer.shape)
    if layer.global_stats:
        mean_blob, variance_blob, factor = params
        scale = f(0) if factor[0] == 0 else f(1) / factor[0]
        g.node("BatchNormalization", [x, g.constant(f"{name}/ones", np.ones(C, f)),
                                      g.constant(f"{name}/zeros", np.zeros(C, f)),
                                      g.constant(f"{name}/mean", scale * mean_blob),
                                      g.constant(f"{name}/variance", scale * variance_blob)],
               tops, epsilon=layer.eps)
        return
    axes = [0] + list(range(2, ndim))
    mean = g.op("ReduceMean", [x], f"{name}/mean", axes=axes, keepdims=1)
    centred = g.op("Sub", [x, mean], f"{name}/centred")
    square = g.op("Mul", [centred, centred], f"{name}/square")
    variance = g.op("ReduceMean", [square], f"{name}/variance", axes=axes, keepdims=1)
    shifted = g.op("Add", [variance, g.scalar(f"{name}/eps", layer.eps)], f"{name}/shifted")
    std = g.op("Sqrt", [shifted], f"{name}/std")
    g.node("Div", [centred, std], tops)
