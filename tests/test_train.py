"""The training loop end to end: iter_size, the bundled CIFAR nets, and real MNIST."""
import numpy as np
import pytest

from cgp import models
from cgp.commands.equivalence import train_run
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


@pytest.mark.parametrize("threads, workers", [(1, "threads"), (2, "threads"), (3, "threads"),
                                              (2, "processes")])
def test_updates_in_the_reduction_tasks_match_an_update_run(threads, workers, mnist_dir):
    """Where the Step needs no gradient, each reduction task updates the columns it has just
    summed (DataParallelStep.fused), with iter_size's sum over passes: bitwise the weights,
    solver history and losses of an update run of its own after each iteration; a run that
    each() ends early leaves the weights up to date too. Adam, and momentum SGD with weight
    decay, with 1 and 2 passes. (Updating a task's columns before summing them, or before
    every call has passed their layers, fails this.)"""
    from cgp.train import Trainer
    for sp in (lenet_solver(32, type="SGD"), lenet_solver(32, type="Adam"),
               lenet_solver(16, iter_size=2)):
        config = RunConfig(threads=threads, workers=workers, data_dir=str(mnist_dir),
                           progress=False)
        trainers = [Trainer(sp, None, config, log=lambda line: None) for _ in range(2)]
        assert trainers[0].train_step.fused and trainers[1].train_step.fused
        trainers[0].train_step.fused = False
        try:
            single = [trainers[0].step()[0] for _ in range(5)]
            fused = []
            trainers[1].steps(3, lambda it, loss, outputs, rate: fused.append(loss))
            trainers[1].steps(9, lambda it, loss, outputs, rate: fused.append(loss) or it == 4)
            assert trainers[1].iter == 5 and fused == single
            assert np.array_equal(trainers[0].net.params, trainers[1].net.params)
            for a, b in zip(trainers[0].solver.histories, trainers[1].solver.histories):
                assert np.array_equal(a, b)
        finally:
            for t in trainers:
                t.close()


def test_updates_that_need_the_gradient_first_are_not_fused(mnist_dir):
    """Clipping scales the step by the whole gradient's norm: such a solver's Step needs the
    gradient, so its update runs after the reduction, and steps(n) still gives the bits of
    step() after step(), on 1 and 2 workers alike."""
    from cgp.train import Trainer
    sp = lenet_solver(16, clip_gradients=0.5, iter_size=2)
    trainers = [Trainer(sp, None, RunConfig(threads=threads, data_dir=str(mnist_dir),
                                            progress=False), log=lambda line: None)
                for threads in (1, 2)]
    try:
        assert not trainers[0].train_step.fused and not trainers[1].train_step.fused
        single = [trainers[0].step()[0] for _ in range(3)]
        losses = []
        trainers[1].steps(3, lambda it, loss, outputs, rate: losses.append(loss))
        assert losses == single
        assert np.array_equal(trainers[0].net.params, trainers[1].net.params)
    finally:
        for t in trainers:
            t.close()


@pytest.mark.parametrize("threads, clip", [(1, -1), (2, -1), (2, 1e30)])
def test_a_diverging_run_stops_at_the_iteration_naming_where(threads, clip, tmp_path,
                                                            mnist_dir):
    """base_lr far too large: the loss goes to NaN a few iterations in; training stops within
    that iteration with one error naming it and the first layer whose output is not finite,
    the weights of the step before, and no snapshot after the last good one (with the update
    in the reduction's tasks, and after them with clip_gradients)."""
    from cgp.errors import CgpError
    from cgp.train import Trainer
    sp = lenet_solver(32, base_lr=50.0, clip_gradients=clip, snapshot=1,
                      snapshot_prefix=str(tmp_path / "s"), test_interval=0, display=0)
    trainer = Trainer(sp, None, RunConfig(threads=threads, data_dir=str(mnist_dir),
                                          progress=False, max_iter=50), log=lambda line: None)
    try:
        with pytest.raises(CgpError, match=r"diverged at iteration (\d+): the loss is nan "
                                           r"\(the first output that is not finite is layer "
                                           r"'(conv|ip|pool|relu)\w*'") as raised:
            trainer.solve()
        stopped = int(raised.value.args[0].split("iteration ")[1].split(":")[0])
        assert trainer.iter == stopped
        assert np.isfinite(trainer.net.params).all()   # the step's update did not run
    finally:
        trainer.close()
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written[-2:] == [f"s_iter_{stopped}.caffemodel", f"s_iter_{stopped}.solverstate"]


