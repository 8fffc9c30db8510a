"""Device ops: the forward and backward of each layer type over the arrays of ONE chunk, written
against an array module `xp` (CuPy on a GPU; NumPy as its stand-in, which is how the tests run
them without a GPU), for the device engine (cgp.device.engine).

An op reads its layer's configuration from the CPU layer object (set up by the net: the
prototxt stays the one source of truth) and never branches on the array module: the backend
hands it `xp`, and only NumPy-API calls that CuPy also has are used. Contract of an op:

    Op(layer, xp)
    stages                        (forward stages, backward stages): more than one where the
                                  layer sums over the whole batch (BatchNorm: 3 and 2); the
                                  engine makes sum k between stage k and k + 1
    forward(stage, bottom, top, params, sums, chunk)
    backward(stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums, chunk)

Arrays hold one chunk (axis 0 = chunk.n samples), on the device; a loss top is a 0-d array,
the chunk's share of the batch's loss. param_diff arrays (this chunk's own gradient, the
blob's shape) are added to; bottom_diff arrays are overwritten, None where no gradient
flows. sums: per sum k of the layer, (share, total): the chunk's share to write (float64,
(m_k,)) and the batch's total once made (the layer's sync() has finished it, on the host).
An op keeps what its backward reads (max pooling's window offsets, a loss's probabilities)
between the two: each workspace has ops of its own.

Why one chunk: the weights must be bitwise the same for any number of devices or ranks, so
nothing a chunk computes may depend on which other chunks share its call: a library GEMM or
reduction picks its algorithm (and so its order of additions) from the shapes it is given,
and a chunk's shapes are fixed by the batch and the chunk count alone. Every op below is
also free of atomics (max-pooling's gradient and col2im add window offset by window offset,
in a fixed order), so the same shapes give the same bits on every run.
"""
import numpy as np

from cgp.kernels.activation import dropout_forward
from cgp.layers.base import view
from cgp.proto import caffe_pb2

OPS = {}


def op(*type_names):
    """Class decorator: the device op of these Caffe layer types."""
    def add(cls):
        for name in type_names:
            OPS[name] = cls
        return cls
    return add


def unsupported(net):
    """[(layer name, type, why), ...] of the net's layers that the device cannot run."""
    out = []
    for entry in net.entries:
        layer = entry.layer
        cls = OPS.get(layer.type_name)
        why = "no device op" if cls is None else cls.refuses(layer)
        if why:
            out.append((layer.name, layer.type_name, why))
    return out


class Op:
    """Base of the device ops: one stage each way, no refusals."""
    stages = (1, 1)

    def __init__(self, layer, xp):
        self.layer, self.xp = layer, xp

    @staticmethod
    def refuses(layer):
        """Why the device cannot run this configuration of the layer, or None."""
        return None

    def forward(self, stage, bottom, top, params, sums, chunk):
        raise NotImplementedError

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        """Nothing flows back (Accuracy)."""


# -- convolution, inner product ---------------------------------------------------------------

