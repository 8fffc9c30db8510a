"""Blob-plumbing layers: Concat, Eltwise, Flatten, Reshape and Split, with Caffe's parameters.

None of them learns anything. Where Caffe shares memory between bottom and top (Flatten,
Reshape, Split, one-bottom Concat), cgp copies: the net builder gives every top its own buffer.
Nothing here may mix samples, so the batch axis is never concatenated, flattened or reshaped.
"""
import math

import numpy as np

from cgp.errors import shorten
from cgp.kernels import elementwise as K
from cgp.layers.base import (DeviceOp, Layer, assign, check_axis, device_op, flat,
                             onnx_converter, register)
from cgp.proto import caffe_pb2


def _shape(shape):
    return "(" + ", ".join(str(d) for d in shape) + ")"


@register("Concat")
class Concat(Layer):
    """Joins N bottoms along concat_param.axis (default 1; the old concat_dim also works).
    The bottoms' shapes must agree on every other axis."""
    bottoms = (1, None)
    params_read = ("concat_param",)

    def setup(self, bottom_shapes):
        cp = self.lp.concat_param
        if cp.HasField("axis") and cp.HasField("concat_dim"):
            raise self.error("give either concat_param.axis or concat_dim, not both")
        shape0 = tuple(bottom_shapes[0])
        ndim = len(shape0)
        axis = cp.concat_dim if cp.HasField("concat_dim") else cp.axis
        self.axis = axis = check_axis(self, axis, ndim)
        for i, shape in enumerate(bottom_shapes[1:], 1):
            shape = tuple(shape)
            if len(shape) != ndim or any(a != b for j, (a, b) in enumerate(zip(shape0, shape))
                                         if j != axis):
                raise self.error(
                    f"bottom '{shorten(self.lp.bottom[0])}' {_shape(shape0)} and bottom "
                    f"'{shorten(self.lp.bottom[i])}' {_shape(shape)} must have the same shape "
                    f"except on the concat axis {axis}")
        self.sizes = [shape[axis] for shape in bottom_shapes]
        self.outer = math.prod(shape0[1:axis])     # per sample: rows before the concat axis
        self.inner = math.prod(shape0[axis + 1:])  # elements per slice of the concat axis
        top = list(shape0)
        top[axis] = sum(self.sizes)
        return [tuple(top)]

    def _rows(self, a, size, n):
        return flat(a).reshape(n * self.outer, size * self.inner)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n, total = chunk.n, sum(self.sizes)
        y = self._rows(top[0], total, n)
        offset = 0
        for x, size in zip(bottom, self.sizes):
            yield K.concat_forward, (self._rows(x, size, n), y, offset * self.inner)
            offset += size

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        n, total = chunk.n, sum(self.sizes)
        dy = self._rows(top_diff[0], total, n)
        offset = 0
        for dx, size in zip(bottom_diff, self.sizes):
            if dx is not None:
                yield K.concat_backward, (dy, self._rows(dx, size, n), offset * self.inner)
            offset += size


