"""Solver update kernels: one elementwise kernel per Caffe solver rule, over a slice [lo, hi),
each the one loop of update_kernel around the rule's arithmetic for one element.

Each kernel follows BVLC Caffe's CPU path operation by operation, in float32: clip scale, then
iter_size normalization, then L1/L2 regularization (Caffe's ClipGradients, Normalize, Regularize),
then the rule's history update and step (ComputeUpdateValue), then w -= step (Net::Update).
Like Caffe, a kernel overwrites the gradient with the step it applied.
Not here: the learning rate policy, the global gradient norm, and any threading (see cgp.solver).

Every kernel takes (w, g, h, u, lr_mult, decay_mult, lo, hi, rate, clip_scale, accum,
weight_decay, l1, hyper). Arrays, all flat float32 of the net's parameter count n (only
[lo, hi) is read or written):
  w       parameters              g        gradients in, steps out
  h, u    rule histories (a rule with one history reads only h; pass it as u too)
Scalars are float32 (np.float32) except lo, hi (int) and l1 (bool): a Python float would make
Numba compute in float64 and the result would no longer be Caffe's float32 arithmetic.
  hyper        the rule's float32 hyperparameters, a tuple: SGD and Nesterov (momentum,),
               AdaGrad (delta,), RMSProp (rms_decay, delta), AdaDelta (momentum, delta), Adam
               (beta1, beta2, delta, correction)
  rate         global learning rate        clip_scale  clip_gradients factor, 1 when not clipping
  accum        1 / iter_size, in float32   weight_decay, l1  regularization (L1 if l1 else L2)
  lr_mult, decay_mult   the blob multipliers of every parameter in [lo, hi) (the caller cuts
               its slices where they change; cgp.solver.Solver.apply): as scalars, the kernel
               reads two arrays fewer and its regularization test is the same for every
               element; local_rate and local_decay are the products Caffe forms per blob.
Each returns whether every weight it wrote is finite (no NaN, no infinity): the check rides
on the loop that writes them and costs nothing measurable (cgp.step stops training on it).
Elementwise only, so results are bitwise identical however [0, n) is cut into slices. The
loops index views of the slice from 0: an index that may be negative (lo + i) costs Numba a
wrap-around test per element, which keeps the loop from being vectorised.
Also `claim`, a hint that asks for a slice's cache lines for writing before an update writes
them (cgp.step.DataParallelStep, in the reduction's tasks); it changes no value.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, register_jitable


FLOAT32_MAX = np.float32(np.finfo(np.float32).max)   # |x| <= it: x is finite


@njit(cache=True, nogil=True)
def all_finite(a):
    """Whether every element of a (any shape) is finite."""
    finite = True
    for x in a.ravel():
        finite &= abs(x) < np.inf   # false for infinities and NaN
    return finite


@njit(cache=True, nogil=True)
def _caffe_gradient(g, w, clip_scale, accum, local_decay, l1):
    """One element's gradient as Caffe's ComputeUpdateValue receives it (all float32 scalars)."""
    # Multiplying by 1 is exact, so scaling unconditionally equals Caffe skipping it.
    g = g * clip_scale
    g = g * accum
    # Caffe skips regularization when local_decay is 0; 0 * inf would otherwise give NaN.
    if local_decay != 0:
        if l1:
            sign = np.float32(0.0)
            if w > 0:
                sign = np.float32(1.0)
            elif w < 0:
                sign = np.float32(-1.0)
            g = local_decay * sign + g
        else:
            g = local_decay * w + g
    return g


def update_kernel(rule):
    """The update kernel of one solver rule: the loop every rule shares (the slice, Caffe's
    gradient, w -= step, the finite check) around rule(g, h, u, i, local_rate, hyper), which
    updates element i of the histories h and u from the element's gradient g and returns the
    step. The rule is a register_jitable function, which Numba compiles into the loop (no call
    per element); a Numba dispatcher here would make the cache miss in every new process,
    since a closure's cache key pickles it with an id of the process's own."""
    @njit(cache=True, nogil=True)
    def kernel(w, g, h, u, lr_mult, decay_mult, lo, hi, rate, clip_scale, accum, weight_decay,
               l1, hyper):
        w, g, h, u = w[lo:hi], g[lo:hi], h[lo:hi], u[lo:hi]
        local_rate, local_decay = rate * lr_mult, weight_decay * decay_mult
        finite = True
        for i in range(hi - lo):
            step = rule(_caffe_gradient(g[i], w[i], clip_scale, accum, local_decay, l1), h, u, i,
                        local_rate, hyper)
            g[i] = step
            wi = w[i] - step
            w[i] = wi
            finite &= abs(wi) <= FLOAT32_MAX
        return finite
    return kernel


# -- the rules: one element's history update and step (u is h for one-history rules) ----

@register_jitable
def _sgd(g, h, u, i, local_rate, hyper):
    """h = local_rate * g + momentum * h; step = h."""
    (momentum,) = hyper
    step = local_rate * g + momentum * h[i]
    h[i] = step
    return step


@register_jitable
def _nesterov(g, h, u, i, local_rate, hyper):
    """h' = local_rate * g + momentum * h; step = (1 + momentum) * h' - momentum * h."""
    (momentum,) = hyper
    previous = h[i]
    current = local_rate * g + momentum * previous
    h[i] = current
    return (np.float32(1.0) + momentum) * current - momentum * previous


@register_jitable
def _adagrad(g, h, u, i, local_rate, hyper):
    """h += g^2; step = local_rate * (g / (sqrt(h) + delta))."""
    (delta,) = hyper
    history = g * g + h[i]
    h[i] = history
    return local_rate * (g / (np.sqrt(history) + delta))


@register_jitable
def _rmsprop(g, h, u, i, local_rate, hyper):
    """h = (1 - rms_decay) * g^2 + rms_decay * h; step = local_rate * (g / (sqrt(h) + delta))."""
    rms_decay, delta = hyper
    history = (np.float32(1.0) - rms_decay) * (g * g) + rms_decay * h[i]
    h[i] = history
    return local_rate * (g / (np.sqrt(history) + delta))


@register_jitable
def _adadelta(g, h, u, i, local_rate, hyper):
    """h: mean squared gradient, u: mean squared update (Caffe's second history block).
    h = (1-momentum) g^2 + momentum h; d = g sqrt((u + delta) / (h + delta));
    u = (1-momentum) d^2 + momentum u; step = local_rate * d."""
    momentum, delta = hyper
    one_minus_momentum = np.float32(1.0) - momentum
    history = one_minus_momentum * (g * g) + momentum * h[i]
    h[i] = history
    # The old u, before this step's update, scales the gradient.
    d = g * np.sqrt((delta + u[i]) / (delta + history))
    u[i] = one_minus_momentum * (d * d) + momentum * u[i]
    return local_rate * d


@register_jitable
def _adam(g, m, v, i, local_rate, hyper):
    """m = (1-beta1) g + beta1 m; v = (1-beta2) g^2 + beta2 v;
    step = (local_rate * correction) * (m / (sqrt(v) + delta)), with the iteration's bias
    correction sqrt(1 - beta2^t) / (1 - beta1^t) computed by the caller."""
    beta1, beta2, delta, correction = hyper
    mi = (np.float32(1.0) - beta1) * g + beta1 * m[i]
    vi = (np.float32(1.0) - beta2) * (g * g) + beta2 * v[i]
    m[i] = mi
    v[i] = vi
    return (local_rate * correction) * (mi / (np.sqrt(vi) + delta))


sgd_update = update_kernel(_sgd)
nesterov_update = update_kernel(_nesterov)
adagrad_update = update_kernel(_adagrad)
rmsprop_update = update_kernel(_rmsprop)
adadelta_update = update_kernel(_adadelta)
adam_update = update_kernel(_adam)


@njit(cache=True, nogil=True)
def sum_of_squares(x, lo, hi):
    """x: (n,) float32. Returns sum of x[lo:hi]^2 accumulated in float64, in index order."""
    total = 0.0
    x = x[lo:hi]
    for i in range(hi - lo):
        xi = np.float64(x[i])
        total += xi * xi
    return total


@intrinsic
def _prefetch_write(typingctx, a, index):
    """Asks for the cache line of a[index] (a contiguous 1-d array) for writing (x86's
    PREFETCHW): the core takes the line over from other cores' caches now, while it does
    other work, instead of when it stores to it. A hint: no value changes."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"):
        return None   # the address below is data + index: contiguous arrays only
    sig = types.void(a, types.intp)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        pointer = builder.gep(array.data, [args[1]])
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]),
            "llvm.prefetch.p0")
        # (address, write, keep in all cache levels, data)
        builder.call(prefetch, [pointer, i32(1), i32(3), i32(1)])
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def claim(a, lo, hi):
    """Prefetches a[lo:hi] (1-d float32) for writing: one request per 16 elements (a 64-byte
    line), and one for the last, whose line a slice that starts mid-line would miss. With two
    workers, LeNet's ip1 update blocks took 1.7 times as long as with one: each store waited
    for the other core to give up its copy of a line that its calls had read. Claimed before
    the reduction's sum, they take about as long as with one worker."""
    for i in range(lo, hi, 16):
        _prefetch_write(a, i)
    if hi > lo:
        _prefetch_write(a, hi - 1)
