"""EuclideanLoss, SigmoidCrossEntropyLoss, HingeLoss, InfogainLoss and ContrastiveLoss against
float64 NumPy references, finite differences (away from the hinges' kinks) and batch splits
(each chunk's share of the global batch's value), plus Caffe's rules."""
import numpy as np
import pytest

from cgp.errors import CgpError, NetError
from cgp.layers import Chunk
from cgp.proto import caffe_pb2
from cgp.snapshot import array_to_blob
from layer_check import backward, build, check_forward, check_gradients, check_split_invariance


def data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# -- EuclideanLoss -----------------------------------------------------------------------------

def test_euclidean():
    layer = build('type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss"',
                  [(4, 3, 2), (4, 6)])
    assert layer.top_shapes == [()] and layer.default_loss_weight == 1
    a, b = data((4, 3, 2)), data((4, 6), 1)
    check_forward(layer, [a, b], lambda a, b: ((a.reshape(4, -1) - b) ** 2).sum() / 4 / 2,
                  params=[])
    check_gradients(layer, [a, b], params=[])
    check_split_invariance(layer, [a, b], params=[], cut=1)


def test_euclidean_refuses_other_sizes():
    with pytest.raises(NetError, match="same dimension"):
        build('type: "EuclideanLoss" bottom: "a" bottom: "b" top: "l"', [(4, 3), (4, 2)])


# -- SigmoidCrossEntropyLoss -------------------------------------------------------------------

