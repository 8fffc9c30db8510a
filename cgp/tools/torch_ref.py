"""The same network in PyTorch, built from a cgp Net (and so from the same prototxt, with the
same layers, shapes and weights), for `cgp bench speedup --compare torch` and as an independent
check of cgp's forward and backward. Optional: importing this module needs PyTorch.

It covers the layers of the bundled models and of the zoo's ResNet-50, GoogLeNet, MobileNet and
SqueezeNet (Convolution, grouped and depthwise too; Pooling MAX/AVE with Caffe's rounding, global
too; InnerProduct, ReLU, LRN, Sigmoid, TanH, Dropout, BatchNorm, Scale, Bias, Eltwise, Concat,
Softmax, SoftmaxWithLoss, Reduction, Accuracy and the Split layers the net builder inserts);
any other layer is refused by name. It does not read data: callers pass the batches that cgp's
data layers produce.

Written as a PyTorch user writes such a net (torchvision's): a BatchNorm whose only reader is a
learnt per-channel Scale runs as one batch_norm with weight and bias, and a ReLU that Caffe
runs in place runs in place where autograd allows it (its input read by nothing else, and made
by an op that keeps its inputs, not its output, for backward).
"""
import numpy as np

from cgp.errors import CgpError

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # an optional extra: say how to get it
    raise CgpError("the PyTorch comparison needs PyTorch: pip install 'cgp[torch]' "
                   "(or pip install torch)") from None

from cgp.proto import caffe_pb2

PP = caffe_pb2.PoolingParameter
LossP = caffe_pb2.LossParameter
EltP = caffe_pb2.EltwiseParameter
RedP = caffe_pb2.ReductionParameter
SUPPORTED = ("Convolution", "Pooling", "InnerProduct", "ReLU", "LRN", "Sigmoid", "TanH",
             "Dropout", "BatchNorm", "Scale", "Bias", "Eltwise", "Concat", "Softmax",
             "SoftmaxWithLoss", "Reduction", "Accuracy", "Split")
# Ops whose backward keeps their inputs, not their output: a ReLU after one may overwrite it.
KEEP_INPUTS = ("Convolution", "InnerProduct", "BatchNorm", "Scale", "Bias", "Eltwise", "Concat")
LAYOUTS = ("channels_last", "contiguous")


def memory_format(layout):
    if layout not in LAYOUTS:
        raise CgpError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


