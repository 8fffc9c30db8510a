"""BatchNorm over the whole batch: Caffe's arithmetic (statistics, moving averages, global
statistics), finite-difference gradients through the batch statistics, and bitwise the same
results for any number of workers, however the batch is grouped into calls."""
import numpy as np
import pytest

from cgp import models
from cgp.comm.local import LocalCommunicator
from cgp.engine import Engine
from cgp.commands.equivalence import compare, train_run
from cgp.kernels import batchnorm as K
from cgp.net import Net, RunOptions
from cgp.proto import caffe_pb2
from cgp.prototxt import parse_net, read_net, read_solver
from cgp.runtime.procs import make_pool
from cgp.train import RunConfig
from layer_check import build, check_gradients, forward

TRAIN_BN = 'type: "BatchNorm" bottom: "x" top: "y" batch_norm_param { eps: 0.001 }'


def caffe_bn(x, eps=0.001):
    """Caffe's training forward in float64: per channel, over samples and positions."""
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


@pytest.mark.parametrize("shape", [(6, 3, 4, 5), (7, 4), (5, 2, 9)])
def test_forward_normalises_over_the_whole_batch(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3 + 1
    layer = build(TRAIN_BN, [shape])
    blobs = [np.zeros(shape[1], np.float32), np.zeros(shape[1], np.float32),
             np.zeros(1, np.float32)]
    (y,), _ = forward(layer, [x.astype(np.float32)], blobs)
    np.testing.assert_allclose(y, caffe_bn(x), rtol=1e-4, atol=1e-5)


def test_moving_averages_follow_caffe():
    """After two training forwards: factor = f * (f * 0 + 1) + 1, mean_blob = mean_2 + f *
    mean_1, variance_blob = m/(m-1) var_2 + f * m/(m-1) var_1, in float32 (Caffe's axpby),
    with f the moving_average_fraction and m the values per channel."""
    rng = np.random.default_rng(1)
    shape = (5, 3, 2, 2)
    layer = build('type: "BatchNorm" bottom: "x" top: "y" '
                  'batch_norm_param { moving_average_fraction: 0.9 }', [shape])
    blobs = [np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(1, np.float32)]
    f, m = np.float32(0.9), 5 * 4
    want_mean, want_var, want_factor = (np.zeros(3, np.float32), np.zeros(3, np.float32),
                                        np.float32(0))
    for _ in range(2):
        x = rng.standard_normal(shape).astype(np.float32)
        forward(layer, [x], blobs)
        x64 = x.astype(np.float64)
        mean = x64.mean(axis=(0, 2, 3))
        var = ((x64 - mean[:, None, None]) ** 2).mean(axis=(0, 2, 3))
        want_factor = want_factor * f + np.float32(1)
        want_mean = mean.astype(np.float32) + f * want_mean
        want_var = np.float32(m) / np.float32(m - 1) * var.astype(np.float32) + f * want_var
    assert blobs[2][0] == want_factor
    np.testing.assert_allclose(blobs[0], want_mean, rtol=1e-6)
    np.testing.assert_allclose(blobs[1], want_var, rtol=1e-6)


def test_global_statistics_use_the_blobs_over_their_factor():
    """TEST phase (use_global_stats by default): y = (x - mean_blob / factor) /
    sqrt(var_blob / factor + eps), dx = dy / that; a factor of 0 divides by nothing."""
    rng = np.random.default_rng(2)
    shape = (4, 3, 2, 3)
    layer = build('type: "BatchNorm" bottom: "x" top: "y"', [shape], phase=caffe_pb2.TEST)
    assert layer.batch_sums == (0, 0)
    blobs = [rng.standard_normal(3).astype(np.float32), rng.random(3).astype(np.float32) + 1,
             np.array([2.5], np.float32)]
    x = rng.standard_normal(shape)
    mean = blobs[0] / 2.5
    std = np.sqrt(blobs[1].astype(np.float64) / 2.5 + 1e-5)
    want = (x - mean[:, None, None]) / std[:, None, None]
    (y,), _ = forward(layer, [x.astype(np.float32)], blobs)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    check_gradients(layer, [x], params=blobs, check_params=False)
    blobs[2][0] = 0
    (y,), _ = forward(layer, [x.astype(np.float32)], blobs)
    np.testing.assert_allclose(y, x / np.sqrt(1e-5), rtol=1e-5)


def lane_reference(terms):
    """The float64 sum of `terms` as the lanes of kernels/batchnorm.py order it, in Python
    floats: term j added to lane j % 8 in order, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
    (l6 + l7))."""
    lanes = [0.0] * 8
    for j, term in enumerate(terms):
        lanes[j % 8] += float(term)
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
        (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_add_in_eight_lanes_then_a_tree(dtype):
    """The sums in lanes (every sum of BatchNorm, Scale and Bias) against the order they
    promise, bit for bit: each term (an element, a product in the rows' dtype, a squared
    difference from the mean taken in the rows' dtype, squared in float64) into lane j % 8,
    for rows of any length, whole blocks of 8 or not; two sums in one pass, the same bits."""
    rng = np.random.default_rng(5)
    m = dtype(0.3)
    for size in list(range(20)) + [49, 196, 3136]:
        a, b = (rng.standard_normal(size).astype(dtype) * 100 for _ in range(2))
        assert K.plain_sum(a) == lane_reference(a.astype(np.float64))
        assert K.product_sum(a, b) == lane_reference((a * b).astype(np.float64))
        square = [float(d) * float(d) for d in (a - m)]
        assert K.centred_square_sum(a, m) == lane_reference(square)
        assert K.product_and_plain_sums(a, b) == (K.product_sum(a, b), K.plain_sum(a))


@pytest.mark.parametrize("shape", [(5, 2, 3, 3), (6, 3)])
def test_gradients_through_the_batch_statistics(shape):
    """dx of L = <y, W> against central differences in float64: the statistics depend on
    every sample, so every sample's gradient does too."""
    x = np.random.default_rng(3).standard_normal(shape)
    layer = build(TRAIN_BN, [shape])
    blobs = [np.zeros(shape[1]), np.zeros(shape[1]), np.zeros(1)]
    check_gradients(layer, [x], params=blobs, rtol=1e-4, atol=1e-6)


BN_NET = """
name: "bn"
layer { name: "data" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 11 dim: 3 dim: 6 dim: 6 } shape { dim: 11 } } }
layer { name: "c1" type: "Convolution" bottom: "x" top: "c1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "b1" }
layer { name: "relu" type: "ReLU" bottom: "b1" top: "b1" }
layer { name: "fc" type: "InnerProduct" bottom: "b1" top: "f"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "f" top: "g" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "g" bottom: "label" top: "loss" }
"""


def test_calls_pause_at_each_sum_and_give_the_same_bits_for_any_grouping():
    """A net with two BatchNorms on 1 to 3 workers, as threads and processes, in calls of 1,
    2 or all 5 chunks: the same loss, gradient and moving averages, bit for bit; and one call
    of the whole batch (its sums made in the call) gives them too."""
    net = Net(parse_net(BN_NET, "bn.prototxt"), caffe_pb2.TRAIN, RunOptions())
    net.init_params(3)
    assert net.forward_syncs == [(1, 0), (1, 1), (4, 0), (4, 1)]
    assert net.backward_syncs == [(4, 2), (1, 2)]
    rng = np.random.default_rng(1)
    batch = {net.sources[0].tops[0]: rng.standard_normal((11, 3, 6, 6)),
             net.sources[0].tops[1]: rng.integers(0, 6, 11).astype(np.float64)}
    start = net.params.copy()
    results = []
    for threads, group, kind in ((1, None, "threads"), (2, 1, "threads"), (3, 2, "threads"),
                                 (2, None, "processes"), (3, 1, "processes"), (1, 5, "threads")):
        pool = make_pool(kind, threads, [net])
        net.params[...] = start
        engine = Engine(net, 5, pool, LocalCommunicator(pool), group=group)
        # The layers' work scratch (c1's widened input "e") is one set per worker; the
        # calls' workspaces keep the rest.
        assert len(engine.work) == threads and "e" in engine.work[0][0]
        assert all("e" not in ws.scratch[0] for ws in engine.workspaces)
        pool.start()
        try:
            _, loss, grad = engine.run(batch, 0, 7)
            results.append((loss, grad.copy(), net.params.copy()))
        finally:
            pool.close()
    assert np.count_nonzero(results[0][1]) > 0.5 * results[0][1].size
    assert not np.array_equal(results[0][2], start)   # the moving averages moved
    for loss, grad, params in results[1:]:
        assert loss == results[0][0]
        assert np.array_equal(grad, results[0][1]) and np.array_equal(params, results[0][2])


def bn_lenet_solver(mnist_dir):
    """LeNet with a BatchNorm after each convolution and after ip1."""
    net = read_net(models.FOLDER / "lenet_train_test.prototxt")
    layers = list(net.layer)
    del net.layer[:]
    for lp in layers:
        net.layer.add().CopyFrom(lp)
        if lp.name in ("conv1", "conv2", "ip1"):
            bn = net.layer.add(name=f"{lp.name}_bn", type="BatchNorm", bottom=[lp.top[0]],
                               top=[lp.top[0]])
            bn.batch_norm_param.moving_average_fraction = 0.9
    sp = read_solver(models.solver_path("mnist"))
    sp.ClearField("net")
    sp.net_param.CopyFrom(net)
    del sp.test_iter[:]
    sp.test_iter.append(1)
    return sp


def test_a_net_with_batchnorm_has_one_hash_for_any_thread_count(mnist_dir):
    """LeNet with BatchNorm, 3 iterations: one hash, every loss and the test (on the moving
    averages) the same for 1, 2, 3, 4, 7 and 16 workers, as processes and as threads."""
    sp = bn_lenet_solver(mnist_dir)
    outcomes = [train_run(sp, None, RunConfig(threads=t, data_dir=str(mnist_dir),
                                              workers=kind), 3)
                for kind, threads in (("processes", (1, 2, 3, 4, 7, 16)), ("threads", (2, 3)))
                for t in threads]
    rows, ok = compare(outcomes)
    assert ok, rows
    assert outcomes[0].losses[0] != outcomes[0].losses[-1]
    assert 0 <= outcomes[0].accuracy["accuracy"] <= 1


def test_resnet20_trains_with_one_hash_for_any_thread_count(cifar_dir):
    """The bundled ResNet-20 (BatchNorm and Scale after every convolution) on generated
    CIFAR-10 files, its batch cut to 16: one hash, every loss and the test on 1, 2 and 3
    workers."""
    sp = read_solver(models.solver_path("resnet20"))
    sp.ClearField("net")
    net = read_net(models.FOLDER / "resnet20_cifar10_train_test.prototxt")
    for lp in net.layer:
        if lp.type == "Data":
            lp.data_param.batch_size = 16
    sp.net_param.CopyFrom(net)
    del sp.test_iter[:]
    sp.test_iter.append(1)
    outcomes = [train_run(sp, None, RunConfig(threads=t, data_dir=str(cifar_dir)), 2)
                for t in (1, 2, 3)]
    rows, ok = compare(outcomes)
    assert ok, rows
    assert np.isfinite(outcomes[0].losses).all()
