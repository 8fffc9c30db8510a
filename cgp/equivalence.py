"""The convergence-equivalence harness: train the same solver from the same seed at
several thread counts and prove the runs bitwise identical; and compare one float32
SGD step with a float64 run of the same net.

It trains through the same Trainer as `cgp train`: there is no second engine.
"""
import hashlib
from dataclasses import dataclass, replace

import numpy as np
from threadpoolctl import threadpool_limits

from cgp.comm import make_communicator
from cgp.engine import Engine
from cgp.errors import CgpError
from cgp.runtime.pool import Pool
from cgp.train import Trainer

# A float32 step against the float64 reference: relative to the largest update.
STEP_TOLERANCE = 1e-3


@dataclass
class Outcome:
    threads: int
    workers: str
    sha256: str
    params: np.ndarray
    losses: list
    accuracy: dict


def train_run(sp, solver_path, config, iters, log=lambda line: None):
    """Train `iters` iterations; returns an Outcome with every iteration's loss."""
    trainer = Trainer(sp, solver_path, replace(config, max_iter=iters, progress=False), log=log)
    try:
        losses = []
        with threadpool_limits(limits=1):   # as Trainer.solve runs the iterations
            trainer.steps(iters, lambda it, loss, outputs, rate: losses.append(loss))
            accuracy = trainer.test(0)[0] if trainer.test_nets else {}
        params = trainer.net.params.copy()
    finally:
        trainer.close()
    digest = hashlib.sha256(params.tobytes()).hexdigest()
    return Outcome(config.threads, config.workers, digest, params, losses, accuracy)


def compare(outcomes):
    """Rows of (threads, workers, sha256, max |dw| vs the first, losses identical, accuracy,
    bitwise the same) and whether every run matched the first bit for bit."""
    first = outcomes[0]
    rows, ok = [], True
    for o in outcomes:
        dw = float(np.max(np.abs(o.params.astype(np.float64) - first.params))) if o.params.size else 0.0
        same_losses = o.losses == first.losses
        same = o.sha256 == first.sha256 and same_losses
        ok &= same
        rows.append((o.threads, o.workers, o.sha256, dw, same_losses, o.accuracy, same))
    return rows, ok


def step_against_float64(sp, solver_path, config):
    """One SGD step of the float32 engine against the same net run in float64 with a
    plain NumPy SGD update. Returns (max |w32 - w64| / max |w64 - w0|, loss32, loss64)."""
    trainer = Trainer(sp, solver_path, replace(config, max_iter=1, progress=False))
    try:
        net = trainer.net
        w0 = net.params.astype(np.float64)
        params64 = w0.copy()
        with threadpool_limits(limits=1):
            batch = trainer._batch(trainer.engine, 0, 0)
            pool = Pool(1, flush_denormals=config.denormals == "flush")
            engine64 = Engine(net, config.chunks, pool, make_communicator(pool), params=params64)
            _, loss64, grad64 = engine64.run(batch, 0, trainer.seed)
            loss32, _, _ = trainer.step()
        # The first step of Caffe's SGD from zero history: w -= lr*lr_mult*(g + wd*decay_mult*w).
        rate = trainer.solver.learning_rate(0)
        decay = sp.weight_decay * net.decay_mult.astype(np.float64)
        w64 = w0 - rate * net.lr_mult.astype(np.float64) * (grad64 + decay * w0)
        scale = max(float(np.max(np.abs(w64 - w0))), 1e-30)
        error = float(np.max(np.abs(net.params.astype(np.float64) - w64))) / scale
    finally:
        trainer.close()
    return error, loss32, loss64


def run(sp, solver_path, config, threads_list, iters, log=print, workers=None):
    """The whole harness; returns the process exit status (0: all equivalent). workers:
    every thread count runs with its workers as each of these (RunConfig.workers; default
    config's)."""
    workers = workers or (config.workers,)
    if not threads_list:
        raise CgpError("--threads needs at least one thread count")
    if iters < 1:
        raise CgpError(f"--iters must be at least 1, got {iters}")
    outcomes = []
    for kind in workers:
        for threads in threads_list:
            outcomes.append(train_run(sp, solver_path,
                                      replace(config, threads=threads, workers=kind), iters))
            log(f"{kind} {threads:>3}: trained {iters} iterations, last iteration's loss "
                f"{outcomes[-1].losses[-1]:.6g}")
    rows, ok = compare(outcomes)
    log("")
    log(f"{'threads':>7}  {'workers':<9}  {'sha256 of parameters':<64}  {'max|dw|':>9}  "
        f"{'losses':>9}  test of the final weights")
    for threads, kind, digest, dw, same_losses, accuracy, _ in rows:
        acc = ", ".join(f"{k} {v:.4f}" for k, v in accuracy.items()) or "-"
        log(f"{threads:>7}  {kind:<9}  {digest}  {dw:9.3g}  "
            f"{'identical' if same_losses else 'DIFFER':>9}  {acc}")
    status = 0 if ok else 1
    log("")
    log("bitwise identical across thread counts"
        + (", in " + " and in ".join(workers) if len(workers) > 1 else "") + ": "
        + ("yes" if ok else "NO"))
    plain_sgd = (sp.type == "SGD" and sp.iter_size == 1 and sp.clip_gradients < 0
                 and sp.regularization_type == "L2")
    if not plain_sgd:
        log("one-step float64 comparison: skipped (it covers SGD with L2, iter_size 1, no clipping)")
    else:
        error, loss32, loss64 = step_against_float64(sp, solver_path, replace(config, threads=1))
        passed = error <= STEP_TOLERANCE
        log(f"one SGD step, float32 engine vs float64 reference: max error {error:.3g} of the "
            f"largest update (tolerance {STEP_TOLERANCE:g}); loss {loss32:.7g} vs {loss64:.7g}: "
            + ("ok" if passed else "FAILED"))
        status = status or (0 if passed else 1)
    return status
