"""`cgp export`: a net's TEST phase with its weights as an ONNX graph (opsets 13 to 17), for
the tools that deploy nets. Needs the `onnx` package (the `onnx` extra).

The graph is the net without its data, loss and accuracy layers: its inputs are the data
layers' tops that the remaining layers read (the batch axis named "N"), its outputs the blobs
no remaining layer reads. Caffe's semantics where ONNX's differ are spelled out: pooling pads
explicitly and never lets a window start past Caffe's last one, AVE pooling divides by
Caffe's clipped window, WITHIN_CHANNEL LRN is composed from pooling and powers, BatchNorm
divides its statistics by their scale factor, ArgMax breaks ties towards the larger index,
MVN and Reduction are composed from ONNX's reductions. A layer with no conversion is named in
one error with every other such layer. Not here: training graphs.
"""
import tempfile
from pathlib import Path

import numpy as np

from cgp.errors import CgpError, require
from cgp.proto import caffe_pb2

OPSET = 13
HIGHEST = 17          # opset 18 moves the reductions' axes to an input
ONE_FILE = 2**31 - 1   # bytes: protobuf's limit on one message, so on one .onnx file
LOWEST = float(np.finfo(np.float32).min)   # MAX pooling's padding: never the maximum


def require_onnx():
    return require("onnx", "onnx", "cgp export")


def cmd_export(args, log=print):
    shape = None
    if args.input_shape:
        try:
            shape = tuple(int(d) for d in args.input_shape.split(","))
        except ValueError:
            raise CgpError(f"--input-shape wants comma-separated integers, e.g. 64,1,28,28; "
                           f"got {args.input_shape!r}") from None
    net = load_net(args.model, args.weights, shape, args.data_dir, not args.no_download)
    model = export(net, args.onnx, args.opset)
    graph = model.graph
    log(f"cgp export: {args.onnx}: opset {args.opset}, {len(graph.node)} nodes, inputs "
        f"{', '.join(i.name for i in graph.input)}, outputs "
        f"{', '.join(o.name for o in graph.output)}; onnx.checker accepts it")
    try:
        import onnxruntime  # noqa: F401  (only whether it is there)
    except ImportError:
        log("cgp export: onnxruntime is not installed: the graph was not run")
        return 0
    error = verify(args.onnx, net)
    log(f"cgp export: ONNX Runtime against cgp's forward on random input, every blob: largest "
        f"difference {error:.3g} of the blob's scale")
    return 0


def load_net(model, weights=None, input_shape=None, data_dir=None, download=True):
    """A pycaffe Net of the model's TEST phase with the weights; input_shape replaces the
    Data layers by Input layers of that shape (their second top, labels, (N,))."""
    from cgp.prototxt import format_message, read_model
    from cgp.caffe.pycaffe import TEST, Net

    if input_shape is None:
        return Net(model, TEST, weights=weights, data_dir=data_dir, download=download)
    param = read_model(model)
    for lp in param.layer:
        if lp.type == "Data":
            lp.type = "Input"
            lp.ClearField("data_param")
            lp.ClearField("transform_param")
            lp.input_param.shape.add().dim.extend(input_shape)
            for _ in lp.top[1:]:
                lp.input_param.shape.add().dim.append(input_shape[0])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / Path(model).name
        path.write_text(format_message(param))
        return Net(str(path), TEST, weights=weights, data_dir=data_dir, download=download)


class Graph:
    """The ONNX nodes, initializers and value names being built from one net."""

    def __init__(self, onnx, net):
        self.onnx, self.net = onnx, net
        self.nodes, self.initializers = [], []
        self.reads = set()      # values a layer reads for their shape only (Crop, Silence)
        self._count = 0

    def fresh(self, base):
        self._count += 1
        return f"{base}/{self._count}"

    def constant(self, base, array):
        name = self.fresh(base)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def scalar(self, base, value):
        return self.constant(base, np.array(value, np.float32))

    def ints(self, base, values):
        return self.constant(base, np.array(values, np.int64))

    def node(self, op, inputs, outputs, **attrs):
        self.nodes.append(self.onnx.helper.make_node(op, inputs, outputs, **attrs))

    def op(self, op, inputs, base, out=None, **attrs):
        """One node of one output, named `out` or a fresh name from base; returns the name."""
        out = out or self.fresh(base)
        self.node(op, inputs, [out], **attrs)
        return out