@op("Convolution")
class Convolution(Op):
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

    def forward(self, stage, bottom, top, params, sums, chunk):
        L, xp = self.layer, self.xp
        x, y = bottom[0], top[0]
        G = L.group
        w = params[0].reshape(G, L.K // G, -1)
        out = xp.matmul(w[None], self._columns(x))          # (n, G, Kg, P*Q)
        out = out.reshape(y.shape)
        if L.bias_term:
            out += params[1].reshape(1, L.K, 1, 1)
        y[...] = out

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
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


@op("InnerProduct")
class InnerProduct(Op):

    def _rows(self, a, n, width):
        return view(a, (n * self.layer.rows, width))

    def forward(self, stage, bottom, top, params, sums, chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        x = self._rows(bottom[0], n, L.C)
        w = params[0]
        out = xp.matmul(x, w) if L.transpose else xp.matmul(x, w.T)
        if L.bias_term:
            out += params[1]
        self._rows(top[0], n, L.K)[...] = out

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
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


# -- pooling ----------------------------------------------------------------------------------

@op("Pooling")
class Pooling(Op):
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

    def forward(self, stage, bottom, top, params, sums, chunk):
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

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
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


# -- elementwise ------------------------------------------------------------------------------

@op("ReLU")
class ReLU(Op):
    """In place (top = bottom), the bottom holds y, whose sign is x's for a slope >= 0."""

    def forward(self, stage, bottom, top, params, sums, chunk):
        x = bottom[0]
        slope = x.dtype.type(self.layer.slope)
        top[0][...] = self.xp.where(x > 0, x, x * slope)

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is not None:
            x, dy = bottom[0], top_diff[0]
            slope = dy.dtype.type(self.layer.slope)
            bottom_diff[0][...] = self.xp.where(x > 0, dy, dy * slope)


@op("Sigmoid")
class Sigmoid(Op):

    def forward(self, stage, bottom, top, params, sums, chunk):
        x = bottom[0]
        one = x.dtype.type(1)
        top[0][...] = one / (one + self.xp.exp(-x))

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is not None:
            y = top[0]
            bottom_diff[0][...] = top_diff[0] * y * (y.dtype.type(1) - y)


@op("TanH")
class TanH(Op):

    def forward(self, stage, bottom, top, params, sums, chunk):
        top[0][...] = self.xp.tanh(bottom[0])

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is not None:
            y = top[0]
            bottom_diff[0][...] = top_diff[0] * (y.dtype.type(1) - y * y)


@op("Dropout")
class Dropout(Op):
    """The CPU layer's mask, drawn on the host by its Philox kernel (keyed by sample, never by
    chunk or device) and copied over; TEST: the identity."""

    def forward(self, stage, bottom, top, params, sums, chunk):
        L, x = self.layer, bottom[0]
        if not L.train:
            top[0][...] = x
            return
        rows = (x.shape[0], x[0].size)
        ones, mask = np.ones(rows, x.dtype), np.empty(rows, x.dtype)
        dropout_forward(ones, np.empty(rows, x.dtype), mask, L.ratio, x.dtype.type(L.scale),
                        chunk.seed, chunk.iteration, chunk.first, L.index)
        self.mask = self.xp.asarray(mask).reshape(x.shape)
        top[0][...] = x * self.mask

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is not None:
            dy = top_diff[0]
            bottom_diff[0][...] = dy * self.mask if self.layer.train else dy


@op("LRN")
class LRN(Op):
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

    def forward(self, stage, bottom, top, params, sums, chunk):
        L, xp = self.layer, self.xp
        x = bottom[0]
        f = x.dtype.type
        base = f(L.k) if L.across else f(1)
        self.scale = base + f(L.alpha / self._count()) * self._window_sum(x * x)
        self.power = xp.power(self.scale, f(-L.beta))
        top[0][...] = x * self.power

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is None:
            return
        L = self.layer
        x, y, dy = bottom[0], top[0], top_diff[0]
        f = x.dtype.type
        ratio = f(2 * L.alpha * L.beta / self._count())
        bottom_diff[0][...] = dy * self.power - ratio * x * self._window_sum(dy * y / self.scale)


@op("Eltwise")
class Eltwise(Op):
    """SUM (coefficients), PROD, MAX (ties to the earlier bottom, bottom 1 over bottom 0, as
    Caffe)."""

    def forward(self, stage, bottom, top, params, sums, chunk):
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

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
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


@op("Split")
class Split(Op):

    def forward(self, stage, bottom, top, params, sums, chunk):
        for t in top:
            t[...] = bottom[0]

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is not None:
            total = top_diff[0]
            for d in top_diff[1:]:
                total = total + d
            bottom_diff[0][...] = total


@op("Flatten", "Reshape")
class Copy(Op):

    def forward(self, stage, bottom, top, params, sums, chunk):
        top[0].reshape(-1)[...] = bottom[0].reshape(-1)

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is not None:
            bottom_diff[0].reshape(-1)[...] = top_diff[0].reshape(-1)


@op("Concat")
class Concat(Op):

    def _pieces(self, a):
        L = self.layer
        rows = a.reshape(a.shape[0] * L.outer, -1, L.inner)
        at = 0
        for size in L.sizes:
            yield rows[:, at:at + size]
            at += size

    def forward(self, stage, bottom, top, params, sums, chunk):
        L = self.layer
        for piece, x in zip(self._pieces(top[0]), bottom):
            piece[...] = x.reshape(x.shape[0] * L.outer, -1, L.inner)

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        L = self.layer
        for piece, dx in zip(self._pieces(top_diff[0]), bottom_diff):
            if dx is not None:
                dx.reshape(dx.shape[0] * L.outer, -1, L.inner)[...] = piece


# -- batch normalisation and its Scale --------------------------------------------------------

@op("BatchNorm")
class BatchNorm(Op):
    """Caffe's arithmetic as cgp.kernels.batchnorm: float64 sums of the chunk (its share),
    everything else in the blobs' dtype."""

    def __init__(self, layer, xp):
        super().__init__(layer, xp)
        self.stages = (1, 1) if layer.global_stats else (3, 2)

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

    def forward(self, stage, bottom, top, params, sums, chunk):
        x, y = self._view(bottom[0]), self._view(top[0])
        if self.layer.global_stats:
            mean, std = self._stats(params, x.dtype)
        elif stage == 0:
            sums[0][0][...] = x.astype(np.float64).sum(axis=(0, 2))
            return
        elif stage == 1:
            d = (x - sums[0][1].astype(x.dtype)[None, :, None]).astype(np.float64)
            sums[1][0][...] = (d * d).sum(axis=(0, 2))
            return
        else:
            mean, std = sums[0][1].astype(x.dtype), sums[1][1].astype(x.dtype)
        y[...] = (x - mean[None, :, None]) / std[None, :, None]

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is None:
            return
        y, dy, dx = self._view(top[0]), self._view(top_diff[0]), self._view(bottom_diff[0])
        f = y.dtype.type
        C = self.layer.C
        if self.layer.global_stats:
            _, std = self._stats(params, y.dtype)
            dx[...] = dy / std[None, :, None]
        elif stage == 0:
            share = sums[2][0]
            share[:C] = (dy * y).astype(np.float64).sum(axis=(0, 2))
            share[C:] = dy.astype(np.float64).sum(axis=(0, 2))
        else:
            total = sums[2][1].astype(y.dtype)
            a, b = total[None, :C, None], total[None, C:, None]
            std = sums[1][1].astype(y.dtype)[None, :, None]
            scale = f(-1.0) / f(self.layer.m)
            dx[...] = (dy + scale * (y * a + b)) / std


@op("Scale")
class Scale(Op):
    """A learnt scale (and bias) broadcast over the other axes."""

    @staticmethod
    def refuses(layer):
        if not layer.learnt:
            return "a second bottom as the scale"
        if layer.axis == 0 and layer.blob_shape:
            return "a scale blob along the batch axis"
        return None

    def __init__(self, layer, xp):
        super().__init__(layer, xp)
        L, k = layer, len(layer.blob_shape)
        # The blob's shape broadcast against a chunk's arrays, and the axes it sums over.
        self.shape = (1,) * L.axis + tuple(L.blob_shape) + (1,) * (len(L.shape) - L.axis - k)
        self.axes = tuple(a for a in range(len(L.shape)) if not L.axis <= a < L.axis + k)

    def forward(self, stage, bottom, top, params, sums, chunk):
        out = bottom[0] * params[0].reshape(self.shape)
        if self.layer.bias_term:
            out = out + params[1].reshape(self.shape)
        top[0][...] = out

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        dy = top_diff[0]
        if self.layer.bias_term:
            param_diff[1] += dy.sum(axis=self.axes).reshape(param_diff[1].shape)
        param_diff[0] += (dy * bottom[0]).sum(axis=self.axes).reshape(param_diff[0].shape)
        if bottom_diff[0] is not None:
            bottom_diff[0][...] = dy * params[0].reshape(self.shape)


# -- softmax, losses, accuracy ----------------------------------------------------------------

def _softmax(xp, scores):
    """Softmax over axis 1 of (O, C, I) scores, the maximum subtracted first."""
    e = xp.exp(scores - scores.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@op("Softmax")
class Softmax(Op):

    def forward(self, stage, bottom, top, params, sums, chunk):
        n = bottom[0].shape[0]
        self.layer._scores(top[0], n)[...] = _softmax(self.xp, self.layer._scores(bottom[0], n))

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        if bottom_diff[0] is None:
            return
        n = top[0].shape[0]
        y = self.layer._scores(top[0], n)
        dy = self.layer._scores(top_diff[0], n)
        self.layer._scores(bottom_diff[0], n)[...] = (
            dy - (dy * y).sum(axis=1, keepdims=True)) * y


class _Labelled(Op):
    """Labels checked as the CPU layer checks them (integers in [0, C) or the ignore_label),
    on the device; the message names the first bad one, as the CPU layer's does. A second
    top (second_top: what it is) is refused."""
    second_top = None

    @classmethod
    def refuses(cls, layer):
        return cls.second_top if len(layer.lp.top) > 1 else None

    def _labels(self, labels, n, chunk):
        """(O, I) float labels -> (int labels with ignored ones at 0, mask of counted ones)."""
        L, xp = self.layer, self.xp
        labels = L._labels(labels, n)
        whole = labels == xp.floor(labels)
        ok = whole & (labels >= 0) & (labels < L.classes)
        counted = ok
        if L.has_ignore:
            ignored = labels == L.ignore
            ok = ok | ignored
            counted = ok & ~ignored
        if not bool(ok.all()):
            raise L._bad_label(labels, int(xp.argmin(ok.reshape(-1))), chunk.first)
        return xp.where(counted, labels, 0).astype(np.int64), counted


@op("SoftmaxWithLoss")
class SoftmaxWithLoss(_Labelled):
    second_top = "the probabilities top"

    def forward(self, stage, bottom, top, params, sums, chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        labels, counted = self._labels(bottom[1], n, chunk)
        prob = _softmax(xp, L._scores(bottom[0], n))                     # (O, C, I)
        picked = xp.take_along_axis(prob, labels[:, None, :], axis=1)[:, 0, :]
        f = prob.dtype.type
        logs = xp.log(xp.maximum(picked, f(np.finfo(prob.dtype).tiny)))
        self.prob, self.labels, self.counted = prob, labels, counted
        top[0][...] = -xp.where(counted, logs, f(0)).sum() / f(L.normaliser(chunk))

    def backward(self, stage, top, top_diff, bottom, bottom_diff, params, param_diff, sums,
                 chunk):
        L, xp = self.layer, self.xp
        if bottom_diff[0] is None:
            return
        n = bottom[0].shape[0]
        f = self.prob.dtype.type
        classes = xp.arange(self.prob.shape[1])[None, :, None]
        grad = self.prob - (classes == self.labels[:, None, :]).astype(self.prob.dtype)
        grad = xp.where(self.counted[:, None, :], grad, f(0))
        scale = top_diff[0] / f(L.normaliser(chunk))
        L._scores(bottom_diff[0], n)[...] = grad * scale


@op("Accuracy")
class Accuracy(_Labelled):
    """A position is correct when fewer than top_k other classes score at least its label's
    (a tie counts against, as Caffe)."""
    second_top = "the per-class accuracy top"

    def forward(self, stage, bottom, top, params, sums, chunk):
        L, xp = self.layer, self.xp
        n = bottom[0].shape[0]
        labels, counted = self._labels(bottom[1], n, chunk)
        scores = L._scores(bottom[0], n)
        mine = xp.take_along_axis(scores, labels[:, None, :], axis=1)       # (O, 1, I)
        others = (scores >= mine).sum(axis=1) - 1
        correct = int(((others < L.top_k) & counted).sum())
        count = (int(L._batch_label_counts(chunk, "accuracy with an ignore_label").sum())
                 if L.has_ignore else L._positions(chunk))
        top[0][...] = correct / count if count > 0 else 0.0

