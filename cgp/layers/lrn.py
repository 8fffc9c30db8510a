"""The LRN layer: Caffe's local response normalisation, ACROSS_CHANNELS and WITHIN_CHANNEL.

Each sample is normalised on its own, so chunks need nothing from each other. Only Caffe's
CPU implementation's math: the `engine` field (CUDNN included) is a hint cgp ignores.
"""
from cgp.kernels import lrn as K
from cgp.layers.base import Layer, register
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
