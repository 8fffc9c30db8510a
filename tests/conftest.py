"""Shared pytest fixtures, and running cgp's command line from a test (run_cgp)."""
import os
import selectors
import subprocess
import sys
import time
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


def quick_solver(folder, model="mnist", **fields):
    """folder/solver.prototxt: the bundled model's solver (what `cgp train MODEL` runs) with
    its tests on one batch instead of the whole test set (LeNet's 100 batches take longer than
    its first iterations), for runs whose test results no assertion reads; `fields` as
    bundled.solver's. Returns its path."""
    from cgp.prototxt import format_message
    from bundled import solver
    path = Path(folder) / "solver.prototxt"
    path.write_text(format_message(solver(model, **{"test_iter": [1], **fields})))
    return path


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


class RunningCgp:
    """`python -m cgp ARGS` in cwd, started in a session of its own (a signal to its process
    group reaches it and its workers as a terminal's Ctrl-C would), its output (stderr with
    it) read line by line while it runs. Use it in a with block: the process is killed if
    the test leaves it running."""

    def __init__(self, args, cwd):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cgp", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.pid = self.proc.pid
        self.lines = []
        self._partial = b""    # the last line, while it has no newline yet

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def output(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout=120):
        """Reads the output until a line read from now on holds text (a poll loop with a
        deadline, so that a run that goes quiet fails the test instead of hanging it)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=1):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                *lines, self._partial = (self._partial + chunk).split(b"\n")
                lines = [line.decode() + "\n" for line in lines]
                self.lines.extend(lines)
                if any(text in line for line in lines):
                    return
        raise AssertionError(f"no '{text}' in the output:\n{self.output()}")

    def finish(self, timeout=60):
        """Waits for the end of the run; returns its whole output."""
        rest, _ = self.proc.communicate(timeout=timeout)
        self.lines.append((self._partial + rest).decode())
        self._partial = b""
        return self.output()
