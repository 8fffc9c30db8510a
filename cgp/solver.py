"""Caffe's solvers (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam) over one flat parameter array.

A Solver turns a SolverParameter into learning rates and per-slice updates that reproduce BVLC
Caffe's arithmetic: float32 updates in Caffe's order, and learning rates computed with the same
mix of float and double that Caffe's C++ uses. It knows nothing about workers or ranks: the
data-parallel step (cgp.step) calls prepare() once per iteration, then apply() on slices
[lo, hi) in any order or in parallel.
Not here: snapshots (see `histories` for Caffe's history order) and the iteration loop.
"""
import math
from typing import NamedTuple, Optional

import numpy as np

from cgp.comm.local import blocks
from cgp.errors import PrototxtError, shorten
from cgp.runtime import update
from cgp.prototxt import non_finite, solver_extras
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
    momentum_scale: np.float32 = f32(1.0)   # SGD's momentum scaled during a warm-up

    def plain(self):
        """The Step as a tuple of Python numbers (floats hold float32 values exactly), as it
        travels to worker processes with every run (cgp.runtime.procs): a tuple of built-in types
        pickles and loads in a tenth of the time or less that a Step takes, whose pickle
        names its type and rebuilds NumPy scalars. Step.of makes the Step again."""
        return (self.it, float(self.rate), float(self.clip_scale), float(self.correction),
                self.grad_norm, float(self.momentum_scale))

    @classmethod
    def of(cls, plain):
        """The Step of its plain() tuple, with its float32 fields float32 again."""
        it, rate, clip_scale, correction, grad_norm, momentum_scale = plain
        return cls(it, f32(rate), f32(clip_scale), f32(correction), grad_norm,
                   f32(momentum_scale))


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


def _solver_type(param, where="solver"):
    """The solver's type string, resolved as Caffe's UpgradeSolverType does."""
    if param.HasField("solver_type"):
        if param.HasField("type"):
            raise PrototxtError(f"{where}: the deprecated 'solver_type' (enum) and 'type' "
                                "(string) cannot both be given; use 'type'")
        return SOLVER_TYPES[param.solver_type]
    # An unset 'type' reads as its default, "SGD".
    if param.type not in SOLVER_TYPES:
        raise PrototxtError(f"{where}: type '{shorten(param.type)}' is not supported; "
                            f"supported types: {', '.join(SOLVER_TYPES)}")
    return param.type


# Which rules read which hyperparameter (Caffe's sgd_solvers.hpp).
_MOMENTUM = ("SGD", "Nesterov", "AdaDelta", "Adam")
_DELTA = ("AdaGrad", "RMSProp", "AdaDelta", "Adam")
_NET_FIELDS = ("net_param", "train_net_param", "test_net_param")   # checked by the net
_FLT_MIN = float(np.finfo(np.float32).tiny)   # the smallest normal float32


