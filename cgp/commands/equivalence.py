"""The convergence-equivalence harness: train the same solver from the same seed at
several thread counts and prove the runs bitwise identical; and compare one float32
SGD step with a float64 run of the same net.

It trains through the same Trainer as `cgp train`: there is no second engine.
"""
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from cgp.comm import make_communicator
from cgp.device import make_engine, select_backend
from cgp.errors import CgpError
from cgp.prototxt import format_solver, solver_extras
from cgp.runtime.pool import Pool
from cgp.train import RunConfig, Trainer

# A float32 step against the float64 reference: relative to the largest update.
STEP_TOLERANCE = 1e-3
# The device engine's float64 gradient against the CPU engine's, relative to the largest
# element of each blob's: the same arithmetic in other orders (a GEMM's, a reduction's).
DEVICE_TOLERANCE = 1e-9
NOISE_FLOOR = 1e-4


@dataclass
class Outcome:
    threads: int
    workers: str
    sha256: str
    params: np.ndarray
    losses: list
    accuracy: dict
    ranks: int = 1


def refusal(sharing):
    """Why the harness does not run a mode that shares weights asynchronously."""
    return (f"cgp equivalence proves that runs are bitwise identical; --sharing {sharing} is "
            "not reproducible by nature (each group of ranks adds its update to the shared "
            "weights whenever it is done, so the weights depend on timing, even between two "
            "runs with the same settings): there is nothing to prove. --staleness S "
            "overlaps communication with a fixed delay that stays bitwise reproducible")


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


def mpi_run(sp, solver_path, config, ranks, iters):
    """train_run on `ranks` MPI ranks of this machine (mpirun, cgp.comm.mpi.local_job): each rank
    runs this module (main_rank below), rank 0 writes the outcome, read back here."""
    from cgp.comm import mpi
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "solver.prototxt").write_text(format_solver(sp))
        (folder / "spec.json").write_text(json.dumps({
            "solver_path": None if solver_path is None else str(solver_path),
            "config": asdict(config), "iters": iters}))
        argv, env = mpi.local_job(ranks, ["-m", "cgp.commands.equivalence", str(folder)])
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not (folder / "outcome.json").exists():
            raise CgpError(f"{ranks} MPI ranks: {' '.join(argv)} ended with status "
                           f"{done.returncode}:\n{done.stderr[-2000:]}")
        outcome = json.loads((folder / "outcome.json").read_text())
        params = np.load(folder / "params.npy", allow_pickle=False)
    return Outcome(config.threads, config.workers, outcome["sha256"], params,
                   outcome["losses"], outcome["accuracy"], ranks)


def main_rank(folder):
    """One rank of mpi_run: trains as its spec says; rank 0 writes the outcome."""
    from cgp.prototxt import parse_solver
    folder = Path(folder)
    spec = json.loads((folder / "spec.json").read_text())
    sp = parse_solver((folder / "solver.prototxt").read_text(), "solver.prototxt")
    outcome = train_run(sp, spec["solver_path"], RunConfig(**spec["config"]), spec["iters"])
    from cgp.comm import mpi
    if mpi.world().Get_rank() == 0:
        np.save(folder / "params.npy", outcome.params, allow_pickle=False)
        (folder / "outcome.json").write_text(json.dumps(
            {"sha256": outcome.sha256, "losses": outcome.losses, "accuracy": outcome.accuracy}))


def compare(outcomes):
    """Rows of (ranks, threads, workers, sha256, max |dw| vs the first, losses identical,
    accuracy, bitwise the same) and whether every run matched the first bit for bit."""
    first = outcomes[0]
    rows, ok = [], True
    for o in outcomes:
        dw = float(np.max(np.abs(o.params.astype(np.float64) - first.params))) if o.params.size else 0.0
        same_losses = o.losses == first.losses
        same = o.sha256 == first.sha256 and same_losses
        ok &= same
        rows.append((o.ranks, o.threads, o.workers, o.sha256, dw, same_losses, o.accuracy, same))
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
            engine64 = make_engine(None, net, config.chunks, pool, make_communicator(pool),
                                   params=params64)
            _, loss64, grad64 = engine64.run(batch, 0, trainer.seed)
            loss32, _, _ = trainer.step()
        # The first step of Caffe's SGD from zero history: w -= lr*lr_mult*(g + wd*decay_mult*w),
        # on what the forward pass left (a BatchNorm's moving averages, which no solver moves).
        rate = trainer.solver.learning_rate(0)
        decay = sp.weight_decay * net.decay_mult.astype(np.float64)
        w64 = params64 - rate * net.lr_mult.astype(np.float64) * (grad64 + decay * w0)
        scale = max(float(np.max(np.abs(w64 - w0))), 1e-30)
        error = float(np.max(np.abs(net.params.astype(np.float64) - w64))) / scale
    finally:
        trainer.close()
    return error, loss32, loss64


