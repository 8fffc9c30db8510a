"""What a careful or an adversarial user meets (issue 38): values that cannot be meant,
non-finite numbers, nets too big for the machine, long names and garbage, damaged LMDBs,
bad labels, a second writer of a blob, snapshots interrupted by a kill or a full disk, two
runs on one prefix, SIGTERM, resumes past the end, and a memory line that counts what the
process holds. Each ends in one clear message (exit status 2) or a complete snapshot pair,
never a traceback, a signal or a lost run."""
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from google.protobuf import text_format

from cgp import cli
from cgp.datasets import store
from cgp.errors import CgpError, DataError, NetError, PrototxtError, shorten
from cgp.net import RunOptions, build_net
from cgp.proto import caffe_pb2
from cgp.snapshot import (lock_prefix, read_caffemodel, recover_snapshots,
                          write_caffemodel, write_solverstate)
from cgp.solver import check_values
from cgp.train import Trainer
from cgp.tools.fake_data import synthetic_images
from conftest import RunningCgp
from test_snapshot import TINY, quiet, solver, trainer

ROOT = Path(__file__).resolve().parents[1]


def cgp(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cgp", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def assert_user_error(out, *fragments):
    """Exit status 2, no traceback, no signal, and each fragment in stderr."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, out.stderr


def main(capsys, *args):
    """cgp.cli.main in this process: (exit status, stdout, stderr)."""
    status = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def solver_param(text):
    return text_format.Parse(text, caffe_pb2.SolverParameter())


# -- solver values --------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("base_lr: -0.01", ["base_lr", "-0.01"]),
    ("base_lr: nan", ["base_lr is nan"]),
    ("base_lr: inf", ["base_lr is inf"]),
    ("momentum: 1", ["momentum", "[0, 1)"]),
    ("momentum: -0.5", ["momentum", "[0, 1)"]),
    ("type: 'Adam' momentum2: 1.5", ["momentum2", "[0, 1)"]),
    ("type: 'Nesterov' momentum: 1.2", ["momentum"]),
    ("weight_decay: -0.0005", ["weight_decay"]),
    ("type: 'AdaGrad' delta: 0", ["delta", "AdaGrad"]),
    ("type: 'Adam' delta: -1e-8", ["delta"]),
    ("snapshot: -100", ["snapshot must be at least 0"]),
    ("display: -1", ["display must be at least 0"]),
    ("test_interval: -5", ["test_interval must be at least 0"]),
    ("average_loss: 0", ["average_loss must be at least 1"]),
    ("test_iter: -3", ["test_iter must be at least 1"]),
    ("test_iter: 0", ["test_iter must be at least 1"]),
    ("clip_gradients: nan", ["clip_gradients is nan"]),
    ("lr_policy: 'inv' power: -0.75 gamma: 0.1", ["power"]),
    ("lr_policy: 'step' stepsize: 10 gamma: nan", ["gamma is nan"]),
])
def test_solver_values_that_cannot_be_meant_are_refused(text, words):
    sp = solver_param(text)
    if not sp.HasField("base_lr"):
        sp.base_lr = 0.01
    if not sp.HasField("lr_policy"):
        sp.lr_policy = "fixed"
    with pytest.raises(PrototxtError) as error:
        check_values(sp, "my_solver.prototxt")
    assert str(error.value).startswith("solver my_solver.prototxt: ")
    for word in words:
        assert word in str(error.value)


def test_values_caffe_accepts_are_accepted_and_said_once():
    notes = []
    sp = solver_param("lr_policy: 'step' stepsize: 5 gamma: 0 base_lr: 0 momentum: 0 "
                      "weight_decay: 0 display: 0 clip_gradients: 0 test_iter: 2")
    assert check_values(sp, "s.prototxt", notes.append) == "SGD"
    assert notes == [
        "Note: base_lr is 0: the weights never change (as in Caffe)",
        "Note: clip_gradients is 0: every gradient is scaled to 0, so only weight decay "
        "changes the weights (as in Caffe)",
        "Note: gamma is 0: lr_policy 'step' drops the learning rate to 0 at its first step "
        "(as in Caffe)",
        "Note: test_interval is 0: the test nets never run (as in Caffe)"]
    check_values(solver_param("lr_policy: 'fixed' base_lr: 0.01 clip_gradients: -1"),
                 "s.prototxt", notes.append)
    assert len(notes) == 4


def test_a_bad_solver_value_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "diverge_solver.prototxt"
    path.write_text(f'net: "{ROOT / "models/lenet_train_test.prototxt"}"\nbase_lr: nan\n'
                    'lr_policy: "fixed"\nmax_iter: 1\n')
    assert_user_error(cgp("train", "--solver", path, cwd=tmp_path),
                      "solver ", "diverge_solver.prototxt: base_lr is nan")
    assert list(tmp_path.iterdir()) == [path]   # refused before anything was written


# -- non-finite numbers in weights, prototxts and data --------------------------------------

def test_weights_holding_nan_or_inf_are_refused_naming_file_layer_and_blob(mnist_dir,
                                                                           tmp_path):
    t = trainer(solver(), mnist_dir)
    path = tmp_path / "w.caffemodel"
    write_caffemodel(path, t.net)
    for layer, blob, value in (("ip1", 0, math.nan), ("ip2", 1, -math.inf), ("ip1", 1, 1e39)):
        proto = caffe_pb2.NetParameter.FromString((tmp_path / "w.caffemodel").read_bytes())
        target = next(lp for lp in proto.layer if lp.name == layer).blobs[blob]
        if value == 1e39:   # finite as a double, an infinity as float32
            target.double_data.extend(target.data)
            del target.data[:]
            target.double_data[3] = value
        else:
            target.data[3] = value
        bad = tmp_path / f"bad_{layer}_{blob}.caffemodel"
        bad.write_bytes(proto.SerializeToString())
        with pytest.raises(DataError, match=re.escape(
                f"weights file {bad}, layer '{layer}' blob {blob}: value {value}")):
            read_caffemodel(bad)


@pytest.mark.parametrize("transform, field", [
    ("mean_value: nan", "transform_param.mean_value[0] is nan"),
    ("scale: inf", "transform_param.scale is inf"),
])
def test_a_nan_in_a_prototxt_is_refused_naming_the_layer(transform, field, mnist_dir):
    net = text_format.Parse(
        f'layer {{ name: "d" type: "Data" top: "data" top: "label" transform_param '
        f'{{ {transform} }} data_param {{ source: "mnist:train" batch_size: 4 }} }}',
        caffe_pb2.NetParameter())
    with pytest.raises(NetError, match=re.escape(f"net.prototxt: layer 'd': {field}")):
        build_net(net, "net.prototxt", caffe_pb2.TRAIN, RunOptions(str(mnist_dir)))


def test_float_data_with_nan_is_refused_naming_the_record(tmp_path):
    lmdb = pytest.importorskip("lmdb")
    from cgp.data.lmdb_data import LmdbRecords
    env = lmdb.open(str(tmp_path / "floats"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(5):
            values = np.full(12, 0.5, np.float32)
            values[7] = np.nan if i == 3 else 0.25
            d = caffe_pb2.Datum(channels=3, height=2, width=2, label=1,
                                float_data=values.tolist())
            txn.put(f"{i:08d}".encode(), d.SerializeToString())
    env.close()
    with pytest.raises(DataError, match=re.escape(
            f"LMDB {tmp_path / 'floats'}: record 3 (key 00000003) holds nan at (channel, row, "
            "column) (1, 1, 1)")):
        LmdbRecords(tmp_path / "floats")


def test_input_values_holding_nan_are_refused_where_they_enter():
    net = build_net(text_format.Parse(
        'layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }'
        'layer { name: "r" type: "ReLU" bottom: "x" top: "y" }', caffe_pb2.NetParameter()),
        "deploy.prototxt", caffe_pb2.TEST)
    layer = net.sources[0].layer
    layer.load(0, 0, 0)
    layer.values[0][1, 2] = np.inf
    with pytest.raises(DataError, match=re.escape("layer 'in': top 'x' holds inf at (1, 2)")):
        layer.load(0, 0, 0)


# -- memory: refused before allocation -------------------------------------------------------

INPUT = 'layer {{ name: "in" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}\n'


@pytest.mark.parametrize("net, words", [
    (INPUT.format(dims="dim: 2 dim: 1 dim: 28 dim: 28")
     + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
       'inner_product_param { num_output: 2000000000 } }',
     ["layer 'ip' (type InnerProduct): learnable blob 0 of shape (2000000000, 784) needs "
      "5.7 TiB"]),
    (INPUT.format(dims="dim: 2 dim: 1 dim: 28 dim: 28")
     + 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
       'convolution_param { num_output: 2 kernel_size: 3 pad: 1000000 } }',
     ["layer 'c' (type Convolution): top 'c' of shape (2, 2, 2000026, 2000026) needs",
      "TiB for one sample of it"]),
    (INPUT.format(dims="dim: 1 dim: 100000 dim: 100000 dim: 100000"),
     ["layer 'in' (type Input): top 'data' of shape (1, 100000, 100000, 100000) needs"]),
    (INPUT.format(dims="dim: 2 dim: -1 dim: 28 dim: 28"),
     ["layer 'in' (type Input): top 'data' would have shape (2, -1, 28, 28); every "
      "dimension must be at least 1"]),
    (INPUT.format(dims="dim: 2 dim: 0 dim: 28"), ["would have shape (2, 0, 28)"]),
])
def test_a_net_too_big_for_memory_is_refused_before_allocation(net, words):
    """The figure and the layer, within a fraction of a second, with nothing allocated (the
    process's resident memory barely moves)."""
    param = text_format.Parse(net, caffe_pb2.NetParameter())
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    with pytest.raises(NetError) as error:
        build_net(param, "big.prototxt", caffe_pb2.TRAIN)
    assert time.perf_counter() - started < 0.5
    assert psutil.Process().memory_info().rss - before < 32 << 20
    for word in words:
        assert word in str(error.value)


def test_parameters_and_activations_together_are_checked(mnist_dir, monkeypatch):
    """LeNet's blobs each fit in 7 MiB, its parameters four times over do not."""
    from cgp import net as net_module
    from cgp.prototxt import read_net

    class Machine:
        available = 7 << 20
    monkeypatch.setattr(net_module.psutil, "virtual_memory", lambda: Machine)
    with pytest.raises(NetError, match=r"net 'LeNet' needs at least 7\.\d MiB of memory "
                                       r"\(431080 parameters: 6\.6 MiB; .*7\.0 MiB available"):
        build_net(read_net(ROOT / "models/lenet_train_test.prototxt"), "lenet",
                  caffe_pb2.TRAIN, RunOptions(str(mnist_dir)))


def test_a_huge_net_ends_in_one_message_on_the_command_line(tmp_path):
    path = tmp_path / "big.prototxt"
    path.write_text(INPUT.format(dims="dim: 2 dim: 1 dim: 28 dim: 28")
                    + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                      'inner_product_param { num_output: 2000000000 } }')
    assert_user_error(cgp("time", "--model", path), "big.prototxt: layer 'ip'", "5.7 TiB")


# -- long names and garbage ------------------------------------------------------------------

def test_shorten_keeps_the_start_and_says_the_length():
    assert shorten("abc", 5) == "abc"
    assert shorten("x" * 1000, 10) == "xxxxxxxxxx... (1000 characters)"


@pytest.mark.parametrize("what", ["layer name", "bottom name", "garbage", "net name"])
def test_a_megabyte_of_user_data_is_not_echoed_whole(what, tmp_path, capsys):
    long = "L" * (1 << 20)
    text = {
        "layer name": INPUT.format(dims="dim: 1 dim: 3")
        + f'layer {{ name: "{long}" type: "Frobnicate" bottom: "data" top: "o" }}',
        "bottom name": INPUT.format(dims="dim: 1 dim: 3")
        + f'layer {{ name: "r" type: "ReLU" bottom: "{long}" top: "o" }}',
        "garbage": 'layer { name: "' + long,
        "net name": f'name: "{long}"\n',
    }[what]
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    status, out, err = main(capsys, "time", "--model", path)
    assert status == 2 and "net.prototxt" in err and len(err) + len(out) < 2000, err[:3000]


def test_garbage_on_the_command_line_is_short(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_bytes(b'layer { name: "' + b"q" * (1 << 20))
    out = cgp("time", "--model", path)
    assert_user_error(out, "net.prototxt:1:15", "characters)")
    assert len(out.stderr) < 1000


# -- damaged LMDBs and bad records -----------------------------------------------------------

LMDB_NET = """
name: "lmdb"
layer {{ name: "d" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.004 }} data_param {{ source: "{source}" batch_size: 8 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


def make_lmdb(path, n=300, labels=None):
    """A real database, written by cgp's own writer (as `cgp convert` does)."""
    pytest.importorskip("lmdb")
    from cgp.data.convert import write_lmdb
    images, synthetic = synthetic_images(n, (1, 28, 28), 5)
    write_lmdb(path, images, synthetic if labels is None else labels, 8, log=lambda l: None)
    return path


def lmdb_solver(tmp_path, db):
    (tmp_path / "net.prototxt").write_text(LMDB_NET.format(source=db))
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 3 '
                    'snapshot_after_train: false\n')
    return path


def damage(db, how):
    """Damage data.mdb: cut it in half, or spoil the flags of its first data pages, or point
    the main tree's root (in both meta pages) past the last page."""
    path = db / "data.mdb"
    data = bytearray(path.read_bytes())
    page = 4096
    if how == "truncated":
        data = data[:len(data) // 2]
    elif how == "page flags":
        for p in (2, 3):
            data[p * page + 10] ^= 0xFF
    else:   # MDB_meta after the 16-byte page header: the main tree's md_root at 128,
        for meta in (0, page):   # mm_last_pg at 136
            last, = struct.unpack_from("<Q", data, meta + 136)
            struct.pack_into("<Q", data, meta + 128, last + 10)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, words", [
    ("truncated", ["data.mdb is truncated or damaged"]),
    ("page flags", ["cannot read", "MDB_CORRUPTED"]),
    ("root", ["cannot read", "MDB_PAGE_NOTFOUND"]),
])
def test_a_damaged_lmdb_is_one_clear_error_naming_it(how, words, tmp_path):
    """A truncated data.mdb used to end the process with SIGBUS, a spoiled page with the
    binding's traceback."""
    db = make_lmdb(tmp_path / "train_lmdb")
    damage(db, how)
    out = cgp("train", "--solver", lmdb_solver(tmp_path, db), "--workers", "threads",
              cwd=tmp_path)
    assert_user_error(out, f"LMDB {db}", *words)


def test_a_database_damaged_while_it_is_read_is_a_data_error(tmp_path):
    """The streaming reader's thread turns the binding's errors into DataError too."""
    pytest.importorskip("lmdb")
    from cgp.data.lmdb_data import LmdbRecords
    db = make_lmdb(tmp_path / "db", n=2000)
    records = LmdbRecords(db, cache_bytes=0)   # streamed
    records.read(0, 8)
    with open(db / "data.mdb", "r+b") as f:    # in place: the file stays as long
        pages = os.fstat(f.fileno()).st_size // 4096
        for page in range(2, pages):
            f.seek(page * 4096 + 10)
            f.write(b"\xff")
    try:
        # The batch read ahead (records 8 on) may meet the damage first.
        with pytest.raises(DataError, match=f"LMDB {re.escape(str(db))}: cannot read records "
                                            r"from (8|1000) on: .*MDB_"):
            records.read(1000, 8)
    finally:
        records.close()


def test_a_bad_label_names_the_lmdb_record(tmp_path, mnist_dir):
    _, labels = synthetic_images(40, (1, 28, 28), 5)
    labels = labels.astype(np.int64)
    labels[21] = 12
    db = make_lmdb(tmp_path / "labels_lmdb", n=40, labels=labels)
    sp = solver(LMDB_NET.format(source=db), snapshot_after_train=False)
    t = Trainer(sp, None, quiet(), log=lambda line: None)
    t.steps(2)    # records 0 to 15
    with pytest.raises(DataError, match=re.escape(
            f"layer 'd': LMDB {db}: record 21 (key 00000021): label 12 is not a class of "
            "layer 'loss', which takes labels 0 to 9")):
        t.step()
    t.close()
    # A bundled data set's records are named likewise.
    sp = solver(TINY.replace("num_output: 10", "num_output: 5"))
    t = trainer(sp, mnist_dir)
    with pytest.raises(DataError, match=r"data set mnist:train: record \d+: label [5-9] is not "
                                        r"a class of layer 'loss'"):
        t.steps(4)
    t.close()


def test_the_pickled_cifar_folder_is_named(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"\x80\x04pickle")
    for data_dir in (tmp_path, tmp_path / "cifar-10-batches-py"):
        with pytest.raises(DataError, match=re.escape(
                f"{tmp_path / 'cifar-10-batches-py'} holds CIFAR-10's pickled Python "
                "version, which is not supported") + ".*cifar-10-binary.tar.gz"):
            store.locate("cifar10", str(data_dir), download=False)


# -- a blob written twice --------------------------------------------------------------------

def test_a_second_writer_of_a_blob_is_refused_and_in_place_stays_allowed():
    text = (INPUT.format(dims="dim: 2 dim: 3")
            + 'layer { name: "a" type: "ReLU" bottom: "data" top: "x" }'
            + 'layer { name: "b" type: "ReLU" bottom: "x" top: "x" }'           # in place
            + 'layer { name: "c" type: "Sigmoid" bottom: "data" top: "x" }')    # a second writer
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    with pytest.raises(NetError, match=re.escape(
            "n.prototxt: layer 'c': top blob 'x' is already produced by another layer "
            "(Caffe: 'produced by multiple sources')")):
        build_net(param, "n.prototxt")
    del param.layer[-1]
    build_net(param, "n.prototxt")


# -- snapshots: pairs, kills, full disks -----------------------------------------------------

def pair_files(folder):
    return sorted(p.name for p in Path(folder).iterdir() if not p.name.endswith(".lock"))


def test_a_full_disk_leaves_the_previous_pair(mnist_dir, tmp_path, monkeypatch):
    t = trainer(solver(snapshot_prefix=str(tmp_path / "s")), mnist_dir)
    t.snapshot()
    before = {p: (tmp_path / p).read_bytes() for p in pair_files(tmp_path)}
    t.steps(1)
    real_fsync, calls = os.fsync, []

    def fsync(fd):    # the .solverstate's data, the second file synced, finds the disk full
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CgpError, match=re.escape(f"cannot write snapshot {tmp_path}/s_iter_1."
                                                 "caffemodel: No space left on device")):
        t.snapshot()
    monkeypatch.undo()
    assert {p: (tmp_path / p).read_bytes() for p in pair_files(tmp_path)} == before
    t.close()


