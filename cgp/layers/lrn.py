"""The LRN layer: Caffe's local response normalisation, ACROSS_CHANNELS and WITHIN_CHANNEL.

Each sample is normalised on its own, so chunks need nothing from each other. Only Caffe's
CPU implementation's math: the `engine` field (CUDNN included) is a hint cgp ignores.
"""
import numpy as np

from cgp.kernels import lrn as K
from cgp.layers.base import DeviceOp, Layer, device_op, onnx_converter, register
from cgp.proto import caffe_pb2

LRNP = caffe_pb2.LRNParameter


@register("LRN")
class LRN(Layer):
    """ACROSS_CHANNELS: y = x * (k + alpha / L * sum of x^2 over L neighbouring channels)^-beta.
    WITHIN_CHANNEL: y = x * (1 + alpha / L^2 * sum of x^2 over an L x L spatial window)^-beta,
    as Caffe builds it from pooling and power layers (which ignore k). L = local_size, odd.

    Scratch: "scale", the denominator's base per element, and "power", its power -beta
    (forward writes both, backward reads them), and "plane", one work plane: a padded plane
    for WITHIN_CHANNEL's window sums, an (H, W) one for ACROSS_CHANNELS' backward.
    """
    params_read = ("lrn_param",)
    work_scratch = ("plane",)   # "scale" and "power" are kept for backward

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.error(f"the input must have 4 axes (num, channels, height, width), "
                             f"got shape {shape}")
        p = self.lp.lrn_param
        if p.local_size % 2 != 1:
            raise self.error(f"local_size must be odd, got {p.local_size}")
        if p.norm_region not in (LRNP.ACROSS_CHANNELS, LRNP.WITHIN_CHANNEL):
            raise self.error(f"unknown norm_region {p.norm_region}")
        self.across = p.norm_region == LRNP.ACROSS_CHANNELS
        self.size = int(p.local_size)
        self.alpha = float(p.alpha)
        self.beta = float(p.beta)
        self.k = float(p.k)
        self.shape = shape
        return [shape]

    def scratch_shapes(self, n):
        _, c, h, w = self.shape
        plane = h * w if self.across else K.plane_size(h, w, self.size)
        return {"scale": (n, c, h, w), "power": (n, c, h, w), "plane": (plane,)}

    def forward_calls(self, bottom, top, params, scratch, chunk):
        x = bottom[0]
        t = x.dtype.type
        scale, power = scratch["scale"][:chunk.n], scratch["power"][:chunk.n]
        if self.across:
            # Caffe forms alpha / size in the blob's type.
            yield K.lrn_across_forward, (x, top[0], scale, power, self.size,
                                         t(self.alpha) / t(self.size), t(self.beta), t(self.k))
        else:
            yield K.lrn_within_forward, (x, top[0], scale, power, scratch["plane"], self.size,
                                         t(self.alpha), t(self.beta))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        x = bottom[0]
        t = x.dtype.type
        scale, power = scratch["scale"][:chunk.n], scratch["power"][:chunk.n]
        window = self.size if self.across else self.size * self.size
        cache_ratio = t(2.0 * self.alpha * self.beta / window)
        kernel = K.lrn_across_backward if self.across else K.lrn_within_backward
        yield kernel, (x, top[0], top_diff[0], scale, power, bottom_diff[0], self.size,
                       cache_ratio, scratch["plane"])


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(LRN)
class LRNOp(DeviceOp):
    """Caffe's formulas (cgp.kernels.lrn): across channels, scale = k + alpha / L * the window's
    sum of squares; within a channel, 1 + alpha / L^2 * the L x L window's (zero-padded); then
    y = x * scale^-beta and dx = dy * scale^-beta - ratio * x * the window's sum of
    dy * y / scale. Windows add offset by offset, in a fixed order."""

    def _window_sum(self, a):
        """Each position's sum of `a` over its window, zeros beyond the borders."""
        L, xp = self.layer, self.xp
        R = (L.size - 1) // 2
        n, C, H, W = a.shape
        total = xp.zeros_like(a)
        if L.across:
            padded = xp.zeros((n, C + 2 * R, H, W), a.dtype)
            padded[:, R:R + C] = a
            for c in range(L.size):
                total += padded[:, c:c + C]
        else:
            padded = xp.zeros((n, C, H + 2 * R, W + 2 * R), a.dtype)
            padded[:, :, R:R + H, R:R + W] = a
            for r in range(L.size):
                for s in range(L.size):
                    total += padded[:, :, r:r + H, s:s + W]
        return total

    def _count(self):
        return self.layer.size if self.layer.across else self.layer.size ** 2

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        x = bottom[0]
        f = x.dtype.type
        base = f(L.k) if L.across else f(1)
        self.scale = base + f(L.alpha / self._count()) * self._window_sum(x * x)
        self.power = xp.power(self.scale, f(-L.beta))
        top[0][...] = x * self.power

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is None:
            return
        L = self.layer
        x, y, dy = bottom[0], top[0], top_diff[0]
        f = x.dtype.type
        ratio = f(2 * L.alpha * L.beta / self._count())
        bottom_diff[0][...] = dy * self.power - ratio * x * self._window_sum(dy * y / self.scale)


@onnx_converter(LRN)
def lrn_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    if layer.across:
        g.node("LRN", bottoms, tops, size=layer.size, alpha=layer.alpha, beta=layer.beta,
               bias=layer.k)
        return
    # WITHIN_CHANNEL, as Caffe builds it: x * (1 + alpha * mean of x^2 over an L x L window,
    # zero-padded)^-beta; every window holds L^2 cells of the padded plane.
    x, name, half = bottoms[0], layer.name, (layer.size - 1) // 2
    square, mean, scaled, base, power = (g.fresh(f"{name}/{s}") for s in
                                         ("square", "mean", "scaled", "base", "power"))
    g.node("Mul", [x, x], [square])
    g.node("AveragePool", [square], [mean], kernel_shape=[layer.size, layer.size],
           pads=[half] * 4, count_include_pad=1)
    g.node("Mul", [mean, g.constant(f"{name}/alpha", np.array(layer.alpha, np.float32))], [scaled])
    g.node("Add", [scaled, g.constant(f"{name}/one", np.array(1, np.float32))], [base])
    g.node("Pow", [base, g.constant(f"{name}/beta", np.array(-layer.beta, np.float32))], [power])
    g.node("Mul", [x, power], tops)
