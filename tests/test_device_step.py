"""The step on the device (cgp.device.step, cgp.device.update, cgp.device.engine.tree_sum):
the update's arithmetic against the CPU solvers' kernels, bitwise in float32 and float64, the
device's tree sum against the host's, and a training run through DeviceStep against the
host's step, bitwise. On NumPy standing in for CuPy, and on CuPy where a GPU is (the "gpu"
parameters, which bench/gpu_check.sh runs). Training through DeviceStep against the host's
step: tests/test_device.py's ranks test (one rank takes DeviceStep, more the host's step)."""
import numpy as np
import pytest

from cgp.comm.local import reference_reduce
from cgp.device.engine import tree_sum
from cgp.device.update import DeviceUpdate
from cgp.proto import caffe_pb2
from cgp.runtime.reduce import TILE
from cgp.runtime.reduce import tree_sum as host_tree_sum
from cgp.solver import Solver, Step

from test_device import GPU

XP = ["numpy", pytest.param("cupy", marks=GPU)]


def array_module(name):
    """(xp, to_numpy) of the array module named."""
    if name == "numpy":
        return np, np.asarray
    import cupy
    return cupy, cupy.asnumpy

RULES = [("SGD", {}), ("Nesterov", {}), ("AdaGrad", {}), ("RMSProp", {"rms_decay": 0.9}),
         ("AdaDelta", {"delta": 1e-6}), ("Adam", {"momentum2": 0.999, "delta": 1e-8})]


def make_solver(kind, l1, extra, n):
    momentum = 0.0 if kind in ("AdaGrad", "RMSProp") else 0.9
    sp = caffe_pb2.SolverParameter(type=kind, base_lr=0.1, lr_policy="fixed",
                                   weight_decay=0.01, regularization_type="L1" if l1 else "L2",
                                   momentum=momentum, iter_size=2, **extra)
    # Multipliers that change along the array, zero decay (and a zero weight) included.
    lr_mult = np.repeat(np.float32([1, 2, 0, 1]), n // 4)
    decay_mult = np.repeat(np.float32([1, 0, 1, 2]), n // 4)
    return Solver(sp, lr_mult, decay_mult)


@pytest.mark.parametrize("xp_name", XP)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("l1", [False, True])
@pytest.mark.parametrize("kind, extra", RULES)
def test_the_device_update_is_the_cpu_solvers_bitwise(kind, extra, l1, dtype, xp_name):
    """Three steps of every rule, L1 and L2, clipped and warming up, on the CPU's kernels
    (Solver.apply) and on DeviceUpdate: the same weights, histories and steps taken, bit
    for bit, in float32 (the training dtype) and float64 (the same arithmetic)."""
    n = 64
    rng = np.random.default_rng(1)
    cpu, dev = make_solver(kind, l1, extra, n), make_solver(kind, l1, extra, n)
    w_cpu = rng.standard_normal(n).astype(dtype)
    w_cpu[3] = 0.0
    xp, to_numpy = array_module(xp_name)
    w_dev = xp.array(w_cpu)   # copies
    update = DeviceUpdate(dev, xp)
    update.to_device()
    for it in range(3):
        g = rng.standard_normal(n).astype(dtype)
        g_dev = xp.array(g)
        step = Step(it, np.float32(0.01 * (it + 1)), np.float32(0.5 if it == 1 else 1.0),
                    np.float32(0.9 + 0.01 * it), None, np.float32(1.25 if it == 2 else 1.0))
        assert cpu.apply(step, w_cpu, g, 0, n)
        assert update.apply(step, w_dev, g_dev)
        assert w_dev.dtype == w_cpu.dtype and g_dev.dtype == g.dtype
        assert np.array_equal(to_numpy(w_dev), w_cpu) and np.array_equal(to_numpy(g_dev), g)
    update.to_host(to_numpy)
    for h_dev, h_cpu in zip(dev.histories, cpu.histories):
        assert np.array_equal(h_dev, h_cpu)


def test_the_device_update_finds_a_weight_that_is_not_finite():
    solver = make_solver("SGD", False, {}, 8)
    update = DeviceUpdate(solver, np)
    w, g = np.ones(8, np.float32), np.ones(8, np.float32)
    g[5] = np.inf
    with np.errstate(invalid="ignore"):
        assert not update.apply(Step(0, np.float32(0.1), np.float32(1), np.float32(1), None,
                                     np.float32(1)), w, g)


@pytest.mark.parametrize("xp_name", XP)
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 7, 16])
def test_the_device_tree_sum_is_the_hosts_bitwise(chunks, xp_name):
    """The rows' sum level by level as array additions == the host kernel's tiled tree, and
    the naive reference's, for chunk counts that are and are not powers of two."""
    rng = np.random.default_rng(chunks)
    rows = (rng.standard_normal((chunks, 3000)) * 10.0 ** rng.integers(-3, 4, (chunks, 1))
            ).astype(np.float32)
    want = rows.copy()
    host_tree_sum(want, 0, want.shape[1], np.empty((chunks, TILE), np.float32))
    xp, to_numpy = array_module(xp_name)
    assert np.array_equal(to_numpy(tree_sum(xp.array(rows))), want[0])
    assert np.array_equal(to_numpy(tree_sum(xp.array(rows))), reference_reduce(rows))



@pytest.mark.parametrize("device", ["numpy", pytest.param("gpu", marks=GPU)])
def test_batchnorm_trains_its_moving_averages_through_the_device_step(tmp_path, device):
    """A net whose sums over the batch update blobs (BatchNorm's moving averages: every op
    of tests/test_device.py's ZOO, BatchNorm with batch statistics) trains to the same bits
    through DeviceStep (weights on the device) as through the host's step on a device
    engine that copies the host's weights in at every run."""
    from cgp.device.engine import DeviceEngine
    from cgp.step import DataParallelStep
    from cgp.train import RunConfig, Trainer
    from test_device import ZOO
    path = tmp_path / "every_op.prototxt"
    path.write_text(ZOO.replace("use_global_stats: true", "use_global_stats: false"))
    sp = caffe_pb2.SolverParameter(net=str(path), base_lr=0.01, lr_policy="fixed",
                                   momentum=0.9, weight_decay=0.001, max_iter=2, random_seed=5)
    config = RunConfig(device=device, chunks=3, progress=False)
    weights = []
    for device_step in (True, False):
        trainer = Trainer(sp, None, config, log=lambda line: None)
        assert type(trainer.train_step).__name__ == "DeviceStep"
        if not device_step:
            trainer.engine = DeviceEngine(trainer.net, 3, trainer.pool, trainer.comm,
                                          trainer.backend)
            trainer.train_step = DataParallelStep(trainer.engine, trainer.solver, trainer.comm)
        before = trainer.net.params.copy()
        trainer.steps(2)
        weights.append(trainer.net.params.copy())
    net = trainer.net
    norms = [i for i, e in enumerate(net.entries) if e.layer.type_name == "BatchNorm"]
    moved = [not np.array_equal(a, b) for i in norms
             for a, b in zip(net.param_views(weights[0])[i], net.param_views(before)[i])]
    assert norms and all(moved)   # the moving averages and their factor were updated
    assert np.array_equal(weights[0], weights[1])
