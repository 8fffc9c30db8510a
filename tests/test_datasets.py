"""Tests of cgp.datasets: IDX, MNIST and CIFAR-10 readers on small generated files, the lookup
order, and downloads from a real HTTP server on 127.0.0.1 (no outside network)."""

import functools
import gzip
import hashlib
import http.server
import io
import socket
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

import cgp.datasets
from cgp.datasets import cifar10, mnist, store
from cgp.datasets.idx import read_idx
from cgp.errors import DataError


# ---------------------------------------------------------------- generated files

def idx_bytes(array):
    """The IDX encoding of a uint8 array: magic 0x000008DD, big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim])
    header += b"".join(size.to_bytes(4, "big") for size in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder, n_train=5, n_test=3, compress=True, seed=0):
    """Write the four MNIST files with random content; return {split: (images, labels)}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        for stem, array in zip(mnist.FILES[split], (images, labels)):
            data = idx_bytes(array)
            if compress:
                (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / stem).write_bytes(data)
        arrays[split] = (images, labels)
    return arrays


def cifar_bytes(images, labels):
    records = np.concatenate([labels[:, None], images.reshape(len(images), -1)], axis=1)
    return records.astype(np.uint8).tobytes()


def cifar_batches(n=4, seed=0):
    """{file name: (images (n, 3, 32, 32), labels (n,))} for the six batch files."""
    rng = np.random.default_rng(seed)
    names = cifar10.FILES["train"] + cifar10.FILES["test"]
    return {name: (rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
                   rng.integers(0, 10, n, dtype=np.uint8)) for name in names}


