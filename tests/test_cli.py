"""The command line as a user meets it: one clear message and exit status 2 for a
mistake, never a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import quick_solver


def cgp(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "cgp", *args], capture_output=True,
                          text=True, cwd=cwd)


def cgp_in_process(args, cwd, monkeypatch, capsys):
    """What `python -m cgp ARGS` in cwd does, run by cgp.cli.main in this process (a second
    or more less than a process of its own, which imports numpy, Numba and MPI)."""
    from cgp import cli
    monkeypatch.chdir(cwd)
    try:
        status = cli.main(list(args))
    except SystemExit as e:   # argparse's own errors
        status = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out.out, out.err)


def assert_user_error(out, *fragments):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, out.stderr


def test_malformed_solver_names_file_and_line(tmp_path):
    path = tmp_path / "bad_solver.prototxt"
    path.write_text('net: "x.prototxt"\nbase_lr: 0.01\nbase_lrr: 3\n')
    assert_user_error(cgp("train", "--solver", str(path)), "bad_solver.prototxt:3", "base_lrr")


def test_missing_net_file_is_named(tmp_path):
    path = tmp_path / "solver.prototxt"
    for name in ("nowhere/net.prototxt", tmp_path / "nowhere.prototxt"):   # relative, absolute
        path.write_text(f'net: "{name}"\nbase_lr: 0.01\nlr_policy: "fixed"\n')
        assert_user_error(cgp("train", "--solver", str(path), cwd=tmp_path),
                          f"net file (solver field net) '{name}' not found")


def test_negative_max_iter_is_refused(tmp_path):
    path = tmp_path / "solver.prototxt"
    net = Path(__file__).resolve().parents[1] / LENET_NET
    path.write_text(f'net: "{net}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: -5\n')
    assert_user_error(cgp("train", "--solver", str(path), cwd=tmp_path),
                      "max_iter must be at least 0, got -5")


def test_default_seed_is_said(tmp_path, mnist_dir):
    net = Path(__file__).resolve().parents[1] / LENET_NET
    path = tmp_path / "solver.prototxt"   # no random_seed
    path.write_text(f'net: "{net}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 0\n')
    args = ("train", "--solver", str(path), "--data-dir", str(mnist_dir))
    out = cgp(*args, cwd=tmp_path)
    assert out.returncode == 0 and ", seed 1701 (no random_seed set), " in out.stdout, out.stdout
    out = cgp(*args, "--seed", "5", cwd=tmp_path)
    assert out.returncode == 0 and ", seed 5, " in out.stdout, out.stdout


def test_unknown_layer_in_net(tmp_path):
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "in" type: "Input" top: "d" input_param { shape { dim: 1 dim: 3 } } }\n'
        'layer { name: "odd" type: "Frobnicate" bottom: "d" top: "o" }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\n')
    assert_user_error(cgp("train", "--solver", str(tmp_path / "solver.prototxt"), cwd=tmp_path),
                      "net.prototxt: layer 'odd': unsupported layer type 'Frobnicate'",
                      "Convolution")
    assert_user_error(cgp("time", "--model", "net.prototxt", cwd=tmp_path),
                      "net.prototxt: layer 'odd': unsupported layer type 'Frobnicate'")


def test_unknown_model_name():
    assert_user_error(cgp("train", "nosuchmodel"), "nosuchmodel", "mnist")


def test_missing_data_explains_where_it_looked(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(cgp("train", "mnist", "--data-dir", str(empty)), str(empty))


def test_bad_thread_list():
    assert_user_error(cgp("equivalence", "mnist", "--threads", "1,x"), "--threads")


def test_train_small_run_end_to_end(tmp_path, mnist_dir):
    """A whole `cgp train` run: progress lines, a test, snapshots, the summary."""
    out = cgp("train", "--solver", str(quick_solver(tmp_path)), "--iters", "4", "--threads", "2",
              "--data-dir", str(mnist_dir), "--snapshot-prefix", str(tmp_path / "snap"),
              cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "subnormals flushed to zero" in out.stdout    # the default, said at start-up
    assert "Iteration 0 (" in out.stdout and "lr = 0.01" in out.stdout
    assert "Test net output #0: accuracy" in out.stdout
    assert (tmp_path / "snap_iter_4.caffemodel").is_file()
    assert (tmp_path / "snap_iter_4.solverstate").is_file()
    assert "weights written to" in out.stdout


def test_unsupported_solver_field_is_refused(tmp_path, mnist_dir):
    from cgp import models
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{models.FOLDER / "lenet_train_test.prototxt"}"\nbase_lr: 0.01\n'
                    'lr_policy: "fixed"\nsnapshot_diff: true\n')
    assert_user_error(cgp("train", "--solver", str(path), "--data-dir", str(mnist_dir)),
                      "snapshot_diff")


def test_unknown_worker_kind_is_refused():
    assert_user_error(cgp("equivalence", "mnist", "--workers", "threads,fibres"),
                      "--workers wants threads, processes or both", "fibres")
    assert_user_error(cgp("bench", "speedup", "mnist", "--workers", "ranks"), "--workers")
    assert_user_error(cgp("train", "mnist", "--workers", "fibres"), "--workers", "processes")


LENET_NET = "models/lenet_train_test.prototxt"


@pytest.mark.parametrize("args,message", [
    (("train", "mnist", "--chunks", "0"), "--chunks must be at least 1, got 0"),
    (("train", "mnist", "--chunks", "-3"), "--chunks must be at least 1, got -3"),
    (("train", "mnist", "--threads", "0"), "--threads must be at least 1"),
    (("test", "--model", LENET_NET, "--weights", "none.caffemodel", "--threads", "0"),
     "--threads must be at least 1, got 0"),
    (("train", "mnist", "--iters", "-1"), "--iters must be at least 0, got -1"),
    (("train", "mnist", "--seed", "-5"), "--seed must be from 0 to 2**63 - 1"),
    (("train", "mnist", "--seed", str(2**63)), "--seed must be from 0 to 2**63 - 1"),
    (("equivalence", "mnist", "--threads", "1", "--iters", "0"), "--iters must be at least 1"),
    (("equivalence", "mnist", "--threads", "1", "--chunks", "0"), "--chunks must be at least 1"),
    (("bench", "speedup", "mnist", "--threads", "1", "--chunks", "0"), "--chunks must be"),
    (("bench", "speedup", "mnist", "--threads", "1", "--repeats", "0"), "--repeats must be"),
    (("bench", "speedup", "mnist", "--threads", "1", "--lead-in", "-1"),
     "--lead-in must be at least 0"),
    (("time", "--model", LENET_NET, "--chunks", "0"), "--chunks must be at least 1"),
    (("time", "--model", LENET_NET, "--iterations", "0"), "--iterations must be at least 1, got 0"),
    (("time", "--model", "no_net.prototxt"), "model 'no_net.prototxt' not found (looked in"),
    (("test", "--model", "no_net.prototxt", "--weights", "w"), "model 'no_net.prototxt' not found"),
])
def test_numbers_out_of_range_are_refused_before_anything_runs(args, message, mnist_dir,
                                                                 tmp_path, monkeypatch, capsys):
    """A count or seed out of range is a user mistake: one message naming the flag, exit
    status 2, nothing written (a seed too large for a snapshot used to fail only when the
    first snapshot was written, after the training). In this process: the tests above run
    `python -m cgp` itself."""
    root = Path(__file__).resolve().parents[1]
    out = cgp_in_process([str(root / a) if a == LENET_NET else a for a in args]
                         + ["--data-dir", str(mnist_dir)], tmp_path, monkeypatch, capsys)
    assert_user_error(out, message)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_outputs_are_found_before_the_work(tmp_path, mnist_dir):
    """Where a result cannot be written is said before the work that makes it, never after
    it (the folder here is a regular file, which no user can write into)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = cgp("train", "mnist", "--iters", "2", "--data-dir", str(mnist_dir),
              "--snapshot-prefix", str(blocker / "snap"), cwd=tmp_path)
    assert_user_error(out, f"cannot write {blocker / 'snap'}_iter_0.caffemodel")
    assert "Iteration 0" not in out.stdout
    if Path("/proc/self").is_dir():   # a folder that exists but takes no file, even from root
        out = cgp("train", "mnist", "--iters", "2", "--data-dir", str(mnist_dir),
                  "--snapshot-prefix", "/proc/snap", cwd=tmp_path)
        assert_user_error(out, "cannot write /proc/snap_iter_0.caffemodel: folder /proc")
        assert "Iteration 0" not in out.stdout
    out = cgp("bench", "speedup", "mnist", "--threads", "1", "--out", str(blocker / "results"),
              "--data-dir", str(mnist_dir), cwd=tmp_path)
    assert_user_error(out, f"cannot write {blocker / 'results'}")
    for args in (("--to", "lmdb", str(blocker / "db")),
                 ("--to", "lmdb", str(tmp_path / "db"), "--mean", str(blocker / "mean"))):
        out = cgp("convert", "mnist", *args, "--limit", "5", "--data-dir", str(mnist_dir))
        assert_user_error(out, f"cannot write {blocker}")
        assert not (tmp_path / "db").exists()


