"""Slice, Crop, Tile and Silence against NumPy, finite differences and batch splits, plus
Caffe's shape and parameter rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import Chunk
from layer_check import (backward, blob_names, build, check_forward, check_gradients,
                         check_split_invariance, forward, rand)


# -- Slice -------------------------------------------------------------------------------------

@pytest.mark.parametrize("param, shape, tops, axis, points", [
    ("", (3, 4, 2), 2, 1, [2]),
    ("slice_param { slice_point: 1 slice_point: 3 }", (3, 4, 2), 3, 1, [1, 3]),
    ("slice_param { axis: 2 slice_point: 1 }", (3, 2, 3, 2), 2, 2, [1]),
    ("slice_param { axis: -1 }", (3, 2, 6), 3, 2, [2, 4]),
    ("slice_param { slice_dim: 1 slice_point: 1 }", (3, 2), 2, 1, [1]),   # the old name
    ("", (3, 5, 2), 1, 1, []),                                             # one top: a copy
])
def test_slice(param, shape, tops, axis, points):
    layer = build(f'type: "Slice" bottom: "x" {blob_names("top", tops)} {param}', [shape])
    x = rand(shape)
    want = np.split(x, points, axis=axis)
    assert layer.top_shapes == [w.shape for w in want]
    check_forward(layer, [x], lambda x: tuple(np.split(x, points, axis=axis)), rtol=0, atol=0)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)


@pytest.mark.parametrize("param, tops, message", [
    ("slice_param { slice_point: 1 }", 3, "one fewer than the tops"),
    ("slice_param { slice_point: 3 slice_point: 2 }", 3, "increase strictly"),
    ("slice_param { slice_point: 4 }", 2, "increase strictly"),
    ("", 3, "evenly"),
    ("slice_param { axis: 0 }", 2, "batch axis"),
    ("slice_param { slice_dim: 0 }", 2, "batch axis"),
    ("slice_param { axis: 1 slice_dim: 1 }", 2, "not both"),
])
def test_slice_refused(param, tops, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Slice" bottom: "x" {blob_names("top", tops)} {param}', [(4, 4, 2)])


# -- Crop --------------------------------------------------------------------------------------

def crop_ref(offsets):
    def reference(x, ref):
        window = tuple(slice(o, o + s) for o, s in zip(offsets, ref.shape))
        return x[window]
    return reference


@pytest.mark.parametrize("param, big, small, offsets", [
    ("", (2, 3, 5, 6), (2, 1, 3, 4), (0, 0, 0, 0)),                 # axis 2, offset 0
    ("crop_param { offset: 1 }", (2, 3, 5, 6), (2, 1, 3, 4), (0, 0, 1, 1)),
    ("crop_param { axis: 1 offset: 1 offset: 2 offset: 0 }", (2, 4, 5, 6), (2, 2, 3, 4),
     (0, 1, 2, 0)),
    ("crop_param { axis: -1 offset: 2 }", (2, 3, 6), (2, 1, 3), (0, 0, 2)),
    ("crop_param { axis: 0 }", (2, 3, 4), (2, 2, 2), (0, 0, 0)),
])
def test_crop(param, big, small, offsets):
    layer = build(f'type: "Crop" bottom: "x" bottom: "ref" top: "y" {param}', [big, small])
    start = layer.lp.crop_param.axis % len(big)
    want = big[:start] + small[start:]       # the axes before the crop axis stay whole
    assert layer.top_shapes == [want]
    x, ref = rand(big), rand(small, 1)
    check_forward(layer, [x, ref], lambda x, r: crop_ref(offsets)(x, np.zeros(want)),
                  rtol=0, atol=0)
    check_gradients(layer, [x, ref], check=[True, False])
    check_split_invariance(layer, [x, ref], cut=1)
    # Outside the window the gradient is zero (the input-gradient buffer starts as 7s).
    _, (dx, _), _ = backward(layer, [x, ref], [], [np.ones(want)], propagate=[True, False])
    assert dx.sum() == np.prod(want) and set(np.unique(dx)) <= {0.0, 1.0}


@pytest.mark.parametrize("param, message", [
    ("crop_param { offset: 3 }", "out of bounds"),
    ("crop_param { axis: 1 offset: 1 offset: 1 }", "give one, or one per axis"),
    ("crop_param { axis: 0 offset: 1 }", "out of bounds"),    # the batch axis: offset 0 only
    ("crop_param { axis: 4 }", "out of range"),
])
def test_crop_refused(param, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Crop" bottom: "x" bottom: "ref" top: "y" {param}',
              [(2, 3, 5, 6), (2, 3, 3, 4)])


# -- Tile --------------------------------------------------------------------------------------

@pytest.mark.parametrize("param, shape, axis, tiles", [
    ("tile_param { tiles: 3 }", (2, 2, 3), 1, 3),
    ("tile_param { axis: 2 tiles: 2 }", (2, 2, 3, 2), 2, 2),
    ("tile_param { axis: -1 tiles: 4 }", (3, 5), 1, 4),
])
def test_tile(param, shape, axis, tiles):
    layer = build(f'type: "Tile" bottom: "x" top: "y" {param}', [shape])
    reps = [1] * len(shape)
    reps[axis] = tiles
    x = rand(shape)
    check_forward(layer, [x], lambda x: np.tile(x, reps), rtol=0, atol=0)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)


@pytest.mark.parametrize("param, message", [
    ("", "tiles must be given"), ("tile_param { tiles: 0 }", "positive"),
    ("tile_param { axis: 0 tiles: 2 }", "batch axis"),
])
def test_tile_refused(param, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Tile" bottom: "x" top: "y" {param}', [(2, 3)])


# -- Silence -----------------------------------------------------------------------------------

def test_silence_has_no_top_and_a_zero_gradient():
    layer = build('type: "Silence" bottom: "a" bottom: "b"', [(2, 3), (2, 1, 2)])
    assert layer.top_shapes == []
    a, b = rand((2, 3)), rand((2, 1, 2), 1)
    tops, (da, db), _ = backward(layer, [a, b], [], [], propagate=[True, False])
    assert tops == [] and db is None
    np.testing.assert_array_equal(da, np.zeros((2, 3)))
    with pytest.raises(NetError, match="takes 0 top"):
        build('type: "Silence" bottom: "a" top: "y"', [(2, 3)])
    forward(layer, [a, b], [], Chunk(n=2))