CTRL_C_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_snapshot import solver, trainer
# Ctrl-C as at a terminal: a process started in the background of a script inherits
# SIGINT ignored, and then rightly keeps ignoring it.
signal.signal(signal.SIGINT, signal.default_int_handler)
t = trainer(solver(snapshot_prefix={prefix!r}), {mnist!r})
real = os.replace
def replace(src, dst):   # Ctrl-C as the .caffemodel takes its name
    if str(dst).endswith(".caffemodel"):
        signal.raise_signal(signal.SIGINT)
    real(src, dst)
os.replace = replace
try:
    t.snapshot()
except KeyboardInterrupt:
    print("interrupted after the snapshot")
"""


def test_a_second_ctrl_c_between_the_two_renames_waits_for_the_pair(mnist_dir, tmp_path):
    """Ctrl-C between the pair's two renames takes effect once both are done: the
    interrupt comes, and the pair is whole. In a process of its own with Python's Ctrl-C
    handler, as at a terminal: a suite run in the background of a script inherits SIGINT
    ignored, which the snapshot's held signals then rightly keep ignoring."""
    script = CTRL_C_SCRIPT.format(tests=str(ROOT / "tests"), prefix=str(tmp_path / "s"),
                                  mnist=str(mnist_dir))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "interrupted after the snapshot" in out.stdout, out.stderr
    assert pair_files(tmp_path) == ["s_iter_0.caffemodel", "s_iter_0.solverstate"]


