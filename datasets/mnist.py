"""MNIST reader: the four IDX files (plain or .gz) in one folder -> uint8 images and labels.
It neither finds nor downloads the folder (store.py does) and does not scale the pixels."""

from pathlib import Path

import numpy as np

from cgp.datasets.idx import read_idx
from cgp.errors import DataError

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
CLASSES = 10


def find(root, stem):
    """The file for `stem` in root: stem itself if present, else stem.gz; None if neither."""
    for path in (Path(root) / stem, Path(root) / f"{stem}.gz"):
        if path.is_file():
            return path
    return None


def missing(root):
    """The files of both splits absent from root, as 'name[.gz]'; empty when all are there."""
    return [f"{stem}[.gz]" for pair in FILES.values() for stem in pair if find(root, stem) is None]


def load(split, root):
    """Read split 'train' or 'test' from folder root.

    Returns images uint8 (N, 1, rows, cols), which is (N, 1, 28, 28) for MNIST, and labels
    uint8 (N,) in 0..9."""
    if split not in FILES:
        raise DataError(f"unknown MNIST split {split!r}: expected 'train' or 'test'")
    paths = []
    for stem in FILES[split]:
        path = find(root, stem)
        if path is None:
            raise DataError(f"{root}: MNIST file {stem} (or {stem}.gz) not found")
        paths.append(path)
    images_path, labels_path = paths
    images = read_idx(images_path, ndim=3)
    labels = read_idx(labels_path, ndim=1)
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} holds "
                        f"{len(labels)} labels")
    bad = np.flatnonzero(labels >= CLASSES)
    if bad.size:
        raise DataError(f"{labels_path}: label {labels[bad[0]]} at index {bad[0]} is out of "
                        f"range 0..{CLASSES - 1}")
    # Caffe blobs are NCHW: MNIST has one channel.
    return images[:, None, :, :], labels
