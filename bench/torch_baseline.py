"""Is `cgp bench speedup --compare torch` fair to PyTorch? Times its PyTorch side (the training
loop of cgp.tools.speedup.torch_config on cgp.tools.torch_ref.TorchTrainer, exactly as the
comparison runs it) against an independent minimal loop that a PyTorch user writes for LeNet
(nn.Sequential, F.cross_entropy, torch.optim.SGD with Caffe's lr_mult 2 on biases, momentum and
weight decay; random data of the same shape made beforehand; torch.set_num_threads and
nothing else), in one process, interleaved round by round in rotated order, for each memory
format. Prints each loop's median images/s and the median of the rounds' ratios (comparison
over minimal: 1.00 is fair; below 0.95 the comparison handicaps PyTorch).

tests/test_bench.py checks that both loops do the same work: the same parameters, bit for bit,
after the same steps from the same weights and data (minimal_lenet and minimal_step below).

    python bench/torch_baseline.py --threads 1 --iters 50 --rounds 11 [--clock cpu]

On a loaded machine the wall-clock rounds swing by 2x; --clock cpu times one thread by its
CPU time instead, which the neighbours hardly change.
"""
import argparse
import copy
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn



def minimal_lenet(layout):
    """LeNet as a PyTorch user writes it (Caffe's examples/mnist, its ceil-mode pooling equal
    to PyTorch's floor mode at these sizes), and its optimizer: Caffe's lenet_solver."""
    model = nn.Sequential(nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2), nn.Conv2d(20, 50, 5),
                          nn.MaxPool2d(2, 2), nn.Flatten(), nn.Linear(800, 500),
                          nn.ReLU(inplace=True), nn.Linear(500, 10))
    model = model.to(memory_format=memory_format(layout))
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    optimizer = torch.optim.SGD([dict(params=weights, lr=0.01), dict(params=biases, lr=0.02)],
                                lr=0.01, momentum=0.9, weight_decay=0.0005)
    return model, optimizer


def memory_format(layout):
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def minimal_step(model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    return loss


class Minimal:
    """The minimal loop over one random batch made beforehand, as a timed configuration
    (cgp.tools.speedup.Config): every timing trains the same steps from the same state."""

    def __init__(self, layout, batch, seed):
        torch.manual_seed(seed)
        self.model, self.optimizer = minimal_lenet(layout)
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand((batch, 1, 28, 28), generator=generator).contiguous(
            memory_format=memory_format(layout))
        self.labels = torch.randint(0, 10, (batch,), generator=generator)
        self.saved = None

    def run(self, iterations):
        for _ in range(iterations):
            minimal_step(self.model, self.optimizer, self.images, self.labels)

    def save(self):
        self.saved = copy.deepcopy((self.model.state_dict(), self.optimizer.state_dict()))

    def restore(self):
        self.model.load_state_dict(self.saved[0])
        self.optimizer.load_state_dict(self.saved[1])


def plain_threads(threads):
    """The minimal loop's one setting: its thread count."""
    @contextmanager
    def context():
        torch.set_num_threads(threads)
        yield
    return context


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--iters", type=int, default=50, help="steps per timing (default 50)")
    parser.add_argument("--rounds", type=int, default=11, help="timings of each loop (default 11)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--lead-in", type=int, default=3,
                        help="untimed steps before each timing (default 3), as speedup's")
    parser.add_argument("--layouts", default="channels_last,contiguous",
                        help="memory formats (default channels_last,contiguous)")
    parser.add_argument("--data-dir", default=None, help="MNIST folder (default: the bundled)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: speedup's own interleaved timing; cpu (one thread only): "
                             "the calling thread's CPU time, which PyTorch's one-thread ops "
                             "run in, and which other programs on a loaded machine hardly "
                             "change (the rates are then images per CPU second)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu times one thread: give --threads 1")

    from cgp.models import solver_path
    from cgp.prototxt import read_solver
    from cgp.tools import torch_ref
    from cgp.tools.speedup import Config, interleaved, torch_config
    from cgp.train import RunConfig, Trainer

    path = str(solver_path("mnist"))
    sp = read_solver(path)
    data = Trainer(sp, path, RunConfig(data_dir=args.data_dir, progress=False,
                                       workers="threads"), log=lambda line: None)
    batch = data.net.batch_size
    configs = []
    for layout in args.layouts.split(","):
        configs.append(torch_config(torch_ref, args.threads, layout,
                                    torch_ref.TorchTrainer(data.net, sp, layout), data,
                                    lead_in=args.lead_in))
        configs[-1].impl = "comparison"
        minimal = Minimal(layout, batch, seed=1701)
        configs.append(Config("minimal", args.threads, layout, run=minimal.run,
                              context=plain_threads(args.threads), save=minimal.save,
                              restore=minimal.restore))
    print(f"PyTorch {torch.__version__}, {args.threads} thread(s), LeNet batch {batch}, "
          f"{args.rounds} rounds of {args.lead_in} untimed + {args.iters} steps, interleaved")
    try:
        interleaved(configs, args.iters, args.rounds, args.warmup, batch, print,
                    lead_in=args.lead_in,
                    clock=time.thread_time if args.clock == "cpu" else time.perf_counter)
    finally:
        data.close()
    for c in configs:
        print(f"{c.impl + '/' + c.layout:>26}: {statistics.median(c.rates):8.0f} images/s "
              f"({min(c.rates):.0f} - {max(c.rates):.0f})")
    for comparison, minimal in zip(configs[::2], configs[1::2]):
        ratios = [a / b for a, b in zip(comparison.rates, minimal.rates)]
        print(f"comparison / minimal, {minimal.layout}: median of rounds "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f})")


if __name__ == "__main__":
    main()
