"""Snapshots in Caffe's binary formats: round trips for every solver type, the structure a
reader built from Caffe's schema alone sees, atomic writes, resume bit for bit (LMDB data,
crops, mirrors, dropout, iter_size, test passes, at another thread count), the Ctrl-C
snapshot of a real `cgp train`, and readers that turn any bad input into one DataError."""
import os
import re
import signal

import numpy as np
import pytest
from google.protobuf import text_format, unknown_fields

from cgp import snapshot
from cgp.errors import CgpError, DataError
from cgp.proto import caffe_pb2, cgp_pb2
from cgp.snapshot import (copy_weights, read_caffemodel, read_solverstate, write_caffemodel,
                          write_solverstate)
from cgp.solver import SOLVER_TYPES
from cgp.train import RunConfig, Trainer, fmt
from conftest import CAFFE_DIR, RunningCgp

HYPER = {"SGD": "momentum: 0.9", "Nesterov": "momentum: 0.9", "AdaGrad": "delta: 1e-6",
         "RMSProp": "rms_decay: 0.95", "AdaDelta": "momentum: 0.95 delta: 1e-6",
         "Adam": "momentum: 0.9 momentum2: 0.999"}

TINY = """
name: "tiny"
layer { name: "d" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 } data_param { source: "mnist:train" batch_size: 8 } }
layer { name: "d" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 } data_param { source: "mnist:test" batch_size: 10 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 12 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def solver(net=TINY, type_="SGD", **fields):
    sp = text_format.Parse(f'type: "{type_}" {HYPER[type_]} base_lr: 0.01 lr_policy: "step" '
                           'gamma: 0.5 stepsize: 2 weight_decay: 0.001 display: 0 '
                           'random_seed: 11', caffe_pb2.SolverParameter())
    text_format.Parse(net, sp.net_param)
    for key, value in fields.items():
        if isinstance(value, list):
            getattr(sp, key).extend(value)
        else:
            setattr(sp, key, value)
    return sp


def quiet(**config):
    return RunConfig(progress=False, **config)


def trainer(sp, mnist_dir, **config):
    return Trainer(sp, None, quiet(data_dir=str(mnist_dir), **config), log=lambda line: None)


@pytest.mark.parametrize("type_", SOLVER_TYPES)
def test_round_trip_and_resume_for_every_solver(type_, mnist_dir, tmp_path):
    sp = solver(type_=type_, snapshot=3, snapshot_prefix=str(tmp_path / "s"))
    whole = trainer(sp, mnist_dir, max_iter=5)
    whole.solve()
    resumed = trainer(sp, mnist_dir, max_iter=5, threads=2)
    resumed.restore(tmp_path / "s_iter_3.solverstate")
    # The round trip itself: what was written at iteration 3 reads back unchanged.
    again = trainer(sp, mnist_dir)
    state, resume = read_solverstate(tmp_path / "s_iter_3.solverstate", again.solver, again.net)
    assert len(state.history) == len(again.solver.histories) * len(again.net.param_blobs)
    for ours, theirs in zip(again.solver.histories, resumed.solver.histories):
        assert np.array_equal(ours, theirs)
    assert resumed.iter == 3 and state.current_step == 1 and resume.seed == 11
    resumed.solve()
    assert np.array_equal(resumed.net.params, whole.net.params)
    for ours, theirs in zip(resumed.solver.histories, whole.solver.histories):
        assert np.array_equal(ours, theirs)
    assert resumed.solver.current_step == whole.solver.current_step == 2


def test_state_of_another_solver_type_says_so(mnist_dir, tmp_path):
    sgd = trainer(solver(snapshot_prefix=str(tmp_path / "s")), mnist_dir)
    sgd.snapshot()
    adam = trainer(solver(type_="Adam"), mnist_dir)
    with pytest.raises(DataError, match=re.escape(
            "4 history blobs, the Adam solver on this net needs 8 (2 per parameter blob, 4 "
            "blobs): written for another net or solver type?")):
        adam.restore(tmp_path / "s_iter_0.solverstate")


def test_resuming_past_max_iter_says_there_is_nothing_to_train(mnist_dir, tmp_path):
    sp = solver(snapshot_prefix=str(tmp_path / "s"), snapshot_after_train=False)
    first = trainer(sp, mnist_dir, max_iter=3)
    first.solve()
    first.snapshot()
    lines = []
    again = Trainer(sp, None, quiet(data_dir=str(mnist_dir), max_iter=2), log=lines.append)
    again.restore(tmp_path / "s_iter_3.solverstate")
    again.solve()
    assert ("Note: resumed at iteration 3, max_iter is 2: nothing to train; no snapshot "
            "written") in lines
    assert again.iter == 3 and np.array_equal(again.net.params, first.net.params)


def has_unknown_fields(msg):
    if len(unknown_fields.UnknownFieldSet(msg)):
        return True
    for field, value in msg.ListFields():
        if field.message_type is not None:
            children = value if field.is_repeated else [value]
            if any(has_unknown_fields(child) for child in children):
                return True
    return False


def test_files_have_caffes_structure(mnist_dir, tmp_path, monkeypatch):
    """Read with Caffe's schema alone: every layer of the TRAIN net in order with its phase,
    the Data layer's source, shaped blobs; a SolverState whose only field unknown to Caffe
    is cgp's trailer, with the .caffemodel named relative, as Caffe names it."""
    monkeypatch.chdir(tmp_path)
    sp = solver(type_="Adam", snapshot_prefix="snaps/tiny")
    t = trainer(sp, mnist_dir, max_iter=2)
    t.solve()
    model = caffe_pb2.NetParameter.FromString((tmp_path / "snaps/tiny_iter_2.caffemodel").read_bytes())
    assert not has_unknown_fields(model)
    assert [(lp.name, lp.type) for lp in model.layer] == [
        ("d", "Data"), ("ip1", "InnerProduct"), ("relu", "ReLU"), ("ip2", "InnerProduct"),
        ("loss", "SoftmaxWithLoss")]
    assert all(lp.phase == caffe_pb2.TRAIN for lp in model.layer)
    assert model.layer[0].data_param.source == "mnist:train"
    assert list(model.layer[4].loss_weight) == [1.0]      # Caffe's LossLayer adds it
    assert [tuple(b.shape.dim) for b in model.layer[1].blobs] == [(12, 784), (12,)]
    assert all(not b.HasField("num") for lp in model.layer for b in lp.blobs)
    raw = (tmp_path / "snaps/tiny_iter_2.solverstate").read_bytes()
    state = caffe_pb2.SolverState.FromString(raw)
    assert [f.field_number for f in unknown_fields.UnknownFieldSet(state)] == [1701000]
    assert (state.iter, state.learned_net, state.current_step) == (2, "snaps/tiny_iter_2.caffemodel", 0)
    assert [tuple(h.shape.dim) for h in state.history] == 2 * [(12, 784), (12,), (10, 12), (10,)]
    assert not any(has_unknown_fields(h) for h in state.history)
    resume = cgp_pb2.SolverStateTrailer.FromString(raw).cgp_resume
    assert (resume.seed, resume.data_origin, resume.chunks) == (11, 0, 8)
    # Without the trailer, the bytes are exactly Caffe's serialization of the state.
    state.DiscardUnknownFields()
    trailer = cgp_pb2.SolverStateTrailer(cgp_resume=resume).SerializeToString()
    assert raw == state.SerializeToString() + trailer


