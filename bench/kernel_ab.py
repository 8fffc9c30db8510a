"""Interleaved A/B of the kernels against another git revision: the stride-1 convolutions of
LeNet and cifar10_quick (forward, backward without and with the input gradient), the pooling
of both (forward, backward), their first InnerProduct (forward, input gradient, and the
weight gradient where the engine does not factor it: weights shared by several layers), the
reduction of the InnerProduct weight gradients that the engine sums from factors (LeNet's ip1,
cifar10_quick's ip1: 16 chunks of the whole batch), and cifar10_full's LRN layers (forward,
backward; and one across channels), one thread. Each round times the base
revision's kernel and then the working tree's on the same data, so a change of the machine's
speed hits both alike; prints milliseconds per 100 samples (medians; per batch for the
reductions), the working tree's speed as the median of the per-round ratios, and whether the
two gave the same bits.

    python bench/kernel_ab.py --base REV [--layers cifar2,cifar3,pool2,ip1sum] [--samples 12]
                              [--rounds 60] [--clock cpu]

--clock cpu times each call by the calling thread's CPU time (every kernel here runs on that
thread, PyTorch on one thread too): on a loaded machine a wall-clock call also counts the
time the thread waited for a core, which moved single calls by up to 5x on the shared 2-core
VM.

The base revision's files (BASE_FILES: the kernels and the runtime modules they import) are
taken with `git show` into a temporary folder and imported from there, each importing the
others' copies (the rest of the package is the working tree's); REV may also be a folder that
holds a revision's files at their paths (a checkout, or `git archive REV | tar -x -C DIR`).
`--base torch` times PyTorch's convolution instead (1 thread, channels_last, the
same data: forward, and the backward kernels alone, through autograd on a kept graph; its
results left in its layout, as training leaves them), for convolution and BatchNorm rows
only, and prints how far the results differ rather than whether the bits are the same (the
working tree's parts added up, as PyTorch sums the whole call).
`--torch-samples N` gives PyTorch calls of N samples (as it trains: the whole batch at once)
while cgp keeps `--samples` (its engine's calls); the results are then not compared.
`--layers resnet50` times each distinct convolution of ResNet-50 (1x1, 3x3, the 1x1 stride-2
and the 7x7 stride-2 ones) and each distinct BatchNorm + Scale pair (batch statistics: the
sums, the normalisation and the Scale with its bias, against PyTorch's fused batch_norm with
--base torch), then the totals per kind of layer over the whole net, each distinct layer
counted as often as the net has it, each pass as training runs it (the first convolution
without the input gradient).
Every array starts on a cache line, and scratch starts zeroed, as the engine allocates them:
an operand that straddles cache lines runs at another speed, and uninitialised memory may
hold subnormal floats, which tiles read in lanes they never store and which then slow every
multiply-add.
"""
import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

# The working tree's kernels, and where the base revision's are, with the modules they import
# (in import order: each file may import those before it). Where a module moves, both change:
# before 9287f70, simd.py and reduce.py were kernels/tile.py and kernels/reduce.py.
from cgp.engine import chunk_bounds
from cgp.layers.conv import gemm_faster
from cgp.kernels import batchnorm, conv, fc, lrn, pool, scale as broadcast
from cgp.runtime import reduce
from cgp.runtime.memory import aligned_zeros

BASE_FILES = {"simd": "cgp/runtime/simd.py", "elementwise": "kernels/elementwise.py",
              "conv": "kernels/conv.py", "pool": "kernels/pool.py",
              "reduce": "cgp/runtime/reduce.py", "fc": "kernels/fc.py", "lrn": "kernels/lrn.py"}
# Imported only where BatchNorm rows are asked for: revisions before them lack the files.
NORM_FILES = {"batchnorm": "kernels/batchnorm.py", "scale": "kernels/scale.py"}
ROOT = Path(__file__).resolve().parent.parent