def export(pynet, path, opset=OPSET):
    """Writes the ONNX graph of a pycaffe Net (cgp.caffe.pycaffe.Net) to path; returns the model,
    which onnx.checker has accepted. Values are named as the blobs in the prototxt: the last
    layer to write a name (an in-place chain's last) gives it, the ones before write
    <name>/<layer>."""
    onnx = require_onnx()
    from cgp.snapshot import writable_folder

    if not OPSET <= opset <= HIGHEST:
        raise CgpError(f"--opset {opset}: cgp writes opsets {OPSET} to {HIGHEST}")
    net = pynet._net
    g = Graph(onnx, net)
    params = net.param_views(net.params)
    kept = [i for i, e in enumerate(net.entries) if not e.layer.reduces_batch]
    origin = split_origins(net)
    read = {origin.get(b, b) for i in kept for b in net.entries[i].bottoms
            if net.entries[i].layer.type_name != "Split"}
    last = {}
    for e in net.sources + net.entries:
        last.update((name, id(e)) for name in e.layer.lp.top)

    def top_name(e, j):
        name = e.layer.lp.top[j]
        return name if last[name] == id(e) else f"{name}/{e.layer.name}"

    current = {}            # blob id -> the ONNX name of its latest value
    inputs = []
    for e in net.sources:
        for j, t in enumerate(e.tops):
            current[t] = top_name(e, j)
            inputs.append((current[t], t))
    # The batch values (losses, accuracies, a Reduction over axis 0) are left out: a layer
    # that reads one cannot be exported.
    batch_values = {t: e for e in net.entries if e.layer.reduces_batch for t in e.tops}
    problems, made = [], []
    for i in kept:
        e = net.entries[i]
        missing = [b for b in e.bottoms if b not in current]
        if e.layer.type_name == "Split" and missing:
            continue                        # its readers are named below
        if missing:
            src = batch_values[origin.get(missing[0], missing[0])].layer
            problems.append(f"layer '{e.layer.name}' (type {e.layer.type_name}): reads "
                            f"'{net.blob_names[missing[0]]}', a batch value of layer "
                            f"'{src.name}' (type {src.type_name}), which the graph leaves "
                            "out with the losses (ONNX values are per sample here)")
            continue
        bottoms = [current[b] for b in e.bottoms]
        if e.layer.type_name == "Split":   # ONNX values take any number of readers
            current.update((t, bottoms[0]) for t in e.tops)
            continue
        tops = [top_name(e, j) for j in range(len(e.tops))]
        current.update(zip(e.tops, tops))
        made += zip(tops, e.tops)
        convert = CONVERTERS.get(e.layer.type_name)
        if convert is None:
            problems.append(f"layer '{e.layer.name}' (type {e.layer.type_name}): no ONNX "
                            f"conversion (converted: {', '.join(sorted(CONVERTERS))})")
            continue
        try:
            convert(g, e, bottoms, tops, [np.asarray(p, np.float32) for p in params[i]], read)
        except CgpError as error:
            problems.append(str(error))
    if problems:
        raise CgpError(f"{pynet._model}: cannot export net '{net.name}' to ONNX: "
                       + "; ".join(problems))
    consumed = {x for node in g.nodes for x in node.input}
    produced = {x for node in g.nodes for x in node.output}
    outputs = [(name, t) for name, t in made
               if name in produced and name not in consumed | g.reads]
    g.nodes = live_nodes(g.nodes, {name for name, _ in outputs})
    consumed = {x for node in g.nodes for x in node.input}
    inputs = [(name, t) for name, t in inputs if name in consumed]
    g.initializers = [t for t in g.initializers if t.name in consumed]
    if not outputs:
        raise CgpError(f"{pynet._model}: net '{net.name}': nothing left to export once the "
                       "data, loss and accuracy layers are left out")

    def info(name, blob):
        shape = ["N"] + list(net.blob_shapes[blob][1:])
        return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)

    graph = onnx.helper.make_graph(g.nodes, net.name or "net", [info(*x) for x in inputs],
                                   [info(*x) for x in outputs], g.initializers)
    model = onnx.helper.make_model(graph, producer_name="cgp",
                                   opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset == OPSET else onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid("", opset)])
    size = model.ByteSize()
    if size > ONE_FILE:
        raise CgpError(f"{pynet._model}: net '{net.name}': the graph with its weights takes "
                       f"{size / 2**30:.2f} GiB, over the 2 GiB that one ONNX file (one "
                       "protobuf message) holds; cgp does not write ONNX's external data files")
    data = model.SerializeToString()    # once, for the checker and the file
    try:
        onnx.checker.check_model(data, full_check=True)
    except onnx.checker.ValidationError as e:
        raise CgpError(f"{pynet._model}: net '{net.name}': the ONNX graph does not check: "
                       f"{e}") from None
    path = writable_folder(path)
    try:
        path.write_bytes(data)
    except OSError as e:
        raise CgpError(f"cannot write {path}: {e.strerror or e}") from None
    return model


