"""Training logs (`cgp train --log`, and by default beside the snapshots), their CSV, the
compile notice, and `cgp plot`."""
import csv
import re
import subprocess
import sys
from datetime import datetime

import pytest

from cgp import models

# Caffe's tools/extra/parse_log.py reads a log with these patterns (its regex_iteration,
# regex_train_output, regex_test_output, regex_learning_rate), after a line holding
# 'Solving', and takes every later line's time from glog's prefix (extract_seconds.py:
# month and day in the first field, H:M:S.micro in the second).
ITERATION = re.compile(r"Iteration (\d+)")
TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")


def parse_caffe_log(path):
    """What parse_log.py and parse_log.sh take from a log: {iteration: {"lr", output...}}
    for train and for test rows, and the losses parse_log.sh reads as the 9th field of
    ', loss = ' lines."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "Solving" in line)
    iteration, train, test, losses = -1, {}, {}, {}
    for line in lines[start:]:
        fields = line.split()
        datetime.strptime(f"{fields[0][1:]} {fields[1]}", "%m%d %H:%M:%S.%f")   # glog's time
        if (m := ITERATION.search(line)):
            iteration = int(m[1])
        if iteration == -1:
            continue
        if (m := LEARNING_RATE.search(line)):
            train.setdefault(iteration, {})["lr"] = float(m[1])
            assert float(fields[8]) == float(m[1])       # parse_log.sh: awk '{print $9}'
        if (m := TRAIN_OUTPUT.search(line)):
            train.setdefault(iteration, {})[m[2]] = float(m[3])
        if (m := TEST_OUTPUT.search(line)):
            test.setdefault(iteration, {})[m[2]] = float(m[3])
            assert float(fields[10]) == float(m[3])      # parse_log.sh: awk '{print $11}'
        if ", loss = " in line:
            losses[iteration] = float(fields[8])         # parse_log.sh: awk '{print $9}'
    return train, test, losses


def solver_file(folder, mnist_dir):
    path = folder / "solver.prototxt"
    path.write_text(f'net: "{models.FOLDER / "lenet_train_test.prototxt"}"\n'
                    'test_iter: 1 test_interval: 3 base_lr: 0.01 momentum: 0.9 lr_policy: "inv" '
                    'gamma: 0.1 power: 0.75 display: 1 max_iter: 6 snapshot: 0 random_seed: 1\n'
                    f'snapshot_prefix: "{folder / "snaps/lenet"}"\n')
    return path


def train(folder, mnist_dir, *args):
    out = subprocess.run([sys.executable, "-m", "cgp", "train", "--solver",
                          str(solver_file(folder, mnist_dir)), "--data-dir", str(mnist_dir),
                          "--workers", "threads", *args], capture_output=True, text=True,
                         cwd=folder)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mnist_dir):
    """Two short trainings: 1 thread with the default log, 2 threads with --log."""
    folder = tmp_path_factory.mktemp("runs")
    one = train(folder, mnist_dir, "--threads", "1")
    two = train(folder, mnist_dir, "--threads", "2", "--log", str(folder / "two.log"))
    default = sorted((folder / "snaps").glob("lenet_*.log"))
    assert len(default) == 1 and re.fullmatch(r"lenet_\d{8}-\d{6}\.log", default[0].name)
    return folder, (default[0], one), (folder / "two.log", two)


def test_log_reads_as_caffe_logs_do(runs):
    """parse_log's patterns recover every iteration's loss and lr and every test output;
    the CSV beside the log holds the same values; the console said the same."""
    _, (log, stdout), _ = runs
    train_rows, test_rows, losses = parse_caffe_log(log)
    assert sorted(losses) == list(range(7))      # every iteration, and the final one
    assert sorted(test_rows) == [0, 3, 6] and all(
        set(row) == {"accuracy", "loss"} for row in test_rows.values())
    for it in range(6):
        assert set(train_rows[it]) == {"lr", "loss"}
        assert f"Iteration {it} (" in stdout and f"loss = {losses[it]:.6g}" in stdout
    assert train_rows[0]["lr"] == 0.01 and train_rows[5]["lr"] < train_rows[1]["lr"]
    with open(log.with_suffix(".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    values = {(int(r["iteration"]), r["phase"], r["name"]): float(r["value"]) for r in rows}
    for it in range(6):
        assert values[(it, "train", "smoothed_loss")] == losses[it]
        assert values[(it, "train", "lr")] == train_rows[it]["lr"]
        assert values[(it, "train", "loss")] == train_rows[it]["loss"]
        assert values[(it, "train", "images_per_s")] > 0
    assert values[(6, "train", "smoothed_loss")] == losses[6]
    for it, row in test_rows.items():
        for name, value in row.items():
            assert values[(it, "test0", name)] == value
    seconds = [float(r["seconds"]) for r in rows]
    assert seconds == sorted(seconds)


def test_log_option_and_no_log(runs, tmp_path, mnist_dir):
    folder, _, (log, stdout) = runs
    assert log.is_file() and log.with_suffix(".csv").is_file()
    assert f"training log written to {log}" in stdout
    train(tmp_path, mnist_dir, "--no-log", "--iters", "1")
    assert not list(tmp_path.rglob("*.log")) and not list(tmp_path.rglob("*.csv"))


def test_plot_two_runs(runs, tmp_path):
    pytest.importorskip("matplotlib")
    folder, (one, _), (two, _) = runs
    png = tmp_path / "curves.png"
    out = subprocess.run([sys.executable, "-m", "cgp", "plot", str(one), str(two), "--out",
                          str(png), "--labels", "1 thread,2 threads"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000


def test_plot_without_matplotlib_says_so(runs, tmp_path):
    _, (one, _), _ = runs
    code = ("import sys; sys.modules['matplotlib'] = None; from cgp.cli import main; "
            f"sys.exit(main(['plot', {str(one)!r}, '--out', {str(tmp_path / 'x.png')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and "pip install 'cgp[plot]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_compile_notice_counts_kernels():
    """Each kernel compiled in the block is counted as it comes, the notice said once, the
    count and the kernel compiling now every `every`, and the total with its time at the
    end."""
    from numba import njit

    from cgp.commands.timing import COMPILING, compile_notice

    kernels = [njit(lambda x, k=k: x + k) for k in range(3)]   # fresh, uncached
    for kernel in kernels:
        kernel.py_func.__module__ = "cgptest.kernels"
    lines = []
    with compile_notice(lines.append, prefix="cgptest.", every=2) as notice:
        for kernel in kernels:
            kernel(1)
        kernels[0](2)    # compiled already: no event
    assert notice.count == 3 and notice.seconds > 0
    assert lines[0] == COMPILING
    assert re.fullmatch(r"compiling kernels: 2 so far, \d+ s; now kernels\..*<lambda>", lines[1])
    assert re.fullmatch(r"compiled 3 kernels in \d+\.\d s \(cached for later runs\)", lines[2])