# name: (C, H, W, K, R, S, pad, stride): the stride-1 convolutions of the shipped nets.
LAYERS = {"lenet1": (1, 28, 28, 20, 5, 5, 0, 1), "lenet2": (20, 12, 12, 50, 5, 5, 0, 1),
          "cifar1": (3, 32, 32, 32, 5, 5, 2, 1), "cifar2": (32, 16, 16, 32, 5, 5, 2, 1),
          "cifar3": (32, 8, 8, 64, 5, 5, 2, 1)}
# ResNet-50 (the zoo's deploy net at 224 x 224): each distinct convolution, named after its
# first layer, as in LAYERS, and how many layers of the net have its shape.
RESNET50 = {"conv1": ((3, 224, 224, 64, 7, 7, 3, 2), 1),
            "res2a_branch1": ((64, 56, 56, 256, 1, 1, 0, 1), 1),
            "res2a_branch2a": ((64, 56, 56, 64, 1, 1, 0, 1), 1),
            "res2a_branch2b": ((64, 56, 56, 64, 3, 3, 1, 1), 3),
            "res2a_branch2c": ((64, 56, 56, 256, 1, 1, 0, 1), 3),
            "res2b_branch2a": ((256, 56, 56, 64, 1, 1, 0, 1), 2),
            "res3a_branch1": ((256, 56, 56, 512, 1, 1, 0, 2), 1),
            "res3a_branch2a": ((256, 56, 56, 128, 1, 1, 0, 2), 1),
            "res3a_branch2b": ((128, 28, 28, 128, 3, 3, 1, 1), 4),
            "res3a_branch2c": ((128, 28, 28, 512, 1, 1, 0, 1), 4),
            "res3b_branch2a": ((512, 28, 28, 128, 1, 1, 0, 1), 3),
            "res4a_branch1": ((512, 28, 28, 1024, 1, 1, 0, 2), 1),
            "res4a_branch2a": ((512, 28, 28, 256, 1, 1, 0, 2), 1),
            "res4a_branch2b": ((256, 14, 14, 256, 3, 3, 1, 1), 6),
            "res4a_branch2c": ((256, 14, 14, 1024, 1, 1, 0, 1), 6),
            "res4b_branch2a": ((1024, 14, 14, 256, 1, 1, 0, 1), 5),
            "res5a_branch1": ((1024, 14, 14, 2048, 1, 1, 0, 2), 1),
            "res5a_branch2a": ((1024, 14, 14, 512, 1, 1, 0, 2), 1),
            "res5a_branch2b": ((512, 7, 7, 512, 3, 3, 1, 1), 3),
            "res5a_branch2c": ((512, 7, 7, 2048, 1, 1, 0, 1), 3),
            "res5b_branch2a": ((2048, 7, 7, 512, 1, 1, 0, 1), 2)}
# name: ((C, H, W), count): ResNet-50's BatchNorm + Scale pairs (one after each convolution,
# Scale with a bias term), by shape.
BATCHNORMS = {"bn-64x112": ((64, 112, 112), 1), "bn-64x56": ((64, 56, 56), 6),
              "bn-256x56": ((256, 56, 56), 4), "bn-128x28": ((128, 28, 28), 8),
              "bn-512x28": ((512, 28, 28), 5), "bn-256x14": ((256, 14, 14), 12),
              "bn-1024x14": ((1024, 14, 14), 7), "bn-512x7": ((512, 7, 7), 6),
              "bn-2048x7": ((2048, 7, 7), 4)}
BN_EPS = 1e-5
# name: (C, H, W, window, stride, MAX or AVE): cifar10_quick's pooling (3 x 3, stride 2, CEIL)
# and LeNet's (2 x 2, stride 2).
POOLS = {"pool1": (32, 32, 32, 3, 2, "MAX"), "pool2": (32, 16, 16, 3, 2, "AVE"),
         "pool3": (64, 8, 8, 3, 2, "AVE"), "lenet-pool1": (20, 24, 24, 2, 2, "MAX"),
         "lenet-pool2": (50, 8, 8, 2, 2, "MAX")}
