"""The InnerProduct layer: Caffe's fully connected layer over the axes from `axis` on.

Rows never mix and every row goes through the same code, so a sample's output does not depend
on its chunk (see cgp.kernels.fc). Axis 0 is refused.
"""
import numpy as np

from cgp.kernels import fc as K
from cgp.layers.base import Layer, check_axis, register


def matrix(a, rows):
    """a as a (rows, -1) view; refuses arrays that would need a copy, whose writes would be lost."""
    if not a.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous array, got strides {a.strides}")
    return a.reshape(rows, a.size // rows if rows else 0)


@register("InnerProduct")
class InnerProduct(Layer):
    can_overwrite_param_diff = True
    """Caffe's InnerProduct: bottom (N, d1, ..., dk) is seen as rows of the axes from `axis`
    on, C = d_axis * ... * dk inputs each and N * d1 * ... * d(axis-1) rows; top is
    (N, d1, ..., d(axis-1), num_output). Weight (num_output, C), or (C, num_output) when
    transpose; bias (num_output,).
    """

    def setup(self, bottom_shapes):
        p = self.lp.inner_product_param
        shape = tuple(bottom_shapes[0])
        self.axis = check_axis(self, p.axis, len(shape))
        self.K = int(p.num_output)
        if self.K <= 0:
            raise self.error("num_output must be given and positive")
        self.C = int(np.prod(shape[self.axis:]))
        # Rows per sample: the axes between the batch axis and `axis`.
        self.rows = int(np.prod(shape[1:self.axis]))
        self.transpose = bool(p.transpose)
        self.bias_term = bool(p.bias_term)
        return [shape[:self.axis] + (self.K,)]

    def param_shapes(self):
        weight = (self.C, self.K) if self.transpose else (self.K, self.C)
        return [weight, (self.K,)] if self.bias_term else [weight]

    def param_fillers(self):
        p = self.lp.inner_product_param
        return [p.weight_filler, p.bias_filler] if self.bias_term else [p.weight_filler]

    def forward(self, bottom, top, params, scratch, chunk):
        m = chunk.n * self.rows
        w = params[0]
        b = params[1] if self.bias_term else np.empty(0, w.dtype)
        K.fc_forward(matrix(bottom[0], m), w, b, matrix(top[0], m), self.transpose)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        m = chunk.n * self.rows
        x = matrix(bottom[0], m)
        db = param_diff[1] if self.bias_term else np.empty(0, x.dtype)
        need_dx = bottom_diff[0] is not None
        # Without dx the kernel never touches its dx argument; x stands in for the type.
        dx = matrix(bottom_diff[0], m) if need_dx else x
        K.fc_backward(x, params[0], matrix(top_diff[0], m), dx, param_diff[0], db,
                      self.transpose, need_dx, self.overwrite_param_diff)
