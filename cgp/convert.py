"""`cgp convert`: write MNIST or CIFAR-10 as a Caffe LMDB of Datum records, as Caffe's
convert_mnist_data and convert_cifar_data do, and optionally the mean image as Caffe's
compute_image_mean does.

Records keep the files' order (neither Caffe tool shuffles), with Caffe's keys: the
zero-padded index, 8 digits for MNIST and 5 for CIFAR-10. Each value is a serialized
Datum holding channels, height, width, the raw uint8 pixels (C x H x W) and the label.
It reads the data sets through cgp.datasets; it never reads LMDBs (lmdb_data.py does).
"""
from pathlib import Path

import numpy as np

from cgp.datasets import store
from cgp.errors import CgpError, DataError
from cgp.lmdb_data import require_lmdb
from cgp.proto import caffe_pb2
from cgp.snapshot import atomic_write, writable_folder

KEY_DIGITS = {"mnist": 8, "cifar10": 5}
COMMIT_EVERY = 1000    # records per transaction, as convert_mnist_data commits
DEFAULT_MAP_SIZE = 1 << 20   # liblmdb's default, where Caffe's LMDB writer starts


def datum_bytes(image, label):
    """A serialized Datum for one uint8 image (C, H, W) and its label."""
    c, h, w = image.shape
    datum = caffe_pb2.Datum(channels=c, height=h, width=w, data=image.tobytes(), label=int(label))
    return datum.SerializeToString()


def write_lmdb(out, images, labels, digits, log=print):
    """Create the LMDB folder `out` with one Datum per image, keys '%0{digits}d'.

    Written as Caffe's db_lmdb.cpp writes: batches of COMMIT_EVERY records, one transaction
    each, starting from LMDB's default map size and doubling it whenever a batch does not
    fit; so the database file comes out as Caffe's tools make it."""
    lmdb = require_lmdb(f"LMDB {out}")
    out = Path(out)
    if out.exists():
        raise CgpError(f"{out} already exists: cgp convert creates a new database (remove it "
                       "first)")
    try:
        env = lmdb.open(str(out), map_size=DEFAULT_MAP_SIZE, subdir=True)
    except (lmdb.Error, OSError) as e:
        raise DataError(f"LMDB {out}: cannot create: {e}") from None
    try:
        for first in range(0, len(images), COMMIT_EVERY):
            batch = [(f"{i:0{digits}d}".encode(), datum_bytes(images[i], labels[i]))
                     for i in range(first, min(first + COMMIT_EVERY, len(images)))]
            while True:
                try:
                    with env.begin(write=True) as txn:
                        for key, value in batch:
                            txn.put(key, value)
                    break
                except lmdb.MapFullError:
                    env.set_mapsize(2 * env.info()["map_size"])
    except lmdb.Error as e:
        raise DataError(f"LMDB {out}: cannot write: {e}") from None
    finally:
        env.close()
    log(f"Processed {len(images)} files.")


def image_mean(images):
    """Caffe's compute_image_mean: sums in float32, record by record, divided by the
    count in float32. Returns the BlobProto (legacy 1 x C x H x W form, as Caffe writes)."""
    total = np.zeros(images.shape[1:], np.float32)
    for image in images:
        total += image          # uint8 -> float32, one rounding per addition as Caffe's
    mean = total / np.float32(len(images))
    c, h, w = images.shape[1:]
    blob = caffe_pb2.BlobProto(num=1, channels=c, height=h, width=w)
    blob.data.extend(mean.ravel().tolist())
    return blob


def convert(dataset, out, split="train", data_dir=None, download=True, limit=None, mean=None,
            log=print):
    if dataset not in KEY_DIGITS:
        raise CgpError(f"cgp convert: unknown data set '{dataset}'; known: "
                       f"{', '.join(KEY_DIGITS)}")
    if limit is not None and limit < 1:
        raise CgpError(f"--limit must be at least 1, got {limit}")
    require_lmdb(f"LMDB {out}")
    for path in (out, mean) if mean else (out,):   # before any work that would be lost
        writable_folder(path)
    images, labels = store.load(dataset, split, data_dir, download)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    log(f"cgp convert: {dataset} {split}, {len(images)} records of {images.shape[1:]} -> {out}")
    write_lmdb(out, images, labels, KEY_DIGITS[dataset], log)
    if mean:
        atomic_write(mean, image_mean(images).SerializeToString())
        log(f"Mean image written to {mean}")
