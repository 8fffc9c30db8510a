"""The layers the model zoo needs, in nets: a tiny net of many of them trains to the same bits
on 1, 2 and 3 workers, and every zoo net whose layers cgp has runs forward and backward on a
small batch (the others are skipped, each with what it still needs)."""
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from cgp.commands.equivalence import compare, train_run
from cgp.layers import REGISTRY, Chunk
from cgp.net import Net, Workspace
from cgp.proto import caffe_pb2
from cgp.prototxt import read_net
from cgp.train import RunConfig

# Data (MNIST, 28 x 28) through many of the new layers to three losses: a reconstruction
# (SigmoidCrossEntropyLoss against the image), the classes (SoftmaxWithLoss), and a batch
# Reduction of squares as a penalty.
MANY_LAYERS = """
name: "many"
layer { name: "data" type: "Data" top: "data" top: "label"
        data_param { source: "mnist:train" batch_size: 12 }
        transform_param { scale: 0.00390625 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2
                            weight_filler { type: "xavier" } } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1"
        scale_param { bias_term: true filler { type: "constant" value: 1.5 } } }
layer { name: "prelu1" type: "PReLU" bottom: "conv1" top: "conv1" }
layer { name: "dw" type: "Convolution" bottom: "conv1" top: "dw"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 group: 4
                            weight_filler { type: "msra" } } }
layer { name: "elu" type: "ELU" bottom: "dw" top: "dw" }
layer { name: "mvn" type: "MVN" bottom: "dw" top: "mvn" }
layer { name: "up" type: "Deconvolution" bottom: "mvn" top: "up"
        convolution_param { num_output: 2 kernel_size: 2 stride: 2
                            weight_filler { type: "xavier" } } }
layer { name: "slice" type: "Slice" bottom: "up" top: "recon" top: "rest" }
layer { name: "ce" type: "SigmoidCrossEntropyLoss" bottom: "recon" bottom: "data"
        top: "ce" loss_weight: 0.1 }
layer { name: "pool" type: "Pooling" bottom: "rest" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "swish" type: "Swish" bottom: "pool" top: "swish" }
layer { name: "ip1" type: "InnerProduct" bottom: "swish" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "embed" type: "Embed" bottom: "label" top: "embed"
        embed_param { num_output: 6 input_dim: 10 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "embed" top: "sum" }
layer { name: "ip2" type: "InnerProduct" bottom: "sum" top: "ip2"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
layer { name: "penalty" type: "Reduction" bottom: "ip1" top: "penalty" loss_weight: 0.001
        reduction_param { operation: SUMSQ } }
"""


def many_layers_solver():
    sp = caffe_pb2.SolverParameter()
    text_format.Parse(MANY_LAYERS, sp.net_param)
    sp.base_lr, sp.lr_policy, sp.momentum, sp.weight_decay = 0.05, "fixed", 0.9, 0.0005
    sp.random_seed, sp.display = 7, 0
    return sp


def test_a_net_of_the_new_layers_trains_to_one_hash_on_1_2_3_workers(mnist_dir):
    """Three steps on 1 and 2 worker threads and 3 worker processes, in 5 chunks (which do
    not divide the batch of 12): the same weights and losses bit for bit, and it trained."""
    sp = many_layers_solver()
    outcomes = [train_run(sp, None, RunConfig(threads=t, chunks=5, data_dir=str(mnist_dir),
                                              workers=workers), 3)
                for t, workers in ((1, "threads"), (2, "threads"), (3, "processes"))]
    rows, ok = compare(outcomes)
    assert ok, rows
    losses = outcomes[0].losses
    assert np.isfinite(losses).all() and losses[0] != losses[-1]


# -- the model zoo ----------------------------------------------------------------------------

ZOO = Path(__file__).resolve().parents[2] / "shared" / "data" / "caffe" / "zoo"
NETS = sorted(p.relative_to(ZOO).as_posix() for p in ZOO.glob("*/*.prototxt")
              if "solver" not in p.name) if ZOO.is_dir() else []
# The per-sample shapes of the Data and ImageData layers' tops (zoo README: the crop, or the
# data set's images; a label is one value), for nets whose data is not among the fixtures:
# the test gives them Input layers of these shapes.
DATA_SHAPES = {
    "bvlc_alexnet/train_val.prototxt": {"data": (3, 227, 227), "label": ()},
    "bvlc_reference_caffenet/train_val.prototxt": {"data": (3, 227, 227), "label": ()},
    "bvlc_googlenet/train_val.prototxt": {"data": (3, 224, 224), "label": ()},
    "squeezenet_v1.1/train_val.prototxt": {"data": (3, 227, 227), "label": ()},
    # MNIST pairs: two images as two channels, and whether they show the same digit.
    "mnist_siamese/mnist_siamese_train_test.prototxt": {"pair_data": (2, 28, 28), "sim": ()},
    "cifar10_full_sigmoid_bn/cifar10_full_sigmoid_train_test_bn.prototxt":
        {"data": (3, 32, 32), "label": ()},
    "resnet20_cifar10/trainval.prototxt": {"data": (3, 32, 32), "label": ()},
    "vgg16_cifar10/trainval.prototxt": {"data": (3, 32, 32), "label": ()},
    "bvlc_reference_caffenet_v1/train_val.prototxt": {"data": (3, 227, 227), "label": ()},
    "resnet50_cvgj/train.prototxt": {"data": (3, 224, 224), "label": ()},
}
SOURCE_PARAMS = {"Data": ("data_param", "transform_param"),
                 "ImageData": ("image_data_param", "transform_param")}