def sce_ref(mode, ignore=None):
    def reference(x, t):
        t = t.reshape(x.shape)
        keep = np.ones(x.shape, bool) if ignore is None else t.astype(int) != ignore
        p = 1 / (1 + np.exp(-x))
        loss = -(t * np.log(p) + (1 - t) * np.log(1 - p))[keep].sum()
        norm = {"FULL": x.size, "VALID": keep.sum(), "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
        return loss / max(1, norm)
    return reference


def sce_text(loss_param=""):
    return (f'type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" top: "loss" '
            f'loss_param {{ {loss_param} }}')


def targets(shape, seed=1, ignore=None):
    t = np.random.default_rng(seed).uniform(0, 1, shape)
    if ignore is not None:
        t.reshape(-1)[::3] = ignore
    return t


@pytest.mark.parametrize("loss_param, mode", [
    ("", "BATCH_SIZE"), ("normalization: FULL", "FULL"), ("normalization: NONE", "NONE"),
    ("normalize: true", "VALID"), ("normalization: VALID", "VALID"),
])
def test_sigmoid_cross_entropy(loss_param, mode):
    layer = build(sce_text(loss_param), [(4, 3, 2), (4, 6)])
    x, t = data((4, 3, 2)) * 4, targets((4, 6))
    check_forward(layer, [x, t], sce_ref(mode), params=[])
    check_gradients(layer, [x, t], params=[], check=[True, False])
    check_split_invariance(layer, [x, t], params=[], cut=1)


@pytest.mark.parametrize("mode", ["VALID", "FULL", "BATCH_SIZE"])
def test_sigmoid_cross_entropy_ignores_a_label(mode):
    layer = build(sce_text(f"normalization: {mode} ignore_label: -1"), [(4, 5), (4, 5)])
    x, t = data((4, 5)), targets((4, 5), ignore=-1)
    kw = {"batch_tops": {"t": t.astype(np.float32)}}
    check_forward(layer, [x, t], sce_ref(mode, -1), params=[], chunk=Chunk(n=4, **kw))
    check_gradients(layer, [x, t], params=[], check=[True, False], chunk=Chunk(n=4, **kw))
    check_split_invariance(layer, [x, t], params=[], cut=3, chunk_kw=kw)
    _, (dx, _), _ = backward(layer, [x, t], [], [np.array(1.0)], Chunk(n=4, **kw),
                             [True, False])
    assert np.all(dx[t == -1] == 0) and np.all(dx[t != -1] != 0)


def test_sigmoid_cross_entropy_large_scores_stay_finite():
    layer = build(sce_text("normalization: NONE"), [(1, 4), (1, 4)])
    x = np.array([[-200.0, -50.0, 50.0, 200.0]], np.float32)
    t = np.array([[0.0, 1.0, 0.0, 1.0]], np.float32)
    with np.errstate(all="raise"):
        tops, (dx, _), _ = backward(layer, [x, t], [], [np.array(1.0, np.float32)],
                                    propagate=[True, False])
    np.testing.assert_allclose(tops[0], 100.0, rtol=1e-6)
    np.testing.assert_allclose(dx, [[0, -1, 1, 0]], atol=1e-20)


def test_sigmoid_cross_entropy_valid_ignore_needs_data_targets():
    layer = build(sce_text("normalization: VALID ignore_label: -1"), [(2, 3), (2, 3)])
    with pytest.raises(NetError, match="data layer"):
        check_forward(layer, [data((2, 3)), targets((2, 3))], sce_ref("VALID"), params=[])


# -- HingeLoss ---------------------------------------------------------------------------------

def hinge_ref(l2):
    def reference(x, labels):
        rows = x.reshape(len(x), -1)
        s = np.ones_like(rows)
        s[np.arange(len(x)), labels.astype(int).ravel()] = -1
        m = np.maximum(0, 1 + s * rows)
        return (m * m if l2 else m).sum() / len(x)
    return reference


def hinge_scores(shape, labels, seed=0):
    """Scores whose margins 1 + s x stay 0.1 or more from the kink at 0."""
    x = data(shape, seed).reshape(len(labels), -1)
    s = np.ones_like(x)
    s[np.arange(len(x)), labels.astype(int)] = -1
    margin = 1 + s * x
    x += s * np.where(np.abs(margin) < 0.1, 0.2, 0.0)
    return x.reshape(shape)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge(norm):
    layer = build(f'type: "HingeLoss" bottom: "x" bottom: "l" top: "loss" '
                  f'hinge_loss_param {{ norm: {norm} }}', [(5, 2, 2), (5,)])
    labels = np.array([0, 3, 1, 2, 3], float)
    x = hinge_scores((5, 2, 2), labels)
    check_forward(layer, [x, labels], hinge_ref(norm == "L2"), params=[])
    check_gradients(layer, [x, labels], params=[], check=[True, False])
    check_split_invariance(layer, [x, labels], params=[], cut=2)


@pytest.mark.parametrize("bad", [4.0, -1.0, np.nan])
def test_hinge_refuses_a_label_that_is_no_class(bad):
    layer = build('type: "HingeLoss" bottom: "x" bottom: "l" top: "loss"', [(3, 4), (3, 1)])
    labels = np.array([[0.0], [bad], [1.0]])
    with pytest.raises(NetError, match=r"sample 1 of the batch\) is not a class.*\[0, 4\)"):
        check_forward(layer, [data((2, 4)), labels[1:]], hinge_ref(False), params=[],
                      chunk=Chunk(n=2, first=1, batch=3))
    with pytest.raises(NetError, match="one label per sample"):
        build('type: "HingeLoss" bottom: "x" bottom: "l" top: "loss"', [(3, 4), (3, 2)])


# -- InfogainLoss ------------------------------------------------------------------------------

def infogain_ref(H, mode="VALID", ignore=None, axis=1):
    def reference(x, labels, *rest):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        p = np.moveaxis(e / e.sum(axis=axis, keepdims=True), axis, -1).reshape(-1, x.shape[axis])
        lab = labels.reshape(-1).astype(int)
        keep = lab != ignore if ignore is not None else np.ones(lab.size, bool)
        loss = -(H[lab[keep]] * np.log(p[keep])).sum()
        norm = {"VALID": keep.sum(), "FULL": lab.size, "BATCH_SIZE": int(np.prod(x.shape[:axis])),
                "NONE": 1}[mode]
        return loss / max(1, norm)
    return reference


def matrix(C, seed=3):
    return np.random.default_rng(seed).uniform(0, 1, (C, C)) + np.eye(C)


def write_matrix(path, H):
    path.write_bytes(array_to_blob(H.astype(np.float32), caffe_pb2.BlobProto())
                     .SerializeToString())
    return path


@pytest.mark.parametrize("mode", ["VALID", "FULL", "BATCH_SIZE", "NONE"])
def test_infogain_from_a_file(tmp_path, mode):
    H = matrix(3).astype(np.float32).astype(float)
    source = write_matrix(tmp_path / "H.binaryproto", H)
    layer = build(f'type: "InfogainLoss" bottom: "x" bottom: "l" top: "loss" '
                  f'infogain_loss_param {{ source: "{source}" }} '
                  f'loss_param {{ normalization: {mode} }}', [(4, 3, 2), (4, 2)])
    x = data((4, 3, 2))
    labels = np.array([[0, 2], [1, 1], [2, 0], [1, 2]], float)
    check_forward(layer, [x, labels], infogain_ref(H, mode), params=[])
    check_gradients(layer, [x, labels], params=[], check=[True, False])
    check_split_invariance(layer, [x, labels], params=[], cut=1)


def test_infogain_from_a_third_bottom_with_ignore_and_probabilities():
    H = matrix(4)
    layer = build('type: "InfogainLoss" bottom: "x" bottom: "l" bottom: "H" top: "loss" '
                  'top: "prob" loss_param { ignore_label: 3 }', [(6, 4), (6,), (2, 8)])
    x, labels = data((6, 4)), np.array([0, 3, 1, 2, 3, 0], float)
    kw = {"batch_tops": {"l": labels, "H": H.reshape(2, 8)}}
    e = np.exp(x - x.max(1, keepdims=True))
    check_forward(layer, [x, labels, H.reshape(2, 8)],
                  lambda *b: (infogain_ref(H, ignore=3)(*b), e / e.sum(1, keepdims=True)),
                  params=[], chunk=Chunk(n=6, **kw))
    check_split_invariance(layer, [x, labels, H.reshape(2, 8)], params=[], cut=2, chunk_kw=kw)
    # The gradient is the loss top's alone (Caffe's): checked with that top only.
    layer = build('type: "InfogainLoss" bottom: "x" bottom: "l" bottom: "H" top: "loss" '
                  'loss_param { ignore_label: 3 }', [(6, 4), (6,), (2, 8)])
    check_gradients(layer, [x, labels, H.reshape(2, 8)], params=[], check=[True, False, False],
                    chunk=Chunk(n=6, **kw))


def test_infogain_with_the_identity_is_softmax_loss():
    """H = I makes the infogain loss the softmax loss, bit for bit in float64."""
    H = np.eye(3)
    infogain = build('type: "InfogainLoss" bottom: "x" bottom: "l" bottom: "H" top: "loss"',
                     [(4, 3), (4,), (3, 3)])
    softmax = build('type: "SoftmaxWithLoss" bottom: "x" bottom: "l" top: "loss"',
                    [(4, 3), (4,)])
    x, labels = data((4, 3)), np.array([0, 2, 1, 1], float)
    chunk = Chunk(n=4, batch_tops={"H": H})
    got = backward(infogain, [x, labels, H], [], [np.array(1.0)], chunk, [True, False, False])
    want = backward(softmax, [x, labels], [], [np.array(1.0)], None, [True, False])
    np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-14)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-12, atol=1e-16)


