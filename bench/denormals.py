"""Step time as training goes on, with subnormal floats flushed to zero or kept (IEEE): once
a net fits its data, gradients underflow into the subnormal range, where x86 arithmetic is
many times slower. One thread, the given model, blocks of 10 steps.

    python bench/denormals.py [cifar10] [--denormals keep|flush] [--blocks 12] [--data-dir DIR]
"""
import argparse
import time

from threadpoolctl import threadpool_limits

from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="cifar10")
    parser.add_argument("--denormals", choices=("flush", "keep"), default="keep")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    # Trainer resolves the solver's net relative to the solver file.
    path = models.solver_path(args.model)
    config = RunConfig(progress=False, data_dir=args.data_dir, denormals=args.denormals)
    trainer = Trainer(read_solver(path), path, config, log=lambda line: None)
    print(f"{args.model}, 1 thread, subnormals {args.denormals}")
    with threadpool_limits(limits=1):
        for block in range(args.blocks):
            started = time.perf_counter()
            for _ in range(10):
                loss = trainer.step()[0]
            step = (time.perf_counter() - started) / 10
            print(f"  iterations {10 * block:4d}-{10 * block + 9:4d}: {1e3 * step:7.1f} ms per "
                  f"step, loss {loss:.4g}")
    trainer.close()


if __name__ == "__main__":
    main()
