"""`cgp export`: a net's TEST phase with its weights as an ONNX graph (opsets 13 to 17), for
the tools that deploy nets. Needs the `onnx` package (the `onnx` extra).

The graph is the net without its data, loss and accuracy layers: its inputs are the data
layers' tops that the remaining layers read (the batch axis named "N"), its outputs the blobs
no remaining layer reads. Caffe's semantics where ONNX's differ are spelled out: pooling pads
explicitly and never lets a window start past Caffe's last one, AVE pooling divides by
Caffe's clipped window, WITHIN_CHANNEL LRN is composed from pooling and powers, BatchNorm
divides its statistics by their scale factor, ArgMax breaks ties towards the larger index,
MVN and Reduction are composed from ONNX's reductions. Each layer type's converter sits in its
layer's module (cgp/layers/<family>.py, @onnx_converter); here is the graph they add to and
the export around it. A layer with no conversion is named in one error with every other such
layer. Not here: training graphs.
"""
import tempfile
from pathlib import Path

import numpy as np

from cgp.errors import CgpError, require
from cgp.layers import REGISTRY

OPSET = 13
HIGHEST = 17          # opset 18 moves the reductions' axes to an input
ONE_FILE = 2**31 - 1   # bytes: protobuf's limit on one message, so on one .onnx file


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

    def chain(self, base, x, steps, top):
        """x through [(binary op, float32 constant)] in order, the last step writing top."""
        if not steps:
            self.node("Identity", [x], [top])
            return
        for k, (op, value) in enumerate(steps):
            out = top if k == len(steps) - 1 else None
            x = self.op(op, [x, self.scalar(f"{base}/{op.lower()}", value)],
                        f"{base}/{op.lower()}", out)

    def then_scaled(self, op, x, factor_name, factor, tops, name):
        """tops = op(x) * factor, with no Mul where the factor is 1."""
        if factor == 1:
            self.node(op, [x], tops)
            return
        x = self.op(op, [x], f"{name}/{op.lower()}")
        self.node("Mul", [x, self.scalar(f"{name}/{factor_name}", factor)], tops)


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
        convert = e.layer.to_onnx
        if convert is None:
            problems.append(f"layer '{e.layer.name}' (type {e.layer.type_name}): no ONNX "
                            f"conversion (converted: {', '.join(converted_types())})")
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


def converted_types():
    """The layer types with an ONNX conversion (each layer's module registers its own)."""
    return sorted(name for name, cls in REGISTRY.items() if cls.to_onnx is not None)


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
