"""Caffe's HDF5 snapshots (snapshot_format: HDF5): the files' layout as Caffe's Net::ToHDF5
and SnapshotSolverStateToHDF5 write it, resume bit for bit from a .solverstate.h5, weights
from a .caffemodel.h5 (one that Caffe wrote, with a shared blob left out, too), and bad
files as one DataError."""
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from cgp.errors import DataError
from cgp.proto import caffe_pb2, cgp_pb2
from cgp.snapshot import read_caffemodel, read_solverstate
from cgp.train import RunConfig, Trainer

h5py = pytest.importorskip("h5py")

NET = """
name: "tiny"
layer { name: "d" type: "Data" top: "data" top: "label"
  transform_param { scale: 0.00390625 } data_param { source: "mnist:train" batch_size: 8 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param { name: "shared_w" } param { lr_mult: 2 }
  inner_product_param { num_output: 12 weight_filler { type: "xavier" } } }
layer { name: "ip1b" type: "InnerProduct" bottom: "data" top: "ip1b"
  param { name: "shared_w" }
  inner_product_param { num_output: 12 weight_filler { type: "xavier" } } }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip1b" top: "s" }
layer { name: "relu" type: "ReLU" bottom: "s" top: "s" }
layer { name: "ip2" type: "InnerProduct" bottom: "s" top: "ip2"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def make(tmp_path, mnist_dir, max_iter=4, **config):
    sp = text_format.Parse('type: "Adam" base_lr: 0.01 lr_policy: "multistep" gamma: 0.5 '
                           'stepvalue: 1 stepvalue: 3 '
                           'momentum: 0.9 display: 0 random_seed: 3 snapshot: 2 '
                           f'snapshot_format: HDF5 snapshot_prefix: "{tmp_path}/s"',
                           caffe_pb2.SolverParameter())
    text_format.Parse(NET, sp.net_param)
    lines = []
    trainer = Trainer(sp, None, RunConfig(progress=False, data_dir=str(mnist_dir),
                                          max_iter=max_iter, **config), log=lines.append)
    return trainer, lines


def test_files_have_caffes_hdf5_layout(tmp_path, mnist_dir):
    trainer, lines = make(tmp_path, mnist_dir)
    trainer.solve()
    trainer.close()
    model, state = tmp_path / "s_iter_2.caffemodel.h5", tmp_path / "s_iter_2.solverstate.h5"
    assert f"Snapshotting to HDF5 file {model}" in lines
    assert f"Snapshotting solver state to HDF5 file {state}" in lines
    assert not (tmp_path / "s_iter_2.caffemodel").exists()
    with h5py.File(tmp_path / "s_iter_4.caffemodel.h5", "r") as f:
        assert sorted(f["data"].keys()) == ["d", "ip1", "ip1b", "ip2", "loss", "relu", "sum"]
        assert sorted(f["data/ip1"].keys()) == ["0", "1"]
        assert sorted(f["data/ip1b"].keys()) == ["1"]         # blob 0 is ip1's: owners only
        assert f["data/ip1/0"].shape == (12, 784) and f["data/ip1/0"].dtype == np.float32
        net = trainer.net
        blob = net.blob_param("ip2")[0]
        assert np.array_equal(f["data/ip2/0"][()],
                              net.params[blob.offset:blob.offset + blob.size].reshape(10, 12))
    with h5py.File(state, "r") as f:
        assert f["iter"][()] == 2 and f["iter"].dtype == np.int32 and f["iter"].shape == ()
        assert f["current_step"][()] == 1
        assert f["learned_net"][()].rstrip(b"\0").decode() == str(model)
        # Adam: every blob's first moment, then every blob's second.
        assert sorted(f["history"].keys(), key=int) == [str(k) for k in range(10)]
        assert f["history/0"].shape == (12, 784) and f["history/5"].shape == (12, 784)
        resume = cgp_pb2.ResumeState.FromString(bytes(f["cgp_resume"][()]))
        assert resume.seed == 3


def test_resume_from_an_hdf5_state_is_bit_for_bit(tmp_path, mnist_dir):
    whole, _ = make(tmp_path, mnist_dir, max_iter=4)
    whole.solve()
    whole.close()
    resumed, lines = make(tmp_path / "again", mnist_dir, max_iter=4, threads=2)
    resumed.restore(tmp_path / "s_iter_2.solverstate.h5")
    assert resumed.iter == 2
    resumed.solve()
    resumed.close()
    assert np.array_equal(resumed.net.params, whole.net.params)
    for ours, theirs in zip(resumed.solver.histories, whole.solver.histories):
        assert np.array_equal(ours, theirs)


def test_weights_and_snapshot_options(tmp_path, mnist_dir):
    """`cgp train --weights X.caffemodel.h5` and `--snapshot X.solverstate.h5`."""
    trainer, _ = make(tmp_path, mnist_dir, max_iter=2)
    trainer.solve()
    trainer.close()
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "net.prototxt" type: "Adam" base_lr: 0.01 momentum: 0.9 '
                      'lr_policy: "fixed" display: 1 max_iter: 3 random_seed: 3 '
                      'snapshot_after_train: false')
    (tmp_path / "net.prototxt").write_text(NET)
    run = [sys.executable, "-m", "cgp", "train", "--solver", str(solver), "--data-dir",
           str(mnist_dir), "--no-log"]
    out = subprocess.run(run + ["--weights", str(tmp_path / "s_iter_2.caffemodel.h5")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Copied weights of 3 layers" in out.stdout
    out = subprocess.run(run + ["--snapshot", str(tmp_path / "s_iter_2.solverstate.h5")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Iteration 2" in out.stdout and "Iteration 0," not in out.stdout


def caffe_made_model(path, layers):
    """An HDF5 model in the layout of Caffe's ToHDF5: {layer: {blob index: array}}."""
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        for name, blobs in layers.items():
            group = data.create_group(name)
            for j, array in blobs.items():
                group.create_dataset(str(j), data=np.asarray(array, np.float32))