def split_origins(net):
    """{a Split's top: the blob it copies}, through chains of Splits."""
    origin = {}
    for e in net.entries:
        if e.layer.type_name == "Split":
            origin.update((t, origin.get(e.bottoms[0], e.bottoms[0])) for t in e.tops)
    return origin


def live_nodes(nodes, outputs):
    """The nodes that the graph's outputs need (a Crop's reference or a Silence's bottoms
    may leave others computing what nothing reads), in their order."""
    needed, live = set(outputs), []
    for node in reversed(nodes):
        if needed & set(node.output):
            live.append(node)
            needed.update(node.input)
    return live[::-1]


def random_feed(pynet, names, rng):
    """{input name: random array}: standard normal, except where an Embed layer reads the
    input: row indices of its table."""
    net = pynet._net
    origin = split_origins(net)
    rows = {}               # blob id -> the smallest table that reads it
    for e in net.entries:
        if e.layer.type_name == "Embed":
            b = origin.get(e.bottoms[0], e.bottoms[0])
            rows[b] = min(rows.get(b, e.layer.V), e.layer.V)
    ids = {name: t for e in net.sources for name, t in zip(e.layer.lp.top, e.tops)}
    feed = {}
    for name in names:
        shape = pynet.blobs[name].data.shape
        if ids.get(name) in rows:
            feed[name] = rng.integers(0, rows[ids[name]], shape).astype(np.float32)
        else:
            feed[name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def blob_errors(path, pynet, seed=0):
    """Runs the ONNX graph at path in ONNX Runtime and pynet's forward on the same random input
    (random_feed); returns {blob: largest |ONNX Runtime - cgp| / max(1, largest |cgp|)} for
    every blob that the graph names as the prototxt does (each layer's top, not only the
    outputs: a saturated Softmax hides what its logits show). NaN in both counts as equal; a
    NaN in one, or another shape, as inf."""
    import onnx
    import onnxruntime

    model = onnx.load(str(path))
    outputs = {o.name for o in model.graph.output}
    blobs = [x for node in model.graph.node for x in node.output
             if x in pynet.blobs and x not in outputs]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT,
                                                                 None) for x in blobs)
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    feed = random_feed(pynet, [i.name for i in session.get_inputs()],
                       np.random.default_rng(seed))
    pynet.forward(**feed)
    errors = {}
    for o, got in zip(session.get_outputs(), session.run(None, feed)):
        want = pynet.blobs[o.name].data
        if got.shape != want.shape:
            errors[o.name] = float("inf")
            continue
        both = np.isnan(got) & np.isnan(want)
        diff = np.where(both, 0, np.abs(got - want))
        rest = want[~both]
        scale = max(1.0, float(np.abs(rest).max()) if rest.size else 0.0)
        errors[o.name] = float("inf") if np.isnan(diff).any() else float(diff.max()) / scale
    return errors


def verify(path, pynet, seed=0):
    """The largest of blob_errors: 0 for a graph that computes what cgp does."""
    return max(blob_errors(path, pynet, seed).values())


# -- one converter per layer type -------------------------------------------------------
# convert(g, entry, bottoms, tops, params, read): bottoms and tops are ONNX value names,
# params the layer's weights (float32 copies), read the cgp blobs some exported layer reads.

