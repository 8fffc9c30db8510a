"""Solver tests: every rule against a float64 NumPy reference of its formula and against a float32
twin in Caffe's order of operations (bitwise), every lr policy against its hand formula, slicing
invariance, and the error messages for what Caffe rejects."""
import math
import platform
import re
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from cgp.comm.local import blocks
from cgp.errors import PrototxtError
from cgp.prototxt import parse_solver
from cgp.runtime import update
from cgp.solver import Solver, multistep_count

N = 37          # odd, so slices do not fall on SIMD-width boundaries
STEPS = 5

HYPER = {       # per-rule settings; AdaGrad and RMSProp must have momentum 0 in Caffe
    "SGD": "momentum: 0.9",
    "Nesterov": "momentum: 0.9",
    "AdaGrad": "delta: 1e-6",
    "RMSProp": "rms_decay: 0.95 delta: 1e-6",
    "AdaDelta": "momentum: 0.95 delta: 1e-6",
    "Adam": "momentum: 0.9 momentum2: 0.999 delta: 1e-8",
}

CASES = {       # extra solver fields, on top of the rule's
    "plain": "",
    "l2": "weight_decay: 0.05",
    "l1": "weight_decay: 0.05 regularization_type: 'L1'",
    "iter_size": "weight_decay: 0.01 iter_size: 3",
    "clip_triggered": "weight_decay: 0.01 clip_gradients: 0.5",
    "clip_not_triggered": "weight_decay: 0.01 clip_gradients: 1000",
    "clip_and_iter_size": "clip_gradients: 0.5 iter_size: 2",
}


def f(x):
    """A solver field as Caffe reads it: a float32 value."""
    return float(np.float32(x))


def solver_param(text):
    return parse_solver(text)


def rule_param(type_, extra="", lr="base_lr: 0.05 lr_policy: 'fixed'"):
    return solver_param(f"type: '{type_}' {lr} {HYPER[type_]} {extra}")


def multipliers():
    """Per-element lr_mult and decay_mult with zeros (frozen, undecayed) and non-unit values."""
    lr_mult = np.tile(np.array([1, 0, 2, 1, 0.5], np.float32), 8)[:N]
    decay_mult = np.tile(np.array([1, 1, 0, 2, 1, 0, 1], np.float32), 6)[:N]
    return lr_mult, decay_mult