def test_a_model_caffe_wrote(tmp_path, mnist_dir):
    """Layer groups without blobs, a shared blob left out, legacy 4-d shapes: loaded."""
    trainer, _ = make(tmp_path, mnist_dir)
    net = trainer.net
    rng = np.random.default_rng(0)
    w1, b1, b1b = rng.standard_normal((12, 784)), rng.standard_normal(12), rng.standard_normal(12)
    w2 = rng.standard_normal((1, 1, 10, 12))
    caffe_made_model(tmp_path / "caffe.caffemodel.h5", {
        "d": {}, "ip1": {0: w1, 1: b1}, "ip1b": {1: b1b}, "ip2": {0: w2, 1: np.zeros(10)},
        "gone": {0: [1.0]}, "ip1_split": {}})
    trainer.load_weights(tmp_path / "caffe.caffemodel.h5")
    trainer.close()

    def get(name, j):
        blob = net.blob_param(name)[j]
        return net.params[blob.offset:blob.offset + blob.size].reshape(blob.shape)
    assert np.array_equal(get("ip1", 0), w1.astype(np.float32))
    assert np.array_equal(get("ip1b", 0), w1.astype(np.float32))   # shared: ip1's
    assert np.array_equal(get("ip1b", 1), b1b.astype(np.float32))
    assert np.array_equal(get("ip2", 0), w2[0, 0].astype(np.float32))
    # A blob the layer owns, missing: refused by name.
    caffe_made_model(tmp_path / "short.caffemodel.h5", {"ip1": {1: b1}})
    with pytest.raises(DataError, match="layer 'ip1' has no blob 0"):
        make(tmp_path, mnist_dir)[0].load_weights(tmp_path / "short.caffemodel.h5")


