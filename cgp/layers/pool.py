"""The Pooling layer: Caffe's 2-d MAX and AVE pooling, global pooling, CEIL or FLOOR rounding.

STOCHASTIC pooling is refused. Each sample is pooled on its own, so chunks need nothing from
each other; the `engine` field chooses an implementation in Caffe and is ignored.
"""
import numpy as np

from cgp.kernels import pool as K
from cgp.layers.base import DeviceOp, Layer, assign, device_op, onnx_converter, register
from cgp.proto import caffe_pb2

PP = caffe_pb2.PoolingParameter

# Caffe's mask top holds the max's index as a float (the blobs' type): exact below 2^24.
MAX_PLANE = 1 << 24


def pair(layer, p, name, h_name, w_name, default):
    """Caffe's rule for pad and stride: `name` alone, or both `h_name` and `w_name`."""
    has_h, has_w = p.HasField(h_name), p.HasField(w_name)
    if has_h or has_w:
        if p.HasField(name) or not (has_h and has_w):
            raise layer.error(f"{name} is {name} OR {h_name} and {w_name}, both of them")
        return int(getattr(p, h_name)), int(getattr(p, w_name))
    value = int(getattr(p, name)) if p.HasField(name) else default
    return value, value


def pooled_size(size, pad, kernel, stride, ceil):
    """Caffe's output length: rounded up (CEIL) or down (FLOOR); with padding, a last window
    that would start in the padding past the image is dropped."""
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil else span // stride) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@register("Pooling")
class Pooling(Layer):
    """Caffe's Pooling over (N, C, H, W) -> (N, C, P, Q).

    P = ceil((H + 2*pad_h - R) / stride_h) + 1 (floor with round_mode FLOOR), minus one when
    padded and the last window would start at or past H + pad_h; likewise Q. MAX may have a
    second top, Caffe's mask: the max's index h*W + w in its plane, as a float.

    Scratch: "arg" (MAX), the max's index per output as int32, for backward (and copied into
    the mask top; the kernel's vectorised loops run much faster on integer indices); and
    the per-plane row results of the kernels' first pass, "rowmax" and "rowarg" (MAX), H*Q
    each; AVE's blocks of planes turned planes-innermost, "planes", and which windows cover
    each row and column, "cover" (int32).
    """
    tops = (1, 2)
    params_read = ("pooling_param",)
    work_scratch = ("rowmax", "rowarg", "planes", "cover")   # "arg" is kept for backward
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.pooling_param
        shape = tuple(bottom_shapes[0])
        if p.pool == PP.STOCHASTIC:
            raise self.error("pool STOCHASTIC is not supported (supported: MAX, AVE)")
        if p.pool not in (PP.MAX, PP.AVE):
            raise self.error(f"unknown pool method {p.pool} (supported: MAX, AVE)")
        self.max = p.pool == PP.MAX
        if len(self.lp.top) == 2 and not self.max:
            raise self.error("a second top (the max's mask) needs pool MAX")
        if len(shape) != 4:
            raise self.error(f"the input must have 4 axes (num, channels, height, width), "
                             f"got shape {shape}")
        _, C, H, W = shape
        has_size = p.HasField("kernel_size")
        has_hw = p.HasField("kernel_h") or p.HasField("kernel_w")
        if p.global_pooling:
            if has_size or has_hw:
                raise self.error("with global_pooling the kernel size must not be given")
            self.R, self.S = H, W
        else:
            if has_size and has_hw:
                raise self.error("the kernel is kernel_size OR kernel_h and kernel_w, not both")
            if has_size:
                self.R = self.S = int(p.kernel_size)
            elif p.HasField("kernel_h") and p.HasField("kernel_w"):
                self.R, self.S = int(p.kernel_h), int(p.kernel_w)
            else:
                raise self.error("kernel_size, or both kernel_h and kernel_w, must be given")
        self.pad_h, self.pad_w = pair(self, p, "pad", "pad_h", "pad_w", 0)
        self.stride_h, self.stride_w = pair(self, p, "stride", "stride_h", "stride_w", 1)
        if min(self.R, self.S) <= 0:
            raise self.error(f"kernel dimensions must be positive, got {self.R}x{self.S}")
        if min(self.stride_h, self.stride_w) <= 0:
            raise self.error(f"stride must be positive, got {self.stride_h}x{self.stride_w}")
        if p.global_pooling and (self.pad_h or self.pad_w or self.stride_h != 1
                                 or self.stride_w != 1):
            raise self.error("with global_pooling only pad 0 and stride 1 are allowed")
        if self.pad_h >= self.R or self.pad_w >= self.S:
            raise self.error(f"pad ({self.pad_h}x{self.pad_w}) must be smaller than the kernel "
                             f"({self.R}x{self.S})")
        if self.R > H + 2 * self.pad_h or self.S > W + 2 * self.pad_w:
            raise self.error(f"the kernel ({self.R}x{self.S}) is larger than the padded input "
                             f"({H + 2 * self.pad_h}x{W + 2 * self.pad_w}) of bottom shape {shape}")
        if p.round_mode not in (PP.CEIL, PP.FLOOR):
            raise self.error(f"unknown round_mode {p.round_mode} (supported: CEIL, FLOOR)")
        if len(self.lp.top) == 2 and H * W > MAX_PLANE:
            raise self.error(f"the mask top holds the max's index as a float, exact for planes "
                             f"of up to {MAX_PLANE} cells; got {H}x{W}")
        ceil = p.round_mode == PP.CEIL
        self.P = pooled_size(H, self.pad_h, self.R, self.stride_h, ceil)
        self.Q = pooled_size(W, self.pad_w, self.S, self.stride_w, ceil)
        # Rounding up can add a last window that starts past the input: it would pool
        # nothing (Caffe reads and writes outside the blob there).
        for axis, out, size, pad, stride in (("rows", self.P, H, self.pad_h, self.stride_h),
                                             ("columns", self.Q, W, self.pad_w, self.stride_w)):
            if (out - 1) * stride - pad >= size:
                raise self.error(f"the last of {out} windows along the {axis} would start at "
                                 f"{(out - 1) * stride - pad}, past the input's {size}: stride "
                                 f"{stride} is too large for this input; use a smaller stride "
                                 "or round_mode: FLOOR")
        self.C, self.H, self.W = C, H, W
        top = (shape[0], C, self.P, self.Q)
        return [top] * len(self.lp.top)

    def scratch_shapes(self, n):
        if self.max:
            rows = (self.H * self.Q,)
            return {"arg": ((n, self.C, self.P, self.Q), np.int32), "rowmax": rows,
                    "rowarg": (rows, np.int32)}
        planes, cover = K.ave_sizes(self.H, self.W, self.P, self.Q)
        return {"planes": (planes,), "cover": ((cover,), np.int32)}

    def _window(self):
        return self.R, self.S, self.stride_h, self.stride_w, self.pad_h, self.pad_w

    def forward_calls(self, bottom, top, params, scratch, chunk):
        if self.max:
            arg = scratch["arg"][:chunk.n]
            yield K.max_pool_forward, (bottom[0], top[0], arg, scratch["rowmax"],
                                       scratch["rowarg"], *self._window())
            if len(top) == 2:
                yield assign, (top[1], arg)
        else:
            yield K.ave_pool_forward, (bottom[0], top[0], scratch["planes"], *self._window())

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        if self.max:
            yield K.max_pool_backward, (top_diff[0], scratch["arg"][:chunk.n], bottom_diff[0])
        else:
            yield K.ave_pool_backward, (top_diff[0], bottom_diff[0], scratch["planes"],
                                        scratch["cover"], *self._window())


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(Pooling)
class PoolingOp(DeviceOp):
    """MAX keeps, per output, the offset r*S + s of its window's first maximum (Caffe's: the
    first in row-major order); AVE divides by Caffe's window size (padding counted, the part
    past the padded input not)."""

    @staticmethod
    def refuses(layer):
        if len(layer.lp.top) > 1:
            return "the mask top of MAX pooling"
        return None

    def __init__(self, layer, xp):
        super().__init__(layer, xp)
        L = layer
        # The padded input every window fits in: windows may run past it in CEIL mode.
        self.Hp = max((L.P - 1) * L.stride_h + L.R, L.H + L.pad_h)
        self.Wp = max((L.Q - 1) * L.stride_w + L.S, L.W + L.pad_w)
        if not L.max:
            hs = np.arange(L.P) * L.stride_h - L.pad_h
            ws = np.arange(L.Q) * L.stride_w - L.pad_w
            rows = np.minimum(hs + L.R, L.H + L.pad_h) - hs
            cols = np.minimum(ws + L.S, L.W + L.pad_w) - ws
            self.size = np.outer(rows, cols)
        self.arg = None   # MAX: the chunk's window offsets of the maxima, for backward

    def _windows(self):
        L = self.layer
        for r in range(L.R):
            for s in range(L.S):
                yield r * L.S + s, (slice(r, r + L.stride_h * (L.P - 1) + 1, L.stride_h),
                                    slice(s, s + L.stride_w * (L.Q - 1) + 1, L.stride_w))

    def _padded(self, x, fill):
        L, xp = self.layer, self.xp
        padded = xp.full((x.shape[0], L.C, self.Hp, self.Wp), fill, x.dtype)
        padded[:, :, L.pad_h:L.pad_h + L.H, L.pad_w:L.pad_w + L.W] = x
        return padded

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        x, y = bottom[0], top[0]
        if L.max:
            padded = self._padded(x, -np.inf)
            best = xp.full(y.shape, -np.inf, x.dtype)
            arg = xp.zeros(y.shape, np.int32)
            for k, (rows, cols) in self._windows():
                window = padded[:, :, rows, cols]
                better = window > best
                best = xp.where(better, window, best)
                arg = xp.where(better, np.int32(k), arg)
            y[...] = best
            self.arg = arg
        else:
            padded = self._padded(x, 0)
            total = xp.zeros(y.shape, x.dtype)
            for _, (rows, cols) in self._windows():
                total += padded[:, :, rows, cols]
            y[...] = total / xp.asarray(self.size, x.dtype)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        L, xp = self.layer, self.xp
        if bottom_diff[0] is None:
            return
        dy = top_diff[0]
        padded = xp.zeros((dy.shape[0], L.C, self.Hp, self.Wp), dy.dtype)
        share = None if L.max else dy / xp.asarray(self.size, dy.dtype)
        zero = dy.dtype.type(0)
        for k, (rows, cols) in self._windows():
            padded[:, :, rows, cols] += (xp.where(self.arg == k, dy, zero) if L.max
                                         else share)
        bottom_diff[0][...] = padded[:, :, L.pad_h:L.pad_h + L.H, L.pad_w:L.pad_w + L.W]


