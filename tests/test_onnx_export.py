"""`cgp export`: ONNX graphs that onnx.checker accepts and ONNX Runtime runs as cgp's forward,
on random weights and inputs, for the bundled nets, every zoo net cgp runs and each layer type
on its own; and the layers it refuses. Every blob the graph names as the prototxt does, not
only the outputs, is compared: |ONNX Runtime - cgp| over max(1, largest |cgp| of the blob)
above TOLERANCE fails (absolute for blobs within +-1, relative to the blob's largest value
beyond)."""
import subprocess
import sys

import numpy as np
import pytest

from cgp import models
from cgp.errors import CgpError

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from test_zoo import NETS, ZOO, needs, read, runnable  # noqa: E402

from cgp.commands.onnx_export import (  # noqa: E402
    blob_errors, converted_types, export, load_net, verify)
from cgp.prototxt import format_message  # noqa: E402
from cgp.layers import REGISTRY, register  # noqa: E402
from cgp.layers.activation import ReLU  # noqa: E402
from cgp.caffe.pycaffe import TEST, Net  # noqa: E402

TOLERANCE = 1e-5
# BatchNorm's statistics are stored times this factor (Caffe's third blob): the export must
# divide it out.
BN_FACTOR = 3.5


def randomize(net, seed=0):
    """Weights that keep signals in range (He's scale, the prototxt fillers' are tiny for
    some nets and a deploy net's are zeros); Scale factors around 1; BatchNorm statistics
    (a mean, a positive variance) stored times BN_FACTOR."""
    rng = np.random.default_rng(seed)
    types = {e.layer.name: e.layer.type_name for e in net._net.entries}
    for name, blobs in net.params.items():
        if types[name] == "BatchNorm":
            mean, variance, factor = (b.data for b in blobs)
            mean[...] = rng.standard_normal(mean.shape) * 0.2 * BN_FACTOR
            variance[...] = rng.uniform(0.5, 2, variance.shape) * BN_FACTOR
            factor[...] = BN_FACTOR
            continue
        for k, blob in enumerate(blobs):
            shape = blob.data.shape
            if types[name] == "Scale" and k == 0:
                blob.data[...] = rng.uniform(0.5, 1.5, shape)
            elif len(shape) >= 2:
                blob.data[...] = rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[1:]))
            else:
                blob.data[...] = rng.standard_normal(shape) * 0.5


def round_trip(net, tmp_path):
    """Exports net, checks the file; returns (blob_errors: every blob the graph names as the
    prototxt does against cgp's forward, the model). The outputs are among the blobs, and
    cgp's values are finite (no test passes on NaN); an in-place chain's blob is its last
    layer's value in both."""
    path = tmp_path / "net.onnx"
    model = export(net, path)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert model.opset_import[0].version == 13
    errors = blob_errors(path, net, seed=1)
    assert {o.name for o in model.graph.output} <= set(errors)
    assert all(np.isfinite(net.blobs[name].data).all() for name in errors)
    return errors, model


def worst(errors):
    return max(errors.items(), key=lambda item: item[1])


def test_blob_errors_see_an_inner_blob_that_differs(tmp_path):
    """A graph whose inner blob differs (a bias changed) while its output does not (a ReLU
    then Softmax of one class hides it): blob_errors names the inner blob."""
    text = ('name: "hide" layer { name: "data" type: "Input" top: "data" input_param { '
            'shape { dim: 2 dim: 3 } } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
            'inner_product_param { num_output: 1 } }\n'
            'layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }\n')
    path = tmp_path / "hide.prototxt"
    path.write_text(text)
    net = Net(str(path), TEST)
    randomize(net)
    export(net, tmp_path / "hide.onnx")
    model = onnx.load(str(tmp_path / "hide.onnx"))
    bias = next(t for t in model.graph.initializer if t.name.startswith("ip/bias"))
    bias.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(bias) + 0.5,
                                               bias.name))
    onnx.save(model, str(tmp_path / "hide.onnx"))
    errors = blob_errors(tmp_path / "hide.onnx", net)
    assert errors["prob"] == 0 and errors["ip"] > 0.1
    assert verify(tmp_path / "hide.onnx", net) == errors["ip"]


