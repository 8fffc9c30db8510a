"""Worker processes (--workers processes): the same bits as threads, every call run once,
a worker's error or death reported in the main process, and nothing left running."""
import json
import mmap
import os
import re
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from cgp.runtime import procs
from cgp.commands.equivalence import compare, train_run
from cgp.errors import CgpError, NetError
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.procs import ProcessPool
from cgp.train import RunConfig, Trainer
from conftest import quick_solver
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


def test_updates_in_processes_keep_every_history_and_pass(mnist_dir):
    """The update runs in whichever process takes each slice: Adam's two histories and the
    sum of iter_size passes must be shared, or the bits differ from threads."""
    sp = solver("mnist", type="Adam", base_lr=0.001, momentum=0.9, momentum2=0.999,
                lr_policy="fixed", iter_size=2, test_iter=[1])   # compare() reads no test
    outcomes = [train_run(sp, None, RunConfig(threads=t, chunks=5, data_dir=str(mnist_dir),
                                              workers=w), 3)
                for w, t in [("threads", 1), ("processes", 2), ("processes", 3)]]
    rows, ok = compare(outcomes)
    assert ok, rows


def shared(a):
    """Whether array a lies in an anonymous shared mapping (aligned_zeros(shared=True))."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return isinstance(a.base, mmap.mmap)


def test_one_worker_forks_nothing(mnist_dir):
    """A single worker runs as plain sequential code in private memory, whatever --workers."""
    trainer = Trainer(solver("mnist"), None, RunConfig(threads=1, workers="processes",
                                                       data_dir=str(mnist_dir)),
                      log=lambda line: None)
    try:
        assert not trainer.pool.shared_memory and not psutil.Process().children()
        # The batch's two sets of inputs (Engine.stage) are private too.
        assert not any(shared(a) for inputs in trainer.engine.inputs for a in inputs.values())
    finally:
        trainer.close()


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


def _record(seen, fail):
    """A program for a pool: task i records (i, worker, pid, the sum of its arguments) in the
    shared array seen, and raises where i is in the shared array fail."""
    def task(w, i, *args):
        if i in fail:
            raise NetError(f"task {i} failed in worker {w}")
        seen[i] = i, w, os.getpid(), sum(args)
    return task


def test_every_task_runs_once_and_errors_reach_the_caller():
    seen = aligned_zeros((40, 4), np.float64, shared=True)
    fail = aligned_zeros(2, np.int64, shared=True)   # forked workers see it change
    fail[:] = -1
    pool = ProcessPool(3)
    record = pool.program(_record(seen, fail))
    pool.start()
    try:
        assert all(p.is_alive() for p in pool.procs) and len(pool.procs) == 2
        for iteration in range(3):
            seen[:] = -1
            pool.run(record, 40, iteration, 7.5)
            assert list(seen[:, 0]) == list(range(40))
            assert set(seen[:, 1]) <= {0, 1, 2}
            main = seen[:, 1] == 0
            assert (seen[main, 2] == os.getpid()).all()
            assert (seen[~main, 2] != os.getpid()).all()
            assert (seen[:, 3] == iteration + 7.5).all()
            pool.run(record, 0)   # nothing to run: returns at once
        # A failed task's error reaches the caller, with its type and message, once the
        # running tasks have ended (task 9 may be skipped after 5 failed, or 5 after 9); every
        # failure is read with it.
        fail[:] = 9, 5
        seen[:] = -1
        with pytest.raises(NetError, match="task [59] failed"):
            pool.run(record, 40)
        assert seen[5, 0] == -1 and seen[9, 0] == -1
        fail[:] = -1
        pool.run(record, 40)   # the workers still serve, and no failure is left over
        assert list(seen[:, 0]) == list(range(40))
        # A worker that dies ends the run with a message that says so, and every later run.
        os.kill(pool.procs[0].pid, signal.SIGKILL)
        pool.procs[0].join()
        for _ in range(2):
            with pytest.raises(CgpError,
                               match="worker process 1 ended unexpectedly .killed by signal 9"):
                pool.run(record, 40)
    finally:
        pids = [p.pid for p in pool.procs]
        pool.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)   # ended and reaped


def test_an_error_stops_the_handing_out_of_tasks():
    started = aligned_zeros(1, np.int64, shared=True)

    def task(w, i):
        started[0] += 1 if w == 0 else 0   # the caller's count: workers' writes may race
        if i == 3:
            raise ValueError("task 3")
    for threads in (1, 3):
        pool = ProcessPool(threads)
        failing = pool.program(task)
        pool.start()
        try:
            started[0] = 0
            with pytest.raises(ValueError, match="task 3"):
                pool.run(failing, 2000)
            assert started[0] < 2000
            if threads == 1:
                assert started[0] == 4   # tasks 0 to 3, in order, and nothing after
        finally:
            pool.close()


def test_a_worker_late_to_leave_a_run_takes_no_task_of_the_next():
    """A run's tickets carry its number (runtime.spin.take_ticket): once the next run is
    posted, the old one's count can neither hand out a task nor take one of the new run."""
    from cgp.runtime import spin
    flags = np.zeros(1, np.int64)
    flags[0] = 4 << 32
    assert [spin.take_ticket(flags, 0, 4, 2) for _ in range(3)] == [0, 1, -1]
    flags[0] = 5 << 32   # run 5 posted
    assert spin.take_ticket(flags, 0, 4, 100) == -1 and flags[0] == 5 << 32
    assert spin.take_ticket(flags, 0, 5, 100) == 0


