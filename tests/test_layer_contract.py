"""The layer contract (cgp/layers/base.py): every registered layer hands its kernel calls over
to the net or says that it runs each call; register() refuses a layer that would leave the
bound calls unsaid; a `*_param` message a layer does not read is refused by name, in Caffe's
example and model-zoo nets too; `engine:` is a hint cgp ignores. The groups of layers come from
the registry: a registered type with no net to try here, no test in its family's file, or a
device op or converter that is no registered layer's fails."""
import sys
from pathlib import Path

import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import (REGISTRY, SYNC, Chunk, DeviceOp, base, device_op, onnx_converter,
                        register)
from cgp.layers.activation import ReLU
from cgp.layers.base import Layer
from cgp.net import Net, Workspace, build_net
from cgp.proto import caffe_pb2
from cgp.prototxt import parse_net, parse_text
from layer_check import backward, build, random_params

INPUT = ('layer { name: "in" type: "Input" top: "data" top: "label" '
         'input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }\n')

# Caffe's LayerParameter messages whose names end in _param (`param`, the ParamSpecs, is not one).
PARAM_MESSAGES = [f.name for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields
                  if f.name.endswith("_param")]

# A small net for each layer type that hands its calls over: INPUT, then the layer "l".
HANDS_OVER = {
    "AbsVal": 'type: "AbsVal" bottom: "data" top: "y"',
    "ArgMax": 'type: "ArgMax" bottom: "data" top: "y" argmax_param { top_k: 2 }',
    "BNLL": 'type: "BNLL" bottom: "data" top: "y"',
    "BatchNorm": 'type: "BatchNorm" bottom: "data" top: "y"',
    "Bias": 'type: "Bias" bottom: "data" top: "y"',
    "Clip": 'type: "Clip" bottom: "data" top: "y" clip_param { min: -1 max: 1 }',
    "Crop": 'type: "Crop" bottom: "data" bottom: "data" top: "y"',
    "Deconvolution": 'type: "Deconvolution" bottom: "data" top: "y" '
                     'convolution_param { num_output: 2 kernel_size: 2 stride: 2 }',
    "ELU": 'type: "ELU" bottom: "data" top: "y"',
    "Exp": 'type: "Exp" bottom: "data" top: "y"',
    "Log": 'type: "Log" bottom: "data" top: "y"',
    "MVN": 'type: "MVN" bottom: "data" top: "y"',
    "Power": 'type: "Power" bottom: "data" top: "y" power_param { power: 2 }',
    "PReLU": 'type: "PReLU" bottom: "data" top: "y"',
    "Scale": 'type: "Scale" bottom: "data" top: "y" scale_param { bias_term: true }',
    "Silence": 'type: "Silence" bottom: "data" bottom: "label"',
    "Slice": 'type: "Slice" bottom: "data" top: "y" top: "z" slice_param { axis: 2 }',
    "Swish": 'type: "Swish" bottom: "data" top: "y"',
    "Threshold": 'type: "Threshold" bottom: "data" top: "y"',
    "Tile": 'type: "Tile" bottom: "data" top: "y" tile_param { tiles: 2 }',
    "Concat": 'type: "Concat" bottom: "data" bottom: "data" top: "y"',
    "Convolution": 'type: "Convolution" bottom: "data" top: "y" '
                   'convolution_param { num_output: 2 kernel_size: 3 }',
    "Eltwise": 'type: "Eltwise" bottom: "data" bottom: "data" top: "y"',
    "Flatten": 'type: "Flatten" bottom: "data" top: "y"',
    "InnerProduct": 'type: "InnerProduct" bottom: "data" top: "y" '
                    'inner_product_param { num_output: 3 }',
    "LRN": 'type: "LRN" bottom: "data" top: "y" lrn_param { local_size: 3 }',
    "Pooling": 'type: "Pooling" bottom: "data" top: "y" '
               'pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
    "ReLU": 'type: "ReLU" bottom: "data" top: "y"',
    "Reshape": 'type: "Reshape" bottom: "data" top: "y" reshape_param { shape { dim: 0 dim: -1 } }',
    "Sigmoid": 'type: "Sigmoid" bottom: "data" top: "y"',
    "Softmax": 'type: "Softmax" bottom: "data" top: "y"',
    "Split": 'type: "Split" bottom: "data" top: "y" top: "z"',
    "TanH": 'type: "TanH" bottom: "data" top: "y"',
    "Python": 'type: "Python" bottom: "data" top: "y" python_param { module: "cgp.caffe.pylayer" '
              'layer: "ScaleLayer" param_str: "2" }',
}
# From the registry: layers that run Python at every call (calls_each_time), the data
# layers (is_source), and the rest, which hand their calls over (each needs a net above).
EACH_TIME = {kind for kind, cls in REGISTRY.items() if cls.calls_each_time}
SOURCES = {kind for kind, cls in REGISTRY.items() if cls.is_source}
HANDS_OVER_TYPES = set(REGISTRY) - EACH_TIME - SOURCES
# Layers of HANDS_OVER with nothing to do one way: Silence computes no top; ArgMax and
# Threshold have no gradient (Caffe implements none) and refuse a net that needs one.
NO_FORWARD = {"Silence"}
NO_GRADIENT = {"ArgMax", "Threshold"}


