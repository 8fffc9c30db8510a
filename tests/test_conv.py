"""Convolution against a float64 NumPy reference written without im2col (shifted slices of the
padded input), gradient checks, split invariance, shape rules and Caffe's parameter rules."""
import itertools

import numpy as np
import pytest

from numba import njit

from cgp.errors import NetError
from cgp.kernels import conv as K
from cgp.runtime.blas import gemm
from cgp.runtime.simd import (SHAPES, folded_tile, lane_tile, shifted_copy, shifted_row_sum,
                              tile, transpose_block)
from cgp.layers import Chunk, alloc_scratch
from layer_check import (backward, build, check_forward, check_gradients,
                         check_parts, check_split_invariance, forward, random_params)


def conv_text(extra, num_output=4, bottoms=("x",), tops=("y",)):
    names = "".join(f'bottom: "{b}" ' for b in bottoms) + "".join(f'top: "{t}" ' for t in tops)
    return f'type: "Convolution" {names} convolution_param {{ num_output: {num_output} {extra} }}'


def conv_ref(x, w, b=None, stride=(1, 1), pad=(0, 0), dilation=(1, 1), group=1):
    """Direct convolution: for each kernel tap (r, s), a strided slice of the zero-padded input
    times that tap's weights, summed over taps and the group's channels."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    P = (H + 2 * ph - (dh * (R - 1) + 1)) // sh + 1
    Q = (W + 2 * pw - (dw * (S - 1) + 1)) // sw + 1
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    y = np.zeros((N, K, P, Q))
    Kg = K // group
    for k in range(K):
        g = k // Kg
        for r in range(R):
            for s in range(S):
                patch = xp[:, g * Cg:(g + 1) * Cg,
                           r * dh:r * dh + sh * (P - 1) + 1:sh,
                           s * dw:s * dw + sw * (Q - 1) + 1:sw]
                y[:, k] += np.einsum("nchw,c->nhw", patch, w[k, :, r, s])
    if b is not None:
        y += b[None, :, None, None]
    return y


def data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# (prototxt fields, bottom shape, reference keyword arguments)
CONFIGS = {
    "plain": ("kernel_size: 3", (2, 3, 5, 6), {}),
    "pad_stride": ("kernel_size: 3 pad: 1 stride: 2", (2, 3, 6, 5),
                   dict(stride=(2, 2), pad=(1, 1))),
    "rect": ("kernel_h: 3 kernel_w: 2 pad_h: 2 pad_w: 0 stride_h: 1 stride_w: 2", (2, 2, 5, 6),
             dict(stride=(1, 2), pad=(2, 0))),
    "per_axis": ("kernel_size: 2 kernel_size: 3 pad: 1 pad: 2 stride: 2 stride: 1",
                 (2, 2, 5, 4), dict(stride=(2, 1), pad=(1, 2))),
    "group2": ("kernel_size: 3 pad: 1 group: 2", (2, 4, 4, 4), dict(pad=(1, 1), group=2)),
    "dilation": ("kernel_size: 3 dilation: 2 pad: 1", (2, 2, 7, 6),
                 dict(pad=(1, 1), dilation=(2, 2))),
    "dilation_hw": ("kernel_size: 2 dilation: 1 dilation: 3 stride: 2", (2, 2, 5, 7),
                    dict(stride=(2, 2), dilation=(1, 3))),
    "pointwise": ("kernel_size: 1", (2, 3, 3, 4), {}),
    "pointwise_group": ("kernel_size: 1 group: 2", (2, 4, 3, 3), dict(group=2)),
    # Small planes run 1x1 layers through GEMM (cgp.layers.conv.gemm_faster), larger ones
    # through the direct kernels.
    "pointwise_plane": ("kernel_size: 1", (1, 2, 15, 14), {}),
    "pointwise_stride": ("kernel_size: 1 stride: 2 pad: 1", (2, 3, 4, 3),
                         dict(stride=(2, 2), pad=(1, 1))),
    # Unpadded stride-1 layers take their input gradient through the column matrix
    # (conv_backward_direct), as does "dilation", whose output is small despite its padding.
    "group_unpadded": ("kernel_size: 2 group: 2", (2, 4, 4, 5), dict(group=2)),
    "dilation_unpadded": ("kernel_h: 2 kernel_w: 3 dilation: 2", (2, 2, 5, 7),
                          dict(dilation=(2, 2))),
    # One input channel per group runs the depthwise kernels: stride 1 over flat padded
    # planes, other strides row by row; two outputs per channel; padding beyond the kernel.
    "depthwise": ("kernel_size: 3 pad: 1 group: 4", (2, 4, 5, 6), dict(pad=(1, 1), group=4)),
    "depthwise_stride": ("kernel_size: 3 pad: 1 stride: 2 group: 4", (2, 4, 7, 6),
                         dict(stride=(2, 2), pad=(1, 1), group=4)),
    "depthwise_multiplier": ("kernel_size: 3 dilation: 2 pad: 2 group: 2", (2, 2, 6, 7),
                             dict(pad=(2, 2), dilation=(2, 2), group=2)),
    "depthwise_rect": ("kernel_h: 2 kernel_w: 3 pad_w: 2 stride_h: 1 stride_w: 2 group: 4",
                       (2, 4, 5, 6), dict(stride=(1, 2), pad=(0, 2), group=4)),
    "depthwise_unpadded": ("kernel_size: 3 group: 4", (2, 4, 5, 5), dict(group=4)),
    "depthwise_wide_pad": ("kernel_size: 2 pad: 2 group: 4", (2, 4, 4, 5),
                           dict(pad=(2, 2), group=4)),
}


@pytest.mark.parametrize("fields", ["kernel_size: 3 pad: 1", "kernel_size: 3 stride: 2"])
def test_backward_reads_its_input_not_forward_scratch(fields):
    """Backward takes the input it is given, whatever forward left in the scratch: a forward
    pass over other data on the same scratch in between changes no bit of the gradients."""
    layer = build(conv_text(fields), [(3, 3, 7, 7)])
    x, params = data((3, 3, 7, 7)), random_params(layer)
    top_diff = [data(layer.top_shapes[0], 3)]
    tops, bottom_diff, once = backward(layer, [x], params, top_diff)
    scratch = alloc_scratch(layer, 3, x.dtype)
    for bottom in (x, data((3, 3, 7, 7), 9)):
        layer.forward([bottom], [np.zeros_like(tops[0])], params, scratch, Chunk(n=3))
    dx = [np.zeros_like(x)]
    diffs = [np.zeros((1,) + p.shape) for p in params]
    layer.backward(tops, top_diff, [x], dx, params, diffs, scratch, Chunk(n=3))
    np.testing.assert_array_equal(dx[0], bottom_diff[0])
    for got, want in zip(diffs, once):
        np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward(name, bias):
    fields, shape, kw = CONFIGS[name]
    layer = build(conv_text(f"{fields} bias_term: {str(bias).lower()}"), [shape])
    params = random_params(layer)
    assert len(params) == (2 if bias else 1)
    check_forward(layer, [data(shape)],
                  lambda x, w, b=None: conv_ref(x, w, b, **kw), params=params)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients(name):
    fields, shape, _ = CONFIGS[name]
    layer = build(conv_text(fields), [shape])
    check_gradients(layer, [data(shape)])


def test_gradients_without_bias_or_dx():
    layer = build(conv_text("kernel_size: 3 pad: 1 stride: 2 group: 2 bias_term: false"),
                  [(2, 4, 5, 5)])
    check_gradients(layer, [data((2, 4, 5, 5))], check=[False])


def test_two_bottoms_share_weights():
    shape = (2, 3, 5, 5)
    layer = build(conv_text("kernel_size: 3 pad: 1", bottoms=("a", "b"), tops=("c", "d")),
                  [shape, shape])
    assert layer.top_shapes == [(2, 4, 5, 5)] * 2
    a, b = data(shape, 1), data(shape, 2)
    check_forward(layer, [a, b], lambda a, b, w, bias: (conv_ref(a, w, bias, pad=(1, 1)),
                                                        conv_ref(b, w, bias, pad=(1, 1))))
    check_gradients(layer, [a, b])


def test_parameter_gradients_add():
    """Parameter gradients are added to what the buffers hold; dx may be skipped."""
    layer = build(conv_text("kernel_size: 3"), [(2, 3, 5, 5)])
    x, params = data((2, 3, 5, 5)), random_params(layer)
    top_diff = [data((2, 4, 3, 3), 3)]
    _, _, once = backward(layer, [x], params, top_diff)
    tops, scratch = forward(layer, [x], params)
    diffs = [np.ones_like(p) for p in params]
    layer.backward(tops, top_diff, [x], [None], params, [d[None] for d in diffs], scratch, Chunk(n=2))
    for got, want in zip(diffs, once):
        np.testing.assert_allclose(got, want + 1, rtol=1e-12)


@pytest.mark.parametrize("num_output, fields, shapes", [
    (20, "kernel_size: 5", [(5, 1, 28, 28)]),                     # by lanes (LeNet's conv1)
    (50, "kernel_size: 5", [(5, 20, 12, 12)]),                    # by kernel rows (conv2)
    (40, "kernel_size: 3 pad: 1", [(5, 6, 14, 12)]),              # last channels along T
    (96, "kernel_size: 5 pad: 1 group: 2", [(5, 8, 7, 9)]),       # tiles, two groups
    (16, "kernel_size: 3 pad: 1 bias_term: false", [(5, 3, 9, 8)] * 2)])  # two bottoms
def test_overwrite_sets_gradients_bitwise_as_adding_to_zeros(num_output, fields, shapes):
    """With overwrite_param_diff the direct kernels set each part's weight and bias
    gradients (the engine then skips zeroing them): bitwise what adding into zeros gives,
    whatever the buffers held, an empty part's zeros included, and +0.0 where the chain's
    products are -0.0 (0.0 + -0.0 is +0.0: the first part's samples have x > 0 and
    dy = -0.0)."""
    names = ("a", "b")[:len(shapes)]
    layer = build(conv_text(fields, num_output, bottoms=names, tops=("y", "z")[:len(shapes)]),
                  shapes)
    assert layer.can_overwrite_param_diff
    bottom = [np.abs(data(shape, i)).astype(np.float32) for i, shape in enumerate(shapes)]
    params = [p.astype(np.float32) for p in random_params(layer)]
    dy = [data(t, 5).astype(np.float32) for t in layer.top_shapes]
    for d in dy:
        d[:2] = -0.0
    chunk = Chunk(n=5, batch=5, part_starts=(0, 2, 2, 5))
    _, _, added = backward(layer, bottom, params, dy, chunk)
    assert not any(np.signbit(g[0]).any() for g in added)
    layer.overwrite_param_diff = True
    tops, scratch = forward(layer, bottom, params, chunk)
    garbage = [np.full((3,) + p.shape, np.nan, np.float32) for p in params]
    bottom_diff = [np.zeros_like(b) for b in bottom]
    layer.backward(tops, dy, bottom, bottom_diff, params, garbage, scratch, chunk)
    for got, want in zip(garbage, added):
        assert np.array_equal(got, want) and not np.signbit(got[:2]).any()


def test_only_the_direct_kernels_overwrite():
    """Strided, GEMM and depthwise convolutions and Deconvolution add to their gradients."""
    for layer in (build(conv_text("kernel_size: 3 stride: 2"), [(2, 3, 9, 9)]),
                  build(conv_text("kernel_size: 3 group: 3", 3), [(2, 3, 9, 9)]),
                  build(deconv_text("kernel_size: 3"), [(2, 3, 5, 5)])):
        assert not layer.can_overwrite_param_diff


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parts_get_their_own_gradients(name, bias):
    """One call over three parts (the engine's chunks) gives each part the weight and bias
    gradients a call with that part alone gives, bitwise, on both paths (direct, im2col)."""
    fields, shape, _ = CONFIGS[name]
    shape = (6,) + shape[1:]
    layer = build(conv_text(f"{fields} bias_term: {str(bias).lower()}"), [shape])
    check_parts(layer, [data(shape)], (0, 2, 3, 6))


@pytest.mark.parametrize("name", ["pad_stride", "group2", "pointwise"])
def test_split_invariance(name):
    fields, shape, _ = CONFIGS[name]
    shape = (5,) + shape[1:]
    layer = build(conv_text(fields), [shape])
    check_split_invariance(layer, [data(shape)], cut=2)


def test_split_invariance_lenet_conv2():
    # Real sizes, so that the kernels run their full-sized tiles.
    layer = build(conv_text("kernel_size: 5", num_output=50), [(5, 20, 12, 12)])
    for cut in (1, 2, 4):
        check_split_invariance(layer, [data((5, 20, 12, 12))], cut=cut)


def test_last_channels_of_the_weight_gradient_keep_their_parts():
    """Where the output channels are not whole vectors, the weight gradient runs its last
    channels in tiles of channels by vectors of rows (c, s) (kernels.conv._dw_tiles): each
    part still gets what a call with that part alone gives, bitwise."""
    shape = (3, 6, 14, 12)
    layer = build(conv_text("kernel_size: 3 pad: 1", 40), [shape])
    assert K._dw_tiles(6 * 3, 40, 1, 3, 14 * 12, 16 * 12, 16)[3] > 0
    check_parts(layer, [data(shape)], (0, 1, 3))


def test_weight_gradient_by_kernel_rows_keeps_parts_and_values():
    """Kernels DW_S wide whose weight gradient has DW_KV vectors of channels (LeNet's conv2)
    tile it by kernel row (kernels.conv.DW_S): each part gets what a call with that part
    alone gives, bitwise, and on small integers (exact sums) the float64 reference's values
    exactly, with padding, and both groups of a grouped layer."""
    V = 16
    for num_output, fields, shape, kw in [
            (50, "kernel_size: 5", (5, 20, 12, 12), {}),
            (48, "kernel_size: 5 pad: 2", (3, 8, 8, 9), dict(pad=(2, 2))),
            (96, "kernel_size: 5 pad: 1 group: 2", (3, 8, 7, 9), dict(pad=(1, 1), group=2))]:
        layer = build(conv_text(fields, num_output), [shape])
        Cg, Kg = layer.C // layer.group, layer.K // layer.group
        _, KV, Km, _, _ = K._dw_tiles(Cg * 5, Kg, layer.group, 5, layer.P * layer.Q,
                                      (layer.H + 2 * layer.pad_h) * layer.Q, V)
        assert layer._direct() and layer.S == K.DW_S and KV == K.DW_KV and Km > 0
        check_parts(layer, [data(shape)], (0, 1, shape[0]))
        rng = np.random.default_rng(4)
        x = rng.integers(-3, 4, shape).astype(np.float32)
        w, b = (rng.integers(-3, 4, p.shape).astype(np.float32) for p in random_params(layer))
        dy = rng.integers(-3, 4, layer.top_shapes[0]).astype(np.float32)
        _, _, (dw, db) = backward(layer, [x], [w, b], [dy])
        _, want_dw, want_db = conv_ref_grads(x.astype(np.float64), w.astype(np.float64),
                                             dy.astype(np.float64), **kw)
        assert np.array_equal(dw, want_dw) and np.array_equal(db, want_db)


def conv_ref_grads(x, w, dy, stride=(1, 1), pad=(0, 0), dilation=(1, 1), group=1):
    """dx, dw, db of sum(conv_ref(x, w, b) * dy), from the same shifted slices as conv_ref:
    each tap's slice of the padded input meets dy."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    P, Q = dy.shape[2:]
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    dxp, dwr = np.zeros_like(xp), np.zeros(w.shape)
    Kg = K // group
    for k in range(K):
        g = k // Kg
        for r in range(R):
            for s in range(S):
                window = (slice(None), slice(g * Cg, (g + 1) * Cg),
                          slice(r * dh, r * dh + sh * (P - 1) + 1, sh),
                          slice(s * dw, s * dw + sw * (Q - 1) + 1, sw))
                dwr[k, :, r, s] = np.einsum("nchw,nhw->c", xp[window], dy[:, k])
                dxp[window] += np.einsum("nhw,c->nchw", dy[:, k], w[k, :, r, s])
    return dxp[:, :, ph:ph + H, pw:pw + W], dwr, dy.sum(axis=(0, 2, 3))


# Real-sized channel counts, which the small configurations never reach: the stride-1 kernels'
# other tile shapes, several channel blocks, both ways to the input gradient; and the im2col path.
LARGE = [
    (50, "kernel_size: 5", (3, 20, 12, 12), {}),   # LeNet conv2: dx through columns
    (32, "kernel_size: 5 pad: 2", (2, 3, 10, 10), dict(pad=(2, 2))),  # gathers dx
    (40, "kernel_size: 3 pad: 1 group: 2", (2, 6, 9, 7), dict(pad=(1, 1), group=2)),
    (70, "kernel_size: 3 dilation: 2 pad: 2", (2, 17, 7, 9),
     dict(pad=(2, 2), dilation=(2, 2))),
    (36, "kernel_size: 2 dilation: 2 group: 3", (2, 9, 6, 7),
     dict(dilation=(2, 2), group=3)),
    # 40 channels, not whole float32 vectors: the weight gradient's last 8 in tiles of
    # channels by vectors of rows (c, s), over two blocks of positions, with padding.
    (40, "kernel_size: 3 pad: 1", (2, 6, 14, 12), dict(pad=(1, 1))),
    (24, "kernel_size: 1", (2, 40, 5, 6), {}),   # through GEMM, a small plane
    (24, "kernel_size: 1", (2, 40, 15, 14), {}),
    (36, "kernel_size: 3 pad: 1", (2, 160, 7, 7), dict(pad=(1, 1))),   # through GEMM
    (24, "kernel_size: 5 pad: 1", (2, 7, 9, 8), dict(pad=(1, 1))),  # padded, through columns
    (20, "kernel_size: 3 stride: 2 pad: 1", (2, 12, 9, 8), dict(stride=(2, 2), pad=(1, 1))),
    # Rows that read only padding, whole tiles of them and tiles of a few rows: the kernel
    # rows left out there must be exactly the padding's.
    (21, "kernel_size: 3 pad: 3 group: 3", (2, 3, 5, 40), dict(pad=(3, 3), group=3)),
    (16, "kernel_size: 3 dilation: 3 pad: 4", (2, 4, 7, 5), dict(pad=(4, 4), dilation=(3, 3))),
    # Kernel columns that read only padding at every output column, dilated taps wider than
    # the image, and a padded output whose weight-gradient blocks of positions end inside
    # rows (30 columns).
    (16, "kernel_size: 7 pad: 3", (2, 5, 2, 2), dict(pad=(3, 3))),
    (16, "kernel_size: 3 dilation: 3 pad: 3", (2, 5, 3, 2), dict(pad=(3, 3), dilation=(3, 3))),
    (16, "kernel_size: 3 pad: 1", (2, 3, 20, 30), dict(pad=(1, 1))),
    # Kernel rows wider than a vector (17 > 16 float32 lanes): the weight gradient is turned
    # into w's layout in blocks of columns.
    (18, "kernel_h: 2 kernel_w: 17 pad_h: 0 pad_w: 8", (2, 2, 4, 20), dict(pad=(0, 8))),
    # Small padded images: tiles of positions by vectors of channels, transposed into place,
    # forward and input gradient (cifar10_quick's conv3; with groups and dilation; a
    # rectangular kernel).
    (64, "kernel_size: 5 pad: 2", (2, 32, 8, 8), dict(pad=(2, 2))),
    (32, "kernel_size: 3 dilation: 2 pad: 2 group: 2", (2, 32, 6, 6),
     dict(pad=(2, 2), dilation=(2, 2), group=2)),
    (20, "kernel_h: 5 kernel_w: 3 pad: 2", (2, 20, 6, 9), dict(pad=(2, 2))),
]
# MobileNet's depthwise layers at real widths (rows longer than the lanes of the weight
# gradient's partial sums, and not a multiple of them), stride 1 and 2.
DEPTHWISE = [
    (32, "kernel_size: 3 pad: 1 group: 32", (2, 32, 15, 13), dict(pad=(1, 1), group=32)),
    (24, "kernel_size: 3 pad: 1 stride: 2 group: 24", (2, 24, 15, 14),
     dict(stride=(2, 2), pad=(1, 1), group=24)),
]

# Single-channel layers, whose weight gradient runs by lanes (kernels.conv._dw_lanes): LeNet's
# conv1; channels that do not fill lane_tile's LANE_M and rows (c, s) that do not fill its
# LANE_N, positions that are not whole vectors, and padding rows left out; two channels
# (by lanes in float32 only). (LARGE's 16-channel layer on a 20 x 30 plane runs by lanes
# too.)
LANES = [
    (20, "kernel_size: 5", (2, 1, 28, 28), {}),
    (10, "kernel_size: 3 pad: 1", (2, 1, 21, 19), dict(pad=(1, 1))),
    (6, "kernel_size: 5 pad: 2", (2, 1, 20, 23), dict(pad=(2, 2))),
    (10, "kernel_size: 3 pad: 1", (2, 2, 17, 18), dict(pad=(1, 1))),
]


def test_lanes_take_lenet_conv1_alone_of_the_shipped_nets():
    """The weight gradient runs by lanes for the LANES layers, and of the shipped nets' layers
    for LeNet's conv1 alone: LeNet's conv2 and cifar10_quick's layers keep their tiles (and
    their bits)."""
    def by_lanes(num_output, fields, shape):
        layer = build(conv_text(fields, num_output), [shape])
        return K._dw_by_lanes(layer.C * layer.S, layer.K, layer.group, layer.P * layer.Q, 16)
    assert all(by_lanes(*case[:3]) for case in LANES)
    others = [(50, "kernel_size: 5", (1, 20, 12, 12)),
              (32, "kernel_size: 5 pad: 2", (1, 3, 32, 32)),
              (32, "kernel_size: 5 pad: 2", (1, 32, 16, 16)),
              (64, "kernel_size: 5 pad: 2", (1, 32, 8, 8))]
    assert not any(by_lanes(*case) for case in others)


def test_lanes_keep_their_parts():
    """By lanes, each part's weight and bias gradients are what a call with that part alone
    gives, bitwise (the lanes are summed at each part's end), and the tops do not depend on
    the split."""
    for num_output, fields, shape, _ in LANES[:2]:
        shape = (5,) + shape[1:]
        layer = build(conv_text(fields, num_output), [shape])
        check_parts(layer, [data(shape)], (0, 1, 3, 5))
        check_split_invariance(layer, [data(shape)], cut=2)


@njit
def _lanes_product(out, a, b, m_valid, n_valid, n, V):
    """lane_tile (4 rows of a by 5 of b, rows of n elements; out (4, 5, V)) twice, the second
    call continuing the first's chains over the rows' second half."""
    half = n // 2 // V * V
    lane_tile(4, 5, out, 0, 5 * V, V, a, 0, n, m_valid, b, 0, n, n_valid, half)
    lane_tile(4, 5, out, 0, 5 * V, V, a, half, n, m_valid, b, half, n, n_valid, n - half)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lane_tile_keeps_a_chain_per_lane(dtype):
    """lane_tile adds element c's product into lane c mod V, continuing from out; masked
    loads past the row's end add nothing; rows past the valid ones repeat the last. Small
    integers make every sum exact, so the lanes can be compared with NumPy's."""
    V = 64 // np.dtype(dtype).itemsize
    rng = np.random.default_rng(1)
    n, m_valid, n_valid = 3 * V + 5, 3, 4
    a = rng.integers(-4, 5, (4, n)).astype(dtype)
    b = rng.integers(-4, 5, (5, n)).astype(dtype)
    start = rng.integers(-9, 10, (4, 5, V)).astype(dtype)
    out = start.copy()
    _lanes_product(out.ravel(), a.ravel(), b.ravel(), m_valid, n_valid, n, V)
    ai = np.concatenate([a[:m_valid], a[[m_valid - 1]]]).astype(np.float64)
    bi = np.concatenate([b[:n_valid], b[[n_valid - 1]]]).astype(np.float64)
    products = np.zeros((4, 5, -(-n // V) * V))
    products[:, :, :n] = ai[:, None, :] * bi[None, :, :]
    want = start + products.reshape(4, 5, -1, V).sum(axis=2)
    assert np.array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("num_output, fields, shape, kw", LARGE + DEPTHWISE + LANES)
def test_large_against_reference(num_output, fields, shape, kw, dtype):
    layer = build(conv_text(fields, num_output), [shape])
    x = data(shape)
    params = random_params(layer)
    dy = data(layer.top_shapes[0], 3)
    cast = [np.asarray(a, dtype) for a in [x] + params + [dy]]
    tops, (dx,), (dw, db) = backward(layer, [cast[0]], cast[1:3], [cast[3]])
    x, w, b, dy = (np.asarray(a, np.float64) for a in cast)
    want = (conv_ref(x, w, b, **kw),) + conv_ref_grads(x, w, dy, **kw)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-9)
    for got, ref in zip((tops[0], dx, dw, db), want):
        np.testing.assert_allclose(got, ref, **tol)


def test_results_ignore_scratch_contents_and_alignment():
    """Scratch full of NaN, and every buffer moved by a few elements, give bitwise the same
    tops and gradients: the kernels read only what they wrote (padding lanes and tiles that
    hang over an edge are never stored), and alignment changes only the speed."""
    for num_output, fields, shape, _ in LARGE[:5] + LARGE[-3:] + DEPTHWISE + LANES[1:]:
        layer = build(conv_text(fields, num_output), [shape])
        x = data(shape).astype(np.float32)
        params = [p.astype(np.float32) for p in random_params(layer)]
        dy = data(layer.top_shapes[0], 3).astype(np.float32)
        results = []
        for shift, fill in ((0, 0.0), (3, np.nan), (5, np.nan)):
            scratch = {}
            for name, buf in alloc_scratch(layer, shape[0], np.float32).items():
                # Integer scratch (the depthwise path's tap offsets) gets garbage of its type.
                junk = fill if buf.dtype.kind == "f" else -7 * (shift > 0)
                moved = np.full(buf.size + shift, junk, buf.dtype)[shift:].reshape(buf.shape)
                scratch[name] = moved
            top = np.zeros(layer.top_shapes[0], np.float32)
            layer.forward([x], [top], params, scratch, Chunk(n=shape[0]))
            dx = np.full_like(x, 7.0)
            diffs = [np.zeros_like(p) for p in params]
            layer.backward([top], [dy], [x], [dx], params, [d[None] for d in diffs], scratch, Chunk(n=shape[0]))
            results.append([top, dx] + diffs)
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert np.array_equal(a, b), fields


def test_direct_path_choices_are_covered():
    """The configurations above reach both ways to the input gradient, both arrangements of
    tiles where the forward pass and the input gradient convolve rows, and several tile
    shapes of each stride-1 kernel, in both SIMD widths."""
    seen = set()
    for num_output, fields, shape, _ in [(4,) + c for c in CONFIGS.values()] + LARGE:
        layer = build(conv_text(fields, num_output), [shape])
        if layer.stride_h == layer.stride_w == 1:
            for V in (8, 16):
                seen.add(K.direct_shapes(layer.C, layer.H, layer.W, layer.K, layer.R, layer.S,
                                         layer.pad_h, layer.pad_w, layer.dil_h, layer.dil_w,
                                         layer.group, V))
    # (T, KV, positions) forward, (T, KV) weight gradient, (T, KV, positions) input
    # gradient, through columns or not.
    assert {shapes[-1] for shapes in seen} == {True, False}
    assert {shapes[2] for shapes in seen} == {shapes[7] for shapes in seen} == {True, False}
    for i in (0, 3, 5):
        assert len({shapes[i:i + 2] for shapes in seen}) >= 3


@pytest.mark.parametrize("num_output, fields, shape, gemm", [
    (512, "kernel_size: 3 pad: 1", (1, 512, 7, 7), True),     # ResNet-50's res5 3x3
    (256, "kernel_size: 1", (1, 1024, 14, 14), True),         # its res4 1x1
    (16, "kernel_size: 1", (1, 480, 14, 14), True),           # GoogLeNet's 5x5_reduce
    (128, "kernel_size: 5 pad: 2", (1, 48, 7, 7), False),     # its 5x5 over 48 channels
    (128, "kernel_size: 1", (1, 512, 28, 28), False),         # 28 x 28 planes
    (64, "kernel_size: 3 pad: 1", (1, 64, 56, 56), False),
    (50, "kernel_size: 5", (1, 20, 12, 12), False),           # LeNet's conv2
    (64, "kernel_size: 5 pad: 2", (1, 32, 8, 8), False),      # cifar10_quick's conv3
])
def test_small_planes_with_long_reductions_run_through_gemm(num_output, fields, shape, gemm):
    """Stride-1 layers take the im2col path and BLAS (scratch "col") where gemm_faster says
    it is faster, the direct kernels (scratch "e") elsewhere; the shipped nets' layers stay
    direct."""
    layer = build(conv_text(fields, num_output), [shape])
    assert ("col" in layer.scratch_shapes(1)) == gemm
    assert ("e" in layer.scratch_shapes(1)) != gemm


def test_extra_channel_tiles_give_the_same_bits():
    """_convolve_rows' extra channel tile (ROWS_T, ROWS_KV), which LeNet's conv1 and conv2 take
    (20 and 50 channels), gives the bits of SHAPES' tiles: one chain per element either way.
    Positions not whole vectors, channels not whole tiles, kernel rows left out at the edges
    (padding 1)."""
    assert K.direct_shapes(1, 28, 28, 20, 5, 5, 0, 0, 1, 1, 1, 16)[:3] == (K.ROWS_T, K.ROWS_KV,
                                                                         False)
    Ko, R, steps, Qo, Hi = 23, 3, 4, 13, 9   # Hi + 2 rows of padding, Qo wide
    PQo = Hi * Qo
    rng = np.random.default_rng(2)
    KoT = 32
    e = rng.standard_normal(R * Qo + steps * (Hi + 2) * Qo + PQo + 256).astype(np.float32)
    wt = rng.standard_normal(R * steps * KoT + 32).astype(np.float32)
    results = []
    for T, KV in ((K.ROWS_T, K.ROWS_KV), (8, 2), (12, 2), (6, 4)):
        out = np.full(Ko * PQo, np.nan, np.float32)
        K._convolve_rows(e, 0, (Hi + 2) * Qo, Qo, wt, 0, KoT, out, 0, Ko, PQo, R, steps, Qo, 1,
                         1, Hi, T, KV, False, out, 16)
        results.append(out)
    assert not np.isnan(results[0]).any()
    for other in results[1:]:
        assert np.array_equal(other, results[0])


def test_tile_rows_counts_every_tile():
    """The kernel rows that the tiles of a convolution run, counted from the edges in, are
    the sum over every tile, for paddings up to beyond the kernel, dilations, and tiles of
    part of a row to several rows."""
    for Hi, Qo, R, dil, shift, span in itertools.product((1, 3, 8, 13), (1, 5, 8), (1, 3, 5),
                                                         (1, 2), (-1, 0, 2, 5), (3, 8, 32)):
        P = Hi + 2 * max(shift, 0) - dil * (R - 1)
        if P <= 0:
            continue
        PQo = P * Qo
        every = sum(r1 - r0 for r0, r1 in (K._kernel_rows(j0, min(j0 + span, PQo), Qo, R, dil,
                                                          shift, Hi)
                                           for j0 in range(0, PQo, span)))
        assert K._tile_rows(PQo, span, Qo, R, dil, shift, Hi) == every


# -- the SIMD and BLAS helpers of the kernels -------------------------------------------------

@njit
def _tile_product(T, KV, out, a, b, M, N, nseg, nstep, V, accumulate):
    """out (M, N) = sum over (g, i) of a[g, i, :M] (outer) b[g, i, :N], in T x KV*V tiles;
    a: (nseg, nstep, M + T), b: (nseg, nstep, N + KV*V), flat."""
    ma, nb = M + T, N + KV * V
    for t0 in range(0, M, T):
        for j0 in range(0, N, KV * V):
            tile(T, KV, out, t0 * N + j0, N, M - t0, N - j0, accumulate,
                 a, t0, 1, nstep * ma, ma, b, j0, nstep * nb, nb, nseg, nstep)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_shapes_agree(dtype):
    """Every tile shape gives the same bits (one chain per element) and the product; tiles
    hang over both edges; with accumulate the chain continues from what out holds."""
    rng = np.random.default_rng(0)
    M, N, nseg, nstep = 13, 37, 2, 5
    V = 64 // np.dtype(dtype).itemsize
    results = []
    for T, KV in SHAPES:
        a = rng.standard_normal((nseg, nstep, M + T))
        b = rng.standard_normal((nseg, nstep, N + KV * V))
        a[:, :, :M], b[:, :, :N] = data((nseg, nstep, M), 1), data((nseg, nstep, N), 2)
        out = np.full(M * N + 5, 9.0, dtype)
        _tile_product(T, KV, out, a.astype(dtype).ravel(), b.astype(dtype).ravel(), M, N, nseg,
                      nstep, V, False)
        assert np.all(out[M * N:] == 9.0)  # nothing stored past the edges
        results.append(out[:M * N].copy())
        _tile_product(T, KV, out, a.astype(dtype).ravel(), b.astype(dtype).ravel(), M, N, nseg,
                      nstep, V, True)
        np.testing.assert_allclose(out[:M * N], 2 * results[-1], rtol=1e-5, atol=1e-5)
    want = np.einsum("gim,gin->mn", data((nseg, nstep, M), 1), data((nseg, nstep, N), 2))
    np.testing.assert_allclose(results[0].reshape(M, N), want,
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
    for other in results[1:]:
        assert np.array_equal(other, results[0])


@njit
def _folded(T, KV, out, M, N, a, b, nstep, V, stack, top, nfold):
    """One tile of out (M, N) = sum over i of a[i, :M] (outer) b[i, :N] (a: (nstep, T),
    b: (nstep, KV*V), flat), plus the stack's tiles top, top - 1, ... (nfold of them)."""
    n = T * KV * V
    if nfold < 0:  # tile's product alone, for comparison
        tile(T, KV, out, 0, N, M, N, False, a, 0, 1, 0, T, b, 0, 0, KV * V, 1, nstep)
    else:
        folded_tile(T, KV, out, 0, N, M, N, a, 0, 1, 0, T, b, 0, 0, KV * V, 1, nstep,
                    stack, top * n, KV * V, -n, nfold)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_folded_tile_adds_the_stack_top_down(dtype):
    """folded_tile's products are tile's bits, then the stack's tiles are added one at a
    time from the top, each on the left (the order that decides the rounding); only rows
    below M and columns below N are stored."""
    rng = np.random.default_rng(3)
    V = 64 // np.dtype(dtype).itemsize
    nstep = 3
    for T, KV in SHAPES:
        W = KV * V
        a = rng.standard_normal(nstep * T).astype(dtype)
        b = rng.standard_normal(nstep * W).astype(dtype)
        product = np.zeros(T * W, dtype)
        _folded(T, KV, product, T, W, a, b, nstep, V, product, 0, -1)
        product = product.reshape(T, W)
        np.testing.assert_allclose(product, np.einsum("it,iw->tw", a.reshape(nstep, T),
                                                      b.reshape(nstep, W)), rtol=1e-5, atol=1e-5)
        # Values of several magnitudes, so that another order of the adds rounds otherwise.
        stack = (rng.standard_normal((5, T, W)) * 10.0 ** rng.integers(-4, 5, (5, T, W)))
        stack = stack.astype(dtype)
        for M, N, top, nfold in ((T, W, 4, 5), (T - 1, W - 3, 3, 2), (1, 1, 0, 1),
                                 (T, W, 2, 0)):
            out = np.full((M + 1) * N, 7.0, dtype)
            _folded(T, KV, out, M, N, a, b, nstep, V, stack.ravel(), top, nfold)
            want = product
            for level in range(top, top - nfold, -1):
                want = stack[level] + want
            assert np.array_equal(out[:M * N].reshape(M, N), want[:M, :N]), (T, KV, M, N)
            assert np.all(out[M * N:] == 7.0)


@njit
def _row_sum(out, W, src, step, S, dil, pad, Q, rows):
    shifted_row_sum(out, 3, W, src, 2, step, S, dil, pad, Q, rows)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shifted_row_sum_adds_the_taps_in_order(dtype):
    """shifted_row_sum (the input gradient's pass from the column matrix) against a loop over
    the taps s in order, then the elements, in the dtype, on values of many magnitudes (another
    order rounds otherwise): rows wider than a vector, more rows than it takes at once, taps
    shifted left and right past both ends; nothing outside the rows is written."""
    rng = np.random.default_rng(4)
    order_shows = False
    for W, Q, S, dil, pad, rows in ((12, 8, 5, 1, 0, 8), (40, 38, 3, 1, 1, 11),
                                    (7, 7, 3, 2, 2, 3), (20, 4, 4, 5, 1, 9), (5, 9, 2, 1, 0, 1)):
        step = rows * Q + 3
        src = (rng.standard_normal(2 + S * step) * 10.0 ** rng.integers(-6, 7, 2 + S * step))
        src = src.astype(dtype)
        out = (rng.standard_normal(3 + rows * W + 4) * 1e3).astype(dtype)

        def in_order(taps):
            total = out.copy()
            for s in taps:
                shift = s * dil - pad
                for i in range(rows):
                    for w in range(W):
                        if 0 <= w - shift < Q:
                            total[3 + i * W + w] += src[2 + s * step + i * Q + w - shift]
            return total

        want = in_order(range(S))
        order_shows |= not np.array_equal(want, in_order(reversed(range(S))))
        _row_sum(out, W, src, step, S, dil, pad, Q, rows)
        assert np.array_equal(out, want), (W, Q, S, dil, pad, rows)
    assert order_shows


@njit
def _transpose(dst, src, sums, rows, cols, add):
    transpose_block(dst, 3, 37, src, 2, 31, rows, cols, sums, 1, add)


@njit
def _copy(out, src, period, lo, hi, n):
    shifted_copy(out, 2, src, 5, period, lo, hi, n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_and_copy(dtype):
    V = 64 // np.dtype(dtype).itemsize
    src = data(2 + 31 * V).astype(dtype)
    for rows, cols in ((V, V), (5, V), (V, 3), (1, 1)):
        dst, sums = np.full(3 + 37 * V, -1.0, dtype), np.ones(V + 2, dtype)
        _transpose(dst, src, sums, rows, cols, True)
        block = src[2:2 + 31 * V].reshape(V, 31)[:rows, :cols]
        want = np.full_like(dst, -1.0)
        want[3:3 + 37 * V].reshape(V, 37)[:cols, :rows] = block.T
        assert np.array_equal(dst, want)
        total = np.ones(V + 2, dtype)
        for j in range(cols):  # the sums run in column order
            total[1:1 + rows] += block[:, j]
        assert np.array_equal(sums, total)
    # One row (period >= n), then rows of periods below, at and above the vector's lanes.
    for period, lo, hi, n in ((5, 0, 0, 5), (20, 2, 7, 20), (3, 0, 3, 3), (41, 4, 40, 40),
                              (8, 2, 8, 48), (3, 0, 2, 45), (1, 0, 1, 17), (V, 0, V - 3, 48),
                              (V + 4, 3, V + 1, 48), (7, 5, 5, 30)):
        out = np.full(60, -1.0, dtype)
        _copy(out, src, period, lo, hi, n)
        want = np.full(60, -1.0, dtype)
        want[2:2 + n] = [src[5 + i] if lo <= i % period < hi else 0 for i in range(n)]
        assert np.array_equal(out, want), (period, lo, hi, n)


def test_intrinsics_refuse_operands_of_mixed_or_other_types():
    """Each SIMD intrinsic compiles only for arrays of one float dtype (and int32 indices for
    column_max and stride2_row_max); anything else is a typing error, not a kernel for the
    wrong type."""
    from numba.core.errors import TypingError

    from cgp.runtime.simd import column_max, dot_tile, stride2_row_max
    f32, f64, i32 = (np.zeros(64, t) for t in (np.float32, np.float64, np.int32))

    @njit
    def copy(out, src):
        shifted_copy(out, 0, src, 0, 4, 0, 4, 4)

    @njit
    def transpose(dst, src, sums):
        transpose_block(dst, 0, 4, src, 0, 4, 4, 4, sums, 0, False)

    @njit
    def cmax(y, a, rmax, rarg):
        column_max(y, a, 0, rmax, rarg, 0, 4, 2)

    @njit
    def rmax(x, out, arg):
        stride2_row_max(x, 0, 8, 0, 4, 2, out, arg, 0, 0, -1.0, 1, 1, 8)

    @njit
    def dots(out, a, w):
        dot_tile(out, 0, 4, 1, 1, a, 0, 4, w, 0, 4, 4)

    @njit
    def rows(out, src):
        shifted_row_sum(out, 0, 4, src, 0, 4, 2, 1, 0, 4, 1)

    @njit
    def lane_dots(out, a, b):
        lane_tile(4, 5, out, 0, 0, 0, a, 0, 4, 1, b, 0, 4, 1, 4)

    copy(f32, f32)
    transpose(f64, f64, f64)
    cmax(f32, i32, f32, i32)
    rmax(f64, f64, i32)
    dots(f32, f32, f32)
    rows(f64, f64)
    lane_dots(f64, f64, f64)
    for call in (lambda: copy(f32, f64), lambda: copy(i32, i32),
                 lambda: transpose(f32, f32, f64), lambda: cmax(f32, i32, f64, i32),
                 lambda: cmax(f32, f32, f32, i32), lambda: cmax(i32, i32, i32, i32),
                 lambda: rmax(f32, f64, i32), lambda: rmax(f32, f32, f32),
                 lambda: rmax(i32, i32, i32), lambda: dots(f32, f64, f32),
                 lambda: dots(i32, i32, i32), lambda: rows(f32, f64), lambda: rows(i32, i32),
                 lambda: lane_dots(f32, f64, f32), lambda: lane_dots(i32, i32, i32)):
        with pytest.raises(TypingError):
            call()


@njit
def _gemm(alpha, a, b, beta, c):
    gemm(alpha, a, b, beta, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm(dtype):
    """c = alpha*a@b + beta*c in place, for row-major views and transposed ones; beta=0
    ignores what c holds (NaN included)."""
    a, b = data((6, 4)).astype(dtype), data((5, 6), 1).astype(dtype)
    for x, y in ((a.T, b.T), (np.ascontiguousarray(a.T), b.T), (a.T, np.ascontiguousarray(b.T))):
        c = np.full((4, 5), np.nan, dtype)
        _gemm(1.0, x, y, 0.0, c)
        np.testing.assert_allclose(c, a.T @ b.T, rtol=1e-5)
        ct = np.ones((5, 4), dtype).T  # a column-major target
        _gemm(2.0, x, y, 1.0, ct)
        np.testing.assert_allclose(ct, 2 * a.T @ b.T + 1, rtol=1e-5)
    with pytest.raises(ValueError, match="shapes do not match"):
        _gemm(1.0, a, a, 0.0, np.zeros((6, 4), dtype))


@pytest.mark.parametrize("fields, shape, top, weight", [
    ("num_output: 20 kernel_size: 5", (64, 1, 28, 28), (64, 20, 24, 24), (20, 1, 5, 5)),  # LeNet
    ("num_output: 50 kernel_size: 5", (64, 20, 12, 12), (64, 50, 8, 8), (50, 20, 5, 5)),
    ("num_output: 32 kernel_size: 5 pad: 2", (100, 3, 32, 32), (100, 32, 32, 32),
     (32, 3, 5, 5)),                                                                # cifar10_quick
    ("num_output: 2 kernel_size: 3 stride: 2", (1, 1, 8, 8), (1, 2, 3, 3), (2, 1, 3, 3)),
    ("num_output: 2 kernel_size: 3 stride: 2 pad: 1", (1, 1, 8, 7), (1, 2, 4, 4), (2, 1, 3, 3)),
    ("num_output: 2 kernel_size: 3 dilation: 2", (1, 1, 9, 9), (1, 2, 5, 5), (2, 1, 3, 3)),
    ("num_output: 4 kernel_h: 5 kernel_w: 1 group: 2", (1, 2, 5, 5), (1, 4, 1, 5), (4, 1, 5, 1)),
])
def test_shapes(fields, shape, top, weight):
    # Caffe rounds the output size down: P = (H + 2*pad - extent) // stride + 1.
    text = f'type: "Convolution" bottom: "x" top: "y" convolution_param {{ {fields} }}'
    layer = build(text, [shape])
    assert layer.top_shapes == [top]
    assert layer.param_shapes() == [weight, (weight[0],)]


def test_fillers():
    layer = build(conv_text('kernel_size: 3 weight_filler { type: "xavier" }'), [(1, 2, 4, 4)])
    weight, bias = layer.param_fillers()
    assert weight.type == "xavier" and bias.type == "constant" and bias.value == 0
    layer = build(conv_text("kernel_size: 3 bias_term: false"), [(1, 2, 4, 4)])
    assert len(layer.param_fillers()) == 1 and layer.param_fillers()[0].type == "constant"


@pytest.mark.parametrize("fields, shape, message", [
    ("kernel_size: 3 group: 2", (1, 3, 5, 5), "multiple of group"),
    ("kernel_size: 3 group: 3", (1, 3, 5, 5), "num_output .4. must be a multiple of group"),
    ("kernel_size: 6", (1, 3, 5, 5), "larger than the padded input"),
    ("kernel_size: 6 pad: 1", (1, 3, 3, 8), "larger than the padded input"),
    ("kernel_size: 3 dilation: 3", (1, 3, 6, 6), "larger than the padded input"),
    ("kernel_size: 3 axis: 0", (1, 3, 5, 5), "axis 0"),
    ("kernel_size: 3 axis: 2", (1, 3, 5, 5, 5), "axis 2 is not supported"),
    ("kernel_size: 3", (1, 3, 5), "only 2-d convolution"),
    ("kernel_size: 3", (1, 3, 5, 5, 5), "only 2-d convolution"),
    ("kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 3, 5, 5), "not both"),
    ("kernel_h: 3", (1, 3, 5, 5), "together"),
    ("pad: 1", (1, 3, 5, 5), "kernel_size .or kernel_h and kernel_w. must be given"),
    ("kernel_size: 1 kernel_size: 2 kernel_size: 3", (1, 3, 5, 5), "once per spatial axis"),
    ("kernel_size: 0", (1, 3, 5, 5), "kernel dimensions must be positive"),
    ("kernel_size: 3 stride: 0", (1, 3, 5, 5), "stride must be positive"),
    ("kernel_size: 3 dilation: 0", (1, 3, 5, 5), "dilation must be positive"),
    ("kernel_size: 3 group: 0", (1, 3, 5, 5), "group must be positive"),
])
def test_refused(fields, shape, message):
    with pytest.raises(NetError, match=message):
        build(conv_text(fields), [shape])


def test_refused_counts_and_shapes():
    with pytest.raises(NetError, match="num_output must be given"):
        build('type: "Convolution" bottom: "x" top: "y" convolution_param { kernel_size: 3 }',
              [(1, 3, 5, 5)])
    with pytest.raises(NetError, match="one top per bottom"):
        build(conv_text("kernel_size: 3", bottoms=("a", "b")), [(1, 3, 5, 5)] * 2)
    with pytest.raises(NetError, match="one shape"):
        build(conv_text("kernel_size: 3", bottoms=("a", "b"), tops=("c", "d")),
              [(1, 3, 5, 5), (1, 3, 6, 5)])


def test_lenet_test_forward_matches_caffe(caffe_dir):
    """Caffe's LeNet after 100 iterations, run through these Convolution, Pooling and
    InnerProduct layers (ReLU and softmax in NumPy) on the first 1000 MNIST test images, gives
    `caffe test`'s per-batch accuracy and loss (test_iter100.txt)."""
    import gzip

    from google.protobuf import text_format

    from cgp.layers import REGISTRY
    from cgp.proto import caffe_pb2
    from cgp.snapshot import read_caffemodel

    lenet, mnist = caffe_dir / "lenet", caffe_dir.parent / "mnist"
    if not (mnist / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"MNIST not found at {mnist}")
    images = np.frombuffer(gzip.open(mnist / "t10k-images-idx3-ubyte.gz").read(), np.uint8,
                           offset=16).reshape(-1, 1, 28, 28)[:1000]
    labels = np.frombuffer(gzip.open(mnist / "t10k-labels-idx1-ubyte.gz").read(), np.uint8,
                           offset=8)[:1000]
    weights = read_caffemodel(lenet / "lenet_iter_100.caffemodel")
    net = text_format.Parse((lenet / "lenet_train_test_fixture.prototxt").read_text(),
                            caffe_pb2.NetParameter())
    params = {lp.name: lp for lp in net.layer}
    expected = [line.split() for line in (lenet / "test_iter100.txt").read_text().splitlines()
                if line[:1].isdigit()]

    def run(name, x):
        layer = REGISTRY[params[name].type](params[name])
        y = np.zeros(layer.setup([x.shape])[0], np.float32)
        scratch = alloc_scratch(layer, len(x), np.float32)
        layer.forward([x], [y], weights.get(name, []), scratch, Chunk(n=len(x)))
        return y

    for b, (_, accuracy, loss) in enumerate(expected):
        x = images[b * 100:(b + 1) * 100].astype(np.float32) * np.float32(0.00390625)
        h = run("pool2", run("conv2", run("pool1", run("conv1", x))))
        z = run("ip2", np.maximum(run("ip1", h), 0)).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        y = labels[b * 100:(b + 1) * 100]
        assert np.mean(z.argmax(axis=1) == y) == pytest.approx(float(accuracy), abs=1e-9)
        assert -log_p[np.arange(100), y].mean() == pytest.approx(float(loss), rel=2e-5)


# -- Deconvolution -----------------------------------------------------------------------------

def deconv_text(extra, num_output=4, bottoms=("x",), tops=("y",)):
    return conv_text(extra, num_output, bottoms, tops).replace('"Convolution"', '"Deconvolution"')


def deconv_ref(x, w, b=None, stride=(1, 1), pad=(0, 0), dilation=(1, 1), group=1):
    """The transpose of conv_ref: each input element scatters its weights, tap by tap, into
    the padded output; the padding is then cut away."""
    N, C, H, W = x.shape
    _, Kg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    P = sh * (H - 1) + dh * (R - 1) + 1 - 2 * ph
    Q = sw * (W - 1) + dw * (S - 1) + 1 - 2 * pw
    yp = np.zeros((N, Kg * group, P + 2 * ph, Q + 2 * pw))
    Cg = C // group
    for c in range(C):
        g = c // Cg
        for r in range(R):
            for s in range(S):
                yp[:, g * Kg:(g + 1) * Kg, r * dh:r * dh + sh * (H - 1) + 1:sh,
                   s * dw:s * dw + sw * (W - 1) + 1:sw] += np.einsum("nhw,k->nkhw", x[:, c],
                                                                      w[c, :, r, s])
    y = yp[:, :, ph:ph + P, pw:pw + Q]
    return y if b is None else y + b[None, :, None, None]


DECONV = {
    "plain": ("kernel_size: 3", (2, 3, 4, 5), {}),
    "fcn_upsample": ("kernel_size: 4 stride: 2 pad: 1", (2, 3, 3, 4),
                     dict(stride=(2, 2), pad=(1, 1))),
    "rect": ("kernel_h: 2 kernel_w: 3 stride_h: 3 stride_w: 1 pad_w: 1", (2, 2, 3, 4),
             dict(stride=(3, 1), pad=(0, 1))),
    "group2": ("kernel_size: 3 stride: 2 group: 2", (2, 4, 3, 3), dict(stride=(2, 2), group=2)),
    "dilation": ("kernel_size: 3 dilation: 2 pad: 1", (2, 2, 4, 4),
                 dict(pad=(1, 1), dilation=(2, 2))),
    "pointwise": ("kernel_size: 1", (2, 3, 3, 2), {}),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(DECONV))
def test_deconvolution(name, bias):
    fields, shape, kw = DECONV[name]
    layer = build(deconv_text(f"{fields} bias_term: {str(bias).lower()}"), [shape])
    params = random_params(layer)
    group = kw.get("group", 1)
    assert params[0].shape[:2] == (shape[1], 4 // group)
    assert layer.top_shapes == [deconv_ref(data(shape), params[0], **kw).shape]
    check_forward(layer, [data(shape)], lambda x, w, b=None: deconv_ref(x, w, b, **kw),
                  params=params)
    check_gradients(layer, [data(shape)])
    check_parts(layer, [data((5,) + shape[1:])], (0, 2, 3, 5))
    check_split_invariance(layer, [data((3,) + shape[1:])], cut=1)


def test_deconvolution_two_bottoms_and_no_dx():
    shape = (2, 3, 3, 3)
    layer = build(deconv_text("kernel_size: 2 stride: 2", bottoms=("a", "b"), tops=("c", "d")),
                  [shape, shape])
    a, b = data(shape, 1), data(shape, 2)
    check_forward(layer, [a, b], lambda a, b, w, bias: (
        deconv_ref(a, w, bias, stride=(2, 2)), deconv_ref(b, w, bias, stride=(2, 2))))
    check_gradients(layer, [a, b], check=[True, False])


def test_deconvolution_refuses_an_empty_output():
    with pytest.raises(NetError, match="output would be"):
        build(deconv_text("kernel_size: 1 pad: 1"), [(2, 3, 2, 2)])


def test_dilated_convolution_gradients_match_the_reference():
    """Convolution's dilation (as in Caffe's DeepLab nets), which cgp had already:
    the input gradient and weight gradient against conv_ref_grads."""
    shape = (2, 3, 9, 9)
    layer = build(conv_text("kernel_size: 3 dilation: 3 pad: 3"), [shape])
    x, params = data(shape), random_params(layer)
    dy = data((2, 4, 9, 9), 4)
    _, (dx,), (dw, db) = backward(layer, [x], params, [dy])
    want = conv_ref_grads(x, params[0], dy, pad=(3, 3), dilation=(3, 3))
    for got, ref in zip((dx, dw, db), want):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
