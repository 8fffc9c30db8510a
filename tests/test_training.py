"""The trainer's units (cgp.training) on their own: the triggers against a count simulated
iteration by iteration, Caffe's test-data position against its schedule, real signals
through Signals' handlers, the snapshot prefix and the snapshot at the end; then the loop's
hand-offs in a real training: a request heard in a step ends that steps() call and is acted
on at once, and the progress bar on a terminal prints the log past itself unchanged."""
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from google.protobuf import text_format

from cgp.comm import make_schedule
from cgp.comm.local import LocalCommunicator
from cgp.errors import DataError
from cgp.proto import caffe_pb2
from cgp.runtime.procs import make_pool
from cgp.training.config import RunConfig
from cgp.training.progress import smoothed
from cgp.training.signals import Signals
from cgp.training.snapshots import Snapshots
from cgp.training.testing import PeriodicTests
from cgp.training.triggers import Count, until
from test_snapshot import TINY, solver, trainer


def passed(interval, start, it, drained):
    """Brute force: a multiple of interval is the count now, or (before every iteration is
    claimed) one of the counts start + 1 .. it that the steps went through."""
    if it % interval == 0:
        return True
    return not drained and any(m % interval == 0 for m in range(start + 1, it + 1))


@pytest.mark.parametrize("interval", [1, 2, 3, 5, 7])
def test_count_reached_is_a_multiple_hit_or_passed(interval):
    for start in range(0, 20):
        for it in range(start, start + 12):
            for drained in (False, True):
                assert Count(it, start, drained).reached(interval) == \
                    passed(interval, start, it, drained), (start, it, drained)
    assert not any(Count(it, 0).reached(0) for it in range(10))   # no interval: never


def test_until_is_the_distance_to_the_next_multiple():
    for interval in (1, 3, 10):
        for it in range(30):
            n = until(it, interval)
            assert n >= 1 and (it + n) % interval == 0
            assert not any((it + m) % interval == 0 for m in range(1, n))
    assert min(5, until(7, 0)) == 5   # no interval: never the nearest


@pytest.fixture(scope="module")
def tiny(mnist_dir):
    t = trainer(solver(test_iter=[2], test_interval=4), mnist_dir)
    yield t
    t.close()


@pytest.mark.parametrize("interval", [1, 3, 4])
@pytest.mark.parametrize("initialization", [True, False])
def test_tests_before_counts_the_passes_caffe_ran(tiny, interval, initialization):
    """The test data goes on from where the previous pass stopped: the passes before
    iteration `it` are Caffe's tests at iterations data_origin .. it - 1 (a Caffe
    .solverstate resumed at data_origin: none before it)."""
    sp = solver(test_iter=[2], test_interval=interval, test_initialization=initialization)
    tests = PeriodicTests(sp, tiny.test_nets, tiny.test_engines)
    for origin in (0, 3, 4, 8):
        for it in range(origin, origin + 14):
            ran = sum(1 for j in range(origin, it)
                      if j % interval == 0 and (j > 0 or initialization))
            assert tests.before(it, origin) == ran, (origin, it)
    assert PeriodicTests(sp, [], []).before(9, 0) == 0    # no test net: no test
    assert tests.due(Count(0)) == initialization and tests.due(Count(interval))


