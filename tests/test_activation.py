"""ReLU, Sigmoid, TanH, AbsVal and Dropout against float64 NumPy references, finite
differences and batch splits; Philox4x32-10 against Random123's known answers."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.kernels import activation as K
from cgp.runtime.philox import philox4x32_10, uniform, uniform_fill
from cgp.layers import Chunk
from cgp.net import Net, Workspace
from cgp.proto import caffe_pb2
from cgp.prototxt import parse_net
from layer_check import (backward, build, check_forward, check_gradients, check_parts,
                         check_split_invariance, forward)

SHAPE = (4, 3, 2, 3)


def away_from_zero(shape, seed=0):
    """Random values with |x| >= 0.1: central differences never straddle ReLU's kink."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 2.0, shape)
    return x * rng.choice([-1.0, 1.0], shape)


def layer_text(kind, extra=""):
    return f'type: "{kind}" bottom: "x" top: "y" {extra}'


# -- ReLU, Sigmoid, TanH ----------------------------------------------------------------------

def relu_ref(slope):
    return lambda x: np.where(x > 0, x, slope * x)


def sigmoid_ref(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("kind, extra, reference", [
    ("ReLU", "", relu_ref(0.0)),
    ("ReLU", "relu_param { negative_slope: 0.25 }", relu_ref(0.25)),
    ("Sigmoid", "", sigmoid_ref),
    ("TanH", "", np.tanh),
    ("AbsVal", "", np.abs),
])
def test_activation(kind, extra, reference):
    x = away_from_zero(SHAPE)
    layer = build(layer_text(kind, extra), [SHAPE])
    assert layer.top_shapes == [SHAPE]
    check_forward(layer, [x], reference)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)


def test_relu_kink_and_in_place_name():
    # Caffe nets run ReLU in place (top named like the bottom); the layer sees two buffers.
    layer = build('type: "ReLU" bottom: "x" top: "x" relu_param { negative_slope: 0.5 }',
                  [(1, 4)])
    x = np.array([[-2.0, 0.0, 3.0, -0.5]])
    dy = np.ones_like(x)
    tops, (dx,), _ = backward(layer, [x], [], [dy])
    np.testing.assert_array_equal(tops[0], [[-1.0, 0.0, 3.0, -0.25]])
    np.testing.assert_array_equal(dx, [[0.5, 0.5, 1.0, 0.5]])   # x = 0 takes the slope


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_relu_kernels_in_place_give_the_bits_of_separate_arrays(dtype, slope):
    # In place the kernels take another loop (one LLVM can vectorise); the same bits, also
    # at 0, -0, infinities and NaN, over a length that is no multiple of a vector.
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1000).astype(dtype)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
    dy = rng.standard_normal(1000).astype(dtype)
    dy[6:10] = [np.inf, -np.inf, -0.0, np.nan]
    s = dtype(slope)
    y = np.empty_like(x)
    K.relu_forward(x, y, s)
    same = x.copy()
    K.relu_forward(same, same, s)
    assert same.tobytes() == y.tobytes()
    dx = np.empty_like(x)
    K.relu_backward(x, dy, dx, s)
    d = dy.copy()
    K.relu_backward(y, d, d, s)      # in place: from the top, as the net runs it
    assert d.tobytes() == dx.tobytes()


def test_sigmoid_saturates_without_overflow():
    layer = build(layer_text("Sigmoid"), [(1, 4)])
    x = np.array([[-1e4, -100.0, 100.0, 1e4]], np.float32)
    with np.errstate(all="raise"):
        (y,), _ = forward(layer, [x], [])
    np.testing.assert_allclose(y, [[0.0, 0.0, 1.0, 1.0]], atol=1e-30)


def test_backward_uses_the_top():
    # Sigmoid and TanH differentiate from y: a top that disagrees with the bottom shows it.
    for kind, grad in (("Sigmoid", lambda y: y * (1 - y)), ("TanH", lambda y: 1 - y * y)):
        layer = build(layer_text(kind), [(1, 3)])
        x = np.zeros((1, 3))
        y = np.array([[0.2, 0.5, 0.9]])
        dy = np.array([[1.0, 2.0, 3.0]])
        dx = np.full_like(x, 7.0)
        layer.backward([y], [dy], [x], [dx], [], [], {}, Chunk(n=1))
        np.testing.assert_allclose(dx, dy * grad(y))