def _convolution(g, e, bottoms, tops, params, op):
    """A Conv or ConvTranspose node per bottom, sharing the layer's weight and bias."""
    layer = e.layer
    weight = g.constant(f"{layer.name}/weight", params[0])
    inputs = [weight] + ([g.constant(f"{layer.name}/bias", params[1])] if layer.bias_term else [])
    for x, y in zip(bottoms, tops):
        g.node(op, [x] + inputs, [y], kernel_shape=[layer.R, layer.S],
               pads=[layer.pad_h, layer.pad_w, layer.pad_h, layer.pad_w],
               strides=[layer.stride_h, layer.stride_w],
               dilations=[layer.dil_h, layer.dil_w], group=layer.group)


def conv(g, e, bottoms, tops, params, read):
    _convolution(g, e, bottoms, tops, params, "Conv")


def deconv(g, e, bottoms, tops, params, read):
    """ConvTranspose: Caffe's output size, stride * (H - 1) + dilated kernel - 2 * pad, is
    ONNX's with no output_padding."""
    _convolution(g, e, bottoms, tops, params, "ConvTranspose")


def caffe_pool_count(size, pad, kernel, stride, out):
    """Per output position, the cells Caffe's AVE pooling divides by along one axis: the
    window clipped to the padded input's end (not to its start)."""
    starts = np.arange(out) * stride - pad
    return np.minimum(starts + kernel, size + pad) - starts


def pool(g, e, bottoms, tops, params, read):
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


def inner_product(g, e, bottoms, tops, params, read):
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


def relu(g, e, bottoms, tops, params, read):
    if e.layer.slope == 0:
        g.node("Relu", bottoms, tops)
    else:
        g.node("LeakyRelu", bottoms, tops, alpha=e.layer.slope)


def lrn(g, e, bottoms, tops, params, read):
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


def softmax(g, e, bottoms, tops, params, read):
    g.node("Softmax", bottoms, tops, axis=e.layer.axis)


def concat(g, e, bottoms, tops, params, read):
    g.node("Concat", bottoms, tops, axis=e.layer.axis)


def eltwise(g, e, bottoms, tops, params, read):
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


def reshape(g, e, bottoms, tops, params, read):
    """Flatten and Reshape: the top's shape, its batch axis copied (0)."""
    shape = [0] + list(g.net.blob_shapes[e.tops[0]][1:])
    g.node("Reshape", [bottoms[0], g.constant(f"{e.layer.name}/shape",
                                              np.array(shape, np.int64))], tops)


def identity(g, e, bottoms, tops, params, read):
    """Dropout at test time, Caffe's identity."""
    g.node("Identity", bottoms, tops)


def unary(op):
    def convert(g, e, bottoms, tops, params, read):
        g.node(op, bottoms, tops)
    return convert


def batch_norm(g, e, bottoms, tops, params, read):
    """Global statistics (TEST's default): BatchNormalization with Caffe's blobs divided by
    their scale factor (0 where the factor is 0, as Caffe's). Batch statistics
    (use_global_stats: false): the batch's mean and biased variance per channel, composed."""
    layer, x = e.layer, bottoms[0]
    name, f = layer.name, np.float32
    C, ndim = layer.C, len(layer.shape)
    if layer.global_stats:
        mean_blob, variance_blob, factor = params
        scale = f(0) if factor[0] == 0 else f(1) / factor[0]
        g.node("BatchNormalization", [x, g.constant(f"{name}/ones", np.ones(C, f)),
                                      g.constant(f"{name}/zeros", np.zeros(C, f)),
                                      g.constant(f"{name}/mean", scale * mean_blob),
                                      g.constant(f"{name}/variance", scale * variance_blob)],
               tops, epsilon=layer.eps)
        return
    axes = [0] + list(range(2, ndim))
    mean = g.op("ReduceMean", [x], f"{name}/mean", axes=axes, keepdims=1)
    centred = g.op("Sub", [x, mean], f"{name}/centred")
    square = g.op("Mul", [centred, centred], f"{name}/square")
    variance = g.op("ReduceMean", [square], f"{name}/variance", axes=axes, keepdims=1)
    shifted = g.op("Add", [variance, g.scalar(f"{name}/eps", layer.eps)], f"{name}/shifted")
    std = g.op("Sqrt", [shifted], f"{name}/std")
    g.node("Div", [centred, std], tops)


def broadcast(g, e, array, base):
    """A Scale's or Bias's learnt blob shaped to broadcast from the layer's axis."""
    layer = e.layer
    trailing = len(layer.shape) - layer.axis - len(layer.blob_shape)
    return g.constant(base, array.reshape(layer.blob_shape + (1,) * trailing))