def data(seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(N).astype(np.float32)
    w[5] = 0.0                          # L1's sign(0) = 0
    grads = [(0.3 * rng.standard_normal(N)).astype(np.float32) for _ in range(STEPS)]
    return w, grads


# ----------------------------------------------------------------------------- float64 reference

def reference(param, w, grads, lr_mult, decay_mult, rate):
    """The solver formulas in float64; returns w after len(grads) steps."""
    type_ = param.type
    w = w.astype(np.float64)
    h = np.zeros_like(w)
    u = np.zeros_like(w)
    momentum, delta = f(param.momentum), f(param.delta)
    local_rate = rate * lr_mult.astype(np.float64)
    local_decay = f(param.weight_decay) * decay_mult.astype(np.float64)
    for it, g in enumerate(grads):
        g = g.astype(np.float64)
        if param.clip_gradients >= 0:
            norm = math.sqrt(np.sum(g * g))
            if norm > param.clip_gradients:
                g = g * (f(param.clip_gradients) / norm)
        g = g / param.iter_size
        if param.regularization_type == "L1":
            g = g + local_decay * np.sign(w)
        else:
            g = g + local_decay * w
        if type_ == "SGD":
            h = local_rate * g + momentum * h
            step = h
        elif type_ == "Nesterov":
            previous = h
            h = momentum * h + local_rate * g
            step = (1 + momentum) * h - momentum * previous
        elif type_ == "AdaGrad":
            h = h + g * g
            step = local_rate * g / (np.sqrt(h) + delta)
        elif type_ == "RMSProp":
            rms_decay = f(param.rms_decay)
            h = rms_decay * h + (1 - rms_decay) * g * g
            step = local_rate * g / (np.sqrt(h) + delta)
        elif type_ == "AdaDelta":
            h = momentum * h + (1 - momentum) * g * g
            d = g * np.sqrt((u + delta) / (h + delta))
            u = momentum * u + (1 - momentum) * d * d
            step = local_rate * d
        elif type_ == "Adam":
            beta1, beta2 = momentum, f(param.momentum2)
            h = beta1 * h + (1 - beta1) * g
            u = beta2 * u + (1 - beta2) * g * g
            t = it + 1
            correction = math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
            step = local_rate * correction * h / (np.sqrt(u) + delta)
        w = w - step
    return w


def run_solver(param, w, grads, lr_mult, decay_mult):
    solver = Solver(param, lr_mult, decay_mult)
    w = w.copy()
    for it, g in enumerate(grads):
        solver.update(w, g.copy(), it)
    return w, solver


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("type_", HYPER)
def test_rule_matches_float64_reference(type_, case):
    param = rule_param(type_, CASES[case])
    lr_mult, decay_mult = multipliers()
    w0, grads = data()
    w, _ = run_solver(param, w0, grads, lr_mult, decay_mult)
    expected = reference(param, w0, grads, lr_mult, decay_mult, float(np.float32(0.05)))
    np.testing.assert_allclose(w, expected, rtol=2e-5, atol=2e-6)
    assert np.any(w != w0)
    # lr_mult 0 freezes a parameter exactly, whatever its decay and history
    assert np.array_equal(w[lr_mult == 0], w0[lr_mult == 0])


def test_clip_cases_do_what_their_names_say():
    w, grads = data()
    lr_mult, decay_mult = multipliers()
    triggered = Solver(rule_param("SGD", CASES["clip_triggered"]), lr_mult, decay_mult)
    step = triggered.prepare(0, triggered.statistics(w, grads[0], [(0, N)]))
    assert step.grad_norm > 0.5 and step.clip_scale == np.float32(0.5) / np.float32(step.grad_norm)
    quiet = Solver(rule_param("SGD", CASES["clip_not_triggered"]), lr_mult, decay_mult)
    assert quiet.prepare(0, quiet.statistics(w, grads[0], [(0, N)])).clip_scale == 1
    off = Solver(rule_param("SGD"), lr_mult, decay_mult)
    assert not off.needs_norm and off.prepare(0).grad_norm is None


# ------------------------------------------------------- float32 twin in Caffe's operation order

def caffe_order_float32(param, w, grads, lr_mult, decay_mult, rate):
    """Caffe's CPU sequence written with whole-array float32 NumPy ops; must match bitwise."""
    f32 = np.float32
    type_ = param.type
    w = w.copy()
    h = np.zeros_like(w)
    u = np.zeros_like(w)
    momentum, delta, rate = f32(param.momentum), f32(param.delta), f32(rate)
    local_rate = rate * lr_mult
    local_decay = f32(param.weight_decay) * decay_mult
    for it, g in enumerate(grads):
        g = g.copy()
        clip = f32(param.clip_gradients)
        if clip >= 0:
            norm = f32(math.sqrt(np.sum(g.astype(np.float64) ** 2)))
            if norm > clip:
                g = g * (clip / norm)
        g = g * (f32(1) / f32(param.iter_size))
        sign = ((w > 0).astype(np.float32) - (w < 0).astype(np.float32))
        decayed = local_decay * (sign if param.regularization_type == "L1" else w) + g
        g = np.where(local_decay != 0, decayed, g)
        if type_ == "SGD":
            h = local_rate * g + momentum * h
            step = h
        elif type_ == "Nesterov":
            previous = h
            h = local_rate * g + momentum * h
            step = (f32(1) + momentum) * h + (-momentum) * previous
        elif type_ == "AdaGrad":
            h = g * g + h
            step = local_rate * (g / (np.sqrt(h) + delta))
        elif type_ == "RMSProp":
            rms_decay = f32(param.rms_decay)
            h = (f32(1) - rms_decay) * (g * g) + rms_decay * h
            step = local_rate * (g / (np.sqrt(h) + delta))
        elif type_ == "AdaDelta":
            h = (f32(1) - momentum) * (g * g) + momentum * h
            d = g * np.sqrt((delta + u) / (delta + h))
            u = (f32(1) - momentum) * (d * d) + momentum * u
            step = local_rate * d
        elif type_ == "Adam":
            beta1, beta2 = float(momentum), float(f32(param.momentum2))
            t = it + 1
            correction = f32(math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t))
            h = (f32(1) - f32(beta1)) * g + f32(beta1) * h
            u = (f32(1) - f32(beta2)) * (g * g) + f32(beta2) * u
            step = (local_rate * correction) * (h / (np.sqrt(u) + delta))
        w = w - step
    return w


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("type_", HYPER)
def test_rule_is_caffe_float32_arithmetic(type_, case):
    param = rule_param(type_, CASES[case])
    lr_mult, decay_mult = multipliers()
    w0, grads = data(1)
    w, _ = run_solver(param, w0, grads, lr_mult, decay_mult)
    expected = caffe_order_float32(param, w0, grads, lr_mult, decay_mult, 0.05)
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, expected)


