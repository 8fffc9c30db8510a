"""`cgp export`: a net's TEST phase with its weights as an ONNX graph (opset 13 or later),
for the tools that deploy nets. Needs the `onnx` package (the `onnx` extra).

The graph is the net without its data, loss and accuracy layers: its inputs are the data
layers' tops that the remaining layers read (the batch axis named "N"), its outputs the blobs
no remaining layer reads. Caffe's semantics where ONNX's differ are spelled out: pooling pads
explicitly and never lets a window start past Caffe's last one, AVE pooling divides by
Caffe's clipped window, WITHIN_CHANNEL LRN is composed from pooling and powers. A layer with
no conversion is named in one error with every other such layer. Not here: training graphs.
"""
import tempfile
from pathlib import Path

import numpy as np

from cgp.errors import CgpError
from cgp.proto import caffe_pb2

OPSET = 13
LOWEST = float(np.finfo(np.float32).min)   # MAX pooling's padding: never the maximum


def require_onnx():
    try:
        import onnx
    except ImportError:
        raise CgpError("cgp export needs the onnx package: pip install 'cgp[onnx]' (or pip "
                       "install onnx)") from None
    return onnx


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
    log(f"cgp export: ONNX Runtime's outputs against cgp's forward on random input: largest "
        f"difference {error:.3g} of the output's scale")
    return 0


def load_net(model, weights=None, input_shape=None, data_dir=None, download=True):
    """A pycaffe Net of the model's TEST phase with the weights; input_shape replaces the
    Data layers by Input layers of that shape (their second top, labels, (N,))."""
    from cgp.prototxt import format_message, read_model
    from cgp.pycaffe import TEST, Net

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
        self._count = 0

    def fresh(self, base):
        self._count += 1
        return f"{base}/{self._count}"

    def constant(self, base, array):
        name = self.fresh(base)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op, inputs, outputs, **attrs):
        self.nodes.append(self.onnx.helper.make_node(op, inputs, outputs, **attrs))


def export(pynet, path, opset=OPSET):
    """Writes the ONNX graph of a pycaffe Net (cgp.pycaffe.Net) to path; returns the model,
    which onnx.checker has accepted. Values are named as the blobs in the prototxt: the last
    layer to write a name (an in-place chain's last) gives it, the ones before write
    <name>/<layer>."""
    onnx = require_onnx()
    from cgp.snapshot import writable_folder

    if opset < OPSET:
        raise CgpError(f"--opset {opset}: cgp writes opset {OPSET} or later")
    net = pynet._net
    g = Graph(onnx, net)
    params = net.param_views(net.params)
    kept = [i for i, e in enumerate(net.entries) if not e.layer.reduces_batch]
    origin = {}             # a Split's top -> the blob it copies
    for e in net.entries:
        if e.layer.type_name == "Split":
            origin.update((t, origin.get(e.bottoms[0], e.bottoms[0])) for t in e.tops)
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
    problems, made = [], []
    for i in kept:
        e = net.entries[i]
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
            convert(g, e, bottoms, tops, [np.array(p, np.float32) for p in params[i]], read)
        except CgpError as error:
            problems.append(str(error))
    if problems:
        raise CgpError(f"cannot export net '{net.name}' to ONNX: " + "; ".join(problems))
    consumed = {x for node in g.nodes for x in node.input}
    produced = {x for node in g.nodes for x in node.output}
    inputs = [(name, t) for name, t in inputs if name in consumed]
    outputs = [(name, t) for name, t in made if name in produced and name not in consumed]
    if not outputs:
        raise CgpError(f"net '{net.name}': nothing left to export once the data, loss and "
                       "accuracy layers are left out")

    def info(name, blob):
        shape = ["N"] + list(net.blob_shapes[blob][1:])
        return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)

    graph = onnx.helper.make_graph(g.nodes, net.name or "net", [info(*x) for x in inputs],
                                   [info(*x) for x in outputs], g.initializers)
    model = onnx.helper.make_model(graph, producer_name="cgp",
                                   opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset == OPSET else onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid("", opset)])
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise CgpError(f"net '{net.name}': the ONNX graph does not check: {e}") from None
    path = writable_folder(path)
    onnx.save(model, str(path))
    return model


def verify(path, pynet, seed=0):
    """Runs the ONNX graph in ONNX Runtime and pynet's forward on the same random input
    (standard normal; labels, if read, random classes); returns the largest absolute
    difference over the outputs, divided by max(1, the output's largest magnitude)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feed = {}
    for i in session.get_inputs():
        shape = pynet.blobs[i.name].data.shape
        feed[i.name] = rng.standard_normal(shape).astype(np.float32)
    pynet.forward(**feed)
    error = 0.0
    for o, got in zip(session.get_outputs(), session.run(None, feed)):
        want = pynet.blobs[o.name].data
        scale = max(1.0, float(np.abs(want).max()))
        error = max(error, float(np.abs(got - want).max()) / scale)
    return error


# -- one converter per layer type -------------------------------------------------------
# convert(g, entry, bottoms, tops, params, read): bottoms and tops are ONNX value names,
# params the layer's weights (float32 copies), read the cgp blobs some exported layer reads.

def conv(g, e, bottoms, tops, params, read):
    layer = e.layer
    weight = g.constant(f"{layer.name}/weight", params[0])
    inputs = [weight] + ([g.constant(f"{layer.name}/bias", params[1])] if layer.bias_term else [])
    for x, y in zip(bottoms, tops):
        g.node("Conv", [x] + inputs, [y], kernel_shape=[layer.R, layer.S],
               pads=[layer.pad_h, layer.pad_w, layer.pad_h, layer.pad_w],
               strides=[layer.stride_h, layer.stride_w],
               dilations=[layer.dil_h, layer.dil_w], group=layer.group)


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
    R, S, sh, sw, ph, pw = layer.R, layer.S, layer.stride_h, layer.stride_w, layer.pad_h, layer.pad_w
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
        inputs = [flat, g.constant(f"{layer.name}/weight", np.ascontiguousarray(weight))]
        if layer.bias_term:
            inputs.append(g.constant(f"{layer.name}/bias", params[1]))
        g.node("Gemm", inputs, [tops[0]])
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


CONVERTERS = {
    "Convolution": conv, "Pooling": pool, "InnerProduct": inner_product, "ReLU": relu,
    "Sigmoid": unary("Sigmoid"), "TanH": unary("Tanh"), "LRN": lrn, "Softmax": softmax,
    "Concat": concat, "Eltwise": eltwise, "Flatten": reshape, "Reshape": reshape,
    "Dropout": identity,
}