def given_blob(g, e, x):
    """A Scale's or Bias's second bottom, (N, ...), with axes of 1 after its own."""
    layer = e.layer
    k, ndim = len(layer.blob_shape), len(layer.shape)
    if k == ndim:
        return x
    return g.op("Unsqueeze", [x, g.ints(f"{layer.name}/axes", list(range(k, ndim)))],
                f"{layer.name}/factors")


def scale(g, e, bottoms, tops, params, read):
    """y = x * s (+ b with bias_term), s the learnt blob or the second bottom."""
    layer, name = e.layer, e.layer.name
    s = (broadcast(g, e, params[0], f"{name}/scale") if layer.learnt
         else given_blob(g, e, bottoms[1]))
    if not layer.bias_term:
        g.node("Mul", [bottoms[0], s], tops)
        return
    product = g.op("Mul", [bottoms[0], s], f"{name}/product")
    g.node("Add", [product, broadcast(g, e, params[-1], f"{name}/bias")], tops)


def bias(g, e, bottoms, tops, params, read):
    layer = e.layer
    b = (broadcast(g, e, params[0], f"{layer.name}/bias") if layer.learnt
         else given_blob(g, e, bottoms[1]))
    g.node("Add", [bottoms[0], b], tops)


def prelu(g, e, bottoms, tops, params, read):
    layer = e.layer
    slope = params[0] if layer.shared else params[0].reshape(
        (layer.shape[1],) + (1,) * (len(layer.shape) - 2))
    g.node("PRelu", [bottoms[0], g.constant(f"{layer.name}/slope", slope)], tops)


def elu(g, e, bottoms, tops, params, read):
    g.node("Elu", bottoms, tops, alpha=e.layer.lp.elu_param.alpha)


def power(g, e, bottoms, tops, params, read):
    """y = (shift + scale * x) ^ power, each step only where it changes x; where power *
    scale is 0, Caffe's constant (1 for power 0, else shift ^ power) of x's shape."""
    layer, x = e.layer, bottoms[0]
    name = layer.name
    p, scale, shift = layer.forward_args(np.float32)
    if p * scale == 0:
        value = np.float32(1) if p == 0 else np.float32(shift ** p)
        shape = g.op("Shape", [x], f"{name}/shape")
        g.node("ConstantOfShape", [shape], tops, value=g.onnx.numpy_helper.from_array(
            np.array([value], np.float32)))
        return
    steps = [("Mul", scale, scale != 1), ("Add", shift, shift != 0), ("Pow", p, p != 1)]
    chain(g, name, x, [(op, value) for op, value, needed in steps if needed], tops[0])


def chain(g, base, x, steps, top):
    """x through [(binary op, float32 constant)] in order, the last step writing top."""
    if not steps:
        g.node("Identity", [x], [top])
        return
    for k, (op, value) in enumerate(steps):
        out = top if k == len(steps) - 1 else None
        x = g.op(op, [x, g.scalar(f"{base}/{op.lower()}", value)], f"{base}/{op.lower()}", out)


def _then_scaled(g, op, x, factor_name, factor, tops, name):
    """tops = op(x) * factor, with no Mul where the factor is 1."""
    if factor == 1:
        g.node(op, [x], tops)
        return
    x = g.op(op, [x], f"{name}/{op.lower()}")
    g.node("Mul", [x, g.scalar(f"{name}/{factor_name}", factor)], tops)


def exp(g, e, bottoms, tops, params, read):
    """y = outer * exp(inner * x), inner = log(base) * scale and outer = base ^ shift, as
    cgp's Exp takes them."""
    name = e.layer.name
    inner, outer = e.layer.forward_args(np.float32)
    x = bottoms[0]
    if inner != 1:
        x = g.op("Mul", [x, g.scalar(f"{name}/inner", inner)], f"{name}/inner")
    _then_scaled(g, "Exp", x, "outer", outer, tops, name)


def log(g, e, bottoms, tops, params, read):
    """y = log(scale * x + shift) / log(base), as cgp's Log takes them."""
    name = e.layer.name
    scale, shift, base_scale = e.layer.forward_args(np.float32)
    x = bottoms[0]
    steps = [("Mul", scale, scale != 1), ("Add", shift, shift != 0)]
    for op, value, needed in steps:
        if needed:
            x = g.op(op, [x, g.scalar(f"{name}/{op.lower()}", value)], f"{name}/{op.lower()}")
    _then_scaled(g, "Log", x, "base_scale", base_scale, tops, name)