class TorchNet(torch.nn.Module):
    """net.entries as PyTorch ops over blob ids. Parameters start as copies of `params`
    (default net.params), one torch Parameter per cgp ParamBlob, so shared blobs stay shared.
    `layout`: the memory format of 4-d blobs and weights, channels_last or contiguous;
    `dtype`: of the weights and inputs (float64: a reference for cgp's float32 arithmetic);
    `device`: PyTorch's, where the weights live and each batch is copied ("cpu", "cuda")."""

    def __init__(self, net, params=None, layout="channels_last", dtype=np.float32,
                 device="cpu"):
        super().__init__()
        unsupported = sorted({e.layer.type_name for e in net.entries} - set(SUPPORTED))
        if unsupported:
            raise CgpError(f"net '{net.name}': the PyTorch comparison does not support layer "
                           f"type(s) {', '.join(unsupported)}; supported: {', '.join(SUPPORTED)}")
        self.net = net
        self.format = memory_format(layout)
        self.dtype, self.device = dtype, device
        flat = net.params if params is None else params
        self.blobs = torch.nn.ParameterList()
        for b in net.param_blobs:
            value = torch.from_numpy(np.array(flat[b.offset:b.offset + b.size], dtype)
                                     .reshape(b.shape)).to(device)
            if value.dim() == 4:
                # .to, as Module.to(memory_format=...): .contiguous keeps the strides of a
                # tensor that is both formats at once (one input channel: conv1 of LeNet),
                # and its convolution then ran in the other format.
                value = value.to(memory_format=self.format)
            self.blobs.append(torch.nn.Parameter(value, requires_grad=b.lr_mult != 0))
        self.readers = {}    # blob id -> how many entries read it
        self.writer = {}     # blob id -> the entry that writes it
        for e in net.entries:
            for b in e.bottoms:
                self.readers[b] = self.readers.get(b, 0) + 1
            for t in e.tops:
                self.writer[t] = e
        # Scale entry index -> the BatchNorm entry it runs with (and that then passes through).
        self.fused = {}
        for i, e in enumerate(net.entries):
            if e.layer.type_name == "Scale" and self._after_batchnorm(e):
                self.fused[i] = self.writer[e.bottoms[0]]
        fused_norms = {id(e) for e in self.fused.values()}
        self.ops = [(lambda xs, ps: [xs[0]]) if id(e) in fused_norms
                    else self._scale_norm(e, self.fused[i]) if i in self.fused
                    else self._op(e.layer, e) for i, e in enumerate(net.entries)]
        self.label_blobs = {e.bottoms[1] for e in net.entries
                            if e.layer.type_name in ("SoftmaxWithLoss", "Accuracy")}

    # -- building ----------------------------------------------------------------
    def _after_batchnorm(self, e):
        """Whether Scale entry e is a learnt per-channel scale of a BatchNorm's output that
        nothing else reads: the pair torchvision writes as one BatchNorm2d."""
        layer = e.layer
        source = self.writer.get(e.bottoms[0])
        return (source is not None and source.layer.type_name == "BatchNorm"
                and self.readers[e.bottoms[0]] == 1 and layer.learnt and layer.axis == 1
                and len(layer.blob_shape) == 1)

    def _scale_norm(self, scale, norm):
        """A BatchNorm entry and the Scale after it as one batch_norm with weight and bias."""
        def fused(xs, ps):
            weight, bias = ps[0], ps[1] if scale.layer.bias_term else None
            stats = [self.blobs[p] for p in norm.params]
            return self._batch_norm(norm.layer, xs[0], stats, weight, bias)
        return fused

    @staticmethod
    def _batch_norm(layer, x, stats, weight=None, bias=None):
        """Caffe's BatchNorm (and the Scale after it): batch statistics, or its blobs' mean and
        variance divided by their factor (0 where the factor is 0, as Caffe)."""
        if not layer.global_stats:
            return [F.batch_norm(x, None, None, weight, bias, training=True, eps=layer.eps)]
        mean, variance, factor = stats
        scale = 0 if float(factor[0]) == 0 else 1 / float(factor[0])
        return [F.batch_norm(x, mean * scale, variance * scale, weight, bias, training=False,
                             eps=layer.eps)]

    def _op(self, layer, entry):
        """fn(bottoms, params) -> tops for one layer."""
        kind = layer.type_name
        if kind == "Split":
            return lambda xs, ps: [xs[0]] * len(layer.lp.top)
        if kind == "Convolution":
            geometry = dict(stride=(layer.stride_h, layer.stride_w),
                            padding=(layer.pad_h, layer.pad_w),
                            dilation=(layer.dil_h, layer.dil_w), groups=layer.group)
            return lambda xs, ps: [F.conv2d(x, ps[0], ps[1] if len(ps) > 1 else None, **geometry)
                                   for x in xs]
        if kind == "Pooling":
            return self._pool(layer, entry)
        if kind == "InnerProduct":
            def inner_product(xs, ps):
                x = xs[0].reshape(xs[0].shape[:layer.axis] + (-1,))
                w = ps[0].t() if layer.transpose else ps[0]
                return [F.linear(x, w, ps[1] if len(ps) > 1 else None)]
            return inner_product
        if kind == "ReLU":
            source = self.writer.get(entry.bottoms[0])
            inplace = (layer.lp.bottom[0] == layer.lp.top[0] and source is not None
                       and source.layer.type_name in KEEP_INPUTS
                       and self.readers[entry.bottoms[0]] == 1)
            if layer.slope:
                return lambda xs, ps: [F.leaky_relu(xs[0], layer.slope, inplace=inplace)]
            return lambda xs, ps: [F.relu(xs[0], inplace=inplace)]
        if kind == "BatchNorm":
            return lambda xs, ps: self._batch_norm(layer, xs[0], ps)
        if kind in ("Scale", "Bias"):
            return self._broadcast(layer)
        if kind == "Eltwise":
            return self._eltwise(layer)
        if kind == "Concat":
            return lambda xs, ps: [torch.cat(xs, dim=layer.axis)]
        if kind == "Softmax":
            return lambda xs, ps: [F.softmax(xs[0], dim=layer.axis)]
        if kind == "Reduction":
            return self._reduction(layer)
        if kind == "Sigmoid":
            return lambda xs, ps: [torch.sigmoid(xs[0])]
        if kind == "TanH":
            return lambda xs, ps: [torch.tanh(xs[0])]
        if kind == "Dropout":
            return lambda xs, ps: [F.dropout(xs[0], layer.ratio, training=layer.train)]
        if kind == "LRN":
            return self._lrn(layer)
        if kind == "SoftmaxWithLoss":
            return self._softmax_loss(layer)
        if kind == "Accuracy":
            return self._accuracy(layer)
        raise CgpError(f"layer '{layer.name}': type {kind} has no PyTorch op")  # SUPPORTED lies

    def _broadcast(self, layer):
        """Scale (y = x * s, + b with bias_term) or Bias (y = x + b): s and b broadcast
        from layer.axis, learnt or the second bottom (one per sample, from axis 0)."""
        ndim = len(layer.shape)

        def placed(blob):
            k = len(layer.blob_shape)
            return blob.reshape((1,) * layer.axis + tuple(blob.shape[:k] if k else ())
                                + (1,) * (ndim - layer.axis - k))
        scale = layer.type_name == "Scale"
        bias_term = layer.bias_term if scale else True

        def broadcast(xs, ps):
            given = xs[1] if len(xs) > 1 else None
            y = xs[0]
            if scale:
                y = y * placed(ps[0] if given is None else given)
            if bias_term:
                y = y + placed(ps[-1] if scale or given is None else given)
            return [y]
        return broadcast

    def _eltwise(self, layer):
        def eltwise(xs, ps):
            if layer.op == EltP.SUM:
                y = xs[0] * layer.coeffs[0] if layer.coeffs[0] != 1 else xs[0]
                for x, c in zip(xs[1:], layer.coeffs[1:]):
                    y = y + (x * c if c != 1 else x)
                return [y]
            y = xs[0]
            for x in xs[1:]:
                y = y * x if layer.op == EltP.PROD else torch.maximum(y, x)
            return [y]
        return eltwise

    def _reduction(self, layer):
        p = layer.lp.reduction_param

        def reduction(xs, ps):
            # (rows, values reduced per row); axis 0: the whole batch in one row
            x = xs[0].flatten(layer.axis) if layer.axis else xs[0].reshape(-1)
            if p.operation == RedP.ASUM:
                x = x.abs()
            elif p.operation == RedP.SUMSQ:
                x = x * x
            count = x.shape[-1] if p.operation == RedP.MEAN else 1
            return [x.sum(-1) * (p.coeff / count)]
        return reduction

    def _pool(self, layer, entry):
        if len(layer.lp.top) != 1:
            raise layer.error("the PyTorch comparison does not support the MAX mask top")
        if 2 * layer.pad_h > layer.R or 2 * layer.pad_w > layer.S:
            raise layer.error(f"pad {layer.pad_h}x{layer.pad_w} is more than half the kernel "
                              f"{layer.R}x{layer.S}, which PyTorch's pooling refuses")
        p = layer.lp.pooling_param
        # PyTorch's ceil_mode drops a last window that starts in the padding and divides an
        # average by the window clipped to the padded input, exactly as Caffe does. Where
        # rounding down gives the same output size the windows are the same, and a PyTorch
        # user writes the default: its max pooling ran 3x slower with ceil_mode on LeNet's
        # pool1 in channels_last (bench/torch_baseline.py, PyTorch 2.13).
        args = dict(kernel_size=(layer.R, layer.S), stride=(layer.stride_h, layer.stride_w),
                    padding=(layer.pad_h, layer.pad_w),
                    ceil_mode=p.round_mode == PP.CEIL and self._ceil_differs(layer, entry))
        if layer.max:
            return lambda xs, ps: [F.max_pool2d(xs[0], **args)]
        return lambda xs, ps: [F.avg_pool2d(xs[0], count_include_pad=True, **args)]

    def _ceil_differs(self, layer, entry):
        """Whether rounding the output size up (Caffe's) gives more outputs than down."""
        height, width = self.net.blob_shapes[entry.bottoms[0]][2:]
        return bool((height + 2 * layer.pad_h - layer.R) % layer.stride_h
                    or (width + 2 * layer.pad_w - layer.S) % layer.stride_w)

    def _lrn(self, layer):
        size, alpha, beta, k = layer.size, layer.alpha, layer.beta, layer.k
        if layer.across:
            return lambda xs, ps: [F.local_response_norm(xs[0], size, alpha, beta, k)]

        def within(xs, ps):
            # Caffe: x * (1 + alpha * (average of x^2 over a size x size window))^-beta
            x = xs[0]
            mean = F.avg_pool2d(x * x, size, stride=1, padding=(size - 1) // 2,
                                count_include_pad=True)
            return [x * (1 + alpha * mean) ** -beta]
        return within

    def _softmax_loss(self, layer):
        if len(layer.lp.top) != 1:
            raise layer.error("the PyTorch comparison does not support the probabilities top")
        ignore = layer.ignore if layer.has_ignore else -100

        def softmax_loss(xs, ps):
            scores, labels = xs[0].movedim(layer.axis, 1), xs[1]
            labels = labels.reshape(scores.shape[:1] + scores.shape[2:]).long()
            total = F.cross_entropy(scores, labels, ignore_index=ignore, reduction="sum")
            positions = labels.numel()
            mode = layer.normalization
            if mode == LossP.VALID and layer.has_ignore:
                count = float((labels != ignore).sum())
            elif mode in (LossP.VALID, LossP.FULL):
                count = positions
            elif mode == LossP.BATCH_SIZE:
                count = scores.shape[0] * layer.per_sample
            else:
                count = 1
            return [total / max(1.0, float(count))]
        return softmax_loss

    def _accuracy(self, layer):
        def accuracy(xs, ps):
            with torch.no_grad():
                scores = xs[0].movedim(layer.axis, -1).reshape(-1, xs[0].shape[layer.axis])
                labels = xs[1].reshape(-1).long()
                keep = labels != layer.ignore if layer.has_ignore else torch.ones_like(labels, dtype=bool)
                mine = scores.gather(1, labels.clamp(min=0)[:, None])
                # Caffe: correct when fewer than top_k classes score at least as high.
                better = (scores >= mine).sum(1) - 1
                hits = (better < layer.top_k) & keep
                return [hits.sum() / max(1, int(keep.sum()))]
        return accuracy

    # -- running -----------------------------------------------------------------
    def inputs(self, batch):
        """batch: source blob id -> whole-batch numpy array (from cgp's data layers) ->
        tensors: images in this net's memory format, labels as they are."""
        out = {}
        for blob, array in batch.items():
            x = torch.from_numpy(np.asarray(array, self.dtype)).to(self.device)
            if x.dim() == 4 and blob not in self.label_blobs:
                x = x.to(memory_format=self.format)   # as PyTorch's tutorial writes it
            out[blob] = x
        return out

    def forward(self, batch):
        """Returns (loss tensor, {blob id: tensor}) for one whole batch: source blob id ->
        numpy array, or the tensors that inputs() made of one."""
        made = all(torch.is_tensor(a) for a in batch.values())
        data = dict(batch) if made else self.inputs(batch)
        for entry, op in zip(self.net.entries, self.ops):
            params = [self.blobs[p] for p in entry.params]
            for blob, value in zip(entry.tops, op([data[b] for b in entry.bottoms], params)):
                data[blob] = value
        loss = None   # the sum of the weighted losses, with no op where a weight is 1
        for blob, weight in self.net.loss_weights.items():
            term = data[blob] if weight == 1 else weight * data[blob]
            loss = term if loss is None else loss + term
        return loss, data

    def flat_grad(self):
        """The parameter gradients in cgp's flat layout (zeros where none was computed)."""
        grad = np.zeros(self.net.n_params, np.float32)
        for b, p in zip(self.net.param_blobs, self.blobs):
            if p.grad is not None:
                grad[b.offset:b.offset + b.size] = (p.grad.detach().contiguous().cpu().numpy()
                                                    .reshape(-1))
        return grad


