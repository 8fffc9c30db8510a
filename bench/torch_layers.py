"""PyTorch's own time per operator and input shape for the training step that
`cgp bench speedup --compare torch` times (the same net, batch and momentum SGD, one thread,
from torch.profiler): the counterpart of `cgp time`'s per-layer table, to see which layers
PyTorch runs faster.

    python bench/torch_layers.py [mnist|cifar10] [--layout channels_last|contiguous]
                                 [--steps 10] [--rows 16] [--data-dir DIR]
"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from cgp import models, torch_ref
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="cifar10")
    parser.add_argument("--layout", default="channels_last", choices=torch_ref.LAYOUTS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    path = models.solver_path(args.model)
    data = Trainer(read_solver(path), path, RunConfig(threads=1, progress=False,
                                                      data_dir=args.data_dir), log=lambda l: None)
    try:
        net, n = data.net, data.net.batch_size
        torch.set_num_threads(1)
        trainer = torch_ref.TorchTrainer(net, data.sp, args.layout)
        batches = [data._batch(data.engine, i * n, i) for i in range(args.steps + 3)]
        for batch in batches[:3]:
            trainer.step(batch)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for batch in batches[3:]:
                trainer.step(batch)
    finally:
        data.close()
    ms = defaultdict(float)   # (operator, input shapes) -> self CPU ms per step
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = ", ".join(str(tuple(s)) for s in e.input_shapes if s)
        ms[(e.key, shapes)] += e.self_cpu_time_total / 1e3 / args.steps
    total = sum(ms.values())
    print(f"PyTorch {torch.__version__}, {args.model}, {args.layout}, 1 thread: "
          f"{total:.2f} ms of operators per step; self CPU ms per step:")
    for (name, shapes), t in sorted(ms.items(), key=lambda kv: -kv[1])[:args.rows]:
        print(f"  {t:8.2f}  {name:<40} {shapes}")


if __name__ == "__main__":
    main()
