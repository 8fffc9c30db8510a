"""Caffe LMDB databases as Data-layer sources: Datum records (raw bytes and float_data) in
key order, the streaming reader against the in-memory one, clear errors for what is not a
Datum database, Caffe's TransformationParameter, and `cgp convert` (encoded records and
images: tests/test_images.py)."""
import subprocess
import sys

import gc

import numpy as np
import pytest
from google.protobuf import text_format

from cgp.data import lmdb_data
from cgp.data.convert import convert
from cgp.datasets import store
from cgp.errors import CgpError, DataError, NetError
from cgp.layers.data import DataLayer
from cgp.net import RunOptions
from cgp.proto import caffe_pb2
from cgp.train import RunConfig, Trainer

lmdb = pytest.importorskip("lmdb")


def datum(image, label):
    if image.dtype == np.uint8:
        d = caffe_pb2.Datum(data=image.tobytes(), label=int(label))
    else:
        d = caffe_pb2.Datum(float_data=image.ravel().tolist(), label=int(label))
    d.channels, d.height, d.width = image.shape
    return d.SerializeToString()


def write_db(path, values, keys=None):
    """An LMDB with the given values under keys '%08d' (or `keys`), put in reverse order
    so that key order, not insertion order, must decide the record order."""
    keys = keys or [f"{i:08d}".encode() for i in range(len(values))]
    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for key, value in reversed(list(zip(keys, values))):
            txn.put(key, value)
    env.close()
    return path


