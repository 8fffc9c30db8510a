"""What a pool run costs apart from its work: the median wall time of a run whose tasks, one
per worker, do nothing but wait until every worker has taken one (in compiled code that
holds no interpreter lock), on the thread Pool and on the ProcessPool (cgp/engine.py,
cgp/procs.py): the runs back to back, as a training step's phases follow each other (the
workers watching memory between them), and after rest() (the workers asleep, woken by the
run). A training step makes three runs (the calls, the reduction, the update), so three times
the first figure is what the hand-overs add to a step.

    python bench/handover.py [--workers 2] [--runs 2000] [--rounds 7]
"""
import argparse
import statistics
import time

from cgp.engine import Pool
from cgp.runtime import spin
from cgp.layers import aligned_zeros
from cgp.procs import ProcessPool


def meeting(arrived, workers):
    """A program whose tasks wait until `workers` tasks of the run have started: arrived[0]
    counts arrivals over all runs, so run r (from 1) ends at r * workers."""
    def task(w, i, run):
        spin.fetch_add(arrived, 0, 1)
        spin.wait_for(arrived, 0, run * workers, 1 << 40)
    return task


def per_run(pool, program, workers, runs, rest, counter):
    """Median over `runs` runs of one run's wall time, in microseconds."""
    times = []
    for _ in range(runs):
        if rest:
            pool.rest()
        counter[0] += 1
        started = time.perf_counter()
        pool.run(program, workers, counter[0])
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    pools = {"threads": Pool(args.workers), "processes": ProcessPool(args.workers)}
    arrived = {kind: aligned_zeros(1, "int64", shared=True) for kind in pools}
    counters = {kind: [0] for kind in pools}
    programs = {kind: pool.program(meeting(arrived[kind], args.workers))
                for kind, pool in pools.items()}
    for pool in pools.values():
        pool.start()
    results = {(kind, rest): [] for kind in pools for rest in (False, True)}
    try:
        for _ in range(args.rounds):   # interleaved, so the machine's swings hit all alike
            for kind, pool in pools.items():
                for rest in (False, True):
                    runs = args.runs if not rest else max(1, args.runs // 10)
                    results[kind, rest].append(per_run(pool, programs[kind], args.workers,
                                                       runs, rest, counters[kind]))
                pool.rest()
    finally:
        for pool in pools.values():
            pool.close()
    print(f"{args.workers} workers, runs of one waiting task per worker, median of "
          f"{args.rounds} rounds (spread):")
    for (kind, rest), values in results.items():
        print(f"  {kind:<9}  {'after rest()' if rest else 'back to back':<12}  "
              f"{statistics.median(values):8.1f} us per run  "
              f"({min(values):.1f} - {max(values):.1f})")


if __name__ == "__main__":
    main()