LOWEST = float(np.finfo(np.float32).min)   # MAX pooling's padding in ONNX: never the maximum


def caffe_pool_count(size, pad, kernel, stride, out):
    """Per output position, the cells Caffe's AVE pooling divides by along one axis: the
    window clipped to the padded input's end (not to its start)."""
    starts = np.arange(out) * stride - pad
    return np.minimum(starts + kernel, size + pad) - starts


@onnx_converter(Pooling)
def pooling_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    if len(e.tops) == 2 and e.tops[1] in read:
        raise layer.error("its second top (the max's mask) is read by another layer; ONNX's "
                          "MaxPool indices are not Caffe's mask")
    R, S, sh, sw = layer.R, layer.S, layer.stride_h, layer.stride_w
    ph, pw = layer.pad_h, layer.pad_w
    H, W, P, Q = layer.H, layer.W, layer.P, layer.Q
    # Pad explicitly: Caffe's first window starts at -pad, its last at (P-1)*stride - pad,
    # and no window reaches past that one's end; ONNX's ceil_mode would add a window.
    end_h = max(0, (P - 1) * sh + R - H - ph)
    end_w = max(0, (Q - 1) * sw + S - W - pw)
    assert (H + ph + end_h - R) // sh + 1 == P and (W + pw + end_w - S) // sw + 1 == Q
    x = bottoms[0]
    if ph or pw or end_h or end_w:
        padded = g.fresh(f"{layer.name}/padded")
        pads = g.constant(f"{layer.name}/pads", np.array([0, 0, ph, pw, 0, 0, end_h, end_w],
                                                         np.int64))
        fill = g.constant(f"{layer.name}/fill", np.array(LOWEST if layer.max else 0, np.float32))
        g.node("Pad", [x, pads, fill], [padded], mode="constant")
        x = padded
    attrs = dict(kernel_shape=[R, S], strides=[sh, sw])
    if layer.max:
        g.node("MaxPool", [x], [tops[0]], **attrs)
        return
    count = np.outer(caffe_pool_count(H, ph, R, sh, P), caffe_pool_count(W, pw, S, sw, Q))
    if np.all(count == R * S):
        g.node("AveragePool", [x], [tops[0]], **attrs)
        return
    mean = g.fresh(f"{layer.name}/mean")
    g.node("AveragePool", [x], [mean], **attrs)
    scale = (R * S / count).astype(np.float32).reshape(1, 1, P, Q)
    g.node("Mul", [mean, g.constant(f"{layer.name}/scale", scale)], [tops[0]])
