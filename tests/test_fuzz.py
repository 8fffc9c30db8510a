"""A fuzz test that stays in the suite (issue 38): random and mutated inputs (net and solver
prototxts, .caffemodel, .solverstate, IDX, CIFAR-10 and LMDB files) through the command
line, asserting only what a user must get: exit status 0 or 2, one message and no
traceback, no signal, no hang, and no snapshot left half written. A fixed seed and a
bounded time: the cases are the same on every run, and the test stops making new ones
once its time is up (the first ones always run)."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from cgp import cli
from cgp.proto import caffe_pb2
from cgp.tools.fake_data import synthetic_images, write_cifar, write_mnist
from test_snapshot import mutations

# CGP_FUZZ_SEED and CGP_FUZZ_SECONDS run other cases for longer, to look for bugs.
SEED = int(os.environ.get("CGP_FUZZ_SEED", 38))
# Cases in process; the subprocess ones come on top (a few seconds).
BUDGET_SECONDS = float(os.environ.get("CGP_FUZZ_SECONDS", 35))
CASE_SECONDS = 30        # a case running longer has hung

NET = """name: "fz"
layer {
  name: "d"
  type: "Data"
  top: "data"
  top: "label"
  include { phase: TRAIN }
  transform_param { scale: 0.00390625 mirror: true crop_size: 24 }
  data_param { source: "SOURCE:train" batch_size: 8 }
}
layer {
  name: "d"
  type: "Data"
  top: "data"
  top: "label"
  include { phase: TEST }
  transform_param { scale: 0.00390625 crop_size: 24 }
  data_param { source: "SOURCE:test" batch_size: 8 }
}
layer {
  name: "conv"
  type: "Convolution"
  bottom: "data"
  top: "conv"
  param { lr_mult: 1 }
  param { lr_mult: 2 }
  convolution_param { num_output: 4 kernel_size: 5 stride: 2 pad: 1 weight_filler { type: "xavier" } }
}
layer {
  name: "pool"
  type: "Pooling"
  bottom: "conv"
  top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
layer {
  name: "norm"
  type: "LRN"
  bottom: "pool"
  top: "norm"
  lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 }
}
layer {
  name: "relu"
  type: "ReLU"
  bottom: "norm"
  top: "norm"
}
layer {
  name: "drop"
  type: "Dropout"
  bottom: "norm"
  top: "drop"
  dropout_param { dropout_ratio: 0.2 }
}
layer {
  name: "ip"
  type: "InnerProduct"
  bottom: "drop"
  top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.01 } }
}
layer {
  name: "acc"
  type: "Accuracy"
  bottom: "ip"
  bottom: "label"
  top: "acc"
  include { phase: TEST }
}
layer {
  name: "loss"
  type: "SoftmaxWithLoss"
  bottom: "ip"
  bottom: "label"
  top: "loss"
}
"""

SOLVER = """net: "net.prototxt"
type: "SGD"
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
stepsize: 1
display: 1
max_iter: 2
snapshot: 1
snapshot_prefix: "snaps/fz"
test_iter: 1
test_interval: 2
average_loss: 2
random_seed: 1
"""

# What a number in a prototxt becomes: edge values, and a few that ask for a lot.
NUMBERS = ["0", "1", "2", "3", "-1", "-7", "0.5", "1e-3", "1e-45", "1e9", "65537",
           "2147483648", "-2147483649", "nan", "inf", "-inf", "1.5e300", "0x10"]
WORDS = ["MAX", "AVE", "STOCHASTIC", "TRAIN", "TEST", "true", "false", "\"\"", "\"x\"",
         "\"ReLU\"", "\"Pooling\"", "\"Adam\"", "\"poly\"", "{", "}", ":"]


def mutate_text(text, rng):
    """A damaged copy of a prototxt: a number or a word replaced, a line deleted, duplicated
    or swapped with another, a byte changed, or the text cut short."""
    lines = text.splitlines()
    kind = int(rng.integers(0, 7))
    at = int(rng.integers(0, len(lines)))
    if kind == 0:
        numbers = [i for i, line in enumerate(lines) if any(c.isdigit() for c in line)]
        at = numbers[int(rng.integers(0, len(numbers)))]
        words = lines[at].split(" ")
        digits = [j for j, w in enumerate(words) if any(c.isdigit() for c in w)]
        words[digits[int(rng.integers(0, len(digits)))]] = str(rng.choice(NUMBERS))
        lines[at] = " ".join(words)
    elif kind == 1:
        words = lines[at].split(" ")
        words[int(rng.integers(0, len(words)))] = str(rng.choice(WORDS))
        lines[at] = " ".join(words)
    elif kind == 2:
        del lines[at]
    elif kind == 3:
        lines.insert(at, lines[int(rng.integers(0, len(lines)))])
    elif kind == 4:
        other = int(rng.integers(0, len(lines)))
        lines[at], lines[other] = lines[other], lines[at]
    elif kind == 5:
        data = bytearray("\n".join(lines).encode())
        data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        return bytes(data)
    else:
        return "\n".join(lines)[:int(rng.integers(0, len(text)))].encode()
    return "\n".join(lines).encode()


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def check_snapshots(folder, case):
    """Every .solverstate has its .caffemodel, both whole; no temporary file is left."""
    if not folder.is_dir():
        return
    names = [p.name for p in folder.iterdir()]
    assert not [n for n in names if n.endswith((".tmp", ".probe"))], (case, names)
    for state in folder.glob("*.solverstate"):
        parsed = caffe_pb2.SolverState.FromString(state.read_bytes())
        model = folder / Path(parsed.learned_net).name
        assert model.is_file(), (case, names)
        # Whole, not necessarily finite: a diverging run is the trainer's to stop.
        assert caffe_pb2.NetParameter.FromString(model.read_bytes()).layer, (case, names)


def run_in_process(capsys, case, args, folder):
    """cgp.cli.main in this process, bounded by CASE_SECONDS: exit status 0 or 2, and on 2
    one short message."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        status = cli.main([str(a) for a in args])
    except Hang:
        raise AssertionError(f"{case}: still running after {CASE_SECONDS} s") from None
    except BaseException as e:   # anything but CgpError is a bug: say which case
        raise AssertionError(f"{case}: {type(e).__name__}: {e}") from e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out = capsys.readouterr()
    assert status in (0, 2), (case, status, out.err[-2000:])
    if status == 2:
        assert out.err.startswith("cgp: error: ") and len(out.err) < 5000, (case, out.err[:2000])
    assert "Traceback" not in out.err, (case, out.err[-3000:])
    check_snapshots(folder / "snaps", case)
    return status