# name: (inputs, outputs): the first InnerProduct of LeNet and of cifar10_quick.
INNER = {"ip1": (800, 500), "cifar-ip1": (1024, 64)}
# name: (batch, J, L): a factored weight gradient's shape, summed over 16 chunks.
REDUCTIONS = {"ip1sum": (64, 500, 800), "cifar-ip1sum": (100, 64, 1024)}
# name: (C, H, W, local_size, region): cifar10_full's LRN layers (alpha 5e-05, beta 0.75), and
# one across channels of the same size (the shipped nets have none).
NORMS = {"norm1": (32, 16, 16, 3, "WITHIN"), "norm2": (32, 8, 8, 3, "WITHIN"),
         "norm-across": (32, 16, 16, 5, "ACROSS")}
NORM_ALPHA, NORM_BETA = 5e-5, 0.75
CONVS = dict(LAYERS, **{name: shape for name, (shape, _) in RESNET50.items()})
KNOWN = (list(CONVS) + list(POOLS) + list(INNER) + list(REDUCTIONS) + list(NORMS)
         + list(BATCHNORMS))
# --layers resnet50: every ResNet-50 row, and the totals over the net.
GROUPS = {"resnet50": list(RESNET50) + list(BATCHNORMS)}


def kind(name):
    """The kind of layer a ResNet-50 row counts toward in the totals."""
    if name in BATCHNORMS:
        return "BatchNorm+Scale"
    C, H, W, K, R, S, pad, stride = CONVS[name]
    return f"conv {R}x{S}" + (f" stride {stride}" if stride > 1 else "")


def base_modules(rev, folder):
    """The revision's conv, pool, reduce, fc and lrn kernels, importing its own simd and
    elementwise (BASE_FILES), as modules base_conv, base_pool, base_reduce, base_fc and
    base_lrn."""
    m = import_revision(rev, BASE_FILES, folder)
    return m["conv"], m["pool"], m["reduce"], m["fc"], m["lrn"]


def import_revision(rev, files, folder):
    """The modules in `files` ({name: path from the repository root}) as of git revision
    `rev`, or as they are in folder `rev`, imported in that order from copies in `folder` as
    base_<name>. A copy's imports of the others (`from cgp.runtime.simd import`) are
    rewritten to the copies, so the revision's modules use each other, not the working
    tree's. Returns {name: module}; raises subprocess.CalledProcessError, with git's
    message, where git has no such file (OSError where the folder has none)."""
    sys.path.insert(0, str(folder))
    # kernels/x.py is installed as cgp.kernels.x, cgp/x/y.py is cgp.x.y.
    dotted = {name: "cgp." + path[:-len(".py")].replace("/", ".").removeprefix("cgp.")
              for name, path in files.items()}
    modules = {}
    for name, path in files.items():
        if Path(rev).is_dir():
            text = (Path(rev) / path).read_text()
        else:
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
        for other in files:
            text = text.replace(f"from {dotted[other]} import", f"from base_{other} import")
        copy = Path(folder) / f"base_{name}.py"
        copy.write_text(text)
        spec = importlib.util.spec_from_file_location(f"base_{name}", copy)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"base_{name}"] = module   # for the copies that import it
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def normal(rng, shape):
    """Standard normal float32 values in an array that starts on a cache line."""
    out = aligned_zeros(shape, np.float32)
    out[...] = rng.standard_normal(shape)
    return out


