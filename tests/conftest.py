"""Shared pytest fixtures, and running cgp's command line from a test (run_cgp)."""
import os
import subprocess
import sys
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


def run_cgp(args, cwd, ranks=0, pythonpath=(), timeout=600):
    """`python -m cgp ARGS` in cwd, in one process or on `ranks` mpirun ranks (0: without
    MPI, even inside an MPI test's environment); pythonpath: folders put before PYTHONPATH."""
    command = ["-m", "cgp", *args]
    if ranks:
        from cgp.comm import mpi
        argv, env = mpi.local_job(ranks, command)
    else:
        argv, env = [sys.executable, *command], dict(os.environ)
    env.pop("OMPI_COMM_WORLD_SIZE", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