def test_a_full_disk_on_a_real_file_system(mnist_dir, tmp_path):
    """A tmpfs of 400 KiB holds a few of the tiny net's 77 KB pairs, then the disk is full:
    exit status 2 naming the snapshot, every pair on the disk whole, nothing half written."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs",
                                            str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        (tmp_path / "tiny.prototxt").write_text(TINY)
        (tmp_path / "solver.prototxt").write_text(
            'net: "tiny.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 max_iter: 40 '
            'snapshot: 1 snapshot_prefix: "disk/tiny" random_seed: 3\n')
        out = cgp("train", "--solver", tmp_path / "solver.prototxt", "--data-dir", mnist_dir,
                  "--workers", "threads", cwd=tmp_path)
        assert_user_error(out, "cannot write snapshot disk/tiny_iter_", "No space left on device")
        states = list(disk.glob("tiny_iter_*.solverstate"))
        assert len(states) >= 2 and not list(disk.glob(".*.tmp"))
        assert len(list(disk.glob("tiny_iter_*.caffemodel"))) == len(states)
        for state in states:
            parsed = caffe_pb2.SolverState.FromString(state.read_bytes())
            assert read_caffemodel(tmp_path / parsed.learned_net)["ip1"][0].shape == (12, 784)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_snapshot import solver, trainer
t = trainer(solver(snapshot_prefix={prefix!r}), {mnist!r})
t.snapshot()
t.steps(1)
real, calls = os.replace, []
def replace(src, dst):   # killed after rename number {after}
    if len(calls) == {after}:
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(dst)
    real(src, dst)
os.replace = replace
t.snapshot()
"""


