"""The other data layers and databases: HDF5Data (a list of .h5 files), DummyData, LevelDB
databases (the siamese example's data layers unchanged), clear errors for each one's bad
input, and for a missing optional package (Pillow, h5py, plyvel) the extra to install."""
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from cgp.errors import DataError, NetError
from cgp.layers import REGISTRY
from cgp.net import RunOptions
from cgp.proto import caffe_pb2
from cgp.prototxt import read_net


def layer(text, phase=caffe_pb2.TRAIN):
    lp = text_format.Parse(text, caffe_pb2.LayerParameter())
    made = REGISTRY[lp.type](lp, index=2, phase=phase)
    made.options = RunOptions()
    return made, made.setup([])


# -- HDF5Data ---------------------------------------------------------------------------------

@pytest.fixture
def h5files(tmp_path):
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(0)
    data = rng.standard_normal((9, 2, 3))
    labels = np.arange(9, dtype=np.int64)
    for name, rows in (("a.h5", slice(0, 4)), ("b.h5", slice(4, 9))):
        with h5py.File(tmp_path / name, "w") as f:
            f["data"] = data[rows]          # float64, read as float32
            f["label"] = labels[rows]
    (tmp_path / "files.txt").write_text(f"{tmp_path / 'a.h5'}\n\n{tmp_path / 'b.h5'}\n")
    return tmp_path, data.astype(np.float32), labels


def hdf5_layer(folder, batch=4, shuffle=False, tops=("data", "label")):
    tops = " ".join(f'top: "{t}"' for t in tops)
    return layer(f'name: "h" type: "HDF5Data" {tops} hdf5_data_param {{ source: '
                 f'"{folder / "files.txt"}" batch_size: {batch} shuffle: {str(shuffle).lower()} }}')


def test_hdf5_data_reads_rows_across_files(h5files):
    folder, data, labels = h5files
    h, shapes = hdf5_layer(folder)
    assert shapes == [(4, 2, 3), (4,)] and len(h) == 9
    for start in (0, 3, 7, 16):
        rows = (start + np.arange(4)) % 9
        got_data, got_labels = h.load(start, 0, 0)
        assert got_data.dtype == np.float32 and np.array_equal(got_data, data[rows])
        assert np.array_equal(got_labels, labels[rows])
    assert np.array_equal(h.load(3, 0, 0, range(1, 3))[1], labels[[4, 5]])
    h.close()


def test_hdf5_data_shuffle_is_a_permutation_per_epoch(h5files):
    """Files in a fresh order each epoch, and each file's rows: a function of (seed, epoch)
    that any split of a batch reads the same."""
    folder, data, labels = h5files
    h, _ = hdf5_layer(folder, batch=3, shuffle=True)
    epochs = [np.concatenate([h.load(e * 9 + s, 0, 4)[1] for s in (0, 3, 6)]) for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(9))
        first = epoch[:4] if epoch[0] < 4 else epoch[:5]     # one file's rows, then the other's
        assert set(first.tolist()) in ({0, 1, 2, 3}, {4, 5, 6, 7, 8})
    assert not all(np.array_equal(epochs[0], e) for e in epochs[1:])
    assert np.array_equal(h.load(9, 0, 4, range(1, 3))[1], epochs[1][1:3])
    again, _ = hdf5_layer(folder, batch=3, shuffle=True)
    assert np.array_equal(again.load(9, 0, 4)[1], epochs[1][:3])
    other_seed = np.concatenate([again.load(s, 0, 5)[1] for s in (0, 3, 6)])
    assert not np.array_equal(other_seed, epochs[0])
    h.close()
    again.close()


