"""Real BVLC Caffe as the referee: the LMDBs, snapshots, losses and test scores that a Caffe
build produced on LeNet / MNIST (../shared/data/caffe/lenet, see its README), reproduced by
cgp; and Caffe's own example files (../shared/data/caffe/prototxt) loading unchanged.

Everything runs in a temporary folder holding the extracted LMDBs, since Caffe's paths are
relative to the working directory; Caffe's files are read in place, never copied here."""
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from cgp.data import lmdb_data
from cgp.commands.testing import run_test
from cgp.datasets import store
from cgp.errors import DataError
from cgp.net import Net
from cgp.proto import caffe_pb2
from cgp.prototxt import read_net, read_solver
from cgp.snapshot import read_caffemodel
from cgp.train import RunConfig, Trainer

pytest.importorskip("lmdb")

# Caffe against itself (loss_sgd_openblas_variants.tsv): the largest |loss difference| over
# the 101 rows of the 100-iteration run, between OpenBLAS kernels.
CAFFE_SPREAD = 5.4e-3
LMDBS = ("mnist_train_6400_lmdb", "mnist_test_1000_lmdb")


@pytest.fixture(scope="module")
def lenet(caffe_dir):
    return caffe_dir / "lenet"


@pytest.fixture(scope="module")
def workdir(lenet, tmp_path_factory):
    """A folder holding Caffe's two LMDBs, extracted from the tarballs."""
    folder = tmp_path_factory.mktemp("caffe_lenet")
    for name in LMDBS:
        with tarfile.open(lenet / f"{name}.tar.xz") as tar:
            # The "data" filter (plain files only) where this Python has it (3.10.12+).
            tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        (folder / name).chmod(0o755)
    return folder


@pytest.fixture
def here(workdir, monkeypatch):
    """Run inside workdir, as Caffe ran inside its folder."""
    monkeypatch.chdir(workdir)
    return workdir


def read_tsv(path):
    """{iteration: loss} from a loss_*.tsv file."""
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:] if line.strip()]
    return {int(r[0]): float(r[1]) for r in rows}


def train(lenet, threads=1, weights=None, snapshot=None, max_iter=None, stream=False,
          monkeypatch=None, device="cpu"):
    """Train the fixture solver as `caffe train` did; returns (trainer, {iteration: loss}
    from the log lines, as the loss_*.tsv files were made)."""
    if stream:   # read the LMDB batch by batch through the prefetching reader thread
        monkeypatch.setattr(lmdb_data, "CACHE_BYTES", 0)
    solver = lenet / "lenet_solver_fixture.prototxt"
    sp = read_solver(solver)
    if weights:
        sp.weights.append(str(weights))
    lines = []
    trainer = Trainer(sp, str(solver), RunConfig(threads=threads, max_iter=max_iter,
                                                 progress=False, device=device),
                      log=lines.append)
    if stream:
        assert not trainer.net.sources[0].layer.records.cached
    try:
        if snapshot:
            trainer.restore(snapshot)
        trainer.solve()
    finally:
        trainer.close()
    losses = {}
    for line in lines:
        match = re.match(r"Iteration (\d+)[ ,(].*loss = (\S+)$", line)
        if match:
            losses[int(match.group(1))] = float(match.group(2))
    return trainer, losses


def test_lmdbs_read_back_as_caffe_wrote_them(lenet, here):
    """Records in key order: the first 6400 / 1000 MNIST images and labels, raw bytes."""
    for name, split, count, label_counts in (
            (LMDBS[0], "train", 6400, [628, 718, 624, 650, 660, 552, 645, 693, 587, 643]),
            (LMDBS[1], "test", 1000, [85, 126, 116, 107, 110, 87, 87, 99, 89, 94])):
        images, labels = store.load("mnist", split)
        for cache in (None, 0):   # decoded into memory, and streamed by the reader thread
            records = lmdb_data.LmdbRecords(here / name, cache_bytes=cache)
            assert len(records) == count and records.shape == (1, 28, 28)
            got_images, got_labels = records.read(0, count)
            records.close()
            assert np.array_equal(got_images, images[:count])
            assert np.array_equal(got_labels, labels[:count])
            assert np.bincount(got_labels.astype(int)).tolist() == label_counts