@pytest.mark.parametrize("model, fixture", [("lenet_train_test", "mnist_dir"),
                                            ("cifar10_quick_train_test", "cifar_dir"),
                                            ("cifar10_full_train_test", "cifar_dir")])
def test_bundled_nets_round_trip(model, fixture, tmp_path, request):
    """TEST phase of the bundled train/test nets: data, loss and accuracy layers left out."""
    net = load_net(str(models.FOLDER / f"{model}.prototxt"),
                   data_dir=str(request.getfixturevalue(fixture)))
    randomize(net)
    errors, graph = round_trip(net, tmp_path)
    assert worst(errors)[1] < TOLERANCE, worst(errors)
    assert [i.name for i in graph.graph.input] == ["data"]
    assert [o.name for o in graph.graph.output] == ["ip1" if "full" in model else "ip2"]
    types = {n.op_type for n in graph.graph.node}
    assert "Softmax" not in types and not types & {"SoftmaxCrossEntropyLoss", "ArgMax"}


def test_input_shape_replaces_data_layers(tmp_path):
    """--input-shape: no data set needed; the batch axis stays free (N)."""
    net = load_net(str(models.FOLDER / "cifar10_quick_train_test.prototxt"),
                   input_shape=(3, 3, 32, 32))
    randomize(net)
    errors, graph = round_trip(net, tmp_path)
    assert worst(errors)[1] < TOLERANCE, worst(errors)
    dims = graph.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["N", 3, 32, 32]