@pytest.mark.parametrize("after", [0, 1])
def test_a_kill_during_a_snapshot_leaves_a_whole_pair(after, mnist_dir, tmp_path):
    """SIGKILL before the pair's first rename, or between its two: the next run on the
    prefix removes the temporary files, or completes the pair; never a weights file
    without its state, nor a state of other weights."""
    prefix = tmp_path / "snaps" / "s"
    script = KILL_SCRIPT.format(tests=str(ROOT / "tests"), prefix=str(prefix),
                                mnist=str(mnist_dir), after=after)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    names = pair_files(prefix.parent)
    assert (".s_iter_1.solverstate.tmp" in names) and ("s_iter_1.solverstate" not in names)
    lines = []
    t = Trainer(solver(snapshot_prefix=str(prefix)), None, quiet(data_dir=str(mnist_dir)),
                log=lines.append)
    t.hold_prefix()   # what solve() and snapshot() do first
    t.close()
    names = pair_files(prefix.parent)
    assert not [n for n in names if n.startswith(".")], names
    if after == 0:
        assert names == ["s_iter_0.caffemodel", "s_iter_0.solverstate"]
        assert any(line.startswith("Removed 2 temporary file(s)") for line in lines)
    else:
        assert names == ["s_iter_0.caffemodel", "s_iter_0.solverstate",
                         "s_iter_1.caffemodel", "s_iter_1.solverstate"]
        assert f"Completed the snapshot {prefix}_iter_1.solverstate that an interrupted run " \
               "had left half committed" in lines
        resumed = trainer(solver(snapshot_prefix=str(prefix)), mnist_dir, max_iter=2)
        resumed.restore(f"{prefix}_iter_1.solverstate")
        whole = trainer(solver(snapshot_prefix=str(tmp_path / "w")), mnist_dir, max_iter=1)
        whole.solve()
        assert resumed.iter == 1 and np.array_equal(resumed.net.params, whole.net.params)


