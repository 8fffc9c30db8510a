"""Reduction, ArgMax and MVN against float64 NumPy references, finite differences and batch
splits, plus Caffe's tie rule (ArgMax) and parameter rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import Chunk
from layer_check import (backward, build, check_forward, check_gradients,
                         check_split_invariance, forward)

SHAPE = (4, 3, 2, 3)


def data(shape, seed=0):
    """Values at least 0.05 from 0: ASUM's kink stays out of the differences' reach."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.05, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


# -- Reduction ---------------------------------------------------------------------------------

REDUCE = {"SUM": np.sum, "ASUM": lambda x, axis: np.abs(x).sum(axis),
          "SUMSQ": lambda x, axis: (x * x).sum(axis), "MEAN": np.mean}


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("axis", [1, 2, -1])
def test_reduction_per_sample(op, axis):
    layer = build(f'type: "Reduction" bottom: "x" top: "y" reduction_param {{ operation: {op} '
                  f'axis: {axis} coeff: 1.5 }}', [SHAPE])
    start = axis % len(SHAPE)
    assert layer.top_shapes == [SHAPE[:start]] and not layer.reduces_batch
    x = data(SHAPE)
    axes = tuple(range(start, len(SHAPE)))
    check_forward(layer, [x], lambda x: 1.5 * REDUCE[op](x, axis=axes))
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)


@pytest.mark.parametrize("op", sorted(REDUCE))
def test_reduction_of_the_batch_is_a_batch_value(op):
    """Caffe's default axis 0 reduces everything into one value: each call's share, whose sum
    over the chunks is the batch's value, and a gradient that follows the batch's count."""
    layer = build(f'type: "Reduction" bottom: "x" top: "y" reduction_param {{ operation: {op} '
                  f'coeff: -2 }}', [SHAPE])
    assert layer.top_shapes == [()] and layer.reduces_batch
    x = data(SHAPE)
    check_forward(layer, [x], lambda x: -2 * REDUCE[op](x, axis=None), rtol=2e-5)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)
    # A call of the batch's last sample alone: its gradient is that of the whole batch's call.
    x32 = x.astype(np.float32)
    one = [np.array(0.5, np.float32)]
    _, (whole,), _ = backward(layer, [x32], [], one, Chunk(n=4, batch=4))
    _, (part,), _ = backward(layer, [x32[3:]], [], one, Chunk(n=1, first=3, batch=4))
    np.testing.assert_array_equal(part, whole[3:])


def test_reduction_in_a_net_as_a_loss():
    """Reduction of the batch with a loss_weight is a loss the net backpropagates from."""
    from cgp.net import Net
    from cgp.proto import caffe_pb2
    from cgp.prototxt import parse_net
    net = Net(parse_net(
        'layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 3 dim: 4 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h" '
        '        inner_product_param { num_output: 2 } }\n'
        'layer { name: "r" type: "Reduction" bottom: "h" top: "loss" loss_weight: 1 '
        '        reduction_param { operation: SUMSQ } }'), caffe_pb2.TRAIN)
    assert net.loss_weights and net.scalar_outputs()[0][1] == "loss"