def test_every_registered_type_is_walked():
    """A registered type lands in exactly one of the three groups, and each type that hands
    its calls over has a net above to try them on (a new one without fails here)."""
    assert not EACH_TIME & SOURCES
    assert sorted(HANDS_OVER) == sorted(HANDS_OVER_TYPES)


# The test files of a layer module (tests/test_<module>.py unless named here).
FAMILY_TESTS = {"data": ("test_data_layers.py", "test_net.py"),
                "hdf5_data": ("test_data_layers.py",),
                "image_data": ("test_data_layers.py", "test_images.py"),
                "loss": ("test_loss.py", "test_losses.py"),
                "memory_data": ("test_pycaffe_surface.py",),
                "python": ("test_python_layer.py",)}


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_every_registered_type_has_a_test_of_its_family(kind):
    """Each registered type is named, "Type", in its module's test file: a layer module that
    registers a type nobody tests fails here."""
    module = REGISTRY[kind].__module__.rsplit(".", 1)[1]
    names = FAMILY_TESTS.get(module, (f"test_{module}.py",))
    here = Path(__file__).parent
    texts = [(here / name).read_text() for name in names if (here / name).exists()]
    assert any(f'"{kind}"' in text for text in texts), (
        f"{kind} (cgp/layers/{module}.py) is named in none of {', '.join(names)}")


def _layer_modules():
    return [module for name, module in sorted(sys.modules.items())
            if name.startswith("cgp.layers.") and name != "cgp.layers.base"]


def test_every_device_op_and_converter_belongs_to_a_registered_layer():
    """A layer module's device ops and ONNX converters are each some registered layer's (one
    written but attached to nothing, or to a type that is not registered, fails here), and
    each layer's sits in the layer's own module."""
    ops = {cls.device_op for cls in REGISTRY.values()} - {None}
    converters = {cls.to_onnx for cls in REGISTRY.values()} - {None}
    for module in _layer_modules():
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if isinstance(value, type) and issubclass(value, DeviceOp):
                assert value in ops, f"{module.__name__}.{name} is no layer's device op"
            elif callable(value) and name.endswith("_onnx"):
                assert value in converters, f"{module.__name__}.{name} is no layer's converter"
    for kind, cls in REGISTRY.items():
        for attached in (cls.device_op, cls.to_onnx):
            if attached is not None:
                assert attached.__module__ == cls.__module__, (kind, attached)


def test_a_device_op_or_converter_for_an_unregistered_layer_is_refused():
    loose = type("Loose", (ReLU,), {})
    with pytest.raises(TypeError, match="device op LooseOp names layer class Loose, which is "
                                        "not registered"):
        device_op(loose)(type("LooseOp", (DeviceOp,), {}))
    with pytest.raises(TypeError, match="ONNX converter _loose_onnx names layer class Loose"):
        onnx_converter(loose)(_loose_onnx)
    assert loose.device_op is ReLU.device_op is not None and loose.to_onnx is ReLU.to_onnx


def _loose_onnx(g, e, bottoms, tops, params, read):
    pass


def test_a_registered_subclass_inherits_no_device_op_or_converter(monkeypatch):
    """register() gives a layer neither, whatever its base class has: Deconvolution is a
    Convolution without Convolution's device op; it has a converter of its own."""
    assert REGISTRY["Convolution"].device_op is not None
    assert REGISTRY["Deconvolution"].device_op is None
    assert REGISTRY["Deconvolution"].to_onnx not in (None, REGISTRY["Convolution"].to_onnx)
    monkeypatch.setattr(base, "REGISTRY", {})
    cls = register("Leaky")(type("Leaky", (ReLU,), {}))
    assert cls.device_op is None and cls.to_onnx is None