def test_a_post_writes_the_run_and_wakes_the_sleepers_only():
    """runtime.spin.post, all of a run's posting in one call: the ticket at the run's first
    task, the run's fields, its argument bytes, the run number; the sleep marks of the
    sleeping workers cleared and those workers named, the others left alone."""
    from cgp.runtime import spin
    flags = np.full(40, 9, np.int64)
    flags[20:40:8] = 0, 1, 0    # of three workers, the second sleeps
    args = np.zeros(8, np.uint8)
    woken = np.full(3, -1, np.int64)
    assert spin.post(flags, 0, 6, 8, (16, 17), (0, -2), args, b"\x01\x02\xff", 20, 8,
                     woken) == 1
    assert flags[0] == 6 and flags[8] == 6 << 32 and list(flags[16:18]) == [0, -2]
    assert list(args) == [1, 2, 255, 0, 0, 0, 0, 0] and woken[0] == 1
    assert list(flags[20:40:8]) == [0, 0, 0]
    assert (np.delete(flags, [0, 8, 16, 17, 20, 28, 36]) == 9).all()   # nothing else written


def _meet(arrived, threads):
    """A program whose task i waits (up to 10 s) until `threads` tasks have started: it
    ends only if every worker takes one of them, and records who did."""
    import time

    def task(w, i):
        arrived[1 + i] = os.getpid()
        from cgp.runtime import spin
        spin.fetch_add(arrived, 0, 1)
        deadline = time.monotonic() + 10
        while spin.load(arrived, 0) < threads and time.monotonic() < deadline:
            pass
    return task


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_wake_for_every_run_after_rest_and_sleep(workers):
    """Workers that spin, that were sent to sleep (rest) and that fell asleep on their own
    all take part in the next run; a resting worker uses no CPU. (With more workers than
    CPUs they never spin: 3 on a 2-CPU machine.)"""
    import time
    arrived = aligned_zeros(1 + workers, np.int64, shared=True)
    pool = ProcessPool(workers)
    meet = pool.program(_meet(arrived, workers))
    pool.start()
    try:
        for how in ("spinning", "rested", "rested", "asleep", "spinning"):
            if how == "rested":
                pool.rest()
            elif how == "asleep":
                # Past SPIN_SECONDS a worker sleeps on its own.
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:
                    pass
            arrived[:] = 0
            pool.run(meet, workers)
            assert arrived[0] == workers and len(set(arrived[1:])) == workers, how
        pool.rest()
        before = [psutil.Process(p.pid).cpu_times() for p in pool.procs]
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            pass
        after = [psutil.Process(p.pid).cpu_times() for p in pool.procs]
        assert all(a.user + a.system - b.user - b.system < 0.05 for a, b in zip(after, before))
    finally:
        pool.close()


def test_the_lowest_failed_tasks_error_comes_back_however_long():
    """Every worker fails a task, the workers' reports longer than a pipe holds: the caller
    raises the lowest task's error, whoever ran it."""
    arrived = aligned_zeros(4, np.int64, shared=True)
    meet = _meet(arrived, 3)

    def task(w, i):
        meet(w, i)   # every worker takes a task
        raise NetError(f"task {i} " + ("x" * 300_000 if w else "in the caller"))
    pool = ProcessPool(3)
    failing = pool.program(task)
    pool.start()
    try:
        for _ in range(3):
            arrived[:] = 0
            with pytest.raises(NetError, match="task 0 ") as raised:
                pool.run(failing, 3)
            assert len(str(raised.value)) > 300_000 or "in the caller" in str(raised.value)
    finally:
        pool.close()


def test_the_callers_first_work_overlaps_the_workers_tasks():
    """As with threads (test_engine): the caller's `first` runs while the worker processes take
    tasks; its exception comes after every task, and no worker's failure is left for the next
    run."""
    import time
    from cgp.runtime import spin
    done = aligned_zeros(41, np.int64, shared=True)

    def task(w, i, fail):
        done[1 + i] = os.getpid()
        spin.fetch_add(done, 0, 1)
        if fail and i == 7:
            raise NetError("task 7")
    pool = ProcessPool(2)
    program = pool.program(task)
    pool.start()
    try:
        def first():
            deadline = time.monotonic() + 10
            while (not ((done[1:] != 0) & (done[1:] != os.getpid())).any()
                   and time.monotonic() < deadline):
                pass
            # A worker process's task, meanwhile.
            assert ((done[1:] != 0) & (done[1:] != os.getpid())).any()

        def failing():
            first()
            raise ValueError("first's own")
        for fail in (False, True):
            done[:] = 0
            pool.run(program, 40, False, first=first)
            assert done[0] == 40 and (done[1:] != os.getpid()).any()
            done[:] = 0
            with pytest.raises(ValueError, match="first's own"):
                pool.run(program, 40, fail, first=failing)
            assert done[0] == 40 or fail
        done[:] = 0
        pool.run(program, 40, False)   # nothing left over from the failed runs
        assert done[0] == 40
    finally:
        pool.close()