LAYERS = {
    "conv_pad_stride_group_dilation": (
        (2, 4, 9, 11), 'type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 '
        'pad: 2 stride: 2 group: 2 dilation: 2 weight_filler { type: "gaussian" } '
        'bias_filler { type: "gaussian" } }'),
    "conv_hw": ((2, 3, 8, 7), 'type: "Convolution" convolution_param { num_output: 4 '
                'kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 0 stride_h: 1 stride_w: 2 '
                'bias_term: false weight_filler { type: "gaussian" } }'),
    "max_pool_ceil_clipped": ((2, 3, 8, 7), 'type: "Pooling" pooling_param { pool: MAX '
                              'kernel_size: 3 stride: 2 pad: 1 }'),
    "max_pool_ceil": ((2, 3, 10, 9), 'type: "Pooling" pooling_param { pool: MAX '
                      'kernel_size: 3 stride: 2 }'),
    "ave_pool_ceil": ((2, 3, 10, 9), 'type: "Pooling" pooling_param { pool: AVE '
                      'kernel_size: 3 stride: 2 }'),
    "ave_pool_pad": ((2, 3, 8, 7), 'type: "Pooling" pooling_param { pool: AVE '
                     'kernel_size: 3 stride: 2 pad: 1 }'),
    "ave_pool_floor": ((2, 3, 9, 8), 'type: "Pooling" pooling_param { pool: AVE '
                       'kernel_size: 2 stride: 2 round_mode: FLOOR }'),
    "global_pool": ((2, 3, 5, 6), 'type: "Pooling" pooling_param { pool: AVE '
                    'global_pooling: true }'),
    "inner_product": ((2, 3, 4, 5), 'type: "InnerProduct" inner_product_param { num_output: 7 '
                      'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }'),
    "inner_product_axis_transpose": (
        (2, 3, 4, 5), 'type: "InnerProduct" inner_product_param { num_output: 6 axis: 2 '
        'transpose: true weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }'),
    "relu": ((2, 3, 4, 5), 'type: "ReLU"'),
    "leaky_relu": ((2, 3, 4, 5), 'type: "ReLU" relu_param { negative_slope: 0.1 }'),
    "sigmoid": ((2, 3, 4, 5), 'type: "Sigmoid"'),
    "tanh": ((2, 3, 4, 5), 'type: "TanH"'),
    "lrn_across": ((2, 7, 4, 5), 'type: "LRN" lrn_param { local_size: 5 alpha: 0.5 '
                   'beta: 0.75 k: 2 }'),
    "lrn_within": ((2, 3, 6, 5), 'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 '
                   'beta: 0.75 norm_region: WITHIN_CHANNEL }'),
    "softmax": ((2, 5, 3, 4), 'type: "Softmax"'),
    "softmax_axis": ((2, 5, 3, 4), 'type: "Softmax" softmax_param { axis: 2 }'),
    "dropout": ((2, 3, 4, 5), 'type: "Dropout" dropout_param { dropout_ratio: 0.3 }'),
    "flatten": ((2, 3, 4, 5), 'type: "Flatten" flatten_param { axis: 2 }'),
    "reshape": ((2, 3, 4, 5), 'type: "Reshape" reshape_param { shape { dim: 0 dim: -1 '
                'dim: 2 } }'),
    # The zoo's other layers. Fillers are replaced by randomize's weights.
    "deconv_pad_stride_group_dilation": (
        (2, 4, 5, 6), 'type: "Deconvolution" convolution_param { num_output: 6 kernel_size: 3 '
        'pad: 1 stride: 2 group: 2 dilation: 2 }'),
    "deconv_no_bias": ((2, 3, 4, 5), 'type: "Deconvolution" convolution_param { num_output: 2 '
                       'kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 bias_term: false }'),
    "depthwise_conv": ((2, 4, 6, 6), 'type: "Convolution" convolution_param { num_output: 4 '
                       'kernel_size: 3 pad: 1 group: 4 }'),
    "batch_norm_global": ((2, 3, 4, 5), 'type: "BatchNorm" batch_norm_param { '
                          'use_global_stats: true eps: 0.001 }'),
    "batch_norm_default_at_test": ((2, 3, 4, 5), 'type: "BatchNorm"'),
    "batch_norm_batch_statistics": ((3, 4, 2, 5), 'type: "BatchNorm" batch_norm_param { '
                                    'use_global_stats: false }'),
    "batch_norm_2d": ((4, 3), 'type: "BatchNorm"'),
    "scale_bias_axes": ((2, 3, 4, 5), 'type: "Scale" scale_param { axis: 1 num_axes: 2 '
                        'bias_term: true }'),
    "scale_last_axis": ((2, 3, 4, 5), 'type: "Scale" scale_param { axis: -1 }'),
    "scale_all_axes": ((2, 3, 4, 5), 'type: "Scale" scale_param { axis: 1 num_axes: -1 }'),
    "scale_second_bottom": ([(2, 3, 4, 5), (2, 3)], 'type: "Scale" scale_param { axis: 0 '
                            'bias_term: true }'),
    "bias_learnt": ((2, 3, 4, 5), 'type: "Bias" bias_param { axis: 2 num_axes: 1 }'),
    "bias_second_bottom": ([(2, 3, 4, 5), (2, 3, 4)], 'type: "Bias" bias_param { axis: 0 }'),
    "prelu": ((2, 3, 4, 5), 'type: "PReLU"'),
    "prelu_shared": ((2, 3, 4, 5), 'type: "PReLU" prelu_param { channel_shared: true }'),
    "elu": ((2, 3, 4, 5), 'type: "ELU" elu_param { alpha: 0.7 }'),
    "power": ((2, 3, 4, 5), 'type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }'),
    "power_sqrt": ((2, 3, 4, 5), 'type: "Power" power_param { power: 0.5 scale: 0 '
                   'shift: 2 }'),
    "power_zero": ((2, 3, 4, 5), 'type: "Power" power_param { power: 0 scale: 3 }'),
    "power_identity": ((2, 3, 4, 5), 'type: "Power"'),
    "absval": ((2, 3, 4, 5), 'type: "AbsVal"'),
    "bnll": ((2, 3, 4, 5), 'type: "BNLL"'),
    "exp": ((2, 3, 4, 5), 'type: "Exp"'),
    "exp_base_scale_shift": ((2, 3, 4, 5), 'type: "Exp" exp_param { base: 2 scale: 0.5 '
                             'shift: 1 }'),
    "log_base_scale_shift": ((2, 3, 4, 5), 'type: "Log" log_param { base: 10 scale: 0.5 '
                             'shift: 8 }'),
    "threshold": ((2, 3, 4, 5), 'type: "Threshold" threshold_param { threshold: 0.2 }'),
    "clip": ((2, 3, 4, 5), 'type: "Clip" clip_param { min: -0.5 max: 0.7 }'),
    "swish": ((2, 3, 4, 5), 'type: "Swish"'),
    "swish_beta": ((2, 3, 4, 5), 'type: "Swish" swish_param { beta: 1.5 }'),
    "slice_points": ((2, 5, 4, 3), 'top: "b" top: "c" type: "Slice" slice_param { axis: 1 '
                     'slice_point: 1 slice_point: 3 }'),
    "slice_even": ((2, 3, 4, 6), 'top: "b" type: "Slice" slice_param { axis: -1 }'),
    "crop": ([(2, 3, 8, 9), (2, 3, 5, 4)], 'type: "Crop" crop_param { axis: 2 offset: 1 '
             'offset: 3 }'),
    "crop_channels": ([(2, 5, 8, 9), (2, 3, 4, 4)], 'type: "Crop" crop_param { axis: 1 '
                      'offset: 2 }'),
    "tile": ((2, 3, 4, 5), 'type: "Tile" tile_param { axis: 2 tiles: 3 }'),
    "reduction_sum": ((2, 3, 4, 5), 'type: "Reduction" reduction_param { axis: 1 }'),
    "reduction_asum": ((2, 3, 4, 5), 'type: "Reduction" reduction_param { operation: ASUM '
                       'axis: 2 coeff: 0.5 }'),
    "reduction_sumsq": ((2, 3, 4, 5), 'type: "Reduction" reduction_param { operation: SUMSQ '
                        'axis: -1 }'),
    "reduction_mean": ((2, 3, 4, 5), 'type: "Reduction" reduction_param { operation: MEAN '
                       'axis: 1 coeff: -2 }'),
    "argmax": ((2, 7, 2, 2), 'type: "ArgMax"'),
    "argmax_top_k_max_val": ((2, 7, 2, 2), 'type: "ArgMax" argmax_param { top_k: 3 '
                             'out_max_val: true }'),
    "argmax_axis": ((2, 7, 3, 2), 'type: "ArgMax" argmax_param { axis: 1 top_k: 2 }'),
    "argmax_axis_max_val": ((2, 7, 3, 2), 'type: "ArgMax" argmax_param { axis: -1 '
                            'out_max_val: true }'),
    "mvn": ((2, 3, 4, 5), 'type: "MVN"'),
    "mvn_mean_only": ((2, 3, 4, 5), 'type: "MVN" mvn_param { normalize_variance: false }'),
    "mvn_across_channels": ((2, 3, 4, 5), 'type: "MVN" mvn_param { across_channels: true '
                            'eps: 0.01 }'),
    "embed": ((2, 5), 'type: "Embed" embed_param { num_output: 4 input_dim: 7 }'),
    "embed_no_bias": ((3,), 'type: "Embed" embed_param { num_output: 4 input_dim: 9 '
                      'bias_term: false }'),
}


