"""The measuring tools: `cgp bench speedup`, `cgp time`, the first-run compile note, and the
PyTorch copy of a net (which must compute what cgp computes, or its timings mean nothing)."""
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from numba import njit
from threadpoolctl import threadpool_limits

from cgp import cli
from cgp.tools.speedup import Config, default_threads, training_flops
from cgp.tools.stats import summarise, table
from cgp.models import FOLDER, solver_path
from cgp.net import Net, RunOptions
from cgp.prototxt import parse_net, read_net, read_solver
from cgp.proto import caffe_pb2
from cgp.commands.timing import COMPILING, compile_notice
from cgp.train import RunConfig, Trainer

LENET = FOLDER / "lenet_train_test.prototxt"
LENET_LAYERS = ("mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss")

DEPLOY = """
name: "tiny_deploy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 6 dim: 2 dim: 12 dim: 12 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""

# Every layer kind of the PyTorch copy, with the awkward settings: padding, stride, groups,
# Caffe's ceil rounding with a clipped last window, both LRN regions, a shared label blob.
ALL_KINDS = """
name: "all_kinds"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 5 dim: 4 dim: 11 dim: 11 } shape { dim: 5 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 stride: 2 group: 2
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "lrn1" type: "LRN" bottom: "conv1" top: "lrn1"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 } }
layer { name: "pool1" type: "Pooling" bottom: "lrn1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "tanh" type: "TanH" bottom: "pool1" top: "pool1" }
layer { name: "lrn2" type: "LRN" bottom: "pool1" top: "lrn2"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL } }
layer { name: "pool2" type: "Pooling" bottom: "lrn2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "sig" type: "Sigmoid" bottom: "pool2" top: "sig" }
layer { name: "drop" type: "Dropout" bottom: "sig" top: "sig" dropout_param { dropout_ratio: 0 } }
layer { name: "ip1" type: "InnerProduct" bottom: "sig" top: "ip1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" relu_param { negative_slope: 0.1 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def run_cli(capsys, *args):
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    return out.out


def mnist_trainer(mnist_dir, **config):
    path = str(solver_path("mnist"))
    return Trainer(read_solver(path), path,
                   RunConfig(data_dir=str(mnist_dir), progress=False, **config), log=lambda s: None)


# -- bench speedup -------------------------------------------------------------------
# LeNet's multiply-adds per image: conv1 20x24x24 outputs of 25 (forward and weight gradient;
# no gradient flows into the data), conv2 50x8x8 of 500, ip1 500 of 800 and ip2 10 of 500
# (forward, weight and input gradients); two FLOPs each.
LENET_FLOPS = 2 * (2 * 20 * 24 * 24 * 25 + 3 * (50 * 8 * 8 * 500 + 500 * 800 + 10 * 500))


def test_training_flops_count_each_pass_that_runs(mnist_dir):
    train = Net(read_net(LENET), caffe_pb2.TRAIN, RunOptions(str(mnist_dir)))
    assert training_flops(train) == LENET_FLOPS == 13_182_000
    # A net without a loss only runs forward: conv 4x10x10 outputs of 2x3x3, fc 5 of 4x5x5.
    deploy = Net(parse_net(DEPLOY), caffe_pb2.TEST, RunOptions())
    assert training_flops(deploy) == 2 * (4 * 10 * 10 * 2 * 3 * 3 + 5 * 4 * 5 * 5)


def test_speedup_times_mpi_ranks(tmp_path, mnist_dir):
    """--ranks 2: the training on 2 MPI ranks x 1 worker is timed in the same rounds, ends on
    the weights of one process (checked), and reports its communication: time per step, the
    share hidden behind backward, and the bytes a rank moves."""
    pytest.importorskip("mpi4py")
    out = subprocess.run(
        [sys.executable, "-m", "cgp", "bench", "speedup", "mnist", "--threads", "1",
         "--ranks", "2", "--iters", "2", "--repeats", "2", "--warmup", "1", "--data-dir",
         str(mnist_dir), "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("speedup_mnist_*Z.json")]
    [mpi] = [r for r in report["results"] if r["impl"] == "mpi"]
    assert report["ranks"] == [1, 2] and mpi["ranks"] == 2 and mpi["threads"] == 2
    assert mpi["comm_ms_per_step"] > 0 and 0 <= mpi["comm_hidden_share"] <= 1
    gradient = 4 * 431080
    assert 0.5 * gradient < mpi["bytes_sent_per_step"] < 2.2 * gradient
    assert "2 MPI ranks x 1 workers" in out.stdout and "hidden behind backward" in out.stdout


def test_speedup_writes_json_csv_and_table(tmp_path, mnist_dir):
    """Without --out, the results go to ./cgp-results/ under the working directory, never
    into the package's folders."""
    out = subprocess.run(
        [sys.executable, "-m", "cgp", "bench", "speedup", "mnist", "--threads", "2",
         "--iters", "1", "--repeats", "2", "--warmup", "1", "--data-dir", str(mnist_dir),
         "--ceiling"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "speedup" in out.stdout and "efficiency" in out.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["cgp-results"]
    [report_path] = (tmp_path / "cgp-results").glob("speedup_mnist_*Z.json")
    assert f"wrote {Path('cgp-results') / report_path.name}" in out.stdout
    report = json.loads(report_path.read_text())
    assert report["model"] == "mnist" and report["net"] == "LeNet" and report["batch"] == 64
    assert report["threads"] == [1, 2]   # 1 is added: the baseline
    machine = report["machine"]
    for key in ("cpu", "physical_cores", "logical_cores", "simd", "versions", "blas", "command",
                "foreign_load_cores", "steal_cores"):
        assert key in machine
    assert machine["steal_cores"] >= 0 and machine["foreign_load_cores"] >= 0
    assert {"python", "numpy", "numba", "scipy"} <= set(machine["versions"])
    # This checkout's commit (what README cites result files by), "+changes" when edited.
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert machine["versions"]["cgp_commit"].split("+")[0] == head and head
    assert machine["memory_bytes"] > 2**20 and report["units"]["rates"] == "images/s"
    assert "bench speedup mnist" in machine["command"]
    rows = {r["threads"]: r for r in report["results"] if r["impl"] == "cgp"}
    assert set(rows) == {1, 2}
    # --ceiling: two 1-thread copies at once, timed in the same rounds.
    [ceiling] = [r for r in report["results"] if r["impl"] == "ceiling"]
    assert report["ceiling"] and ceiling["threads"] == 2 and len(ceiling["images_per_s"]) == 2
    assert rows[2]["share_of_ceiling"] == pytest.approx(
        rows[2]["median"] / ceiling["median"], abs=1e-3)
    assert "machine ceiling, 2 copies" in out.stdout
    # The arithmetic rate against NumPy's matmul, from the same run.
    assert report["training_flops_per_image"] == LENET_FLOPS
    matmul = report["numpy_matmul_gflops"]
    assert len(matmul) == 2 and min(matmul) > 0  # one per round
    rate = rows[1]["median"] * LENET_FLOPS / 1e9
    assert report["cgp_1_thread_gflops"] == pytest.approx(rate, abs=0.01)
    assert report["cgp_1_thread_share_of_matmul"] == pytest.approx(
        rate / np.median(matmul), rel=1e-2)
    assert "13.2 MFLOP per training image" in out.stdout
    assert rows[1]["speedup"] == 1.0 and rows[1]["efficiency"] == 1.0
    for row in rows.values():
        assert len(row["images_per_s"]) == 2 and row["min"] <= row["median"] <= row["max"]
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["threads"], abs=1e-3)
        assert row["paired_speedup"] > 0
    with open(report_path.with_suffix(".csv")) as f:
        table = list(csv.DictReader(f))
    assert [(r["impl"], int(r["threads"])) for r in table] == [
        ("cgp", 1), ("cgp", 2), ("ceiling", 2)]
    assert {"median", "min", "max", "speedup", "efficiency", "share_of_ceiling"} <= set(table[0])
    png = report_path.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert not png.exists() and "PNG plot was skipped" in out.stdout


def test_speedup_interleaves_in_rotated_order(monkeypatch):
    from cgp.tools import speedup
    order = []
    configs = [Config("cgp", t) for t in (1, 2, 4)]
    for c in configs:
        c.run = lambda n, c=c: order.append(c.threads) if n else None
        c.context = lambda: threadpool_limits(limits=None)
        c.save = c.restore = lambda: None
    speedup.interleaved(configs, iters=1, repeats=3, warmup=0, images_per_iter=1,
                      log=lambda s: None)
    assert order == [1, 2, 4, 2, 4, 1, 4, 1, 2]
    rows, best = summarise(configs)
    assert [r["speedup"] for r in rows if r["threads"] == 1] == [1.0] and best == {}


def test_each_timing_starts_after_its_lead_in():
    """Every timing restores the state, runs lead_in untimed iterations and then the timed
    ones, and pauses the configuration's workers after it, untimed too."""
    from cgp.tools import speedup
    events = []
    configs = [Config("cgp", t) for t in (1, 2)]
    for c in configs:
        def run(n, c=c):
            events.append((c.threads, "run", n))
            time.sleep(0.2 if n == 2 else 0.01 * n)   # the lead-in is slow, the rest fast
        c.run = run
        c.context = lambda: threadpool_limits(limits=None)
        c.save = lambda: None
        c.restore = lambda c=c: events.append((c.threads, "restore"))
        c.pause = lambda c=c: time.sleep(0.2) or events.append((c.threads, "pause"))
    speedup.interleaved(configs, iters=1, repeats=2, warmup=0, images_per_iter=1,
                      log=lambda s: None, lead_in=2)
    timing = [[(t, "restore"), (t, "run", 2), (t, "run", 1), (t, "pause")] for t in (1, 2)]
    assert events[4:] == timing[0] + timing[1] + timing[1] + timing[0]
    # One image per iteration in 0.01 s, 100 images/s, less on a busy machine: with the
    # lead-in (0.2 s) or the pause (0.2 s) in the timing it would be below 5.
    assert all(10 < rate < 101 for c in configs for rate in c.rates)


def test_short_timings_run_more_iterations():
    """--min-seconds: where a configuration's last warm-up iteration says --iters would take
    it less, every configuration runs as many iterations as that length needs in every
    timing (the same iterations for all: they end on the same weights), and the rates count
    them."""
    from cgp.tools import speedup
    runs, lines = [], []
    configs = [Config("cgp", 1), Config("cgp", 2)]
    for c, seconds in zip(configs, (0.01, 0.05)):
        def run(n, c=c, seconds=seconds):
            runs.append((c.threads, n))
            time.sleep(seconds * n)
        c.run = run
        c.context = lambda: threadpool_limits(limits=None)
        c.save = c.restore = lambda: None
    speedup.interleaved(configs, iters=2, repeats=2, warmup=3, images_per_iter=1,
                        log=lines.append, lead_in=1, min_seconds=0.1)
    n = configs[0].iters
    assert 2 < n <= 10 and configs[1].iters == n
    assert runs[:3] == [(1, 2), (1, 1), (2, 2)]   # the warm-up, its last iteration timed
    assert runs.count((1, n)) == 2 and runs.count((2, n)) == 2
    assert lines[0] == f"  timings of at least 0.1 s (--min-seconds): {n} iterations each"
    # One image per iteration: 100 images/s for the first, 20 for the second, less when busy.
    assert all(50 < rate < 101 for rate in configs[0].rates)
    assert all(10 < rate < 20.5 for rate in configs[1].rates)


def test_paired_speedup_is_the_median_of_ratios_within_rounds():
    """A slow spell that hits one round halves every rate in it: the ratio of medians moves,
    the median of the per-round ratios does not."""
    one, two = Config("cgp", 1), Config("cgp", 2)
    one.rates, two.rates = [100, 100, 50, 50, 50], [180, 180, 90, 90, 90]
    rows, _ = summarise([one, two])
    row = rows[1]
    assert row["paired_speedup"] == pytest.approx(1.8)
    assert row["speedup"] == pytest.approx(90 / 50)
    one.rates, two.rates = [100, 100, 100, 50, 50], [180, 90, 90, 90, 90]
    rows, _ = summarise([one, two])
    assert rows[1]["paired_speedup"] == pytest.approx(1.8) and rows[1]["speedup"] == 0.9


def test_median_ci_takes_the_binomial_order_statistics():
    """The interval's ranks follow Binomial(n, 1/2): for 6 values only the extremes give 95 %
    (each tail 1/64), for 31 the 10th and 22nd values (tails 0.015, while adding the 11th
    would make them 0.035), and for 5 values no interval reaches 95 %."""
    from cgp.tools.stats import median_ci

    assert median_ci([3, 1, 2, 6, 5, 4]) == (1, 6)
    assert median_ci(list(range(31, 0, -1))) == (10, 22)
    assert median_ci([1, 2, 3, 4, 5]) is None
    assert median_ci([1, 2, 3, 4, 5], level=0.9) == (1, 5)
    # Binomial tails checked against their definition at many sizes.
    from math import comb
    for n in range(6, 60):
        lo, _ = median_ci(list(range(1, n + 1)))
        k = lo - 1   # values below lo
        tail = sum(comb(n, i) for i in range(k + 1)) / 2 ** n
        assert tail <= 0.025 < tail + comb(n, k + 1) / 2 ** n


def test_paired_ratios_come_with_their_interval():
    one, two = Config("cgp", 1), Config("cgp", 2)
    torch = Config("torch", 1, "channels_last")
    one.rates = [100.0] * 7
    two.rates = [150.0, 160.0, 170.0, 180.0, 190.0, 200.0, 210.0]
    torch.rates = [50.0, 100.0, 200.0, 100.0, 100.0, 100.0, 100.0]
    rows, best = summarise([one, two, torch])
    assert rows[1]["paired_speedup"] == pytest.approx(1.8)
    assert rows[1]["paired_speedup_ci"] == [1.5, 2.1]
    assert rows[0]["paired_cgp_over_torch"] == 1.0
    assert rows[0]["paired_cgp_over_torch_ci"] == [0.5, 2.0]
    lines = table(rows, best)
    assert "1.80 (1.50-2.10)" in lines[2] and "1.00 (0.50-2.00)" in lines[1]


def test_quiet_rounds_leave_out_timings_the_hypervisor_cut_into():
    """Rounds where either timing lost more than QUIET_STEAL of the CPUs to steal time are left
    out of the quiet-round speedup, and only those."""
    from cgp.tools.stats import QUIET_STEAL

    one, two = Config("cgp", 1), Config("cgp", 2)
    one.rates = [100.0] * 8
    two.rates = [180.0, 60.0, 70.0, 170.0, 190.0, 180.0, 175.0, 185.0]
    one.steals = [0.0, 0.3, 0.0, 0.0, QUIET_STEAL, 0.0, 0.0, 0.0]
    two.steals = [0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, QUIET_STEAL / 2]
    rows, best = summarise([one, two])
    row = rows[1]
    assert row["quiet_rounds"] == 6
    assert row["quiet_paired_speedup"] == pytest.approx(1.8)   # of 1.8, 1.7, 1.9, 1.8, 1.75, 1.85
    assert row["quiet_paired_speedup_ci"] == [1.7, 1.9]
    assert row["paired_speedup"] == pytest.approx(1.775)
    assert "6 of 8; paired speedup there 1.80 (1.70-1.90)" in table(rows, best)[-1]


def test_every_timing_trains_from_the_same_state(mnist_dir):
    """restore() rewinds weights, solver history and iteration: repetitions do equal work."""
    from cgp.tools.speedup import cgp_config

    trainer = mnist_trainer(mnist_dir, threads=2)
    try:
        config = cgp_config(2, trainer)
        config.save()
        finals = []
        for _ in range(2):
            config.restore()
            with config.context():
                config.run(2)
            finals.append((trainer.iter, trainer.net.params.copy()))
        assert finals[0][0] == finals[1][0] == 2
        assert np.array_equal(finals[0][1], finals[1][1])
    finally:
        trainer.close()


def test_ceiling_is_over_cgp_one_thread_and_cgp_gets_its_share():
    one, two, top = Config("cgp", 1), Config("cgp", 2), Config("ceiling", 2, "processes", 2)
    one.rates, two.rates, top.rates = [100, 100, 50], [170, 180, 80], [200, 190, 100]
    rows, best = summarise([one, two, top])
    cgp2, ceiling = rows[1], rows[2]
    assert ceiling["speedup"] == pytest.approx(1.9) and ceiling["paired_speedup"] == 2.0
    assert cgp2["share_of_ceiling"] == pytest.approx(170 / 190, abs=1e-4)
    assert cgp2["paired_share_of_ceiling"] == pytest.approx(0.85)   # of 0.85, 0.947, 0.8
    assert "share_of_ceiling" not in rows[0]
    [line] = [x for x in table(rows, best) if x.startswith("machine ceiling")]
    assert "2 copies" in line and "speedup 1.90" in line and "reaches 0.89 of it" in line


def test_ceiling_copies_train_what_cgp_trains(mnist_dir):
    """Each copy, in a process of its own, ends on the very weights that cgp's 2-thread
    training reaches from the same seed: the ceiling times the same work."""
    from cgp.tools.speedup import Copies, cgp_config

    # As in bench speedup: the copies' trainer keeps its parameters in private memory,
    # which each forked copy then has to itself.
    own = mnist_trainer(mnist_dir, threads=1, workers="threads")
    two = mnist_trainer(mnist_dir, threads=2)
    copies = Copies(3, cgp_config(1, own))
    try:
        config = copies.config()
        assert (config.impl, config.threads, config.copies) == ("ceiling", 3, 3)
        config.save()
        config.run(3)          # moves every copy on
        config.restore()       # and back
        config.run(2)
        reference = cgp_config(2, two)
        with reference.context():
            reference.run(2)
        assert copies.digests() == [reference.digest()] * 3
    finally:
        copies.close()
        own.close()
        two.close()
    assert not any(worker.is_alive() for worker in copies.workers)


def _spin(seconds):
    import time
    while time.process_time() < seconds:
        pass


def test_foreign_load_leaves_out_our_own_children():
    """Worker processes and --ceiling copies are ours: their CPU time is not the neighbours'."""
    import multiprocessing

    from cgp.tools.machine import ForeignLoad
    with ForeignLoad() as load:
        before = load._ours()
        child = multiprocessing.get_context("fork").Process(target=_spin, args=(0.3,))
        child.start()
        child.join()
        # 0.3 s of CPU, counted in clock ticks of 10 ms and subtracted in floating point.
        assert load._ours() - before >= 0.28


def test_default_threads_reach_the_core_count(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert default_threads() == [1, 2, 4, 6]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert default_threads() == [1, 2]


# -- cgp time ------------------------------------------------------------------------
def layer_times(text, name):
    """(forward ms, backward ms) of a layer in `cgp time` output."""
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == name and parts[1] in ("forward:", "backward:"):
            values[parts[1][:-1]] = float(parts[2])
    return values["forward"], values["backward"]


def test_time_train_net_prints_every_layer(capsys, mnist_dir):
    text = run_cli(capsys, "time", "--model", LENET, "--iterations", "2",
                   "--data-dir", mnist_dir)
    for name in LENET_LAYERS:
        forward, backward = layer_times(text, name)
        assert forward >= 0 and backward >= 0
    assert layer_times(text, "conv2")[1] > 0
    for line in ("Average Forward pass:", "Average Backward pass:", "Average Forward-Backward:",
                 "Initial loss:", "Iteration: 2 forward-backward time:", "engine on 1 thread"):
        assert line in text


def test_time_deploy_net_with_random_input(capsys, tmp_path):
    model = tmp_path / "deploy.prototxt"
    model.write_text(DEPLOY)
    for workers, kind in (("threads", "thread(s)"), ("processes", "process(es)")):
        text = run_cli(capsys, "time", "--model", model, "--iterations", "2", "--threads", "2",
                       "--chunks", "3", "--phase", "TEST", "--workers", workers)
        for name in ("data", "conv", "relu", "pool", "fc", "prob"):
            layer_times(text, name)
        assert "no loss" in text and f"engine on 2 {kind}" in text
        assert layer_times(text, "conv")[1] > 0   # weight gradients are timed, as in Caffe


# -- the first-run note --------------------------------------------------------------
def test_compile_notice_only_when_numba_compiles():
    lines = []

    @njit
    def first(x):
        return x + 1

    @njit
    def second(x):
        return x * 2

    with compile_notice(lines.append, prefix=first.py_func.__module__):
        first(1)
        second(1)
    assert lines[0] == COMPILING and len(lines) == 2
    assert lines[1].startswith("compiled 2 kernels in ")   # and how long, at the end
    lines.clear()
    with compile_notice(lines.append, prefix=first.py_func.__module__):
        first(2)          # compiled already: no note
    with compile_notice(lines.append):   # cgp's kernels only
        first(2.0)
    assert lines == []


# -- the PyTorch copy ----------------------------------------------------------------
def test_torch_lenet_has_cgp_loss_and_gradient(mnist_dir):
    pytest.importorskip("torch")
    from cgp.tools.torch_ref import TorchNet

    trainer = mnist_trainer(mnist_dir, chunks=4)
    try:
        batch = trainer._batch(trainer.engine, 0, 0)
        with threadpool_limits(limits=1):
            _, loss, grad = trainer.engine.run(batch, 0, trainer.seed)
        for layout in ("channels_last", "contiguous"):
            model = TorchNet(trainer.net, layout=layout)
            torch_loss, _ = model(batch)
            assert abs(float(torch_loss.detach()) - loss) < 1e-4
            torch_loss.backward()
            assert np.allclose(model.flat_grad(), grad, rtol=1e-3, atol=1e-5 * np.abs(grad).max())
    finally:
        trainer.close()


def test_torch_training_state_is_restored(mnist_dir):
    torch = pytest.importorskip("torch")
    from cgp.tools.torch_ref import TorchTrainer

    trainer = mnist_trainer(mnist_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a fixed reduction order
    try:
        copy = TorchTrainer(trainer.net, trainer.sp)
        batches = [trainer._batch(trainer.engine, i * 64, i) for i in range(3)]
        copy.step(batches[0])
        saved = copy.save()
        losses = []
        for _ in range(2):
            copy.restore(saved)
            losses.append([copy.step(b) for b in batches[1:]])
        assert losses[0] == losses[1]
    finally:
        torch.set_num_threads(threads)
        trainer.close()


@pytest.mark.parametrize("flush", [True, False])
def test_torch_timings_run_in_pytorchs_own_mode(mnist_dir, flush):
    """--compare torch: each PyTorch timing keeps subnormals, PyTorch's default, whatever
    cgp's --denormals (flush=False), or flushes them with --torch-denormals flush, and gives
    the caller its own mode back; a product that underflows shows which mode PyTorch
    computed in. No BLAS or OpenMP limit of cgp's reaches it: it has its own threads."""
    torch = pytest.importorskip("torch")
    from cgp.runtime import fpenv
    from cgp.tools import torch_ref
    from cgp.tools.speedup import torch_config

    trainer = mnist_trainer(mnist_dir)
    before = fpenv.set_flush(not flush)   # the caller in the other mode
    threads = torch.get_num_threads()
    try:
        config = torch_config(torch_ref, 2, "channels_last",
                              torch_ref.TorchTrainer(trainer.net, trainer.sp), trainer, flush)
        tiny = torch.full((64,), 1e-30)
        with config.context():
            assert fpenv.flushing() == flush
            assert bool((tiny * 1e-10 == 0).all()) == flush   # 1e-40 is subnormal
            assert torch.get_num_threads() == 2
            config.run(1)
        assert fpenv.flushing() == (not flush)
    finally:
        fpenv.restore(before)
        torch.set_num_threads(threads)
        trainer.close()


def load_bench(name):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_torch_comparison_does_the_work_of_a_minimal_loop(mnist_dir, layout):
    """The loop that --compare torch times and the minimal LeNet loop a PyTorch user writes
    (bench/torch_baseline.py, which times the two against each other) end on the same
    parameters and momenta, bit for bit, after the same steps from the same weights on the
    same batches: the same ops in the same formats and the same optimizer, no more."""
    torch = pytest.importorskip("torch")
    from cgp.tools import torch_ref
    from cgp.tools.speedup import torch_config

    baseline = load_bench("torch_baseline.py")
    trainer = mnist_trainer(mnist_dir)
    threads = torch.get_num_threads()
    try:
        copy = torch_ref.TorchTrainer(trainer.net, trainer.sp, layout)
        config = torch_config(torch_ref, 1, layout, copy, trainer, lead_in=1)
        config.iters = 2   # batches made into tensors by save(), for 1 + 2 iterations
        model, optimizer = baseline.minimal_lenet(layout)
        with torch.no_grad():
            for mine, theirs in zip(model.parameters(), copy.model.blobs):
                mine.copy_(theirs)
        config.save()
        with config.context():
            config.run(3)
            for it in range(3):
                tensors = copy.model.inputs(trainer._batch(trainer.engine, it * 64, it))
                images, labels = tensors.values()
                assert images.is_contiguous(memory_format=baseline.memory_format(layout))
                baseline.minimal_step(model, optimizer, images, labels.long())
        mine = list(model.parameters())
        theirs = list(copy.model.blobs)
        assert [p.shape for p in mine] == [p.shape for p in theirs]
        assert not torch.equal(theirs[0], torch.from_numpy(trainer.net.params[:500])
                               .reshape(theirs[0].shape))   # it trained
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)
            assert a.stride() == b.stride()
            assert torch.equal(optimizer.state[a]["momentum_buffer"],
                               copy.optimizer.state[b]["momentum_buffer"])
    finally:
        torch.set_num_threads(threads)
        trainer.close()


def test_torch_copy_of_every_supported_layer():
    pytest.importorskip("torch")
    from cgp.comm.local import LocalCommunicator
    from cgp.engine import Engine
    from cgp.runtime.pool import Pool
    from cgp.commands.timing import fill_inputs
    from cgp.tools.torch_ref import TorchNet

    net = Net(parse_net(ALL_KINDS), caffe_pb2.TRAIN)
    net.init_params(5)
    fill_inputs(net, 5)
    batch = {t: v for e in net.sources for t, v in zip(e.tops, e.layer.values)}
    pool = Pool(1)
    with threadpool_limits(limits=1):
        outputs, loss, grad = Engine(net, 2, pool, LocalCommunicator(pool)).run(batch, 0, 5)
    model = TorchNet(net)
    torch_loss, data = model(batch)
    torch_loss.backward()
    assert abs(float(torch_loss.detach()) - loss) < 1e-5
    accuracy = net.scalar_outputs()[0][0]
    assert float(data[accuracy]) == pytest.approx(outputs["accuracy"], abs=1e-6)
    assert np.allclose(model.flat_grad(), grad, rtol=1e-3, atol=1e-5 * np.abs(grad).max())


# A deploy net of the zoo's layers, as `cgp bench speedup --model` trains it: BatchNorm with a
# Scale after it (the pair PyTorch runs as one batch_norm) and without, depthwise and grouped
# convolution, Eltwise SUM with coefficients and MAX, LRN, MAX pooling whose Caffe (ceil)
# rounding keeps a row that floor would drop (8 -> 4), Concat, global AVE pooling, a Dropout
# (ratio 0: a random mask cannot be compared) and a Softmax that becomes the loss.
ZOO_KINDS = """
name: "zoo_kinds"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 17 dim: 17 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 stride: 2 bias_term: false } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"
        batch_norm_param { use_global_stats: true } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "dw" type: "Convolution" bottom: "conv1" top: "dw"
        convolution_param { num_output: 8 group: 8 kernel_size: 3 pad: 1 } }
layer { name: "bn2" type: "BatchNorm" bottom: "dw" top: "bn2" }
layer { name: "relu2" type: "ReLU" bottom: "bn2" top: "relu2" }
layer { name: "scale2" type: "Scale" bottom: "bn2" top: "scale2" }
layer { name: "sum" type: "Eltwise" bottom: "scale2" bottom: "conv1" bottom: "relu2" top: "sum"
        eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 } }
layer { name: "norm" type: "LRN" bottom: "sum" top: "norm"
        lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool" type: "Pooling" bottom: "norm" top: "pool"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "a" type: "Convolution" bottom: "pool" top: "a"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "b" type: "Convolution" bottom: "pool" top: "b"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "max" type: "Eltwise" bottom: "a" bottom: "b" top: "max"
        eltwise_param { operation: MAX } }
layer { name: "c" type: "Convolution" bottom: "pool" top: "c"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 group: 2 } }
layer { name: "cat" type: "Concat" bottom: "max" bottom: "c" top: "cat" }
layer { name: "gap" type: "Pooling" bottom: "cat" top: "gap"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "fc" type: "InnerProduct" bottom: "gap" top: "fc"
        inner_product_param { num_output: 5 } }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc" dropout_param { dropout_ratio: 0 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""
ZOO = Path(__file__).resolve().parents[2] / "shared" / "data" / "caffe" / "zoo"


def assert_torch_matches_cgp(path, batch, gradient_norm_tolerance=None):
    """The net that `cgp bench speedup --model path --batch batch` trains, one forward and
    backward on its synthetic batch in cgp (1 worker) and in the PyTorch copy, in each
    layout, from the same weights: the same loss and parameter gradients (elementwise, or
    each blob's within gradient_norm_tolerance of PyTorch's in norm). Dropout ratios are set
    to 0 (a random mask cannot be compared)."""
    from cgp.comm.local import LocalCommunicator
    from cgp.engine import Engine
    from cgp.runtime.pool import Pool
    from cgp.commands.timing import fill_inputs
    from cgp.tools.net_bench import bench_solver
    from cgp.tools.torch_ref import TorchNet

    param = bench_solver(path, batch, log=lambda line: None).net_param
    for lp in param.layer:
        if lp.type == "Dropout":
            lp.dropout_param.dropout_ratio = 0
    net = Net(param, caffe_pb2.TRAIN)
    net.init_params(3)
    fill_inputs(net, 3)
    data = {t: v for e in net.sources for t, v in zip(e.tops, e.layer.values)}
    pool = Pool(1)
    with threadpool_limits(limits=1):
        _, loss, grad = Engine(net, batch, pool, LocalCommunicator(pool)).run(data, 0, 3)
    assert np.abs(grad).max() > 0
    for layout in ("channels_last", "contiguous"):
        model = TorchNet(net, layout=layout)
        torch_loss, _ = model(data)
        torch_loss.backward()
        assert float(torch_loss.detach()) == pytest.approx(loss, rel=1e-4)
        theirs = model.flat_grad()
        if gradient_norm_tolerance is None:
            assert np.allclose(theirs, grad, rtol=1e-3, atol=1e-4 * np.abs(grad).max())
            continue
        for b in net.param_blobs:
            part = slice(b.offset, b.offset + b.size)
            assert (np.linalg.norm(grad[part] - theirs[part])
                    <= gradient_norm_tolerance * np.linalg.norm(theirs[part]))


def test_torch_copy_of_the_zoo_layers(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "deploy.prototxt"
    path.write_text(ZOO_KINDS)
    assert_torch_matches_cgp(path, 3)


def test_torch_copy_of_squeezenet():
    """A zoo net as the bench trains it, at batch 2."""
    pytest.importorskip("torch")
    path = ZOO / "squeezenet_v1.1" / "deploy.prototxt"
    if not path.is_file():
        pytest.skip(f"the model zoo fixtures are not at {ZOO}")
    # The gradients of the layers below pool5 differ from PyTorch's contiguous run by up to
    # 0.4% in norm (conv1): float rounding made discrete by a max. One of pool5's 100352
    # windows holds a near-tie (its two largest inputs 1.1e-7 apart in PyTorch's float64,
    # less than float32's rounding through the layers above), and cgp, like PyTorch's
    # channels_last run, takes the other cell; the loss is equal. Given cgp's argmax at
    # pool5, the contiguous run agrees within 3e-6. pool5 itself is not at fault: on its
    # input, cgp and both PyTorch layouts pick the same cell as Caffe's rule in every window.
    assert_torch_matches_cgp(path, 2, gradient_norm_tolerance=1e-2)


def test_torch_refuses_other_layers_by_name():
    pytest.importorskip("torch")
    from cgp.errors import CgpError
    from cgp.tools.torch_ref import TorchNet

    net = Net(parse_net(DEPLOY.replace('"Softmax"', '"AbsVal"')), caffe_pb2.TEST)
    with pytest.raises(CgpError, match="AbsVal.*supported: Convolution"):
        TorchNet(net)


def test_speedup_times_a_deploy_net_file(capsys, tmp_path):
    """--model FILE: a deploy net (no data layer, no loss) at the batch --batch sets, trained
    on synthetic input by cgp and by PyTorch alike."""
    pytest.importorskip("torch")
    path = tmp_path / "deploy.prototxt"
    path.write_text(ZOO_KINDS)
    text = run_cli(capsys, "bench", "speedup", "--model", path, "--batch", "4", "--threads",
                   "1", "--iters", "1", "--repeats", "1", "--warmup", "0", "--compare", "torch",
                   "--torch-layout", "contiguous", "--out", tmp_path)
    assert "Softmax -> SoftmaxWithLoss against synthetic labels" in text
    [report_path] = Path(tmp_path).glob("speedup_*_deploy_*.json")
    report = json.loads(report_path.read_text())
    assert report["batch"] == 4 and report["net_file"] == str(path)
    assert {(r["impl"], r["layout"]) for r in report["results"]} == {
        ("cgp", "processes"), ("torch", "contiguous")}


def test_speedup_batch_goes_with_a_net_file(capsys, mnist_dir):
    code = cli.main(["bench", "speedup", "mnist", "--batch", "4", "--data-dir", str(mnist_dir)])
    assert code == 2
    assert "--batch goes with --model FILE" in capsys.readouterr().err


def test_speedup_compares_with_torch(capsys, tmp_path, mnist_dir):
    pytest.importorskip("torch")
    text = run_cli(capsys, "bench", "speedup", "mnist", "--threads", "1", "--iters", "1",
                   "--repeats", "1", "--warmup", "0", "--compare", "torch",
                   "--data-dir", mnist_dir, "--out", tmp_path)
    assert "cgp/torch" in text
    [report_path] = Path(tmp_path).glob("speedup_mnist_*.json")
    report = json.loads(report_path.read_text())
    layouts = {r["layout"] for r in report["results"] if r["impl"] == "torch"}
    assert layouts == {"channels_last", "contiguous"}
    assert "torch" in report["machine"]["versions"]
    [cgp_row] = [r for r in report["results"] if r["impl"] == "cgp"]
    assert cgp_row["cgp_over_torch"] > 0



def test_speedup_on_a_device_times_both_torch_modes(capsys, tmp_path, mnist_dir):
    """--device numpy (the GPU path on the host): PyTorch on the same device ("cpu" here),
    in its default mode and in its deterministic one, each against cgp."""
    pytest.importorskip("torch")
    text = run_cli(capsys, "bench", "speedup", "mnist", "--threads", "1", "--iters", "1",
                   "--repeats", "1", "--warmup", "0", "--compare", "torch", "--device",
                   "numpy", "--torch-layout", "contiguous", "--data-dir", mnist_dir,
                   "--out", tmp_path)
    assert "on NumPy standing in for CuPy" in text
    [report_path] = Path(tmp_path).glob("speedup_mnist_*.json")
    report = json.loads(report_path.read_text())
    assert report["device"] == "numpy"
    rows = {r["layout"]: r for r in report["results"] if r["impl"] == "torch"}
    assert set(rows) == {"contiguous", "contiguous deterministic"}
    for layout, row in rows.items():
        assert row["cgp_over_this"] > 0
        assert f"cgp / PyTorch {layout}: " in text
