"""Building nets from prototxt: phase rules, in-place renaming and in-place ReLUs, automatic
splits, parameter layout and sharing, and the errors a user sees for a broken net."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import Chunk
from cgp.net import Net, RunOptions, Workspace
from cgp.proto import caffe_pb2
from cgp.prototxt import parse_net, read_net
from cgp import models

INPUT = 'layer { name: "in" type: "Input" top: "data" top: "label" ' \
        'input_param { shape { dim: 4 dim: 1 dim: 6 dim: 6 } shape { dim: 4 } } }\n'


def build(text, phase=caffe_pb2.TRAIN, **kw):
    return Net(parse_net(INPUT + text, "test.prototxt"), phase, **kw)


def test_lenet_shapes_and_splits(mnist_dir):
    param = read_net(models.FOLDER / "lenet_train_test.prototxt")
    train = Net(param, caffe_pb2.TRAIN, RunOptions(data_dir=str(mnist_dir)))
    shapes = {train.blob_names[b]: train.blob_shapes[b] for e in train.entries for b in e.tops}
    assert shapes["conv1"] == (64, 20, 24, 24)
    assert shapes["pool1"] == (64, 20, 12, 12)
    assert shapes["pool2"] == (64, 50, 4, 4)
    assert shapes["ip2"] == (64, 10)
    assert train.batch_size == 64
    assert train.n_params == 20 * 25 + 20 + 50 * 500 + 50 + 500 * 800 + 500 + 10 * 500 + 10
    # The TEST net reads ip2 and label twice (accuracy and loss): Caffe's splits appear.
    test = Net(param, caffe_pb2.TEST, RunOptions(data_dir=str(mnist_dir)))
    splits = [e.layer.name for e in test.entries if e.layer.type_name == "Split"]
    assert sorted(splits) == ["ip2_split", "label_split"]
    assert test.batch_size == 100
    assert [name for _, name in test.scalar_outputs()] == ["accuracy", "loss"]


def test_in_place_layers_get_their_own_buffers():
    net = build('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                'inner_product_param { num_output: 3 } }\n'
                'layer { name: "sig" type: "Sigmoid" bottom: "ip" top: "ip" }\n'
                'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }')
    ip, sig, loss = net.entries
    assert sig.bottoms == ip.tops and sig.tops != sig.bottoms
    assert loss.bottoms[0] == sig.tops[0]
    assert ip.backward and sig.backward and loss.backward
    assert net.loss_weights == {loss.tops[0]: 1.0}


IN_PLACE = ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
            'convolution_param { num_output: 4 kernel_size: 3 pad: 1 '
            'weight_filler { type: "gaussian" std: 0.5 } } }\n'
            'layer { name: "relu1" type: "ReLU" bottom: "conv" top: "conv" '
            'relu_param { negative_slope: 0.25 } }\n'
            'layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" '
            'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
            'layer { name: "relu2" type: "ReLU" bottom: "pool" top: "pool" '
            'relu_param { negative_slope: 0.1 } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" '
            'inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } '
            'bias_filler { type: "gaussian" } } }\n'
            'layer { name: "relu3" type: "ReLU" bottom: "ip" top: "ip" }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }')


def test_in_place_relu_shares_its_bottoms_buffers():
    """A ReLU that the prototxt runs in place, on the top of a Convolution, Pooling or
    InnerProduct that no other layer reads, takes that blob's buffers, as in Caffe."""
    net = build(IN_PLACE)
    conv, relu1, pool, relu2, ip, relu3, loss = net.entries
    assert relu1.tops == relu1.bottoms == conv.tops
    assert relu2.tops == relu2.bottoms == pool.tops
    assert relu3.tops == relu3.bottoms == ip.tops
    assert pool.bottoms == conv.tops and loss.bottoms[0] == ip.tops[0]
    assert all(e.backward for e in net.entries)


@pytest.mark.parametrize("text, why", [
    ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
     'inner_product_param { num_output: 3 } }\n'
     'layer { name: "relu" type: "ReLU" bottom: "ip" top: "r" }\n', "not in place"),
    ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
     'inner_product_param { num_output: 3 } }\n'
     'layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" '
     'relu_param { negative_slope: -0.5 } }\n', "negative slope: y > 0 where x < 0"),
    ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
     'inner_product_param { num_output: 3 } }\n'
     'layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" propagate_down: true }\n',
     "propagate_down given"),
    ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
     'inner_product_param { num_output: 3 } }\n'
     'layer { name: "sig" type: "Sigmoid" bottom: "ip" top: "s" }\n'
     'layer { name: "relu" type: "ReLU" bottom: "s" top: "s" }\n', "Sigmoid reads its top"),
    ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
     'inner_product_param { num_output: 3 } }\n'
     'layer { name: "other" type: "Sigmoid" bottom: "ip" top: "s" }\n'
     'layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }\n', "another reader"),
])
def test_a_relu_keeps_its_own_buffer_where_sharing_would_show(text, why):
    net = build(text)
    relu = next(e for e in net.entries if e.layer.type_name == "ReLU")
    assert relu.tops != relu.bottoms, why