def test_absval_kink():
    # dy/dx = sign(x), and 0 at x = 0 and -0 (Caffe's sign); the differences stepping around
    # the kink, from either side, give -1 and 1.
    layer = build(layer_text("AbsVal"), [(1, 5)])
    x = np.array([[-2.0, 0.0, -0.0, 3.0, -0.5]])
    dy = np.array([[2.0, 5.0, -5.0, 4.0, 3.0]])
    tops, (dx,), _ = backward(layer, [x], [], [dy])
    assert tops[0].tobytes() == np.array([[2.0, 0.0, 0.0, 3.0, 0.5]]).tobytes()
    np.testing.assert_array_equal(dx, [[-2.0, 0.0, 0.0, 4.0, -3.0]])
    check_gradients(layer, [np.array([[-1e-3, 1e-3, -2e-5, 2e-5, 0.7]])])


def test_absval_named_in_place_keeps_its_bottom():
    """A prototxt that names AbsVal's top like its bottom: |x| loses the sign that backward
    needs, so the top gets its own buffer, and the net gives the bits of the net that names
    the top apart."""
    head = ('layer { name: "in" type: "Input" top: "data" top: "label" '
            'input_param { shape { dim: 4 dim: 6 } shape { dim: 4 } } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
            'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }\n')
    loss_text = ('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "{}" bottom: "label" '
                 'top: "loss" }')
    texts = [head + 'layer { name: "abs" type: "AbsVal" bottom: "ip" top: "ip" }\n'
             + loss_text.replace("{}", "ip"),
             head + 'layer { name: "abs" type: "AbsVal" bottom: "ip" top: "abs" }\n'
             + loss_text.replace("{}", "abs")]
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4, 6)).astype(np.float32)
    label = np.array([0, 1, 2, 1], np.float32)
    results = []
    for text in texts:
        net = Net(parse_net(text), caffe_pb2.TRAIN)
        ip, absval, loss = net.entries
        assert absval.tops != absval.bottoms and loss.bottoms[0] == absval.tops[0]
        net.init_params(3)
        ws = Workspace(net, 4)
        chunk = Chunk(n=4, batch=4)
        views = net.param_views(net.params)
        grads = np.zeros((1, net.n_params), np.float32)
        out = net.forward(ws, chunk, {net.sources[0].tops[0]: data,
                                      net.sources[0].tops[1]: label}, views)
        net.backward(ws, chunk, out, views, net.param_views(grads))
        # The gradient reached the InnerProduct through sign(x), not through sign(|x|).
        x, dy = out[ip.tops[0]], ws.diff_views(4)[absval.tops[0]]
        assert (x < 0).any()
        np.testing.assert_array_equal(ws.diff_views(4)[ip.tops[0]], np.sign(x) * dy)
        results.append((out[loss.tops[0]].tobytes(), grads.tobytes()))
    assert results[0] == results[1]


# -- Philox4x32-10 ----------------------------------------------------------------------------

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key -> output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(*counter, *key)) == expected


def test_uniform_moments_and_range():
    u = np.zeros(100_000)
    uniform_fill(12345, 7, 3, 2, u)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005             # sd of the mean ~ 0.0009
    assert abs(u.var() - 1 / 12) < 0.002
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    # The fill and the scalar draw are the same stream.
    assert [uniform(12345, 7, 3, 2, d) for d in (0, 1, 5, 99_999)] == list(u[[0, 1, 5, 99_999]])


def test_uniform_depends_on_every_key_component():
    base = (11, 5, 3, 2)

    def stream(seed, iteration, sample, layer):
        u = np.zeros(64)
        uniform_fill(seed, iteration, sample, layer, u)
        return u

    ref = stream(*base)
    np.testing.assert_array_equal(ref, stream(*base))
    for k in range(4):
        changed = list(base)
        changed[k] += 1
        assert np.count_nonzero(stream(*changed) == ref) < 3, f"key component {k} ignored"
    assert len(set(ref)) == 64                    # the element index changes the draw too
    # The seed's high word is part of the key.
    assert uniform(11, 5, 3, 2, 0) != uniform(11 + 2**32, 5, 3, 2, 0)


# -- Dropout ----------------------------------------------------------------------------------

DROP = (6, 2, 3, 5)