@register("Eltwise")
class Eltwise(Layer):
    """Elementwise SUM (with optional coeff per bottom), PROD or MAX of two or more bottoms of
    one shape. MAX keeps the winning bottom's index in scratch["argmax"]; ties go as in Caffe
    (bottom 1 over bottom 0, then the earlier bottom)."""
    bottoms = (2, None)
    params_read = ("eltwise_param",)

    def setup(self, bottom_shapes):
        ep = self.lp.eltwise_param
        P = caffe_pb2.EltwiseParameter
        self.op = ep.operation
        if self.op not in (P.SUM, P.PROD, P.MAX):
            raise self.error(f"unsupported eltwise_param.operation {self.op}")
        count = len(bottom_shapes)
        coeffs = list(ep.coeff)
        if coeffs and len(coeffs) != count:
            raise self.error(f"eltwise_param.coeff takes one coefficient per bottom: got "
                             f"{len(coeffs)} for {count} bottoms")
        if coeffs and self.op != P.SUM:
            raise self.error("eltwise_param.coeff applies only to operation SUM")
        self.coeffs = coeffs or [1.0] * count
        self.stable_prod_grad = ep.stable_prod_grad
        self.shape = tuple(bottom_shapes[0])
        for i, shape in enumerate(bottom_shapes[1:], 1):
            if tuple(shape) != self.shape:
                raise self.error(
                    f"all bottoms must have the same shape: bottom '{shorten(self.lp.bottom[0])}' "
                    f"{_shape(self.shape)}, bottom '{shorten(self.lp.bottom[i])}' {_shape(shape)}")
        return [self.shape]

    def scratch_shapes(self, n):
        if self.op == caffe_pb2.EltwiseParameter.MAX:
            return {"argmax": (n,) + self.shape[1:]}
        return {}

    def forward_calls(self, bottom, top, params, scratch, chunk):
        P = caffe_pb2.EltwiseParameter
        xs = [flat(b) for b in bottom]
        y = flat(top[0])
        if self.op == P.SUM:
            c = [y.dtype.type(c) for c in self.coeffs]
            yield K.scaled_copy, (xs[0], c[0], y)
            for x, ci in zip(xs[1:], c[1:]):
                yield K.axpy, (x, ci, y)
        elif self.op == P.PROD:
            yield K.multiply, (xs[0], xs[1], y)
            for x in xs[2:]:
                yield K.multiply, (y, x, y)
        else:
            idx = flat(scratch["argmax"][:chunk.n])
            yield K.max_first, (xs[0], xs[1], y, idx)
            for k, x in enumerate(xs[2:], 2):
                yield K.max_next, (x, k, y, idx)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        P = caffe_pb2.EltwiseParameter
        dy = flat(top_diff[0])
        xs = [flat(b) for b in bottom]
        if self.op == P.SUM and len(bottom_diff) == 2 and all(d is not None for d in bottom_diff):
            # ResNet's shortcuts: both gradients from one read of dy.
            f = dy.dtype.type
            yield K.scaled_copies, (dy, f(self.coeffs[0]), flat(bottom_diff[0]),
                                    f(self.coeffs[1]), flat(bottom_diff[1]))
            return
        for i, dx in enumerate(bottom_diff):
            if dx is None:
                continue
            dx = flat(dx)
            if self.op == P.SUM:
                yield K.scaled_copy, (dy, dx.dtype.type(self.coeffs[i]), dx)
            elif self.op == P.PROD:
                if self.stable_prod_grad:
                    # The product of the other bottoms, in bottom order, then times dy.
                    others = [x for j, x in enumerate(xs) if j != i]
                    yield K.copy, (others[0], dx)
                    for x in others[1:]:
                        yield K.multiply, (dx, x, dx)
                    yield K.multiply, (dx, dy, dx)
                else:
                    yield K.divide_multiply, (flat(top[0]), xs[i], dy, dx)
            else:
                yield K.max_backward, (dy, flat(scratch["argmax"][:chunk.n]), i, dx)


class _Copy(Layer):
    """A top that holds the bottom's elements in the same order under another shape."""

    def forward_calls(self, bottom, top, params, scratch, chunk):
        yield K.copy, (flat(bottom[0]), flat(top[0]))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is not None:
            yield K.copy, (flat(top_diff[0]), flat(bottom_diff[0]))


@register("Flatten")
class Flatten(_Copy):
    """Merges axes flatten_param.axis .. end_axis (defaults 1 and -1) into one; a copy."""
    params_read = ("flatten_param",)

    def setup(self, bottom_shapes):
        fp = self.lp.flatten_param
        shape = tuple(bottom_shapes[0])
        ndim = len(shape)
        start = check_axis(self, fp.axis, ndim)
        if not -ndim <= fp.end_axis < ndim:
            raise self.error(f"end_axis {fp.end_axis} is out of range for a {ndim}-d blob")
        end = fp.end_axis % ndim
        if end + 1 < start:
            raise self.error(f"end_axis {fp.end_axis} comes before axis {fp.axis}")
        return [shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]]