def one_layer_net(tmp_path, shapes, body):
    """An Input layer of tops data, in1, ... (one per shape), and `layer` on all of them
    writing out (and the tops body names)."""
    if not isinstance(shapes, list):
        shapes = [shapes]
    names = ["data"] + [f"in{k}" for k in range(1, len(shapes))]
    tops = " ".join(f'top: "{n}"' for n in names)
    dims = " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }" for s in shapes)
    bottoms = " ".join(f'bottom: "{n}"' for n in names)
    text = (f'name: "one" layer {{ name: "data" type: "Input" {tops} input_param {{ {dims} }} }}\n'
            f'layer {{ name: "layer" {bottoms} top: "out" {body} }}\n')
    path = tmp_path / "one.prototxt"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_one_layer_against_cgp(case, tmp_path):
    shapes, body = LAYERS[case]
    net = Net(one_layer_net(tmp_path, shapes, body), TEST)
    randomize(net)
    errors, graph = round_trip(net, tmp_path)
    assert worst(errors)[1] < TOLERANCE, (case, worst(errors))
    assert "out" in [o.name for o in graph.graph.output]


def test_every_layer_type_with_a_conversion_is_tested_alone():
    tested = {body.split('type: "')[1].split('"')[0] for _, body in LAYERS.values()}
    assert set(converted_types()) - tested == {"Concat", "Eltwise", "Silence"}


