"""Caffe's solvers (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam) over one flat parameter array.

A Solver turns a SolverParameter into learning rates and per-slice updates that reproduce BVLC
Caffe's arithmetic: float32 updates in Caffe's order, and learning rates computed with the same
mix of float and double that Caffe's C++ uses. It knows nothing about workers or ranks: the
data-parallel step (cgp.parallel) calls prepare() once per iteration, then apply() on slices
[lo, hi) in any order or in parallel.
Not here: snapshots (see `histories` for Caffe's history order) and the iteration loop.
"""
import math
from typing import NamedTuple, Optional

import numpy as np

from cgp.errors import PrototxtError
from cgp.runtime import update
from cgp.runtime.memory import aligned_zeros

# Caffe's solver registry, and the order of the deprecated SolverParameter.SolverType enum (0..5).
SOLVER_TYPES = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")
LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")

f32 = np.float32


class Step(NamedTuple):
    """What apply() needs for one iteration; computed once by prepare(), shared by all slices."""
    it: int                      # Caffe's iter_: updates done before this one
    rate: np.float32             # learning rate before lr_mult
    clip_scale: np.float32       # clip_gradients / ||g|| when clipping triggered, else 1
    correction: np.float32       # Adam's bias correction for this iteration; 1 for other rules
    grad_norm: Optional[float]   # global L2 norm of the gradients, when clip_gradients >= 0

    def plain(self):
        """The Step as a tuple of Python numbers (floats hold float32 values exactly), as it
        travels to worker processes with every run (cgp.runtime.procs): a tuple of built-in types
        pickles and loads in a tenth of the time or less that a Step takes, whose pickle
        names its type and rebuilds NumPy scalars. Step.of makes the Step again."""
        return (self.it, float(self.rate), float(self.clip_scale), float(self.correction),
                self.grad_norm)

    @classmethod
    def of(cls, plain):
        """The Step of its plain() tuple, with its float32 fields float32 again."""
        it, rate, clip_scale, correction, grad_norm = plain
        return cls(it, f32(rate), f32(clip_scale), f32(correction), grad_norm)


def _c_pow(base, exponent):
    """C's pow on doubles: inf and NaN where Python's math.pow raises."""
    try:
        return math.pow(base, exponent)
    except OverflowError:
        return math.inf
    except ValueError:      # 0 to a negative power, or a negative base to a fractional one
        return math.inf if base == 0 else math.nan


def _pow_f32(base, exponent):
    """C's powf on float32 arguments: glibc computes it in double and rounds once, as here."""
    return f32(_c_pow(float(base), float(exponent)))


def _exp_f32(x):
    """C's expf on a float32 argument, computed in double and rounded once."""
    try:
        return f32(math.exp(float(x)))
    except OverflowError:
        return f32(math.inf)


def multistep_count(stepvalues, it):
    """Caffe's multistep current_step at iteration it, as a pure function.

    Caffe advances current_step by at most one per iteration, when it >= stepvalue[current_step];
    so step k is taken at iteration max(stepvalue[k], iteration of step k-1 + 1). For increasing
    stepvalues this is the number of stepvalues <= it; it also matches Caffe on repeated or
    unsorted ones.
    """
    count, taken_at = 0, -1
    for value in stepvalues:
        taken_at = max(value, taken_at + 1)
        if taken_at > it:
            break
        count += 1
    return count


def _solver_type(param):
    """The solver's type string, resolved as Caffe's UpgradeSolverType does."""
    if param.HasField("solver_type"):
        if param.HasField("type"):
            raise PrototxtError("solver: the deprecated 'solver_type' (enum) and 'type' (string) "
                                "cannot both be given; use 'type'")
        return SOLVER_TYPES[param.solver_type]
    # An unset 'type' reads as its default, "SGD".
    if param.type not in SOLVER_TYPES:
        raise PrototxtError(f"solver: type '{param.type}' is not supported; "
                            f"supported types: {', '.join(SOLVER_TYPES)}")
    return param.type


