"""What grouped execution buys: training steps with 1, 2, 4, ... chunks per layer call (the
same bits for every setting), the settings interleaved round by round in one process, so a
change of the machine's speed hits them all alike. Prints each setting's median step time and
its speed relative to the first setting, as the median of the per-round ratios.

    python bench/grouping.py [mnist|cifar10] [--threads 1] [--groups 1,2,4,8,auto]
                             [--rounds 9] [--steps 15] [--data-dir DIR]

"auto" is the engine's default (cgp.engine.group_size).
"""
import argparse
import statistics

from interleave import grouped_trainer, interleaved_rounds  # bench/, on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--groups", default="1,2,4,8,auto")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    groups = [None if g == "auto" else int(g) for g in args.groups.split(",")]
    trainers = [grouped_trainer(args.model, args.threads, g, args.data_dir, workers="threads")
                for g in groups]
    times = [[seconds / args.steps for seconds in row]
             for row in interleaved_rounds(trainers, args.rounds, args.steps)]
    print(f"{args.model}, {args.threads} thread(s), {len(trainers[0].engine.bounds)} chunks, "
          f"{args.rounds} rounds of {args.steps} steps")
    for g, t, row in zip(groups, trainers, times):
        ratio = statistics.median(a / b for a, b in zip(times[0], row))
        name = "auto" if g is None else str(g)
        print(f"  group {name:>4} ({max(c1 - c0 for c0, c1 in t.engine.groups)} chunks per call, "
              f"{len(t.engine.groups)} calls): {1e3 * statistics.median(row):7.2f} ms per step, "
              f"{ratio:.3f}x the first")
        t.close()


if __name__ == "__main__":
    main()
