"""`cgp export`: ONNX graphs that onnx.checker accepts and ONNX Runtime runs as cgp's forward
(random weights and inputs; largest difference over 1e-5 of the output's scale fails)."""
import subprocess
import sys

import numpy as np
import pytest

from cgp import models
from cgp.errors import CgpError

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from cgp.onnx_export import export, load_net, verify  # noqa: E402
from cgp.pycaffe import TEST, Net  # noqa: E402

TOLERANCE = 1e-5


def randomize(net, seed=0):
    """Weights of unit scale (the prototxt fillers' are tiny for some nets)."""
    rng = np.random.default_rng(seed)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.data.shape) / np.sqrt(
                max(1, blob.data[0].size))


def round_trip(net, tmp_path):
    path = tmp_path / "net.onnx"
    model = export(net, path)
    onnx.checker.check_model(onnx.load(str(path)))
    assert model.opset_import[0].version >= 13
    return verify(path, net), model


@pytest.mark.parametrize("model, fixture", [("lenet_train_test", "mnist_dir"),
                                            ("cifar10_quick_train_test", "cifar_dir"),
                                            ("cifar10_full_train_test", "cifar_dir")])
def test_bundled_nets_round_trip(model, fixture, tmp_path, request):
    """TEST phase of the bundled train/test nets: data, loss and accuracy layers left out."""
    net = load_net(str(models.FOLDER / f"{model}.prototxt"),
                   data_dir=str(request.getfixturevalue(fixture)))
    randomize(net)
    error, graph = round_trip(net, tmp_path)
    assert error < TOLERANCE
    assert [i.name for i in graph.graph.input] == ["data"]
    assert [o.name for o in graph.graph.output] == ["ip1" if "full" in model else "ip2"]
    types = {n.op_type for n in graph.graph.node}
    assert "Softmax" not in types and not types & {"SoftmaxCrossEntropyLoss", "ArgMax"}


def test_input_shape_replaces_data_layers(tmp_path):
    """--input-shape: no data set needed; the batch axis stays free (N)."""
    net = load_net(str(models.FOLDER / "cifar10_quick_train_test.prototxt"),
                   input_shape=(3, 3, 32, 32))
    randomize(net)
    error, graph = round_trip(net, tmp_path)
    assert error < TOLERANCE
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
}


def one_layer_net(tmp_path, shape, body, bottoms=("data",)):
    dims = " ".join(f"dim: {d}" for d in shape)
    text = (f'name: "one" layer {{ name: "data" type: "Input" top: "data" '
            f'input_param {{ shape {{ {dims} }} }} }}\n'
            f'layer {{ name: "layer" {" ".join(f"bottom: {chr(34)}{b}{chr(34)}" for b in bottoms)} '
            f'top: "out" {body} }}\n')
    path = tmp_path / "one.prototxt"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_one_layer_against_cgp(case, tmp_path):
    shape, body = LAYERS[case]
    net = Net(one_layer_net(tmp_path, shape, body), TEST)
    error, graph = round_trip(net, tmp_path)
    assert error < TOLERANCE, case
    assert [o.name for o in graph.graph.output] == ["out"]


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
    error, graph = round_trip(Net(str(path), TEST), tmp_path)
    assert error < TOLERANCE


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
    with pytest.raises(CgpError, match="layer 'p1'.*mask.*layer 'p2'.*mask"):
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