def runs(module, shape, n, seed=0):
    """The three calls of one layer with the module's kernels, each returning its result:
    the direct kernels at stride 1, im2col's and BLAS (conv_forward, conv_backward) at others
    and where the working tree's Convolution layer takes them at stride 1 (gemm_faster)."""
    C, H, W, K, R, S, pad, stride = shape
    rng = np.random.default_rng(seed)
    x, w, b = normal(rng, (n, C, H, W)), normal(rng, (K, C, R, S)), normal(rng, K)
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    y = aligned_zeros((n, K, P, Q), np.float32)
    dy = normal(rng, y.shape)
    dx = aligned_zeros(x.shape, np.float32)
    dw, db = aligned_zeros(2 * w.size, np.float32), aligned_zeros(2 * K, np.float32)
    starts = np.array([0, n // 2, n], np.int64)  # two parts, as a call of two chunks
    if stride == 1 and not gemm_faster(C, R, S, P, Q, R == S == 1 and pad == 0):
        sizes = [max(pair) for pair in zip(*(
            module.direct_sizes(C, H, W, K, R, S, pad, pad, 1, 1, 1, V) for V in (16, 8)))]
        e, e_extra, wpt, dycl, dycl_extra, dwt, dbacc, eb, wft, dxp = sizes
        scratch = [aligned_zeros(size, np.float32) for size in
                   (e + e_extra, n * dycl + dycl_extra, dwt, dbacc, eb, wft, dxp)]
        wpt = aligned_zeros(wpt, np.float32)
        geometry = (pad, pad, 1, 1, 1)
        forward_kernel = module.conv_forward_direct
        forward_scratch = (scratch[0], wpt)
        backward_kernel = module.conv_backward_direct
    else:
        scratch = [aligned_zeros((C * R * S, P * Q), np.float32)]
        geometry = (stride, stride, pad, pad, 1, 1, 1)
        forward_kernel, forward_scratch = module.conv_forward, scratch
        backward_kernel = module.conv_backward

    def forward():
        forward_kernel(x, w, b, y, *forward_scratch, *geometry)
        return y

    def backward(need_dx):
        def call():
            dw[:], db[:] = 0, 0
            backward_kernel(x, w, dy, dx, dw, w.size, db, K, starts, *scratch, *geometry,
                            need_dx)
            return np.concatenate([dw, db] + ([dx.ravel()] if need_dx else []))
        return call

    return {"forward": forward, "backward, no dx": backward(False),
            "backward": backward(True)}


def torch_runs(shape, n, seed=0):
    """runs()' three calls in PyTorch, on the same data (the same seed), each returning what
    runs()' does with the two parts' gradients in one: the first part's slots hold the sum,
    the second's zeros."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    C, H, W, K, R, S, pad, stride = shape
    rng = np.random.default_rng(seed)
    x, w, b = normal(rng, (n, C, H, W)), normal(rng, (K, C, R, S)), normal(rng, K)
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    dy = normal(rng, (n, K, P, Q))
    last = torch.channels_last

    def tensor(a, grad):
        t = torch.from_numpy(a)
        t = t.contiguous(memory_format=last) if a.ndim == 4 else t.clone()
        return t.requires_grad_(grad)

    tx, tw, tb, tdy = tensor(x, True), tensor(w, True), tensor(b, True), tensor(dy, False)
    y = F.conv2d(tx, tw, tb, stride=stride, padding=pad)

    def forward():
        with torch.no_grad():
            out = F.conv2d(tx, tw, tb, stride=stride, padding=pad)
        return out

    def backward(need_dx):
        inputs = [tw, tb] + ([tx] if need_dx else [])

        def call():
            return torch.autograd.grad(y, inputs, tdy, retain_graph=True)
        return call

    return {"forward": forward, "backward, no dx": backward(False),
            "backward": backward(True)}


def batchnorm_runs(norm, broadcast, shape, n, seed=0):
    """A BatchNorm (batch statistics) and the Scale with a bias after it, over a call of n
    samples in one part, with the modules' kernels as the layers yield them (cgp.layers.
    batchnorm, cgp.layers.scale), what the layers' syncs make of the sums in NumPy: forward
    (two sums, the normalisation, the product and the bias) and backward (Scale's two sums
    and its input gradient, BatchNorm's sums and its input gradient). Each call returns what
    it writes: the top; the input gradient, then the factors' and the bias's."""
    C, H, W = shape
    S, f = H * W, np.float32
    m = n * S
    rng = np.random.default_rng(seed)
    x, dz = normal(rng, (n, C, S)), normal(rng, (n, C, S))
    s, b = normal(rng, C), normal(rng, C)
    y, z, dy, dx = (aligned_zeros((n, C, S), np.float32) for _ in range(4))
    ds, db = aligned_zeros(C, np.float32), aligned_zeros(C, np.float32)
    starts = np.array([0, n], np.int64)
    shares = [aligned_zeros((1, size), np.float64) for size in (C, C, 2 * C)]
    mean, std, grads = (aligned_zeros(size, np.float64) for size in (C, C, 2 * C))

    # Before their sums in lanes, BatchNorm's kernels took a row of work space, and Scale
    # added its bias in a pass of its own.
    takes_work = "work" in inspect.signature(norm.centred_square_sums.py_func).parameters
    work = (aligned_zeros(S, np.float64),) if takes_work else ()
    fused = hasattr(broadcast, "scale_bias_forward")

    def forward():
        norm.channel_sums(x, starts, shares[0])
        mean[:] = (shares[0][0] / m).astype(f)
        norm.centred_square_sums(x, mean, starts, shares[1], *work)
        std[:] = np.sqrt((shares[1][0] / m).astype(f) + f(BN_EPS))
        norm.normalize(x, mean, std, y)
        if fused:
            broadcast.scale_bias_forward(y, s, 0, 0, b, 0, 0, z)
        else:
            broadcast.scale_forward(y, s, 0, 0, z)
            broadcast.bias_forward(z, b, 0, 0, z)
        return z

    def backward():
        ds[:], db[:] = 0, 0
        broadcast.row_sums(dz, db, 0, 0, starts, C, True)
        broadcast.product_sums(dz, y, ds, 0, 0, starts, C, True)
        broadcast.scale_forward(dz, s, 0, 0, dy)
        norm.gradient_sums(y, dy, starts, shares[2], *work)
        grads[:] = shares[2][0]
        norm.normalize_backward(y, dy, grads, m, std, dx)
        return np.concatenate([dx.ravel(), ds, db])

    forward()   # backward reads forward's y and std
    return {"forward": forward, "backward": backward}


def torch_batchnorm_runs(shape, n, seed=0):
    """batchnorm_runs()' two calls in PyTorch (its fused batch_norm, training, with the
    Scale's factors and bias as its weight and bias; channels_last), on the same data."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    C, H, W = shape
    rng = np.random.default_rng(seed)
    x, dz = normal(rng, (n, C, H * W)), normal(rng, (n, C, H * W))
    s, b = normal(rng, C), normal(rng, C)
    last = torch.channels_last
    tx = torch.from_numpy(x.reshape(n, C, H, W)).contiguous(memory_format=last)
    tx.requires_grad_(True)
    tdz = torch.from_numpy(dz.reshape(n, C, H, W)).contiguous(memory_format=last)
    ts, tb = (torch.from_numpy(a).clone().requires_grad_(True) for a in (s, b))
    mean, var = torch.zeros(C), torch.ones(C)
    z = F.batch_norm(tx, mean, var, ts, tb, True, 0.1, BN_EPS)

    def forward():
        with torch.no_grad():
            out = F.batch_norm(tx, mean, var, ts, tb, True, 0.1, BN_EPS)
        return out

    def backward():
        return torch.autograd.grad(z, [tx, ts, tb], tdz, retain_graph=True)

    return {"forward": forward, "backward": backward}


def from_torch(result, conv_backward):
    """A PyTorch call's result (a tensor, or a tuple of gradients), which the timed calls
    leave in PyTorch's layout, as runs()' or batchnorm_runs()' result; conv_backward: a
    convolution's gradients, which runs() gives for two parts (the second's slots zeros)."""
    if not isinstance(result, tuple):
        return result.contiguous().numpy()
    flat = [g.contiguous().numpy().ravel() for g in result]
    if conv_backward:
        dw, db = flat[:2]
        flat = [dw, np.zeros_like(dw), db, np.zeros_like(db)] + flat[2:]
    return np.concatenate(flat)


def parts_summed(result, shape, call):
    """runs()' result with the second part's gradients added into the first's slots."""
    C, H, W, K, R, S = shape[:6]
    if call == "forward":
        return result
    out = result.copy()
    size = K * C * R * S
    out[:size] += out[size:2 * size]
    out[size:2 * size] = 0
    out[2 * size:2 * size + K] += out[2 * size + K:2 * size + 2 * K]
    out[2 * size + K:2 * size + 2 * K] = 0
    return out


def pool_runs(module, shape, n, seed=0):
    """Pooling's two calls with the module's kernels. Before 30ef7d2 average pooling took a
    row scratch (forward) and none (backward); since, blocks of planes (ave_sizes)."""
    C, H, W, R, stride, method = shape
    P, Q = -(-(H - R) // stride) + 1, -(-(W - R) // stride) + 1
    rng = np.random.default_rng(seed)
    x, dy = normal(rng, (n, C, H, W)), normal(rng, (n, C, P, Q))
    y, dx = aligned_zeros(dy.shape, np.float32), aligned_zeros(x.shape, np.float32)
    window = (R, R, stride, stride, 0, 0)
    if method == "MAX":
        arg = aligned_zeros(y.shape, np.int32)
        rmax, rarg = aligned_zeros(H * Q, np.float32), aligned_zeros(H * Q, np.int32)

        def max_forward():
            module.max_pool_forward(x, y, arg, rmax, rarg, *window)
            return np.concatenate([y.ravel(), arg.ravel().view(np.float32)])

        def max_backward():
            module.max_pool_backward(dy, arg, dx)
            return dx

        return {"forward": max_forward, "backward": max_backward}
    if hasattr(module, "ave_sizes"):
        size, cover = module.ave_sizes(H, W, P, Q)
        planes, cover = aligned_zeros(size, np.float32), aligned_zeros(cover, np.int32)
        fwd = (planes,)
        bwd = (planes, cover)
    else:
        fwd, bwd = (aligned_zeros(H * Q, np.float32),), ()

    def forward():
        module.ave_pool_forward(x, y, *fwd, *window)
        return y

    def backward():
        module.ave_pool_backward(dy, dx, *bwd, *window)
        return dx

    return {"forward": forward, "backward": backward}


def inner_runs(module, shape, n, seed=0):
    """InnerProduct's forward pass, input gradient and unfactored weight gradient (a weight
    not transposed) with the module's kernels."""
    C, K = shape
    rng = np.random.default_rng(seed)
    x, w, b, dy = normal(rng, (n, C)), normal(rng, (K, C)), normal(rng, K), normal(rng, (n, K))
    y, dx = aligned_zeros((n, K), np.float32), aligned_zeros((n, C), np.float32)
    dw = aligned_zeros((K, C), np.float32)
    scratch = aligned_zeros(module.scratch_size(n, K), np.float32)
    none = aligned_zeros(0, np.float32)

    def forward():
        module.fc_forward(x, w, b, y, False, none)
        return y

    def input_gradient():
        module.fc_backward(x, w, dy, dx, x, none, False, True, False, False, scratch)
        return dx

    def weight_gradient():   # one part's, set (overwrite): where it is not factored
        module.fc_backward(x, w, dy, x, dw, none, False, False, True, True, scratch)
        return dw

    return {"forward": forward, "input gradient": input_gradient,
            "weight gradient": weight_gradient}


def reduce_runs(module, shape, seed=0):
    """A factored gradient's sum over 16 chunks: with a stack of register tiles where the
    revision has outer_stack_size (a7a6a9a, 6b15401, and from the folded tiles on), else with a
    panel scratch and a tree scratch."""
    batch, J, L = shape
    bounds = chunk_bounds(batch, 16)
    starts = np.array([first for first, _ in bounds] + [batch], np.int64)
    rng = np.random.default_rng(seed)
    a = aligned_zeros(batch * J + module.OUTER_PAD, np.float32)
    b = aligned_zeros(batch * L + module.OUTER_PAD, np.float32)
    a[:batch * J] = rng.standard_normal(batch * J)
    b[:batch * L] = rng.standard_normal(batch * L)
    out = aligned_zeros(J * L, np.float32)
    if hasattr(module, "outer_stack_size"):
        scratch = [aligned_zeros(module.outer_stack_size(len(bounds)), np.float32)]
    else:
        scratch = [aligned_zeros((len(bounds), module.OUTER_SCRATCH), np.float32),
                   aligned_zeros((len(bounds), module.TILE), np.float32)]

    def call():
        module.outer_tree_sum(a, b, J, L, starts, 0, J, *scratch, out)
        return out

    return {"tree sum": call}


def lrn_runs(module, shape, n, seed=0):
    """LRN's forward and backward with the module's kernels: where the revision has
    plane_size, forward also keeps scale^-beta for backward; before, backward took a power of
    its own."""
    C, H, W, L, region = shape
    rng = np.random.default_rng(seed)
    x, dy = normal(rng, (n, C, H, W)), normal(rng, (n, C, H, W))
    y, scale, power, dx = (aligned_zeros((n, C, H, W), np.float32) for _ in range(4))
    alpha, beta = np.float32(NORM_ALPHA), np.float32(NORM_BETA)
    within = region == "WITHIN"
    window = L * L if within else L
    ratio = np.float32(2.0 * NORM_ALPHA * NORM_BETA / window)   # as the layer forms it
    kept = hasattr(module, "plane_size")
    if kept:
        plane = aligned_zeros(module.plane_size(H, W, L) if within else H * W, np.float32)
    else:
        plane = aligned_zeros((H, W), np.float32)

    def forward():
        if within:
            args = (x, y, scale) + ((power, plane) if kept else ()) + (L, alpha, beta)
            module.lrn_within_forward(*args)
        else:
            args = (x, y, scale) + ((power,) if kept else ()) + (L, alpha / np.float32(L),
                                                                   beta, np.float32(1))
            module.lrn_across_forward(*args)
        return y

    def backward():
        kernel = module.lrn_within_backward if within else module.lrn_across_backward
        if kept:
            kernel(x, y, dy, scale, power, dx, L, ratio, plane)
        else:
            kernel(x, y, dy, scale, dx, L, ratio, beta, plane)
        return dx

    return {"forward": forward, "backward": backward}


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True,
                        help="git revision to compare against, or torch")
    parser.add_argument("--layers", default=",".join(KNOWN),
                        help="comma-separated rows, or resnet50 for all of ResNet-50's")
    parser.add_argument("--samples", type=int, default=12, help="samples per call")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock, or the calling thread's CPU time")
    parser.add_argument("--torch-samples", type=int, default=None,
                        help="samples per PyTorch call with --base torch (default --samples)")
    args = parser.parse_args(argv)
    args.layers = [row for name in args.layers.split(",") for row in GROUPS.get(name, [name])]
    unknown = [name for name in args.layers if name not in KNOWN]
    if unknown:
        parser.error(f"unknown layers {unknown}; known: {', '.join(KNOWN + list(GROUPS))}")
    with_torch = args.base == "torch"
    if with_torch and any(name not in CONVS and name not in BATCHNORMS
                          for name in args.layers):
        parser.error(f"--base torch times convolutions and BatchNorm only: "
                     f"{', '.join(list(CONVS) + list(BATCHNORMS))}")
    if args.torch_samples is not None and not with_torch:
        parser.error("--torch-samples goes with --base torch")
    return args


def counted(name, call):
    """How many times ResNet-50 runs this row's call in a training step (0: not at all, or not
    a ResNet-50 row): each pass once per layer of the shape, conv1 without the input
    gradient (its bottom is the data)."""
    if name in BATCHNORMS:
        return BATCHNORMS[name][1]
    if name not in RESNET50 or call == ("backward" if name == "conv1" else "backward, no dx"):
        return 0
    return RESNET50[name][1]


def print_totals(totals):
    """totals: {kind: (base ms, working tree ms)} summed over the net; one line per kind and
    one for them all."""
    print("  totals over ResNet-50, each distinct layer as often as the net has it, the passes "
          "training runs (ms per 100 samples):")
    every = np.sum(list(totals.values()), axis=0)
    for name, (old, new) in list(totals.items()) + [("all of these", every)]:
        print(f"    {name:20s} base {old:8.2f}  now {new:8.2f}  speed x{old / new:.3f}")


def main():
    args = parse_args()
    layers = args.layers
    with_torch = args.base == "torch"
    torch_samples = args.torch_samples or args.samples
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    totals = {}
    with tempfile.TemporaryDirectory() as folder, threadpool_limits(1):
        try:
            if not with_torch:
                base_conv, base_pool, base_reduce, base_fc, base_lrn = base_modules(
                    args.base, Path(folder))
                if any(name in BATCHNORMS for name in layers):
                    norm_modules = import_revision(args.base, NORM_FILES, Path(folder))
        except subprocess.CalledProcessError as err:
            sys.exit(f"kernel_ab: git show {args.base}: {err.stderr.strip()}")
        except OSError as err:
            sys.exit(f"kernel_ab: {args.base}: {err}")
        print(f"base {args.base} against the working tree, {args.samples} samples per call"
              f"{f' ({torch_samples} for PyTorch)' if torch_samples != args.samples else ''}, "
              f"{args.rounds} rounds; {'CPU ' if args.clock == 'cpu' else ''}ms per 100 samples "
              f"(per batch for the reductions)")
        for name in layers:
            scale = old_scale = 1e3 * 100 / args.samples
            if name in REDUCTIONS:
                old = reduce_runs(base_reduce, REDUCTIONS[name])
                new = reduce_runs(reduce, REDUCTIONS[name])
                scale = old_scale = 1e3
            elif name in POOLS:
                old = pool_runs(base_pool, POOLS[name], args.samples)
                new = pool_runs(pool, POOLS[name], args.samples)
            elif name in INNER:
                old = inner_runs(base_fc, INNER[name], args.samples)
                new = inner_runs(fc, INNER[name], args.samples)
            elif name in NORMS:
                old = lrn_runs(base_lrn, NORMS[name], args.samples)
                new = lrn_runs(lrn, NORMS[name], args.samples)
            elif name in BATCHNORMS and with_torch:
                old = torch_batchnorm_runs(BATCHNORMS[name][0], torch_samples)
                old_scale = 1e3 * 100 / torch_samples
                new = batchnorm_runs(batchnorm, broadcast, BATCHNORMS[name][0], args.samples)
            elif name in BATCHNORMS:
                old = batchnorm_runs(norm_modules["batchnorm"], norm_modules["scale"],
                                     BATCHNORMS[name][0], args.samples)
                new = batchnorm_runs(batchnorm, broadcast, BATCHNORMS[name][0], args.samples)
            elif with_torch:
                old = torch_runs(CONVS[name], torch_samples)
                old_scale = 1e3 * 100 / torch_samples
                new = runs(conv, CONVS[name], args.samples)
            else:
                old = runs(base_conv, CONVS[name], args.samples)
                new = runs(conv, CONVS[name], args.samples)
            for call in old:
                try:
                    first = old[call]()
                except (TypeError, ValueError) as err:
                    sys.exit(f"kernel_ab: {args.base}'s kernels take other arguments or "
                             f"scratch than this script gives them ({err}); compare with a "
                             f"later revision")
                if torch_samples != args.samples:
                    same = "other data: not compared"
                elif with_torch:
                    ours = new[call]().ravel()
                    if name in CONVS:
                        ours = parts_summed(ours, CONVS[name], call)
                    # The largest difference over the largest magnitude.
                    first = from_torch(first, name in CONVS and call != "forward").ravel()
                    same = f"differ by {np.abs(ours - first).max() / np.abs(first).max():.1e}"
                else:
                    equal = np.array_equal(first.view(np.int32), new[call]().view(np.int32))
                    same = f"same bits: {'yes' if equal else 'NO'}"
                t_old, t_new = [], []
                for _ in range(args.rounds):
                    for fn, times in ((old[call], t_old), (new[call], t_new)):
                        start = clock()
                        fn()
                        times.append(clock() - start)
                # Per 100 samples, which the two sides may reach in calls of different sizes.
                ratio = np.median(np.array(t_old) * old_scale / (np.array(t_new) * scale))
                print(f"  {name:14s} {call:16s} base {np.median(t_old) * old_scale:7.2f}  "
                      f"now {np.median(t_new) * scale:7.2f}  speed x{ratio:.3f}  "
                      f"{same}", flush=True)
                times = counted(name, call) * np.array([np.median(t_old) * old_scale,
                                                        np.median(t_new) * scale])
                if times.any():
                    totals[kind(name)] = totals.get(kind(name), 0) + times
        if totals:
            print_totals(totals)


if __name__ == "__main__":
    main()