@pytest.mark.parametrize("text, message", [
    ("reduction_param { axis: 4 }", "out of range"),
    ("reduction_param { operation: SUM axis: -5 }", "out of range"),
])
def test_reduction_refused(text, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Reduction" bottom: "x" top: "y" {text}', [SHAPE])


# -- ArgMax ------------------------------------------------------------------------------------

def argmax_ref(x, k, axis=None, out_max_val=False):
    """Caffe's order: (value, index) pairs sorted descending, a tie to the larger index."""
    if axis is None:
        rows = x.reshape(x.shape[0], -1)
        order = np.lexsort((-np.arange(rows.shape[1])[None].repeat(len(rows), 0), -rows))[:, :k]
        idx = order.astype(float)
        val = np.take_along_axis(rows, order, 1)
        out = np.stack([idx, val], 1) if out_max_val else idx[:, None]
        return out.reshape(out.shape + (1,) * (x.ndim - 3))
    moved = np.moveaxis(x, axis, -1)
    keys = (-np.broadcast_to(np.arange(moved.shape[-1]), moved.shape), -moved)
    order = np.lexsort(keys)[..., :k]
    got = np.take_along_axis(moved, order, -1) if out_max_val else order.astype(float)
    return np.moveaxis(got, -1, axis)


@pytest.mark.parametrize("param, k, axis, out_max_val", [
    ("", 1, None, False),
    ("argmax_param { top_k: 3 }", 3, None, False),
    ("argmax_param { top_k: 2 out_max_val: true }", 2, None, True),
    ("argmax_param { axis: 1 top_k: 2 }", 2, 1, False),
    ("argmax_param { axis: 3 out_max_val: true top_k: 3 }", 3, 3, True),
    ("argmax_param { axis: -2 }", 1, 2, False),
])
def test_argmax(param, k, axis, out_max_val):
    layer = build(f'type: "ArgMax" bottom: "x" top: "y" {param}', [SHAPE])
    x = np.round(data(SHAPE) * 2) / 2            # ties, which go to the larger index
    want = argmax_ref(x, k, axis, out_max_val)
    assert layer.top_shapes == [want.shape]
    check_forward(layer, [x], lambda x: argmax_ref(x, k, axis, out_max_val), params=[],
                  rtol=0, atol=0)
    check_split_invariance(layer, [x], params=[], cut=1)


def test_argmax_of_a_2d_bottom_and_no_gradient():
    layer = build('type: "ArgMax" bottom: "x" top: "y" argmax_param { out_max_val: true }',
                  [(2, 3)])
    x = np.array([[1.0, 5.0, 5.0], [-1.0, -3.0, -2.0]])
    assert layer.top_shapes == [(2, 2, 1)]
    (y,), _ = forward(layer, [x], [])
    np.testing.assert_array_equal(y[:, :, 0], [[2, 5], [0, -1]])
    assert list(layer.backward_calls([y], [y], [x], [None], [], [], {}, Chunk(n=2))) == []
    with pytest.raises(NetError, match="no gradient"):
        layer.backward_calls([y], [y], [x], [np.zeros_like(x)], [], [], {}, Chunk(n=2))


@pytest.mark.parametrize("param, message", [
    ("argmax_param { top_k: 0 }", "at least 1"),
    ("argmax_param { top_k: 19 }", "exceeds"),
    ("argmax_param { axis: 1 top_k: 4 }", "exceeds"),
    ("argmax_param { axis: 0 }", "batch axis"),
])
def test_argmax_refused(param, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "ArgMax" bottom: "x" top: "y" {param}', [SHAPE])


# -- MVN ---------------------------------------------------------------------------------------

def mvn_ref(across, normalize, eps=1e-9):
    def reference(x):
        axes = tuple(range(1 if across else 2, x.ndim))
        y = x - x.mean(axis=axes, keepdims=True)
        if normalize:
            y = y / (np.sqrt((y * y).mean(axis=axes, keepdims=True)) + eps)
        return y
    return reference


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_mvn(across, normalize):
    layer = build(f'type: "MVN" bottom: "x" top: "y" mvn_param {{ across_channels: '
                  f'{str(across).lower()} normalize_variance: {str(normalize).lower()} }}',
                  [SHAPE])
    x = data(SHAPE) * 3 + 1
    check_forward(layer, [x], mvn_ref(across, normalize), params=[], rtol=1e-4, atol=1e-5)
    check_gradients(layer, [x], params=[], rtol=1e-4, atol=1e-6)
    check_split_invariance(layer, [x], params=[], cut=1)


def test_mvn_eps_adds_to_the_deviation():
    layer = build('type: "MVN" bottom: "x" top: "y" mvn_param { eps: 0.5 }', [(2, 2, 3)])
    x = data((2, 2, 3))
    check_forward(layer, [x], mvn_ref(False, True, eps=0.5), params=[])


def test_mvn_refuses_more_than_four_axes():
    with pytest.raises(NetError, match="up to 4 axes"):
        build('type: "MVN" bottom: "x" top: "y"', [(2, 2, 2, 2, 2)])
