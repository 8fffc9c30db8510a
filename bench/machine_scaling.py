"""The machine's own ceiling for 2-core speedup: one single-threaded, cache-resident SGEMM
loop alone, then two such processes at once. On a VM whose vCPUs share physical cores or
memory bandwidth, no parallel trainer can beat the ratio printed here.

    python bench/machine_scaling.py [--seconds 8] [--processes 2]
"""
import argparse
import subprocess
import sys

LOOP = """
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


def run(processes, seconds):
    procs = [subprocess.Popen([sys.executable, "-c", LOOP.format(seconds=seconds)],
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [int(p.communicate()[0]) for p in procs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    alone = run(1, args.seconds)[0]
    together = run(args.processes, args.seconds)
    print(f"one process: {alone} products; {args.processes} at once: {' + '.join(map(str, together))}")
    print(f"throughput ratio (the machine's ceiling for {args.processes} cores): "
          f"{sum(together) / alone:.2f}")


if __name__ == "__main__":
    main()