class TorchTrainer:
    """Caffe's SGD training step in PyTorch: forward, backward, momentum SGD with weight
    decay (lr * lr_mult, weight_decay * decay_mult per blob) at the solver's base_lr. For a
    constant rate PyTorch's momentum form equals Caffe's; the rate schedule is left out, as
    it changes no amount of work."""

    def __init__(self, net, sp, layout="channels_last", device="cpu"):
        self.model = TorchNet(net, layout=layout, device=device)
        self.model.train()
        groups = {}
        for b, p in zip(net.param_blobs, self.model.blobs):
            if p.requires_grad:
                groups.setdefault((b.lr_mult, b.decay_mult), []).append(p)
        self.optimizer = torch.optim.SGD(
            [dict(params=ps, lr=sp.base_lr * lr, weight_decay=sp.weight_decay * decay)
             for (lr, decay), ps in groups.items()],
            lr=sp.base_lr, momentum=sp.momentum)

    def save(self):
        """A copy of the weights and momenta, for restore()."""
        with torch.no_grad():
            return [(p.detach().clone(), self._momentum(p)) for p in self.model.blobs]

    def restore(self, saved):
        with torch.no_grad():
            for p, (value, momentum) in zip(self.model.blobs, saved):
                p.copy_(value)
                state = self.optimizer.state.get(p)
                if state is not None and momentum is not None:
                    state["momentum_buffer"] = momentum.clone()
                elif state is not None:
                    state.pop("momentum_buffer", None)

    def _momentum(self, p):
        buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")
        return None if buffer is None else buffer.clone()

    def step(self, batch):
        """One training iteration on a whole batch (source blob id -> numpy array, or the
        tensors of TorchNet.inputs); returns the loss."""
        self.optimizer.zero_grad()   # PyTorch's default: the gradients set to None
        loss, _ = self.model(batch)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def version():
    return torch.__version__


def deterministic(on):
    """PyTorch's deterministic mode (torch.use_deterministic_algorithms), as a user who needs
    repeatable runs sets it; on a GPU, cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before CUDA
    starts (cmd_speedup sets it)."""
    torch.use_deterministic_algorithms(on)


def synchronize(device):
    """Waits for the device's queued work: a timing must end once it is done."""
    if device == "cuda":
        torch.cuda.synchronize()


def set_threads(n):
    torch.set_num_threads(n)


def flush_denormal(on):
    """PyTorch's own switch for flushing subnormal floats to zero (FTZ and DAZ), as a PyTorch
    user sets it."""
    torch.set_flush_denormal(on)