def test_an_update_that_overflows_names_the_parameter_blob(mnist_dir):
    """A finite loss whose update overflows the weights (base_lr 3e38, doubled for the biases
    by their lr_mult: float32 overflows): the first iteration
    stops, naming a parameter blob."""
    from cgp.errors import CgpError
    from cgp.train import Trainer
    trainer = Trainer(lenet_solver(32, base_lr=3e38), None,
                      RunConfig(threads=2, data_dir=str(mnist_dir), progress=False),
                      log=lambda line: None)
    try:
        with pytest.raises(CgpError, match=r"diverged at iteration 0: the gradient of layer "
                                           r"'(conv|ip)\d' blob [01] \(.*\) is not finite"):
            trainer.step()
    finally:
        trainer.close()



def test_staleness_applies_the_gradient_of_s_iterations_before(mnist_dir):
    """--staleness 2: iterations 0 and 1 change no weight; iteration t applies the gradient
    made at t - 2 (a float64 reference of the SGD rule from the recorded gradients), with
    the update in the reduction's tasks and after them (the same bits)."""
    from cgp.train import Trainer
    sp = lenet_solver(16, momentum=0.0, weight_decay=0.0)
    config = RunConfig(threads=2, data_dir=str(mnist_dir), progress=False, staleness=2)
    trainers = [Trainer(sp, None, config, log=lambda line: None) for _ in range(2)]
    trainers[1].train_step.fused = False
    try:
        start = trainers[0].net.params.copy()
        made = []
        for it in range(5):
            before = trainers[0].net.params.copy()
            for t in trainers:
                t.step()
            made.append(trainers[0].train_step.updater.slots[it % 3].copy())
            after = trainers[0].net.params
            if it < 2:
                assert np.array_equal(after, start)
            else:
                rate = trainers[0].solver.learning_rate(it)
                want = before - rate * trainers[0].net.lr_mult * made[it - 2].astype(np.float64)
                np.testing.assert_allclose(after, want, rtol=1e-5, atol=1e-7)
            assert np.array_equal(trainers[0].net.params, trainers[1].net.params)
    finally:
        for t in trainers:
            t.close()


def test_staleness_resumes_bit_for_bit(tmp_path, mnist_dir):
    """A snapshot keeps the gradients made and not applied yet: resumed, the run ends on the
    bits of an uninterrupted one; resumed with another staleness, it is refused."""
    from cgp.errors import CgpError
    from cgp.train import Trainer
    sp = lenet_solver(16, snapshot=3, snapshot_prefix=str(tmp_path / "s"), test_interval=0)
    config = RunConfig(threads=2, data_dir=str(mnist_dir), progress=False, staleness=2,
                       max_iter=6)
    whole = Trainer(sp, None, config, log=lambda line: None)
    whole.solve()
    whole.close()
    resumed = Trainer(sp, None, config, log=lambda line: None)
    resumed.restore(tmp_path / "s_iter_3.solverstate")
    resumed.solve()
    resumed.close()
    assert np.array_equal(whole.net.params, resumed.net.params)
    other = Trainer(sp, None, RunConfig(threads=1, data_dir=str(mnist_dir), progress=False,
                                        staleness=1), log=lambda line: None)
    try:
        with pytest.raises(CgpError, match="written with --staleness 2"):
            other.restore(tmp_path / "s_iter_3.solverstate")
    finally:
        other.close()
