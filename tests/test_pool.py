"""Pooling against float64 NumPy references of Caffe's window rules, gradient checks, the tie
rule, the mask top, split invariance, Caffe's output-size rule and its parameter rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from layer_check import (backward, build, check_forward, check_gradients,
                         check_split_invariance, forward)


def pool_text(fields, tops=("y",)):
    names = "".join(f'top: "{t}" ' for t in tops)
    return f'type: "Pooling" bottom: "x" {names} pooling_param {{ {fields} }}'


def pool_ref(x, kernel, stride, pad, out, method):
    """Each window is cut from the input padded with -inf (MAX: the padding never wins) or 0
    (AVE), then clipped to the padded image; AVE divides by the clipped window's size."""
    N, C, H, W = x.shape
    (R, S), (sh, sw), (ph, pw), (P, Q) = kernel, stride, pad, out
    fill = -np.inf if method == "MAX" else 0.0
    xp = np.full((N, C, H + 2 * ph, W + 2 * pw), fill)
    xp[:, :, ph:ph + H, pw:pw + W] = x
    y = np.zeros((N, C, P, Q))
    mask = np.zeros((N, C, P, Q))
    for p in range(P):
        for q in range(Q):
            window = xp[:, :, p * sh:p * sh + R, q * sw:q * sw + S]
            if method == "MAX":
                y[:, :, p, q] = window.max(axis=(2, 3))
                flat = window.reshape(N, C, -1).argmax(axis=2)   # first max, row-major
                h = p * sh - ph + flat // window.shape[3]
                w = q * sw - pw + flat % window.shape[3]
                mask[:, :, p, q] = h * W + w
            else:
                y[:, :, p, q] = window.sum(axis=(2, 3)) / window[0, 0].size
    return y, mask


def data(shape, seed=0):
    # A permutation: no ties, so max-pooling gradients are smooth at the test point.
    rng = np.random.default_rng(seed)
    return rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 2.0


# (prototxt fields, bottom shape, kernel, stride, pad, expected (P, Q))
CONFIGS = {
    "lenet": ("kernel_size: 2 stride: 2", (2, 2, 6, 6), (2, 2), (2, 2), (0, 0), (3, 3)),
    "ceil_exact": ("kernel_size: 3 stride: 2", (2, 2, 7, 7), (3, 3), (2, 2), (0, 0), (3, 3)),
    "ceil_overhang": ("kernel_size: 3 stride: 2", (2, 2, 6, 8), (3, 3), (2, 2), (0, 0), (3, 4)),
    "pad": ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 6, 5), (3, 3), (2, 2), (1, 1), (4, 3)),
    "pad_drop_last": ("kernel_size: 2 stride: 2 pad: 1", (2, 2, 5, 4), (2, 2), (2, 2), (1, 1),
                      (3, 3)),
    "rect": ("kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 1", (2, 2, 4, 5),
             (3, 2), (1, 2), (1, 1), (4, 3)),
    "stride1": ("kernel_size: 2", (2, 2, 3, 4), (2, 2), (1, 1), (0, 0), (2, 3)),
    # Windows that tile the rows (W == stride * Q) with padding: the kernels' one-loop path
    # with border windows on both sides.
    "pad_tiles": ("kernel_size: 4 stride: 2 pad: 1", (2, 2, 8, 8), (4, 4), (2, 2), (1, 1),
                  (4, 4)),
}


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward(name, method):
    fields, shape, kernel, stride, pad, out = CONFIGS[name]
    layer = build(pool_text(f"pool: {method} {fields}"), [shape])
    assert layer.top_shapes == [shape[:2] + out]
    check_forward(layer, [data(shape)],
                  lambda x: pool_ref(x, kernel, stride, pad, out, method)[0], params=[])


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients(name, method):
    fields, shape, *_ = CONFIGS[name]
    layer = build(pool_text(f"pool: {method} {fields}"), [shape])
    check_gradients(layer, [data(shape)], params=[])


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global(method):
    shape = (2, 3, 5, 4)
    layer = build(pool_text(f"pool: {method} global_pooling: true"), [shape])
    assert layer.top_shapes == [(2, 3, 1, 1)]
    reduce = np.max if method == "MAX" else np.mean
    check_forward(layer, [data(shape)], lambda x: reduce(x, axis=(2, 3), keepdims=True),
                  params=[])
    check_gradients(layer, [data(shape)], params=[])


