"""The speeds of the tile shapes (cgp.runtime.simd.SHAPES) in the convolution weight gradient,
where the kernels read them from SPEEDS_STRIDED to choose a shape: each shape forced in turn
on the stride-1 convolutions of the shipped nets (bench/kernel_ab.py's LAYERS), one thread.

    python bench/tile_speeds.py [--layers lenet2,cifar3] [--samples 12] [--rounds 30]

For each layer, prints per shape the backward pass without the input gradient (weight and
bias gradients) in ms per 100 samples, its speed relative to the shape the working tree
chooses (*; < marks the fastest), the multiply-adds of its padded tiles, (Cg*S rounded up to
T) * (Kg rounded up to KV vectors), relative to (8, 2)'s, and its speed per padded
multiply-add relative to (8, 2) (medians of the per-round ratios). Then the median of that
last speed over the layers where the shape's padded work is within 5 % of (8, 2)'s: what
SPEEDS_STRIDED models. (Where the two differ more, the work around the tiles, the same for
every shape, blurs the speed per multiply-add: it flatters the shape that pads more.) Every
shape gives the same bits (checked).

Each shape runs from a copy of kernels/conv.py, in a temporary folder, whose weight gradient
takes that shape instead of choosing; the rounds rotate which shape goes first, so that a
shape never always runs just after another's data left the caches.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from threadpoolctl import threadpool_limits

from cgp.kernels import conv
from cgp.runtime.simd import SHAPES, choose, lanes
from kernel_ab import LAYERS, runs  # bench/, on the path when run as a script

# The line of kernels/conv.py that chooses the weight gradient's shape.
CHOICE = "    T_w, KV_w = choose(Cg * S, Kg, V, False)\n"
V = lanes(4)  # float32, as kernel_ab.runs makes the data


def forced_modules(folder):
    """{(T, KV): a copy of cgp.kernels.conv whose weight gradient always takes (T, KV)}."""
    source = Path(conv.__file__).read_text()
    if source.count(CHOICE) != 1:
        sys.exit(f"tile_speeds: kernels/conv.py no longer has the line {CHOICE.strip()!r}; "
                 f"update CHOICE")
    sys.path.insert(0, str(folder))
    modules = {}
    for T, KV in SHAPES:
        name = f"conv_w{T}x{KV}"
        (folder / f"{name}.py").write_text(source.replace(CHOICE, f"    T_w, KV_w = {T}, {KV}\n"))
        modules[T, KV] = __import__(name)
    return modules


def padded_work(shape, T, KV):
    """Multiply-adds per position of the weight gradient's tiles of shape (T, KV)."""
    C, H, W, K, R, S, pad = shape
    return -(-C * S // T) * T * -(-K // (KV * V)) * KV * V


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--samples", type=int, default=12, help="samples per call")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=5, help="calls per shape per round")
    args = parser.parse_args()
    layers = args.layers.split(",")
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        parser.error(f"unknown layers {unknown}; known: {', '.join(LAYERS)}")
    relative = {shape: [] for shape in SHAPES}
    with tempfile.TemporaryDirectory() as folder, threadpool_limits(1):
        modules = forced_modules(Path(folder))
        print(f"weight gradient (backward without the input gradient), {args.samples} samples "
              f"per call, {args.rounds} rounds; ms per 100 samples, speed relative to the "
              f"chosen shape (*; < fastest), padded work and speed per padded multiply-add "
              f"relative to (8, 2)")
        for name in layers:
            shape = LAYERS[name]
            C, H, W, K, R, S, pad = shape
            calls = {s: runs(m, shape, args.samples)["backward, no dx"] for s, m in modules.items()}
            results = {s: call() for s, call in calls.items()}
            first = results[SHAPES[0]]
            if any((r != first).any() for r in results.values()):
                sys.exit(f"tile_speeds: {name}: the shapes gave different bits")
            times = {s: [] for s in SHAPES}
            for i in range(args.rounds):
                for s in SHAPES[i % len(SHAPES):] + SHAPES[:i % len(SHAPES)]:
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        calls[s]()
                    times[s].append((time.perf_counter() - started) / args.calls)
            chosen = tuple(choose(C * S, K, V, False))
            fastest = min(SHAPES, key=lambda s: statistics.median(times[s]))
            for s in SHAPES:
                work = padded_work(shape, *s) / padded_work(shape, 8, 2)
                speed = statistics.median(work * a / b for a, b in zip(times[8, 2], times[s]))
                if abs(work - 1) <= 0.05:
                    relative[s].append(speed)
                layer = statistics.median(a / b for a, b in zip(times[chosen], times[s]))
                ms = 1e5 * statistics.median(times[s]) / args.samples
                print(f"  {name:7s} ({s[0]:2d}, {s[1]})  {ms:7.2f} ms  x{layer:5.3f}"
                      f"{' *' if s == chosen else '  '}{' <' if s == fastest else '  '}"
                      f"  padded work {work:4.2f}  speed {speed:5.3f}")
    print("speed per padded multiply-add, median over the layers where it pads within 5 % of "
          "(8, 2): " + ", ".join(
              f"({s[0]}, {s[1]}) {statistics.median(relative[s]):.3f} ({len(relative[s])})"
              if relative[s] else f"({s[0]}, {s[1]}) -" for s in SHAPES))


if __name__ == "__main__":
    main()