def test_convert_writes_caffes_database_byte_for_byte(here, tmp_path):
    """`cgp convert mnist` on the first N records writes the data.mdb that Caffe's
    convert_mnist_data wrote."""
    from cgp.data.convert import convert
    for name, split, count in ((LMDBS[0], "train", 6400), (LMDBS[1], "test", 1000)):
        out = tmp_path / name
        convert("mnist", out, split=split, limit=count, log=lambda line: None)
        assert (out / "data.mdb").read_bytes() == (here / name / "data.mdb").read_bytes()


def test_first_loss_and_test_scores(lenet, here):
    """Forward with Caffe's weights: the first training loss, and `caffe test` scores."""
    trainer, losses = train(lenet, weights=lenet / "lenet_iter_0.caffemodel", max_iter=1)
    assert losses[0] == pytest.approx(2.32814, abs=1e-5)
    print(f"\nreferee: first loss from lenet_iter_0 {losses[0]:.8g} (Caffe 2.32814)")
    model = lenet / "lenet_train_test_fixture.prototxt"
    lines = []
    means, loss = run_test(model, str(lenet / "lenet_iter_100.caffemodel"), 10,
                           log=lines.append)
    print(f"referee: test of lenet_iter_100: accuracy {means['accuracy']:.6g}, loss "
          f"{means['loss']:.8g} (Caffe 0.91, 0.286794)")
    assert f"{means['accuracy']:.6g}" == "0.91"     # exact, to the digits Caffe prints
    assert means["loss"] == pytest.approx(0.286794, abs=1e-5)
    assert loss == pytest.approx(0.286794, abs=1e-5)
    rows = [line.split("\t") for line in (lenet / "test_iter100.txt").read_text().splitlines()
            if line[:1].isdigit()]
    for b, accuracy, batch_loss in rows:
        got = dict(re.match(rf"Batch {b}, (\w+) = (\S+)$", line).groups() for line in lines
                   if line.startswith(f"Batch {b},"))
        assert got["accuracy"] == accuracy
        assert float(got["loss"]) == pytest.approx(float(batch_loss), abs=2e-5)
    assert lines[-2:] == ["accuracy = 0.91", "loss = 0.286794 (* 1 = 0.286794 loss)"]
    for snapshot, accuracy, expected in (("lenet_iter_0", 0.078, 2.33173),
                                         ("lenet_iter_50", 0.857, 0.465698)):
        means, _ = run_test(model, str(lenet / f"{snapshot}.caffemodel"), 10, threads=2,
                            log=lambda line: None)
        assert f"{means['accuracy']:.6g}" == f"{accuracy:.6g}"
        assert means["loss"] == pytest.approx(expected, abs=1e-5)


def test_caffe_referees_the_device_path(lenet, here):
    """The device engine (--device numpy: the GPU path with NumPy for CuPy) against Caffe's
    numbers: the first training loss from lenet_iter_0, and `caffe test` of lenet_iter_100."""
    _, losses = train(lenet, weights=lenet / "lenet_iter_0.caffemodel", max_iter=1,
                      device="numpy")
    assert losses[0] == pytest.approx(2.32814, abs=1e-5)
    model = lenet / "lenet_train_test_fixture.prototxt"
    means, loss = run_test(model, str(lenet / "lenet_iter_100.caffemodel"), 10,
                           log=lambda line: None, device="numpy")
    assert f"{means['accuracy']:.6g}" == "0.91"
    assert means["loss"] == pytest.approx(0.286794, abs=1e-5)


def test_one_sgd_step_matches_caffe(lenet, here):
    trainer, _ = train(lenet, weights=lenet / "lenet_iter_0.caffemodel", max_iter=1)
    caffe = read_caffemodel(lenet / "lenet_iter_1.caffemodel")
    worst = 0.0
    for name, arrays in caffe.items():
        for blob, array in zip(trainer.net.blob_param(name), arrays):
            ours = trainer.net.params[blob.offset:blob.offset + blob.size].reshape(blob.shape)
            worst = max(worst, float(np.abs(ours - array).max()))
    print(f"\nreferee: one SGD step, max |w - Caffe's lenet_iter_1| = {worst:.3g} (bound 1e-6)")
    assert worst <= 1e-6


