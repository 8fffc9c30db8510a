"""Old net formats that Caffe still reads, upgraded on load as its UpgradeNetAsNeeded does:
V1 `layers {}` files (enum types, blobs_lr / weight_decay), the legacy input fields, the
old transformation fields of V1 data layers, BatchNorm's old param specs; every file of the
model zoo and of Caffe's examples parsing; the V1 CaffeNet building as the new one does."""
import subprocess
import sys

import numpy as np
import pytest

from cgp.errors import PrototxtError
from cgp.net import Net
from cgp.proto import caffe_pb2
from cgp.prototxt import format_message, parse_net, parse_solver, read_net
from cgp.snapshot import copy_weights, read_caffemodel


def quiet(path):
    notes = []
    return read_net(path, log=notes.append), notes


def zoo_nets(caffe_dir):
    files = sorted((caffe_dir / "zoo").glob("*/*.prototxt")) + sorted(
        (caffe_dir / "prototxt").glob("*.prototxt"))
    return [f for f in files if "solver" not in f.name]


def test_every_zoo_and_example_file_parses_and_upgrades(caffe_dir):
    files = zoo_nets(caffe_dir)
    assert len(files) == 28
    upgraded = {}
    for path in files:
        net, notes = quiet(path)
        assert net.layer and not net.layers and not net.input and not net.input_dim
        assert len(notes) <= 1
        if notes:
            upgraded[str(path.relative_to(caffe_dir))] = notes[0]
    # The zoo's README: the V1 CaffeNet files, and the deploy nets with legacy input fields.
    assert sorted(upgraded) == [
        "zoo/bvlc_reference_caffenet_v1/deploy.prototxt",
        "zoo/bvlc_reference_caffenet_v1/train_val.prototxt",
        "zoo/mobilenet/mobilenet_deploy.prototxt", "zoo/mobilenet/mobilenet_v2_deploy.prototxt",
        "zoo/resnet50/ResNet-50-deploy.prototxt",
        "zoo/vgg16/VGG_ILSVRC_16_layers_deploy.prototxt"]
    note = upgraded["zoo/bvlc_reference_caffenet_v1/deploy.prototxt"]
    assert "V1 layers" in note and "input fields" in note and "deploy.prototxt" in note
    solvers = sorted((caffe_dir / "zoo").glob("*/*solver*")) + [
        caffe_dir / "zoo" / "resnet50_cvgj" / "train.solver"]
    for path in solvers:
        parse_solver(path.read_text(), str(path))


def test_v1_train_val_upgrades_to_the_new_format_file(caffe_dir):
    """The V1 CaffeNet train_val (blobs_lr, weight_decay, enum types, `include: {...}`)
    comes out as the same message as the new-format file of the same net."""
    old, _ = quiet(caffe_dir / "zoo" / "bvlc_reference_caffenet_v1" / "train_val.prototxt")
    new, notes = quiet(caffe_dir / "zoo" / "bvlc_reference_caffenet" / "train_val.prototxt")
    assert not notes
    assert format_message(old) == format_message(new)
    conv1 = old.layer[2]
    assert conv1.type == "Convolution" and [(p.lr_mult, p.decay_mult) for p in conv1.param] \
        == [(1, 1), (2, 0)]


def test_v1_deploy_builds_as_the_new_deploy(caffe_dir):
    """Layer list, blob shapes and parameter layout of the V1 CaffeNet deploy net (legacy
    input fields too) are those of the new-format deploy net."""
    old = Net(quiet(caffe_dir / "zoo" / "bvlc_reference_caffenet_v1" / "deploy.prototxt")[0],
              caffe_pb2.TEST)
    new = Net(quiet(caffe_dir / "zoo" / "bvlc_reference_caffenet" / "deploy.prototxt")[0],
              caffe_pb2.TEST)
    assert [(e.layer.name, e.layer.type_name) for e in old.entries] == \
        [(e.layer.name, e.layer.type_name) for e in new.entries]
    assert [e.layer.type_name for e in old.sources] == ["Input"]
    assert old.blob_shapes == new.blob_shapes and old.blob_shapes[0] == (10, 3, 227, 227)
    layout = [[(b.layer, b.index, b.shape, b.offset, b.lr_mult, b.decay_mult)
               for b in net.param_blobs] for net in (old, new)]
    assert layout[0] == layout[1] and old.n_params == 60965224


