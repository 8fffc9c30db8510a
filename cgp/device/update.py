"""The solvers' update on the device: cgp.runtime.update's arithmetic, operation by operation
in the same order and dtype, as whole-array operations over an array module `xp` (CuPy, or
NumPy standing in for it), so that the weights are bitwise those of the CPU's kernels.

Why array operations and not cgp.runtime.update's own functions in a Numba CUDA kernel: a
compiled kernel may contract a * b + c into one fused multiply-add (NVVM does by default),
which rounds once where the CPU's kernels round twice; one array operation per arithmetic
operation rounds as they do. The per-element multipliers (lr_mult, decay_mult) sit on the
device as arrays, so the update is some ten array operations whatever the net, rather than
some per blob.

Not here: the learning rate, clipping's norm and the Step (cgp.solver, on the host), and the
layer-wise rates (LARS, LARC), which keep the host's update (cgp.device.make_step).
"""
import numpy as np

from cgp.runtime.update import FLOAT32_MAX


def caffe_gradient(xp, g, w, clip_scale, accum, local_decay, l1):
    """cgp.runtime.update._caffe_gradient over arrays: local_decay is an array (a weight's
    weight_decay * decay_mult)."""
    one = g.dtype.type
    g = g * clip_scale
    g = g * accum
    if l1:
        # Caffe's sign: +0 at 0 (np.sign would keep -0's sign).
        sign = xp.where(w > 0, one(1.0), xp.where(w < 0, one(-1.0), one(0.0)))
        decayed = local_decay * sign + g
    else:
        decayed = local_decay * w + g
    # Caffe skips regularization where local_decay is 0 (0 * inf would give NaN).
    return xp.where(local_decay != 0, decayed, g)


def sgd(xp, g, h, u, local_rate, hyper):
    (momentum,) = hyper
    step = local_rate * g + momentum * h
    h[...] = step
    return step


def nesterov(xp, g, h, u, local_rate, hyper):
    (momentum,) = hyper
    previous = h.copy()
    current = local_rate * g + momentum * previous
    h[...] = current
    return (np.float32(1.0) + momentum) * current - momentum * previous


def adagrad(xp, g, h, u, local_rate, hyper):
    (delta,) = hyper
    history = g * g + h
    h[...] = history
    return local_rate * (g / (xp.sqrt(history) + delta))


def rmsprop(xp, g, h, u, local_rate, hyper):
    rms_decay, delta = hyper
    history = (np.float32(1.0) - rms_decay) * (g * g) + rms_decay * h
    h[...] = history
    return local_rate * (g / (xp.sqrt(history) + delta))


def adadelta(xp, g, h, u, local_rate, hyper):
    momentum, delta = hyper
    one_minus_momentum = np.float32(1.0) - momentum
    history = one_minus_momentum * (g * g) + momentum * h
    h[...] = history
    d = g * xp.sqrt((delta + u) / (delta + history))
    u[...] = one_minus_momentum * (d * d) + momentum * u
    return local_rate * d


def adam(xp, g, m, v, local_rate, hyper):
    beta1, beta2, delta, correction = hyper
    mi = (np.float32(1.0) - beta1) * g + beta1 * m
    vi = (np.float32(1.0) - beta2) * (g * g) + beta2 * v
    m[...] = mi
    v[...] = vi
    return (local_rate * correction) * (mi / (xp.sqrt(vi) + delta))


RULES = {"SGD": sgd, "Nesterov": nesterov, "AdaGrad": adagrad, "RMSProp": rmsprop,
         "AdaDelta": adadelta, "Adam": adam}


class DeviceUpdate:
    """A Solver's update of all n parameters on the device: its histories and multipliers
    there, copied from and back to the Solver's (host) arrays by to_device and to_host."""

    def __init__(self, solver, xp):
        if solver.layerwise:
            raise ValueError("layer-wise rates (LARS, LARC) update on the host")
        self.solver, self.xp = solver, xp
        self.rule = RULES[solver.type]
        self.histories = [xp.zeros(h.size, np.float32) for h in solver.histories]
        self.lr_mult = xp.asarray(solver.lr_mult)
        self.decay_mult = xp.asarray(solver.decay_mult)
        # Solver.apply's scalars, float32 as its kernels take them.
        self._weight_decay, self._l1 = solver._weight_decay, solver._l1
        self._accum, self._hyper = solver._accum, solver._hyper

    def to_device(self):
        for device, host in zip(self.histories, self.solver.histories):
            device[...] = self.xp.asarray(host)

    def to_host(self, to_numpy):
        for device, host in zip(self.histories, self.solver.histories):
            host[...] = to_numpy(device)

    def apply(self, step, w, g):
        """Solver.apply(step, w, g, 0, n) on the device: w and the histories updated, g
        overwritten with the step taken. Returns whether every weight is finite."""
        xp, solver = self.xp, self.solver
        hyper = self._hyper
        if solver.type == "SGD":
            hyper = (hyper[0] * step.momentum_scale,)   # exactly momentum unless warming up
        if solver.type == "Adam":
            hyper = hyper + (step.correction,)
        h, u = self.histories[0], self.histories[-1]   # a one-history rule reads h alone
        local_rate = step.rate * self.lr_mult
        local_decay = self._weight_decay * self.decay_mult
        gradient = caffe_gradient(xp, g, w, step.clip_scale, self._accum, local_decay, self._l1)
        taken = self.rule(xp, gradient, h, u, local_rate, hyper)
        g[...] = taken
        w -= taken
        return bool(xp.all(xp.abs(w) <= FLOAT32_MAX))