def test_layers_with_no_conversion_are_named_in_one_error(tmp_path, monkeypatch):
    """A registered layer type that registers no converter (as a Python layer) is refused with
    every such layer named, and what is converted."""
    cls = type("NoConversion", (ReLU,), {})
    monkeypatch.setitem(REGISTRY, "NoConversion", cls)
    register("NoConversion")(cls)
    path = tmp_path / "two.prototxt"
    path.write_text('name: "two" layer { name: "data" type: "Input" top: "data" '
                    'input_param { shape { dim: 2 dim: 3 } } }\n'
                    'layer { name: "a" type: "NoConversion" bottom: "data" top: "a" }\n'
                    'layer { name: "b" type: "ReLU" bottom: "a" top: "b" }\n'
                    'layer { name: "c" type: "NoConversion" bottom: "b" top: "c" }\n')
    net = Net(str(path), TEST)
    with pytest.raises(CgpError) as refused:
        export(net, tmp_path / "two.onnx")
    listed = ", ".join(converted_types())
    assert str(refused.value) == (
        f"{path}: cannot export net 'two' to ONNX: layer 'a' (type NoConversion): no ONNX "
        f"conversion (converted: {listed}); layer 'c' (type NoConversion): no ONNX conversion "
        f"(converted: {listed})")
    assert "NoConversion" not in listed and "ReLU" in listed
    assert not (tmp_path / "two.onnx").exists()


@pytest.mark.parametrize("body", [
    'type: "Concat" concat_param { axis: 1 }',
    'type: "Eltwise" eltwise_param { operation: SUM coeff: 0.5 coeff: -2 }',
    'type: "Eltwise" eltwise_param { operation: PROD }',
    'type: "Eltwise" eltwise_param { operation: MAX }'])
def test_two_bottom_layers_and_splits(body, tmp_path):
    """A second blob from the input (TanH), then the layer on both: the input is read twice
    (a Split in cgp, one value in ONNX), and an in-place ReLU rewrites the TanH's blob."""
    text = ('name: "two" layer { name: "data" type: "Input" top: "data" input_param { shape '
            '{ dim: 2 dim: 3 dim: 4 dim: 5 } } }\n'
            'layer { name: "t" type: "TanH" bottom: "data" top: "t" }\n'
            'layer { name: "r" type: "ReLU" bottom: "t" top: "t" relu_param { negative_slope: 0.5 } }\n'
            f'layer {{ name: "layer" bottom: "data" bottom: "t" top: "out" {body} }}\n')
    path = tmp_path / "two.prototxt"
    path.write_text(text)
    errors, graph = round_trip(Net(str(path), TEST), tmp_path)
    assert worst(errors)[1] < TOLERANCE, worst(errors)


