"""Convolution against a float64 NumPy reference written without im2col (shifted slices of the
padded input), gradient checks, split invariance, shape rules and Caffe's parameter rules."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import Chunk
from layer_check import (backward, build, check_forward, check_gradients,
                         check_split_invariance, random_params)


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
    "pointwise_stride": ("kernel_size: 1 stride: 2 pad: 1", (2, 3, 4, 3),
                         dict(stride=(2, 2), pad=(1, 1))),
}


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
    tops, _, once = backward(layer, [x], params, top_diff)
    scratch = {k: np.zeros(s) for k, s in layer.scratch_shapes(2).items()}
    diffs = [np.ones_like(p) for p in params]
    layer.backward(tops, top_diff, [x], [None], params, diffs, scratch, Chunk(n=2))
    for got, want in zip(diffs, once):
        np.testing.assert_allclose(got, want + 1, rtol=1e-12)


@pytest.mark.parametrize("name", ["pad_stride", "group2", "pointwise"])
def test_split_invariance(name):
    fields, shape, _ = CONFIGS[name]
    shape = (5,) + shape[1:]
    layer = build(conv_text(fields), [shape])
    check_split_invariance(layer, [data(shape)], cut=2)


def test_split_invariance_lenet_conv2():
    # Real sizes, so that BLAS runs its full GEMM kernels.
    layer = build(conv_text("kernel_size: 5", num_output=50), [(5, 20, 12, 12)])
    for cut in (1, 2, 4):
        check_split_invariance(layer, [data((5, 20, 12, 12))], cut=cut)


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
        scratch = {k: np.zeros(s, np.float32) for k, s in layer.scratch_shapes(len(x)).items()}
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