def test_thread_workers_past_their_scale_are_warned_of():
    from cgp.options import THREAD_WORKERS_SCALE, check_threads
    lines = []
    check_threads(THREAD_WORKERS_SCALE + 1, lines.append, "threads")
    assert any("--workers processes scales further" in line for line in lines)
    for threads, workers in ((THREAD_WORKERS_SCALE, "threads"),
                             (THREAD_WORKERS_SCALE + 1, "processes")):
        lines = []
        check_threads(threads, lines.append, workers)
        assert not any("interpreter lock" in line for line in lines), lines


def test_weights_of_another_net_are_refused_by_test(tmp_path, mnist_dir):
    """`cgp test` with a .caffemodel that holds none of the net's layers fails, naming them,
    rather than score a net of zeros."""
    from cgp.proto import caffe_pb2
    other = caffe_pb2.NetParameter(name="other")
    blob = other.layer.add(name="fc7", type="InnerProduct").blobs.add()
    blob.shape.dim.extend([2, 2])
    blob.data.extend([0.0] * 4)
    (tmp_path / "other.caffemodel").write_bytes(other.SerializeToString())
    net = Path(__file__).resolve().parents[1] / LENET_NET
    out = cgp("test", "--model", str(net), "--weights", "other.caffemodel", "--iterations", "1",
              "--data-dir", str(mnist_dir), cwd=tmp_path)
    assert_user_error(out, "--weights other.caffemodel: holds no layer of the net (its layers "
                           "with weights: conv1, conv2, ip1, ip2)")