def test_start_up_removes_only_the_prefix_temporaries(tmp_path):
    mine = [".s_iter_3.caffemodel.tmp", ".s_iter_3.caffemodel.ab_d12z9.tmp",
            ".s_iter_12.solverstate.x1y2z3w4.probe", ".s_iter_3.solverstate.tmp"]
    others = [".t_iter_3.caffemodel.tmp", ".s_iter_x.caffemodel.tmp", "s_iter_3.caffemodel.tmp",
              ".s_iter_3.caffemodel.tmp.bak", "notes.txt", ".s_x_iter_3.caffemodel.tmp"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    assert recover_snapshots(str(tmp_path / "s")) == []   # the .solverstate's was not whole
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)


# -- one run per prefix, SIGTERM -------------------------------------------------------------

@pytest.fixture
def tiny_solver_file(tmp_path):
    (tmp_path / "tiny.prototxt").write_text(TINY)
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "tiny.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 '
                    'display: 1 max_iter: 1000000 snapshot_prefix: "snaps/tiny" '
                    'random_seed: 3\n')
    return path


def start(solver_path, mnist_dir):
    """`cgp train` on 2 worker processes, without end (the tests stop it), in the solver's
    folder."""
    return RunningCgp(["train", "--solver", solver_path, "--data-dir", mnist_dir, "--workers",
                       "processes", "--threads", "2"], solver_path.parent)


