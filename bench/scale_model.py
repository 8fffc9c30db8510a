"""A model of cgp's step on N nodes, from a net's measured per-layer times and a link's
bandwidth and latency, as FireCaffe analysed its reduction trees; predicts step time and
parallel efficiency for 1 to 256 nodes, and, with --check, compares its predicted speedups
with those of real mpirun runs of 2 to 4 ranks on this machine (`cgp bench speedup --ranks`).

    python bench/scale_model.py [mnist|cifar10_quick|...] [--threads T] [--chunks K]
                                [--link 25GbE|100GbIB|NAME=GBPS,US ...] [--nodes 1,2,4,...]
                                [--check] [--data-dir DIR]

The model, per node of T workers (each node one MPI rank):
- compute: the per-layer forward and backward times of one worker (cgp.commands.timing.LayerTimer,
  in calls of the chunk size), scaled to the node's share of the batch, batch / N samples on
  T workers (perfect scaling inside a node: an assumption; --check measures it here);
- the exchange (cgp.comm.mpi): each rank owns n / N columns; it sends every other owner the
  partial sums of its subtrees of its chunk range (1 where N is a power of two dividing K)
  for their columns, in buckets (the engine's, about 256K columns), each sent as soon as the
  backward pass has passed the layers that write it, one after the other on the link: a
  bucket costs (N - 1) latencies plus its bytes over the bandwidth; only what is left after
  backward ends is exposed;
- the update of n / N columns (measured per column), then the all-gather of the
  parameters, a ring: (N - 1) latencies plus (N - 1) / N of the parameters' bytes.
No contention, no stragglers: the efficiency is an upper bound. N may not exceed K (cgp
cuts the batch into K chunks; a node without chunks has nothing to compute): the default
--chunks is the largest node count asked for.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

LINKS = {"25GbE": (25e9 / 8, 5e-6), "100GbIB": (100e9 / 8, 1.5e-6)}
BUCKET = 1 << 18   # columns per bucket, as cgp.comm.mpi.BUCKET


def measure(model, chunks, data_dir, iterations=5):
    """Per-entry forward and backward seconds of one worker per batch, the update's seconds
    per column, the parameter count, the batch, and (entry, columns) of each parameter blob."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from cgp import models
    from cgp.net import RunOptions, build_net
    from cgp.prototxt import read_net, read_solver
    from cgp.solver import Solver
    from cgp.commands.timing import LayerTimer, denormals

    solver = read_solver(models.solver_path(model))
    path = models.FOLDER / solver.net
    net = build_net(read_net(path), str(path), options=RunOptions(data_dir))
    net.init_params(1)
    timer = LayerTimer(net, chunks, 1)
    with threadpool_limits(limits=1), denormals(True):
        timer.iteration(0)
        timer.reset()
        for it in range(iterations):
            timer.iteration(it + 1)
        solver_ = Solver(solver, net.lr_mult, net.decay_mult)
        grads = np.zeros(net.n_params, np.float32)
        step = solver_.prepare(0)
        started = time.perf_counter()
        for _ in range(10):
            solver_.apply(step, net.params.copy(), grads, 0, net.n_params)
        update = (time.perf_counter() - started) / 10 / net.n_params
    blobs = [(e, net.param_blobs[p].offset, net.param_blobs[p].size)
             for e, entry in enumerate(net.entries) for p in entry.params]
    return {"forward": list(timer.forward / iterations), "backward": list(timer.backward / iterations),
            "data": float(timer.data.sum() / iterations), "update_per_column": update,
            "params": net.n_params, "batch": net.batch_size, "blobs": blobs}


def subtree_count(lo, hi, chunks):
    from cgp.comm.local import subtrees
    return len(subtrees(lo, hi, chunks))