@register("Reshape")
class Reshape(_Copy):
    """Caffe's Reshape: reshape_param.shape replaces axes axis .. axis + num_axes - 1 (default:
    all); a dim of 0 copies the bottom's dim, one dim of -1 is inferred. The batch axis must
    keep its size (write dim: 0 for it), so that each sample stays whole; a copy."""
    params_read = ("reshape_param",)

    def setup(self, bottom_shapes):
        rp = self.lp.reshape_param
        bottom = tuple(bottom_shapes[0])
        ndim = len(bottom)
        dims = list(rp.shape.dim)
        if any(d < -1 for d in dims):
            raise self.error(f"reshape_param.shape dims must be >= -1, got {dims}")
        inferred = [i for i, d in enumerate(dims) if d == -1]
        if len(inferred) > 1:
            raise self.error(f"reshape_param.shape may hold at most one -1, got {dims}")
        start = rp.axis if rp.axis >= 0 else ndim + rp.axis + 1
        if not 0 <= start <= ndim:
            raise self.error(f"reshape_param.axis {rp.axis} is out of range for a {ndim}-d blob")
        if rp.num_axes < -1:
            raise self.error(f"reshape_param.num_axes must be >= 0, or -1 for all; "
                             f"got {rp.num_axes}")
        end = ndim if rp.num_axes == -1 else start + rp.num_axes
        if end > ndim:
            raise self.error(f"reshape_param.axis + num_axes = {end} is out of range for a "
                             f"{ndim}-d blob")
        top = list(bottom[:start]) + dims + list(bottom[end:])
        for i, d in enumerate(dims):
            if d == 0:
                if start + i >= ndim:
                    raise self.error(f"reshape_param.shape dim {i} is 0 but bottom "
                                     f"{_shape(bottom)} has no axis {start + i} to copy")
                top[start + i] = bottom[start + i]
        count = math.prod(bottom)
        if inferred:
            known = math.prod(d for j, d in enumerate(top) if j != start + inferred[0])
            if known == 0 or count % known:
                raise self.error(f"cannot infer the -1 dim: bottom {_shape(bottom)} holds "
                                 f"{count} elements, not a multiple of {known}")
            top[start + inferred[0]] = count // known
        top = tuple(top)
        if math.prod(top) != count:
            raise self.error(f"bottom {_shape(bottom)} and top {_shape(top)} hold different "
                             f"numbers of elements")
        if top[0] != bottom[0]:
            raise self.error(f"top {_shape(top)} would change the batch axis of bottom "
                             f"{_shape(bottom)}: cgp splits the batch into chunks, so the first "
                             f"dim must stay (write dim: 0)")
        return [top]


@register("Split")
class Split(Layer):
    """Copies its bottom to each of its tops; backward sums the tops' gradients in top order.
    The net builder inserts it where one blob feeds several layers, as Caffe does."""
    tops = (1, None)

    def setup(self, bottom_shapes):
        return [tuple(bottom_shapes[0])] * len(self.lp.top)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        x = flat(bottom[0])
        # Two tops a time from one read of x; an odd one out alone.
        for j in range(0, len(top) - 1, 2):
            yield K.copies, (x, flat(top[j]), flat(top[j + 1]))
        if len(top) % 2:
            yield K.copy, (x, flat(top[-1]))

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        dx = flat(bottom_diff[0])
        # A top whose consumers need no gradient may come without one: it adds nothing.
        diffs = [flat(d) for d in top_diff if d is not None]
        if not diffs:
            yield assign, (dx, 0)
        elif len(diffs) == 1:
            yield K.copy, (diffs[0], dx)
        elif len(diffs) == 2:
            yield K.add, (diffs[0], diffs[1], dx)
        else:
            # In top order, two more gradients a pass (GoogLeNet's four-way splits).
            yield K.add3, (diffs[0], diffs[1], diffs[2], dx)
            for j in range(3, len(diffs) - 1, 2):
                yield K.add3, (dx, diffs[j], diffs[j + 1], dx)
            if len(diffs) % 2 == 0:
                yield K.add, (dx, diffs[-1], dx)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@device_op(Concat)
class ConcatOp(DeviceOp):

    def _pieces(self, a):
        L = self.layer
        rows = a.reshape(a.shape[0] * L.outer, -1, L.inner)
        at = 0
        for size in L.sizes:
            yield rows[:, at:at + size]
            at += size

    def forward(self, bottom, top, params, scratch, chunk):
        L = self.layer
        for piece, x in zip(self._pieces(top[0]), bottom):
            piece[...] = x.reshape(x.shape[0] * L.outer, -1, L.inner)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        L = self.layer
        for piece, dx in zip(self._pieces(top_diff[0]), bottom_diff):
            if dx is not None:
                dx.reshape(dx.shape[0] * L.outer, -1, L.inner)[...] = piece