def test_a_relu_on_a_data_layers_top_keeps_its_own_buffer():
    net = build('layer { name: "relu" type: "ReLU" bottom: "data" top: "data" }')
    relu, = net.entries
    assert relu.tops != relu.bottoms   # data blobs are views of the batch: never written


def test_in_place_relus_give_the_bits_of_separate_buffers():
    """Forward and backward of a net whose ReLUs run in place against the same net with each
    ReLU's top renamed (own buffers): the same loss and parameter gradients, bit for bit;
    also where values are exactly 0 (the kink) and negative zero."""
    apart = IN_PLACE
    for relu, blob in (("relu1", "conv"), ("relu2", "pool"), ("relu3", "ip")):
        apart = apart.replace(f'name: "{relu}" type: "ReLU" bottom: "{blob}" top: "{blob}"',
                              f'name: "{relu}" type: "ReLU" bottom: "{blob}" top: "{relu}"')
    apart = (apart.replace('bottom: "conv" top: "pool"', 'bottom: "relu1" top: "pool"')
             .replace('bottom: "pool" top: "ip"', 'bottom: "relu2" top: "ip"')
             .replace('bottom: "ip" bottom: "label"', 'bottom: "relu3" bottom: "label"'))
    shared, separate = build(IN_PLACE), build(apart)
    assert all(e.tops != e.bottoms for e in separate.entries if e.layer.type_name == "ReLU")
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4, 1, 6, 6)).astype(np.float32)
    # Zero rows and a zero bias: conv's first output row is exactly 0 at relu1 (the kink).
    data[:, :, :2] = 0
    data[0, 0, 0, 0] = -0.0
    label = np.array([0, 1, 4, 2], np.float32)
    results = []
    for net in (shared, separate):
        net.init_params(7)
        batch = {net.sources[0].tops[0]: data, net.sources[0].tops[1]: label}
        ws = Workspace(net, 4)
        grads = np.zeros((1, net.n_params), np.float32)
        chunk = Chunk(n=4, batch=4)
        views = net.param_views(net.params)
        out = net.forward(ws, chunk, batch, views)
        loss = out[net.entries[-1].tops[0]].copy()
        net.backward(ws, chunk, out, views, net.param_views(grads))
        results.append((net.params.copy(), loss, grads))
    (p1, l1, g1), (p2, l2, g2) = results
    np.testing.assert_array_equal(p1, p2)
    assert l1.tobytes() == l2.tobytes()
    assert g1.tobytes() == g2.tobytes()
    assert np.count_nonzero(g1) > 0.5 * g1.size


def test_param_multipliers_and_sharing():
    net = build('layer { name: "a" type: "InnerProduct" bottom: "data" top: "a" '
                'param { name: "w" lr_mult: 2 decay_mult: 0 } param { lr_mult: 3 } '
                'inner_product_param { num_output: 3 } }\n'
                'layer { name: "b" type: "InnerProduct" bottom: "data" top: "b" '
                'param { name: "w" } inner_product_param { num_output: 3 bias_term: false } }\n'
                'layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }\n'
                'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" top: "loss" }')
    assert net.n_params == 3 * 36 + 3  # b's weight is a's
    w, bias = net.blob_param("a")
    assert net.blob_param("b")[0] is w
    assert np.all(net.lr_mult[:w.size] == 2) and np.all(net.decay_mult[:w.size] == 0)
    assert np.all(net.lr_mult[bias.offset:] == 3)


