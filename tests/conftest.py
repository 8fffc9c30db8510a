"""Shared pytest fixtures."""

from pathlib import Path

import pytest

from cgp.tools.fake_data import write_cifar, write_mnist   # bench/fake_cifar10.py's too

# Caffe reference data (example prototxts, LeNet snapshots made by a real Caffe): ../shared next to
# the repository root, not inside it.
CAFFE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "caffe"


@pytest.fixture(scope="session")
def caffe_dir():
    """The folder holding Caffe's reference files (prototxt/, lenet/)."""
    if not CAFFE_DIR.is_dir():
        pytest.skip(f"Caffe reference data not found at {CAFFE_DIR}")
    return CAFFE_DIR


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """A small generated MNIST in the official IDX format."""
    return write_mnist(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory):
    """A small generated CIFAR-10 in the official binary format."""
    return write_cifar(tmp_path_factory.mktemp("cifar10"))
