"""Worker processes (--workers processes): the same bits as threads, every call run once,
a worker's error or death reported in the main process, and nothing left running."""
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from cgp import procs
from cgp.equivalence import compare, train_run
from cgp.errors import CgpError, NetError
from cgp.layers import aligned_zeros
from cgp.procs import Processes
from cgp.train import RunConfig, Trainer
from test_engine import solver

pytestmark = pytest.mark.skipif(not procs.available(), reason="worker processes need fork()")


@pytest.mark.parametrize("model,chunks", [("mnist", 7), ("cifar10", 16)])
def test_processes_give_the_bits_of_threads(model, chunks, mnist_dir, cifar_dir):
    data = mnist_dir if model == "mnist" else cifar_dir
    sp = solver(model, test_iter=[1])
    runs = [("threads", 1), ("processes", 2), ("processes", 3), ("processes", 7)]
    outcomes = [train_run(sp, None, RunConfig(threads=t, chunks=chunks, data_dir=str(data),
                                              workers=w), 3) for w, t in runs]
    rows, ok = compare(outcomes)
    assert ok, rows
    assert outcomes[0].accuracy and outcomes[0].losses[0] != outcomes[0].losses[-1]


def test_resume_from_snapshot_in_processes_is_bitwise_identical(tmp_path, mnist_dir):
    sp = solver("mnist", snapshot=3, test_interval=2, test_iter=[1], display=0,
                snapshot_prefix=str(tmp_path / "p"))
    threads = Trainer(sp, None, RunConfig(data_dir=str(mnist_dir), max_iter=6),
                      log=lambda line: None)
    threads.solve()
    threads.close()
    config = RunConfig(threads=3, workers="processes", data_dir=str(mnist_dir), max_iter=6)
    resumed = Trainer(sp, None, config, log=lambda line: None)
    try:
        resumed.net.params[:] = 0  # must come back from the snapshot
        resumed.restore(tmp_path / "p_iter_3.solverstate")
        resumed.solve()
    finally:
        resumed.close()
    assert np.array_equal(threads.net.params, resumed.net.params)
    assert threads.last_test == resumed.last_test


class Recorder:
    """The part of an Engine that Processes drives: calls (groups), the shared batch
    (inputs) and work(). Call g records (g, worker, pid) in shared memory and adds the
    batch's first value, so a worker that read a stale batch shows; call `fail` raises."""

    def __init__(self, calls):
        self.groups = [None] * calls
        self.inputs = {0: aligned_zeros(1, np.float64, shared=True)}
        self.seen = aligned_zeros((calls, 4), np.float64, shared=True)
        self.fail = aligned_zeros(1, np.int64, shared=True)   # forked workers see it change
        self.fail[0] = -1

    def work(self, worker, g, iteration, seed, batch):
        if g == self.fail[0]:
            raise NetError(f"call {g} failed in worker {worker}")
        self.seen[g] = g, worker, os.getpid(), batch[0][0] + iteration + seed


def test_every_call_runs_once_and_errors_reach_the_caller():
    engine = Recorder(40)
    workers = Processes(3, [engine])
    try:
        assert all(p.is_alive() for p in workers.procs) and len(workers.procs) == 2
        for iteration in range(3):
            engine.seen[:] = -1
            engine.inputs[0][0] = 100 * iteration
            workers.run(engine, iteration, seed=7)
            assert list(engine.seen[:, 0]) == list(range(40))
            assert set(engine.seen[:, 1]) <= {0, 1, 2}
            main = engine.seen[:, 1] == 0
            assert (engine.seen[main, 2] == os.getpid()).all()
            assert (engine.seen[~main, 2] != os.getpid()).all()
            assert (engine.seen[:, 3] == 101 * iteration + 7).all()
        # An error in any worker reaches the caller, with its type and message, once the
        # running calls have ended (that no call starts after it: the test below).
        engine.fail[0] = 5
        engine.seen[:] = -1
        with pytest.raises(NetError, match="call 5 failed"):
            workers.run(engine, 0, 0)
        assert engine.seen[5, 0] == -1
        engine.fail[0] = -1
        workers.run(engine, 0, 0)   # the workers still serve
        assert list(engine.seen[:, 0]) == list(range(40))
        # A worker that dies ends the run with a message that says so, and every later run.
        os.kill(workers.procs[0].pid, signal.SIGKILL)
        workers.procs[0].join()
        for _ in range(2):
            with pytest.raises(CgpError,
                               match="worker process 1 ended unexpectedly .killed by signal 9"):
                workers.run(engine, 0, 0)
    finally:
        pids = [p.pid for p in workers.procs]
        workers.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)   # ended and reaped