@pytest.fixture(scope="module")
def hundred(lenet, workdir):
    """The 100-iteration run from lenet_iter_0 at 1 thread (weights decoded into memory)
    and at 3 threads (weights streamed through the prefetching reader), with snapshots."""
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        for threads, stream in ((1, False), (3, True)):
            folder = workdir / f"run_{threads}"
            folder.mkdir()
            for name in LMDBS:
                (folder / name).symlink_to(workdir / name)
            mp.chdir(folder)
            runs[threads] = (*train(lenet, threads, weights=lenet / "lenet_iter_0.caffemodel",
                                    stream=stream, monkeypatch=mp), folder)
    return runs


def test_hundred_iterations_follow_caffe(lenet, hundred):
    expected = read_tsv(lenet / "loss_sgd.tsv")
    assert sorted(expected) == list(range(101))
    for threads, (trainer, losses, _) in hundred.items():
        assert sorted(losses) == list(range(101))
        spread = max(abs(losses[i] - expected[i]) for i in expected)
        print(f"\nreferee: {threads} thread(s), 100 iterations, max |loss - Caffe's| = "
              f"{spread:.3g} (Caffe against itself: {CAFFE_SPREAD})")
        assert spread <= CAFFE_SPREAD, (threads, spread)
        assert losses[0] == expected[0] and losses[1] == expected[1]
    (one, losses_1, _), (three, losses_3, _) = hundred[1], hundred[3]
    assert losses_1 == losses_3
    assert np.array_equal(one.net.params, three.net.params)
    assert np.array_equal(one.solver.histories[0], three.solver.histories[0])


def test_resume_from_caffes_solverstate_restarts_the_data(lenet, here):
    """Caffe's .solverstate carries no data position: as `caffe train --snapshot`, the
    data starts again at the first record (iteration 50 runs on batch 0)."""
    trainer, losses = train(lenet, snapshot=lenet / "lenet_iter_50.solverstate")
    expected = read_tsv(lenet / "loss_sgd_resume_from_50.tsv")
    assert sorted(losses) == sorted(expected) == list(range(50, 101))
    assert losses[50] == pytest.approx(0.462313, abs=1e-5)     # batch 0, not batch 50
    assert max(abs(losses[i] - expected[i]) for i in expected) <= CAFFE_SPREAD
    assert trainer.data_origin == 50


def test_cgp_snapshot_resumes_bit_for_bit(lenet, hundred, monkeypatch):
    """cgp's own lenet_iter_50.solverstate continues exactly as the uninterrupted run,
    at another thread count."""
    whole, losses, folder = hundred[1]
    resume_folder = folder / "resumed"
    resume_folder.mkdir()
    for name in LMDBS:
        (resume_folder / name).symlink_to(folder / name)
    monkeypatch.chdir(resume_folder)
    resumed, resumed_losses = train(lenet, threads=2, snapshot=folder / "lenet_iter_50.solverstate")
    assert resumed.data_origin == 0
    assert all(resumed_losses[i] == losses[i] for i in range(51, 101))
    assert np.array_equal(resumed.net.params, whole.net.params)
    assert np.array_equal(resumed.solver.histories[0], whole.solver.histories[0])