def test_a_second_run_on_a_prefix_refuses_to_start(tiny_solver_file, mnist_dir, tmp_path):
    """Named by the first run's pid and command line; the lock goes with the first run's
    main process, even when killed and while its forked worker lives on."""
    with start(tiny_solver_file, mnist_dir) as first:
        first.wait_for("Iteration 1 (")
        second = cgp("train", "--solver", tiny_solver_file, "--data-dir", mnist_dir, "--iters",
                     "2", cwd=tmp_path)
        assert_user_error(second, "snapshot prefix 'snaps/tiny' is in use by another run "
                          f"(pid {first.pid}, command ", "-m cgp train --solver",
                          "--snapshot-prefix")
        # A trainer that writes no snapshot (equivalence, bench) takes no lock.
        sp = solver(snapshot_prefix=str(tmp_path / "snaps" / "tiny"))
        t = trainer(sp, mnist_dir)
        t.steps(1)
        with pytest.raises(CgpError, match="is in use by another run"):
            t.snapshot()
        t.close()
        workers = psutil.Process(first.pid).children()
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
        lock = lock_prefix(str(tmp_path / "snaps" / "tiny"))   # free at once
        assert lock is not None
        lock.release()
        for worker in workers:
            worker.wait(timeout=30)


def test_sigterm_stops_with_a_snapshot_like_ctrl_c(tiny_solver_file, mnist_dir, tmp_path):
    """What a batch scheduler sends before it kills a job, to every process of it (here the
    process group: the forked worker leaves it to the main process)."""
    with start(tiny_solver_file, mnist_dir) as run:
        run.wait_for("Iteration 2 (")
        workers = psutil.Process(run.pid).children()
        os.killpg(run.pid, signal.SIGTERM)
        run.wait_for("Optimization stopped early")
        text = run.finish()
    assert run.proc.returncode == 0, text
    assert "SIGTERM: stopping after this iteration (SIGTERM again to abort)" in text
    assert "Traceback" not in text
    states = list((tmp_path / "snaps").glob("tiny_iter_*.solverstate"))
    assert len(states) == 1 and states[0].with_suffix(".caffemodel").is_file()
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