TINY_NET = """
name: "tiny"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.00390625 } data_param { source: "mnist:train" batch_size: 8 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to share out")
def test_first_run_compiles_in_processes_to_the_same_bits(tmp_path, mnist_dir):
    """On an empty kernel cache, cgp train has processes compile the net's kernels first: the
    run itself then compiles none, and ends on the same weights as a run whose process
    compiled its own kernels (--compile-processes 1: none) because it ran on a CPU of other
    features (NUMBA_CPU_FEATURES, by which Numba keys its cache entries): the cache holds
    nothing such a CPU may run. That run's two workers are processes: it compiles before it
    forks them (its start-up line after the compiling), else each would compile its own.
    A second run starts none."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features().flatten()
    other = features.replace("+rdrnd", "-rdrnd") if "+rdrnd" in features else features + ",+rdrnd"
    (tmp_path / "net.prototxt").write_text(TINY_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nmomentum: 0.9\nlr_policy: "fixed"\nmax_iter: 3\n'
        'random_seed: 7\nsnapshot_prefix: "snap"\n')

    def train(cache, prefix, one_core=False):
        moved = {"NUMBA_CPU_FEATURES": other} if one_core else {}
        return subprocess.run(
            [sys.executable, "-m", "cgp", "train", "--solver", "solver.prototxt", "--data-dir",
             str(mnist_dir), "--snapshot-prefix", prefix, "--no-log", "--compile-processes",
             "1" if one_core else "2", "--threads", "2" if one_core else "1"],
            capture_output=True, text=True, cwd=tmp_path,
            env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / cache), **moved})

    shared = train("cache", "shared")
    assert shared.returncode == 0, shared.stdout + shared.stderr
    assert "compiling kernels in 2 processes" in shared.stdout
    assert "compiled " in shared.stdout
    assert "compiling kernels (first run only" not in shared.stdout   # the run compiled none
    again = train("cache", "again")
    assert again.returncode == 0 and "compil" not in again.stdout, again.stdout
    alone = train("cache", "alone", one_core=True)   # the same cache, another CPU
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "compiling kernels in" not in alone.stdout
    assert alone.stdout.index("compiling kernels (first run") < alone.stdout.index("cgp: solver")
    weights = [(tmp_path / f"{p}_iter_3.caffemodel").read_bytes()
               for p in ("shared", "again", "alone")]
    assert weights[0] == weights[1] == weights[2]


def test_compile_ahead_serves_train(tmp_path, mnist_dir):
    """`cgp compile` fills an empty kernel cache so that `cgp train` compiles nothing; asked
    again, it finds every kernel there. (What makes the cache miss: a CPU of other features
    in test_first_run_compiles_in_processes_to_the_same_bits, an edit of cgp's sources in
    tests/test_runtime.py.)"""
    (tmp_path / "net.prototxt").write_text(TINY_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 2\n'
        'random_seed: 7\nsnapshot_prefix: "snap"\n')

    def cgp(*args):
        out = subprocess.run([sys.executable, "-m", "cgp", *args, "--solver", "solver.prototxt",
                              "--data-dir", str(mnist_dir)], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ,
                                                "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    ahead = cgp("compile", "--processes", "0")
    assert "compiling kernels (first run" in ahead and "kernels compiled in" in ahead
    assert "every kernel was in the cache already" in cgp("compile")
    trained = cgp("train", "--no-log", "--compile-processes", "0", "--threads", "2")
    assert "compil" not in trained and "Optimization Done" in trained, trained