def test_infogain_refusals(tmp_path):
    shapes = [(2, 3), (2,)]
    with pytest.raises(NetError, match="source must name"):
        build('type: "InfogainLoss" bottom: "x" bottom: "l" top: "loss"', shapes)
    source = write_matrix(tmp_path / "H.binaryproto", np.eye(2))
    with pytest.raises(NetError, match="holds 4 elements, not 3x3"):
        build(f'type: "InfogainLoss" bottom: "x" bottom: "l" top: "loss" '
              f'infogain_loss_param {{ source: "{source}" }}', shapes)
    with pytest.raises(CgpError, match="missing.binaryproto"):
        build('type: "InfogainLoss" bottom: "x" bottom: "l" top: "loss" '
              'infogain_loss_param { source: "missing.binaryproto" }', shapes)
    with pytest.raises(NetError, match="must hold 3x3"):
        build('type: "InfogainLoss" bottom: "x" bottom: "l" bottom: "H" top: "loss"',
              shapes + [(2, 4)])
    with pytest.raises(NetError, match="normalize is deprecated"):
        build('type: "InfogainLoss" bottom: "x" bottom: "l" bottom: "H" top: "loss" '
              'loss_param { normalize: true }', shapes + [(3, 3)])
    layer = build('type: "InfogainLoss" bottom: "x" bottom: "l" bottom: "H" top: "loss"',
                  shapes + [(3, 3)])
    with pytest.raises(NetError, match="data layer's top"):
        check_forward(layer, [data((2, 3)), np.zeros(2), np.eye(3)], lambda *b: 0, params=[])


# -- ContrastiveLoss ---------------------------------------------------------------------------

def contrastive_ref(margin, legacy):
    def reference(a, b, y):
        d2 = ((a - b) ** 2).reshape(len(a), -1).sum(1)
        similar = y.reshape(-1).astype(int) != 0
        far = np.maximum(margin - d2, 0) if legacy else np.maximum(margin - np.sqrt(d2), 0) ** 2
        return np.where(similar, d2, far).sum() / len(a) / 2
    return reference


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 1, 1)])
def test_contrastive(legacy, shape):
    margin = 2.0
    layer = build(f'type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "y" top: "loss" '
                  f'contrastive_loss_param {{ margin: {margin} legacy_version: '
                  f'{str(legacy).lower()} }}', [shape, shape, (6, 1)])
    # Pairs at distances whose margin - d (and margin - d^2) stay clear of the kink at 0,
    # on both sides of it.
    b = data(shape, 1)
    u = data((6, 3), 2)
    dist = np.array([0.5, 1.0, 1.5, 2.5, 3.0, 0.8])
    a = b + (u / np.linalg.norm(u, axis=1, keepdims=True) * dist[:, None]).reshape(shape)
    y = np.array([[1], [0], [0], [1], [0], [0]], float)
    check_forward(layer, [a, b, y], contrastive_ref(margin, legacy), params=[])
    # The new version's gradient guards d with 1e-4, as Caffe's: a near-exact check.
    check_gradients(layer, [a, b, y], params=[], check=[True, True, False], rtol=1e-3)
    check_split_invariance(layer, [a, b, y], params=[], cut=2)


def test_contrastive_refused():
    text = 'type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "y" top: "loss"'
    for shapes, message in (([(2, 3, 2), (2, 3, 2), (2,)], "num, channels"),
                            ([(2, 3), (2, 4), (2,)], "same channels"),
                            ([(2, 3), (2, 3), (2, 2)], "one value per sample")):
        with pytest.raises(NetError, match=message):
            build(text, shapes)