def test_shared_gradients_add_up():
    """A blob shared by two layers gets the sum of both gradients (Caffe's sharing)."""
    text = ('layer { name: "a" type: "InnerProduct" bottom: "data" top: "a" param { name: "w" } '
            'inner_product_param { num_output: 3 bias_term: false weight_filler { type: "gaussian" } } }\n'
            'layer { name: "b" type: "InnerProduct" bottom: "data" top: "b" param { name: "w" } '
            'inner_product_param { num_output: 3 bias_term: false } }\n'
            'layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" top: "loss" }')
    net = build(text)
    net.init_params(3)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4, 1, 6, 6)).astype(np.float32)
    label = np.array([0, 1, 2, 1], np.float32)
    batch = {net.sources[0].tops[0]: data, net.sources[0].tops[1]: label}
    ws = Workspace(net, 4)
    grads = np.zeros((1, net.n_params), np.float32)   # one part
    chunk = Chunk(n=4, batch=4)
    views = net.param_views(net.params)
    out = net.forward(ws, chunk, batch, views)
    net.backward(ws, chunk, out, views, net.param_views(grads))
    # d loss / d W = 2 * (p - onehot)^T x / N, since s = 2 W x
    w = net.params.reshape(3, 36).astype(np.float64)
    x = data.reshape(4, 36).astype(np.float64)
    s = 2 * x @ w.T
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(4), label.astype(int)] -= 1
    np.testing.assert_allclose(grads.reshape(3, 36), 2 * p.T @ x / 4, rtol=1e-4, atol=1e-6)


def test_phase_and_stage_rules():
    text = ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
            'inner_product_param { num_output: 3 } }\n'
            'layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" '
            'include { phase: TEST } }\n'
            'layer { name: "extra" type: "ReLU" bottom: "ip" top: "r" include { stage: "deep" } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" '
            'exclude { phase: TEST } }')
    names = lambda net: [e.layer.name for e in net.entries if e.layer.type_name != "Split"]
    assert names(build(text)) == ["ip", "loss"]
    assert names(build(text, caffe_pb2.TEST)) == ["ip", "acc"]
    assert names(build(text, stages=("deep",))) == ["ip", "extra", "loss"]


def test_unknown_layer_type_names_supported_ones():
    with pytest.raises(NetError) as e:
        build('layer { name: "rnn" type: "LSTM" bottom: "data" top: "rnn" }')
    message = str(e.value)
    assert "'rnn'" in message and "LSTM" in message
    for name in ("Convolution", "Pooling", "InnerProduct", "SoftmaxWithLoss", "LRN", "Dropout"):
        assert name in message


def test_missing_bottom_is_named():
    with pytest.raises(NetError, match=r"layer 'r'.*bottom blob 'nope'"):
        build('layer { name: "r" type: "ReLU" bottom: "nope" top: "r" }')


def test_shape_mismatch_names_layer_and_shapes():
    with pytest.raises(NetError) as e:
        build('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
              'inner_product_param { num_output: 3 } }\n'
              'layer { name: "sum" type: "Eltwise" bottom: "data" bottom: "ip" top: "s" }')
    message = str(e.value)
    assert "'sum'" in message and "(4, 1, 6, 6)" in message and "(4, 3)" in message


def test_batch_size_disagreement():
    with pytest.raises(NetError, match="batch size"):
        build('layer { name: "in2" type: "Input" top: "other" '
              'input_param { shape { dim: 5 dim: 2 } } }')


def test_legacy_input_fields_become_an_input_layer():
    """Upgraded as Caffe does, whether read from text or built in code."""
    param = parse_net('input: "data" input_dim: 1 input_dim: 1 input_dim: 4 input_dim: 4',
                      "old.prototxt", log=lambda line: None)
    coded = caffe_pb2.NetParameter(input=["data"], input_dim=[1, 1, 4, 4])
    for net in (Net(param, caffe_pb2.TEST), Net(coded, caffe_pb2.TEST)):
        assert [e.layer.name for e in net.sources] == ["input"]
        assert net.blob_shapes == [(1, 1, 4, 4)]
    assert coded.input          # the caller's message is left as it was


def test_part_span_views_every_part():
    from cgp.layers import base
    grads = np.zeros((4, 30), np.float32)
    parts = grads[1:4, 5:17].reshape(3, 3, 4)     # three parts, 30 elements apart
    span, step = base.part_span(parts)
    assert step == 30 and span.shape == (2 * 30 + 12,)
    span[2 * 30 + 11] = 7                           # the last element of the last part
    assert parts[2, 2, 3] == 7 and np.shares_memory(span, grads)
    with pytest.raises(ValueError, match="C-contiguous"):
        base.part_span(grads[:, ::2].reshape(4, 15)[:, :3])