def gradient_error(net, got, want):
    """The largest difference between two flat gradients over the net's blobs, relative to
    the blob's largest element of `want`, or to NOISE_FLOOR of the whole gradient's where
    that is larger: a gradient that is 0 but for rounding (a bias before a BatchNorm) has no
    scale of its own."""
    floor = NOISE_FLOOR * float(np.max(np.abs(want))) if want.size else 0.0
    errors = [float(np.max(np.abs(got[b.offset:b.offset + b.size]
                                  - want[b.offset:b.offset + b.size])))
              / max(float(np.max(np.abs(want[b.offset:b.offset + b.size]))), floor, 1e-300)
              for b in net.param_blobs]
    return max(errors, default=0.0)


def device_against_cpu(sp, solver_path, config, prepare=None):
    """The first batch's gradient of the device engine (config.device) in float64 against
    the CPU engine's in float64 (gradient_error), and the two losses. prepare(trainer), if
    given, runs first (cgp.commands.timing.fill_inputs for a deploy net's Input layers)."""
    trainer = Trainer(sp, solver_path, replace(config, max_iter=1, progress=False))
    try:
        net = trainer.net
        if prepare is not None:
            prepare(trainer)
        batch = trainer._batch(trainer.engine, 0, 0)
        pool = Pool(1, flush_denormals=config.denormals == "flush")
        runs = []
        for backend in (None, select_backend(config.device)):
            engine = make_engine(backend, net, config.chunks, pool, make_communicator(pool),
                                 params=net.params.astype(np.float64))
            _, loss, grad = engine.run(batch, 0, trainer.seed)
            runs.append((loss, grad.copy()))
    finally:
        trainer.close()
    (cpu_loss, cpu), (device_loss, device) = runs
    error = gradient_error(net, device, cpu)
    return error, device_loss, cpu_loss


def run(sp, solver_path, config, threads_list, iters, log=print, workers=None, ranks=(1,)):
    """The whole harness; returns the process exit status (0: all equivalent). workers:
    every thread count runs with its workers as each of these (RunConfig.workers; default
    config's); ranks: and on each of these numbers of MPI ranks (mpirun on this machine)."""
    if config.sharing != "sync":
        raise CgpError(refusal(config.sharing))
    workers = workers or (config.workers,)
    if not threads_list:
        raise CgpError("--threads needs at least one thread count")
    if iters < 1:
        raise CgpError(f"--iters must be at least 1, got {iters}")
    outcomes = []
    for count in ranks:
        for kind in workers:
            for threads in threads_list:
                run_config = replace(config, threads=threads, workers=kind)
                outcomes.append(train_run(sp, solver_path, run_config, iters) if count == 1
                                else mpi_run(sp, solver_path, run_config, count, iters))
                log(f"{count} rank(s) x {threads} {kind}: trained {iters} iterations, last "
                    f"iteration's loss {outcomes[-1].losses[-1]:.6g}")
    rows, ok = compare(outcomes)
    log("")
    log(f"{'ranks':>5}  {'threads':>7}  {'workers':<9}  {'sha256 of parameters':<64}  "
        f"{'max|dw|':>9}  {'losses':>9}  test of the final weights")
    for count, threads, kind, digest, dw, same_losses, accuracy, _ in rows:
        acc = ", ".join(f"{k} {v:.4f}" for k, v in accuracy.items()) or "-"
        log(f"{count:>5}  {threads:>7}  {kind:<9}  {digest}  {dw:9.3g}  "
            f"{'identical' if same_losses else 'DIFFER':>9}  {acc}")
    status = 0 if ok else 1
    log("")
    across = "thread counts" + (" and rank counts" if len(ranks) > 1 or ranks[0] > 1 else "")
    log(f"bitwise identical across {across}"
        + (", in " + " and in ".join(workers) if len(workers) > 1 else "") + ": "
        + ("yes" if ok else "NO"))
    plain_sgd = (sp.type == "SGD" and sp.iter_size == 1 and sp.clip_gradients < 0
                 and sp.regularization_type == "L2" and not config.staleness
                 and not solver_extras(sp).ListFields())
    if not plain_sgd:
        log("one-step float64 comparison: skipped (it covers synchronous SGD with L2, "
            "iter_size 1, no clipping, no large-batch rule)")
    else:
        error, loss32, loss64 = step_against_float64(sp, solver_path, replace(config, threads=1))
        passed = error <= STEP_TOLERANCE
        log(f"one SGD step, float32 engine vs float64 reference: max error {error:.3g} of the "
            f"largest update (tolerance {STEP_TOLERANCE:g}); loss {loss32:.7g} vs {loss64:.7g}: "
            + ("ok" if passed else "FAILED"))
        status = status or (0 if passed else 1)
    if config.device != "cpu":
        error, device_loss, cpu_loss = device_against_cpu(sp, solver_path,
                                                          replace(config, threads=1))
        passed = error <= DEVICE_TOLERANCE
        log(f"--device {config.device} against the CPU engine, both in float64, the first "
            f"batch's gradient: max error {error:.3g} of each blob's largest element (tolerance "
            f"{DEVICE_TOLERANCE:g}; a gradient of rounding noise against {NOISE_FLOOR:g} of the "
            f"largest of all); loss {device_loss:.15g} vs {cpu_loss:.15g}: "
            + ("ok" if passed else "FAILED") + ". Not bitwise: their GEMMs and sums add in "
            "other orders")
        status = status or (0 if passed else 1)
    return status


if __name__ == "__main__":
    main_rank(sys.argv[1])