# -- resumes ---------------------------------------------------------------------------------

def test_resuming_at_the_end_writes_nothing(mnist_dir, tmp_path):
    sp = solver(snapshot_prefix=str(tmp_path / "s"))    # snapshot_after_train on, Caffe's
    first = trainer(sp, mnist_dir, max_iter=3)
    first.solve()
    first.close()
    files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp_path.glob("s_iter_3.*")}
    assert len(files) == 2
    lines = []
    again = Trainer(sp, None, quiet(data_dir=str(mnist_dir), max_iter=3), log=lines.append)
    again.restore(tmp_path / "s_iter_3.solverstate")
    again.solve()
    again.close()
    assert ("Note: resumed at iteration 3, max_iter is 3: nothing to train; no snapshot "
            "written") in lines
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files} == files
    assert sorted(pair_files(tmp_path)) == sorted(p.name for p in files)


def test_a_state_without_weights_says_they_start_fresh(mnist_dir, tmp_path):
    t = trainer(solver(), mnist_dir)
    write_solverstate(tmp_path / "x.solverstate", 2, "", t.solver, t.net,
                      resume=t.resume_state())
    lines = []
    again = Trainer(solver(), None, quiet(data_dir=str(mnist_dir)), log=lines.append)
    again.restore(tmp_path / "x.solverstate")
    assert (f"Note: {tmp_path / 'x.solverstate'} names no weights file (its learned_net is "
            "empty): the weights start from the net's fillers") in lines