def dropout(ratio=None, phase=caffe_pb2.TRAIN, index=3, shape=DROP):
    extra = f"dropout_param {{ dropout_ratio: {ratio} }}" if ratio is not None else ""
    return build(layer_text("Dropout", extra), [shape], phase=phase, index=index)


def mask_of(layer, x, chunk):
    (y,), scratch = forward(layer, [x], [], chunk)
    return y, scratch["mask"]


def test_dropout_train_keeps_and_scales():
    x = away_from_zero((8, 1000)).astype(np.float32)
    for ratio in (0.5, 0.2):
        layer = dropout(ratio, shape=x.shape)
        y, mask = mask_of(layer, x, Chunk(n=8, seed=1, iteration=2))
        scale = np.float32(1.0 / (1.0 - np.float64(np.float32(ratio))))
        kept = y != 0
        assert abs(kept.mean() - (1 - ratio)) < 0.02
        np.testing.assert_array_equal(y[kept], x[kept] * scale)
        np.testing.assert_array_equal(mask, np.where(kept, scale, 0))


def test_dropout_default_ratio():
    assert dropout().ratio == 0.5


def test_dropout_mask_is_the_uniform_stream():
    layer = dropout(0.4, index=5)
    x = np.ones(DROP)
    _, mask = mask_of(layer, x, Chunk(n=6, first=10, seed=9, iteration=4))
    u = np.zeros(int(np.prod(DROP[1:])))
    for i in range(DROP[0]):
        uniform_fill(9, 4, 10 + i, 5, u)
        keep = u >= np.float64(np.float32(0.4))
        np.testing.assert_array_equal(mask[i].reshape(-1) != 0, keep)


def test_dropout_gradient():
    x = away_from_zero(DROP)
    layer = dropout(0.3)
    chunk = Chunk(n=6, seed=4, iteration=1)
    check_gradients(layer, [x], chunk=chunk)
    dy = away_from_zero(DROP, seed=2)
    (y,), (dx,), _ = backward(layer, [x], [], [dy], chunk)
    _, mask = mask_of(layer, x, chunk)
    np.testing.assert_array_equal(dx, mask * dy)
    assert set(np.unique(mask)) == {0.0, 1.0 / (1.0 - np.float64(np.float32(0.3)))}


def test_dropout_test_phase_is_identity():
    layer = dropout(0.5, phase=caffe_pb2.TEST)
    assert layer.scratch_shapes(6) == {}
    x = away_from_zero(DROP)
    check_forward(layer, [x], lambda x: x, chunk=Chunk(n=6, seed=1))
    dy = away_from_zero(DROP, seed=3)
    _, (dx,), _ = backward(layer, [x], [], [dy])
    np.testing.assert_array_equal(dx, dy)


def test_dropout_split_invariance():
    x = away_from_zero(DROP)
    layer = dropout(0.5)
    for cut in (1, 2, 5):
        check_split_invariance(layer, [x], cut=cut, chunk_kw=dict(seed=7, iteration=3))


def test_dropout_masks_keyed_by_seed_iteration_sample_layer():
    x = np.ones(DROP)
    n = DROP[0]

    def mask(first=0, seed=1, iteration=0, index=3, dtype=np.float64, rows=slice(None)):
        layer = dropout(0.5, index=index)
        xs = x[rows].astype(dtype)
        return mask_of(layer, xs, Chunk(n=len(xs), first=first, batch=n, seed=seed,
                                        iteration=iteration))[1] != 0

    ref = mask()
    np.testing.assert_array_equal(ref, mask())                            # same key
    np.testing.assert_array_equal(ref, mask(dtype=np.float32))            # any dtype
    np.testing.assert_array_equal(ref[2:5], mask(first=2, rows=slice(2, 5)))   # any chunk
    for changed in (dict(seed=2), dict(iteration=1), dict(index=4), dict(first=1)):
        other = mask(**changed)
        assert np.mean(other == ref) < 0.75, f"mask ignores {changed}"
    assert np.mean(ref[0] == ref[1]) < 0.75                               # samples differ


@pytest.mark.parametrize("ratio", [1.0, -0.1])
def test_dropout_refuses_bad_ratio(ratio):
    with pytest.raises(NetError, match="dropout_ratio"):
        dropout(ratio)


