"""The InnerProduct layer: Caffe's fully connected layer over the axes from `axis` on; and
Embed, its lookup-table form (a one-hot input).

Rows never mix and every row goes through the same code, so a sample's output does not depend
on its chunk (see cgp.kernels.fc). Axis 0 is refused.
"""
import numpy as np

from cgp.kernels import fc as K
from cgp.layers.base import (DeviceOp, Factors, Layer, assign, check_axis, device_op,
                             onnx_converter, part_span, register, view)


@register("InnerProduct")
class InnerProduct(Layer):
    """Caffe's InnerProduct: bottom (N, d1, ..., dk) is seen as rows of the axes from `axis`
    on, C = d_axis * ... * dk inputs each and N * d1 * ... * d(axis-1) rows; top is
    (N, d1, ..., d(axis-1), num_output). Weight (num_output, C), or (C, num_output) when
    transpose; bias (num_output,).

    Scratch: "rows", for the kernel that multiplies rows by a weight stored row by row (the
    input gradient; the forward pass of a transposed weight): its rows transposed, and the
    weight's last columns (see cgp.kernels.fc.rows_axpy).
    """
    params_read = ("inner_product_param",)
    work_scratch = ("rows",)
    can_overwrite_param_diff = True
    backward_reads_top = False

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

    def scratch_shapes(self, n):
        # rows_axpy multiplies rows of x by a (C, K) weight when transposed, rows of dy by a
        # (K, C) one otherwise.
        return {"rows": (K.scratch_size(n * self.rows, self.C if self.transpose else self.K),)}

    def param_fillers(self):
        p = self.lp.inner_product_param
        return [p.weight_filler, p.bias_filler] if self.bias_term else [p.weight_filler]

    def forward_calls(self, bottom, top, params, scratch, chunk):
        m = chunk.n * self.rows
        w = params[0]
        b = params[1] if self.bias_term else np.empty(0, w.dtype)
        yield K.fc_forward, (view(bottom[0], (m, self.C)), w, b, view(top[0], (m, self.K)),
                             self.transpose, scratch["rows"])

    def factor_shape(self):
        # The weight gradient is dy^T @ x, or x^T @ dy when the weight is stored transposed.
        return (self.rows, self.C, self.K) if self.transpose else (self.rows, self.K, self.C)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        m = chunk.n * self.rows
        x = view(bottom[0], (m, self.C))
        dy = view(top_diff[0], (m, self.K))
        w, dw = params[0], param_diff[0]
        none = np.empty(0, x.dtype)
        # Without dx (or dw) the kernel never touches that argument; x stands in for the type.
        if bottom_diff[0] is not None:
            yield K.fc_backward, (x, w, dy, view(bottom_diff[0], (m, self.C)), x, none,
                                  self.transpose, True, False, False, scratch["rows"])
        factored = isinstance(dw, Factors)
        starts = chunk.starts * self.rows
        if factored:
            a, b = (x, dy) if self.transpose else (dy, x)
            yield assign, (dw.a, a)
            yield assign, (dw.b, b)
        else:  # each part's weight gradient, the chain over its own rows
            for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
                yield K.fc_backward, (x[lo:hi], w, dy[lo:hi], x, dw[i], none, self.transpose,
                                      False, True, self.overwrite_param_diff, scratch["rows"])
        if self.bias_term:
            db, step = part_span(param_diff[1])
            yield K.bias_parts, (dy, db, step, starts, self.overwrite_param_diff)


