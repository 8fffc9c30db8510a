"""Where one thread's training step goes, layer by layer, in CPU time: each layer's forward
and backward over the batch in the calls the engine's single worker makes (engine.group_size:
LeNet's whole batch in one call, cifar10_quick's in calls of two chunks), its GFLOP/s and
their share of NumPy's single-threaded float32 matmul rate (1024 x 1024, the rate `cgp bench
speedup` compares with), and the engine's whole step (workers as threads, so that the step's
CPU time is the process's). Rounds alternate the matmul, the call and the
steps, and medians are printed.

    python bench/layer_rates.py [mnist|cifar10] [--rounds 9] [--steps 4] [--data-dir DIR]

Every time here is the CPU time of the thread (the process, for the step) that did the work:
on the loaded 2-core VM a wall-clock time also counts the waits for a core, which moved
single kernel calls by up to 5x. Net.forward and Net.backward time their layers with
time.perf_counter; this script points that at the thread's CPU clock instead. FLOPs count the
multiply-adds of Convolution and InnerProduct, 2 each: forward, and backward's weight and
input gradients (the first convolution has no input gradient; InnerProduct's weight gradient
is summed from factors outside the call, in the rest of the step, and counts in the step's
rate alone, which so counts what `cgp bench speedup` does).
"""
import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import cgp.net
from cgp import models
from cgp.engine import chunk_bounds, group_size
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from call_size import load_net, time_calls  # noqa: E402


def layer_flops(entry, batch, first_conv):
    """(forward, backward in the call, outside it) FLOPs of one layer over the batch; zeros
    for layers without multiply-adds."""
    layer = entry.layer
    kind = type(layer).__name__
    if kind == "Convolution":
        macs = layer.K * layer.P * layer.Q * (layer.C // layer.group) * layer.R * layer.S
        return 2 * macs * batch, 2 * macs * batch * (1 if first_conv else 2), 0
    if kind == "InnerProduct":
        flops = 2 * layer.K * layer.C * batch
        return flops, flops, flops
    return 0, 0, 0


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4, help="engine steps per round")
    parser.add_argument("--data-dir", default=None)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    net, batch = load_net(args.model, args.data_dir)
    group = group_size(net, 16, 1)
    bounds = chunk_bounds(net.batch_size, 16)
    calls = -(-len(bounds) // group)
    # Calls of the first `group` chunks, as many as the batch takes; their time scaled to the
    # batch (chunks differ by a sample at most).
    layout = {"batch": (bounds[:group], calls)}
    per_batch = net.batch_size / sum(n for _, n in bounds[:group])
    path = models.solver_path(args.model)
    trainer = Trainer(read_solver(path), path,
                      RunConfig(threads=1, chunks=16, progress=False, workers="threads",
                                data_dir=args.data_dir), log=lambda line: None)
    cgp.net.time = types.SimpleNamespace(perf_counter=time.thread_time)
    a = np.random.default_rng(0).random((1024, 1024), np.float32)
    rates, layers, steps = [], [], []
    with threadpool_limits(limits=1):
        time_calls(net, batch, layout, 1)   # warm-up: compilation, first touches
        trainer.steps(2)
        for _ in range(args.rounds):
            started = time.thread_time()
            a @ a
            rates.append(2 * 1024 ** 3 / (time.thread_time() - started) / 1e9)
            layers.append(time_calls(net, batch, layout, 1)["batch"][0] * per_batch)
            started = time.process_time()
            trainer.steps(args.steps)
            steps.append((time.process_time() - started) / args.steps)
    trainer.close()
    matmul, step = np.median(rates), np.median(steps)
    per_layer = np.median(layers, axis=0)
    count = len(net.entries)
    convs = [i for i, e in enumerate(net.entries) if type(e.layer).__name__ == "Convolution"]
    total_flops = 0
    lines = []
    for i, entry in enumerate(net.entries):
        flops = layer_flops(entry, net.batch_size, bool(convs) and i == convs[0])
        total_flops += flops[2]
        for k, name, f in ((i, "forward", flops[0]), (count + i, "backward", flops[1])):
            seconds = per_layer[k]
            total_flops += f
            rate = (f" {f / seconds / 1e9:6.1f} GFLOP/s = {f / seconds / 1e9 / matmul:4.0%}"
                    if f else "")
            lines.append(f"  {entry.layer.name:12s} {name:8s} {seconds * 1e3:8.3f} ms "
                         f"{seconds / step:6.1%}{rate}")
    print(f"{args.model}, batch {net.batch_size} in {calls} call(s) of {group} chunk(s), "
          f"1 thread, CPU time, medians of {args.rounds} rounds: matmul {matmul:.1f} GFLOP/s; "
          f"engine step {step * 1e3:.2f} ms, "
          f"{total_flops / step / 1e9:.1f} GFLOP/s = {total_flops / step / 1e9 / matmul:.0%} "
          f"of matmul; the layers {per_layer.sum() * 1e3:.2f} ms "
          f"({per_layer.sum() / step:.0%} of the step)")
    print(f"  {'layer':12s} {'pass':8s} {'ms':>8s} {'step':>6s}  rate, share of matmul")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