@pytest.mark.parametrize("kind", sorted(HANDS_OVER))
def test_layer_hands_its_kernel_calls_over(kind):
    """forward_calls and backward_calls give (kernel, args) pairs on a real net's buffers
    (the net binds those: cgp.net.BoundCall), and the calls run."""
    net = Net(parse_net(INPUT + f'layer {{ name: "l" {HANDS_OVER[kind]} }}'), caffe_pb2.TRAIN)
    [i] = [i for i, e in enumerate(net.entries) if e.layer.name == "l"]
    entry, layer = net.entries[i], net.entries[i].layer
    assert type(layer) is REGISTRY[kind]
    assert not layer.calls_each_time and not layer.is_source and not layer.reduces_batch
    net.init_params(1)
    ws = Workspace(net, 4)
    chunk = Chunk(n=4, batch=4)
    inputs = {t: np.random.default_rng(0).standard_normal(net.blob_shapes[t]).astype(np.float32)
              for t in net.sources[0].tops}
    data, diff = net.call_views(ws, chunk, inputs), ws.diff_views(4)
    params = net.param_views(net.params)[i]
    grads = net.param_views(np.zeros((1, net.n_params), np.float32))[i]
    bottom, top = [data[b] for b in entry.bottoms], [data[t] for t in entry.tops]
    bottom_diff = [diff[b] for b in entry.bottoms]
    top_diff = [diff[t] for t in entry.tops]
    forward = layer.forward_calls(bottom, top, params, ws.scratch[i], chunk)
    if kind in NO_GRADIENT:
        with pytest.raises(NetError, match="has no gradient"):
            layer.backward_calls(top, top_diff, bottom, bottom_diff, params, grads,
                                 ws.scratch[i], chunk)
        bottom_diff = [None] * len(bottom)
    back = layer.backward_calls(top, top_diff, bottom, bottom_diff, params, grads, ws.scratch[i],
                                chunk)
    for calls, k, empty in ((forward, 0, kind in NO_FORWARD),
                            (back, layer.batch_sums[0], kind in NO_GRADIENT)):
        assert calls is not None, f"{kind} hands no calls over"
        calls = list(calls)
        assert bool(calls) != empty
        for call in calls:
            if call is SYNC:   # a sum over the batch (this call holds all of it)
                layer.sum_now(k, ws.scratch[i], params, chunk)
                k += 1
                continue
            kernel, args = call
            assert callable(kernel) and isinstance(args, tuple)
            kernel(*args)


@pytest.mark.parametrize("kind", sorted(EACH_TIME))
def test_per_call_layers_declare_it(kind):
    cls = REGISTRY[kind]
    assert cls.calls_each_time and cls.forward is not Layer.forward
    assert cls.forward_calls is Layer.forward_calls


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_sources_load_and_take_no_bottoms(kind):
    cls = REGISTRY[kind]
    assert cls.load is not Layer.load and cls.bottoms == (0, 0)
    assert cls.device_op is None and cls.to_onnx is None


def _per_call(self, *args):
    pass


@pytest.mark.parametrize("attributes, message", [
    # A hand-over layer changed to override forward: refused, not silently run per call.
    (dict(forward=_per_call), "Quiet overrides forward/backward without declaring "
                              "calls_each_time"),
    (dict(backward=_per_call), "Quiet overrides forward/backward"),
    (dict(calls_each_time=True), "Quiet declares calls_each_time: it must define forward and "
                                 "backward"),
    (dict(calls_each_time=True, forward=_per_call, backward=_per_call),
     "Quiet declares calls_each_time and also defines forward_calls"),
    (dict(reduces_batch=True), "Quiet has reduces_batch"),
    (dict(batch_sums=(1, 0)), "Quiet has batch_sums: it hands its calls over"),
    (dict(forward_parts=_per_call), "Quiet takes the parts at once: it needs reduces_batch, "
                                    "forward_parts and backward_parts"),
    (dict(params_read="relu_param"), "Quiet: params_read must be a tuple"),
    (dict(params_read=("relu_parameter",)), "Quiet: params_read must be a tuple"),
])
def test_register_refuses_a_class_that_breaks_the_contract(monkeypatch, attributes, message):
    monkeypatch.setattr(base, "REGISTRY", {})
    cls = type("Quiet", (ReLU,), attributes)
    with pytest.raises(TypeError, match=message):
        register("Quiet")(cls)
    assert base.REGISTRY == {}


