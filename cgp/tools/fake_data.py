"""Generated data sets in the official file formats, for timing and testing where the real
ones are not at hand: MNIST as IDX files, CIFAR-10 as cifar-10-batches-bin. The images are
classes that a small net can learn (a bright square at a spot set by the class) on noise.
Needs NumPy only; `python bench/fake_cifar10.py DIR` writes a CIFAR-10 with it.
"""
from pathlib import Path

import numpy as np


def synthetic_images(n, shape, seed):
    """Images a small net can learn: class k has a bright square at a spot set by k,
    on noise. Returns (uint8 images (n, *shape), uint8 labels (n,))."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 60, (n,) + shape).astype(np.uint8)
    size = shape[-1]
    for image, k in zip(images, labels):
        y, x = divmod(int(k), 5)
        top, left = 2 + y * (size // 2 - 2), 1 + x * (size // 5)
        image[..., top:top + size // 4, left:left + size // 6] = 250
    return images, labels


def write_idx(path, array):
    """An IDX ubyte file (magic 0x0000 08 ndim, big-endian dims, raw bytes)."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    Path(path).write_bytes(header + array.tobytes())


def write_mnist(root, n_train=256, n_test=200, seed=0):
    """MNIST's four IDX files (train-images-idx3-ubyte, ..., t10k-labels-idx1-ubyte) in root."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        images, labels = synthetic_images(n, (28, 28), s)
        write_idx(root / f"{prefix}-images-idx3-ubyte", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels)
    return root


def write_cifar(root, per_batch=40, seed=0):
    """CIFAR-10 binary files: data_batch_1..5.bin and test_batch.bin, 1 label byte + 3072,
    in root/cifar-10-batches-bin."""
    folder = Path(root) / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for i, name in enumerate(names):
        images, labels = synthetic_images(per_batch, (3, 32, 32), seed + i)
        records = np.concatenate([labels[:, None], images.reshape(per_batch, -1)], axis=1)
        (folder / name).write_bytes(records.astype(np.uint8).tobytes())
    return Path(root)