def threshold(g, e, bottoms, tops, params, read):
    """y = 1 where x > threshold, else 0 (NaN too)."""
    name = e.layer.name
    above = g.op("Greater", [bottoms[0], g.scalar(f"{name}/threshold",
                                                  e.layer.lp.threshold_param.threshold)],
                 f"{name}/above")
    g.node("Cast", [above], tops, to=g.onnx.TensorProto.FLOAT)


def clip(g, e, bottoms, tops, params, read):
    p, name = e.layer.lp.clip_param, e.layer.name
    g.node("Clip", [bottoms[0], g.scalar(f"{name}/min", p.min), g.scalar(f"{name}/max", p.max)],
           tops)


def swish(g, e, bottoms, tops, params, read):
    """y = x * sigmoid(beta * x)."""
    name, x = e.layer.name, bottoms[0]
    beta = np.float32(e.layer.lp.swish_param.beta)
    scaled = x if beta == 1 else g.op("Mul", [x, g.scalar(f"{name}/beta", beta)],
                                      f"{name}/scaled")
    gate = g.op("Sigmoid", [scaled], f"{name}/gate")
    g.node("Mul", [x, gate], tops)


def slice_(g, e, bottoms, tops, params, read):
    layer = e.layer
    g.node("Split", [bottoms[0], g.ints(f"{layer.name}/sizes", layer.sizes)], tops,
           axis=layer.axis)


def crop(g, e, bottoms, tops, params, read):
    """Bottom 0's window of bottom 1's shape; bottom 1 gives its shape only (and the batch
    axis, whose offset is 0, stays whole)."""
    layer = e.layer
    g.reads.add(bottoms[1])
    axes = [i for i in range(1, len(layer.big)) if layer.small[i] != layer.big[i]]
    if not axes:
        g.node("Identity", [bottoms[0]], tops)
        return
    starts = [layer.offsets[i] for i in axes]
    ends = [layer.offsets[i] + layer.small[i] for i in axes]
    g.node("Slice", [bottoms[0], g.ints(f"{layer.name}/starts", starts),
                     g.ints(f"{layer.name}/ends", ends), g.ints(f"{layer.name}/axes", axes)],
           tops)


def silence(g, e, bottoms, tops, params, read):
    """No value: its bottoms are no outputs (and what only they needed is left out)."""
    g.reads.update(bottoms)


def tile(g, e, bottoms, tops, params, read):
    layer = e.layer
    repeats = [1] * len(g.net.blob_shapes[e.bottoms[0]])
    repeats[layer.axis] = layer.tiles
    g.node("Tile", [bottoms[0], g.ints(f"{layer.name}/repeats", repeats)], tops)


def reduction(g, e, bottoms, tops, params, read):
    """Axes from reduction_param.axis (> 0: axis 0's batch value is left out as a loss is)
    summed, as magnitudes (ASUM) or squares (SUMSQ), times Caffe's coeff (for MEAN divided
    by the count)."""
    from cgp.kernels import reduction as K

    layer, name = e.layer, e.layer.name
    axes = list(range(layer.axis, len(g.net.blob_shapes[e.bottoms[0]])))
    coeff = layer._coeff(np.float32, 1)
    if layer.op in (K.SUM, K.MEAN):
        total = g.op("ReduceSum", [bottoms[0], g.ints(f"{name}/axes", axes)], f"{name}/total",
                     keepdims=0)
    else:
        op = "ReduceL1" if layer.op == K.ASUM else "ReduceSumSquare"
        total = g.op(op, [bottoms[0]], f"{name}/total", axes=axes, keepdims=0)
    chain(g, name, total, [("Mul", coeff)] if coeff != 1 else [], tops[0])