# Every kind of layer that hands its kernel calls over (Convolution, LRN, Pooling with its
# mask top, ReLU, Concat, Eltwise, Flatten, InnerProduct, Split behind the two readers of
# "flat") and Dropout, which is called each time with its iteration and seed.
BOUND = ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
         'convolution_param { num_output: 4 kernel_size: 3 pad: 1 '
         'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } } }\n'
         'layer { name: "lrn" type: "LRN" bottom: "conv" top: "lrn" lrn_param { local_size: 3 } }\n'
         'layer { name: "pool" type: "Pooling" bottom: "lrn" top: "pool" top: "mask" '
         'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
         'layer { name: "relu" type: "ReLU" bottom: "pool" top: "pool" }\n'
         'layer { name: "cat" type: "Concat" bottom: "pool" bottom: "mask" top: "cat" }\n'
         'layer { name: "flat" type: "Flatten" bottom: "cat" top: "flat" }\n'
         'layer { name: "drop" type: "Dropout" bottom: "flat" top: "drop" }\n'
         'layer { name: "sum" type: "Eltwise" bottom: "drop" bottom: "flat" top: "sum" }\n'
         'layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip" '
         'inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }\n'
         'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }')


def test_bound_calls_read_the_arrays_at_each_call():
    """A BoundCall keeps its layers' kernel calls and their arrays, never their values: run
    again after the inputs, the parameters and the iteration have changed, it gives the bits
    of a call bound then, for forward's tops, the loss and every gradient."""
    net = build(BOUND)
    assert sum(e.layer.type_name == "Split" for e in net.entries) == 1
    net.init_params(5)
    rng = np.random.default_rng(3)
    inputs = {net.sources[0].tops[0]: np.zeros((4, 1, 6, 6), np.float32),
              net.sources[0].tops[1]: np.zeros(4, np.float32)}
    ws, again_ws = Workspace(net, 4), Workspace(net, 4)
    grads, again_grads = np.zeros((2, net.n_params), np.float32)
    views = net.param_views(net.params)

    def chunk(iteration):
        return Chunk(n=4, batch=4, iteration=iteration, seed=11)
    masks = []
    kept = net.bind(ws, chunk(0), net.call_views(ws, chunk(0), inputs), views,
                    net.param_views(grads[None]))
    for iteration in range(3):
        inputs[net.sources[0].tops[0]][...] = rng.standard_normal((4, 1, 6, 6))
        inputs[net.sources[0].tops[1]][...] = rng.integers(0, 5, 4)
        net.params[...] = rng.standard_normal(net.n_params) * 0.3
        grads[...] = again_grads[...] = 0
        kept.forward(chunk(iteration))
        kept.backward(chunk(iteration))
        fresh = net.bind(again_ws, chunk(iteration),
                         net.call_views(again_ws, chunk(iteration), inputs), views,
                         net.param_views(again_grads[None]))
        fresh.forward(chunk(iteration))
        fresh.backward(chunk(iteration))
        for blob in range(len(net.blob_names)):
            if kept.data[blob] is not None:
                assert kept.data[blob].tobytes() == fresh.data[blob].tobytes(), blob
        assert grads.tobytes() == again_grads.tobytes()
        assert np.count_nonzero(grads) > 0.5 * grads.size
        masks.append(kept.data[net.blob_names.index("drop")] != 0)
    assert not np.array_equal(masks[0], masks[1])   # Dropout drew each iteration's own


def test_a_bound_call_refuses_a_call_of_another_layout():
    net = build(BOUND)
    ws = Workspace(net, 4, parts=2, part_max=2)
    inputs = {t: np.zeros(net.blob_shapes[t], np.float32) for t in net.sources[0].tops}
    bound_for = Chunk(n=4, batch=4, part_starts=(0, 2, 4))
    bound = net.bind(ws, bound_for, net.call_views(ws, bound_for, inputs),
                     net.param_views(net.params))
    bound.forward(Chunk(n=4, batch=4, iteration=9, part_starts=(0, 2, 4)))   # its own layout
    for other in (Chunk(n=4, batch=4), Chunk(n=3, batch=4, part_starts=(0, 2, 3)),
                  Chunk(n=4, first=4, batch=8, part_starts=(0, 2, 4))):
        with pytest.raises(ValueError, match="bound for"):
            bound.forward(other)


def test_readme_lists_the_supported_layers():
    """README's list of layers (Known limitations) is the registry's."""
    from pathlib import Path

    from cgp.layers import supported_types
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [entry] = [part for part in readme.split("\n- ") if part.startswith("Layers: ")]
    listed = entry.split(". A net")[0].removeprefix("Layers: ").replace("\n", " ")
    names = [name.split(" (")[0].strip() for name in listed.split(",")]
    assert names == supported_types()
