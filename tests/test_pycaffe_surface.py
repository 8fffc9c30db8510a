"""pycaffe beyond tests/test_pycaffe.py: `cgp pycaffe` running an unmodified script, caffe.io's
Datum and blob conversions, caffe.draw and `cgp draw`, and the Net and Solver calls Caffe's
scripts use (forward_all, clear_param_diffs, share_with, apply_update, diffs after step)."""
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cgp as caffe
from cgp import models
from cgp.caffe import draw
from cgp.proto import caffe_pb2

SCRIPT = """
import sys
import caffe
import caffe.proto.caffe_pb2
from caffe import layers as L, params as P
from caffe.proto import caffe_pb2
from caffe.coord_map import coord_map_from_to
import caffe.draw
n = caffe.NetSpec()
n.data = L.Input(shape=dict(dim=[1, 1, 8, 8]))
n.conv = L.Convolution(n.data, num_output=2, kernel_size=3, pad=1)
n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
print(coord_map_from_to(n.pool, n.data)[1:], caffe.io.array_to_datum is not None)
print(caffe_pb2 is caffe.proto.caffe_pb2, caffe.__name__, sys.argv[1:])
print(caffe.draw.draw_net(n.to_proto(), "LR", ext="dot").decode().count("->"))
"""


def pycaffe(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "cgp", "pycaffe", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)


