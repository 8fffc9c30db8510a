"""Concat, Eltwise, Flatten, Reshape and Split against float64 NumPy references, finite
differences and batch splits, plus Caffe's shape and parameter rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from layer_check import (backward, blob_names, build, check_forward, check_gradients,
                         check_split_invariance, forward, rand)


# -- Concat -----------------------------------------------------------------------------------

@pytest.mark.parametrize("param, shapes, axis", [
    ("", [(3, 2, 2, 3), (3, 1, 2, 3), (3, 3, 2, 3)], 1),
    ("concat_param { axis: 2 }", [(3, 2, 1, 3), (3, 2, 3, 3)], 2),
    ("concat_param { axis: -1 }", [(3, 2, 2, 1), (3, 2, 2, 2)], 3),
    ("concat_param { concat_dim: 1 }", [(3, 4), (3, 2)], 1),    # Caffe's old name
    ("", [(3, 2, 2)], 1),                                        # one bottom: a copy
])
def test_concat(param, shapes, axis):
    layer = build(f'type: "Concat" {blob_names("bottom", len(shapes))} top: "y" {param}', shapes)
    xs = [rand(s, i) for i, s in enumerate(shapes)]
    want = list(shapes[0])
    want[axis] = sum(s[axis] for s in shapes)
    assert layer.top_shapes == [tuple(want)]
    check_forward(layer, xs, lambda *b: np.concatenate(b, axis=axis), rtol=0, atol=0)
    check_gradients(layer, xs)
    check_split_invariance(layer, xs, cut=1)


def test_concat_skips_bottoms_without_gradient():
    shapes = [(2, 1, 3), (2, 2, 3)]
    layer = build(f'type: "Concat" {blob_names("bottom", 2)} top: "y"', shapes)
    xs = [rand(s, i) for i, s in enumerate(shapes)]
    dy = rand((2, 3, 3), 5)
    _, (dx0, dx1), _ = backward(layer, xs, [], [dy], propagate=[False, True])
    assert dx0 is None
    np.testing.assert_array_equal(dx1, dy[:, 1:])


@pytest.mark.parametrize("param, shapes, message", [
    ("", [(2, 3, 4, 4), (2, 5, 3, 4)], r"'b0' \(2, 3, 4, 4\).*'b1' \(2, 5, 3, 4\)"),
    ("", [(2, 3, 4), (2, 3, 4, 1)], r"\(2, 3, 4\).*\(2, 3, 4, 1\)"),
    ("concat_param { axis: 0 }", [(2, 3), (2, 3)], "batch axis"),
    ("concat_param { concat_dim: 0 }", [(2, 3), (2, 3)], "batch axis"),
    ("concat_param { axis: 4 }", [(2, 3), (2, 3)], "out of range"),
    ("concat_param { axis: 1 concat_dim: 1 }", [(2, 3), (2, 3)], "not both"),
])
def test_concat_errors(param, shapes, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Concat" {blob_names("bottom", len(shapes))} top: "y" {param}', shapes)


# -- Eltwise ----------------------------------------------------------------------------------

E = (3, 2, 2, 2)


def eltwise(param, count=3):
    return build(f'type: "Eltwise" {blob_names("bottom", count)} top: "y" {param}', [E] * count)


@pytest.mark.parametrize("param, reference", [
    ("", lambda a, b, c: a + b + c),
    ("eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }",
     lambda a, b, c: a - 0.5 * b + 2 * c),
    ("eltwise_param { operation: PROD }", lambda a, b, c: a * b * c),
    ("eltwise_param { operation: PROD stable_prod_grad: false }", lambda a, b, c: a * b * c),
    ("eltwise_param { operation: MAX }", lambda a, b, c: np.maximum(np.maximum(a, b), c)),
])
def test_eltwise(param, reference):
    layer = eltwise(param)
    xs = [rand(E, i) for i in range(3)]
    if "PROD" in param:
        xs = [x + np.sign(x) * 0.2 for x in xs]      # away from 0 for the division form
    assert layer.top_shapes == [E]
    check_forward(layer, xs, reference)
    check_gradients(layer, xs)                        # MAX: random inputs never tie
    check_split_invariance(layer, xs, cut=2)


@pytest.mark.parametrize("param", ["", "eltwise_param { coeff: -0.5 coeff: 3 }"])
def test_eltwise_two_bottoms_sum(param):
    """Two bottoms (ResNet's shortcuts): both gradients from one kernel, c_i * dy in float32,
    and one without a gradient."""
    layer = build(f'type: "Eltwise" {blob_names("bottom", 2)} top: "y" {param}', [E, E])
    c = [-0.5, 3] if param else [1, 1]
    xs = [rand(E, 1), rand(E, 2)]
    check_forward(layer, xs, lambda a, b: c[0] * a + c[1] * b)
    check_gradients(layer, xs)
    a, b, dy = (rand(E, i).astype(np.float32) for i in (1, 2, 3))
    _, (da, db), _ = backward(layer, [a, b], [], [dy])
    np.testing.assert_array_equal(da, np.float32(c[0]) * dy)
    np.testing.assert_array_equal(db, np.float32(c[1]) * dy)
    db = np.full_like(b, 7.0)
    layer.backward([a + b], [dy], [a, b], [None, db], [], [], {}, None)
    np.testing.assert_array_equal(db, np.float32(c[1]) * dy)


def test_eltwise_two_bottoms_prod_gradient():
    layer = build(f'type: "Eltwise" {blob_names("bottom", 2)} top: "y" '
                  'eltwise_param { operation: PROD }', [E, E])
    a, b, dy = rand(E, 1), rand(E, 2), rand(E, 3)
    _, (da, db), _ = backward(layer, [a, b], [], [dy])
    np.testing.assert_allclose(da, b * dy)
    np.testing.assert_allclose(db, a * dy)


def test_eltwise_max_ties_follow_caffe():
    # The first pair's tie goes to bottom 1; a later bottom must be strictly greater.
    layer = build(f'type: "Eltwise" {blob_names("bottom", 3)} top: "y" '
                  'eltwise_param { operation: MAX }', [(1, 4)] * 3)
    a = np.array([[1.0, 2.0, 0.0, 5.0]])
    b = np.array([[1.0, 1.0, 3.0, 0.0]])
    c = np.array([[1.0, 2.0, 3.0, 6.0]])
    dy = np.array([[10.0, 20.0, 30.0, 40.0]])
    tops, (da, db, dc), _ = backward(layer, [a, b, c], [], [dy])
    np.testing.assert_array_equal(tops[0], [[1.0, 2.0, 3.0, 6.0]])
    np.testing.assert_array_equal(da, [[0, 20, 0, 0]])
    np.testing.assert_array_equal(db, [[10, 0, 30, 0]])
    np.testing.assert_array_equal(dc, [[0, 0, 0, 40]])


@pytest.mark.parametrize("param, shapes, message", [
    ("", [E, (3, 2, 2, 1)], r"'b0' \(3, 2, 2, 2\), bottom 'b1' \(3, 2, 2, 1\)"),
    ("eltwise_param { coeff: 1 }", [E, E], "one coefficient per bottom"),
    ("eltwise_param { operation: PROD coeff: 1 coeff: 2 }", [E, E], "only to operation SUM"),
    ("eltwise_param { operation: MAX coeff: 1 coeff: 2 }", [E, E], "only to operation SUM"),
    ("", [E], "takes 2 to any bottom"),
])
def test_eltwise_errors(param, shapes, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Eltwise" {blob_names("bottom", len(shapes))} top: "y" {param}', shapes)


# -- Flatten and Reshape ----------------------------------------------------------------------

@pytest.mark.parametrize("kind, param, shape, want", [
    ("Flatten", "", (2, 3, 2, 2), (2, 12)),
    ("Flatten", "flatten_param { axis: 2 }", (2, 3, 2, 2), (2, 3, 4)),
    ("Flatten", "flatten_param { axis: 1 end_axis: 2 }", (2, 3, 2, 2), (2, 6, 2)),
    ("Flatten", "flatten_param { axis: -2 end_axis: -2 }", (2, 3, 2, 2), (2, 3, 2, 2)),
    ("Flatten", "flatten_param { axis: 2 end_axis: 1 }", (2, 3, 2), (2, 3, 1, 2)),  # as Caffe
    ("Reshape", "reshape_param { shape { dim: 0 dim: -1 } }", (2, 3, 2, 2), (2, 12)),
    ("Reshape", "reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 3 } }", (2, 3, 2, 2),
     (2, 2, 2, 3)),
    ("Reshape", "reshape_param { shape { dim: 2 dim: 2 } axis: 1 num_axes: 1 }", (2, 4, 3),
     (2, 2, 2, 3)),
    ("Reshape", "reshape_param { shape { dim: 1 } axis: -1 num_axes: 0 }", (2, 4, 3),
     (2, 4, 3, 1)),
    ("Reshape", "reshape_param { shape { dim: -1 } axis: 1 }", (2, 4, 3), (2, 12)),
])
def test_flatten_reshape(kind, param, shape, want):
    layer = build(f'type: "{kind}" bottom: "x" top: "y" {param}', [shape])
    assert layer.top_shapes == [want]
    x = rand(shape)
    check_forward(layer, [x], lambda x: x.reshape(want), rtol=0, atol=0)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)


@pytest.mark.parametrize("kind, param, message", [
    ("Flatten", "flatten_param { axis: 0 }", "batch axis"),
    ("Flatten", "flatten_param { axis: 2 end_axis: 0 }", "before axis"),
    ("Flatten", "flatten_param { end_axis: 4 }", "out of range"),
    ("Reshape", "reshape_param { shape { dim: -1 dim: 3 } }", "batch axis"),
    ("Reshape", "reshape_param { shape { dim: 0 dim: -1 dim: -1 } }", "at most one -1"),
    ("Reshape", "reshape_param { shape { dim: 0 dim: 5 } }", "different numbers"),
    ("Reshape", "reshape_param { shape { dim: 0 dim: -1 dim: 5 } }", "cannot infer"),
    ("Reshape", "reshape_param { shape { dim: 0 } axis: 3 }", "no axis 3 to copy"),
    ("Reshape", "reshape_param { shape { dim: 2 } axis: 2 num_axes: 2 }", "out of range"),
])
def test_flatten_reshape_errors(kind, param, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "{kind}" bottom: "x" top: "y" {param}', [(4, 3, 2)])


# -- Split ------------------------------------------------------------------------------------

def test_split():
    shape = (3, 2, 3)
    layer = build('type: "Split" bottom: "x" top: "a" top: "b" top: "c"', [shape])
    assert layer.top_shapes == [shape] * 3
    x = rand(shape)
    check_forward(layer, [x], lambda x: (x, x, x), rtol=0, atol=0)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)
    d = [rand(shape, i).astype(np.float32) for i in range(3)]
    _, (dx,), _ = backward(layer, [x.astype(np.float32)], [], d)
    np.testing.assert_array_equal(dx, (d[0] + d[1]) + d[2])     # top order, in float32


@pytest.mark.parametrize("tops", [4, 5, 6])
def test_split_sums_gradients_in_top_order(tops):
    """Three or more gradients go two more a pass: the bits of adding them one at a time."""
    shape = (2, 3, 4)
    names = " ".join(f'top: "t{j}"' for j in range(tops))
    layer = build(f'type: "Split" bottom: "x" {names}', [shape])
    x = rand(shape).astype(np.float32)
    d = [rand(shape, j).astype(np.float32) for j in range(tops)]
    _, (dx,), _ = backward(layer, [x], [], d)
    want = d[0] + d[1]
    for g in d[2:]:
        want = want + g
    np.testing.assert_array_equal(dx, want)
    (*ys,), _ = forward(layer, [x], [])
    assert all(np.array_equal(y, x) for y in ys)


def test_split_one_top_and_missing_diffs():
    shape = (2, 3)
    one = build('type: "Split" bottom: "x" top: "a"', [shape])
    x, dy = rand(shape), rand(shape, 1)
    _, (dx,), _ = backward(one, [x], [], [dy])
    np.testing.assert_array_equal(dx, dy)
    two = build('type: "Split" bottom: "x" top: "a" top: "b"', [shape])
    (ta, tb), _ = forward(two, [x], [])
    dx = np.full_like(x, 7.0)
    two.backward([ta, tb], [None, dy], [x], [dx], [], [], {}, None)
    np.testing.assert_array_equal(dx, dy)
    with pytest.raises(NetError, match="at least|1 to any top"):
        build('type: "Split" bottom: "x"', [shape])
