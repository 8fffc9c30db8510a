"""The machine's own ceiling for 2-core speedup: one single-threaded loop alone, then two
such processes at once. The loop is a cache-resident SGEMM (--workload sgemm), or cgp's own
single-threaded LeNet training step (--workload lenet): two independent processes share
nothing but the machine, so on a VM whose vCPUs share physical cores, caches or memory
bandwidth, no parallel trainer can beat the ratio printed here for that workload.

    python bench/machine_scaling.py [--workload sgemm|lenet] [--seconds 8] [--processes 2]
"""
import argparse
import subprocess
import sys

SGEMM = """
import time, numpy as np
from threadpoolctl import threadpool_limits
a = np.random.default_rng(0).random((512, 512), dtype=np.float32)
with threadpool_limits(limits=1):
    end, n = time.perf_counter() + {seconds}, 0
    while time.perf_counter() < end:
        a @ a
        n += 1
print(n)
"""

LENET = """
import time
from threadpoolctl import threadpool_limits
from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer
sp = read_solver(models.solver_path("mnist"))
sp.net = str(models.FOLDER / sp.net)
trainer = Trainer(sp, None, RunConfig(threads=1, progress=False), log=lambda line: None)
with threadpool_limits(limits=1):
    for _ in range(5):
        trainer.step()
    end, n = time.perf_counter() + {seconds}, 0
    while time.perf_counter() < end:
        trainer.step()
        n += 1
print(n)
"""
LOOPS = {"sgemm": (SGEMM, "products"), "lenet": (LENET, "LeNet iterations")}


def run(loop, processes, seconds):
    procs = [subprocess.Popen([sys.executable, "-c", loop.format(seconds=seconds)],
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [int(p.communicate()[0]) for p in procs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--workload", choices=sorted(LOOPS), default="sgemm")
    args = parser.parse_args()
    loop, unit = LOOPS[args.workload]
    alone = run(loop, 1, args.seconds)[0]
    together = run(loop, args.processes, args.seconds)
    print(f"one process: {alone} {unit}; {args.processes} at once: "
          f"{' + '.join(map(str, together))}")
    print(f"throughput ratio (the machine's ceiling for {args.processes} cores): "
          f"{sum(together) / alone:.2f}")


if __name__ == "__main__":
    main()
