"""The Convolution and Deconvolution layers: Caffe's 2-d convolution with padding, stride,
dilation and groups, and its transpose.

Convolution over other than two spatial axes, or along an axis other than 1, is refused.
Each sample is convolved on its own with the same weights, so chunks need nothing from each
other; the `engine` and `force_nd_im2col` fields choose an implementation in Caffe and change
no result, so they are accepted and ignored.
"""
import numpy as np

from cgp.kernels import conv as K
from cgp.runtime.simd import lanes
from cgp.layers.base import (DeviceOp, Layer, check_axis, device_op, onnx_converter,
                             part_span, register)


def spatial_values(layer, p, name, default):
    """(h, w) from Caffe's `name` (repeated: none, one for both axes, or one per axis) or
    from its 2-d-only alternatives `name`_h and `name`_w (kernel_h/_w etc.), not both."""
    values = list(getattr(p, name))
    h_field, w_field = f"{name}_h", f"{name}_w"
    if name == "kernel_size":
        h_field, w_field = "kernel_h", "kernel_w"
    has_h = h_field in p.DESCRIPTOR.fields_by_name and p.HasField(h_field)
    has_w = w_field in p.DESCRIPTOR.fields_by_name and p.HasField(w_field)
    if has_h or has_w:
        if values:
            raise layer.error(f"give either {name} or {h_field}/{w_field}, not both")
        # Caffe reads both fields where either is set: a lone pad_h or pad_w takes the
        # other's default 0; the kernel and stride fields have no usable default.
        if not (has_h and has_w) and name != "pad":
            raise layer.error(f"{h_field} and {w_field} must be given together")
        return int(getattr(p, h_field)), int(getattr(p, w_field))
    if not values:
        if default is None:
            raise layer.error(f"{name} (or {h_field} and {w_field}) must be given")
        return default, default
    if len(values) == 1:
        return int(values[0]), int(values[0])
    if len(values) == 2:
        return int(values[0]), int(values[1])
    raise layer.error(f"{name} must be given once, or once per spatial axis (2), "
                      f"got {len(values)} values")


# Stride-1 convolutions on small output planes with long reductions run faster as one BLAS
# GEMM per sample (the im2col path; a 1x1 convolution multiplies the input itself) than in
# the direct kernels, whose few positions fill few vectors and whose weights are repacked at
# every call: on ResNet-50's and GoogLeNet's 14 x 14 and 7 x 7 planes GEMM took 0.2 - 0.9 of
# the direct kernels' time, on 28 x 28 planes about the same, on larger ones more; short
# reductions on small planes stay direct, which is faster there (LeNet's conv2 and
# cifar10_quick's conv3, (C/G)*R*S 500 and 800; GoogLeNet's 5 x 5 over 48 channels, 1200)
# (bench/README.md, "Where ResNet-50 loses").
GEMM_MAX_POSITIONS = 196
GEMM_MIN_REDUCTION = 1280


def gemm_faster(Cg, R, S, P, Q, pointwise):
    """Whether a stride-1 convolution (Cg input channels per group, an R x S kernel, a P x Q
    output plane; pointwise: 1 x 1 without padding) runs faster through GEMM."""
    return P * Q <= GEMM_MAX_POSITIONS and (pointwise or Cg * R * S >= GEMM_MIN_REDUCTION)