def argmax(g, e, bottoms, tops, params, read):
    """TopK on the axis reversed, so that a tie goes to the larger index as in Caffe (TopK
    gives it to the smaller); indices as floats, after the values' rows with out_max_val and
    no axis."""
    layer, name, x = e.layer, e.layer.name, bottoms[0]
    p = layer.lp.argmax_param
    shape = g.net.blob_shapes[e.bottoms[0]]
    if p.HasField("axis"):
        axis = p.axis % len(shape)
        size = shape[axis]
    else:
        axis, size = 1, int(np.prod(shape[1:]))
        x = g.op("Flatten", [x], f"{name}/rows", axis=1)
    flipped = g.op("Slice", [x, g.ints(f"{name}/start", [-1]),
                             g.ints(f"{name}/end", [np.iinfo(np.int64).min]),
                             g.ints(f"{name}/axis", [axis]), g.ints(f"{name}/step", [-1])],
                   f"{name}/flipped")
    values, flipped_at = g.fresh(f"{name}/values"), g.fresh(f"{name}/at")
    g.node("TopK", [flipped, g.ints(f"{name}/k", [layer.K])], [values, flipped_at], axis=axis)
    at = g.op("Sub", [g.ints(f"{name}/last", size - 1), flipped_at], f"{name}/index")
    if p.HasField("axis") and p.out_max_val:
        g.node("Identity", [values], tops)
        return
    indices = g.op("Cast", [at], f"{name}/indices", to=g.onnx.TensorProto.FLOAT)
    if p.HasField("axis"):
        g.node("Identity", [indices], tops)
        return
    rows = g.op("Concat", [indices, values], f"{name}/rows", axis=1) if p.out_max_val else indices
    top_shape = [0] + list(g.net.blob_shapes[e.tops[0]][1:])
    g.node("Reshape", [rows, g.ints(f"{name}/shape", top_shape)], tops)


def mvn(g, e, bottoms, tops, params, read):
    """Per row (a sample's channel, or with across_channels the sample): y = x - mean, and
    with normalize_variance y / (sqrt(mean of y^2) + eps), Caffe's eps on the deviation."""
    layer, name = e.layer, e.layer.name
    shape = g.net.blob_shapes[e.bottoms[0]]
    rows = g.op("Reshape", [bottoms[0], g.ints(f"{name}/rows_shape", [0, layer.rows, layer.dim])],
                f"{name}/rows")
    mean = g.op("ReduceMean", [rows], f"{name}/mean", axes=[2], keepdims=1)
    y = g.op("Sub", [rows, mean], f"{name}/centred")
    if layer.normalize:
        square = g.op("Mul", [y, y], f"{name}/square")
        variance = g.op("ReduceMean", [square], f"{name}/variance", axes=[2], keepdims=1)
        std = g.op("Sqrt", [variance], f"{name}/std")
        shifted = g.op("Add", [std, g.scalar(f"{name}/eps", layer.lp.mvn_param.eps)],
                       f"{name}/shifted")
        y = g.op("Div", [y, shifted], f"{name}/normalized")
    g.node("Reshape", [y, g.ints(f"{name}/shape", [0] + list(shape[1:]))], tops)


def embed(g, e, bottoms, tops, params, read):
    """Row lookup: Gather of the table at the indices (floats holding integers)."""
    layer, name = e.layer, e.layer.name
    indices = g.op("Cast", [bottoms[0]], f"{name}/indices", to=g.onnx.TensorProto.INT64)
    table = g.constant(f"{name}/weight", params[0])
    if not layer.bias_term:
        g.node("Gather", [table, indices], tops, axis=0)
        return
    rows = g.op("Gather", [table, indices], f"{name}/rows", axis=0)
    g.node("Add", [rows, g.constant(f"{name}/bias", params[1])], tops)


CONVERTERS = {
    "Convolution": conv, "Deconvolution": deconv, "Pooling": pool,
    "InnerProduct": inner_product, "Embed": embed, "LRN": lrn, "BatchNorm": batch_norm,
    "Scale": scale, "Bias": bias, "MVN": mvn, "Softmax": softmax,
    "ReLU": relu, "PReLU": prelu, "ELU": elu, "Sigmoid": unary("Sigmoid"),
    "TanH": unary("Tanh"), "AbsVal": unary("Abs"), "BNLL": unary("Softplus"), "Power": power,
    "Exp": exp, "Log": log, "Threshold": threshold, "Clip": clip, "Swish": swish,
    "Dropout": identity, "Concat": concat, "Slice": slice_, "Eltwise": eltwise,
    "Flatten": reshape, "Reshape": reshape, "Crop": crop, "Tile": tile, "Silence": silence,
    "Reduction": reduction, "ArgMax": argmax,
}