def test_mask_top():
    fields, shape, kernel, stride, pad, out = CONFIGS["pad"]
    layer = build(pool_text(f"pool: MAX {fields}", tops=("y", "mask")), [shape])
    assert layer.top_shapes == [shape[:2] + out] * 2
    assert layer.scratch_shapes(2)["arg"] == ((2,) + shape[1:2] + out, np.int32)
    check_forward(layer, [data(shape)], lambda x: pool_ref(x, kernel, stride, pad, out, "MAX"),
                  params=[])
    check_gradients(layer, [data(shape)], params=[])


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_forward_sweep(method):
    # Many window geometries (both of the kernels' first-pass paths, every border case), on
    # data full of ties; MAX checks the mask too.
    rng = np.random.default_rng(3)
    # (3, 70): rows of more than two vectors of outputs.
    for size in [(5, 5), (6, 8), (8, 8), (9, 7), (12, 12), (3, 70)]:
        for kernel, stride, pad in [(2, 2, 0), (2, 2, 1), (3, 2, 0), (3, 2, 1), (2, 1, 0),
                                    (3, 3, 1), (4, 2, 1), (5, 2, 2), (3, 1, 1)]:
            for mode in ("CEIL", "FLOOR"):
                fields = (f"pool: {method} kernel_size: {kernel} stride: {stride} pad: {pad} "
                          f"round_mode: {mode}")
                shape = (2, 3) + size
                tops = ("y", "mask") if method == "MAX" else ("y",)
                layer = build(pool_text(fields, tops), [shape])
                out = layer.top_shapes[0][2:]
                x = rng.integers(-3, 4, shape) * 0.5
                want = pool_ref(x, (kernel,) * 2, (stride,) * 2, (pad,) * 2, out, method)
                check_forward(layer, [x], lambda x: want if method == "MAX" else want[0],
                              params=[])


def test_ties_go_to_the_first_cell():
    # Every window of 2x2 holds equal values: the first cell (row-major) takes the gradient.
    layer = build(pool_text("pool: MAX kernel_size: 2 stride: 2"), [(1, 1, 4, 4)])
    x = np.ones((1, 1, 4, 4))
    dy = [np.arange(1.0, 5.0).reshape(1, 1, 2, 2)]
    _, (dx,), _ = backward(layer, [x], [], dy)
    want = np.zeros((4, 4))
    want[0::2, 0::2] = [[1, 2], [3, 4]]
    np.testing.assert_array_equal(dx[0, 0], want)


def test_padding_never_wins():
    # All inputs negative: were the padding a 0 that takes part, the border maxima would be 0.
    # Windows start at rows/columns -1, 1, 3; the last one holds row/column 3 alone.
    layer = build(pool_text("pool: MAX kernel_size: 3 stride: 2 pad: 1"), [(1, 1, 4, 4)])
    assert layer.top_shapes == [(1, 1, 3, 3)]
    x = -1.0 - np.arange(16.0).reshape(1, 1, 4, 4)
    (y,), _ = forward(layer, [x], [])
    np.testing.assert_array_equal(y[0, 0], [[-1, -2, -4], [-5, -6, -8], [-13, -14, -16]])


def test_overlapping_windows_add():
    layer = build(pool_text("pool: AVE kernel_size: 3 stride: 1"), [(1, 1, 4, 4)])
    _, (dx,), _ = backward(layer, [np.zeros((1, 1, 4, 4))], [], [np.full((1, 1, 2, 2), 9.0)])
    np.testing.assert_array_equal(dx[0, 0], [[1, 2, 2, 1], [2, 4, 4, 2], [2, 4, 4, 2],
                                             [1, 2, 2, 1]])