def test_written_files_have_caffes_structure(lenet, hundred, here, tmp_path, monkeypatch):
    """cgp's snapshots parse with Caffe's schema as Caffe's do, and from Caffe's state cgp
    writes Caffe's files byte for byte (its .solverstate plus cgp's trailer)."""
    _, _, folder = hundred[1]
    caffe_model = caffe_pb2.NetParameter.FromString((lenet / "lenet_iter_50.caffemodel").read_bytes())
    ours = caffe_pb2.NetParameter.FromString((folder / "lenet_iter_50.caffemodel").read_bytes())
    assert [(lp.name, lp.type, lp.phase) for lp in ours.layer] == \
        [(lp.name, lp.type, lp.phase) for lp in caffe_model.layer]
    assert ours.layer[0].data_param.source == "mnist_train_6400_lmdb"
    for a, b in zip(ours.layer, caffe_model.layer):
        assert [tuple(x.shape.dim) for x in a.blobs] == [tuple(x.shape.dim) for x in b.blobs]
    state = caffe_pb2.SolverState.FromString((folder / "lenet_iter_50.solverstate").read_bytes())
    assert (state.iter, state.learned_net, state.current_step) == (50, "lenet_iter_50.caffemodel", 0)
    assert [tuple(h.shape.dim) for h in state.history] == \
        [tuple(b.shape.dim) for lp in caffe_model.layer for b in lp.blobs]

    for name in LMDBS:
        (tmp_path / name).symlink_to(here / name)
    monkeypatch.chdir(tmp_path)
    sp = read_solver(lenet / "lenet_solver_fixture.prototxt")
    trainer = Trainer(sp, str(lenet / "lenet_solver_fixture.prototxt"), RunConfig(progress=False),
                      log=lambda line: None)
    trainer.restore(lenet / "lenet_iter_50.solverstate")
    trainer.snapshot()
    trainer.close()
    written = tmp_path / "lenet_iter_50.caffemodel"
    assert written.read_bytes() == (lenet / "lenet_iter_50.caffemodel").read_bytes()
    raw = (tmp_path / "lenet_iter_50.solverstate").read_bytes()
    caffe_raw = (lenet / "lenet_iter_50.solverstate").read_bytes()
    assert raw.startswith(caffe_raw) and len(raw) > len(caffe_raw)


def example(caffe_dir, root, name, folder):
    """Caffe's example file, placed where its paths expect it (examples/<folder>/...)."""
    target = root / "examples" / folder / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(caffe_dir / "prototxt" / name)
    return target


@pytest.mark.parametrize("solver,net,folder,missing", [
    ("lenet_solver.prototxt", "lenet_train_test.prototxt", "mnist", "examples/mnist/mnist_train_lmdb"),
    ("lenet_solver_adam.prototxt", "lenet_train_test.prototxt", "mnist", "examples/mnist/mnist_train_lmdb"),
    ("cifar10_quick_solver.prototxt", "cifar10_quick_train_test.prototxt", "cifar10",
     "examples/cifar10/cifar10_train_lmdb"),
    ("cifar10_full_solver.prototxt", "cifar10_full_train_test.prototxt", "cifar10",
     "examples/cifar10/cifar10_train_lmdb"),
])
def test_example_solver_names_the_missing_database(caffe_dir, tmp_path, monkeypatch, solver, net,
                                                    folder, missing):
    monkeypatch.chdir(tmp_path)
    path = example(caffe_dir, tmp_path, solver, folder)
    example(caffe_dir, tmp_path, net, folder)
    with pytest.raises(DataError, match=re.escape(f"'{missing}' not found")):
        Trainer(read_solver(path), str(path), RunConfig(progress=False), log=lambda line: None)


def test_lenet_examples_train_unchanged(caffe_dir, workdir, tmp_path, monkeypatch):
    """Caffe's lenet_solver_adam.prototxt and lenet_train_test.prototxt, unchanged, with
    the fixture LMDBs where they expect mnist_train_lmdb / mnist_test_lmdb; then the deploy
    net lenet.prototxt with the trained weights."""
    monkeypatch.chdir(tmp_path)
    path = example(caffe_dir, tmp_path, "lenet_solver_adam.prototxt", "mnist")
    example(caffe_dir, tmp_path, "lenet_train_test.prototxt", "mnist")
    for source, name in zip(LMDBS, ("mnist_train_lmdb", "mnist_test_lmdb")):
        (tmp_path / "examples" / "mnist" / name).symlink_to(workdir / source)
    trainer = Trainer(read_solver(path), str(path), RunConfig(progress=False),
                      log=lambda line: None)
    assert trainer.solver.type == "Adam"
    losses = [trainer.step()[0] for _ in range(5)]
    assert losses[-1] < losses[0]
    trainer.snapshot()
    trainer.close()
    assert (tmp_path / "examples/mnist/lenet_iter_5.caffemodel").is_file()
    state = caffe_pb2.SolverState.FromString(
        (tmp_path / "examples/mnist/lenet_iter_5.solverstate").read_bytes())
    assert len(state.history) == 16      # Adam: m and v for each of the 8 blobs
    deploy = Net(read_net(caffe_dir / "prototxt" / "lenet.prototxt"), caffe_pb2.TEST)
    assert classify(deploy, tmp_path / "examples/mnist/lenet_iter_5.caffemodel").shape == (64, 10)


