"""InnerProduct against float64 einsum references (axis 1, 2, -1, transpose, no bias),
gradient checks (row counts around the kernels' blocks of four), split invariance at many cuts,
shape rules and Caffe's parameter rules; Embed against a NumPy lookup."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import Chunk, Factors
from layer_check import (backward, build, check_forward, check_gradients, forward,
                         check_parts, check_split_invariance, random_params)


def ip_text(fields):
    return f'type: "InnerProduct" bottom: "x" top: "y" inner_product_param {{ {fields} }}'


def ip_ref(x, w, b=None, axis=1, transpose=False):
    rows = x.reshape(x.shape[:axis] + (-1,))
    y = rows @ w if transpose else rows @ w.T
    return y if b is None else y + b


def data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# (prototxt fields, bottom shape, top shape, weight shape, reference keyword arguments)
CONFIGS = {
    "axis1": ("num_output: 3", (2, 2, 3, 2), (2, 3), (3, 12), {}),
    "axis2": ("num_output: 3 axis: 2", (2, 2, 3, 2), (2, 2, 3), (3, 6), dict(axis=2)),
    "axis_last": ("num_output: 2 axis: -1", (2, 3, 4), (2, 3, 2), (2, 4), dict(axis=2)),
    "transpose": ("num_output: 3 transpose: true", (3, 5), (3, 3), (5, 3),
                  dict(transpose=True)),
    "transpose_axis2": ("num_output: 4 axis: 2 transpose: true", (2, 3, 5), (2, 3, 4), (5, 4),
                        dict(axis=2, transpose=True)),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward(name, bias):
    fields, shape, top, weight, kw = CONFIGS[name]
    layer = build(ip_text(f"{fields} bias_term: {str(bias).lower()}"), [shape])
    assert layer.top_shapes == [top]
    assert layer.param_shapes() == ([weight, (weight[1] if kw.get("transpose") else weight[0],)]
                                    if bias else [weight])
    check_forward(layer, [data(shape)], lambda x, w, b=None: ip_ref(x, w, b, **kw))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients(name):
    fields, shape, *_ = CONFIGS[name]
    layer = build(ip_text(fields), [shape])
    check_gradients(layer, [data(shape)])


@pytest.mark.parametrize("n, outputs, inputs", [(2, 5, 3), (3, 6, 9), (5, 7, 4)])
@pytest.mark.parametrize("transpose", ["false", "true"])
def test_gradients_around_the_blocks(n, outputs, inputs, transpose):
    # The kernels take rows in fours (weight rows in fours or twos), then the rest; with axis 2
    # each sample has 2 rows: 4, 6 and 10 rows.
    layer = build(ip_text(f"num_output: {outputs} axis: 2 transpose: {transpose}"),
                  [(n, 2, inputs)])
    check_gradients(layer, [data((n, 2, inputs))])


def test_gradients_without_bias_or_dx():
    layer = build(ip_text("num_output: 3 bias_term: false"), [(3, 4)])
    check_gradients(layer, [data((3, 4))], check=[False])


def test_parameter_gradients_add():
    layer = build(ip_text("num_output: 3"), [(4, 5)])
    x, params, top_diff = data((4, 5)), random_params(layer), [data((4, 3), 1)]
    tops, _, once = backward(layer, [x], params, top_diff)
    scratch = {k: np.zeros(s) for k, s in layer.scratch_shapes(4).items()}
    diffs = [np.ones_like(p) for p in params]
    layer.backward(tops, top_diff, [x], [None], params, [d[None] for d in diffs], scratch, Chunk(n=4))
    for got, want in zip(diffs, once):
        np.testing.assert_allclose(got, want + 1, rtol=1e-12)


@pytest.mark.parametrize("fields, shape", [
    ("num_output: 7", (37, 6)),
    ("num_output: 7 axis: 2 transpose: true", (19, 3, 4)),
    ("num_output: 500", (9, 50, 4, 4)),    # LeNet ip1: BLAS's real kernels, not the tiny cases
])
def test_split_invariance(fields, shape):
    # A sample's result must not depend on where its chunk starts or ends, including chunks
    # of a single sample (BLAS treats one or two rows differently).
    layer = build(ip_text(fields), [shape])
    x = data(shape)
    n = shape[0]
    for cut in sorted({c for c in (1, 2, 5, 16, 17, n - 2, n - 1) if 0 < c < n}):
        check_split_invariance(layer, [x], cut=cut)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parts_get_their_own_gradients(name):
    """One call over three parts gives each part the gradients of a call with it alone."""
    fields, shape, _, _, _ = CONFIGS[name]
    shape = (6,) + shape[1:]
    check_parts(build(ip_text(fields), [shape]), [data(shape)], (0, 1, 4, 6))


@pytest.mark.parametrize("shape, fields, top, weight", [
    ((64, 50, 4, 4), "num_output: 500", (64, 500), (500, 800)),   # LeNet ip1
    ((64, 500), "num_output: 10", (64, 10), (10, 500)),           # LeNet ip2
    ((100, 64, 4, 4), "num_output: 64", (100, 64), (64, 1024)),   # cifar10_quick ip1
    ((100, 64, 4, 4), "num_output: 64 transpose: true", (100, 64), (1024, 64)),
    ((2, 3, 4, 5), "num_output: 6 axis: 3", (2, 3, 4, 6), (6, 5)),
])
def test_shapes(shape, fields, top, weight):
    layer = build(ip_text(fields), [shape])
    assert layer.top_shapes == [top]
    assert layer.param_shapes() == [weight, (top[-1],)]


def test_fillers():
    layer = build(ip_text('num_output: 2 weight_filler { type: "gaussian" std: 0.1 } '
                          'bias_filler { type: "constant" value: 0.5 }'), [(1, 3)])
    weight, bias = layer.param_fillers()
    assert weight.type == "gaussian" and abs(weight.std - 0.1) < 1e-7 and bias.value == 0.5
    layer = build(ip_text("num_output: 2 bias_term: false"), [(1, 3)])
    assert [f.type for f in layer.param_fillers()] == ["constant"]


@pytest.mark.parametrize("fields, shape, message", [
    ("num_output: 2 axis: 0", (2, 3), "axis 0"),
    ("num_output: 2 axis: -2", (2, 3), "axis 0"),
    ("num_output: 2 axis: 2", (2, 3), "out of range"),
    ("axis: 1", (2, 3), "num_output must be given"),
])
def test_refused(fields, shape, message):
    with pytest.raises(NetError, match=message):
        build(ip_text(fields), [shape])


def test_overwrite_mode_sets_gradients_bitwise_as_adding_to_zeros():
    """With overwrite_param_diff the kernel sets dw/db (the engine then skips zeroing them):
    bitwise the same as adding into zeros, whatever the buffer held before."""
    layer = build('type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 5 }',
                  [(7, 6)])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 6)).astype(np.float32)
    params = [p.astype(np.float32) for p in random_params(layer)]
    dy = [rng.standard_normal((7, 5)).astype(np.float32)]
    _, _, added = backward(layer, [x], params, dy)
    layer.overwrite_param_diff = True
    tops, scratch = forward(layer, [x], params)
    garbage = [np.full_like(p, np.nan) for p in params]
    layer.backward(tops, dy, [x], [np.zeros_like(x)], params, [g[None] for g in garbage], scratch,
                   Chunk(n=7))
    for got, want in zip(garbage, added):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_factored_weight_gradient(name):
    """Handed Factors for its weight gradient, the layer copies its A and B there, whose product
    A^T @ B is the weight gradient; dx and db are bitwise those of the unfactored path."""
    fields, shape, _, weight, _ = CONFIGS[name]
    layer = build(ip_text(fields), [shape])
    rows, J, L = layer.factor_shape()
    assert (J, L) == weight
    x = data(shape)
    params = random_params(layer)
    tops, scratch = forward(layer, [x], params)
    dy = [data(tops[0].shape, seed=1)]
    _, dx, (dw, db) = backward(layer, [x], params, dy)
    factors = Factors(np.full((shape[0] * rows, J), np.nan), np.full((shape[0] * rows, L), np.nan))
    got_dx, got_db = np.zeros_like(x), np.zeros_like(db)
    layer.backward(tops, dy, [x], [got_dx], params, [factors, got_db[None]], scratch,
                   Chunk(n=shape[0]))
    np.testing.assert_allclose(factors.a.T @ factors.b, dw, rtol=1e-12, atol=1e-12)
    assert np.array_equal(got_dx, dx[0]) and np.array_equal(got_db, db)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_axpy_kernel(dtype):
    """rows_axpy (the input gradient, and the forward pass of a transposed weight) against
    float64, at widths around its vectors and tiles, with NaN in its scratch; and each row
    bitwise the same whatever the other rows (row counts pick different tile shapes)."""
    from cgp.kernels.fc import rows_axpy, scratch_size

    rng = np.random.default_rng(7)
    for R in (0, 1, 5, 50):
        for L in (0, 1, 15, 16, 17, 63, 64, 65, 200):
            w = rng.standard_normal((R, L)).astype(dtype)
            a = rng.standard_normal((13, R)).astype(dtype)
            whole = None
            for M in (13, 1, 2, 4, 7, 12):
                out = np.full((M, L), np.nan, dtype)
                rows_axpy(a[:M], w, out, np.full(scratch_size(M, R), np.nan, dtype))
                tol = 1e-5 if dtype == np.float32 else 1e-12
                np.testing.assert_allclose(out, a[:M].astype(np.float64) @ w, rtol=tol,
                                           atol=tol * R)
                if whole is None:
                    whole = out
                assert np.array_equal(out, whole[:M]), (R, L, M)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_axpy_runs_each_chain_in_row_order_across_its_blocks_of_rows(dtype):
    """rows_axpy's tiles go over w in blocks of rows (AXPY_BLOCK_BYTES), each continuing the
    chains the block before left in out: with a = 1 the multiply-adds are plain adds, so each
    element must be exactly w's column added up in row order, in the dtype, whatever the row
    count (which picks the tile shape, (4, 4) at 4 rows); on values whose sums round
    differently in another order, over several blocks and a last column strip narrower than
    a tile."""
    from cgp.kernels.fc import AXPY_BLOCK_BYTES, rows_axpy, scratch_size

    rng = np.random.default_rng(9)
    L = 2 * 64 + 5
    R = 2 * AXPY_BLOCK_BYTES // (L * np.dtype(dtype).itemsize) + 7   # three blocks
    w = (rng.standard_normal((R, L)) * 10.0 ** rng.integers(-8, 9, (R, L))).astype(dtype)
    expected = np.zeros(L, dtype)
    for r in range(R):
        expected = expected + w[r]
    assert not np.array_equal(expected, w[::-1].sum(axis=0, dtype=dtype))  # order shows
    for M in (1, 4, 5, 13):
        out = np.full((M, L), np.nan, dtype)
        rows_axpy(np.ones((M, R), dtype), w, out, np.full(scratch_size(M, R), np.nan, dtype))
        assert np.array_equal(out, np.broadcast_to(expected, (M, L))), M


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_outer_rows_kernel(dtype):
    """add_outer_rows (the weight gradient where it is not factored) against float64 at sizes
    around its tiles, adding to what g held or, with overwrite, from 0; and each element
    exactly its chain over the rows in order, whether a tile or the loops for the rows and
    columns left over compute it: with a = 1 the multiply-adds are plain adds, emulated here
    in the dtype on values whose sums round differently in another order."""
    from cgp.kernels.fc import add_outer_rows

    rng = np.random.default_rng(10)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for M in (0, 1, 5, 13):
        for J in (1, 4, 13, 25):
            for L in (1, 16, 33, 65, 200):
                a = rng.standard_normal((M, J)).astype(dtype)
                b = rng.standard_normal((M, L)).astype(dtype)
                g0 = rng.standard_normal((J, L)).astype(dtype)
                for overwrite in (False, True):
                    g = g0.copy()
                    add_outer_rows(a, b, g, overwrite)
                    np.testing.assert_allclose(g, a.T.astype(np.float64) @ b
                                               + (0 if overwrite else g0),
                                               rtol=tol, atol=tol * max(M, 1))
    V = 64 // np.dtype(dtype).itemsize
    M, J, L = 21, 13, 4 * V + 5   # a row and some columns past the whole tiles
    b = (rng.standard_normal((M, L)) * 10.0 ** rng.integers(-8, 9, (M, L))).astype(dtype)
    g0 = (rng.standard_normal((J, L)) * 10.0 ** rng.integers(-8, 9, (J, L))).astype(dtype)
    for overwrite in (False, True):
        expected = np.zeros((J, L), dtype) if overwrite else g0.copy()
        for m in range(M):
            expected = expected + b[m]
        assert not np.array_equal(expected[0], (b[::-1].sum(axis=0, dtype=dtype)
                                                + (0 if overwrite else g0[0])))  # order shows
        g = g0.copy()
        add_outer_rows(np.ones((M, J), dtype), b, g, overwrite)
        assert np.array_equal(g, expected), overwrite


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_dot_kernel(dtype):
    """rows_dot (the forward pass, and the input gradient of a transposed weight) against
    float64 at lengths around its vectors and row counts around its 4 x 6 tiles; each element
    bitwise the same whatever the other rows; and exactly the documented order: one chain per
    lane, then the lanes in a tree (with a = 1 the multiply-adds are plain adds, emulated
    here in the dtype on values whose sums round differently in another order)."""
    from cgp.kernels.fc import rows_dot

    rng = np.random.default_rng(8)
    V = 64 // np.dtype(dtype).itemsize
    for L in (1, 5, V - 1, V, V + 1, 3 * V + 7, 200):
        for R in (1, 5, 6, 7, 13):
            w = rng.standard_normal((R, L)).astype(dtype)
            a = rng.standard_normal((9, L)).astype(dtype)
            whole = np.full((9, R), np.nan, dtype)
            rows_dot(a, w, whole)
            tol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(whole, a.astype(np.float64) @ w.T.astype(np.float64),
                                       rtol=tol, atol=tol * L)
            for M in (1, 2, 3, 5):
                for first in (0, 4 - M % 4):
                    out = np.full((M, 1), np.nan, dtype)
                    rows_dot(a[first:first + M], w[R - 1:], out)
                    assert np.array_equal(out[:, 0], whole[first:first + M, R - 1]), (L, R, M)
    L, R = 5 * V + 3, 4
    w = (rng.standard_normal((R, L)) * 10.0 ** rng.integers(-12, 13, (R, L))).astype(dtype)
    out = np.zeros((1, R), dtype)
    rows_dot(np.ones((1, L), dtype), w, out)
    in_row_order = 0
    for r in range(R):
        lanes = np.zeros(V, dtype)
        for c in range(L):
            lanes[c % V] = lanes[c % V] + w[r, c]
        half = V // 2
        while half:
            lanes = lanes[:half] + lanes[half:2 * half]
            half //= 2
        assert out[0, r] == lanes[0]
        in_row_order += out[0, r] == np.cumsum(w[r])[-1]
    assert in_row_order < R  # values on which the order shows


# -- Embed -------------------------------------------------------------------------------------

def embed_text(extra=""):
    return (f'type: "Embed" bottom: "i" top: "y" embed_param {{ num_output: 3 input_dim: 5 '
            f'{extra} }}')


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4,), (4, 2, 3)])
def test_embed(shape, bias):
    layer = build(embed_text(f"bias_term: {str(bias).lower()}"), [shape])
    assert layer.top_shapes == [shape + (3,)]
    assert layer.param_shapes() == [(5, 3)] + ([(3,)] if bias else [])
    idx = np.random.default_rng(0).integers(0, 5, shape).astype(float)

    def reference(i, w, b=None):
        y = w[i.astype(int)]
        return y if b is None else y + b
    check_forward(layer, [idx], reference)
    check_gradients(layer, [idx], check=[False])
    check_split_invariance(layer, [idx], cut=1)
    check_parts_no_dx(layer, idx)


def check_parts_no_dx(layer, idx):
    """check_parts without an input gradient (Embed has none): each part's weight and bias
    gradients in a call of three parts are those of the part alone, bitwise."""
    params = random_params(layer, np.float32)
    idx = idx.astype(np.float32)
    dy = np.random.default_rng(5).standard_normal((4,) + layer.top_shapes[0][1:]).astype(
        np.float32)
    _, _, whole = backward(layer, [idx], params, [dy], Chunk(n=4, part_starts=(0, 1, 3, 4)),
                           propagate=[False])
    for k, (lo, hi) in enumerate(((0, 1), (1, 3), (3, 4))):
        _, _, own = backward(layer, [idx[lo:hi]], params, [dy[lo:hi]],
                             Chunk(n=hi - lo, first=lo, batch=4), propagate=[False])
        for got, want in zip(whole, own):
            assert np.array_equal(got[k], want)


@pytest.mark.parametrize("bad", [5.0, -1.0, 1.5, np.nan])
def test_embed_refuses_an_index_that_is_no_row(bad):
    layer = build(embed_text(), [(3, 2)])
    idx = np.array([[0.0, 1.0], [2.0, bad], [4.0, 4.0]])
    with pytest.raises(NetError, match=r"sample 1 of the batch, position 1\).*\[0, 5\)"):
        forward(layer, [idx[1:]], random_params(layer), Chunk(n=2, first=1, batch=3))


def test_embed_has_no_input_gradient():
    layer = build(embed_text(), [(2,)])
    with pytest.raises(NetError, match="cannot backpropagate to its input"):
        backward(layer, [np.zeros(2)], random_params(layer), [np.zeros((2, 3))])


@pytest.mark.parametrize("fields, message", [("num_output: 0 input_dim: 2", "num_output"),
                                             ("num_output: 2", "input_dim")])
def test_embed_refused(fields, message):
    with pytest.raises(NetError, match=message):
        build(f'type: "Embed" bottom: "i" top: "y" embed_param {{ {fields} }}', [(2,)])
