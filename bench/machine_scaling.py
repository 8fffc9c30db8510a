"""The machine's own ceiling for N-core speedup: one single-threaded loop alone, then N
such loops at once. The loop is a cache-resident SGEMM (--workload sgemm, AVX-512 where the
CPU has it), cgp's own single-threaded LeNet training step (lenet), a scalar Python loop
that touches almost no memory (scalar: what a vCPU's share of a core and its clock give), or
copies of a 64 MiB array (stream: memory bandwidth), each copy with its own data. Several
workloads and copy counts are timed in --rounds interleaved rounds, each against the one copy
alone of its own round; a workload whose N copies all keep their speed (scalar near N) and
another that loses it tell apart a host that shares the vCPUs' cores from one whose caches,
memory or vector units run short. Each copy counts what it finishes in the same --seconds, so
a slow copy holds no other up: the machine's throughput. (`cgp bench speedup --ceiling` times
the same iterations in every copy, to the last copy's end, as a step of many workers waits
for the slowest.)

With --in processes (the default) the copies share nothing but the machine, so on a VM whose
vCPUs share physical cores, caches or memory bandwidth, no parallel trainer can beat the
ratio printed here for that workload. With --in threads they run in threads of one process,
as cgp's workers do, and also share its interpreter lock and allocator: the gap between the
two is what running inside one process costs, before any engine design.

    python bench/machine_scaling.py [--workload sgemm,lenet,scalar,stream]
                                    [--in processes|threads] [--seconds 8] [--copies 2,16]
                                    [--rounds 1]
"""
import argparse
import statistics
import subprocess
import sys

SGEMM = """
import numpy as np
def setup():
    return np.random.default_rng(0).random((512, 512), dtype=np.float32)
def step(a):
    a @ a
"""

LENET = """
from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
def setup():
    # Trainer resolves the solver's net relative to the solver file.
    path = models.solver_path("mnist")
    trainer = Trainer(read_solver(path), path, RunConfig(threads=1, progress=False),
                      log=lambda line: None)
    for _ in range(5):
        trainer.step()
    return trainer
def step(trainer):
    trainer.step()
"""

SCALAR = """
def setup():
    return [1]
def step(state):
    x = state[0]
    for _ in range(20000):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    state[0] = x
"""

STREAM = """
import numpy as np
def setup():
    # Both written first, so that no copy pays the destination's page faults.
    return np.ones(1 << 24, dtype=np.float32), np.ones(1 << 24, dtype=np.float32)
def step(arrays):
    np.copyto(arrays[1], arrays[0])
"""

# Runs `copies` copies of the workload in threads of this process; prints each one's count.
DRIVER = """
import threading, time
from threadpoolctl import threadpool_limits
states = [setup() for _ in range({copies})]
counts = []
def loop(state):
    end, n = time.perf_counter() + {seconds}, 0
    while time.perf_counter() < end:
        step(state)
        n += 1
    counts.append(n)
with threadpool_limits(limits=1):
    threads = [threading.Thread(target=loop, args=(s,)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(" ".join(map(str, counts)))
"""
LOOPS = {"sgemm": (SGEMM, "products"), "lenet": (LENET, "LeNet iterations"),
         "scalar": (SCALAR, "loops of 20,000 multiply-adds"),
         "stream": (STREAM, "copies of 64 MiB")}


def run(workload, processes, copies_each, seconds):
    """Counts of every copy: `processes` processes, each running `copies_each` threads."""
    code = workload + DRIVER.format(copies=copies_each, seconds=seconds)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    return [int(n) for p in procs for n in p.communicate()[0].split()]


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--copies", default="2", help="comma-separated copy counts")
    parser.add_argument("--workload", default="sgemm",
                        help=f"comma-separated, of {', '.join(sorted(LOOPS))}")
    parser.add_argument("--in", dest="within", choices=("processes", "threads"),
                        default="processes")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.workload.split(",")) - set(LOOPS))
    if unknown:
        parser.error(f"unknown workload {', '.join(unknown)}; known: {', '.join(sorted(LOOPS))}")
    return args


def main():
    args = parse_args()
    names = args.workload.split(",")
    copies = [int(n) for n in args.copies.split(",")]
    ratios = {(name, n): [] for name in names for n in copies}
    for r in range(args.rounds):
        for name in names:
            workload, unit = LOOPS[name]
            alone = run(workload, 1, 1, args.seconds)[0]
            for n in copies:
                if args.within == "processes":
                    together = run(workload, n, 1, args.seconds)
                else:
                    together = run(workload, 1, n, args.seconds)
                ratios[name, n].append(sum(together) / alone)
                print(f"round {r + 1}, {name}: one copy {alone} {unit}; {n} at once in "
                      f"{args.within}: {' + '.join(map(str, together))}: "
                      f"{sum(together) / alone:.2f}x", flush=True)
    print(f"throughput of N copies against one alone (the machine's ceiling for N cores, "
          f"copies in {args.within}), the median of {args.rounds} round(s), and per copy:")
    for (name, n), values in ratios.items():
        ratio = statistics.median(values)
        print(f"  {name:7s} {n:3d} copies: {ratio:6.2f}x  ({ratio / n:.2f} per copy; "
              f"rounds {min(values):.2f} - {max(values):.2f})")


if __name__ == "__main__":
    main()