def write_cifar(folder, n=4, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    batches = cifar_batches(n, seed)
    for name, (images, labels) in batches.items():
        (folder / name).write_bytes(cifar_bytes(images, labels))
    return batches


def md5(path):
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------- fixtures

def refused_naming(path, match, load, *args):
    """load(*args) raises a DataError that matches and names path, the file at fault."""
    with pytest.raises(DataError, match=match) as info:
        load(*args)
    assert str(path) in str(info.value)


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    """No test sees the user's CGP_DATA_DIR or fills the user's real cache."""
    monkeypatch.delenv(store.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """(folder, base URL) of an HTTP server on 127.0.0.1 serving that folder."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01},
                              daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def refused_url():
    """A URL whose port is bound but not listening, so connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"


def register(monkeypatch, name, reader, folder, mirrors, members=()):
    """Add data set `name` to the registry, with the md5 sums of the files in folder."""
    sources = tuple(store.Source(path.name, "md5", md5(path)) for path in sorted(folder.iterdir()))
    spec = store.DataSet(reader=reader, sources=sources, mirrors=tuple(mirrors), members=members)
    monkeypatch.setitem(store.DATASETS, name, spec)
    return spec


# ---------------------------------------------------------------- IDX

@pytest.mark.parametrize("compress", [False, True])
def test_idx_reads_back(tmp_path, compress):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    data = idx_bytes(images)
    path = tmp_path / "images"
    path.write_bytes(gzip.compress(data) if compress else data)
    out = read_idx(path, ndim=3)
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, images)
    out[0, 0, 0] = 1  # callers get a writable array


def test_idx_gzip_detected_by_content_not_name(tmp_path):
    labels = np.array([3, 1, 4], dtype=np.uint8)
    plain_named_gz = tmp_path / "labels.gz"
    plain_named_gz.write_bytes(idx_bytes(labels))
    gzip_named_plain = tmp_path / "labels.idx"
    gzip_named_plain.write_bytes(gzip.compress(idx_bytes(labels)))
    np.testing.assert_array_equal(read_idx(plain_named_gz, ndim=1), labels)
    np.testing.assert_array_equal(read_idx(gzip_named_plain, ndim=1), labels)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_truncated(tmp_path, compress):
    data = idx_bytes(np.zeros((2, 3, 4), np.uint8))[:-4]
    path = tmp_path / "short-idx3-ubyte"
    path.write_bytes(gzip.compress(data) if compress else data)
    refused_naming(path, "truncated: expected 24 bytes of data, found 20", read_idx, path)


def test_idx_truncated_header(tmp_path):
    path = tmp_path / "header"
    path.write_bytes(bytes([0, 0, 8, 3]) + (2).to_bytes(4, "big"))
    refused_naming(path, "truncated", read_idx, path)


def test_idx_trailing_bytes(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(idx_bytes(np.zeros(5, np.uint8)) + b"junk")
    refused_naming(path, "4 unexpected bytes after the 5 bytes", read_idx, path)


def test_idx_wrong_magic(tmp_path):
    path = tmp_path / "notidx"
    path.write_bytes(b"\x12\x34\x56\x78" + bytes(20))
    refused_naming(path, "0x12345678", read_idx, path)


def test_idx_unsupported_type(tmp_path):
    path = tmp_path / "floats"
    path.write_bytes(bytes([0, 0, 0x0D, 1]) + (1).to_bytes(4, "big") + bytes(4))
    with pytest.raises(DataError, match=r"0x0000'?0D01.*float32.*not supported"):
        read_idx(path)


def test_idx_wrong_number_of_dimensions(tmp_path):
    path = tmp_path / "labels-given-as-images"
    path.write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    with pytest.raises(DataError, match=r"0x00000801 means 1-d data, expected 3-d \(0x00000803\)"):
        read_idx(path, ndim=3)


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_idx_corrupt_gzip(tmp_path, damage):
    data = bytearray(gzip.compress(idx_bytes(np.arange(200, dtype=np.uint8))))
    if damage == "cut":
        data = data[:len(data) // 2]
    else:
        data[-6] ^= 0xFF  # inside the CRC/size trailer
    path = tmp_path / "broken.gz"
    path.write_bytes(bytes(data))
    refused_naming(path, "corrupt gzip", read_idx, path)


def test_idx_missing_file(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        read_idx(tmp_path / "nothing")


# ---------------------------------------------------------------- MNIST

@pytest.mark.parametrize("compress", [False, True])
def test_mnist_load(tmp_path, compress):
    arrays = write_mnist(tmp_path, compress=compress)
    for split in ("train", "test"):
        images, labels = mnist.load(split, tmp_path)
        assert images.shape == (len(arrays[split][0]), 1, 28, 28) and images.dtype == np.uint8
        assert labels.dtype == np.uint8
        np.testing.assert_array_equal(images[:, 0], arrays[split][0])
        np.testing.assert_array_equal(labels, arrays[split][1])
    assert mnist.missing(tmp_path) == []


def test_mnist_count_mismatch(tmp_path):
    write_mnist(tmp_path, compress=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(2, np.uint8)))
    with pytest.raises(DataError, match="holds 3 images but .* holds 2 labels"):
        mnist.load("test", tmp_path)


def test_mnist_label_out_of_range(tmp_path):
    write_mnist(tmp_path, compress=False)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(idx_bytes(np.array([1, 10, 2], np.uint8)))
    refused_naming(path, "label 10 at index 1 is out of range", mnist.load, "test", tmp_path)


@pytest.mark.parametrize("dataset, write, gone, listed, message", [
    (mnist, write_mnist, "train-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte[.gz]",
     "train-labels-idx1-ubyte"),
    (cifar10, write_cifar, "data_batch_4.bin", "data_batch_4.bin",
     "data_batch_4.bin: CIFAR-10 batch file not found")], ids=["mnist", "cifar10"])
def test_a_missing_file_is_named(dataset, write, gone, listed, message, tmp_path):
    """A file of the train split gone: listed as missing, and named by the load that needs
    it; the test split does not need it."""
    write(tmp_path)
    (tmp_path / gone).unlink()
    assert dataset.missing(tmp_path) == [listed]
    with pytest.raises(DataError, match=message):
        dataset.load("train", tmp_path)
    dataset.load("test", tmp_path)


def test_mnist_bad_split(tmp_path):
    write_mnist(tmp_path)
    with pytest.raises(DataError, match="unknown MNIST split 'val'"):
        mnist.load("val", tmp_path)


def test_bundled_mnist_matches_its_checksums():
    folder = store.package_dir("mnist")
    sums = {}
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    assert sorted(sums) == sorted(f"{stem}.gz" for pair in mnist.FILES.values() for stem in pair)
    for name, digest in sums.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


def test_bundled_mnist_loads():
    assert store.locate("mnist", download=False) == Path(cgp.datasets.__file__).parent / "mnist"
    images, labels = store.load("mnist", "test", download=False)
    assert images.shape == (10000, 1, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10000,) and labels.max() == 9
    assert labels[:5].tolist() == [7, 2, 1, 0, 4]  # the well-known start of the test set
    assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ---------------------------------------------------------------- CIFAR-10

@pytest.mark.parametrize("subfolder", [True, False])
def test_cifar_load(tmp_path, subfolder):
    batches = write_cifar(tmp_path / cifar10.FOLDER if subfolder else tmp_path)
    images, labels = cifar10.load("train", tmp_path)
    assert images.shape == (20, 3, 32, 32) and images.dtype == np.uint8
    assert labels.shape == (20,) and labels.dtype == np.uint8
    train = [batches[name] for name in cifar10.FILES["train"]]
    np.testing.assert_array_equal(images, np.concatenate([i for i, _ in train]))
    np.testing.assert_array_equal(labels, np.concatenate([l for _, l in train]))
    images, labels = cifar10.load("test", tmp_path)
    np.testing.assert_array_equal(images, batches["test_batch.bin"][0])
    np.testing.assert_array_equal(labels, batches["test_batch.bin"][1])


def test_cifar_channel_major_layout(tmp_path):
    # One record by hand: label 7, then 1024 red bytes, 1024 green, 1024 blue.
    path = tmp_path / "one.bin"
    path.write_bytes(bytes([7]) + bytes([10]) * 1024 + bytes([20]) * 1024 + bytes([30]) * 1024)
    images, labels = cifar10.read_batch(path)
    assert labels.tolist() == [7]
    assert [int(images[0, c].min()) for c in range(3)] == [10, 20, 30]
    assert [int(images[0, c].max()) for c in range(3)] == [10, 20, 30]


@pytest.mark.parametrize("size", [0, cifar10.RECORD - 1, 2 * cifar10.RECORD + 5])
def test_cifar_bad_size(tmp_path, size):
    write_cifar(tmp_path)
    path = tmp_path / "test_batch.bin"
    path.write_bytes(bytes(size))
    refused_naming(path, "not a positive multiple of the 3073-byte", cifar10.load, "test",
                   tmp_path)


def test_cifar_label_out_of_range(tmp_path):
    write_cifar(tmp_path)
    path = tmp_path / "data_batch_3.bin"
    images = np.zeros((2, 3, 32, 32), np.uint8)
    path.write_bytes(cifar_bytes(images, np.array([0, 12], np.uint8)))
    refused_naming(path, "label 12 of record 1 is out of range", cifar10.load, "train", tmp_path)


def test_cifar_pickled_version_is_refused(tmp_path):
    (tmp_path / "data_batch_1").write_bytes(b"\x80\x04pickle")
    with pytest.raises(DataError, match="pickled Python version, which is not supported"):
        cifar10.load("train", tmp_path)


# ---------------------------------------------------------------- lookup order

def test_lookup_order(tmp_path, monkeypatch):
    given = tmp_path / "given"
    write_mnist(given)
    env_root = tmp_path / "env"
    write_mnist(env_root / "mnist")
    monkeypatch.setenv(store.ENV_VAR, str(env_root))
    write_mnist(store.cache_dir("mnist"))
    assert store.locate("mnist", data_dir=given) == given
    assert store.locate("mnist") == env_root / "mnist"
    monkeypatch.delenv(store.ENV_VAR)
    # The package copy beats the user cache.
    assert store.locate("mnist") == store.package_dir("mnist")


def test_data_dir_may_hold_a_folder_per_data_set(tmp_path):
    write_mnist(tmp_path / "mnist")
    assert store.locate("mnist", data_dir=tmp_path) == tmp_path / "mnist"


def test_data_dir_without_the_files_fails_at_once(tmp_path, monkeypatch):
    env_root = tmp_path / "env"
    write_mnist(env_root / "mnist")
    monkeypatch.setenv(store.ENV_VAR, str(env_root))
    with pytest.raises(DataError) as info:
        store.locate("mnist", data_dir=tmp_path / "empty")  # env and package copy exist
    message = str(info.value)
    assert f"--data-dir {tmp_path / 'empty'}" in message and "no such folder" in message
    (tmp_path / "a_file").write_text("")
    with pytest.raises(DataError, match="a_file: a file, not a folder"):
        store.locate("mnist", data_dir=tmp_path / "a_file")


def test_env_without_the_files_falls_through(tmp_path, monkeypatch):
    monkeypatch.setenv(store.ENV_VAR, str(tmp_path / "nothing"))
    assert store.locate("mnist") == store.package_dir("mnist")


def test_cache_is_used(tmp_path):
    write_cifar(store.cache_dir("cifar10") / cifar10.FOLDER)
    assert store.cache_dir("cifar10") == tmp_path / "xdg-cache" / "cgp" / "cifar10"
    assert store.locate("cifar10", download=False) == store.cache_dir("cifar10")
    images, labels = store.load("cifar10", "test", download=False)
    assert images.shape == (4, 3, 32, 32)


def test_cache_falls_back_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert store.cache_dir("mnist") == tmp_path / ".cache" / "cgp" / "mnist"


def test_unknown_data_set():
    with pytest.raises(DataError, match="unknown data set 'imagenet': known are mnist, cifar10"):
        store.locate("imagenet")


# ---------------------------------------------------------------- downloads

def test_download_writes_verified_files_into_the_cache(server, monkeypatch):
    root, url = server
    arrays = write_mnist(root)
    register(monkeypatch, "tiny", mnist, root, [url])
    folder = store.locate("tiny")
    assert folder == store.cache_dir("tiny")
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in root.iterdir())
    images, labels = store.load("tiny", "train")
    np.testing.assert_array_equal(labels, arrays["train"][1])
    # Found in the cache from now on: no server needed.
    register(monkeypatch, "tiny", mnist, root, ["http://127.0.0.1:9/unused/"])
    assert store.locate("tiny") == folder


def test_download_checksum_mismatch_leaves_nothing(server, monkeypatch):
    root, url = server
    write_mnist(root)
    spec = register(monkeypatch, "tiny", mnist, root, [url])
    bad = store.Source(spec.sources[0].filename, "md5", "0" * 32)
    monkeypatch.setitem(store.DATASETS, "tiny",
                        store.DataSet(mnist, (bad,) + spec.sources[1:], spec.mirrors))
    with pytest.raises(DataError) as info:
        store.locate("tiny")
    message = str(info.value)
    assert f"{url}{bad.filename}: md5 checksum mismatch: expected {'0' * 32}, " \
           f"got {md5(root / bad.filename)}" in message
    cache = store.cache_dir("tiny")
    assert not cache.exists() or list(cache.iterdir()) == []


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_download_falls_back_to_the_next_mirror(server, refused_url, monkeypatch, with_tqdm):
    if not with_tqdm:
        monkeypatch.setattr(store, "tqdm", None)
    root, url = server
    write_mnist(root)
    register(monkeypatch, "tiny", mnist, root, ["unused"])
    assert store.locate("tiny", mirrors=[refused_url, url]) == store.cache_dir("tiny")
    assert store.dataset("tiny").reader.missing(store.cache_dir("tiny")) == []


def test_download_failure_lists_places_and_urls(server, refused_url, monkeypatch, tmp_path):
    root, url = server
    write_mnist(root)
    register(monkeypatch, "tiny", mnist, root, [refused_url, url])
    for path in root.iterdir():
        path.unlink()  # the server now answers 404
    monkeypatch.setenv(store.ENV_VAR, str(tmp_path / "env"))
    with pytest.raises(DataError) as info:
        store.locate("tiny")
    message = str(info.value)
    first = store.DATASETS["tiny"].sources[0].filename
    for expected in ["--data-dir: not given",
                     f"$CGP_DATA_DIR/tiny {tmp_path / 'env' / 'tiny'}: no such folder",
                     f"package copy {store.package_dir('tiny')}: no such folder",
                     f"user cache {store.cache_dir('tiny')}: no such folder",
                     f"{refused_url}{first}: <urlopen error [Errno 111] Connection refused>",
                     f"{url}{first}: HTTP Error 404",
                     "--data-dir DIR", "CGP_DATA_DIR=ROOT"]:
        assert expected in message, expected


def test_no_download_when_disabled(monkeypatch, refused_url, tmp_path):
    write_mnist(tmp_path / "src")
    register(monkeypatch, "tiny", mnist, tmp_path / "src", [refused_url])
    with pytest.raises(DataError, match="not tried: download is off"):
        store.locate("tiny", download=False)


def make_cifar_archive(path, drop=None):
    """A small tar.gz laid out like cifar-10-binary.tar.gz, plus hostile members to skip."""
    with tarfile.open(path, "w:gz") as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        batches = cifar_batches()
        for name, (images, labels) in batches.items():
            if name != drop:
                add(f"{cifar10.FOLDER}/{name}", cifar_bytes(images, labels))
        add(f"{cifar10.FOLDER}/batches.meta.txt", b"airplane\n")
        add("../escaped.bin", b"x")
        add("/tmp/absolute-cgp-test.bin", b"x")
        add(f"{cifar10.FOLDER}/../../escaped2.bin", b"x")
        link = tarfile.TarInfo(f"{cifar10.FOLDER}/link.bin")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return batches


def test_cifar_archive_downloaded_and_extracted_safely(server, monkeypatch):
    root, url = server
    batches = make_cifar_archive(root / "cifar-10-binary.tar.gz")
    members = store.DATASETS["cifar10"].members
    register(monkeypatch, "tinycifar", cifar10, root, [url], members=members)
    folder = store.locate("tinycifar")
    cache = store.cache_dir("tinycifar")
    assert folder == cache
    written = sorted(str(p.relative_to(cache.parent)) for p in cache.parent.rglob("*"))
    assert written == ["tinycifar", f"tinycifar/{cifar10.FOLDER}"] + sorted(
        f"tinycifar/{cifar10.FOLDER}/{name}" for name in batches)  # archive gone, nothing else
    assert not Path("/tmp/absolute-cgp-test.bin").exists()
    images, labels = store.load("tinycifar", "test")
    np.testing.assert_array_equal(images, batches["test_batch.bin"][0])


def test_cifar_archive_lacking_a_member(tmp_path):
    archive = tmp_path / "a.tar.gz"
    make_cifar_archive(archive, drop="data_batch_2.bin")
    with pytest.raises(DataError, match=f"lacks {cifar10.FOLDER}/data_batch_2.bin"):
        store.extract(archive, tmp_path / "out", store.DATASETS["cifar10"].members)


def test_corrupt_archive(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(gzip.compress(b"not a tar file" * 100))
    with pytest.raises(DataError, match="cannot extract"):
        store.extract(archive, tmp_path / "out", store.DATASETS["cifar10"].members)