def test_signals_record_requests_and_restore_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)}
    with Signals("stop", "snapshot", "none") as signals:
        signal.raise_signal(signal.SIGTERM)      # effect none: nothing at all
        assert signals.request is None and not signals.heard
        signal.raise_signal(signal.SIGHUP)
        assert signals.request == "snapshot" and not signals.told_to_stop
        signal.raise_signal(signal.SIGINT)
        assert signals.request == "stop" and signals.told_to_stop
        signal.raise_signal(signal.SIGHUP)       # a weaker request keeps the stop
        assert signals.request == "stop"
        assert signals.heard == [
            "SIGHUP: snapshotting after this iteration",
            "SIGINT: stopping after this iteration (Ctrl-C again to abort)",
            "SIGHUP: snapshotting after this iteration"]
        with pytest.raises(KeyboardInterrupt):   # a second Ctrl-C while stopping
            signal.raise_signal(signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before
    with Signals("snapshot", "snapshot", "stop") as signals:
        signal.raise_signal(signal.SIGTERM)
        assert signals.heard == ["SIGTERM: stopping after this iteration (SIGTERM again to "
                                 "abort)"]


def test_agree_says_what_was_heard_then_takes_the_agreed_request():
    pool = make_pool("threads", 1)
    try:
        comm, lines = make_schedule(LocalCommunicator(pool)), []
        signals = Signals("stop", "snapshot", "stop")
        signals.heard = ["SIGHUP: snapshotting after this iteration"]
        signals.request = "snapshot"
        assert signals.agree(comm, lines.append) == "snapshot" == signals.request
        assert lines == ["SIGHUP: snapshotting after this iteration"] and not signals.heard
        signals.request = None
        assert signals.agree(comm, lines.append) is None and len(lines) == 1
    finally:
        pool.close()


def test_snapshot_prefix_and_the_snapshot_at_the_end():
    sp = caffe_pb2.SolverParameter(snapshot=5, snapshot_prefix="from/solver")
    config = RunConfig(progress=False)
    assert Snapshots(sp, RunConfig(snapshot_prefix="cli/p"), "a/s.prototxt").prefix == "cli/p"
    assert Snapshots(sp, config, "a/s.prototxt").prefix == "from/solver"
    sp.ClearField("snapshot_prefix")
    assert Snapshots(sp, config, "a/s.prototxt").prefix == "a/s"
    snapshots = Snapshots(sp, config, None)
    assert snapshots.prefix == "cgp"
    # snapshot_after_train (on by default): not where `snapshot` wrote one anyway.
    assert not snapshots.due_after_train(10) and snapshots.due_after_train(12)
    snapshots.last_iter = 12   # written at that iteration already (a signal's)
    assert not snapshots.due_after_train(12)
    assert snapshots.due(Count(10)) and not snapshots.due(Count(12, 10))
    assert snapshots.due(Count(12, 9))   # passed 10 (cgp.comm.sharing)
    sp.snapshot_after_train = False
    assert not Snapshots(sp, config, None).due_after_train(12)


def test_smoothed_is_the_mean_of_the_latest_average_loss():
    window = []
    assert [smoothed(window, x, 3) for x in (1.0, 2.0, 6.0, 10.0)] == [1.0, 1.5, 3.0, 6.0]
    assert window == [2.0, 6.0, 10.0]
    assert smoothed(window, 4.0, 0) == 4.0 and window == [4.0]   # 0: the latest alone


def test_a_request_heard_in_a_step_is_acted_on_after_it(mnist_dir, tmp_path):
    """A signal's request ends the steps() call at the iteration where it is agreed; the
    loop acts on it at once (a snapshot), then trains on to max_iter and its own snapshot."""
    sp = solver(snapshot=0, snapshot_prefix=str(tmp_path / "s"))
    t = trainer(sp, mnist_dir, max_iter=4)
    try:
        t.signals.request = "snapshot"   # what SIGHUP's handler sets; agreed after iteration 0
        t.solve()
        assert t.iter == 4 and not t.stopped and t.signals.request is None
        assert sorted(p.name for p in tmp_path.glob("s_iter_*.caffemodel")) == \
            ["s_iter_1.caffemodel", "s_iter_4.caffemodel"]
    finally:
        t.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_test_pass_reads_each_next_batch_during_the_run_before(mnist_dir, threads):
    """Each test batch after the first is read and staged (Engine.stage) during the run of
    the batch before: the outputs are those of the batches read and run one by one."""
    sp = solver(test_iter=[5], test_interval=2)
    t = trainer(sp, mnist_dir, threads=threads, workers="processes")
    try:
        t.steps(2)
        engine, staged = t.test_engines[0], []
        stage = engine.stage
        engine.stage = lambda batch: (staged.append(batch), stage(batch))
        outputs, loss = t.test()
        assert len(staged) == 4   # batches 1 to 4, each during the run before
        del engine.stage
        # The same pass batch by batch: the passes before at iteration 2 are the one at 0.
        first, n = t.tests.before(t.iter, 0) * 5, t.test_nets[0].batch_size
        runs = [engine.run(t._batch(engine, (first + k) * n, first + k), first + k, t.seed)
                for k in range(5)]
        assert loss == sum(r[1] for r in runs) / 5
        assert outputs == {name: sum(r[0][name] for r in runs) / 5 for name in outputs}
    finally:
        t.close()


def test_a_bad_test_record_is_raised_at_its_own_batch(mnist_dir):
    """A data error in a batch read ahead is raised where that batch's turn comes, after
    the batches before it ran, as without the read-ahead."""
    sp = solver(test_iter=[4], test_interval=2)
    t = trainer(sp, mnist_dir, threads=2, workers="processes")
    try:
        layer, ran = t.test_nets[0].sources[0].layer, []
        load, run = layer.load, t.test_engines[0].run

        def load_failing_at_batch_2(start, *args, **kwargs):
            if start == 20:
                raise DataError("record 20: bad")
            return load(start, *args, **kwargs)
        layer.load = load_failing_at_batch_2

        def run_noted(batch, iteration, *args, **kwargs):
            ran.append(iteration)
            return run(batch, iteration, *args, **kwargs)
        t.test_engines[0].run = run_noted
        with pytest.raises(DataError, match="record 20: bad"):
            t.test()
        assert ran == [0, 1]
    finally:
        t.close()


def test_the_progress_bar_on_a_terminal_prints_the_log_past_itself(mnist_dir, tmp_path):
    """stderr a terminal: the bar draws there, and every log line reaches stdout whole and
    the same as without a terminal (the speeds aside)."""
    (tmp_path / "tiny.prototxt").write_text(TINY)
    (tmp_path / "solver.prototxt").write_text(
        'net: "tiny.prototxt" base_lr: 0.01 lr_policy: "fixed" display: 2 max_iter: 6 '
        'test_iter: 2 test_interval: 3 snapshot: 4 snapshot_prefix: "s/t" random_seed: 3\n')
    args = [sys.executable, "-m", "cgp", "train", "--solver", "solver.prototxt",
            "--data-dir", str(mnist_dir), "--workers", "threads", "--no-log"]

    def lines(text):
        text = re.sub(r"\(\S+ iter/s, \d+ img/s\)", "(speed)", text)
        return [re.sub(r" in [\d.]+ s", " in T s", line) for line in text.splitlines()
                if not line.startswith("cgp: memory:")]

    plain = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    main, terminal = os.openpty()
    # A terminal of 24 x 100 (a new one has no size, and tqdm draws no bar 0 columns wide).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        with open(os.devnull) as stdin:
            run = subprocess.run(args, cwd=tmp_path, stdin=stdin, stdout=subprocess.PIPE,
                                 stderr=terminal, text=True, timeout=300)
        drawn = b""   # read with the terminal still open here: once closed, it is gone
        while select.select([main], [], [], 0.5)[0]:
            drawn += os.read(main, 1 << 16)
    finally:
        os.close(terminal)
        os.close(main)
    assert run.returncode == 0, drawn.decode(errors="replace")
    assert lines(run.stdout) == lines(plain.stdout)
    assert "Iteration 6, Testing net (#0)" in run.stdout
    assert b"/6 [" in drawn   # tqdm's "k/6 [elapsed<remaining, ...]"
    assert Path(tmp_path / "s" / "t_iter_6.caffemodel").is_file()


def test_the_trainer_stays_a_small_loop():
    """cgp/train.py sequences the loop's units and holds none of them: under 300 lines, no
    class defined inside a function and no nonlocal state (issue 48's shape)."""
    import ast
    source = (Path(__file__).resolve().parents[1] / "cgp" / "train.py").read_text()
    assert len(source.splitlines()) < 300
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert not [c.name for f in functions for c in ast.walk(f) if isinstance(c, ast.ClassDef)]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Nonlocal)]