def run_in_subprocess(case, args, folder):
    """The same through `python -m cgp`: also no signal (SIGBUS, SIGSEGV)."""
    try:
        out = subprocess.run([sys.executable, "-m", "cgp", *map(str, args)], cwd=folder,
                             capture_output=True, text=True, timeout=CASE_SECONDS * 3)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{case}: still running after {CASE_SECONDS * 3} s") from None
    assert out.returncode in (0, 2), (case, out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, (case, out.stderr[-3000:])
    check_snapshots(folder / "snaps", case)
    return out.returncode


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Valid inputs of every kind, from which the cases are mutated: small MNIST and
    CIFAR-10 folders, an LMDB, the net and solver, and a snapshot pair of a short run."""
    pytest.importorskip("lmdb")
    from cgp.data.convert import write_lmdb
    root = tmp_path_factory.mktemp("fuzz")
    write_mnist(root / "mnist", n_train=64, n_test=24)
    write_cifar(root / "cifar", per_batch=12)
    images, labels = synthetic_images(40, (1, 28, 28), 9)
    write_lmdb(root / "lmdb", images, labels, 8, log=lambda line: None)
    base = root / "base"
    base.mkdir()
    (base / "net.prototxt").write_text(NET.replace("SOURCE", "mnist"))
    (base / "solver.prototxt").write_text(SOLVER)
    status = cli.main(["train", "--solver", str(base / "solver.prototxt"), "--data-dir",
                       str(root / "mnist"), "--workers", "threads", "--snapshot-prefix",
                       str(base / "fz")])
    assert status == 0
    return root


def case_folder(world, n, net=None, solver=SOLVER):
    folder = world / f"case{n}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / "net.prototxt").write_bytes(net if isinstance(net, bytes) else
                                          (net or NET.replace("SOURCE", "mnist")).encode())
    (folder / "solver.prototxt").write_bytes(solver if isinstance(solver, bytes)
                                             else solver.encode())
    return folder


def long_but_valid(net, solver):
    """Whether the case asks for a lot of work that is no fault (a test of 65537 batches, a
    batch of 65537 samples): such cases are left out, since they would run past the time a
    case may take; nothing else is."""
    try:
        sp = text_format.Parse(solver.decode(), caffe_pb2.SolverParameter())
        np_ = text_format.Parse(net.decode(), caffe_pb2.NetParameter())
    except (text_format.ParseError, UnicodeDecodeError):
        return False
    sizes = [lp.data_param.batch_size for lp in np_.layer]
    return (any(n > 8 for n in sp.test_iter) or sp.iter_size > 8
            or any(n > 1024 for n in sizes))


def cases(world, rng):
    """(description, folder, cgp arguments) without end, the kinds in turn."""
    base = world / "base"
    run = ["train", "--solver", "solver.prototxt", "--iters", 2, "--workers", "threads",
           "--threads", 2, "--chunks", 3]
    model = (base / "fz_iter_2.caffemodel").read_bytes()
    state = (base / "fz_iter_1.solverstate").read_bytes()
    weights, states = mutations(model, rng, 10**9), mutations(state, rng, 10**9)
    for n in range(10**9):
        kind = n % 7
        if kind == 0:
            folder = case_folder(world, n, net=mutate_text(NET.replace("SOURCE", "mnist"), rng))
            yield "mutated net", folder, run + ["--data-dir", world / "mnist"]
        elif kind == 1:
            folder = case_folder(world, n, solver=mutate_text(SOLVER, rng))
            yield "mutated solver", folder, run + ["--data-dir", world / "mnist"]
        elif kind == 2:
            folder = case_folder(world, n)
            (folder / "w.caffemodel").write_bytes(next(weights))
            yield ("mutated caffemodel", folder,
                   run + ["--data-dir", world / "mnist", "--weights", "w.caffemodel"])
        elif kind == 3:
            folder = case_folder(world, n)
            shutil.copy(base / "fz_iter_1.caffemodel", folder / "fz_iter_1.caffemodel")
            (folder / "fz_iter_1.solverstate").write_bytes(next(states))
            yield ("mutated solverstate", folder,
                   run + ["--data-dir", world / "mnist", "--snapshot", "fz_iter_1.solverstate"])
        elif kind == 4:
            folder = case_folder(world, n)
            shutil.copytree(world / "mnist", folder / "mnist")
            name = str(rng.choice(["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                   "t10k-labels-idx1-ubyte"]))
            data = (folder / "mnist" / name).read_bytes()
            (folder / "mnist" / name).write_bytes(_damaged(data, rng))
            yield f"mutated IDX {name}", folder, run + ["--data-dir", folder / "mnist"]
        elif kind == 5:
            folder = case_folder(world, n, net=NET.replace("SOURCE", "cifar10"))
            shutil.copytree(world / "cifar", folder / "cifar")
            batch = folder / "cifar" / "cifar-10-batches-bin" / str(rng.choice(
                [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]))
            batch.write_bytes(_damaged(batch.read_bytes(), rng, record=3073))
            yield f"mutated CIFAR {batch.name}", folder, run + ["--data-dir", folder / "cifar"]
        else:
            lmdb_net = NET.replace('"SOURCE:train"', '"db"').replace('"SOURCE:test"', '"db"')
            folder = case_folder(world, n, net=lmdb_net)
            shutil.copytree(world / "lmdb", folder / "db")
            data = (folder / "db" / "data.mdb").read_bytes()
            (folder / "db" / "data.mdb").write_bytes(_damaged(data, rng, record=4096))
            yield "mutated LMDB", folder, run


def kept_cases(world, rng):
    for case, folder, args in cases(world, rng):
        if long_but_valid((folder / "net.prototxt").read_bytes(),
                          (folder / "solver.prototxt").read_bytes()):
            shutil.rmtree(folder)
            continue
        yield case, folder, args


def _damaged(data, rng, record=None):
    """Flipped bits (mostly in headers: the first bytes of the file or of a record or
    page), or the data cut short."""
    data = bytearray(data)
    if rng.random() < 0.25:
        return bytes(data[:int(rng.integers(0, len(data)))])
    for _ in range(int(rng.integers(1, 5))):
        if record and rng.random() < 0.7:
            at = int(rng.integers(0, len(data) // record)) * record + int(rng.integers(0, 32))
        else:
            at = int(rng.integers(0, min(len(data), 64) if rng.random() < 0.5 else len(data)))
        data[min(at, len(data) - 1)] ^= 1 << int(rng.integers(0, 8))
    return bytes(data)


def test_fuzz_through_the_command_line(world, capsys, monkeypatch):
    rng = np.random.default_rng(SEED)
    monkeypatch.chdir(world)
    started, counts = time.monotonic(), {0: 0, 2: 0}
    subprocess_kinds = {"mutated LMDB": 4, "mutated net": 2}   # run through python -m cgp
    for case, folder, args in kept_cases(world, rng):
        elapsed = time.monotonic() - started
        if elapsed > BUDGET_SECONDS and not any(subprocess_kinds.values()):
            break
        description = f"case {folder.name}, {case}, {args}"
        if subprocess_kinds.get(case):
            subprocess_kinds[case] -= 1
            counts[run_in_subprocess(description, args, folder)] += 1
        elif elapsed <= BUDGET_SECONDS and case != "mutated LMDB":
            monkeypatch.chdir(folder)
            counts[run_in_process(capsys, description, args, folder)] += 1
        shutil.rmtree(folder)
    # Both outcomes occur: the mutations are neither all harmless nor all fatal.
    print(f"fuzz: {counts[0]} cases ran, {counts[2]} were refused")
    assert counts[0] > 5 and counts[2] > 5, counts