def _check(param, type_):
    """Raise PrototxtError on what Caffe would CHECK-fail or LOG(FATAL) on."""
    def fail(message):
        raise PrototxtError(f"solver: {message}")

    # Caffe's constructor_sanity_check()s; AdaDelta and Adam use momentum, Caffe checks neither.
    if type_ in ("AdaGrad", "RMSProp") and param.momentum != 0:
        fail(f"momentum cannot be used with {type_} (momentum: {param.momentum:g})")
    if type_ == "RMSProp" and not 0 <= param.rms_decay < 1:
        fail(f"rms_decay should lie between 0 and 1 (rms_decay: {param.rms_decay:g})")
    # Caffe only fails on this once a blob has nonzero decay; checking up front is clearer.
    if param.regularization_type not in ("L1", "L2"):
        fail(f"regularization_type '{param.regularization_type}' is not supported; "
             f"supported: L1, L2")
    # Not checked by Caffe, where it would divide by zero.
    if param.iter_size < 1:
        fail(f"iter_size must be at least 1 (iter_size: {param.iter_size})")

    policy = param.lr_policy
    if policy not in LR_POLICIES:
        shown = f"'{policy}'" if policy else "(none given)"
        fail(f"lr_policy {shown} is not supported; supported policies: {', '.join(LR_POLICIES)}")
    # Caffe checks these on the first learning rate; here before training starts.
    if policy in ("step", "exp", "inv", "multistep", "sigmoid") and param.gamma < 0:
        fail(f"lr_policy '{policy}' needs gamma >= 0 (gamma: {param.gamma:g})")
    if policy in ("step", "sigmoid") and param.stepsize <= 0:
        fail(f"lr_policy '{policy}' needs stepsize > 0 (stepsize: {param.stepsize})")
    if policy == "poly" and param.max_iter <= 0:   # not checked by Caffe: it would divide by zero
        fail(f"lr_policy 'poly' needs max_iter > 0 (max_iter: {param.max_iter})")