def test_atomic_write_leaves_no_partial_file(mnist_dir, tmp_path, monkeypatch):
    t = trainer(solver(), mnist_dir)
    path = tmp_path / "w.caffemodel"
    write_caffemodel(path, t.net)
    before = path.read_bytes()
    t.net.params[:] = 7

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", broken_fsync)
    # The user's error names the file and the cause.
    with pytest.raises(CgpError, match=f"cannot write {path}: No space left"):
        write_caffemodel(path, t.net)
    with pytest.raises(CgpError, match="No space left"):
        write_caffemodel(tmp_path / "new.caffemodel", t.net)
    monkeypatch.undo()
    assert path.read_bytes() == before                  # the old snapshot, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.caffemodel"]   # no temp files
    write_caffemodel(path, t.net)
    assert read_caffemodel(path)["ip1"][0].ravel()[0] == 7
    assert (path.stat().st_mode & 0o777) == 0o666 & ~snapshot._UMASK


LMDB_NET = """
name: "lmdb"
layer {{ name: "d" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.004 crop_size: 6 mirror: true }}
  data_param {{ source: "{train}" batch_size: 6 backend: LMDB }} }}
layer {{ name: "d" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.004 crop_size: 6 }}
  data_param {{ source: "{test}" batch_size: 4 backend: LMDB }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 3 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "drop" type: "Dropout" bottom: "conv" top: "conv" dropout_param {{ dropout_ratio: 0.3 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


@pytest.fixture
def lmdb_net(tmp_path):
    """An LMDB net: 23 training and 9 test records of 2x8x8 (batches wrap around)."""
    pytest.importorskip("lmdb")
    from cgp.data.convert import write_lmdb
    rng = np.random.default_rng(3)
    paths = {}
    for split, n in (("train", 23), ("test", 9)):
        paths[split] = tmp_path / f"{split}_lmdb"
        write_lmdb(paths[split], rng.integers(0, 256, (n, 2, 8, 8)).astype(np.uint8),
                   rng.integers(0, 10, n), 8, log=lambda line: None)
    return LMDB_NET.format(train=paths["train"], test=paths["test"])


def test_resume_is_bit_for_bit(lmdb_net, tmp_path, monkeypatch):
    """Interrupted at iteration 5 and resumed at another thread count, with the records
    streamed: the same weights, history, test results and displayed loss as one run."""
    from cgp.data import lmdb_data
    monkeypatch.setattr(lmdb_data, "CACHE_BYTES", 0)
    sp = solver(lmdb_net, iter_size=2, average_loss=3, test_iter=[2], test_interval=3,
                snapshot=5, snapshot_prefix=str(tmp_path / "r"))
    sp.display = 1
    runs = {}
    for name, threads, start in (("whole", 1, None), ("resumed", 3, "r_iter_5.solverstate")):
        lines = []
        t = Trainer(sp, None, quiet(threads=threads, chunks=4, max_iter=9), log=lines.append)
        if start:
            t.restore(tmp_path / start)
        t.solve()
        t.close()
        # The displayed lines, without the speeds.
        runs[name] = (t, [re.sub(r" \(.*img/s\)", "", line) for line in lines
                          if line.startswith(("Iteration", "    "))])
    (whole, whole_lines), (resumed, resumed_lines) = runs["whole"], runs["resumed"]
    assert np.array_equal(whole.net.params, resumed.net.params)
    assert np.array_equal(whole.solver.histories[0], resumed.solver.histories[0])
    assert whole.last_test == resumed.last_test
    assert resumed_lines[0].startswith("Iteration 5, loss = ")
    assert resumed_lines == whole_lines[whole_lines.index(resumed_lines[0]):]
    assert any("Test net output" in line for line in resumed_lines)


def test_caffe_solverstate_restarts_the_data(lmdb_net, tmp_path):
    """A .solverstate without cgp's trailer (as Caffe writes it) resumes Caffe's way: the
    data starts again at the first record, so the next step is the first step's batch."""
    sp = solver(lmdb_net, snapshot=2, snapshot_prefix=str(tmp_path / "c"))
    t = Trainer(sp, None, quiet(max_iter=2), log=lambda line: None)
    t.solve()
    path = tmp_path / "c_iter_2.solverstate"
    caffe_only = caffe_pb2.SolverState.FromString(path.read_bytes())
    caffe_only.DiscardUnknownFields()        # what Caffe writes when it snapshots this state
    (tmp_path / "caffe.solverstate").write_bytes(caffe_only.SerializeToString())
    for name, origin in (("c_iter_2.solverstate", 0), ("caffe.solverstate", 2)):
        lines = []
        t = Trainer(sp, None, quiet(), log=lines.append)
        t.restore(tmp_path / name)
        assert (t.iter, t.data_origin) == (2, origin)
        assert any("data restarts at the first record" in line for line in lines) == (origin == 2)
        records, starts = t.net.sources[0].layer.records, []
        real_read = records.read

        def read(start, count):
            starts.append(start)
            return real_read(start, count)
        records.read = read
        t.step()
        # The step's batch, then the next one, read during the update (Trainer._read_ahead).
        assert starts == ([12, 18] if origin == 0 else [0, 6])
        t.close()


