"""Write a generated CIFAR-10 in the official binary format (cifar-10-batches-bin: five
training batches and a test batch), for timing cifar10_quick where the real data set is not
at hand (the development VM has no network; the README's cifar10_quick figures were measured
on such files). The images are the test suite's (cgp.tools.fake_data): classes a small net
can learn, on noise. Timing does not depend on the pixels, except where a net fits its data
and its gradients underflow (`--denormals`).

    python bench/fake_cifar10.py DIR [--per-batch 1000]

then pass `--data-dir DIR` to the cifar10 commands.
"""
import argparse

from cgp.tools.fake_data import write_cifar


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="folder to write cifar-10-batches-bin/ into")
    parser.add_argument("--per-batch", type=int, default=1000,
                        help="images per batch file (default 1000)")
    args = parser.parse_args(argv)
    if args.per_batch < 1:
        parser.error("--per-batch must be at least 1")
    return args


def main():
    args = parse_args()
    root = write_cifar(args.dir, per_batch=args.per_batch)
    print(f"wrote {6 * args.per_batch} generated images to {root / 'cifar-10-batches-bin'}")


if __name__ == "__main__":
    main()