@pytest.mark.parametrize("param", ["top_k: 3 out_max_val: true", "axis: 1 top_k: 2"])
def test_argmax_ties_go_to_the_larger_index(param, tmp_path):
    """Inputs of a few small integers, so that most rows tie: ONNX's TopK gives a tie to the
    smaller index; the export flips the axis so that it goes to the larger, as in Caffe."""
    net = Net(one_layer_net(tmp_path, (4, 6, 2, 3), f'type: "ArgMax" argmax_param {{ {param} }}'),
              TEST)
    path = tmp_path / "argmax.onnx"
    export(net, path)
    x = np.random.default_rng(0).integers(0, 3, (4, 6, 2, 3)).astype(np.float32)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"data": x})[0]
    want = net.forward(data=x)["out"]
    assert np.array_equal(got, want)
    # The first of the top k: NumPy's argmax, which gives a tie to the smaller index, differs.
    first = want[:, 0] if "axis" in param else want[:, 0, 0, 0]
    smaller = x.argmax(1) if "axis" in param else x.reshape(4, -1).argmax(1)
    assert (first != smaller).any()


def test_silence_and_a_split_after_an_in_place_layer(tmp_path):
    """A blob rewritten in place, then read by two layers (a Split after the in-place layer,
    which must copy its value): one reader's top is silenced, so it is no output, and what
    only it needed is left out of the graph."""
    text = ('name: "silent" layer { name: "data" type: "Input" top: "data" input_param { '
            'shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }\n'
            'layer { name: "t" type: "Convolution" bottom: "data" top: "t" convolution_param { '
            'num_output: 3 kernel_size: 1 } }\n'
            'layer { name: "r" type: "ReLU" bottom: "t" top: "t" '
            'relu_param { negative_slope: 0.5 } }\n'
            'layer { name: "a" type: "Sigmoid" bottom: "t" top: "a" }\n'
            'layer { name: "b" type: "AbsVal" bottom: "t" top: "b" }\n'
            'layer { name: "quiet" type: "Silence" bottom: "b" }\n')
    path = tmp_path / "silent.prototxt"
    path.write_text(text)
    net = Net(str(path), TEST)
    randomize(net)
    errors, graph = round_trip(net, tmp_path)
    assert worst(errors)[1] < TOLERANCE, worst(errors)
    assert [o.name for o in graph.graph.output] == ["a"]
    assert {n.op_type for n in graph.graph.node} == {"Conv", "LeakyRelu", "Sigmoid"}


# AlexNet's, CaffeNet's and VGG-16's fully connected layers of 4096 outputs get NARROW: their
# 4096 x 9216 and 4096 x 25088 matrices took 13 to 46 s a net to fill, export and run; every
# other layer keeps the net's real shapes (the last, 1000 classes, reads NARROW inputs).
WIDE, NARROW = 4096, 64


@pytest.mark.parametrize("name", NETS)
def test_zoo_net_round_trip(name, tmp_path):
    """The TEST phase of every zoo net cgp runs, on a batch of 1 (data layers replaced by
    Input layers as in test_zoo), random weights: every blob within TOLERANCE."""
    param = read(ZOO / name)
    reason = needs(param)
    if reason:
        pytest.skip(f"{name} needs {reason}")
    param = runnable(name, param, 1)
    if param is None:
        pytest.skip(f"{name}: the shapes of its data are not known")
    for lp in param.layer:
        if lp.type == "InnerProduct" and lp.inner_product_param.num_output == WIDE:
            lp.inner_product_param.num_output = NARROW
    path = tmp_path / name.replace("/", "_")
    path.write_text(format_message(param))
    net = Net(str(path), TEST)
    randomize(net)
    errors, graph = round_trip(net, tmp_path)
    assert worst(errors)[1] < TOLERANCE, worst(errors)
    kept = [e for e in net._net.entries if not e.layer.reduces_batch]
    assert len(errors) >= len({t for e in kept for t in e.layer.lp.top}) // 2
    # Up to 100 MB a net (ResNet-50's weights): pytest keeps the last runs' folders, so the
    # file is left only where the test fails.
    (tmp_path / "net.onnx").unlink()