# ------------------------------------------------------------------------- slicing invariance

@pytest.mark.parametrize("type_", HYPER)
def test_slices_are_bitwise_identical_to_one_slice(type_):
    param = rule_param(type_, "weight_decay: 0.01 clip_gradients: 0.5 iter_size: 2")
    lr_mult, decay_mult = multipliers()
    w0, grads = data(2)
    whole, cut = Solver(param, lr_mult, decay_mult), Solver(param, lr_mult, decay_mult)
    w_whole, w_cut = w0.copy(), w0.copy()
    slices = [(0, 13), (13, 14), (14, N)]
    for it, g in enumerate(grads):
        g_whole, g_cut = g.copy(), g.copy()
        step = whole.prepare(it, whole.statistics(w_whole, g_whole, blocks(N)))
        whole.apply(step, w_whole, g_whole, 0, N)
        for lo, hi in reversed(slices):         # order does not matter either
            cut.apply(step, w_cut, g_cut, lo, hi)
        np.testing.assert_array_equal(g_whole, g_cut)
    np.testing.assert_array_equal(w_whole, w_cut)
    for a, b in zip(whole.histories, cut.histories):
        np.testing.assert_array_equal(a, b)


def test_apply_touches_only_its_slice():
    lr_mult, decay_mult = multipliers()
    solver = Solver(rule_param("Adam", "weight_decay: 0.1"), lr_mult, decay_mult)
    w0, grads = data(3)
    w, g = w0.copy(), grads[0].copy()
    solver.apply(solver.prepare(0), w, g, 10, 20)
    outside = np.r_[0:10, 20:N]
    np.testing.assert_array_equal(w[outside], w0[outside])
    np.testing.assert_array_equal(g[outside], grads[0][outside])
    assert not np.any(solver.histories[0][outside]) and np.all(solver.histories[0][10:20] != 0)


def test_claim_changes_nothing_and_compiles_to_a_prefetch():
    """runtime.update.claim, which a fused update on two workers or more runs first: every
    value stays, at any bounds (mid-line, empty, the last element), and the compiled loop
    holds a prefetch (PREFETCHW where the CPU has it), so it is not compiled away."""
    a = np.arange(3 * N, dtype=np.float32)
    before = a.copy()
    for lo, hi in [(0, a.size), (5, 37), (20, 20), (a.size - 1, a.size)]:
        update.claim(a, lo, hi)
    np.testing.assert_array_equal(a, before)
    if platform.machine().lower() in ("x86_64", "amd64"):
        fresh = njit(update.claim.py_func)   # Numba shows no code loaded from its cache
        fresh(a, 0, a.size)
        asm = "".join(fresh.inspect_asm().values())
        assert re.search(r"^\s+prefetch", asm, re.MULTILINE)


def test_grads_hold_the_step_taken():
    lr_mult, decay_mult = multipliers()
    solver = Solver(rule_param("SGD"), lr_mult, decay_mult)
    w0, grads = data(4)
    w, g = w0.copy(), grads[0].copy()
    solver.update(w, g, 0)
    np.testing.assert_array_equal(w, w0 - g)
    np.testing.assert_array_equal(solver.histories[0], g)


def test_history_count_per_rule():
    lr_mult, decay_mult = multipliers()
    counts = {t: len(Solver(rule_param(t), lr_mult, decay_mult).histories) for t in HYPER}
    assert counts == {"SGD": 1, "Nesterov": 1, "AdaGrad": 1, "RMSProp": 1, "AdaDelta": 2,
                      "Adam": 2}


# ------------------------------------------------------------------------------ learning rates

ITERS = [0, 1, 2, 7, 10, 99, 100, 101, 1000, 4999]


