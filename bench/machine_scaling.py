"""The machine's own ceiling for 2-core speedup: one single-threaded loop alone, then two
such loops at once. The loop is a cache-resident SGEMM (--workload sgemm), or cgp's own
single-threaded LeNet training step (--workload lenet), each copy with its own data.

With --in processes (the default) the copies share nothing but the machine, so on a VM whose
vCPUs share physical cores, caches or memory bandwidth, no parallel trainer can beat the
ratio printed here for that workload. With --in threads they run in threads of one process,
as cgp's workers do, and also share its interpreter lock and allocator: the gap between the
two is what running inside one process costs, before any engine design.

    python bench/machine_scaling.py [--workload sgemm|lenet] [--in processes|threads]
                                    [--seconds 8] [--copies 2]
"""
import argparse
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
LOOPS = {"sgemm": (SGEMM, "products"), "lenet": (LENET, "LeNet iterations")}


def run(workload, processes, copies_each, seconds):
    """Counts of every copy: `processes` processes, each running `copies_each` threads."""
    code = workload + DRIVER.format(copies=copies_each, seconds=seconds)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    return [int(n) for p in procs for n in p.communicate()[0].split()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--workload", choices=sorted(LOOPS), default="sgemm")
    parser.add_argument("--in", dest="within", choices=("processes", "threads"),
                        default="processes")
    args = parser.parse_args()
    workload, unit = LOOPS[args.workload]
    alone = run(workload, 1, 1, args.seconds)[0]
    if args.within == "processes":
        together = run(workload, args.copies, 1, args.seconds)
    else:
        together = run(workload, 1, args.copies, args.seconds)
    print(f"one copy: {alone} {unit}; {args.copies} at once in {args.within}: "
          f"{' + '.join(map(str, together))}")
    print(f"throughput ratio (the machine's ceiling for {args.copies} cores, copies in "
          f"{args.within}): {sum(together) / alone:.2f}")


if __name__ == "__main__":
    main()
