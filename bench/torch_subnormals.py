"""PyTorch's training speed with subnormal floats kept (its default) and flushed to zero
(torch.set_flush_denormal(True), as cgp's --denormals flush): cgp's PyTorch copy of a net
(cgp.torch_ref) trains --warmup batches once, then the next --steps batches over and over,
one thread, each mode in a process of its own; prints images/s for each pass over them. Why
`cgp bench speedup --compare torch` gives PyTorch cgp's mode.

    python bench/torch_subnormals.py [mnist|cifar10_quick] [--warmup 5] [--passes 5]
                                     [--steps 10] [--data-dir DIR]
"""
import argparse
import subprocess
import sys
import time


def child(args):
    import torch

    from cgp import models, torch_ref
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig, Trainer

    torch.set_num_threads(1)
    torch_ref.flush_denormal(args.child == "flush")
    path = models.solver_path(args.model)
    trainer = Trainer(read_solver(path), path, RunConfig(threads=1, data_dir=args.data_dir),
                      log=lambda line: None)
    net = trainer.net
    copy = torch_ref.TorchTrainer(net, read_solver(path))
    batches = [trainer._batch(trainer.engine, i * net.batch_size, i)
               for i in range(args.warmup + args.steps)]
    for batch in batches[:args.warmup]:
        copy.step(batch)
    batches = batches[args.warmup:]
    rates = []
    for _ in range(args.passes):
        started = time.perf_counter()
        for batch in batches:
            copy.step(batch)
        rates.append(len(batches) * net.batch_size / (time.perf_counter() - started))
    trainer.close()
    print(f"{args.child:>7}: " + " ".join(f"{r:7.0f}" for r in rates))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="cifar10_quick")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--child", choices=("keep", "flush"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"{args.model}: PyTorch images/s per pass over {args.steps} batches, one thread")
    for mode in ("keep", "flush"):
        command = [sys.executable, __file__, args.model, "--warmup", str(args.warmup),
                   "--passes", str(args.passes), "--steps", str(args.steps), "--child", mode]
        if args.data_dir:
            command += ["--data-dir", args.data_dir]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