def test_bad_weights_files_are_named(mnist_dir, tmp_path):
    t = trainer(solver(), mnist_dir)
    good = tmp_path / "good.caffemodel"
    write_caffemodel(good, t.net)
    data = good.read_bytes()
    cases = {
        "truncated": data[:len(data) // 2],
        "text": TINY.encode(),
        "png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,
        "empty": b"",
    }
    for name, payload in cases.items():
        path = tmp_path / f"{name}.caffemodel"
        path.write_bytes(payload)
        with pytest.raises(DataError, match=f"weights file {path}: not a Caffe"):
            read_caffemodel(path)
    # A .solverstate given as weights: a well-formed message of another type.
    state = tmp_path / "state.caffemodel"
    write_solverstate(state, 1, "x", t.solver, t.net)
    with pytest.raises(DataError, match=f"{state}: not a Caffe NetParameter"):
        read_caffemodel(state)
    with pytest.raises(DataError, match="cannot read"):
        read_caffemodel(tmp_path / "missing.caffemodel")
    # Shapes: a blob that does not fit the net, and Caffe's legacy 4-d form that does.
    weights = read_caffemodel(good)
    weights["ip2"][0] = np.zeros((12, 10), np.float32)
    with pytest.raises(DataError, match=r"layer 'ip2' blob 0 has shape \(12, 10\), the net "
                                        r"expects \(10, 12\)"):
        copy_weights(t.net, weights, good)
    weights["ip2"][0] = np.full((1, 1, 10, 12), 3, np.float32)
    copied, skipped = copy_weights(t.net, dict(weights, other=[np.zeros(2)]), good)
    assert copied == ["ip1", "ip2"] and skipped == ["other"]
    assert np.all(t.net.params[t.net.blob_param("ip2")[0].offset:][:120] == 3)


def test_weights_option_says_what_it_copied(mnist_dir, tmp_path):
    t = trainer(solver(), mnist_dir)
    path = tmp_path / "w.caffemodel"
    write_caffemodel(path, t.net)
    sp = solver(TINY.replace('"ip2"', '"other"'), weights=[str(path)])
    lines = []
    Trainer(sp, None, quiet(data_dir=str(mnist_dir)), log=lines.append)
    assert any(line.startswith("Copied weights of 1 layers") and "ip1" in line for line in lines)
    assert any(line.startswith("Skipped 1 layers") and "ip2" in line for line in lines)
    assert any(line.startswith("Kept initial weights for: other") for line in lines)


def mutations(data, rng, count):
    """Random byte strings and damaged copies of `data`: flips, truncations, splices."""
    for i in range(count):
        kind = i % 6
        if kind == 0:
            yield rng.bytes(int(rng.integers(0, 400)))
        elif kind == 1:
            yield data[:int(rng.integers(0, len(data)))]
        else:
            buf = bytearray(data)
            for _ in range(int(rng.integers(1, 8))):
                at = int(rng.integers(0, len(buf)))
                if kind == 2:
                    buf[at] ^= 1 << int(rng.integers(0, 8))
                elif kind == 3:
                    buf[at] = int(rng.integers(0, 256))
                elif kind == 4:
                    buf[at:at] = rng.bytes(int(rng.integers(1, 6)))
                else:
                    end = min(len(buf), at + int(rng.integers(1, 40)))
                    del buf[at:end]
            yield bytes(buf)


def fuzz_inputs(mnist_dir, tmp_path, caffe):
    t = trainer(solver(type_="Adam"), mnist_dir)
    write_caffemodel(tmp_path / "m.caffemodel", t.net)
    t.snapshots.prefix = str(tmp_path / "fz")
    t.snapshot()
    seeds = [((tmp_path / "m.caffemodel").read_bytes(),
              (tmp_path / "fz_iter_0.solverstate").read_bytes(), 400)]
    if caffe is not None:   # Caffe's own files, fewer cases: they are 1.7 MB each
        seeds.append(((caffe / "lenet_iter_0.caffemodel").read_bytes(),
                      (caffe / "lenet_iter_50.solverstate").read_bytes(), 12))
    return t, seeds


def test_fuzz_readers_raise_only_data_errors(mnist_dir, tmp_path):
    caffe = CAFFE_DIR / "lenet" if (CAFFE_DIR / "lenet").is_dir() else None
    t, seeds = fuzz_inputs(mnist_dir, tmp_path, caffe)
    rng = np.random.default_rng(2024)
    path = tmp_path / "fuzz.bin"
    outcomes = {"ok": 0, "error": 0}
    for model, state, count in seeds:
        for payload in list(mutations(model, rng, count)) + list(mutations(state, rng, count)):
            path.write_bytes(payload)
            for read in (lambda: copy_weights(t.net, read_caffemodel(path), path),
                         lambda: read_solverstate(path, t.solver, t.net)):
                try:
                    read()
                    outcomes["ok"] += 1
                except DataError as e:
                    assert str(path) in str(e)
                    outcomes["error"] += 1
    assert outcomes["error"] > outcomes["ok"] > 0


@pytest.fixture
def tiny_solver_file(tmp_path):
    net = tmp_path / "tiny.prototxt"
    net.write_text(TINY)
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "tiny.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 '
                    'display: 1 max_iter: 1000000 snapshot_prefix: "snaps/tiny" '
                    'random_seed: 3 test_iter: 2 test_interval: 1000000\n')
    return path


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_signals_snapshot_a_real_training_run(tiny_solver_file, mnist_dir, tmp_path, workers):
    """SIGHUP snapshots and goes on; Ctrl-C (SIGINT) stops after the current iteration with
    a snapshot and exit status 0, as Caffe's default signal effects. The signals go to the
    whole process group, as a terminal sends them: forked workers leave them to the main
    process, and end with it."""
    import psutil
    with RunningCgp(["train", "--solver", tiny_solver_file, "--data-dir", mnist_dir,
                     "--threads", "2", "--workers", workers], tmp_path) as run:
        run.wait_for("Iteration 2 (")
        children = psutil.Process(run.pid).children()
        assert len(children) == (1 if workers == "processes" else 0)
        os.killpg(run.pid, signal.SIGHUP)
        run.wait_for("Snapshotting solver state")
        run.wait_for("Iteration")                     # still training
        os.killpg(run.pid, signal.SIGINT)
        run.wait_for("Optimization stopped early")
        text = run.finish()
    assert run.proc.returncode == 0, text
    assert "Traceback" not in text
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    snaps = sorted((tmp_path / "snaps").glob("tiny_iter_*.solverstate"),
                   key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    assert len(snaps) == 2, text
    assert not list((tmp_path / "snaps").glob(".*tmp"))
    last = caffe_pb2.SolverState.FromString(snaps[-1].read_bytes())
    assert f"Snapshotting to binary proto file snaps/tiny_iter_{last.iter}.caffemodel" in text
    assert read_caffemodel(tmp_path / last.learned_net)["ip1"][0].shape == (12, 784)
    # The only test ran at iteration 0: the summary says so rather than pass its figures off
    # as the final weights'.
    assert (f"cgp: trained to iteration {last.iter} in " in text
            and "; stopped early, the final weights untested (the last test, at iteration 0: "
            "acc " in text), text


def logged_trainer(sp, mnist_dir, **config):
    lines = []
    return Trainer(sp, None, quiet(data_dir=str(mnist_dir), **config), log=lines.append), lines


def test_a_stop_during_a_test_ends_it_and_the_training(mnist_dir, tmp_path):
    """Caffe acts on a signal's request between test batches: a stop ends the test ("Test
    interrupted.") and the training before its next iteration."""
    sp = solver(test_iter=[3], test_interval=2, snapshot_prefix=str(tmp_path / "s"))
    t, lines = logged_trainer(sp, mnist_dir, max_iter=6)
    t.signals.request = "stop"   # what Ctrl-C's handler sets; here before the first test batch
    t.solve()
    assert t.iter == 0 and "Test interrupted." in lines
    assert lines[-1] == "Optimization stopped early."
    assert (tmp_path / "s_iter_0.caffemodel").is_file() and t.last_test_iter is None


def test_test_lines_as_caffe_writes_them(mnist_dir):
    """test_compute_loss's "Test loss", and each loss output's weighted value after it, in
    training's and testing's output lines."""
    sp = solver(test_iter=[2], test_interval=2, test_compute_loss=True, display=1,
                snapshot_after_train=False)
    t, lines = logged_trainer(sp, mnist_dir, max_iter=2)
    t.solve()
    loss = fmt(t.last_test["loss"])
    assert f"Test loss: {loss}" in lines
    assert f"    Test net output #1: loss = {loss} (* 1 = {loss} loss)" in lines
    assert any(line.startswith("    Test net output #0: acc = ") and "(*" not in line
               for line in lines)
    train = [line for line in lines if line.startswith("    Train net output #0: loss = ")]
    assert len(train) == 2 and all(line.endswith(" loss)") for line in train)


def test_closing_display_is_one_forward_pass(mnist_dir):
    """With iter_size 2 Caffe's closing "Iteration N, loss = " is one pass over the next
    batch, not the mean of the iteration's passes."""
    sp = solver(iter_size=2, display=1, snapshot_after_train=False)
    t, lines = logged_trainer(sp, mnist_dir, max_iter=1)
    t.solve()
    passes = []
    for k in range(2):
        position, iteration = t._pass(t.iter, k)
        passes.append(t.engine.run(t._batch(t.engine, position, iteration), iteration, t.seed)[1])
    assert fmt(passes[0]) != fmt(sum(passes) / 2)
    assert lines[-2] == f"Iteration 1, loss = {fmt(passes[0])}"