def test_hdf5_data_mistakes(h5files):
    folder, _, _ = h5files
    with pytest.raises(DataError, match=rf"layer 'h': HDF5 file {folder}/a.h5 has no dataset "
                                        r"'weight' .*it holds: data, label"):
        hdf5_layer(folder, tops=("data", "weight"))
    (folder / "files.txt").write_text("nowhere.h5\n")
    with pytest.raises(DataError, match=r"HDF5 file nowhere.h5 \(listed in .*files.txt\): "
                                        "cannot open"):
        hdf5_layer(folder)
    (folder / "files.txt").write_text("\n")
    with pytest.raises(DataError, match="names no files"):
        hdf5_layer(folder)
    import h5py
    with h5py.File(folder / "c.h5", "w") as f:
        f["data"] = np.zeros((3, 2, 3))
        f["label"] = np.zeros(2)
    (folder / "files.txt").write_text(f"{folder / 'c.h5'}\n")
    with pytest.raises(DataError, match=r"c.h5: the datasets \['data', 'label'\] hold \[2, 3\]"):
        hdf5_layer(folder)


# -- DummyData ---------------------------------------------------------------------------------

def test_dummy_data_fills_each_top():
    dummy, shapes = layer('name: "x" type: "DummyData" top: "a" top: "b" top: "c" '
                          'dummy_data_param { shape { dim: 6 dim: 3 dim: 2 } shape { dim: 6 } '
                          'shape { dim: 6 dim: 4 } data_filler { type: "gaussian" std: 2 } '
                          'data_filler { type: "constant" value: 3 } '
                          'data_filler { type: "xavier" variance_norm: FAN_OUT } }')
    assert shapes == [(6, 3, 2), (6,), (6, 4)]
    a, b, c = dummy.load(0, 5, 1)
    assert np.all(b == 3) and a.dtype == np.float32 and 1 < a.std() < 3
    assert np.abs(c).max() <= np.sqrt(3.0 / 6)    # FAN_OUT of the whole (6, 4) blob: 6
    again = dummy.load(0, 5, 1)
    assert all(np.array_equal(x, y) for x, y in zip((a, b, c), again))
    assert not np.array_equal(dummy.load(0, 6, 1)[0], a)           # refilled each iteration
    part = dummy.load(0, 5, 1, range(2, 5))
    assert all(np.array_equal(x[2:5], y) for x, y in zip((a, b, c), part))
    legacy, shapes = layer('name: "x" type: "DummyData" top: "a" top: "b" dummy_data_param { '
                           'num: 2 channels: 3 channels: 1 height: 4 width: 5 }')
    assert shapes == [(2, 3, 4, 5), (2, 1, 4, 5)] and not legacy.load(0, 0, 0)[0].any()


def test_dummy_data_mistakes():
    for param, why in (('shape { dim: 2 } num: 2', "not both"),
                       ('shape { dim: 2 } data_filler {} data_filler {} data_filler {}',
                        "3 data_filler entries for 2 tops"),
                       ('shape { dim: 2 } data_filler { type: "magic" }', "unknown filler"),
                       ('num: 1 num: 2 num: 3 channels: 1 height: 1 width: 1', "one per top")):
        with pytest.raises(NetError, match=why):
            layer(f'name: "x" type: "DummyData" top: "a" top: "b" dummy_data_param {{ {param} }}')


# -- LevelDB ----------------------------------------------------------------------------------

def write_leveldb(path, images, labels):
    plyvel = pytest.importorskip("plyvel")
    db = plyvel.DB(str(path), create_if_missing=True)
    for i, (image, label) in enumerate(zip(images, labels)):
        c, h, w = image.shape
        db.put(f"{i:08d}".encode(), caffe_pb2.Datum(channels=c, height=h, width=w,
                                                    data=image.tobytes(),
                                                    label=int(label)).SerializeToString())
    db.close()