# -- ELU, BNLL, Exp, Log, Power, Threshold, Clip, Swish, PReLU ---------------------------------

def elu_ref(alpha):
    return lambda x: np.where(x > 0, x, alpha * (np.exp(np.minimum(x, 0)) - 1))


def bnll_ref(x):
    return np.logaddexp(0, x)


def exp_ref(base, scale, shift):
    b = np.e if base == -1 else base
    return lambda x: b ** (shift + scale * x)


def log_ref(base, scale, shift):
    lb = 1.0 if base == -1 else np.log(base)
    return lambda x: np.log(shift + scale * x) / lb


def power_ref(power, scale, shift):
    return lambda x: (shift + scale * x) ** power


def swish_ref(beta):
    return lambda x: x / (1 + np.exp(-beta * x))


@pytest.mark.parametrize("kind, extra, reference", [
    ("ELU", "", elu_ref(1.0)),
    ("ELU", "elu_param { alpha: 0.4 }", elu_ref(0.4)),
    ("BNLL", "", bnll_ref),
    ("Exp", "", exp_ref(-1, 1, 0)),
    ("Exp", "exp_param { base: 2 scale: 0.5 shift: 0.3 }", exp_ref(2, 0.5, 0.3)),
    ("Exp", "exp_param { base: -1 scale: -1.5 shift: -1 }", exp_ref(-1, -1.5, -1)),
    ("Power", "", power_ref(1, 1, 0)),
    ("Power", "power_param { power: 2 scale: 0.5 shift: 0.25 }", power_ref(2, 0.5, 0.25)),
    ("Power", "power_param { power: 3 scale: -2 }", power_ref(3, -2, 0)),
    ("Power", "power_param { power: 1 scale: 3 shift: 1 }", power_ref(1, 3, 1)),
    ("Swish", "", swish_ref(1.0)),
    ("Swish", "swish_param { beta: 2.5 }", swish_ref(2.5)),
    ("Clip", "clip_param { min: -0.5 max: 1.2 }", lambda x: np.clip(x, -0.5, 1.2)),
])
def test_neuron(kind, extra, reference):
    x = away_from_zero(SHAPE)
    layer = build(layer_text(kind, extra), [SHAPE])
    assert layer.top_shapes == [SHAPE]
    check_forward(layer, [x], reference, rtol=2e-5)
    check_gradients(layer, [x])
    check_split_invariance(layer, [x], cut=1)


@pytest.mark.parametrize("extra, reference", [
    ("", log_ref(-1, 1, 0)),
    ("log_param { base: 10 scale: 2 shift: 0.5 }", log_ref(10, 2, 0.5)),
    ("log_param { base: 0.5 scale: 0.5 }", log_ref(0.5, 0.5, 0)),
])
def test_log(extra, reference):
    x = np.abs(away_from_zero(SHAPE)) + 0.2      # inside the logarithm's domain
    layer = build(layer_text("Log", extra), [SHAPE])
    check_forward(layer, [x], reference)
    check_gradients(layer, [x])


def test_power_with_shift_and_fractional_power():
    x = np.abs(away_from_zero(SHAPE))
    layer = build(layer_text("Power", "power_param { power: 0.5 scale: 1.5 shift: 0.2 }"),
                  [SHAPE])
    check_forward(layer, [x], power_ref(0.5, 1.5, 0.2))
    check_gradients(layer, [x])


@pytest.mark.parametrize("extra, value", [("power_param { power: 0 scale: 3 }", 1.0),
                                          ("power_param { power: 3 scale: 0 shift: 2 }", 8.0)])
def test_power_ignoring_its_input(extra, value):
    """Caffe's special case: power or scale 0 gives a constant and a zero gradient, whatever
    the input (NaN included)."""
    x = away_from_zero((2, 3))
    x[0, 0] = np.nan
    layer = build(layer_text("Power", extra), [(2, 3)])
    tops, (dx,), _ = backward(layer, [x], [], [np.ones((2, 3))])
    np.testing.assert_array_equal(tops[0], np.full((2, 3), value))
    np.testing.assert_array_equal(dx, np.zeros((2, 3)))