@register("Embed")
class Embed(Layer):
    """Caffe's Embed: each bottom element is a row index in [0, input_dim) (an integer held
    as a float), and the top takes that row of the weight (input_dim, num_output) plus the
    bias (num_output,): top shape is the bottom's + (num_output,). No gradient to the indices
    (Caffe has none). It checks the indices at every call (calls_each_time): one that is no
    row is refused by sample, where Caffe reads past its table."""
    params_read = ("embed_param",)
    calls_each_time = True
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.embed_param
        shape = tuple(bottom_shapes[0])
        self.K, self.V = int(p.num_output), int(p.input_dim)
        if self.K <= 0:
            raise self.error("num_output must be given and positive")
        if self.V <= 0:
            raise self.error("input_dim must be given and positive")
        self.bias_term = bool(p.bias_term)
        self.per_sample = int(np.prod(shape[1:]))
        return [shape + (self.K,)]

    def param_shapes(self):
        return [(self.V, self.K)] + ([(self.K,)] if self.bias_term else [])

    def param_fillers(self):
        p = self.lp.embed_param
        return [p.weight_filler] + ([p.bias_filler] if self.bias_term else [])

    def forward(self, bottom, top, params, scratch, chunk):
        idx = view(bottom[0], -1)
        w = params[0]
        b = params[1] if self.bias_term else np.empty(0, w.dtype)
        bad = K.embed_forward(idx, w, b, view(top[0], (idx.size, self.K)))
        if bad >= 0:
            raise self.error(f"index {float(idx[bad]):g} (sample "
                             f"{chunk.first + bad // self.per_sample} of the batch, position "
                             f"{bad % self.per_sample}) is not a row of the table: indices "
                             f"must be integers in [0, {self.V}) (input_dim)")

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        if bottom_diff[0] is not None:
            raise self.error("cannot backpropagate to its input, the indices (Caffe cannot "
                             "either): set propagate_down: false")
        idx = view(bottom[0], -1)
        dy = view(top_diff[0], (idx.size, self.K))
        starts = chunk.starts * self.per_sample
        dw, step = part_span(param_diff[0])
        K.embed_backward(idx, dy, dw, step, starts)
        if self.bias_term:
            db, step = part_span(param_diff[1])
            K.bias_parts(dy, db, step, starts, False)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(InnerProduct)
class InnerProductOp(DeviceOp):

    def _rows(self, a, n, width):
        return view(a, (n * self.layer.rows, width))

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        x = self._rows(bottom[0], n, L.C)
        w = params[0]
        out = xp.matmul(x, w) if L.transpose else xp.matmul(x, w.T)
        if L.bias_term:
            out += params[1]
        self._rows(top[0], n, L.K)[...] = out

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        x = self._rows(bottom[0], n, L.C)
        dy = self._rows(top_diff[0], n, L.K)
        param_diff[0] += xp.matmul(x.T, dy) if L.transpose else xp.matmul(dy.T, x)
        if L.bias_term:
            param_diff[1] += dy.sum(axis=0)
        if bottom_diff[0] is not None:
            w = params[0]
            self._rows(bottom_diff[0], n, L.C)[...] = (xp.matmul(dy, w.T) if L.transpose
                                                      else xp.matmul(dy, w))


@onnx_converter(InnerProduct)
def inner_product_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    bottom_shape = g.net.blob_shapes[e.bottoms[0]]
    weight = params[0] if layer.transpose else params[0].T     # (C, K)
    x = bottoms[0]
    if layer.axis == 1:
        flat = g.fresh(f"{layer.name}/flat")
        g.node("Flatten", [x], [flat], axis=1)
        # The blob as stored, (K, C) or with transpose (C, K): no copy of a large matrix.
        inputs = [flat, g.constant(f"{layer.name}/weight", params[0])]
        if layer.bias_term:
            inputs.append(g.constant(f"{layer.name}/bias", params[1]))
        g.node("Gemm", inputs, [tops[0]], transB=0 if layer.transpose else 1)
        return
    rows = g.fresh(f"{layer.name}/rows")
    g.node("Reshape", [x, g.constant(f"{layer.name}/shape", np.array(
        [0] + list(bottom_shape[1:layer.axis]) + [layer.C], np.int64))], [rows])
    product = g.fresh(f"{layer.name}/product") if layer.bias_term else tops[0]
    g.node("MatMul", [rows, g.constant(f"{layer.name}/weight", np.ascontiguousarray(weight))],
           [product])
    if layer.bias_term:
        g.node("Add", [product, g.constant(f"{layer.name}/bias", params[1])], [tops[0]])


@onnx_converter(Embed)
def embed_onnx(g, e, bottoms, tops, params, read):
    """Row lookup: Gather of the table at the indices (floats holding integers)."""
    layer, name = e.layer, e.layer.name
    indices = g.op("Cast", [bottoms[0]], f"{name}/indices", to=g.onnx.TensorProto.INT64)
    table = g.constant(f"{name}/weight", params[0])
    if not layer.bias_term:
        g.node("Gather", [table, indices], tops, axis=0)
        return
    rows = g.op("Gather", [table, indices], f"{name}/rows", axis=0)
    g.node("Add", [rows, g.constant(f"{name}/bias", params[1])], tops)