def test_a_layer_that_reads_a_batch_value_is_refused(tmp_path):
    """A Reduction over axis 0 is one value for the batch, left out as losses are: the layer
    that reads it is named, with its file and what it reads."""
    text = ('name: "total" layer { name: "data" type: "Input" top: "data" input_param { '
            'shape { dim: 2 dim: 3 } } }\n'
            'layer { name: "sum" type: "Reduction" bottom: "data" top: "sum" }\n'
            'layer { name: "sq" type: "Power" bottom: "sum" top: "sq" power_param { power: 2 } }\n'
            'layer { name: "t" type: "TanH" bottom: "data" top: "t" }\n')
    path = tmp_path / "total.prototxt"
    path.write_text(text)
    with pytest.raises(CgpError, match=r"total\.prototxt: .*layer 'sq' \(type Power\): reads "
                       r"'sum', a batch value of layer 'sum' \(type Reduction\)"):
        export(Net(str(path), TEST), tmp_path / "total.onnx")
    assert not (tmp_path / "total.onnx").exists()


def test_a_graph_over_one_files_limit_is_refused(tmp_path, monkeypatch):
    """Protobuf holds 2 GiB in one message: a bigger graph is refused before it is written.
    (A real one takes over 2 GiB of memory to build: the limit is lowered to 100 kB for a
    200 kB layer.)"""
    from cgp.commands import onnx_export

    monkeypatch.setattr(onnx_export, "ONE_FILE", 100_000)
    net = Net(one_layer_net(tmp_path, (2, 500), 'type: "InnerProduct" inner_product_param { '
                            'num_output: 100 }'), TEST)
    with pytest.raises(CgpError, match=r"one\.prototxt: net 'one': the graph with its weights "
                       r"takes .* GiB, over the 2 GiB that one ONNX file"):
        export(net, tmp_path / "big.onnx")
    assert not (tmp_path / "big.onnx").exists()


@pytest.mark.parametrize("opset", [12, 18])
def test_an_opset_out_of_range_is_refused(opset, tmp_path):
    net = Net(one_layer_net(tmp_path, (2, 3), 'type: "ReLU"'), TEST)
    with pytest.raises(CgpError, match=f"--opset {opset}: cgp writes opsets 13 to 17"):
        export(net, tmp_path / "x.onnx", opset)


def test_opset_17_is_written_as_asked(tmp_path):
    net = Net(one_layer_net(tmp_path, (2, 3, 4, 5), 'type: "MVN"'), TEST)
    model = export(net, tmp_path / "x.onnx", 17)
    assert model.opset_import[0].version == 17
    assert verify(tmp_path / "x.onnx", net) < TOLERANCE


def test_unconvertible_layers_are_named_in_one_error(tmp_path):
    text = ('name: "mask" layer { name: "data" type: "Input" top: "data" input_param { shape '
            '{ dim: 2 dim: 3 dim: 4 dim: 4 } } }\n'
            'layer { name: "p1" type: "Pooling" bottom: "data" top: "p1" top: "mask1" '
            'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
            'layer { name: "p2" type: "Pooling" bottom: "data" top: "p2" top: "mask2" '
            'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
            'layer { name: "c" type: "Concat" bottom: "mask1" bottom: "mask2" top: "c" }\n')
    path = tmp_path / "mask.prototxt"
    path.write_text(text)
    with pytest.raises(CgpError, match=r"mask\.prototxt: .*layer 'p1' \(type Pooling\): .*mask"
                       r".*layer 'p2' \(type Pooling\): .*mask"):
        export(Net(str(path), TEST), tmp_path / "mask.onnx")
    assert not (tmp_path / "mask.onnx").exists()


def test_export_command(tmp_path, caffe_dir):
    out = subprocess.run([sys.executable, "-m", "cgp", "export", "--model",
                          str(caffe_dir / "prototxt/lenet.prototxt"), "--onnx",
                          str(tmp_path / "lenet.onnx")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "onnx.checker accepts it" in out.stdout and "largest difference" in out.stdout
    assert (tmp_path / "lenet.onnx").is_file()
    out = subprocess.run([sys.executable, "-m", "cgp", "export", "--model",
                          str(caffe_dir / "prototxt/lenet.prototxt"), "--onnx",
                          str(tmp_path / "x.onnx"), "--input-shape", "1,x"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--input-shape" in out.stderr
    assert "Traceback" not in out.stderr