def test_elu_kink_and_bnll_saturation():
    layer = build(layer_text("ELU", "elu_param { alpha: 0.5 }"), [(1, 3)])
    check_gradients(layer, [np.array([[-1e-3, 1e-3, -3.0]])], eps=1e-7)
    layer = build(layer_text("BNLL"), [(1, 4)])
    x = np.array([[-100.0, -60.0, 60.0, 100.0]], np.float32)
    with np.errstate(all="raise"):
        (y,), (dx,), _ = backward(layer, [x], [], [np.ones((1, 4), np.float32)])
    np.testing.assert_allclose(y, [[0, 0, 60, 100]], atol=1e-25)
    np.testing.assert_allclose(dx, [[0, 0, 1, 1]], atol=1e-25)


def test_clip_gradient_passes_at_its_bounds():
    layer = build(layer_text("Clip", "clip_param { min: -1 max: 2 }"), [(1, 5)])
    x = np.array([[-1.5, -1.0, 0.5, 2.0, 2.5]])
    tops, (dx,), _ = backward(layer, [x], [], [np.full((1, 5), 3.0)])
    np.testing.assert_array_equal(tops[0], [[-1.0, -1.0, 0.5, 2.0, 2.0]])
    np.testing.assert_array_equal(dx, [[0, 3, 3, 3, 0]])
    check_gradients(layer, [np.array([[-1.2, -0.9, 1.9, 2.1]])])


def test_threshold_forward_and_no_gradient():
    layer = build(layer_text("Threshold", "threshold_param { threshold: 0.5 }"), [(1, 4)])
    x = np.array([[0.2, 0.5, 0.51, 3.0]])
    check_forward(layer, [x], lambda x: (x > 0.5).astype(float), rtol=0, atol=0)
    tops, _ = forward(layer, [x], [])
    # Caffe implements no backward: a net that needs one is refused, one that does not runs.
    assert list(layer.backward_calls(tops, [x], [x], [None], [], [], {}, Chunk(n=1))) == []
    with pytest.raises(NetError, match="has no gradient"):
        layer.backward_calls(tops, [x], [x], [np.zeros_like(x)], [], [], {}, Chunk(n=1))


@pytest.mark.parametrize("kind, extra, message", [
    ("Exp", "exp_param { base: -2 }", "strictly positive"),
    ("Log", "log_param { base: 0 }", "strictly positive"),
    ("Log", "log_param { base: 1 }", "base 1"),
    ("Clip", "clip_param { min: 2 max: 1 }", "must not exceed"),
])
def test_neuron_parameters_refused(kind, extra, message):
    with pytest.raises(NetError, match=message):
        build(layer_text(kind, extra), [SHAPE])


def prelu_ref(x, slope):
    a = slope.reshape((1, -1) + (1,) * (x.ndim - 2)) if slope.ndim else slope
    return np.where(x > 0, x, a * x)


@pytest.mark.parametrize("shape", [SHAPE, (4, 5)])
@pytest.mark.parametrize("shared", [False, True])
def test_prelu(shape, shared):
    layer = build(layer_text("PReLU", f"prelu_param {{ channel_shared: {str(shared).lower()} }}"),
                  [shape])
    assert layer.param_shapes() == [() if shared else (shape[1],)]
    x = away_from_zero(shape)
    params = [np.asarray(np.random.default_rng(3).uniform(0.1, 0.4, layer.param_shapes()[0]))]
    check_forward(layer, [x], prelu_ref, params=params)
    check_gradients(layer, [x], params=params)
    check_split_invariance(layer, [x], params=params, cut=1)
    check_parts(layer, [x], (0, 1, 3, 4), params=params)


def test_prelu_default_filler_and_slope_gradient():
    layer = build(layer_text("PReLU"), [(2, 2, 3)])
    [filler] = layer.param_fillers()
    assert (filler.type, filler.value) == ("constant", 0.25)
    x = np.array([[[-1.0, 2.0, -3.0], [0.0, -1.0, 1.0]], [[1.0, -2.0, 4.0], [-0.5, 2.0, 3.0]]])
    dy = np.arange(12.0).reshape(2, 2, 3)
    _, _, (dslope,) = backward(layer, [x], [np.array([0.25, 0.5])], [dy])
    # Elements with x <= 0 only (x = 0 adds 0): channel 0: 0*-1 + 2*-3 + 7*-2; channel 1:
    # 4*-1 + 9*-0.5.
    np.testing.assert_array_equal(dslope, [-20.0, -8.5])