@register("Convolution")
class Convolution(Layer):
    """Caffe's Convolution: top (N, K, P, Q) from bottom (N, C, H, W) with weight
    (K, C/group, R, S) and bias (K,), P = (H + 2*pad_h - (dilation_h*(R-1)+1)) // stride_h + 1
    (rounded down), likewise Q. Several bottoms may share the weights, each giving the top at
    the same position, all of one shape (Caffe's rule).

    Stride 1 runs the direct kernels (cgp.kernels.conv), whose scratch "e" holds one
    sample's input widened S times, per bottom: (bottoms, C*S*(H + 2*pad_h)*Q + slack) per
    worker. No buffer grows with the chunk: the others hold the weights repacked, one sample
    or a block of its positions ("dycl", dy transposed).
    Sizes suit both float32 and float64. Other strides, and stride-1 layers on small planes
    where GEMM is faster (gemm_faster), run im2col and BLAS: "col", the column matrix of one
    sample (C*R*S, P*Q) (none for a 1x1 kernel at stride 1 without padding). One input
    channel per group of several (group = channels > 1, MobileNet's depthwise layers; any
    stride) runs the depthwise kernels: "plane", one zero-padded channel, "wide", one output
    channel Wp wide, "acc", the weight gradient's partial sums, "offs", where each tap reads.
    """
    bottoms = (1, None)
    tops = (1, None)
    params_read = ("convolution_param",)
    backward_reads_top = False
    # Backward needs nothing from forward but its input: every buffer is a kernel's work.
    work_scratch = ("e", "wpt", "dycl", "dwt", "dbacc", "eb", "wft", "dxp", "col", "plane",
                    "wide", "acc", "offs")

    def _read(self, bottom_shapes):
        """Check the bottoms and read convolution_param: sets the kernel, padding, stride,
        dilation, K (num_output), group and bias_term, and C, H, W; returns the bottom shape."""
        if len(self.lp.top) != len(self.lp.bottom):
            raise self.error(f"needs one top per bottom, got {len(self.lp.bottom)} bottom(s) "
                             f"and {len(self.lp.top)} top(s)")
        p = self.lp.convolution_param
        shape = tuple(bottom_shapes[0])
        for i, other in enumerate(bottom_shapes[1:], 1):
            if tuple(other) != shape:
                raise self.error(f"all bottoms must have one shape: bottom 0 is {shape}, "
                                 f"bottom {i} is {tuple(other)}")
        axis = check_axis(self, p.axis, len(shape))
        if axis != 1:
            raise self.error(f"axis {p.axis} is not supported: only axis 1 (channels) with the "
                             f"spatial axes after it")
        if len(shape) != 4:
            raise self.error(f"only 2-d convolution is supported: the bottom must have 4 axes "
                             f"(num, channels, height, width), got shape {shape}")
        self.R, self.S = spatial_values(self, p, "kernel_size", None)
        self.pad_h, self.pad_w = spatial_values(self, p, "pad", 0)
        self.stride_h, self.stride_w = spatial_values(self, p, "stride", 1)
        self.dil_h, self.dil_w = spatial_values(self, p, "dilation", 1)
        if min(self.R, self.S) <= 0:
            raise self.error(f"kernel dimensions must be positive, got {self.R}x{self.S}")
        if min(self.stride_h, self.stride_w) <= 0:
            raise self.error(f"stride must be positive, got {self.stride_h}x{self.stride_w}")
        if min(self.dil_h, self.dil_w) <= 0:
            raise self.error(f"dilation must be positive, got {self.dil_h}x{self.dil_w}")
        _, C, H, W = shape
        self.K = int(p.num_output)
        self.group = int(p.group)
        if self.K <= 0:
            raise self.error("num_output must be given and positive")
        if self.group <= 0:
            raise self.error(f"group must be positive, got {self.group}")
        if C % self.group:
            raise self.error(f"the input channels ({C}, bottom shape {shape}) must be a "
                             f"multiple of group ({self.group})")
        if self.K % self.group:
            raise self.error(f"num_output ({self.K}) must be a multiple of group ({self.group})")
        self.C, self.H, self.W = C, H, W
        self.bias_term = bool(p.bias_term)
        return shape

    def setup(self, bottom_shapes):
        shape = self._read(bottom_shapes)
        H, W = self.H, self.W
        extent_h = self.dil_h * (self.R - 1) + 1
        extent_w = self.dil_w * (self.S - 1) + 1
        if extent_h > H + 2 * self.pad_h or extent_w > W + 2 * self.pad_w:
            raise self.error(f"the kernel ({extent_h}x{extent_w} with dilation) is larger than "
                             f"the padded input ({H + 2 * self.pad_h}x{W + 2 * self.pad_w}) "
                             f"of bottom shape {shape}")
        self.P = (H + 2 * self.pad_h - extent_h) // self.stride_h + 1
        self.Q = (W + 2 * self.pad_w - extent_w) // self.stride_w + 1
        return [(shape[0], self.K, self.P, self.Q)] * len(bottom_shapes)

    def param_shapes(self):
        weight = (self.K, self.C // self.group, self.R, self.S)
        return [weight, (self.K,)] if self.bias_term else [weight]

    def param_fillers(self):
        p = self.lp.convolution_param
        return [p.weight_filler, p.bias_filler] if self.bias_term else [p.weight_filler]

    def _spans(self, param_diff, dtype):
        """(dw, its step, db, its step): the per-part gradients as the kernels take them
        (part_span); without a bias, an empty db."""
        dw, dw_step = part_span(param_diff[0])
        db, db_step = part_span(param_diff[1]) if self.bias_term else (np.empty(0, dtype), 0)
        return dw, dw_step, db, db_step

    @property
    def can_overwrite_param_diff(self):
        # The direct kernels can set each part's gradients (as if added to zeros), which
        # spares the engine a pass zeroing them; the other paths add.
        return self._direct()

    def _depthwise(self):
        # group > 1: a single channel in one group (LeNet's conv1) keeps the dense path.
        return self.C == self.group > 1

    def _direct(self):
        if self.stride_h != 1 or self.stride_w != 1 or self._depthwise():
            return False
        pointwise = self.R == self.S == 1 and self.pad_h == self.pad_w == 0
        return not gemm_faster(self.C // self.group, self.R, self.S, self.P, self.Q, pointwise)

    def scratch_shapes(self, n):
        if self._depthwise():
            plane, wide, acc = K.depthwise_sizes(self.H, self.W, self.R, self.S,
                                                 self.stride_h, self.stride_w, self.pad_h,
                                                 self.pad_w, self.dil_h, self.dil_w)
            return {"plane": (plane,), "wide": (wide,), "acc": (acc,),
                    "offs": ((self.R * self.S,), np.int64)}
        if self._direct():
            # Sizes depend on the SIMD width, which differs by dtype: take the larger of the
            # float32 and float64 needs.
            sizes = [max(pair) for pair in zip(*(
                K.direct_sizes(self.C, self.H, self.W, self.K, self.R, self.S, self.pad_h,
                               self.pad_w, self.dil_h, self.dil_w, self.group,
                               lanes(np.dtype(t).itemsize))
                for t in (np.float32, np.float64)))]
            e, e_extra, wpt, dycl, dycl_extra, dwt, dbacc, eb, wft, dxp = sizes
            return {"e": (len(self.lp.bottom), e + e_extra), "wpt": (wpt,),
                    "dycl": (dycl + dycl_extra,), "dwt": (dwt,), "dbacc": (dbacc,),
                    "eb": (eb,), "wft": (wft,), "dxp": (dxp,)}
        if self.R == self.S == 1 and self.pad_h == self.pad_w == 0 and self.stride_h == \
                self.stride_w == 1:
            return {"col": (1, 1)}   # GEMM multiplies the input itself
        return {"col": (self.C * self.R * self.S, self.P * self.Q)}

    def _geometry(self):
        if self._depthwise():
            return self.stride_h, self.stride_w, self.pad_h, self.pad_w, self.dil_h, self.dil_w
        if self._direct():
            return self.pad_h, self.pad_w, self.dil_h, self.dil_w, self.group
        return (self.stride_h, self.stride_w, self.pad_h, self.pad_w, self.dil_h, self.dil_w,
                self.group)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        w = params[0]
        b = params[1] if self.bias_term else np.empty(0, w.dtype)
        for i, (x, y) in enumerate(zip(bottom, top)):
            if self._depthwise():
                yield K.depthwise_forward, (x, w, b, y, scratch["plane"], scratch["wide"],
                                            scratch["offs"], *self._geometry())
            elif self._direct():
                yield K.conv_forward_direct, (x, w, b, y, scratch["e"][i], scratch["wpt"],
                                              *self._geometry())
            else:
                yield K.conv_forward, (x, w, b, y, scratch["col"], *self._geometry())

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        w = params[0]
        dw, dw_step, db, db_step = self._spans(param_diff, w.dtype)
        starts = chunk.starts
        for i, (x, dy, dx) in enumerate(zip(bottom, top_diff, bottom_diff)):
            need_dx = dx is not None
            # Without dx the kernels never touch their dx argument; x stands in for the type.
            dx = dx if need_dx else x
            if self._depthwise():
                yield K.depthwise_backward, (x, w, dy, dx, dw, dw_step, db, db_step, starts,
                                             scratch["plane"], scratch["wide"], scratch["acc"],
                                             scratch["offs"], *self._geometry(), need_dx)
            elif self._direct():
                yield K.conv_backward_direct, (x, w, dy, dx, dw, dw_step, db, db_step, starts,
                                               scratch["e"][i], scratch["dycl"], scratch["dwt"],
                                               scratch["dbacc"], scratch["eb"], scratch["wft"],
                                               scratch["dxp"], *self._geometry(), need_dx,
                                               self.overwrite_param_diff and i == 0)
            else:
                yield K.conv_backward, (x, w, dy, dx, dw, dw_step, db, db_step, starts,
                                        scratch["col"], *self._geometry(), need_dx)


@register("Deconvolution")
class Deconvolution(Convolution):
    """Caffe's Deconvolution, the transpose of Convolution: top (N, K, P, Q) from bottom
    (N, C, H, W) with weight (C, K/group, R, S) and bias (K,), P = stride_h*(H - 1) +
    dilation_h*(R - 1) + 1 - 2*pad_h, likewise Q. The forward pass is a convolution's input
    gradient, the input gradient a convolution's forward pass, as in Caffe: per sample, the
    column matrix of the output (im2col's, cgp.kernels.conv) and one BLAS GEMM per group.
    Scratch "col": (K*R*S, H*W)."""
    can_overwrite_param_diff = False   # its kernels add (not Convolution's direct ones)

    def setup(self, bottom_shapes):
        shape = self._read(bottom_shapes)
        self.P = self.stride_h * (self.H - 1) + self.dil_h * (self.R - 1) + 1 - 2 * self.pad_h
        self.Q = self.stride_w * (self.W - 1) + self.dil_w * (self.S - 1) + 1 - 2 * self.pad_w
        if self.P <= 0 or self.Q <= 0:
            raise self.error(f"the output would be {self.P}x{self.Q}: the padding is larger "
                             f"than the upsampled input of bottom shape {shape}")
        return [(shape[0], self.K, self.P, self.Q)] * len(bottom_shapes)

    def param_shapes(self):
        weight = (self.C, self.K // self.group, self.R, self.S)
        return [weight, (self.K,)] if self.bias_term else [weight]

    def scratch_shapes(self, n):
        return {"col": (self.K * self.R * self.S, self.H * self.W)}

    def _geometry(self):
        return (self.stride_h, self.stride_w, self.pad_h, self.pad_w, self.dil_h, self.dil_w,
                self.group)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        w = params[0]
        b = params[1] if self.bias_term else np.empty(0, w.dtype)
        for x, y in zip(bottom, top):
            yield K.deconv_forward, (x, w, b, y, scratch["col"], *self._geometry())

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        w = params[0]
        dw, dw_step, db, db_step = self._spans(param_diff, w.dtype)
        for x, dy, dx in zip(bottom, top_diff, bottom_diff):
            need_dx = dx is not None
            yield K.deconv_backward, (x, w, dy, dx if need_dx else x, dw, dw_step, db, db_step,
                                      chunk.starts, scratch["col"], *self._geometry(), need_dx)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(Convolution)
class ConvolutionOp(DeviceOp):
    """im2col over the chunk's samples (R*S strided copies), one batched product per group,
    col2im adding the kernel's offsets one after another."""

    @staticmethod
    def refuses(layer):
        if len(layer.lp.bottom) > 1:
            return "several bottoms sharing the weights"
        return None

    def _offsets(self, P, Q):
        """Per kernel offset (r, s): the strided window of the padded input it reads."""
        L = self.layer
        for r in range(L.R):
            for s in range(L.S):
                h, w = r * L.dil_h, s * L.dil_w
                yield r, s, (slice(h, h + L.stride_h * (P - 1) + 1, L.stride_h),
                             slice(w, w + L.stride_w * (Q - 1) + 1, L.stride_w))

    def _columns(self, x):
        """x (n, C, H, W) -> (n, G, Cg*R*S, P*Q)."""
        L, xp = self.layer, self.xp
        n = x.shape[0]
        P, Q = L.P, L.Q
        padded = xp.zeros((n, L.C, L.H + 2 * L.pad_h, L.W + 2 * L.pad_w), x.dtype)
        padded[:, :, L.pad_h:L.pad_h + L.H, L.pad_w:L.pad_w + L.W] = x
        col = xp.empty((n, L.C, L.R, L.S, P, Q), x.dtype)
        for r, s, (rows, cols) in self._offsets(P, Q):
            col[:, :, r, s] = padded[:, :, rows, cols]
        return col.reshape(n, L.group, L.C // L.group * L.R * L.S, P * Q)

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        x, y = bottom[0], top[0]
        G = L.group
        w = params[0].reshape(G, L.K // G, -1)
        out = xp.matmul(w[None], self._columns(x))          # (n, G, Kg, P*Q)
        out = out.reshape(y.shape)
        if L.bias_term:
            out += params[1].reshape(1, L.K, 1, 1)
        y[...] = out

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        L, xp = self.layer, self.xp
        x, dy = bottom[0], top_diff[0]
        n, G = x.shape[0], L.group
        P, Q = L.P, L.Q
        dyg = dy.reshape(n, G, L.K // G, P * Q)
        if L.bias_term:
            param_diff[1] += dy.sum(axis=(0, 2, 3))
        col = self._columns(x)                                # (n, G, CRS, PQ)
        # Weight gradient: (G, Kg, n*PQ) @ (G, n*PQ, CRS).
        a = dyg.transpose(1, 2, 0, 3).reshape(G, L.K // G, n * P * Q)
        b = col.transpose(1, 0, 3, 2).reshape(G, n * P * Q, -1)
        param_diff[0] += xp.matmul(a, b).reshape(param_diff[0].shape)
        if bottom_diff[0] is None:
            return
        w = params[0].reshape(G, L.K // G, -1)
        dcol = xp.matmul(w.transpose(0, 2, 1)[None], dyg)      # (n, G, CRS, PQ)
        dcol = dcol.reshape(n, L.C, L.R, L.S, P, Q)
        padded = xp.zeros((n, L.C, L.H + 2 * L.pad_h, L.W + 2 * L.pad_w), x.dtype)
        for r, s, (rows, cols) in self._offsets(P, Q):
            padded[:, :, rows, cols] += dcol[:, :, r, s]
        bottom_diff[0][...] = padded[:, :, L.pad_h:L.pad_h + L.H, L.pad_w:L.pad_w + L.W]


def _convolution_onnx(g, e, bottoms, tops, params, op):
    """A Conv or ConvTranspose node per bottom, sharing the layer's weight and bias."""
    layer = e.layer
    weight = g.constant(f"{layer.name}/weight", params[0])
    inputs = [weight] + ([g.constant(f"{layer.name}/bias", params[1])] if layer.bias_term else [])
    for x, y in zip(bottoms, tops):
        g.node(op, [x] + inputs, [y], kernel_shape=[layer.R, layer.S],
               pads=[layer.pad_h, layer.pad_w, layer.pad_h, layer.pad_w],
               strides=[layer.stride_h, layer.stride_w],
               dilations=[layer.dil_h, layer.dil_w], group=layer.group)


@onnx_converter(Convolution)
def convolution_onnx(g, e, bottoms, tops, params, read):
    _convolution_onnx(g, e, bottoms, tops, params, "Conv")


@onnx_converter(Deconvolution)
def deconvolution_onnx(g, e, bottoms, tops, params, read):
    """ConvTranspose: Caffe's output size, stride * (H - 1) + dilated kernel - 2 * pad, is
    ONNX's with no output_padding."""
    _convolution_onnx(g, e, bottoms, tops, params, "ConvTranspose")
