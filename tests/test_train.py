"""The training loop end to end: iter_size, the bundled CIFAR nets, and real MNIST."""
import numpy as np
import pytest

from cgp import models
from cgp.equivalence import train_run
from cgp.prototxt import read_net, read_solver
from cgp.train import RunConfig


def lenet_solver(batch=64, **fields):
    sp = read_solver(models.solver_path("mnist"))
    sp.ClearField("net")
    sp.net_param.CopyFrom(read_net(models.FOLDER / "lenet_train_test.prototxt"))
    sp.net_param.layer[0].data_param.batch_size = batch
    del sp.test_iter[:]
    sp.test_iter.append(2)
    for key, value in fields.items():
        setattr(sp, key, value)
    return sp


def test_iter_size_accumulates_like_a_bigger_batch(mnist_dir):
    config = RunConfig(data_dir=str(mnist_dir))
    big = train_run(lenet_solver(64), None, config, 3)
    accumulated = train_run(lenet_solver(32, iter_size=2), None, config, 3)
    np.testing.assert_allclose(accumulated.losses, big.losses, rtol=1e-5)
    np.testing.assert_allclose(accumulated.params, big.params, atol=2e-6)


@pytest.mark.parametrize("model", ["cifar10", "cifar10_full"])
def test_cifar_nets_train_on_generated_files(model, cifar_dir):
    sp = read_solver(models.solver_path(model))
    sp.net = str(models.FOLDER / sp.net)
    del sp.test_iter[:]
    sp.test_iter.append(1)
    one = train_run(sp, None, RunConfig(threads=1, data_dir=str(cifar_dir)), 2)
    two = train_run(sp, None, RunConfig(threads=2, data_dir=str(cifar_dir)), 2)
    assert one.sha256 == two.sha256 and one.losses == two.losses
    assert np.isfinite(one.losses).all() and 0 <= one.accuracy["accuracy"] <= 1


def test_lenet_learns_real_mnist():
    """300 iterations of the bundled solver on the bundled MNIST: well above chance."""
    sp = lenet_solver()
    sp.test_iter[0] = 10  # the first 1000 test images
    run = train_run(sp, None, RunConfig(threads=2), 300)
    assert run.accuracy["accuracy"] >= 0.95
    assert np.mean(run.losses[-20:]) < 0.3