def predict(m, nodes, threads, chunks, bandwidth, latency, cores=None):
    """Predicted seconds of a step on `nodes` nodes (see the module), and its parts."""
    share = 1.0 / nodes
    # Oversubscription, where --cores says how many cores all nodes share (this machine).
    slow = max(1.0, nodes * threads / cores) if cores else 1.0
    per = share / threads * slow
    forward = sum(m["forward"]) * per + m["data"] * share
    backward = [b * per for b in m["backward"]]
    compute = forward + sum(backward)
    n = m["params"]
    exposed = 0.0
    if nodes > 1:
        pieces = max(subtree_count(r * chunks // nodes, (r + 1) * chunks // nodes, chunks)
                     for r in range(nodes))
        # When backward has passed entry e (the last entries first), measured from its start.
        passed, clock = {}, 0.0
        for e in reversed(range(len(backward))):
            clock += backward[e]
            passed[e] = clock
        # Buckets of the last columns first, each ready when backward has passed every entry
        # that writes it, then sent after the bucket before it.
        link_free, lo = 0.0, n
        while lo > 0:
            hi, lo = lo, max(0, lo - BUCKET)
            writers = [e for e, offset, size in m["blobs"] if offset < hi and lo < offset + size]
            ready = max(passed[e] for e in writers) if writers else 0.0
            cost = (nodes - 1) * latency + pieces * (hi - lo) * 4 * (nodes - 1) / nodes / bandwidth
            link_free = max(link_free, ready) + cost
        exposed = max(0.0, link_free - sum(backward))
    update = m["update_per_column"] * n * share / threads
    gather = ((nodes - 1) * latency + (nodes - 1) / nodes * n * 4 / bandwidth) if nodes > 1 else 0.0
    return {"step": compute + exposed + update + gather, "compute": compute,
            "exposed_exchange": exposed, "update": update, "allgather": gather}


def measured_speedups(model, threads, chunks, data_dir, folder="/tmp/cgp_scale_model"):
    """Paired speedups of 2 to 4 real mpirun ranks of `threads` workers over one process of
    `threads` workers on this machine, from `cgp bench speedup --ranks` (interleaved
    repetitions), and the one process's seconds per step."""
    argv = [sys.executable, "-m", "cgp", "bench", "speedup", model, "--threads", str(threads),
            "--ranks", "2,3,4", "--chunks", str(chunks), "--iters", "20", "--repeats", "5",
            "--out", folder]
    if data_dir:
        argv += ["--data-dir", data_dir]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"scale_model: cgp bench speedup failed:\n{done.stderr}")
    written = re.findall(r"wrote (\S+\.json)", done.stdout + done.stderr)
    report = json.loads(Path(written[-1]).read_text())
    one = next(r for r in report["results"] if r["impl"] == "cgp" and r["threads"] == threads)
    speedups = {1: 1.0}
    speedups.update({r["ranks"]: r["paired_speedup"] for r in report["results"]
                     if r["impl"] == "mpi"})
    return speedups, report["batch"] / one["median"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="mnist")
    p.add_argument("--threads", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--chunks", type=int, default=None, help="K (default: the most nodes)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--link", action="append", default=None,
                   help="25GbE, 100GbIB, or NAME=GBIT_PER_S,LATENCY_US (repeatable)")
    p.add_argument("--check", action="store_true",
                   help="also run 1 to 4 ranks here and compare with the model (the link: "
                        "this machine's shared memory, measured; 2 cores shared)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None, help="write every prediction here")
    args = p.parse_args(argv)
    nodes = [int(x) for x in args.nodes.split(",")]
    chunks = args.chunks or max(nodes)
    m = measure(args.model, chunks, args.data_dir)
    links = []
    for spec in args.link or ["25GbE", "100GbIB"]:
        if spec in LINKS:
            links.append((spec, *LINKS[spec]))
        else:
            name, values = spec.split("=")
            gbit, micro = (float(v) for v in values.split(","))
            links.append((name, gbit * 1e9 / 8, micro * 1e-6))
    print(f"{args.model}: {m['params']} parameters ({4 * m['params'] / 2**20:.2f} MiB), batch "
          f"{m['batch']} in {chunks} chunks, one worker {1e3 * (sum(m['forward']) + sum(m['backward'])):.1f} ms "
          f"forward+backward a batch; {args.threads} worker(s) a node")
    report = {"model": args.model, "threads": args.threads, "chunks": chunks, "measured": m,
              "predictions": {}}
    one = predict(m, 1, args.threads, chunks, 1, 0)["step"]
    for name, bandwidth, latency in links:
        print(f"\n{name} ({8 * bandwidth / 1e9:g} Gbit/s, {1e6 * latency:g} us):")
        print(f"{'nodes':>6} {'step ms':>9} {'exposed exch':>13} {'allgather':>10} "
              f"{'speedup':>8} {'efficiency':>10}")
        rows = []
        for n in nodes:
            if n > chunks or n > m["batch"]:
                continue
            r = predict(m, n, args.threads, chunks, bandwidth, latency)
            speedup = one / r["step"]
            rows.append({"nodes": n, **r, "speedup": speedup, "efficiency": speedup / n})
            print(f"{n:>6} {1e3 * r['step']:>9.3f} {1e3 * r['exposed_exchange']:>13.3f} "
                  f"{1e3 * r['allgather']:>10.3f} {speedup:>8.2f} {speedup / n:>10.2f}")
        report["predictions"][name] = rows
    if args.check:
        # This machine's link: shared memory; its cores are shared by all ranks.
        measured, step = measured_speedups(args.model, args.threads, chunks, args.data_dir)
        cores = os.cpu_count()
        bandwidth, latency = 5e9, 2e-6   # shared memory, about (python -m mpi4py.bench)
        print(f"\ncheck on this machine ({cores} cores shared by all ranks; shared memory "
              f"modelled as {bandwidth / 1e9:g} GB/s, {1e6 * latency:g} us; one process "
              f"{1e3 * step:.2f} ms a step):")
        print(f"{'ranks':>6} {'predicted speedup':>18} {'measured (paired)':>18} {'ratio':>6}")
        check = []
        base = predict(m, 1, args.threads, chunks, bandwidth, latency, cores)["step"]
        for r, speedup in sorted(measured.items()):
            pred = base / predict(m, r, args.threads, chunks, bandwidth, latency, cores)["step"]
            check.append({"ranks": r, "predicted_speedup": pred, "measured_speedup": speedup})
            print(f"{r:>6} {pred:>18.2f} {speedup:>18.2f} {speedup / pred:>6.2f}")
        report["check"] = check
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
