"""CIFAR-10 reader for the binary version (data_batch_1.bin ... test_batch.bin) -> uint8 arrays.
The pickled Python version is not supported: unpickling a file can run code from it."""

from pathlib import Path

import numpy as np

from cgp.errors import DataError

FOLDER = "cifar-10-batches-bin"  # the folder that the official archive unpacks to
FILES = {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test": ("test_batch.bin",)}
SHAPE = (3, 32, 32)              # channel-major: 1024 red, then 1024 green, then 1024 blue bytes
RECORD = 1 + 3 * 32 * 32         # one label byte, then the image
CLASSES = 10
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"


def folder(root):
    """Where the batch files are: root/cifar-10-batches-bin if that folder exists, else root."""
    root = Path(root)
    return root / FOLDER if (root / FOLDER).is_dir() else root


def missing(root):
    """The batch files of both splits absent from root; empty when all are there."""
    where = folder(root)
    return [name for names in FILES.values() for name in names if not (where / name).is_file()]


def foreign(root):
    """Why the files in root are not what cgp reads, or None: CIFAR-10's pickled Python
    version (cifar-10-batches-py, or its data_batch_1 without .bin) found where the binary
    version was looked for."""
    root = Path(root)
    for pickled in (root / "cifar-10-batches-py", root / "data_batch_1"):
        if pickled.exists():
            shown = pickled if pickled.is_dir() else root
            return (f"{shown} holds CIFAR-10's pickled Python version, which is not supported "
                    "(unpickling a file can run code from it): get the binary version "
                    f"instead, {URL}, which unpacks to a folder {FOLDER}")
    return None


def read_batch(path):
    """One batch file -> images uint8 (n, 3, 32, 32) and labels uint8 (n,)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror or error}") from None
    if len(data) == 0 or len(data) % RECORD:
        raise DataError(f"{path}: size {len(data)} bytes is not a positive multiple of the "
                        f"{RECORD}-byte CIFAR-10 record (1 label byte + 3x32x32 image bytes)")
    records = np.frombuffer(data, np.uint8).reshape(-1, RECORD)
    labels = records[:, 0].copy()
    bad = np.flatnonzero(labels >= CLASSES)
    if bad.size:
        raise DataError(f"{path}: label {labels[bad[0]]} of record {bad[0]} is out of "
                        f"range 0..{CLASSES - 1}")
    images = records[:, 1:].reshape(-1, *SHAPE).copy()
    return images, labels


def load(split, root):
    """Read split 'train' (all five data batches, in order) or 'test' from root, which holds
    the .bin files or the cifar-10-batches-bin folder.

    Returns images uint8 (N, 3, 32, 32) and labels uint8 (N,) in 0..9."""
    if split not in FILES:
        raise DataError(f"unknown CIFAR-10 split {split!r}: expected 'train' or 'test'")
    where = folder(root)
    batches = []
    for name in FILES[split]:
        path = where / name
        if not path.is_file():
            raise DataError(_missing_message(where, path))
        batches.append(read_batch(path))
    images = np.concatenate([images for images, _ in batches])
    labels = np.concatenate([labels for _, labels in batches])
    return images, labels


def _missing_message(where, path):
    message = f"{path}: CIFAR-10 batch file not found"
    pickled = foreign(where)
    return f"{message}; {pickled}" if pickled else message