@pytest.mark.parametrize("field, value, words", [
    ("seed", -5, "its seed -5 is outside 0 to 2**63 - 1"),
    ("data_origin", 9, "cgp's resume record is corrupt (data origin 9 for iteration 2)"),
])
def test_a_resume_record_out_of_range_is_refused(field, value, words, mnist_dir, tmp_path):
    t = trainer(solver(), mnist_dir)
    resume = t.resume_state()
    setattr(resume, field, value)
    write_solverstate(tmp_path / "x.solverstate", 2, "", t.solver, t.net, resume=resume)
    with pytest.raises(DataError, match=re.escape(words)):
        trainer(solver(), mnist_dir).restore(tmp_path / "x.solverstate")


# -- the memory line -------------------------------------------------------------------------

@pytest.mark.parametrize("net", ["lenet", "resnet20"])
def test_the_memory_line_counts_what_the_process_holds(net, mnist_dir, cifar_dir, tmp_path):
    """The figure against the measured peak: the main process's resident memory plus the
    pages of its forked worker of its own (USS), sampled while `cgp train` runs. ResNet-20's
    BatchNorm pauses every call at its batch sums, so the whole batch's buffers (data, diff
    and the layers' scratch) are held at once. The kernels are compiled first: the line
    leaves out a first run's compiling processes (memory.KERNEL_BYTES), which can hold
    more than the training itself."""
    from cgp import models
    args = ["mnist", "--data-dir", str(mnist_dir)]
    if net == "resnet20":   # its test at the end on one batch, not 100
        sp = models.FOLDER / "resnet20_cifar10_solver.prototxt"
        text = sp.read_text().replace("test_iter: 100", "test_iter: 1")
        text = text.replace('net: "', f'net: "{models.FOLDER}/')
        (tmp_path / "solver.prototxt").write_text(text)
        args = ["--solver", "solver.prototxt", "--data-dir", str(cifar_dir)]
    subprocess.run([sys.executable, "-m", "cgp", "compile", *args], cwd=tmp_path, check=True,
                   stdout=subprocess.DEVNULL)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgp", "train", *args,
         "--threads", "2", "--iters", "20" if net == "lenet" else "2",
         "--workers", "processes", "--no-log"], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    main_process, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            total = main_process.memory_info().rss
            for child in main_process.children():
                total += child.memory_full_info().uss
            peak = max(peak, total)
        except psutil.Error:
            pass
        time.sleep(0.02)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    line = next(line for line in out.splitlines() if line.startswith("cgp: memory: "))
    figure = float(re.match(r"cgp: memory: ([\d.]+) MiB", line)[1]) * 2**20
    assert 0.7 <= figure / peak <= 1.5, (line, peak / 2**20)


# -- cgp test and Accuracy with non-finite scores -------------------------------------------

def test_accuracy_never_counts_a_nan_score_as_a_hit():
    from cgp.kernels import loss as K
    x = np.zeros((4, 3, 1), np.float32)
    x[:, 1] = 1.0                          # class 1 wins everywhere
    x[1, 0] = np.nan                       # another class's score is NaN
    x[2, 1] = np.nan                       # the true class's own score is NaN
    x[3, 2] = np.nan
    labels = np.ones((4, 1), np.float32)
    correct = np.zeros(3, np.int64)
    total, bad = K.accuracy_forward(x, labels, 1, False, 0, correct)
    assert (total, bad) == (1, -1) and correct.tolist() == [0, 1, 0]
    total, _ = K.accuracy_forward(x, labels, 3, False, 0, correct)   # top 3: all but NaN rows
    assert total == 1


def test_cgp_test_with_non_finite_outputs_says_so(mnist_dir, tmp_path, capsys):
    t = trainer(solver(), mnist_dir)
    t.net.params[:] = 1e30                 # finite weights whose scores overflow
    write_caffemodel(tmp_path / "huge.caffemodel", t.net)
    t.close()
    (tmp_path / "net.prototxt").write_text(TINY)
    status, out, err = main(capsys, "test", "--model", tmp_path / "net.prototxt", "--weights",
                            tmp_path / "huge.caffemodel", "--iterations", 2, "--data-dir",
                            mnist_dir, "--workers", "threads")
    assert status == 2 and "Traceback" not in err
    assert "cgp: error: batch 0: loss = " in err and "the net's outputs are not finite" in err
    assert not re.search(r"^acc = ", out, re.M)    # no score of the whole test
