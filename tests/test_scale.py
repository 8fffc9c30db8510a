"""Scale and Bias against float64 NumPy broadcasting, finite differences, batch splits and
per-part gradients, with a learnt blob or a second bottom, and Caffe's shape rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.kernels import scale as K
from cgp.layers import Chunk
from layer_check import (backward, build, check_forward, check_gradients, check_parts,
                         check_split_invariance, forward)

SHAPE = (4, 3, 2, 3)


def data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def spread(blob, shape, axis):
    """blob reshaped to broadcast against `shape` from `axis` on."""
    return blob.reshape((1,) * axis + blob.shape + (1,) * (len(shape) - axis - blob.ndim))


# (scale_param fields, blob shape, axis it starts at)
PLACES = [
    ("", (3,), 1),
    ("axis: 2 num_axes: 2", (2, 3), 2),
    ("axis: 1 num_axes: -1", (3, 2, 3), 1),
    ("axis: -1", (3,), 3),
    ("num_axes: 0", (), 0),
    ("axis: 0 num_axes: 2", (4, 3), 0),      # one learnt row per sample of the batch
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fields, blob, axis", PLACES)
def test_scale_learnt(fields, blob, axis, bias):
    layer = build(f'type: "Scale" bottom: "x" top: "y" scale_param {{ {fields} '
                  f'bias_term: {str(bias).lower()} }}', [SHAPE])
    assert layer.param_shapes() == [blob] * (2 if bias else 1)
    x = data(SHAPE)

    def reference(x, s, b=None):
        y = x * spread(s, SHAPE, axis)
        return y if b is None else y + spread(b, SHAPE, axis)
    check_forward(layer, [x], reference)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)
    check_parts(layer, [x], (0, 1, 3, 4))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_sum_in_lanes_and_fuse_the_bias(dtype):
    """product_sums and row_sums (the factors' and addends' gradients) take each row's sum in
    the lanes' order (kernels/batchnorm.py), bit for bit, adding the rows of each part in order, as
    product_and_row_sums does in one pass; scale_bias_forward gives the bits of scale_forward
    then bias_forward."""
    from test_batchnorm import lane_reference
    rng = np.random.default_rng(2)
    O, D, I = 5, 3, 21
    dy, x = (rng.standard_normal((O, D, I)).astype(dtype) for _ in range(2))
    starts = np.array([0, 2, 5])
    ds, db = np.zeros(2 * D, np.float64), np.zeros(2 * D, np.float64)
    K.product_sums(dy, x, ds, 0, 0, starts, D, False)
    K.row_sums(dy, db, 0, 0, starts, D, False)
    for p in range(2):
        for d in range(D):
            rows = range(starts[p], starts[p + 1])
            # Each row's sum is written over the last (accumulate False): the part's last row.
            last = rows[-1]
            assert ds[p * D + d] == lane_reference((dy[last, d] * x[last, d]).astype(np.float64))
            assert db[p * D + d] == lane_reference(dy[last, d].astype(np.float64))
    ds[:] = 0   # accumulate: each part's rows added in order
    K.product_sums(dy, x, ds, 0, 0, starts, D, True)
    for p in range(2):
        for d in range(D):
            want = 0.0
            for o in range(starts[p], starts[p + 1]):
                want += lane_reference((dy[o, d] * x[o, d]).astype(np.float64))
            assert ds[p * D + d] == want
    both_s, both_b = np.zeros_like(ds), np.ones_like(db)
    K.product_and_row_sums(dy, x, both_s, both_b, 0, 0, starts, D, D)
    db[:] = 1
    K.row_sums(dy, db, 0, 0, starts, D, True)
    assert np.array_equal(both_s, ds) and np.array_equal(both_b, db)
    s, b = rng.standard_normal(D).astype(dtype), rng.standard_normal(D).astype(dtype)
    # The sums and the input gradient in one pass: the bits of the two kernels.
    fused_s, fused_b, dx = np.zeros_like(ds), np.ones_like(db), np.zeros_like(x)
    K.product_and_row_sums_then_scale(dy, x, s, fused_s, fused_b, 0, 0, starts, D, D, dx)
    alone = np.zeros_like(x)
    K.scale_forward(dy, s, 0, 0, alone)
    assert np.array_equal(fused_s, ds) and np.array_equal(fused_b, db)
    assert np.array_equal(dx, alone)
    assert np.array_equal(dx, (dy.astype(np.float64) * s[:, None]).astype(dtype))
    two, one = np.zeros_like(x), np.zeros_like(x)
    K.scale_forward(x, s, 0, 0, two)
    K.bias_forward(two, b, 0, 0, two)
    K.scale_bias_forward(x, s, 0, 0, b, 0, 0, one)
    assert np.array_equal(one, two)


def test_scale_fillers():
    layer = build('type: "Scale" bottom: "x" top: "y" scale_param { bias_term: true }', [SHAPE])
    scale, bias = layer.param_fillers()
    assert (scale.type, scale.value) == ("constant", 1.0)
    assert (bias.type, bias.value) == ("constant", 0.0)
    layer = build('type: "Scale" bottom: "x" top: "y" scale_param { bias_term: true '
                  'filler { type: "gaussian" std: 2 } bias_filler { type: "constant" value: 3 } }',
                  [SHAPE])
    scale, bias = layer.param_fillers()
    assert (scale.type, scale.std, bias.value) == ("gaussian", 2.0, 3.0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("blob", [(4, 3), (4, 3, 2), (4,)])
def test_scale_by_a_second_bottom(blob, bias):
    """Squeeze-and-excitation's Scale: a per-sample blob as the second bottom, from axis 0."""
    layer = build(f'type: "Scale" bottom: "x" bottom: "s" top: "y" scale_param {{ axis: 0 '
                  f'bias_term: {str(bias).lower()} }}', [SHAPE, blob])
    assert layer.param_shapes() == ([blob] if bias else [])
    x, s = data(SHAPE), data(blob, 1)

    def reference(x, s, b=None):
        y = x * spread(s, SHAPE, 0)
        return y if b is None else y + spread(b, SHAPE, 0)
    check_forward(layer, [x, s], reference)
    check_gradients(layer, [x, s])
    check_split_invariance(layer, [x, s], cut=3)
    check_parts(layer, [x, s], (0, 2, 4))


