"""How finely a batch is cut on many workers: training steps of several (threads, chunks,
chunks per call) settings, worker processes, interleaved round by round in one process. On
16 workers with the default 16 chunks each worker makes one call per step and the step waits
for the slowest (bench/process_phases.py --timeline); more chunks than workers, in calls of
one or two, let a worker that finishes early take another, at the cost of smaller calls.
The chunk count changes the results (it fixes the sums' order), the calls never do: every
setting prints its images/s, and its speedup over the 1-thread setting of its chunk count
(the median of the per-round ratios) where there is one.

    python bench/granularity.py [mnist|cifar10_quick] [--configs 1:16:auto,16:16:auto,...]
                                [--rounds 11] [--steps 20] [--data-dir DIR]

A setting is THREADS:CHUNKS:GROUP, GROUP chunks per call or "auto" (cgp.engine.group_size).
"""
import argparse
import statistics

from interleave import grouped_trainer, interleaved_rounds  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--configs", default="1:16:auto,16:16:auto,1:64:auto,16:64:1,16:64:2")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    configs = []
    for text in args.configs.split(","):
        threads, chunks, group = text.split(":")
        configs.append((int(threads), int(chunks), None if group == "auto" else int(group)))
    trainers = [grouped_trainer(args.model, t, g, args.data_dir, chunks=c)
                for t, c, g in configs]
    times = interleaved_rounds(trainers, args.rounds, args.steps)
    images = trainers[0].net.batch_size * args.steps
    print(f"{args.model}: {args.rounds} rounds of {args.steps} steps, worker processes")
    for (t, c, g), tr, row in zip(configs, trainers, times):
        calls = len(tr.engine.groups)
        line = (f"  {t:>2} threads, {c:>3} chunks, {calls:>3} calls of "
                f"{max(c1 - c0 for c0, c1 in tr.engine.groups)} chunk(s) "
                f"({'auto' if g is None else g}): {images / statistics.median(row):8.0f} img/s")
        base = [k for k, (t1, c1, _) in enumerate(configs) if t1 == 1 and c1 == c]
        if t > 1 and base:
            ratio = statistics.median(a / b for a, b in zip(times[base[0]], row))
            line += f", speedup {ratio:.2f} over 1 thread"
        print(line)
    for tr in trainers:
        tr.close()


if __name__ == "__main__":
    main()