def records(n, shape=(3, 6, 7), dtype=np.uint8, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.uint8:
        images = rng.integers(0, 256, (n,) + shape).astype(np.uint8)
    else:
        images = rng.standard_normal((n,) + shape).astype(np.float32)
    labels = rng.integers(0, 10, n)
    return images, labels


@pytest.fixture
def raw_db(tmp_path):
    images, labels = records(37)
    write_db(tmp_path / "raw_lmdb", [datum(i, l) for i, l in zip(images, labels)])
    return tmp_path / "raw_lmdb", images, labels


@pytest.mark.parametrize("cache", [None, 0], ids=["memory", "streamed"])
def test_raw_records_in_key_order_with_wrapping(raw_db, cache, monkeypatch):
    monkeypatch.setattr(lmdb_data, "ANCHOR_STRIDE", 4)   # seeks between anchors
    path, images, labels = raw_db
    db = lmdb_data.LmdbRecords(path, cache_bytes=cache)
    assert db.cached == (cache is None)
    assert len(db) == 37 and db.shape == (3, 6, 7)
    # In order, wrapping, jumping back and forth, and the same batch twice.
    for start in (0, 8, 16, 30, 5, 5, 36, 74, 1):
        index = (start + np.arange(8)) % 37
        got_images, got_labels = db.read(start, 8)
        assert np.array_equal(got_images, images[index].astype(got_images.dtype))
        assert np.array_equal(got_labels, labels[index])
    db.close()


def test_the_reader_thread_reads_ahead_where_the_next_read_starts(raw_db):
    """A process reading its samples of each batch (MPI) reads `count` records `batch`
    apart: the reader guesses the next start from the last two, not start + count."""
    path, images, _ = raw_db
    db = lmdb_data.LmdbRecords(path, cache_bytes=0)
    db.read(3, 4)
    assert db._pending[:2] == (7, 4)             # no history yet: the records that follow
    db.read(13, 4)
    assert db._pending[:2] == (23, 4)            # 10 apart
    got, _ = db.read(23, 4)
    assert np.array_equal(got, images[23:27].astype(np.float32))
    db.close()


def test_a_dropped_reader_is_shut_down_by_the_next_one_not_by_the_collector(tmp_path):
    """A reader dropped without close() is finalized by the garbage collector on whichever
    thread allocates, perhaps while it holds a lock shutting down needs (the thread pool's
    global lock while it starts a thread: that hung the suite). The finalizer only queues
    the shutdown; the next reader opened runs it: thread stopped, database released."""
    first, second = tmp_path / "first", tmp_path / "second"
    for path in (first, second):
        write_db(path, [datum(i, l) for i, l in zip(*records(2))])
    dropped = lmdb_data.LmdbRecords(first, cache_bytes=0)   # not cached: a reader thread
    dropped.read(0, 2)
    reader = dropped._reader
    del dropped
    gc.collect()
    assert len(lmdb_data._ORPHANS) == 1 and str(first.resolve()) in lmdb_data._ENVS
    assert not reader._shutdown
    other = lmdb_data.LmdbRecords(second, cache_bytes=0)
    assert not lmdb_data._ORPHANS and str(first.resolve()) not in lmdb_data._ENVS
    assert reader._shutdown
    other.close()
    assert str(second.resolve()) not in lmdb_data._ENVS


def test_float_data_records(tmp_path):
    images, labels = records(9, (2, 3, 4), np.float32)
    path = write_db(tmp_path / "float_lmdb", [datum(i, l) for i, l in zip(images, labels)])
    for cache in (None, 0):
        db = lmdb_data.LmdbRecords(path, cache_bytes=cache)
        got, got_labels = db.read(0, 9)
        db.close()
        assert got.dtype == np.float32 and np.array_equal(got, images)
        assert np.array_equal(got_labels, labels)


def test_float_records_among_raw_ones(tmp_path):
    images, labels = records(5, (1, 2, 2))
    values = [datum(i, l) for i, l in zip(images, labels)]
    values[3] = datum(np.full((1, 2, 2), 0.5, np.float32), 1)
    db = lmdb_data.LmdbRecords(write_db(tmp_path / "mixed", values))
    got, _ = db.read(0, 5)
    assert got.dtype == np.float32 and got[3].tolist() == [[[0.5, 0.5], [0.5, 0.5]]]
    assert np.array_equal(got[4], images[4])


def expect_error(path, *fragments, cache=None):
    with pytest.raises(DataError) as info:
        db = lmdb_data.LmdbRecords(path, cache_bytes=cache)
        db.read(0, len(db))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_encoded_bytes_that_are_no_image_are_refused(tmp_path):
    """Encoded records decode (tests/test_images.py); bytes that are no image say so."""
    pytest.importorskip("PIL")
    d = caffe_pb2.Datum(channels=3, height=4, width=4, data=b"\xff\xd8\xff\xe0JFIF", encoded=True)
    path = write_db(tmp_path / "jpeg_lmdb", [d.SerializeToString()])
    expect_error(path, str(path), "key 00000000", "not an image that can be decoded")


@pytest.mark.parametrize("cache", [None, 0], ids=["memory", "streamed"])
@pytest.mark.parametrize("value,why", [
    (b"\xff\xff\xff\xff garbage", "not a caffe Datum"),
    (caffe_pb2.BlobProto(data=[1.0, 2.0]).SerializeToString(), "not a caffe Datum"),
    (caffe_pb2.Datum(channels=1, height=2, width=2, data=b"abc").SerializeToString(),
     "3 data bytes"),
    (b"", "channels x height x width is 0 x 0 x 0"),
])
def test_records_that_are_not_datums_are_refused(tmp_path, value, why, cache):
    images, labels = records(4, (1, 2, 2))
    values = [datum(i, l) for i, l in zip(images, labels)]
    values[2] = value     # a bad record in the middle: found when that batch is read
    path = write_db(tmp_path / "bad_lmdb", values)
    expect_error(path, str(path), "record 2", "key 00000002", why, cache=cache)


def test_records_of_different_shapes_are_refused(tmp_path):
    values = [datum(np.zeros((1, 2, 2), np.uint8), 0), datum(np.zeros((1, 3, 2), np.uint8), 0)]
    expect_error(write_db(tmp_path / "shapes", values), "record 1", "(1, 3, 2)", "one shape")


def test_empty_and_foreign_folders(tmp_path):
    expect_error(write_db(tmp_path / "empty", []), "holds no records")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.mdb").write_bytes(b"not an lmdb file" * 512)
    expect_error(tmp_path / "foreign", "foreign", "cannot open")


def data_layer(source, transform="", phase=caffe_pb2.TRAIN, batch=4, backend=""):
    lp = text_format.Parse(f'name: "d" type: "Data" top: "data" top: "label" '
                           f'data_param {{ source: "{source}" batch_size: {batch} {backend} }} '
                           f'transform_param {{ {transform} }}', caffe_pb2.LayerParameter())
    layer = DataLayer(lp, index=0, phase=phase)
    layer.options = RunOptions()
    layer.setup([])
    return layer


def test_source_paths_are_relative_to_the_working_directory(raw_db, monkeypatch):
    path, images, _ = raw_db
    monkeypatch.chdir(path.parent)
    layer = data_layer(path.name, backend="backend: LMDB")
    assert np.array_equal(layer.load(35, 0, 0)[0], images[[35, 36, 0, 1]].astype(np.float32))
    with pytest.raises(DataError, match=r"layer 'd': data source 'nowhere_lmdb' not found.*"
                                        r"relative to the working directory"):
        data_layer("nowhere_lmdb")
    with pytest.raises(DataError, match="is an LMDB database but its backend is given as "
                                        "LEVELDB: set backend: LMDB"):
        data_layer(path.name, backend="backend: LEVELDB")
    (path.parent / "empty").mkdir()
    with pytest.raises(DataError, match="holds neither data.mdb .LMDB. nor CURRENT .LevelDB."):
        data_layer("empty")
    with pytest.raises(NetError, match="data_param.scale is Caffe's old place"):
        data_layer(path.name, backend="scale: 0.5")


def test_missing_lmdb_package_is_explained(raw_db, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdb", None)
    monkeypatch.setattr(lmdb_data, "_ENVS", {})
    with pytest.raises(DataError, match=r"needs the 'lmdb' package: pip install 'cgp\[lmdb\]'"):
        lmdb_data.LmdbRecords(raw_db[0])


def test_importing_cgp_does_not_need_lmdb():
    code = ("import sys; sys.modules['lmdb'] = None; import cgp.cli, cgp.train, cgp.layers.data, "
            "cgp.data.convert, cgp.commands.testing; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def write_mean(path, mean, legacy):
    blob = caffe_pb2.BlobProto()
    if legacy:       # compute_image_mean's form: num, channels, height, width
        blob.num, (blob.channels, blob.height, blob.width) = 1, mean.shape
    else:
        blob.shape.dim.extend((1,) + mean.shape)
    blob.data.extend(mean.ravel().tolist())
    path.write_bytes(blob.SerializeToString())
    return path


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy_shape", "shape"])
def test_scale_and_mean_file(raw_db, tmp_path, legacy):
    path, images, _ = raw_db
    mean = np.random.default_rng(1).uniform(0, 255, images.shape[1:]).astype(np.float32)
    mean_file = write_mean(tmp_path / "mean.binaryproto", mean, legacy)
    layer = data_layer(path, f'scale: 0.0078125 mean_file: "{mean_file}"')
    data, labels = layer.load(0, 0, 0)
    want = (images[:4].astype(np.float32) - mean) * np.float32(0.0078125)
    assert data.dtype == np.float32 and np.array_equal(data, want)
    with pytest.raises(DataError, match="mean_file .*missing.binaryproto: cannot read"):
        data_layer(path, 'mean_file: "missing.binaryproto"')
    with pytest.raises(NetError, match="has shape"):
        data_layer(path, f'mean_file: "{write_mean(tmp_path / "small", mean[:1], legacy)}"')


def test_transform_kernel_is_caffes_float32_arithmetic():
    """kernels.data.transform against NumPy's float32 operations one at a time, bitwise:
    uint8 and float32 records, with and without a mean, with a scale of 1 and another."""
    from cgp.kernels.data import transform
    rng = np.random.default_rng(3)
    mean = rng.uniform(0, 255, 30).astype(np.float32)
    for records in (rng.integers(0, 256, (5, 30)).astype(np.uint8),
                    rng.standard_normal((5, 30)).astype(np.float32) * 100):
        for scale in (np.float32(1), np.float32(0.00390625), np.float32(0.017)):
            out = np.empty(records.shape, np.float32)
            transform(records, np.empty(0, np.float32), scale, out)
            assert np.array_equal(out, records.astype(np.float32) * scale)
            transform(records, mean, scale, out)
            assert np.array_equal(out, (records.astype(np.float32) - mean) * scale)


def test_records_in_memory_read_as_views_or_wrapped_copies():
    from cgp.data.lmdb_data import ArrayRecords
    images = np.arange(5 * 2 * 3 * 3, dtype=np.uint8).reshape(5, 2, 3, 3)
    records = ArrayRecords(images, np.arange(5))
    for start, want in ((1, [1, 2, 3]), (7, [2, 3, 4]), (4, [4, 0, 1]), (13, [3, 4, 0])):
        got, labels = records.read(start, 3)
        assert np.array_equal(got, images[want]) and np.array_equal(labels, want)


def test_mean_value(raw_db):
    path, images, _ = raw_db
    layer = data_layer(path, "mean_value: 10 mean_value: 20 mean_value: 30.5")
    want = images[:4].astype(np.float32) - np.array([10, 20, 30.5], np.float32)[:, None, None]
    assert np.array_equal(layer.load(0, 0, 0)[0], want)
    with pytest.raises(NetError, match="2 mean_value entries for 3 channels"):
        data_layer(path, "mean_value: 1 mean_value: 2")


def test_crop_and_mirror(raw_db):
    path, images, _ = raw_db
    x = images.astype(np.float32)
    test = data_layer(path, "crop_size: 4", phase=caffe_pb2.TEST, batch=8)
    assert np.array_equal(test.load(0, 0, 0)[0], x[:8, :, 1:5, 1:5])   # the centre
    train = data_layer(path, "crop_size: 4 mirror: true", batch=16)
    a, b = train.load(0, 3, 7)[0], train.load(0, 3, 7)[0]
    assert np.array_equal(a, b)                                  # a function of its keys
    assert not np.array_equal(a, train.load(0, 4, 7)[0])         # another iteration
    flips = 0
    for s in range(16):
        windows = [x[s, :, t:t + 4, l:l + 4] for t in range(3) for l in range(4)]
        plain = any(np.array_equal(a[s], w) for w in windows)
        flipped = any(np.array_equal(a[s], w[..., ::-1]) for w in windows)
        assert plain or flipped
        flips += flipped and not plain
    assert 0 < flips < 16
    # Per-sample streams: sample s draws the same in a batch of 16 and in one of 5.
    five = data_layer(path, "crop_size: 4 mirror: true", batch=5)
    assert np.array_equal(five.load(0, 3, 7)[0], a[:5])


NET = """
name: "tiny"
layer {{ name: "d" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.0039 crop_size: 5 mirror: true mean_value: 100 }}
  data_param {{ source: "{source}" batch_size: 10 backend: LMDB }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "drop" type: "Dropout" bottom: "conv" top: "conv" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


def lmdb_solver(source, **fields):
    sp = text_format.Parse('base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" display: 0 '
                           'random_seed: 5 snapshot_after_train: false',
                           caffe_pb2.SolverParameter())
    text_format.Parse(NET.format(source=source), sp.net_param)
    for key, value in fields.items():
        setattr(sp, key, value)
    return sp


def test_training_from_lmdb_is_split_thread_and_reader_invariant(raw_db, monkeypatch):
    """Crop, mirror and dropout on an LMDB: the same bits at 1 and 3 threads, with the
    records in memory or streamed by the prefetching reader thread."""
    path = raw_db[0]
    runs = []
    for threads, cache in ((1, None), (3, 0), (2, 0)):
        monkeypatch.setattr(lmdb_data, "CACHE_BYTES", lmdb_data.CACHE_BYTES if cache is None else 0)
        trainer = Trainer(lmdb_solver(str(path)), None, RunConfig(threads=threads, chunks=3,
                                                                  progress=False),
                          log=lambda line: None)
        assert trainer.net.sources[0].layer.records.cached == (cache is None)
        losses = [trainer.step()[0] for _ in range(6)]    # 60 records: wraps around 37
        trainer.close()
        runs.append((losses, trainer.net.params.copy()))
    assert all(r[0] == runs[0][0] and np.array_equal(r[1], runs[0][1]) for r in runs)


def test_convert_mnist_and_cifar10(mnist_dir, cifar_dir, tmp_path):
    for name, data_dir, digits, split in (("mnist", mnist_dir, 8, "train"),
                                          ("cifar10", cifar_dir, 5, "test")):
        out = tmp_path / f"{name}_lmdb"
        mean = tmp_path / f"{name}_mean.binaryproto"
        convert(name, out, split=split, data_dir=str(data_dir), mean=mean, log=lambda line: None)
        images, labels = store.load(name, split, str(data_dir))
        env = lmdb.open(str(out), readonly=True, lock=False)
        with env.begin() as txn:
            keys = [bytes(k) for k, _ in txn.cursor()]
            first = caffe_pb2.Datum.FromString(txn.get(keys[0]))
        env.close()
        assert keys == [f"{i:0{digits}d}".encode() for i in range(len(images))]
        assert (first.channels, first.height, first.width) == images.shape[1:]
        assert first.data == images[0].tobytes() and first.label == labels[0]
        db = lmdb_data.LmdbRecords(out)
        got_images, got_labels = db.read(0, len(images))
        assert np.array_equal(got_images, images) and np.array_equal(got_labels, labels)
        blob = caffe_pb2.BlobProto.FromString(mean.read_bytes())
        assert (blob.num, blob.channels, blob.height, blob.width) == (1,) + images.shape[1:]
        want = images.astype(np.float64).mean(axis=0)
        assert np.allclose(np.array(blob.data).reshape(want.shape), want, rtol=1e-6)
    with pytest.raises(CgpError, match="already exists"):
        convert("mnist", tmp_path / "mnist_lmdb", data_dir=str(mnist_dir), log=lambda line: None)


def test_convert_command_line(mnist_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "cgp", "convert", "mnist", "--to", "lmdb",
                          str(tmp_path / "db"), "--split", "test", "--data-dir", str(mnist_dir),
                          "--limit", "50"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Processed 50 files." in out.stdout
    assert len(lmdb_data.LmdbRecords(tmp_path / "db")) == 50
    again = subprocess.run([sys.executable, "-m", "cgp", "convert", "mnist", "--to", "lmdb",
                            str(tmp_path / "db"), "--data-dir", str(mnist_dir)],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert "Traceback" not in again.stderr