def test_workers_end_when_the_main_process_is_killed():
    code = ("import os, sys, numpy as np\n"
            "from cgp.runtime.procs import ProcessPool\n"
            "pool = ProcessPool(2)\n"
            "pool.program(lambda w, i: None)\n"
            "pool.start()\n"
            "print(pool.procs[0].pid, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    worker = psutil.Process(int(out.stdout))
    try:
        worker.wait(timeout=10)   # it checks every second whether its parent is there
    except psutil.TimeoutExpired:
        worker.kill()
        raise AssertionError("the orphaned worker kept running")


def test_programs_come_before_start_and_arguments_fit():
    pool = ProcessPool(2)
    task = pool.program(lambda w, i, *args: None)
    with pytest.raises(RuntimeError, match="before start"):
        pool.run(task, 1)
    pool.start()
    try:
        with pytest.raises(RuntimeError, match="after start"):
            pool.program(lambda w, i: None)
        with pytest.raises(RuntimeError, match="room for"):
            pool.run(task, 1, "x" * 5000)
        pool.run(task, 4, "x" * 100)
    finally:
        pool.close()


def test_workers_are_pinned_with_affinity():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity on this OS")
    allowed = sorted(os.sched_getaffinity(0))
    pool = ProcessPool(3, affinity=True)
    pool.start()
    try:
        cpus = [psutil.Process(p.pid).cpu_affinity() for p in pool.procs]
        assert cpus == [[allowed[1 % len(allowed)]], [allowed[2 % len(allowed)]]]
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        pool.close()
    assert sorted(os.sched_getaffinity(0)) == allowed


def test_without_process_semaphores_threads_are_the_default(mnist_dir, tmp_path):
    """Where /dev/shm cannot be written (some containers), the OS refuses the semaphores that
    worker processes sleep on: asked for, they say so; by default the workers are threads.
    Run in a mount namespace whose /dev/shm is read-only (needs unshare and mount rights)."""
    import shutil
    script = 'mount -t tmpfs -o ro,size=4k tmpfs /dev/shm && exec "$@"'
    jail = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    if not shutil.which("unshare") or subprocess.run(jail + ["true"],
                                                     capture_output=True).returncode:
        pytest.skip("needs unshare and the right to mount in a new mount namespace")

    def train(*args):
        return subprocess.run(jail + [sys.executable, "-m", "cgp", "train", "mnist", "--threads",
                                      "2", "--iters", "1", "--data-dir", str(mnist_dir), *args],
                              capture_output=True, text=True, cwd=tmp_path)
    out = train("--workers", "processes")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "refused a semaphore" in out.stderr and "writable /dev/shm" in out.stderr
    out = train()
    assert out.returncode == 0 and "on 2 thread(s)" in out.stdout, out.stderr


def test_commands_take_workers(mnist_dir, tmp_path):
    def cgp(*args):
        out = subprocess.run([sys.executable, "-m", "cgp", *args, "--data-dir", str(mnist_dir)],
                             capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout
    lenet = str(quick_solver(tmp_path))   # `mnist`, testing on one batch
    text = cgp("equivalence", "--solver", lenet, "--threads", "1,3", "--iters", "2",
               "--workers", "threads,processes")
    assert "bitwise identical across thread counts, in threads and in processes: yes" in text
    assert text.count(" processes  ") == 2
    text = cgp("train", "--solver", lenet, "--threads", "2", "--workers", "processes", "--iters",
               "2")
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
        for proc in trainer.pool.procs:
            assert psutil.Process(proc.pid).memory_full_info().uss < WORKER_PROCESS_BYTES + own
    finally:
        trainer.close()


def test_a_rank_spins_only_within_its_share_of_the_cores(monkeypatch):
    """Under an MPI launcher that binds nothing, a rank's cores are the node's over the ranks
    placed on it: with as many ranks as cores, one each, and two workers no longer spin
    (they would take a core from the other rank); without a launcher, every core, and two
    workers spin. A process bound to fewer cores than the node keeps its binding."""
    import cgp.runtime.pool as pool
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    if cores < 2 or cores < (os.cpu_count() or 0):
        pytest.skip("needs every core of a machine of 2 or more")
    for variable in pool.LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert pool.cores_of_this_process() == cores and pool.spin_count(2) > 0
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(cores))
    assert pool.ranks_on_this_node() == cores
    assert pool.cores_of_this_process() == 1 and pool.spin_count(2) == 0
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert pool.cores_of_this_process() == cores // 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})   # bound to one core
    assert pool.cores_of_this_process() == 1