def classify(net, weights):
    """Forward a deploy net (Input layer of zeros) with weights; returns its last top."""
    from cgp.layers import Chunk
    from cgp.net import Workspace
    from cgp.snapshot import copy_weights
    copied, _ = copy_weights(net, read_caffemodel(weights), weights)
    assert copied
    ws = Workspace(net, net.batch_size, with_diff=False)
    batch = {t: a for e in net.sources for t, a in zip(e.tops, e.layer.load(0, 0, 0))}
    data = net.forward(ws, Chunk(n=net.batch_size), batch, net.param_views(net.params))
    out = data[net.entries[-1].tops[0]]
    assert np.allclose(out.sum(axis=1), 1, atol=1e-5)    # a softmax
    return out


@pytest.mark.parametrize("name", ["cifar10_quick", "cifar10_full"])
def test_cifar10_examples_train_unchanged(caffe_dir, cifar_dir, tmp_path, monkeypatch, name):
    """Caffe's cifar10 solvers and nets, unchanged, on LMDBs and a mean.binaryproto that
    `cgp convert` made where the files expect them; then their deploy nets."""
    from cgp.data.convert import convert
    monkeypatch.chdir(tmp_path)
    path = example(caffe_dir, tmp_path, f"{name}_solver.prototxt", "cifar10")
    example(caffe_dir, tmp_path, f"{name}_train_test.prototxt", "cifar10")
    folder = tmp_path / "examples" / "cifar10"
    convert("cifar10", folder / "cifar10_train_lmdb", data_dir=str(cifar_dir),
            mean=folder / "mean.binaryproto", log=lambda line: None)
    convert("cifar10", folder / "cifar10_test_lmdb", split="test", data_dir=str(cifar_dir),
            log=lambda line: None)
    lines = []
    trainer = Trainer(read_solver(path), str(path), RunConfig(progress=False), log=lines.append)
    losses = [trainer.step()[0] for _ in range(2)]
    assert all(np.isfinite(losses))
    trainer.snapshot()       # cifar10_full asks for HDF5 (snapshot_format: HDF5)
    trainer.close()
    ext = ".h5" if name == "cifar10_full" else ""
    model = folder / f"{name}_iter_2.caffemodel{ext}"
    assert model.is_file() and (folder / f"{name}_iter_2.solverstate{ext}").is_file()
    assert any("to HDF5 file" in line for line in lines) == (name == "cifar10_full")
    deploy = Net(read_net(caffe_dir / "prototxt" / f"{name}.prototxt"), caffe_pb2.TEST)
    assert classify(deploy, model).shape[1] == 10


def cgp(*args, cwd):
    return subprocess.run([sys.executable, "-m", "cgp", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


def test_command_line_as_caffes(lenet, workdir):
    """`cgp test` prints `caffe test`'s lines; mistakes end in one message naming the file."""
    model = lenet / "lenet_train_test_fixture.prototxt"
    out = cgp("test", "--model", model, "--weights", lenet / "lenet_iter_100.caffemodel",
              "--iterations", 10, "--threads", 2, cwd=workdir)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "Batch 0, accuracy = 0.93" in lines and "Batch 9, accuracy = 0.88" in lines
    assert lines[-3:] == ["Loss: 0.286794", "accuracy = 0.91",
                          "loss = 0.286794 (* 1 = 0.286794 loss)"]
    for args, fragment in (
            (("test", "--model", model, "--weights", "nowhere.caffemodel"), "nowhere.caffemodel"),
            (("test", "--model", model, "--weights", model), f"weights file {model}: not a Caffe"),
            (("train", "--solver", lenet / "lenet_solver_fixture.prototxt", "--weights",
              lenet / "lenet_iter_0.caffemodel", "--snapshot", lenet / "lenet_iter_50.solverstate"),
             "not both")):
        out = cgp(*args, cwd=workdir)
        assert out.returncode == 2 and fragment in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