def test_a_solver_state_caffe_wrote(tmp_path, mnist_dir):
    """H5LT's scalar int datasets and a null-terminated string: read as Caffe reads them,
    the data restarting at the first record (no cgp resume record)."""
    trainer, _ = make(tmp_path, mnist_dir)
    trainer.snapshot()
    model = tmp_path / "s_iter_0.caffemodel.h5"
    history = [np.full(b.shape, 0.5, np.float32) for b in trainer.net.param_blobs] * 2
    with h5py.File(tmp_path / "caffe.solverstate.h5", "w") as f:
        f.create_dataset("iter", data=np.int32(7))
        string = h5py.h5t.C_S1.copy()
        string.set_size(len(str(model)) + 1)
        string.set_strpad(h5py.h5t.STR_NULLTERM)
        space = h5py.h5s.create(h5py.h5s.SCALAR)
        h5py.h5d.create(f.id, b"learned_net", string, space).write(
            space, space, np.array(str(model).encode() + b"\0", dtype=f"S{len(str(model)) + 1}"))
        f.create_dataset("current_step", data=np.int32(3))
        for k, array in enumerate(history):
            f.create_dataset(f"history/{k}", data=array)
    lines = []
    trainer.log = lines.append
    trainer.restore(tmp_path / "caffe.solverstate.h5")
    trainer.close()
    assert trainer.iter == 7 and trainer.data_origin == 7 and trainer.solver.current_step == 3
    assert all(np.all(h == 0.5) for h in trainer.solver.histories)
    assert any("Caffe wrote it" in line for line in lines)


def test_bad_hdf5_files_are_one_error(tmp_path, mnist_dir):
    trainer, _ = make(tmp_path, mnist_dir)
    net, solver = trainer.net, trainer.solver
    (tmp_path / "fake.caffemodel.h5").write_bytes(b"not hdf5 at all")
    with h5py.File(tmp_path / "empty.caffemodel.h5", "w") as f:
        f.create_group("weights")
    with h5py.File(tmp_path / "short.solverstate.h5", "w") as f:
        f.create_dataset("iter", data=np.int32(1))
        f.create_dataset("current_step", data=np.int32(0))
        f.create_dataset("history/0", data=np.zeros(3, np.float32))
    cases = [(read_caffemodel, "fake.caffemodel.h5", "not an HDF5 file"),
             (read_caffemodel, "empty.caffemodel.h5", "no group 'data'"),
             (lambda p: read_solverstate(p, solver, net), "short.solverstate.h5",
              "1 history blobs, the Adam solver on this net needs 10"),
             (lambda p: read_solverstate(p, solver, net), "fake.caffemodel.h5",
              "not an HDF5 file")]
    for read, name, why in cases:
        with pytest.raises(DataError, match=why) as info:
            read(tmp_path / name)
        assert str(tmp_path / name) in str(info.value)
    trainer.close()


def test_pycaffe_save_hdf5_and_load_hdf5(caffe_dir, tmp_path):
    import cgp as caffe
    net = caffe.Net(str(caffe_dir / "prototxt" / "lenet.prototxt"), caffe.TEST)
    net.params["ip2"][0].data[...] = np.arange(5000, dtype=np.float32).reshape(10, 500)
    net.save_hdf5(str(tmp_path / "lenet.weights"))       # HDF5 whatever the name
    assert (tmp_path / "lenet.weights").read_bytes()[:4] == b"\x89HDF"
    other = caffe.Net(str(caffe_dir / "prototxt" / "lenet.prototxt"), caffe.TEST)
    other.load_hdf5(str(tmp_path / "lenet.weights"))
    for name in net.params:
        for ours, theirs in zip(net.params[name], other.params[name]):
            assert np.array_equal(ours.data, theirs.data)


def test_an_hdf5_pair_cut_short_is_completed(tmp_path, mnist_dir):
    """snapshot.write_snapshot's commit order holds for HDF5 pairs: a .solverstate.h5's
    temporary file left alone is completed by the next run on the prefix, the model's
    temporary file of an unfinished write removed."""
    from cgp.snapshot import pair_temp, recover_snapshots, state_bytes
    trainer, _ = make(tmp_path, mnist_dir)
    model, state = tmp_path / "s_iter_5.caffemodel.h5", tmp_path / "s_iter_5.solverstate.h5"
    pair_temp(state).write_bytes(state_bytes(state, 5, model, trainer.solver, trainer.net))
    pair_temp(tmp_path / "s_iter_6.caffemodel.h5").write_bytes(b"half")
    lines = []
    assert recover_snapshots(str(tmp_path / "s"), lines.append) == [state]
    trainer.close()
    assert state.is_file() and not pair_temp(state).exists()
    assert not pair_temp(tmp_path / "s_iter_6.caffemodel.h5").exists()
    with h5py.File(state, "r") as f:
        assert f["iter"][()] == 5