def test_v1_caffemodel_weights_load(tmp_path):
    """A .caffemodel in the V1 format (`layers` holding the blobs) loads by layer name."""
    text = ('input: "data" input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4 '
            'layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" '
            'inner_product_param { num_output: 5 } }')
    net = Net(parse_net(text, log=lambda line: None), caffe_pb2.TEST)
    weights = [np.arange(5 * 48, dtype=np.float32).reshape(5, 48), np.arange(5.0)]
    model = caffe_pb2.NetParameter(name="old")
    layer = model.layers.add(name="ip", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
    for array in weights:
        blob = layer.blobs.add(num=1, channels=1, height=array.shape[0] if array.ndim == 2 else 1,
                               width=array.shape[-1])
        blob.data.extend(array.ravel().tolist())
    (tmp_path / "old.caffemodel").write_bytes(model.SerializeToString())
    copied, _ = copy_weights(net, read_caffemodel(tmp_path / "old.caffemodel"), "old")
    assert copied == ["ip"]
    assert np.array_equal(net.params, np.concatenate([w.ravel() for w in weights]))


V1_DATA = '''
layers { name: "mnist" type: DATA top: "data" top: "label"
  data_param { source: "db" batch_size: 64 scale: 0.00390625 mirror: true backend: LMDB }
  include: { phase: TRAIN } }
layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" blobs_lr: 1 blobs_lr: 2
  weight_decay: 1 weight_decay: 0 param: "w" blob_share_mode: PERMISSIVE
  inner_product_param { num_output: 10 } }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "ip" bottom: "label" loss_weight: 2 }
'''


def test_v1_fields_move_where_caffe_moves_them():
    net = parse_net(V1_DATA, log=lambda line: None)
    data, ip, loss = net.layer
    assert data.type == "Data" and data.include[0].phase == caffe_pb2.TRAIN
    assert data.transform_param.scale == np.float32(0.00390625) and data.transform_param.mirror
    assert not data.data_param.HasField("scale") and data.data_param.batch_size == 64
    assert [(p.name, p.share_mode, p.lr_mult, p.decay_mult) for p in ip.param] == \
        [("w", caffe_pb2.ParamSpec.PERMISSIVE, 1, 1), ("", 0, 2, 0)]
    assert loss.type == "SoftmaxWithLoss" and list(loss.loss_weight) == [2]


def test_input_fields_each_form():
    notes = []
    shape = parse_net('input: "a" input: "b" input_shape { dim: 2 dim: 3 } input_shape { dim: 2 } '
                      'layer { name: "r" type: "ReLU" bottom: "a" top: "c" }',
                      "f.prototxt", log=notes.append)
    assert [lp.name for lp in shape.layer] == ["input", "r"]
    assert list(shape.layer[0].top) == ["a", "b"]
    assert [list(s.dim) for s in shape.layer[0].input_param.shape] == [[2, 3], [2]]
    assert notes == ["Note: f.prototxt is in Caffe's deprecated net format; upgraded as Caffe "
                     "does on load: the input fields to an Input layer 'input' "
                     "(upgrade_net_proto_text writes the new format)"]
    dims = parse_net('input: "a" input: "b" ' + " ".join(f"input_dim: {d}" for d in range(1, 9)),
                     log=notes.append)
    assert [list(s.dim) for s in dims.layer[0].input_param.shape] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for text, why in (('input: "a" input_dim: 1 input_dim: 2', "give 4"),
                      ('input: "a" input: "b" input_shape { dim: 1 }', "1 input_shape entries"),
                      ('input: "a"', "no input_shape or input_dim")):
        with pytest.raises(PrototxtError, match=f"^f.prototxt: .*{why}"):
            parse_net(text, "f.prototxt")


def test_what_cannot_be_upgraded_is_one_clear_error(tmp_path):
    cases = [('layers { name: "x" type: CONVOLUTON }', r"old.prototxt:1:\d+: .*no value named "
              r"CONVOLUTON.*the V1 format's layer types are: .*CONVOLUTION"),
             ('layers { layer { name: "c" type: "conv" } }', "V0 format.*upgrade_net_proto_text"),
             ('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }',
              "both 'layer' and 'layers'"),
             ('layers { name: "n" type: NONE }', "has type NONE")]
    for text, why in cases:
        with pytest.raises(PrototxtError, match=why):
            parse_net(text, "old.prototxt")
    path = tmp_path / "old.prototxt"
    path.write_text(cases[0][0])
    out = subprocess.run([sys.executable, "-m", "cgp", "time", "--model", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no value named CONVOLUTON" in out.stderr
    assert "Traceback" not in out.stderr


def test_nets_inside_a_solver_are_upgraded():
    notes = []
    sp = parse_solver('base_lr: 0.1 net_param { input: "x" input_dim: 1 input_dim: 1 '
                      'input_dim: 1 input_dim: 1 } test_net_param { layers { name: "r" '
                      'type: RELU } }', "s.prototxt", log=notes.append)
    assert sp.net_param.layer[0].type == "Input" and sp.test_net_param[0].layer[0].type == "ReLU"
    assert [n.split(" is in")[0] for n in notes] == ["Note: s.prototxt (net_param)",
                                                     "Note: s.prototxt (test_net_param 0)"]


def test_batch_norm_param_specs():
    """Caffe's UpgradeNetBatchNorm: three param specs get lr_mult and decay_mult 0; said
    where an lr_mult was not 0 already."""
    notes = []
    text = ('layer {{ name: "bn" type: "BatchNorm" {} }}')
    zoo = parse_net(text.format("param { lr_mult: 0 } " * 3), log=notes.append)
    assert [(p.lr_mult, p.decay_mult) for p in zoo.layer[0].param] == [(0, 0)] * 3 and not notes
    parse_net(text.format("param { lr_mult: 1 } " * 3), log=notes.append)
    assert len(notes) == 1 and "BatchNorm" in notes[0]
    two = parse_net(text.format("param { lr_mult: 1 } " * 2), log=notes.append)
    assert [p.lr_mult for p in two.layer[0].param] == [1, 1]
