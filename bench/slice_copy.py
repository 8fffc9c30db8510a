"""What a copy costs inside a Numba kernel: Numba's slice assignment (y[i:j] = x[k:l])
against an explicit loop (cgp.kernels.elementwise.copy), both compiled into one loop of
calls, for copies of a few sizes, one thread; prints nanoseconds per copy (best of --rounds
timings of --calls copies each).

    python bench/slice_copy.py [--rounds 21] [--calls 2000]
"""
import argparse
import time

import numpy as np
from numba import njit

from cgp.kernels.elementwise import copy


@njit(cache=True)
def _sliced(calls, x, y, n):
    for k in range(calls):
        y[k % 7:k % 7 + n] = x[:n]   # a moving offset: no copy is hoisted out of the loop


@njit(cache=True)
def _looped(calls, x, y, n):
    for k in range(calls):
        copy(x[:n], y[k % 7:k % 7 + n])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print("elements   slice assignment   loop (ns per copy)")
    for n in (16, 64, 256, 3200, 25000):
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        y = np.zeros(n + 8, np.float32)
        times = []
        for fn in (_sliced, _looped):
            fn(1, x, y, n)   # compile
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                fn(args.calls, x, y, n)
                best = min(best, (time.perf_counter() - start) / args.calls)
            times.append(best * 1e9)
        print(f"{n:8d} {times[0]:18.1f} {times[1]:8.1f}")


if __name__ == "__main__":
    main()
