"""Depthwise convolution speed: cgp's Convolution layer with group = channels (MobileNet's
3 x 3 depthwise layers) against a dense 3 x 3 convolution of equal multiply-adds (input times
output channels = the depthwise layer's channels, the same image) and against PyTorch's
conv2d(groups=C), one thread, calls of --samples samples. Prints per layer and pass
(forward; backward with the weight and input gradients) the median milliseconds of --rounds
rounds, each of which runs every side once in turn, and the GFLOP/s (2 flops per
multiply-add).

    python bench/depthwise.py [--layers dw32,dw512] [--samples 4] [--rounds 11] [--no-torch]

cgp runs through the layer's bound kernel calls (forward_calls / backward_calls), as the
engine makes them; PyTorch through autograd on a kept graph (the backward kernels alone),
in whichever memory format (NCHW or channels_last) is faster for the layer.
"""
import argparse
import time

import numpy as np
from google.protobuf import text_format
from threadpoolctl import threadpool_limits

from cgp.layers import REGISTRY, Chunk, alloc_scratch
from cgp.proto import caffe_pb2
from cgp.runtime.memory import aligned_zeros

# name: (C, H, W, stride): MobileNet v1's depthwise layers (3 x 3, pad 1, group C).
LAYERS = {"dw32": (32, 112, 112, 1), "dw64s2": (64, 112, 112, 2), "dw128": (128, 56, 56, 1),
          "dw128s2": (128, 56, 56, 2), "dw256": (256, 28, 28, 1), "dw512": (512, 14, 14, 1),
          "dw512s2": (512, 14, 14, 2), "dw1024": (1024, 7, 7, 1)}


def dense_channels(C):
    """(input, output) channels of a dense convolution with C multiply-adds per position and
    tap, as near square as C allows."""
    cin = int(np.sqrt(C))
    while C % cin:
        cin -= 1
    return cin, C // cin


def layer(C, H, W, K, stride, group):
    lp = text_format.Parse(
        f'name: "l" type: "Convolution" bottom: "x" top: "y" convolution_param {{ '
        f'num_output: {K} kernel_size: 3 pad: 1 stride: {stride} group: {group} }}',
        caffe_pb2.LayerParameter())
    conv = REGISTRY["Convolution"](lp)
    conv.top_shapes = conv.setup([(1, C, H, W)])
    return conv


def cgp_calls(conv, C, H, W, n, rng):
    """(forward, backward) as functions that make the layer's bound kernel calls."""
    shape = conv.top_shapes[0]
    x = aligned_zeros((n, C, H, W), np.float32)
    x[...] = rng.standard_normal(x.shape)
    y = aligned_zeros((n,) + shape[1:], np.float32)
    dy = aligned_zeros(y.shape, np.float32)
    dy[...] = rng.standard_normal(dy.shape)
    dx = aligned_zeros(x.shape, np.float32)
    params = [aligned_zeros(s, np.float32) for s in conv.param_shapes()]
    for p in params:
        p[...] = rng.standard_normal(p.shape) * 0.1
    grads = [aligned_zeros((1,) + s, np.float32) for s in conv.param_shapes()]
    scratch = alloc_scratch(conv, n, np.float32)
    chunk = Chunk(n=n)
    fwd = list(conv.forward_calls([x], [y], params, scratch, chunk))
    bwd = list(conv.backward_calls([y], [dy], [x], [dx], params, grads, scratch, chunk))

    def run(calls):
        def call():
            for kernel, args in calls:
                kernel(*args)
        return call
    return run(fwd), run(bwd)


def torch_calls(C, H, W, K, stride, group, n, rng, channels_last):
    import torch
    import torch.nn.functional as F
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.from_numpy(rng.standard_normal((n, C, H, W)).astype(np.float32))
    x = x.contiguous(memory_format=fmt).requires_grad_(True)
    w = torch.from_numpy((rng.standard_normal((K, C // group, 3, 3)) * 0.1).astype(np.float32))
    w = w.contiguous(memory_format=fmt).requires_grad_(True)
    b = torch.zeros(K, requires_grad=True)
    y = F.conv2d(x, w, b, stride=stride, padding=1, groups=group)
    dy = torch.from_numpy(rng.standard_normal(tuple(y.shape)).astype(np.float32))
    dy = dy.contiguous(memory_format=fmt)

    def forward():
        with torch.no_grad():
            F.conv2d(x, w, b, stride=stride, padding=1, groups=group)

    def backward():
        torch.autograd.grad(y, [x, w, b], dy, retain_graph=True)
    return forward, backward


def median_ms(fn, rounds):
    return interleaved_ms({"": fn}, rounds)[""]


def interleaved_ms(fns, rounds):
    """{name: median milliseconds}: each round calls every function once, in turn, so that
    a change of the machine's speed (other programs) hits all alike."""
    for fn in fns.values():
        fn()   # compile, warm the caches
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    if not args.no_torch:
        import torch
        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n = args.samples
    print(f"{'layer':>8} {'pass':>8} {'cgp dw ms':>10} {'GF/s':>6} {'dense ms':>9} {'GF/s':>6}"
          + ("" if args.no_torch else f" {'torch ms':>9} {'GF/s':>6} {'cgp/torch':>9}"))
    with threadpool_limits(limits=1):
        for name in args.layers.split(","):
            C, H, W, stride = LAYERS[name]
            cin, cout = dense_channels(C)
            depthwise = layer(C, H, W, C, stride, C)
            P, Q = depthwise.top_shapes[0][2:]
            flops = 2 * n * C * P * Q * 9
            sides = {"dw": cgp_calls(depthwise, C, H, W, n, rng),
                     "dense": cgp_calls(layer(cin, H, W, cout, stride, 1), cin, H, W, n, rng)}
            if not args.no_torch:
                sides["torch"] = max(
                    (torch_calls(C, H, W, C, stride, C, n, rng, last) for last in (False, True)),
                    key=lambda calls: -median_ms(calls[0], 3) - median_ms(calls[1], 3))
            for i, what in enumerate(("forward", "backward")):
                # Backward makes two passes' multiply-adds (weight and input gradients).
                work = flops * (2 if i else 1) / 1e9
                ms = interleaved_ms({side: calls[i] for side, calls in sides.items()},
                                    args.rounds)
                row = f"{name:>8} {what:>8} {ms['dw']:10.2f} {work / ms['dw'] * 1e3:6.1f} " \
                      f"{ms['dense']:9.2f} {work / ms['dense'] * 1e3:6.1f}"
                if "torch" in ms:
                    row += (f" {ms['torch']:9.2f} {work / ms['torch'] * 1e3:6.1f}"
                            f" {ms['dw'] / ms['torch']:9.2f}")
                print(row, flush=True)


if __name__ == "__main__":
    main()