def test_register_derives_the_flags_from_the_methods():
    """is_source, can_factor_param_diff and takes_parts follow load, factor_shape and
    forward_parts: no layer declares them, so none can disagree with its methods."""
    for kind, cls in REGISTRY.items():
        assert cls.is_source == (cls.load is not Layer.load), kind
        assert cls.can_factor_param_diff == (cls.factor_shape is not Layer.factor_shape), kind
        assert cls.takes_parts == hasattr(cls, "forward_parts"), kind
    assert {k for k, c in REGISTRY.items() if c.can_factor_param_diff} == {"InnerProduct"}
    assert {k for k, c in REGISTRY.items() if c.takes_parts} == {"SoftmaxWithLoss"}
    assert SOURCES == {"Data", "DummyData", "HDF5Data", "ImageData", "Input", "MemoryData"}


def test_register_refuses_a_layer_with_no_calls(monkeypatch):
    monkeypatch.setattr(base, "REGISTRY", {})
    with pytest.raises(TypeError, match="Empty must define forward_calls and backward_calls"):
        register("Empty")(type("Empty", (Layer,), {}))


def test_register_takes_a_declared_per_call_layer(monkeypatch):
    monkeypatch.setattr(base, "REGISTRY", {})
    cls = type("Said", (Layer,), dict(calls_each_time=True, forward=_per_call,
                                      backward=_per_call))
    assert register("Said")(cls) is cls and base.REGISTRY == {"Said": cls}


# -- the *_param messages a layer reads ---------------------------------------------------

def test_a_message_the_layer_does_not_read_is_refused_by_name():
    text = INPUT + ('layer { name: "relu1" type: "ReLU" bottom: "data" top: "r" '
                    'pooling_param { pool: MAX kernel_size: 2 } }')
    with pytest.raises(NetError) as e:
        build_net(parse_net(text), "net.prototxt")
    assert str(e.value) == ("net.prototxt: layer 'relu1' (type ReLU): pooling_param is not read "
                            "by ReLU layers (they read relu_param); remove it")


def _layer_param(kind, message=None):
    """A LayerParameter of type `kind` with as few bottoms and tops as it takes, and the
    (empty) message `message` set."""
    cls = REGISTRY[kind]
    lp = caffe_pb2.LayerParameter(name="l", type=kind)
    lp.bottom.extend(f"b{i}" for i in range(cls.bottoms[0]))
    lp.top.extend(f"t{i}" for i in range(cls.tops[0]))
    if message:
        getattr(lp, message).SetInParent()
    return lp


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_each_layer_takes_the_messages_it_reads_and_refuses_others(kind):
    cls = REGISTRY[kind]
    for message in cls.params_read:
        cls(_layer_param(kind, message))
    unread = [m for m in PARAM_MESSAGES if m not in cls.params_read]
    for message in unread:
        with pytest.raises(NetError, match=rf"'l' \(type {kind}\): {message} is not read"):
            cls(_layer_param(kind, message))


# What each layer type reads in Caffe (its caffe.proto messages).
CAFFE_READS = {
    "AbsVal": (), "Accuracy": ("accuracy_param",), "BatchNorm": ("batch_norm_param",),
    "Concat": ("concat_param",),
    "Convolution": ("convolution_param",), "Data": ("data_param", "transform_param"),
    "Dropout": ("dropout_param",), "DummyData": ("dummy_data_param",),
    "Eltwise": ("eltwise_param",), "Flatten": ("flatten_param",),
    "HDF5Data": ("hdf5_data_param",), "ImageData": ("image_data_param", "transform_param"),
    "InnerProduct": ("inner_product_param",),
    "Input": ("input_param",), "LRN": ("lrn_param",), "Pooling": ("pooling_param",),
    "ReLU": ("relu_param",), "Reshape": ("reshape_param",), "Sigmoid": ("sigmoid_param",),
    "Softmax": ("softmax_param",), "SoftmaxWithLoss": ("softmax_param", "loss_param"),
    "Split": (), "TanH": ("tanh_param",),
    "ArgMax": ("argmax_param",), "BNLL": (), "Bias": ("bias_param",), "Clip": ("clip_param",),
    "ContrastiveLoss": ("contrastive_loss_param",), "Crop": ("crop_param",),
    "Deconvolution": ("convolution_param",), "ELU": ("elu_param",), "Embed": ("embed_param",),
    "EuclideanLoss": (), "Exp": ("exp_param",), "HingeLoss": ("hinge_loss_param",),
    # InfogainLoss's inner Softmax, made through Caffe's registry, reads softmax_param's engine.
    "InfogainLoss": ("infogain_loss_param", "loss_param", "softmax_param"),
    "Log": ("log_param",), "MVN": ("mvn_param",), "PReLU": ("prelu_param",),
    "Power": ("power_param",), "Reduction": ("reduction_param",), "Scale": ("scale_param",),
    "SigmoidCrossEntropyLoss": ("loss_param",), "Silence": (), "Slice": ("slice_param",),
    "Swish": ("swish_param",), "Threshold": ("threshold_param",), "Tile": ("tile_param",),
    "Python": ("python_param",),
    "MemoryData": ("memory_data_param", "transform_param"),
}