def lr_solver(text):
    ones = np.ones(3, np.float32)
    return Solver(solver_param("base_lr: 0.01 " + text), ones, ones)


POLICIES = {    # hand formulas over the fields' float32 values (exp amplifies their rounding)
    "fixed": ("lr_policy: 'fixed'", lambda it: f(0.01)),
    "step": ("lr_policy: 'step' gamma: 0.1 stepsize: 100",
             lambda it: f(0.01) * f(0.1) ** (it // 100)),
    "exp": ("lr_policy: 'exp' gamma: 0.999", lambda it: f(0.01) * f(0.999) ** it),
    "inv": ("lr_policy: 'inv' gamma: 0.0001 power: 0.75",
            lambda it: f(0.01) * (1 + f(0.0001) * it) ** -0.75),
    # Caffe divides it / max_iter in float32: near max_iter, 1 - it/max_iter keeps its error.
    "poly": ("lr_policy: 'poly' power: 2 max_iter: 5000",
             lambda it: f(0.01) * (1 - f(it / 5000)) ** 2),
    "poly_fractional": ("lr_policy: 'poly' power: 0.5 max_iter: 5000",
                        lambda it: f(0.01) * (1 - f(it / 5000)) ** 0.5),
    "sigmoid": ("lr_policy: 'sigmoid' gamma: 0.05 stepsize: 100",
                lambda it: f(0.01) / (1 + math.exp(-f(0.05) * (it - 100)))),
    "multistep": ("lr_policy: 'multistep' gamma: 0.5 stepvalue: 7 stepvalue: 100 "
                  "stepvalue: 1000",
                  lambda it: f(0.01) * 0.5 ** sum(it >= s for s in (7, 100, 1000))),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_learning_rate_policy(policy):
    text, formula = POLICIES[policy]
    solver = lr_solver(text)
    for it in ITERS:
        rate = solver.learning_rate(it)
        assert rate == float(np.float32(rate))      # a float32 value, as Caffe's Dtype rate
        assert rate == pytest.approx(formula(it), rel=2e-6), it


def test_learning_rate_is_a_function_of_the_iteration_alone():
    solver = lr_solver("lr_policy: 'multistep' gamma: 0.5 stepvalue: 7 stepvalue: 100")
    forward = [solver.learning_rate(it) for it in range(120)]
    backward = [solver.learning_rate(it) for it in reversed(range(120))][::-1]
    assert forward == backward


def test_current_step_follows_caffe():
    solver = lr_solver("lr_policy: 'multistep' gamma: 0.5 stepvalue: 7 stepvalue: 100")
    solver.learning_rate(50)
    assert solver.current_step == 1
    solver = lr_solver("lr_policy: 'step' gamma: 0.5 stepsize: 30")
    solver.learning_rate(95)
    assert solver.current_step == 3
    assert lr_solver("lr_policy: 'inv' gamma: 0.1 power: 1").current_step == 0


def caffe_multistep(stepvalues, last_it):
    """Caffe's stateful loop, called once per iteration from 0."""
    current_step, steps = 0, []
    for it in range(last_it + 1):
        if current_step < len(stepvalues) and it >= stepvalues[current_step]:
            current_step += 1
        steps.append(current_step)
    return steps


@pytest.mark.parametrize("stepvalues", [[3, 5, 9], [], [0], [4, 4, 4], [9, 2, 5], [1, 2, 3]])
def test_multistep_count_matches_caffe_stateful_loop(stepvalues):
    assert [multistep_count(stepvalues, it) for it in range(15)] == caffe_multistep(stepvalues, 14)


def test_adam_bias_correction():
    lr_mult, decay_mult = multipliers()
    solver = Solver(rule_param("Adam"), lr_mult, decay_mult)
    beta1, beta2 = float(np.float32(0.9)), float(np.float32(0.999))
    for it in (0, 1, 10, 1000):
        t = it + 1
        expected = math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        assert solver.prepare(it).correction == \
            pytest.approx(expected, rel=1e-7)


# ------------------------------------------------------------------------------------ errors

def test_legacy_solver_type_enum():
    lr_mult, decay_mult = multipliers()
    param = solver_param("solver_type: ADAM base_lr: 0.1 lr_policy: 'fixed'")
    assert Solver(param, lr_mult, decay_mult).type == "Adam"
    assert Solver(solver_param("lr_policy: 'fixed'"), lr_mult, decay_mult).type == "SGD"


@pytest.mark.parametrize("text, words", [
    ("type: 'Adamax' lr_policy: 'fixed'",
     ["Adamax", "SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam"]),
    ("type: 'Adam' solver_type: ADAM lr_policy: 'fixed'", ["solver_type", "type"]),
    ("lr_policy: 'cosine'", ["cosine", "fixed, step, exp, inv, multistep, poly, sigmoid"]),
    ("base_lr: 0.1", ["lr_policy", "(none given)", "fixed, step"]),
    ("type: 'AdaGrad' momentum: 0.9 lr_policy: 'fixed'", ["momentum", "AdaGrad"]),
    ("type: 'RMSProp' momentum: 0.9 lr_policy: 'fixed'", ["momentum", "RMSProp"]),
    ("type: 'RMSProp' rms_decay: 1 lr_policy: 'fixed'", ["rms_decay", "between 0 and 1"]),
    ("type: 'RMSProp' rms_decay: -0.1 lr_policy: 'fixed'", ["rms_decay"]),
    ("regularization_type: 'L3' lr_policy: 'fixed'", ["L3", "L1, L2"]),
    ("lr_policy: 'step' gamma: 0.1", ["stepsize"]),
    ("lr_policy: 'sigmoid' gamma: 0.1", ["stepsize"]),
    ("lr_policy: 'exp' gamma: -0.1", ["gamma"]),
    ("lr_policy: 'poly' power: 1", ["max_iter"]),
    ("iter_size: 0 lr_policy: 'fixed'", ["iter_size"]),
])
def test_rejected_solver(text, words):
    lr_mult, decay_mult = multipliers()
    with pytest.raises(PrototxtError) as error:
        Solver(solver_param(text), lr_mult, decay_mult)
    for word in words:
        assert word in str(error.value)


def test_momentum_is_allowed_where_caffe_allows_it():
    lr_mult, decay_mult = multipliers()
    for type_ in ("SGD", "Nesterov", "AdaDelta", "Adam"):
        Solver(solver_param(f"type: '{type_}' momentum: 0.9 lr_policy: 'fixed'"), lr_mult,
               decay_mult)


def test_a_step_crosses_to_worker_processes_unchanged():
    """A Step's plain form pickled (as worker processes receive it) makes the same Step again,
    of the same types: float32 learning rate, clip scale and correction, whose every bit
    survives; the plain form holds built-in types only, which pickle without naming a type."""
    import pickle

    from cgp.solver import Step
    for norm in (2.5, None):
        step = Step(7, np.float32(1) / np.float32(3), np.float32(0.1), np.float32(np.pi), norm)
        plain = step.plain()
        assert {type(v) for v in plain} <= {int, float, type(None)}
        back = Step.of(pickle.loads(pickle.dumps(plain)))
        assert back == step and [type(v) for v in back] == [type(v) for v in step]
        assert [type(v) for v in back[1:4]] == [np.float32] * 3
        assert b"cgp" not in pickle.dumps(plain)


def test_a_step_made_ahead_is_the_step_and_keeps_current_step_until_its_turn():
    """Solver.prepare_ahead(it): the Step that prepare(it) gives, made early; current_step
    (written into .solverstate files) stays the last prepare's until prepare(it) takes it,
    and a prepare of another iteration ignores it. With clip_gradients, whose Step needs
    the gradient, nothing is made ahead."""
    n = 4
    param = solver_param("type: 'SGD' base_lr: 0.1 momentum: 0.9 lr_policy: 'step' "
                         "gamma: 0.5 stepsize: 3")
    ones = np.ones(n, np.float32)
    plain, ahead = Solver(param, ones, ones), Solver(param, ones, ones)
    for it in range(7):
        ahead.prepare_ahead(it + 1)
        assert ahead.current_step == plain.current_step
        assert ahead.prepare(it + 1) == plain.prepare(it + 1)
        assert ahead.current_step == plain.current_step == (it + 1) // 3
    ahead.prepare_ahead(5)
    assert ahead.prepare(2) == plain.prepare(2)
    assert ahead.current_step == 0 and ahead.prepare(5).it == 5
    # A policy that never sets current_step: one restored meanwhile (a .solverstate) stays.
    fixed = Solver(solver_param("type: 'SGD' base_lr: 0.1 lr_policy: 'fixed'"), ones, ones)
    fixed.prepare_ahead(4)
    fixed.current_step = 3
    assert fixed.prepare(4).it == 4 and fixed.current_step == 3
    clipped = Solver(solver_param("type: 'SGD' base_lr: 0.1 clip_gradients: 1 "
                                  "lr_policy: 'fixed'"), ones, ones)
    clipped.prepare_ahead(1)
    grads = np.full(n, 2, np.float32)
    assert clipped.prepare(1, clipped.statistics(grads, grads, blocks(n))).clip_scale == np.float32(0.25)


def test_a_slice_is_cut_where_the_multipliers_change():
    """The kernels take a piece's multipliers as float32 scalars: apply() cuts its slice
    wherever lr_mult or decay_mult changes, and nowhere else."""
    lr = np.array([1, 1, 1, 2, 2, 0, 0, 0], np.float32)
    decay = np.array([1, 1, 0, 0, 0, 0, 1, 1], np.float32)
    solver = Solver(rule_param("SGD"), lr, decay)
    pieces = solver._pieces(1, 7)
    assert [(a, b, float(m), float(d)) for a, b, m, d, _ in pieces] == [
        (1, 2, 1, 1), (2, 3, 1, 0), (3, 5, 2, 0), (5, 6, 0, 0), (6, 7, 0, 1)]
    assert all(type(m) is np.float32 and type(d) is np.float32 for _, _, m, d, _ in pieces)
    assert solver._pieces(3, 3) == []
    # With layer-wise rates the pieces end where a blob ends too, each naming its blob.
    lars = Solver(rule_param("SGD", "local_lr_auto: true"), lr, decay, blobs=[(0, 4), (4, 4)])
    assert [(a, b, blob) for a, b, _, _, blob in lars._pieces(1, 7)] == [
        (1, 2, 0), (2, 3, 0), (3, 4, 0), (4, 5, 1), (5, 6, 1), (6, 7, 1)]


# ------------------------------------------------------------------- large-batch rules (forks)

def test_intel_warmup_and_nvidia_rampup_rates():
    """Intel Caffe's warmup_iter: the rate ramps linearly from warmup_start_lr to base_lr;
    NVIDIA Caffe's rampup_interval: quadratically from rampup_lr; after them, the policy.
    SGD's momentum grows with the rate during Intel's warm-up."""
    lr_mult, decay_mult = multipliers()
    warm = Solver(rule_param("SGD", "warmup_iter: 4 warmup_start_lr: 0.01",
                             lr="base_lr: 0.1 lr_policy: 'step' stepsize: 10 gamma: 0.5"),
                  lr_mult, decay_mult)
    for it in range(6):
        want = (it * 0.1 + (4 - it) * 0.01) / 4 if it < 4 else 0.1
        assert warm.learning_rate(it) == pytest.approx(want, rel=1e-6)
    step = warm.prepare(2)
    assert step.momentum_scale == pytest.approx((0.1 * 2 + 0.01 * 2) / (0.1 + 0.01 * 3), rel=1e-6)
    assert warm.prepare(5).momentum_scale == 1
    ramp = Solver(rule_param("SGD", "rampup_interval: 5 rampup_lr: 0.02",
                             lr="base_lr: 0.1 lr_policy: 'fixed'"), lr_mult, decay_mult)
    for it in range(7):
        want = 0.02 + (0.1 - 0.02) * (it / 5) ** 2 if it < 5 else 0.1
        assert ramp.learning_rate(it) == pytest.approx(want, rel=1e-6)


BLOBS = [(0, 10), (10, 7), (17, N - 17)]


def layerwise_reference(w, g, lr_mult, rate, wd, rule, ratio, momentum=0.0):
    """float64: each blob's local rate (LARS: ratio |w| / (|g| + wd |w|), LARC: (1 -
    momentum) ratio |w| / |g|, without weight decay), in place of a positive lr_mult, then
    w -= rate * local * (g + wd w), from zero history."""
    w, g = w.astype(np.float64), g.astype(np.float64)
    out = w.copy()
    for offset, size in BLOBS:
        s = slice(offset, offset + size)
        wn, gn = np.linalg.norm(w[s]), np.linalg.norm(g[s])
        local = (ratio * wn / (gn + wd * wn) if rule == "lars"
                 else (1 - momentum) * ratio * wn / gn)
        mult = np.where(lr_mult[s] > 0, local, 0.0)
        out[s] = w[s] - rate * mult * (g[s] + wd * w[s])
    return out


@pytest.mark.parametrize("rule", ["lars", "larc"])
def test_layerwise_rates_against_a_float64_reference(rule):
    """One SGD step with LARS (Intel Caffe's local_lr_auto) or LARC (NVIDIA Caffe's larc,
    scale policy) against the float64 arithmetic; a frozen piece (lr_mult 0) stays frozen."""
    lr_mult, decay_mult = multipliers()
    decay_mult[:] = 1
    text = ("local_lr_auto: true local_gw_ratio: 0.02" if rule == "lars"
            else "larc: true larc_eta: 0.02")
    solver = Solver(rule_param("SGD", f"weight_decay: 0.01 {text}"), lr_mult, decay_mult,
                    blobs=BLOBS)
    rng = np.random.default_rng(3)
    w = rng.standard_normal(N).astype(np.float32)
    g = (rng.standard_normal(N) * 0.1).astype(np.float32)
    momentum = float(np.float32(solver.param.momentum))
    want = layerwise_reference(w, g, lr_mult, 0.05, 0.01, rule, 0.02, momentum)
    params, grads = w.copy(), g.copy()
    step = solver.prepare(0, solver.statistics(params, grads, blocks(N)))
    solver.apply(step, params, grads, 0, N)
    np.testing.assert_allclose(params, want, rtol=2e-6, atol=1e-7)
    assert np.array_equal(params[lr_mult == 0], w[lr_mult == 0])


def test_larc_clip_caps_the_global_rate():
    lr_mult, decay_mult = multipliers()
    solver = Solver(rule_param("SGD", "larc: true larc_eta: 1000 larc_policy: 'clip'"),
                    lr_mult, decay_mult, blobs=BLOBS)
    rng = np.random.default_rng(4)
    w, g = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    solver.prepare(0, solver.statistics(w, g, blocks(N)))
    for blob, (offset, _) in enumerate(BLOBS):   # the eta is huge: the cap is the rate
        assert tuple(solver.local[blob]) == (np.float32(0.05), 1.0)


def test_large_batch_fields_are_checked():
    lr_mult, decay_mult = multipliers()
    for extra, message in [("warmup_iter: 3 rampup_interval: 3", "not both"),
                           ("local_lr_auto: true larc: true", "LARS .* or LARC"),
                           ("larc: true larc_policy: 'cap'", "larc_policy 'cap'"),
                           ("local_gw_ratio: -1", "local_gw_ratio must be")]:
        with pytest.raises(PrototxtError, match=message):
            Solver(rule_param("SGD", extra), lr_mult, decay_mult, blobs=BLOBS)
    with pytest.raises(PrototxtError, match="LARS and LARC scale SGD"):
        Solver(rule_param("Adam", "local_lr_auto: true"), lr_mult, decay_mult, blobs=BLOBS)


CACHED = """
import numpy as np
from cgp.runtime import update
f = np.float32
a = [np.ones(8, f) for _ in range(4)]
args = (f(1), f(1), 0, 8, f(0.1), f(1), f(1), f(0), False)
hyper = {"sgd": (f(0.9),), "nesterov": (f(0.9),), "adagrad": (f(1e-8),),
         "rmsprop": (f(0.9), f(1e-8)), "adadelta": (f(0.9), f(1e-6)),
         "adam": (f(0.9), f(0.999), f(1e-8), f(1))}
for name, h in hyper.items():
    kernel = getattr(update, name + "_update")
    kernel(a[0], a[1], a[2], a[3], *args, h)
    print(name, sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values()))
"""


def test_every_update_kernel_loads_from_numbas_cache():
    """The kernels that update_kernel builds keep Numba's cache: a second process compiles
    none of them (a rule passed as a dispatcher would miss in every process)."""
    runs = [subprocess.run([sys.executable, "-c", CACHED], capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    second = runs[1]
    assert len(second) == 18
    for name, hits, misses in zip(second[::3], second[1::3], second[2::3]):
        assert (hits, misses) == ("1", "0"), name
