"""Peak device memory of training a zoo net, cgp against PyTorch, for bench/gpu_check.sh.

    python bench/gpu_memory.py NET.prototxt --batch 32 [--device gpu|numpy] [--iters 3]

cgp (--device gpu): the bytes CuPy's memory pool holds after --iters iterations (a pool
keeps what it freed, so this is its peak), and the bytes in use then. PyTorch (after cgp,
in the same process; its allocator is its own): torch.cuda.max_memory_allocated and
max_memory_reserved over as many iterations, with TF32 off. With --device numpy: cgp's
run on the host, nothing measured (the script's own check). One JSON line to stdout.
"""
import argparse
import json
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("net")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="gpu", choices=["gpu", "numpy"])
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)

    from cgp import cli
    from cgp.commands.timing import fill_inputs
    from cgp.tools.speedup import solver
    from cgp.train import RunConfig, Trainer
    bench_args = cli.build_parser().parse_args(["bench", "speedup", "--model", args.net,
                                                "--batch", str(args.batch)])
    path, sp = solver(bench_args, lambda line: None)
    trainer = Trainer(sp, path, RunConfig(device=args.device, progress=False),
                      log=lambda line: None)
    fill_inputs(trainer.net, trainer.seed)
    trainer.steps(args.iters)
    result = {"net": args.net, "batch": args.batch, "device": args.device,
              "iters": args.iters, "step": type(trainer.train_step).__name__}
    if args.device == "gpu":
        import cupy
        pool = cupy.get_default_memory_pool()
        result.update(cgp_pool_bytes=pool.total_bytes(), cgp_used_bytes=pool.used_bytes())
        result.update(torch_memory(trainer, sp, args.iters))
        if "torch_max_allocated" in result:
            result["cgp_over_torch"] = result["cgp_pool_bytes"] / result["torch_max_allocated"]
    print(json.dumps(result), flush=True)


def torch_memory(trainer, sp, iters):
    try:
        import torch
        from cgp.tools import torch_ref
    except ImportError as error:
        return {"torch": f"not measured: {error}"}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    net = trainer.net
    model = torch_ref.TorchTrainer(net, sp, "channels_last", "cuda")
    batch = {}
    for entry in net.sources:
        arrays = entry.layer.load(0, 0, trainer.seed)
        batch.update(zip(entry.tops, arrays))
    torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        model.step(batch)
    torch.cuda.synchronize()
    return {"torch_max_allocated": torch.cuda.max_memory_allocated(),
            "torch_max_reserved": torch.cuda.max_memory_reserved()}


if __name__ == "__main__":
    sys.exit(main())