class Solver:
    """A Caffe solver over flat float32 arrays of n parameters.

    param: caffe_pb2.SolverParameter. lr_mult, decay_mult: (n,) per-element blob multipliers
    (constant within a blob: apply() hands the kernels a slice's runs of equal ones).
    histories: the rule's state, each (n,) float32 in parameter order: [h] for SGD, Nesterov,
    AdaGrad, RMSProp; [h, u] for AdaDelta and [m, v] for Adam. Caffe's SolverState.history lists
    every blob of histories[0] and then every blob of histories[1]. shared: allocate them in
    shared memory, for updates that run in worker processes (cgp.runtime.procs).
    """

    def __init__(self, param, lr_mult, decay_mult, shared=False):
        self.type = _solver_type(param)
        _check(param, self.type)
        self.param = param
        self.lr_mult = np.ascontiguousarray(lr_mult, dtype=np.float32)
        self.decay_mult = np.ascontiguousarray(decay_mult, dtype=np.float32)
        if self.lr_mult.ndim != 1 or self.lr_mult.shape != self.decay_mult.shape:
            raise ValueError(f"lr_mult {self.lr_mult.shape} and decay_mult "
                             f"{self.decay_mult.shape} must be flat and of one length")
        n = self.lr_mult.size
        # Caffe's SolverState.current_step: set by learning_rate() as Caffe's GetLearningRate does.
        self.current_step = 0

        # Every hyperparameter in float32, as Caffe reads them into Dtype.
        self._weight_decay = f32(param.weight_decay)
        self._l1 = param.regularization_type == "L1"
        # Caffe's Normalize: Dtype(1) / iter_size, a float32 division.
        self._accum = f32(1.0) / f32(param.iter_size)
        momentum, delta = f32(param.momentum), f32(param.delta)
        kernels = {
            "SGD": (update.sgd_update, 1, (momentum,)),
            "Nesterov": (update.nesterov_update, 1, (momentum,)),
            "AdaGrad": (update.adagrad_update, 1, (delta,)),
            "RMSProp": (update.rmsprop_update, 1, (f32(param.rms_decay), delta)),
            "AdaDelta": (update.adadelta_update, 2, (momentum, delta)),
            "Adam": (update.adam_update, 2, (momentum, f32(param.momentum2), delta)),
        }
        self._kernel, count, self._hyper = kernels[self.type]
        self._cuts = {}   # (lo, hi) -> _pieces
        # (it, its Step, the current_step its prepare() sets or None) made by prepare_ahead
        self._ahead = None
        self.histories = [aligned_zeros(n, np.float32, shared) for _ in range(count)]

    def learning_rate(self, it):
        """Caffe's GetLearningRate at iteration it, returned as a float holding a float32 value.

        Follows Caffe's C++ types: pow(float, int) promotes to double (step, exp, multistep),
        while inv, poly and sigmoid stay in float. The rate depends on it alone; current_step
        is recorded for solverstate files.
        """
        p = self.param
        policy = p.lr_policy
        base_lr, gamma, power = f32(p.base_lr), f32(p.gamma), f32(p.power)
        if policy == "fixed":
            rate = base_lr
        elif policy in ("step", "multistep"):
            if policy == "step":
                self.current_step = it // p.stepsize
            else:
                self.current_step = multistep_count(p.stepvalue, it)
            rate = f32(float(base_lr) * _c_pow(float(gamma), self.current_step))
        elif policy == "exp":
            rate = f32(float(base_lr) * _c_pow(float(gamma), it))
        elif policy == "inv":
            rate = base_lr * _pow_f32(f32(1.0) + gamma * f32(it), -power)
        elif policy == "poly":
            rate = base_lr * _pow_f32(f32(1.0) - f32(it) / f32(p.max_iter), power)
        elif policy == "sigmoid":
            x = -gamma * (f32(it) - f32(p.stepsize))
            rate = base_lr * (f32(1.0) / (f32(1.0) + _exp_f32(x)))
        else:  # rejected in __init__; kept so a new policy cannot slip through silently
            raise PrototxtError(f"solver: lr_policy '{policy}' is not supported")
        return float(rate)

    @property
    def needs_norm(self):
        """Whether a Step needs the gradient's norm (clip_gradients), so the gradient first."""
        return self.param.clip_gradients >= 0

    @staticmethod
    def squares(grads, slices):
        """The float64 sum of squares of grads over each slice (lo, hi), in order: what the
        gradient norm of prepare() adds up. grads: (n,) float32."""
        return [update.sum_of_squares(grads, lo, hi) for lo, hi in slices]

    def prepare(self, it, squares=None):
        """The Step for iteration it. squares: with clip_gradients >= 0, the gradient's sums of
        squares (Solver.squares) over a fixed list of slices covering it, which the norm adds
        in list order, so it is the same for any split of the work as long as the list is."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == it:
            if ahead[2] is not None:
                self.current_step = ahead[2]
            return ahead[1]
        rate = f32(self.learning_rate(it))
        clip_scale, grad_norm = f32(1.0), None
        clip = f32(self.param.clip_gradients)
        if clip >= 0:
            sumsq = 0.0
            for value in squares:
                sumsq += value
            grad_norm = math.sqrt(sumsq)
            # Caffe compares and scales in float32.
            if f32(grad_norm) > clip:
                clip_scale = clip / f32(grad_norm)
        correction = f32(1.0)
        if self.type == "Adam":
            # Caffe: sqrt(Dtype(1) - pow(beta2, t)) / (Dtype(1) - pow(beta1, t)) in double.
            t = it + 1
            beta1, beta2 = float(f32(self.param.momentum)), float(f32(self.param.momentum2))
            correction = f32(math.sqrt(1.0 - math.pow(beta2, t)) / (1.0 - math.pow(beta1, t)))
        return Step(it, rate, clip_scale, correction, grad_norm)

    def prepare_ahead(self, it):
        """Makes the Step of iteration it before its turn, for the prepare(it) that follows
        next: while the workers compute the iteration before, instead of between two runs,
        where they all wait for it. Only without clip_gradients, where a Step depends on `it`
        alone. current_step stays as the last prepare() left it until then."""
        if self.needs_norm:
            return
        kept = self.current_step
        step = self.prepare(it)
        # Only these policies set current_step, to a function of `it` (learning_rate).
        sets = self.param.lr_policy in ("step", "multistep")
        self._ahead = (it, step, self.current_step if sets else None)
        self.current_step = kept

    def apply(self, step, params, grads, lo, hi):
        """Update params[lo:hi] and the histories there; grads[lo:hi] is overwritten with the step
        taken (as Caffe leaves it in the diff). Touches nothing outside [lo, hi). Returns whether
        every updated weight is finite."""
        extra = (step.correction,) if self.type == "Adam" else ()   # changes every iteration
        finite = True
        for a, b, lr_mult, decay_mult in self._pieces(lo, hi):
            finite &= self._kernel(params, grads, *self.histories, lr_mult, decay_mult, a, b,
                                   step.rate, step.clip_scale, self._accum, self._weight_decay,
                                   self._l1, *self._hyper, *extra)
        return finite

    def _pieces(self, lo, hi):
        """[(a, b, lr_mult, decay_mult), ...]: [lo, hi) cut where the multipliers change, each
        piece's pair as float32 scalars (the kernels take them so). Cut once per slice."""
        key = (lo, hi)
        if key not in self._cuts:
            lr, decay = self.lr_mult[lo:hi], self.decay_mult[lo:hi]
            changes = np.flatnonzero((lr[1:] != lr[:-1]) | (decay[1:] != decay[:-1])) + 1
            bounds = [0, *changes.tolist(), hi - lo]
            self._cuts[key] = [(lo + a, lo + b, lr[a], decay[a])
                               for a, b in zip(bounds, bounds[1:]) if b > a]
        return self._cuts[key]

    def update(self, params, grads, it):
        """prepare + apply over the whole array as one slice; returns the Step."""
        n = params.size
        step = self.prepare(it, self.squares(grads, [(0, n)]))
        self.apply(step, params, grads, 0, n)
        return step