def test_average_gradient_adds_window_by_window():
    """AVE's input gradient, bitwise as Caffe's loop makes it in float32: window by window in
    (p, q) order, each cell of the window (clipped to the image) adding dy / size, with
    overlapping windows, padding and CEIL-rounded border windows."""
    rng = np.random.default_rng(5)
    for kernel, stride, pad, size, C in [(3, 2, 0, 16, 3), (3, 2, 1, 8, 3), (3, 1, 1, 5, 3),
                                         (4, 2, 1, 9, 3), (2, 3, 0, 10, 40)]:
        layer = build(pool_text(f"pool: AVE kernel_size: {kernel} stride: {stride} pad: {pad}"),
                      [(2, C, size, size)])
        P, Q = layer.top_shapes[0][2:]
        x = rng.standard_normal((2, C, size, size)).astype(np.float32)
        dy = rng.standard_normal((2, C, P, Q)).astype(np.float32)
        _, (dx,), _ = backward(layer, [x], [], [dy])
        want = np.zeros_like(x)
        for p in range(P):
            for q in range(Q):
                h0, w0 = p * stride - pad, q * stride - pad
                h1, w1 = min(h0 + kernel, size + pad), min(w0 + kernel, size + pad)
                share = dy[:, :, p, q] / np.float32((h1 - h0) * (w1 - w0))
                for h in range(max(h0, 0), min(h1, size)):
                    for w in range(max(w0, 0), min(w1, size)):
                        want[:, :, h, w] += share
        np.testing.assert_array_equal(dx, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_over_rows_wider_than_a_vector(dtype):
    """MAX's second pass runs a vector of output columns at a time (tile.column_max): rows of
    20 outputs, more than a vector's lanes in both widths, with ties everywhere (few distinct
    values): the row-major first max and its index, as the reference's."""
    fields, kernel, stride, pad = "kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1)
    shape = (2, 3, 7, 39)
    layer = build(pool_text(f"pool: MAX {fields}", tops=("y", "mask")), [shape])
    P, Q = layer.top_shapes[0][2:]
    assert Q == 20
    x = np.random.default_rng(2).integers(0, 4, shape).astype(dtype)
    (y, mask), _ = forward(layer, [x], [])
    want, want_mask = pool_ref(x.astype(np.float64), kernel, stride, pad, (P, Q), "MAX")
    assert np.array_equal(y, want) and np.array_equal(mask, want_mask)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_average_over_blocks_of_planes(dtype):
    """AVE runs blocks of planes (kernels.pool.PLANE_BLOCK) turned planes-innermost: more
    planes than a block, a partial last block, non-square planes and both SIMD widths give
    each plane bitwise what it gets alone, and the float64 reference's values."""
    fields, kernel, stride, pad = "kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1)
    shape = (3, 29, 10, 9)  # 87 planes
    layer = build(pool_text(f"pool: AVE {fields}"), [shape])
    x = data(shape).astype(dtype)
    dy = np.random.default_rng(4).standard_normal(layer.top_shapes[0]).astype(dtype)
    (y,), _ = forward(layer, [x], [])
    _, (dx,), _ = backward(layer, [x], [], [dy])
    single = build(pool_text(f"pool: AVE {fields}"), [(1, 1) + shape[2:]])
    for n, c in [(0, 0), (1, 7), (2, 6), (2, 28)]:  # planes 0, 36, 64 (block 2) and 86
        (y1,), _ = forward(single, [x[n:n + 1, c:c + 1]], [])
        _, (dx1,), _ = backward(single, [x[n:n + 1, c:c + 1]], [], [dy[n:n + 1, c:c + 1]])
        assert np.array_equal(y[n, c], y1[0, 0]) and np.array_equal(dx[n, c], dx1[0, 0])
    want, _ = pool_ref(x.astype(np.float64), kernel, stride, pad, layer.top_shapes[0][2:], "AVE")
    np.testing.assert_allclose(y, want, rtol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_split_invariance(method):
    layer = build(pool_text(f"pool: {method} kernel_size: 3 stride: 2 pad: 1"), [(5, 2, 6, 6)])
    check_split_invariance(layer, [data((5, 2, 6, 6))], params=[], cut=2)


@pytest.mark.parametrize("fields, size, out", [
    ("kernel_size: 2 stride: 2", 24, 12),               # LeNet pool1
    ("kernel_size: 2 stride: 2", 8, 4),                 # LeNet pool2
    ("kernel_size: 3 stride: 2", 32, 16),               # cifar10_quick pool1: ceil(29/2)+1
    ("kernel_size: 3 stride: 2", 16, 8),
    ("kernel_size: 3 stride: 2", 8, 4),
    ("kernel_size: 3 stride: 2 round_mode: FLOOR", 32, 15),
    ("kernel_size: 3 stride: 2 round_mode: FLOOR", 7, 3),
    ("kernel_size: 2 stride: 2 pad: 1", 5, 3),          # ceil gives 4, but that window would
                                                        # start in the padding: dropped
    ("kernel_size: 2 stride: 2 pad: 1", 4, 3),          # ceil gives 3, the last starts at row 3
    ("kernel_size: 3 stride: 2 pad: 1", 7, 4),
    ("kernel_size: 3 stride: 1", 3, 1),
])
def test_shapes(fields, size, out):
    layer = build(pool_text(fields), [(2, 3, size, size)])
    assert layer.top_shapes == [(2, 3, out, out)]


@pytest.mark.parametrize("fields, shape, message", [
    ("pool: STOCHASTIC kernel_size: 2", (1, 1, 4, 4), "STOCHASTIC is not supported"),
    ("pool: AVE kernel_size: 2", (1, 1, 4), "4 axes"),
    ("kernel_size: 2 kernel_h: 2 kernel_w: 2", (1, 1, 4, 4), "not both"),
    ("kernel_h: 2", (1, 1, 4, 4), "must be given"),
    ("stride: 2", (1, 1, 4, 4), "must be given"),
    ("kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1", (1, 1, 4, 4), "pad OR pad_h and pad_w"),
    ("kernel_size: 2 stride_h: 2", (1, 1, 4, 4), "stride OR stride_h and stride_w"),
    ("kernel_size: 2 pad: 2", (1, 1, 4, 4), "smaller than the kernel"),
    ("kernel_size: 0", (1, 1, 4, 4), "must be positive"),
    ("kernel_size: 2 stride: 0", (1, 1, 4, 4), "must be positive"),
    ("kernel_size: 5", (1, 1, 4, 6), "larger than the padded input"),
    ("global_pooling: true kernel_size: 2", (1, 1, 4, 4), "must not be given"),
    ("global_pooling: true pad: 1", (1, 1, 4, 4), "only pad 0 and stride 1"),
    ("global_pooling: true stride: 2", (1, 1, 4, 4), "only pad 0 and stride 1"),
])
def test_refused(fields, shape, message):
    with pytest.raises(NetError, match=message):
        build(pool_text(fields), [shape])


def test_refused_mask_for_average():
    with pytest.raises(NetError, match="needs pool MAX"):
        build(pool_text("pool: AVE kernel_size: 2", tops=("y", "mask")), [(1, 1, 4, 4)])
    with pytest.raises(NetError, match="top"):
        build(pool_text("kernel_size: 2", tops=("a", "b", "c")), [(1, 1, 4, 4)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stride2_row_pass(dtype):
    """The row pass of MAX with stride 2 (tile.stride2_row_max: two vectors of cells per
    window column, the even ones shuffled out) against a naive loop over every window: rows
    from 1 to 70 cells (up to 5 vectors of outputs), windows 1 to 4 wide, left padding, the
    right edge overhanging, ties, NaN (never a max) and -inf or -FLT_MAX (which never beat the
    start: the window's first cell is named)."""
    from cgp.kernels import pool
    rng = np.random.default_rng(5)
    lowest = dtype(pool._LOWEST)
    for _ in range(300):
        H, W, S = int(rng.integers(1, 4)), int(rng.integers(1, 71)), int(rng.integers(1, 5))
        pad = int(rng.integers(0, S))
        Q = (W + 2 * pad - S + 1) // 2 + 1       # Caffe's ceil rule, then its clip
        if (Q - 1) * 2 >= W + pad:
            Q -= 1
        x = rng.integers(-2, 3, size=H * W + 8).astype(dtype)
        x[rng.integers(0, x.size, 4)] = rng.choice([np.nan, -np.inf, lowest], 4)
        start = 4                                   # the plane starts inside the array
        rmax, rarg = np.full(H * Q, 9, dtype), np.full(H * Q, -1, np.int32)
        pool._row_maxima(x, start, rmax, rarg, H, W, Q, S, 2, pad, lowest)
        for h in range(H):
            for q in range(Q):
                w0, w1 = max(2 * q - pad, 0), min(2 * q - pad + S, W)
                best, at = lowest, h * W + w0
                for w in range(w0, w1):
                    if x[start + h * W + w] > best:
                        best, at = x[start + h * W + w], h * W + w
                assert rmax[h * Q + q] == best and rarg[h * Q + q] == at, (H, W, S, pad, h, q)
