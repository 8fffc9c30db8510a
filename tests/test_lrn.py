"""LRN against float64 NumPy references (both regions, several local_size), gradient checks,
split invariance, and Caffe's parameter rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from layer_check import build, check_forward, check_gradients, check_split_invariance

SHAPE = (2, 4, 3, 3)


def lrn_text(size, region="ACROSS_CHANNELS", extra=""):
    return (f'type: "LRN" bottom: "x" top: "y" '
            f'lrn_param {{ local_size: {size} norm_region: {region} {extra} }}')


def across_ref(x, size, alpha, beta, k):
    """scale[c] = k + alpha / size * sum of x^2 over channels c - r .. c + r (zeros outside)."""
    r = (size - 1) // 2
    sq = np.pad(x * x, ((0, 0), (r, r), (0, 0), (0, 0)))
    channels = x.shape[1]
    window = sum(sq[:, j:j + channels] for j in range(size))
    return x * (k + alpha / size * window) ** -beta


def within_ref(x, size, alpha, beta):
    """scale = 1 + alpha / size^2 * sum of x^2 over the size x size window (zeros outside)."""
    r = (size - 1) // 2
    sq = np.pad(x * x, ((0, 0), (0, 0), (r, r), (r, r)))
    h, w = x.shape[2:]
    window = sum(sq[:, :, i:i + h, j:j + w] for i in range(size) for j in range(size))
    return x * (1 + alpha / size ** 2 * window) ** -beta


def data(shape=SHAPE, seed=0):
    return np.random.default_rng(seed).standard_normal(shape) * 1.5


@pytest.mark.parametrize("size", [1, 3, 5, 7])
def test_across_forward(size):
    # local_size 5 and 7 reach past every edge of the 4 channels.
    layer = build(lrn_text(size, extra="alpha: 0.7 beta: 0.6 k: 2"), [SHAPE])
    check_forward(layer, [data()], lambda x: across_ref(x, size, 0.7, 0.6, 2.0), params=[])


def test_across_defaults():
    layer = build('type: "LRN" bottom: "x" top: "y"', [SHAPE])
    check_forward(layer, [data()], lambda x: across_ref(x, 5, 1.0, 0.75, 1.0), params=[])


@pytest.mark.parametrize("size", [1, 3, 5])
def test_within_forward(size):
    # k is set on purpose: Caffe's WITHIN_CHANNEL builds its denominator with shift 1, not k.
    layer = build(lrn_text(size, "WITHIN_CHANNEL", "alpha: 1.5 beta: 0.8 k: 3"), [(2, 3, 4, 5)])
    check_forward(layer, [data((2, 3, 4, 5))], lambda x: within_ref(x, size, 1.5, 0.8), params=[])


@pytest.mark.parametrize("size", [3, 5])
def test_within_sums_each_window_in_row_order(size):
    """WITHIN_CHANNEL's window sums, which run a row of positions at a time over a plane
    padded with zeros: bitwise each window's squares added in float32 in the window's row
    order from 0, cut at the borders (as Caffe's pooling adds them), on squares whose sums
    round differently in another order; and the denominator's power as forward leaves it for
    backward, scale^-beta (NumPy's float32 power rounds otherwise than the kernels' powf:
    compared to float64)."""
    from layer_check import forward

    shape = (2, 3, 5, 6)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)
    layer = build(lrn_text(size, "WITHIN_CHANNEL", "alpha: 1.5 beta: 0.75"), [shape])
    _, scratch = forward(layer, [x], [])
    r = (size - 1) // 2
    H, W = shape[2:]
    reordered = 0
    for n, c, h, w in np.ndindex(*shape):
        total, backwards = np.float32(0), np.float32(0)
        window = [(i, j) for i in range(max(h - r, 0), min(h + r + 1, H))
                  for j in range(max(w - r, 0), min(w + r + 1, W))]
        for i, j in window:
            total = np.float32(total + x[n, c, i, j] * x[n, c, i, j])
        for i, j in reversed(window):
            backwards = np.float32(backwards + x[n, c, i, j] * x[n, c, i, j])
        reordered += total != backwards
        want = np.float32(1 + np.float64(np.float32(1.5)) * (np.float64(total) / size ** 2))
        assert scratch["scale"][n, c, h, w] == want, (n, c, h, w)
    assert reordered > 0   # the order shows
    want = scratch["scale"].astype(np.float64) ** -0.75
    np.testing.assert_allclose(scratch["power"], want, rtol=2 ** -23)   # within an ulp


@pytest.mark.parametrize("beta", [0.75, 0.6])
def test_power_is_rounded_once(beta):
    """beta 0.75 (AlexNet's, GoogLeNet's) takes square roots in float64: the power rounded
    once to float32, here on 200,000 scales from AlexNet's range to 1e4; other betas take
    float32's power, within a step of it."""
    from cgp.kernels import lrn as K
    rng = np.random.default_rng(3)
    shape = (4, 50, 1000)
    scale = np.concatenate([rng.uniform(1, 1.01, shape[0] * 25000),
                            rng.uniform(0.5, 1e4, shape[0] * 25000)]).astype(np.float32)
    scale = scale.reshape(shape)
    x = rng.standard_normal(shape).astype(np.float32)
    y, power = np.empty_like(x), np.empty_like(x)
    for c in range(shape[0]):
        K._power_plane(x[c], y[c], scale[c], power[c], np.float32(beta))
    exact = (scale.astype(np.float64) ** -float(np.float32(beta))).astype(np.float32)
    if beta == 0.75:
        assert np.array_equal(power, exact)
    else:
        np.testing.assert_allclose(power, exact, rtol=2 ** -23)
    assert np.array_equal(y, power * x)


@pytest.mark.parametrize("size", [1, 3, 5])
def test_across_gradients(size):
    layer = build(lrn_text(size, extra="alpha: 0.9 beta: 0.7 k: 1.5"), [SHAPE])
    check_gradients(layer, [data()], params=[])


@pytest.mark.parametrize("size", [1, 3, 5])
def test_within_gradients(size):
    layer = build(lrn_text(size, "WITHIN_CHANNEL", "alpha: 2 beta: 0.75"), [SHAPE])
    check_gradients(layer, [data()], params=[])


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
def test_split_invariance(region):
    layer = build(lrn_text(3, region), [(5, 4, 3, 3)])
    check_split_invariance(layer, [data((5, 4, 3, 3))], params=[], cut=2)


@pytest.mark.parametrize("text, shape, message", [
    (lrn_text(4), SHAPE, "odd"),
    (lrn_text(0), SHAPE, "odd"),
    (lrn_text(3), (2, 4, 3), "4 axes"),
])
def test_refused(text, shape, message):
    with pytest.raises(NetError, match=message):
        build(text, [shape])