def test_an_unmodified_script_runs_with_caffe_as_cgp(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    run = pycaffe(tmp_path, "script.py", "a", "--b")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "(array([2.]), array([0.5])) True"   # data = 2 * pool + 0.5
    assert lines[1] == "True cgp ['a', '--b']"
    assert lines[2] == "5"   # input -> data -> conv -> conv -> pool -> pool
    # The same through python -m cgp.caffe.run, and a module through -m.
    module = subprocess.run([sys.executable, "-m", "cgp.caffe.run", "script.py", "x"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert module.returncode == 0 and "['x']" in module.stdout, module.stderr
    (tmp_path / "mod.py").write_text("import caffe\nprint(caffe.has_nccl())\n")
    assert pycaffe(tmp_path, "-m", "mod").stdout == "False\n"


def test_caffe_proto_resolves_after_import_cgp_as_caffe():
    code = "import cgp as caffe; print(caffe.proto.caffe_pb2.BlobProto.__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout == "BlobProto\n", run.stderr


def test_a_real_caffe_is_not_shadowed_unless_forced(tmp_path):
    """A `caffe` package on the path (a real Caffe, as far as cgp can tell): cgp pycaffe
    refuses in one line, --force runs; import cgp.caffe.alias warns and leaves it."""
    (tmp_path / "caffe").mkdir()
    (tmp_path / "caffe" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "script.py").write_text("import caffe\nprint(hasattr(caffe, 'REAL'))\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path))
    refused = pycaffe(tmp_path, "script.py", env=env)
    assert refused.returncode == 2 and "a real Caffe is importable" in refused.stderr
    assert "Traceback" not in refused.stderr
    forced = pycaffe(tmp_path, "--force", "script.py", env=env)
    assert forced.returncode == 0 and forced.stdout == "False\n", forced.stderr
    code = "import warnings; warnings.simplefilter('error'); import cgp.caffe.alias"
    warned = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert warned.returncode != 0 and "a real Caffe is importable" in warned.stderr
    none = subprocess.run([sys.executable, "-c", "import cgp.caffe.alias, caffe; "
                           "print(caffe.__name__)"], capture_output=True, text=True)
    assert none.stdout == "cgp\n", none.stderr


def test_datum_round_trips_and_leaves_out_an_unset_label():
    pixels = np.random.default_rng(0).integers(0, 256, (3, 4, 5), dtype=np.uint8)
    datum = caffe.io.array_to_datum(pixels, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 4, 5, 7)
    assert datum.data == pixels.tobytes() and not datum.float_data
    back = caffe.io.datum_to_array(caffe_pb2.Datum.FromString(datum.SerializeToString()))
    assert back.dtype == np.uint8 and np.array_equal(back, pixels)
    values = np.random.default_rng(1).standard_normal((2, 3, 1)).astype(np.float32)
    floats = caffe.io.datum_to_array(caffe.io.array_to_datum(values))
    assert floats.dtype == np.float32 and np.array_equal(floats, values)
    assert not caffe.io.array_to_datum(values).HasField("label")
    with pytest.raises(ValueError, match="channels, height, width"):
        caffe.io.array_to_datum(np.zeros((2, 2)))


def test_blobproto_shapes_legacy_scalar_and_mismatch():
    values = np.arange(6, dtype=np.float32)
    legacy = caffe_pb2.BlobProto(num=1, channels=2, height=3, width=1, data=values)
    assert caffe.io.blobproto_to_array(legacy).shape == (1, 2, 3, 1)
    blob = caffe.io.array_to_blobproto(values.reshape(2, 3))
    assert np.array_equal(caffe.io.blobproto_to_array(blob), values.reshape(2, 3))
    scalar = caffe.io.blobproto_to_array(caffe_pb2.BlobProto(data=[4.5]))
    assert scalar.shape == () and scalar == 4.5
    with pytest.raises(ValueError, match="do not fit"):
        caffe.io.blobproto_to_array(caffe_pb2.BlobProto(data=values))


def test_oversample_takes_corners_centre_and_mirrors():
    image = np.arange(5 * 6 * 2, dtype=np.float32).reshape(5, 6, 2)
    crops = caffe.io.oversample([image, image + 100], (3, 4))
    assert crops.shape == (20, 3, 4, 2) and crops.dtype == np.float32
    want = [image[:3, :4], image[:3, 2:], image[2:, :4], image[2:, 2:], image[1:4, 1:5]]
    for k in range(5):
        assert np.array_equal(crops[k], want[k])
        assert np.array_equal(crops[5 + k], want[k][:, ::-1])
    assert np.array_equal(crops[10], image[:3, :4] + 100)


def test_transformer_preprocess_and_deprocess_invert_each_other():
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([10, 20, 30], np.float32))
    t.set_input_scale("data", 0.5)
    image = np.random.default_rng(3).random((4, 5, 3)).astype(np.float32)
    x = t.preprocess("data", image)
    want = (image.transpose(2, 0, 1)[::-1] * 255 - np.array([10, 20, 30])[:, None, None]) * 0.5
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", x), image, atol=1e-5)


def test_draw_writes_dot_without_graphviz_and_png_with_it(tmp_path, caffe_dir):
    model = caffe_dir / "prototxt" / "lenet_train_test.prototxt"
    run = subprocess.run([sys.executable, "-m", "cgp", "draw", str(model), "lenet.dot",
                          "--phase", "TEST"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    text = (tmp_path / "lenet.dot").read_text()
    assert text.startswith('digraph "LeNet" {') and '"blob_conv1" -> layer' in text
    assert text.count("(Data)") == 1 and "kernel size: 5" in text   # the TEST Data layer
    net = caffe_pb2.NetParameter(name='a"b', layer=[caffe_pb2.LayerParameter(
        name="x|y", type="ReLU", bottom=["d"], top=["d"])])
    assert 'label="x\\|y\\n(ReLU)"' in draw.dot_source(net)   # record fields escaped
    if shutil.which("dot") is None:
        with pytest.raises(caffe.errors.CgpError, match="Graphviz's `dot` program"):
            draw.draw_net(net, "LR", ext="png")
        return
    png = draw.draw_net(net, "TB")
    assert png.startswith(b"\x89PNG")


def simple_net(tmp_path, loss=True):
    """A small net with a loss (or without: ip its output), Caffe's test_net.py's kind."""
    path = tmp_path / f"net{int(loss)}.prototxt"
    text = textwrap.dedent("""\
        name: "small" force_backward: true
        layer { name: "data" type: "Input" top: "data" top: "label"
          input_param { shape { dim: 3 dim: 4 } shape { dim: 3 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
          inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
        """)
    path.write_text(text if loss else text[:text.index('layer { name: "loss"')])
    return path


def test_forward_all_and_backward_all_cover_any_number_of_rows(tmp_path):
    net = caffe.Net(str(simple_net(tmp_path)), caffe.TEST)
    x = np.random.default_rng(5).standard_normal((7, 4)).astype(np.float32)
    labels = np.zeros(7, np.float32)
    out = net.forward_all(blobs=["ip"], data=x, label=labels)
    w, b = (p.data for p in net.params["ip"])
    np.testing.assert_allclose(out["ip"], x @ w.T + b, rtol=1e-5, atol=1e-6)
    assert out["ip"].shape == (7, 2) and out["loss"].shape == (3,)   # a loss per batch
    assert net.blob_loss_weights == {"data": 0.0, "label": 0.0, "ip": 0.0, "loss": 1.0}


    plain = caffe.Net(str(simple_net(tmp_path, loss=False)), caffe.TEST)
    dy = np.random.default_rng(6).standard_normal((7, 2)).astype(np.float32)
    plain.forward_all(data=x)
    diffs = plain.backward_all(ip=dy)
    w = plain.params["ip"][0].data
    np.testing.assert_allclose(diffs["data"], dy @ w, rtol=1e-5, atol=1e-6)
    assert diffs["data"].shape == (7, 4)


def test_clear_param_diffs_and_share_with(tmp_path):
    path = str(simple_net(tmp_path))
    net = caffe.Net(path, caffe.TRAIN)
    net.forward(data=np.ones((3, 4), np.float32), label=np.zeros(3, np.float32))
    net.backward()
    assert np.abs(net.params["ip"][0].diff).max() > 0
    net.clear_param_diffs()
    assert not net.params["ip"][0].diff.any() and not net.params["ip"][1].diff.any()
    other = caffe.Net(path, caffe.TRAIN, seed=99)
    assert not np.array_equal(other.params["ip"][0].data, net.params["ip"][0].data)
    other.share_with(net)
    net.params["ip"][0].data[0, 0] = 123
    assert other.params["ip"][0].data[0, 0] == 123   # one array, as Caffe's shared blobs


def test_apply_update_and_the_diffs_after_step(tmp_path, mnist_dir):
    (tmp_path / "solver.prototxt").write_text(textwrap.dedent(f"""\
        net: "{models.FOLDER / 'lenet_train_test.prototxt'}"
        base_lr: 0.01 lr_policy: "fixed" momentum: 0 weight_decay: 0 max_iter: 10
        snapshot_prefix: "{tmp_path}/s"
        """))
    solver = caffe.SGDSolver(str(tmp_path / "solver.prototxt"), data_dir=str(mnist_dir))
    conv = solver.net.params["conv1"][0]
    before = conv.data.copy()
    solver.step(1)
    # As Caffe's: the diffs hold the step the update subtracted, the rate times the gradient.
    assert np.array_equal(conv.data, before - conv.diff) and np.abs(conv.diff).max() > 0
    conv.data[...] = 0
    conv.diff[...] = 1
    solver.apply_update()
    np.testing.assert_allclose(conv.data, -0.01, rtol=1e-6)
    np.testing.assert_allclose(conv.diff, 0.01, rtol=1e-6)
    assert solver.iter == 1


def test_set_input_arrays_feeds_a_memory_data_layer_round(tmp_path):
    path = tmp_path / "memory.prototxt"
    path.write_text(textwrap.dedent("""\
        name: "memory"
        layer { name: "data" type: "MemoryData" top: "data" top: "label"
          memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
          inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
        """))
    net = caffe.Net(str(path), caffe.TRAIN)
    with pytest.raises(caffe.errors.CgpError, match="has no data: hand it arrays"):
        net.forward()
    data = np.arange(6 * 6, dtype=np.float32).reshape(6, 1, 2, 3)
    labels = np.array([0, 1, 1, 0, 1, 0], np.float32)
    net.set_input_arrays(data, labels)
    for k in (0, 1, 2, 0):   # three batches, then round again
        net.forward()
        assert np.array_equal(net.blobs["data"].data, data[2 * k:2 * k + 2])
        assert np.array_equal(net.blobs["label"].data, labels[2 * k:2 * k + 2])
    with pytest.raises(caffe.errors.CgpError, match="a multiple of the batch size 2"):
        net.set_input_arrays(data[:5], labels[:5])
    with pytest.raises(caffe.errors.CgpError, match="must be float32"):
        net.set_input_arrays(data.astype(np.float64), labels)
    text = path.read_text().replace("memory_data_param", "transform_param { scale: 2 } "
                                    "memory_data_param")
    path.write_text(text)
    with pytest.raises(caffe.errors.CgpError, match="transform_param is not applied"):
        caffe.Net(str(path), caffe.TRAIN)


@pytest.mark.parametrize("shape, legacy", [((), (1, 1, 1, 1)), ((7,), (1, 1, 1, 7)),
                                           ((2, 3), (1, 1, 2, 3)), ((2, 3, 4, 5), (2, 3, 4, 5))])
def test_both_blob_classes_give_caffes_count_and_legacy_axes(shape, legacy):
    """pycaffe's Blob and a Python layer's PyBlob share LegacyAxes: count, and Caffe's
    LegacyShape (missing leading axes are 1), refused past 4 axes as Caffe's CHECK does."""
    from cgp.caffe.pycaffe import Blob
    from cgp.caffe.pylayer import PyBlob
    from cgp.errors import CgpError
    data = np.zeros(shape, np.float32)
    for blob in (Blob(None, "b", data, data), PyBlob(shape)):
        assert blob.count == data.size
        assert (blob.num, blob.channels, blob.height, blob.width) == legacy
    five = np.zeros((1, 2, 3, 4, 5), np.float32)
    for blob in (Blob(None, "b", five, five), PyBlob(five.shape)):
        assert blob.count == 120 and blob.shape == five.shape
        with pytest.raises(CgpError, match="5 axes; num, channels"):
            blob.width