def check_values(param, path=None, log=None):
    """Refuses, with PrototxtError naming the solver file `path` and the field, what Caffe
    would CHECK-fail or LOG(FATAL) on, and values that cannot be meant although Caffe
    takes them (a negative learning rate or interval, momentum of 1 or more, a NaN
    anywhere, ...). Where Caffe deliberately accepts an odd value, so does cgp, and says
    so once with log (unless None): base_lr 0, clip_gradients 0, gamma 0, test_interval 0
    beside test nets. Returns the solver type."""
    where = f"solver {shorten(path)}" if path else "solver"

    def fail(message):
        raise PrototxtError(f"{where}: {message}")

    def note(message):
        if log is not None:
            log(f"Note: {message}")

    bad = non_finite(param, skip=_NET_FIELDS)
    if bad is not None:
        fail(f"{bad[0]} is {bad[1]}; a number must be finite")
    type_ = _solver_type(param, where)
    # Caffe's constructor_sanity_check()s; AdaDelta and Adam use momentum, Caffe checks neither.
    if type_ in ("AdaGrad", "RMSProp") and param.momentum != 0:
        fail(f"momentum cannot be used with {type_} (momentum: {param.momentum:g})")
    if type_ == "RMSProp" and not 0 <= param.rms_decay < 1:
        fail(f"rms_decay should lie between 0 and 1 (rms_decay: {param.rms_decay:g})")
    # Caffe only fails on this once a blob has nonzero decay; checking up front is clearer.
    if param.regularization_type not in ("L1", "L2"):
        fail(f"regularization_type '{shorten(param.regularization_type)}' is not supported; "
             f"supported: L1, L2")
    # Not checked by Caffe, where it would divide by zero.
    if param.iter_size < 1:
        fail(f"iter_size must be at least 1 (iter_size: {param.iter_size})")
    # Caffe's Solver::Init.
    if param.average_loss < 1:
        fail(f"average_loss must be at least 1 (average_loss: {param.average_loss})")
    # Not checked by Caffe: values that would train the wrong way or never settle.
    if param.base_lr < 0:
        fail(f"base_lr must be at least 0 (base_lr: {param.base_lr:g}): a negative rate "
             "climbs the loss")
    if param.weight_decay < 0:
        fail(f"weight_decay must be at least 0 (weight_decay: {param.weight_decay:g})")
    if type_ in _MOMENTUM and not 0 <= param.momentum < 1:
        fail(f"momentum must lie in [0, 1) (momentum: {param.momentum:g}): from 1 on, the "
             "history never decays")
    if type_ == "Adam" and not 0 <= param.momentum2 < 1:
        fail(f"momentum2 must lie in [0, 1) (momentum2: {param.momentum2:g})")
    if type_ in _DELTA and not param.delta >= _FLT_MIN:
        fail(f"delta must be at least {_FLT_MIN:g} for {type_}, which divides by a root plus "
             f"delta; a smaller one is 0 where subnormals are flushed (delta: {param.delta:g})")
    for field in ("display", "snapshot", "test_interval"):
        if getattr(param, field) < 0:
            fail(f"{field} must be at least 0 (0: never), got {getattr(param, field)}")
    for i, count in enumerate(param.test_iter):
        if count < 1:
            fail(f"test_iter must be at least 1 (test_iter[{i}]: {count}); to train without "
                 "testing, set test_interval: 0")

    policy = param.lr_policy
    if policy not in LR_POLICIES:
        shown = f"'{shorten(policy)}'" if policy else "(none given)"
        fail(f"lr_policy {shown} is not supported; supported policies: {', '.join(LR_POLICIES)}")
    # Caffe checks these on the first learning rate; here before training starts.
    if policy in ("step", "exp", "inv", "multistep", "sigmoid") and param.gamma < 0:
        fail(f"lr_policy '{policy}' needs gamma >= 0 (gamma: {param.gamma:g})")
    if policy in ("step", "sigmoid") and param.stepsize <= 0:
        fail(f"lr_policy '{policy}' needs stepsize > 0 (stepsize: {param.stepsize})")
    if policy == "poly" and param.max_iter <= 0:   # not checked by Caffe: it would divide by zero
        fail(f"lr_policy 'poly' needs max_iter > 0 (max_iter: {param.max_iter})")
    if policy in ("inv", "poly") and param.power < 0:   # the rate would grow, not decay
        fail(f"lr_policy '{policy}' needs power >= 0 (power: {param.power:g})")

    if param.base_lr == 0:
        note("base_lr is 0: the weights never change (as in Caffe)")
    if param.clip_gradients == 0:
        note("clip_gradients is 0: every gradient is scaled to 0, so only weight decay "
             "changes the weights (as in Caffe)")
    if policy in ("step", "exp", "multistep") and param.gamma == 0:
        note(f"gamma is 0: lr_policy '{policy}' drops the learning rate to 0 at its first "
             "step (as in Caffe)")
    if param.test_interval == 0 and (param.test_iter or param.test_net or param.test_net_param):
        note("test_interval is 0: the test nets never run (as in Caffe)")
    return type_