@pytest.mark.parametrize("fields, blob, axis", PLACES)
def test_bias_learnt(fields, blob, axis):
    layer = build(f'type: "Bias" bottom: "x" top: "y" bias_param {{ {fields} }}', [SHAPE])
    assert layer.param_shapes() == [blob]
    x = data(SHAPE)
    check_forward(layer, [x], lambda x, b: x + spread(b, SHAPE, axis))
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)
    check_parts(layer, [x], (0, 1, 3, 4))


def test_bias_by_a_second_bottom():
    layer = build('type: "Bias" bottom: "x" bottom: "b" top: "y" bias_param { axis: 0 }',
                  [SHAPE, (4, 3)])
    x, b = data(SHAPE), data((4, 3), 1)
    check_forward(layer, [x, b], lambda x, b: x + spread(b, SHAPE, 0))
    check_gradients(layer, [x, b])
    check_split_invariance(layer, [x, b], cut=1)


def test_learnt_rows_per_sample_follow_the_call():
    """A blob from axis 0 has one row per sample of the batch: a call of samples 2 and 3
    reads and adds to rows 2 and 3 alone."""
    layer = build('type: "Scale" bottom: "x" top: "y" scale_param { axis: 0 num_axes: 2 }',
                  [SHAPE])
    x, s = data(SHAPE).astype(np.float32), data((4, 3), 1).astype(np.float32)
    chunk = Chunk(n=2, first=2, batch=4)
    dy = np.ones((2,) + SHAPE[1:], np.float32)
    tops, _, (ds,) = backward(layer, [x[2:]], [s], [dy], chunk)
    np.testing.assert_allclose(tops[0], x[2:] * s[2:, :, None, None], rtol=1e-6)
    assert not ds[:2].any()
    np.testing.assert_allclose(ds[2:], x[2:].sum(axis=(2, 3)), rtol=1e-5)


@pytest.mark.parametrize("text, shapes, message", [
    ('bottom: "x" bottom: "s" scale_param { axis: 1 }', [SHAPE, (4, 3)], "set axis: 0"),
    ('bottom: "x" bottom: "s" scale_param { axis: 0 }', [SHAPE, (4, 2)], "must match"),
    ('bottom: "x" scale_param { num_axes: -2 }', [SHAPE], "non-negative"),
    ('bottom: "x" scale_param { axis: 2 num_axes: 3 }', [SHAPE], "extends past"),
    ('bottom: "x" scale_param { axis: 4 }', [SHAPE], "out of range"),
])
def test_scale_refused(text, shapes, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Scale" {text} top: "y"', shapes)


def test_scale_gradient_without_dx():
    layer = build('type: "Scale" bottom: "x" top: "y" scale_param { bias_term: true }', [SHAPE])
    check_gradients(layer, [data(SHAPE)], check=[False])
    (y,), _ = forward(layer, [data(SHAPE)], [np.ones(3), np.zeros(3)])
    np.testing.assert_array_equal(y, data(SHAPE))