def test_layers_read_what_caffe_reads():
    assert {k: set(c.params_read) for k, c in REGISTRY.items()} == {
        k: set(v) for k, v in CAFFE_READS.items()}


def test_example_and_zoo_nets_pass_the_message_check(caffe_dir):
    """Every layer of a supported type in the bundled models and in Caffe's example and
    model-zoo nets sets only messages it reads (zoo nets with unsupported types fail on
    the type, elsewhere)."""
    models = Path(__file__).resolve().parents[1] / "models"
    paths = sorted(models.glob("*.prototxt")) + sorted(caffe_dir.rglob("*.prototxt"))
    checked = 0
    for path in paths:
        if "solver" in path.name:
            continue
        param = parse_text(path.read_text(), caffe_pb2.NetParameter(), str(path))
        for index, lp in enumerate(param.layer):
            cls = REGISTRY.get(lp.type)
            if cls is not None:
                cls(lp, index=index)
                checked += 1
    assert checked > 1000


# -- engine: a hint cgp ignores -----------------------------------------------------------

SHAPE = (2, 3, 4, 4)
# Layer text with {} where the engine goes, and its bottom shapes.
ENGINES = {
    "Convolution": ('type: "Convolution" bottom: "x" top: "y" '
                    'convolution_param { num_output: 2 kernel_size: 3 {} }', [SHAPE]),
    "Deconvolution": ('type: "Deconvolution" bottom: "x" top: "y" '
                      'convolution_param { num_output: 2 kernel_size: 3 stride: 2 {} }', [SHAPE]),
    "InfogainLoss": ('type: "InfogainLoss" bottom: "x" bottom: "label" bottom: "H" top: "loss" '
                     'softmax_param { {} }', [(2, 3), (2,), (3, 3)]),
    "LRN": ('type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 {} }', [SHAPE]),
    "LRN within": ('type: "LRN" bottom: "x" top: "y" '
                   'lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL {} }', [SHAPE]),
    "Pooling": ('type: "Pooling" bottom: "x" top: "y" '
                'pooling_param { pool: MAX kernel_size: 2 stride: 2 {} }', [SHAPE]),
    "ReLU": ('type: "ReLU" bottom: "x" top: "y" relu_param { {} }', [SHAPE]),
    "Sigmoid": ('type: "Sigmoid" bottom: "x" top: "y" sigmoid_param { {} }', [SHAPE]),
    "TanH": ('type: "TanH" bottom: "x" top: "y" tanh_param { {} }', [SHAPE]),
    "Softmax": ('type: "Softmax" bottom: "x" top: "y" softmax_param { {} }', [SHAPE]),
    "SoftmaxWithLoss": ('type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss" '
                        'softmax_param { {} }', [(2, 3), (2,)]),
}


def test_every_layer_with_an_engine_field_is_tried():
    with_engine = {kind for kind, cls in REGISTRY.items() for m in cls.params_read
                   if "engine" in getattr(caffe_pb2.LayerParameter(), m).DESCRIPTOR.fields_by_name}
    assert with_engine == {kind.split()[0] for kind in ENGINES}


@pytest.mark.parametrize("engine", ["DEFAULT", "CAFFE", "CUDNN"])
@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_engine_is_a_hint_cgp_ignores(kind, engine):
    """Any engine builds the layer and gives the bits of the layer without one."""
    text, shapes = ENGINES[kind]
    plain = build(text.replace("{}", ""), shapes)
    hinted = build(text.replace("{}", f"engine: {engine}"), shapes)
    rng = np.random.default_rng(2)
    bottom = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    chunk = None
    if kind in ("SoftmaxWithLoss", "InfogainLoss"):
        bottom[1] = np.array([0, 2], np.float32)
    if kind == "InfogainLoss":
        bottom[2] = np.abs(bottom[2])
        chunk = Chunk(n=2, batch_tops={"H": bottom[2]})
    params = random_params(plain, np.float32)
    top_diff = [rng.standard_normal(s if plain.reduces_batch else (shapes[0][0],) + s[1:])
                .astype(np.float32) for s in plain.top_shapes]
    propagate = [True] + [False] * (len(shapes) - 1)
    want = backward(plain, bottom, params, top_diff, chunk, propagate=propagate)
    got = backward(hinted, bottom, params, top_diff, chunk, propagate=propagate)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert (a is None and b is None) or a.tobytes() == b.tobytes()