@device_op(Eltwise)
class EltwiseOp(DeviceOp):
    """SUM (coefficients), PROD, MAX (ties to the earlier bottom, bottom 1 over bottom 0, as
    Caffe)."""

    def forward(self, bottom, top, params, scratch, chunk):
        L, xp = self.layer, self.xp
        P = caffe_pb2.EltwiseParameter
        y = top[0]
        if L.op == P.SUM:
            out = bottom[0] * y.dtype.type(L.coeffs[0])
            for x, c in zip(bottom[1:], L.coeffs[1:]):
                out = out + x * y.dtype.type(c)
        elif L.op == P.PROD:
            out = bottom[0] * bottom[1]
            for x in bottom[2:]:
                out = out * x
        else:
            # Caffe: bottom 1 wins a tie with bottom 0; later bottoms win only when larger.
            take = bottom[1] >= bottom[0]
            out = xp.where(take, bottom[1], bottom[0])
            arg = take.astype(np.int32)
            for k, x in enumerate(bottom[2:], 2):
                larger = x > out
                out = xp.where(larger, x, out)
                arg = xp.where(larger, np.int32(k), arg)
            self.arg = arg
        y[...] = out

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        L, xp = self.layer, self.xp
        P = caffe_pb2.EltwiseParameter
        dy = top_diff[0]
        for i, dx in enumerate(bottom_diff):
            if dx is None:
                continue
            if L.op == P.SUM:
                dx[...] = dy * dy.dtype.type(L.coeffs[i])
            elif L.op == P.PROD:
                others = [x for j, x in enumerate(bottom) if j != i]
                out = others[0]
                for x in others[1:]:
                    out = out * x
                dx[...] = out * dy
            else:
                dx[...] = xp.where(self.arg == i, dy, dy.dtype.type(0))


@device_op(Flatten, Reshape)
class CopyOp(DeviceOp):

    def forward(self, bottom, top, params, scratch, chunk):
        top[0].reshape(-1)[...] = bottom[0].reshape(-1)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is not None:
            bottom_diff[0].reshape(-1)[...] = top_diff[0].reshape(-1)


@device_op(Split)
class SplitOp(DeviceOp):

    def forward(self, bottom, top, params, scratch, chunk):
        for t in top:
            t[...] = bottom[0]

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                 chunk):
        if bottom_diff[0] is not None:
            total = top_diff[0]
            for d in top_diff[1:]:
                total = total + d
            bottom_diff[0][...] = total


@onnx_converter(Concat)
def concat_onnx(g, e, bottoms, tops, params, read):
    g.node("Concat", bottoms, tops, axis=e.layer.axis)


@onnx_converter(Eltwise)
def eltwise_onnx(g, e, bottoms, tops, params, read):
    P = caffe_pb2.EltwiseParameter
    layer = e.layer
    if layer.op == P.MAX:
        g.node("Max", bottoms, tops)
        return
    if layer.op == P.PROD:
        op = "Mul"
        terms = bottoms
    else:
        op = "Add"
        terms = []
        for k, (x, c) in enumerate(zip(bottoms, layer.coeffs)):
            if c == 1:
                terms.append(x)
                continue
            term = g.fresh(f"{layer.name}/term{k}")
            g.node("Mul", [x, g.constant(f"{layer.name}/coeff{k}", np.array(c, np.float32))],
                   [term])
            terms.append(term)
    # Caffe adds (multiplies) the bottoms in order: a chain, not a Sum of all at once.
    acc = terms[0]
    for k, x in enumerate(terms[1:], 1):
        out = tops[0] if k == len(terms) - 1 else g.fresh(f"{layer.name}/acc{k}")
        g.node(op, [acc, x], [out])
        acc = out
    if len(terms) == 1:
        g.node("Identity", [acc], tops)


@onnx_converter(Flatten, Reshape)
def reshape_onnx(g, e, bottoms, tops, params, read):
    """Flatten and Reshape: the top's shape, its batch axis copied (0)."""
    shape = [0] + list(g.net.blob_shapes[e.tops[0]][1:])
    g.node("Reshape", [bottoms[0], g.constant(f"{e.layer.name}/shape",
                                              np.array(shape, np.int64))], tops)