def needs(param):
    """What a zoo net needs that cgp has not, or None: layer types. (Old formats are
    upgraded as the file is read: tests/test_upgrade.py.)"""
    missing = sorted({lp.type for lp in param.layer if lp.type not in REGISTRY})
    if missing:
        return ", ".join(f"layer type {t}" for t in missing)
    return None


def read(path):
    """The net of a zoo file, upgraded from an old format as Caffe reads it."""
    return read_net(path, log=lambda line: None)


def runnable(name, param, batch):
    """The net with a batch of `batch`: its Input layers' first axis set, its Data and
    ImageData layers replaced by Input layers of DATA_SHAPES (their include rules kept); None
    where a data layer's shapes are not known."""
    param = type(param).FromString(param.SerializeToString())
    for lp in param.layer:
        if lp.type in SOURCE_PARAMS:
            shapes = DATA_SHAPES.get(name)
            if shapes is None:
                return None
            for field in SOURCE_PARAMS[lp.type]:
                lp.ClearField(field)
            lp.type = "Input"
            for top in lp.top:
                lp.input_param.shape.add().dim.extend((batch,) + shapes[top])
        elif lp.type == "Input":
            for shape in lp.input_param.shape:
                shape.dim[0] = batch
    return param


@pytest.mark.parametrize("name", NETS)
def test_zoo_net_runs_forward_and_backward(name):
    """The net (TRAIN phase) on a batch of 2 with random weights: forward, then backward from
    its losses, or, for a deploy net, from random gradients of its last top through every
    layer; every learnt blob gets a gradient, every value finite. Labels (one value per sample)
    are 0 or 1, a class of every net."""
    param = read(ZOO / name)
    reason = needs(param)
    if reason:
        pytest.skip(f"{name} needs {reason}")
    batch = 2
    param = runnable(name, param, batch)
    if param is None:
        pytest.skip(f"{name} needs its training data, which the fixtures do not hold")
    net = Net(param, caffe_pb2.TRAIN)
    net.init_params(1)
    rng = np.random.default_rng(0)
    # Deploy nets name no fillers (Caffe's default fills zeros): weights of variance 1/fan_in
    # instead, which keep a deep net's signals in range; and the statistics of a BatchNorm
    # with use_global_stats a variance of 1 (its factor 1), where 0 would scale by 1/sqrt(eps).
    for blob in net.param_blobs:
        fan_in = int(np.prod(blob.shape[1:])) if len(blob.shape) > 1 else 0
        if fan_in:
            net.params[blob.offset:blob.offset + blob.size] = (
                rng.standard_normal(blob.size) / np.sqrt(fan_in))
    for entry, views in zip(net.entries, net.param_views(net.params)):
        if entry.layer.type_name == "BatchNorm":
            views[1][...], views[2][...] = 1, 1
    inputs = {}
    for source in net.sources:
        for t in source.tops:
            shape = (batch,) + net.blob_shapes[t][1:]
            inputs[t] = (rng.integers(0, 2, shape) if len(shape) == 1
                         else rng.standard_normal(shape)).astype(np.float32)
    ws = Workspace(net, batch)
    chunk = Chunk(n=batch, batch=batch)
    views = net.param_views(net.params)
    out = net.forward(ws, chunk, inputs, views)
    grads = np.zeros((1, net.n_params), np.float32)
    plan = None
    if not net.loss_weights:
        last = net.entries[-1].tops[0]
        ws.diff_views(batch)[last][...] = rng.standard_normal(out[last].shape)
        plan = [(True, [True] * len(e.bottoms)) for e in net.entries]
    net.backward(ws, chunk, out, views, net.param_views(grads), plan)
    assert all(np.isfinite(a).all() for a in out if a is not None)
    assert np.isfinite(grads).all()
    # The gradient reaches every learnt blob; but the siamese towers' shared last bias moves
    # both features of a pair alike, so its two gradients cancel, exactly.
    unreached = [(b.layer, b.index) for b in net.param_blobs
                 if b.lr_mult and not grads[0, b.offset:b.offset + b.size].any()]
    assert unreached == ([("feat", 1)] if "siamese_train" in name else [])


def test_which_zoo_nets_run_here():
    """The zoo nets the test above runs, and so what cgp supports of the zoo: a net that
    leaves this list (or joins it) is a change to say in the README's zoo table."""
    if not NETS:
        pytest.skip(f"the model zoo fixtures are not at {ZOO}")
    runs = []
    for name in NETS:
        param = read(ZOO / name)
        if needs(param) is None and runnable(name, param, 1) is not None:
            runs.append(name)
    assert runs == NETS and len(runs) == 21     # every one
