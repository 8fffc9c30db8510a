"""Shared pytest fixtures."""

from pathlib import Path

import pytest

# Caffe reference data (example prototxts, LeNet snapshots made by a real Caffe): ../shared next to
# the repository root, not inside it.
CAFFE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "caffe"


@pytest.fixture(scope="session")
def caffe_dir():
    """The folder holding Caffe's reference files (prototxt/, lenet/)."""
    if not CAFFE_DIR.is_dir():
        pytest.skip(f"Caffe reference data not found at {CAFFE_DIR}")
    return CAFFE_DIR