@pytest.mark.parametrize("cache", [None, 0], ids=["memory", "streamed"])
def test_the_siamese_examples_leveldb_data_layers(caffe_dir, tmp_path, monkeypatch, cache):
    """mnist_siamese_train_test.prototxt's Data layers, unchanged (backend: LEVELDB, scale),
    on LevelDBs of pairs where the example expects them."""
    from cgp.data import lmdb_data
    monkeypatch.setattr(lmdb_data, "CACHE_BYTES", lmdb_data.CACHE_BYTES if cache is None else 0)
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    pairs = rng.integers(0, 256, (70, 2, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 2, 70)
    folder = tmp_path / "examples" / "siamese"
    folder.mkdir(parents=True)
    for name in ("mnist_siamese_train_leveldb", "mnist_siamese_test_leveldb"):
        write_leveldb(folder / name, pairs, labels)
    net = read_net(caffe_dir / "zoo" / "mnist_siamese" / "mnist_siamese_train_test.prototxt")
    for lp in net.layer[:2]:
        data = REGISTRY["Data"](lp, index=0, phase=lp.include[0].phase)
        data.options = RunOptions()
        shapes = data.setup([])
        batch = 64 if lp.include[0].phase == caffe_pb2.TRAIN else 100
        assert shapes == [(batch, 2, 28, 28), (batch,)]
        x, y = data.load(60, 0, 0, range(3, 7))
        rows = (60 + np.arange(3, 7)) % 70
        assert np.array_equal(x, pairs[rows].astype(np.float32) * np.float32(0.00390625))
        assert np.array_equal(y, labels[rows]) and data.records.cached == (cache is None)
        data.close()


def test_a_leveldb_that_is_not_one(tmp_path):
    pytest.importorskip("plyvel")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "CURRENT").write_text("MANIFEST-000001\n")
    with pytest.raises(DataError, match=r"^layer 'd': LevelDB fake: cannot open: Corruption"):
        data_layer(tmp_path, "fake", "backend: LEVELDB")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match=r"LevelDB plain: cannot open: Invalid argument"):
        data_layer(tmp_path, "plain", "backend: LEVELDB")


def data_layer(folder, source, extra=""):
    import os
    here = os.getcwd()
    os.chdir(folder)
    try:
        return layer(f'name: "d" type: "Data" top: "data" data_param {{ source: "{source}" '
                     f'batch_size: 2 {extra} }}')
    finally:
        os.chdir(here)


def test_two_readers_in_a_process_share_a_leveldb(tmp_path):
    """LevelDB lets one handle open a database: a train and a test net reading one share it."""
    write_leveldb(tmp_path / "db", np.zeros((3, 1, 2, 2), np.uint8), [0, 1, 2])
    from cgp.data.leveldb_data import LevelDbRecords
    first = LevelDbRecords(tmp_path / "db", cache_bytes=0)
    second = LevelDbRecords(tmp_path / "db", cache_bytes=0)
    assert first.read(1, 2)[1].tolist() == second.read(1, 2)[1].tolist() == [1, 2]
    first.close()
    second.close()


# -- the optional packages ----------------------------------------------------------------------

def test_each_missing_package_names_its_extra(tmp_path):
    """cgp imports without Pillow, h5py and plyvel; a net that needs one says which extra
    installs it, in one line."""
    (tmp_path / "list.txt").write_text("x.png 0\n")
    (tmp_path / "files.txt").write_text("x.h5\n")
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "CURRENT").write_text("x")
    (tmp_path / "x.png").write_bytes(b"")
    code = """
import sys
sys.modules["PIL"] = sys.modules["h5py"] = sys.modules["plyvel"] = None
import cgp.cli, cgp.train, cgp.layers, cgp.data.convert, cgp.snapshot
from google.protobuf import text_format
from cgp.errors import CgpError
from cgp.net import Net
from cgp.proto import caffe_pb2
for text in ('type: "ImageData" top: "d" top: "l" image_data_param { source: "list.txt" }',
             'type: "HDF5Data" top: "d" hdf5_data_param { source: "files.txt" batch_size: 1 }',
             'type: "Data" top: "d" data_param { source: "db" batch_size: 1 backend: LEVELDB }'):
    net = text_format.Parse('layer { name: "x" ' + text + ' }', caffe_pb2.NetParameter())
    try:
        Net(net)
    except CgpError as e:
        print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stderr
    for line, extra in zip(lines, ("images", "hdf5", "leveldb")):
        assert f"pip install 'cgp[{extra}]'" in line, line