def test_an_error_stops_the_handing_out_of_calls():
    engine = Recorder(40)
    engine.fail[0] = 5
    counter = aligned_zeros(2, np.int64, shared=True)
    counter[:] = 0, 40
    engine.seen[:] = -1
    with pytest.raises(NetError, match="call 5 failed"):
        procs._take_calls(engine, 0, 0, 0, counter, multiprocessing.Lock())
    assert list(counter) == [40, 40]   # what any other worker asks for next: nothing
    assert list(engine.seen[:5, 0]) == [0, 1, 2, 3, 4] and (engine.seen[5:, 0] == -1).all()


def test_workers_are_pinned_with_affinity():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity on this OS")
    engine = Recorder(8)
    allowed = sorted(os.sched_getaffinity(0))
    workers = Processes(3, [engine], affinity=True)
    try:
        cpus = [psutil.Process(p.pid).cpu_affinity() for p in workers.procs]
        assert cpus == [[allowed[1 % len(allowed)]], [allowed[2 % len(allowed)]]]
    finally:
        workers.close()


def test_commands_take_workers(mnist_dir, tmp_path):
    def cgp(*args):
        out = subprocess.run([sys.executable, "-m", "cgp", *args, "--data-dir", str(mnist_dir)],
                             capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout
    text = cgp("equivalence", "mnist", "--threads", "1,3", "--iters", "2",
               "--workers", "threads,processes")
    assert "bitwise identical across thread counts, in threads and in processes: yes" in text
    assert text.count(" processes  ") == 2
    text = cgp("train", "mnist", "--threads", "2", "--workers", "processes", "--iters", "2")
    assert "on 2 process(es)" in text and "trained to iteration 2" in text
    model = str(solver("mnist").net)
    weights = str(tmp_path / "snapshots" / "lenet_iter_2.caffemodel")
    scores = [cgp("test", "--model", model, "--weights", weights, "--iterations", "2",
                  "--threads", "2", "--workers", w).splitlines()[-3:] for w in
              ("threads", "processes")]
    assert scores[0] == scores[1] and "accuracy" in " ".join(scores[0])
    # The speedup benchmark times both kinds in one run, each against its own 1 thread.
    text = cgp("bench", "speedup", "mnist", "--threads", "2", "--iters", "1", "--repeats", "2",
               "--warmup", "1", "--workers", "threads,processes", "--out", str(tmp_path / "res"))
    [report] = (tmp_path / "res").glob("speedup_mnist_*.json")
    report = json.loads(report.read_text())
    assert report["workers"] == ["threads", "processes"]
    assert sorted((r["layout"] or "", r["threads"]) for r in report["results"]) == \
        [("", 1), ("", 2), ("processes", 1), ("processes", 2)]
    assert re.search(r"threads +workers +cgp img/s", text)
    assert re.search(r"\n +2  processes +\d", text) and "2 threads as processes" in text


@pytest.mark.parametrize("model", ["mnist", "cifar10"])
def test_memory_check_counts_what_workers_hold(model, mnist_dir, cifar_dir):
    from cgp.train import WORKER_PROCESS_BYTES
    data = mnist_dir if model == "mnist" else cifar_dir
    trainer = Trainer(solver(model, test_iter=[1]), None,
                      RunConfig(threads=3, workers="processes", data_dir=str(data)),
                      log=lambda line: None)
    try:
        assert "activations of 3 process(es)" in trainer.memory_line
        assert "+ 2 forked worker(s) (64 MiB)" in trainer.memory_line
        for _ in range(2):
            trainer.step()
        trainer.test(0)
        # Each worker's own pages (unique set size): what the check allows it, plus its
        # share of the activations, which the check counts apart.
        activations = trainer.engine.workspaces[1]
        own = sum(a.nbytes for a in activations.data + activations.diff if a is not None)
        for proc in trainer.procs.procs:
            assert psutil.Process(proc.pid).memory_full_info().uss < WORKER_PROCESS_BYTES + own
    finally:
        trainer.close()