class Solver:
    """A Caffe solver over flat float32 arrays of n parameters.

    param: caffe_pb2.SolverParameter. lr_mult, decay_mult: (n,) per-element blob multipliers
    (constant within a blob: apply() hands the kernels a slice's runs of equal ones).
    histories: the rule's state, each (n,) float32 in parameter order: [h] for SGD, Nesterov,
    AdaGrad, RMSProp; [h, u] for AdaDelta and [m, v] for Adam. Caffe's SolverState.history lists
    every blob of histories[0] and then every blob of histories[1]. shared: allocate them in
    shared memory, for updates that run in worker processes (cgp.runtime.procs).
    """

    def __init__(self, param, lr_mult, decay_mult, shared=False, blobs=()):
        """blobs: (offset, size) of each parameter blob, for the layer-wise rules (LARS,
        LARC), whose rate is a blob's."""
        self.type = check_values(param)
        self.extras = extras = solver_extras(param)
        self._check_extras(extras)
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
        # Layer-wise rates (LARS, LARC): each blob's (rate, multiplier) of the latest Step,
        # made by prepare() in this process, read by apply() in every worker.
        self.layerwise = extras.local_lr_auto or extras.larc
        self.blobs = list(blobs)
        if self.layerwise and not self.blobs:
            raise ValueError("layer-wise rates need the blobs' (offset, size)")
        self.local = aligned_zeros((len(self.blobs), 2), np.float32, shared)
        self._starts = np.array([offset for offset, _ in self.blobs] + [n], np.int64)

    def learning_rate(self, it):
        """Caffe's GetLearningRate at iteration it, returned as a float holding a float32 value.

        Follows Caffe's C++ types: pow(float, int) promotes to double (step, exp, multistep),
        while inv, poly and sigmoid stay in float. The rate depends on it alone; current_step
        is recorded for solverstate files.
        """
        p, x = self.param, self.extras
        policy = p.lr_policy
        base_lr, gamma, power = f32(p.base_lr), f32(p.gamma), f32(p.power)
        if 0 <= it < x.warmup_iter:
            return float(self._warmup_rate(it))
        if 0 <= it < x.rampup_interval:
            # NVIDIA Caffe: rampup_lr + (base_lr - rampup_lr) * alpha^2, in float.
            alpha = f32(it) / f32(x.rampup_interval)
            start = f32(x.rampup_lr)
            return float(start + (base_lr - start) * alpha * alpha)
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

    def _check_extras(self, x):
        where = "solver"
        if x.warmup_iter < 0 or x.rampup_interval < 0:
            raise PrototxtError(f"{where}: warmup_iter and rampup_interval must be at least 0")
        if x.warmup_iter and x.rampup_interval:
            raise PrototxtError(f"{where}: give Intel Caffe's warmup_iter or NVIDIA Caffe's "
                                "rampup_interval, not both")
        if x.local_lr_auto and x.larc:
            raise PrototxtError(f"{where}: give LARS (local_lr_auto) or LARC (larc), not both")
        if x.larc and x.larc_policy not in ("scale", "clip"):
            raise PrototxtError(f"{where}: larc_policy '{shorten(x.larc_policy)}' is not one "
                                "of scale, clip")
        if (x.local_lr_auto or x.larc) and self.type not in ("SGD", "Nesterov"):
            raise PrototxtError(f"{where}: LARS and LARC scale SGD's and Nesterov's rates; "
                                f"the solver is {self.type}")
        for name in ("warmup_start_lr", "local_gw_ratio", "rampup_lr", "larc_eta"):
            if not math.isfinite(getattr(x, name)) or getattr(x, name) < 0:
                raise PrototxtError(f"{where}: {name} must be finite and at least 0")

    def _warmup_rate(self, it):
        """Intel Caffe's warm-up: (it * base_lr + (warmup_iter - it) * warmup_start_lr) /
        warmup_iter, in float, with it below 0 taken as 0."""
        x = self.extras
        it = max(it, 0)
        return ((f32(it) * f32(self.param.base_lr)
                 + f32(x.warmup_iter - it) * f32(x.warmup_start_lr)) / f32(x.warmup_iter))

    @property
    def needs_norm(self):
        """Whether a Step needs norms of the gradient (clip_gradients) or of each blob's
        gradient and weights (LARS, LARC): then the gradient first (Solver.statistics)."""
        return self.param.clip_gradients >= 0 or self.layerwise

    def statistics(self, params, grads, blocks):
        """What prepare() adds up, for the fixed blocks (lo, hi) of the columns given, in
        order: per block, its gradient's sum of squares, then (with LARS or LARC) for each
        blob it holds a piece of, the weights' and the gradient's sums of squares there; all
        float64, each in index order. Every process computes its blocks'; the list of every
        block is the same for any split of the work."""
        values = []
        for lo, hi in blocks:
            values.append(update.sum_of_squares(grads, lo, hi))
            if self.layerwise:
                for _, a, b in self._blob_pieces(lo, hi):
                    values += [update.sum_of_squares(params, a, b),
                               update.sum_of_squares(grads, a, b)]
        return values

    def _blob_pieces(self, lo, hi):
        """[(blob, a, b), ...]: the blobs' pieces of columns lo..hi, in order."""
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        pieces = []
        for blob in range(max(first, 0), len(self.blobs)):
            a, b = max(lo, self._starts[blob]), min(hi, self._starts[blob + 1])
            if a >= hi:
                break
            if b > a:
                pieces.append((blob, int(a), int(b)))
        return pieces

    def prepare(self, it, statistics=None):
        """The Step for iteration it. statistics: with clip_gradients, LARS or LARC, those of
        every block of the parameters (Solver.statistics over comm.blocks, in order), which
        the norms add in that order, so they are the same for any split of the work."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == it:
            if ahead[2] is not None:
                self.current_step = ahead[2]
            return ahead[1]
        rate = f32(self.learning_rate(it))
        clip_scale, grad_norm = f32(1.0), None
        clip = f32(self.param.clip_gradients)
        if self.needs_norm:
            squares, blobs = self._gather(statistics)
        if clip >= 0:
            sumsq = 0.0
            for value in squares:
                sumsq += value
            grad_norm = math.sqrt(sumsq)
            # Caffe compares and scales in float32.
            if f32(grad_norm) > clip:
                clip_scale = clip / f32(grad_norm)
        if self.layerwise:
            self._layer_rates(rate, clip_scale, blobs)
        momentum_scale = f32(1.0)
        if self.type == "SGD" and 0 <= it < self.extras.warmup_iter:
            # Intel Caffe scales SGD's momentum by the rate's growth during the warm-up (1
            # where the rate before was 0, which would divide by it).
            before = self._warmup_rate(it - 1)
            momentum_scale = rate / before if before > 0 else f32(1.0)
        correction = f32(1.0)
        if self.type == "Adam":
            # Caffe: sqrt(Dtype(1) - pow(beta2, t)) / (Dtype(1) - pow(beta1, t)) in double.
            t = it + 1
            beta1, beta2 = float(f32(self.param.momentum)), float(f32(self.param.momentum2))
            correction = f32(math.sqrt(1.0 - math.pow(beta2, t)) / (1.0 - math.pow(beta1, t)))
        return Step(it, rate, clip_scale, correction, grad_norm, momentum_scale)

    def _gather(self, statistics):
        """(the blocks' gradient sums of squares in order, each blob's [weights', gradient's]
        sums of squares, added over its pieces in block order) from statistics()."""
        squares, blobs, at = [], np.zeros((len(self.blobs), 2)), 0
        for lo, hi in blocks(self.lr_mult.size):
            squares.append(statistics[at])
            at += 1
            if self.layerwise:
                for blob, _, _ in self._blob_pieces(lo, hi):
                    blobs[blob] += statistics[at:at + 2]
                    at += 2
        return squares, blobs

    def _layer_rates(self, rate, clip_scale, blobs):
        """Each blob's (rate, multiplier) for apply(), in float as the forks compute them:
        LARS (Intel Caffe) gw_ratio |w| / (|g| + weight_decay |w|), LARC (NVIDIA Caffe)
        (1 - momentum) eta |w| / |g|, 1 where a norm is 0, in place of a positive lr_mult
        (0 stays 0); LARC's clip policy takes min(rate, that) as the rate. |g| is the
        gradient as the rule sees it: clipped and divided by iter_size. apply() keeps a zero
        lr_mult zero."""
        x = self.extras
        for blob in range(len(self.blobs)):
            w = f32(math.sqrt(blobs[blob, 0]))
            g = f32(math.sqrt(blobs[blob, 1])) * clip_scale * self._accum
            local = f32(1.0)
            if w > 0 and g > 0:
                local = (f32(x.local_gw_ratio) * w / (g + self._weight_decay * w)
                         if x.local_lr_auto else
                         (f32(1.0) - f32(self.param.momentum)) * f32(x.larc_eta) * w / g)
            if x.larc and x.larc_policy == "clip":
                self.local[blob] = (min(rate, local), f32(1.0))
            else:
                self.local[blob] = (rate, local)

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
        hyper = self._hyper
        if self.type == "SGD":
            hyper = (hyper[0] * step.momentum_scale,)   # exactly momentum unless warming up
        h, u = self.histories[0], self.histories[-1]   # a one-history rule reads h alone
        finite = True
        for a, b, lr_mult, decay_mult, blob in self._pieces(lo, hi):
            rate = step.rate
            if self.layerwise:   # a blob's rate in place of a positive lr_mult
                rate, local = self.local[blob]
                lr_mult = local if lr_mult > 0 else lr_mult
            finite &= self._kernel(params, grads, h, u, lr_mult, decay_mult, a, b, rate,
                                   step.clip_scale, self._accum, self._weight_decay, self._l1,
                                   hyper + extra)
        return finite

    def _pieces(self, lo, hi):
        """[(a, b, lr_mult, decay_mult, blob), ...]: [lo, hi) cut where the multipliers change
        (and, with layer-wise rates, where a blob ends), each piece's pair as float32 scalars
        (the kernels take them so), and its blob where layer-wise. Cut once per slice."""
        key = (lo, hi)
        if key not in self._cuts:
            lr, decay = self.lr_mult[lo:hi], self.decay_mult[lo:hi]
            changes = set((np.flatnonzero((lr[1:] != lr[:-1]) | (decay[1:] != decay[:-1]))
                           + 1).tolist())
            if self.layerwise:
                changes |= {int(s) - lo for s in self._starts if lo < s < hi}
            bounds = [0, *sorted(changes), hi - lo]
            self._cuts[key] = [
                (lo + a, lo + b, lr[a], decay[a],
                 int(np.searchsorted(self._starts, lo + a, side="right")) - 1)
                for a, b in zip(bounds, bounds[1:]) if b > a]
        return self._cuts[key]

    def update(self, params, grads, it):
        """prepare + apply over the whole array as one slice; returns the Step."""
        n = params.size
        step = self.prepare(it, self.statistics(params, grads, blocks(n))
                            if self.needs_norm else None)
        self.apply(step, params, grads, 0, n)
        return step
