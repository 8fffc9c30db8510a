"""The Pooling layer: Caffe's 2-d MAX and AVE pooling, global pooling, CEIL or FLOOR rounding.

STOCHASTIC pooling is refused. Each sample is pooled on its own, so chunks need nothing from
each other; the `engine` field chooses an implementation in Caffe and is ignored.
"""
import numpy as np

from cgp.kernels import pool as K
from cgp.layers.base import Layer, assign, register
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
