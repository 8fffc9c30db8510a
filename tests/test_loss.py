"""Softmax, SoftmaxWithLoss and Accuracy against float64 NumPy references, gradient checks,
split invariance (shares add up; gradients bitwise), and Caffe's label rules: normalisation
modes, ignore_label with the batch's labels, out-of-range labels, top-k ties."""
import numpy as np
import pytest

from cgp.errors import NetError
from cgp.layers import Chunk, alloc_scratch
from layer_check import (backward, build, check_forward, check_gradients,
                         check_split_invariance, forward)

# (scores shape, labels shape, class axis): one label per sample; one per pixel; class axis 2.
CASES = [((5, 4), (5,), 1), ((2, 3, 2, 2), (2, 1, 2, 2), 1), ((2, 3, 4), (2, 3), 2)]


def scores_and_labels(scores_shape, labels_shape, axis, seed=0, ignore=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(scores_shape) * 2
    classes = scores_shape[axis]
    labels = rng.integers(0, classes, labels_shape).astype(np.float64)
    if ignore is not None:
        labels.reshape(-1)[::3] = ignore   # every third position ignored, samples 0 and 1 included
    return x, labels


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rows(x, axis):
    """One row of class scores per position, positions in (outer, inner) order."""
    return np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])


def loss_ref(x, labels, axis, mode, ignore=None):
    p = rows(softmax_ref(x, axis), axis)
    lab = labels.reshape(-1).astype(int)
    keep = lab != ignore if ignore is not None else np.ones(lab.size, bool)
    loss = -np.log(p[np.flatnonzero(keep), lab[keep]]).sum()
    normaliser = {"FULL": lab.size, "VALID": keep.sum(), "BATCH_SIZE": int(np.prod(x.shape[:axis])),
                  "NONE": 1}[mode]
    return loss / max(1, normaliser)


def loss_text(axis=1, loss_param="", tops=1):
    top = 'top: "loss"' + (' top: "prob"' if tops > 1 else "")
    return (f'type: "SoftmaxWithLoss" bottom: "score" bottom: "label" {top} '
            f'softmax_param {{ axis: {axis} }} loss_param {{ {loss_param} }}')


# ---------------------------------------------------------------------------------------- Softmax
@pytest.mark.parametrize("shape, axis", [((3, 5), 1), ((2, 4, 3), 1), ((2, 3, 4), -1)])
def test_softmax_forward(shape, axis):
    layer = build(f'type: "Softmax" bottom: "x" top: "y" softmax_param {{ axis: {axis} }}', [shape])
    x = np.random.default_rng(0).standard_normal(shape) * 3
    check_forward(layer, [x], lambda x: softmax_ref(x, axis), params=[])
    # Large scores: the subtracted maximum keeps exp finite.
    check_forward(layer, [x * 30 + 500], lambda x: softmax_ref(x, axis), params=[])


@pytest.mark.parametrize("shape, axis", [((2, 4, 3), 1), ((2, 3, 4), 2)])
def test_softmax_gradients(shape, axis):
    layer = build(f'type: "Softmax" bottom: "x" top: "y" softmax_param {{ axis: {axis} }}', [shape])
    check_gradients(layer, [np.random.default_rng(1).standard_normal(shape)], params=[])


def test_softmax_split_invariance():
    layer = build('type: "Softmax" bottom: "x" top: "y"', [(5, 4, 3)])
    check_split_invariance(layer, [np.random.default_rng(2).standard_normal((5, 4, 3))], params=[])


def test_softmax_refuses_batch_axis():
    with pytest.raises(NetError, match="batch axis"):
        build('type: "Softmax" bottom: "x" top: "y" softmax_param { axis: 0 }', [(2, 3)])


# ------------------------------------------------------------------------------- SoftmaxWithLoss
@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("scores_shape, labels_shape, axis", CASES)
def test_loss_forward(mode, scores_shape, labels_shape, axis):
    x, labels = scores_and_labels(scores_shape, labels_shape, axis)
    layer = build(loss_text(axis, f"normalization: {mode}"), [scores_shape, labels_shape])
    assert layer.top_shapes == [()]
    check_forward(layer, [x, labels], lambda x, l: loss_ref(x, l, axis, mode), params=[])


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_loss_forward_ignore_label(mode):
    x, labels = scores_and_labels((2, 3, 2, 2), (2, 1, 2, 2), 1, ignore=2)
    layer = build(loss_text(1, f"normalization: {mode} ignore_label: 2"), [x.shape, labels.shape])
    chunk = Chunk(n=2, batch_tops={"label": labels})
    check_forward(layer, [x, labels], lambda x, l: loss_ref(x, l, 1, mode, ignore=2), params=[],
                  chunk=chunk)


@pytest.mark.parametrize("loss_param, mode", [
    ("", "VALID"),                                       # Caffe's default
    ("normalize: false", "BATCH_SIZE"),                  # the old switch, off
    ("normalize: true", "VALID"),                        # the old switch, on
    ("normalize: false normalization: FULL", "FULL"),    # normalization wins when both are set
])
def test_loss_legacy_normalize(loss_param, mode):
    x, labels = scores_and_labels((2, 3, 2, 2), (2, 1, 2, 2), 1)
    layer = build(loss_text(1, loss_param), [x.shape, labels.shape])
    check_forward(layer, [x, labels], lambda x, l: loss_ref(x, l, 1, mode), params=[])


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, 1])
def test_loss_gradients(mode, ignore):
    x, labels = scores_and_labels((2, 3, 2, 2), (2, 1, 2, 2), 1, seed=3, ignore=ignore)
    param = f"normalization: {mode}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    layer = build(loss_text(1, param), [x.shape, labels.shape])
    chunk = Chunk(n=2, batch_tops={"label": labels})
    check_gradients(layer, [x, labels], params=[], check=[True, False], chunk=chunk)
    if ignore is not None:
        # Ignored positions get no gradient at all.
        _, diffs, _ = backward(layer, [x, labels], [], [np.array(1.0)], chunk, [True, False])
        ignored = np.broadcast_to(labels == ignore, x.shape)
        assert np.all(diffs[0][ignored] == 0) and np.any(diffs[0][~ignored] != 0)


def test_loss_gradient_class_axis_2():
    x, labels = scores_and_labels((2, 3, 4), (2, 3), 2, seed=4)
    layer = build(loss_text(2), [x.shape, labels.shape])
    check_gradients(layer, [x, labels], params=[], check=[True, False])


def test_loss_probability_top():
    x, labels = scores_and_labels((4, 3, 2), (4, 2), 1)
    layer = build(loss_text(1, tops=2), [x.shape, labels.shape])
    assert layer.top_shapes == [(), (4, 3, 2)]
    check_forward(layer, [x, labels], lambda x, l: (loss_ref(x, l, 1, "VALID"), softmax_ref(x, 1)),
                  params=[])
    check_split_invariance(layer, [x, labels], params=[], cut=1)


@pytest.mark.parametrize("loss_param", ["normalization: VALID ignore_label: 2",
                                        "normalization: FULL", "normalization: BATCH_SIZE"])
def test_loss_split_invariance(loss_param):
    x, labels = scores_and_labels((5, 3, 2, 2), (5, 1, 2, 2), 1, seed=5, ignore=2)
    layer = build(loss_text(1, loss_param), [x.shape, labels.shape])
    kw = {"batch_tops": {"label": labels.astype(np.float32)}}
    check_split_invariance(layer, [x, labels], params=[], cut=2, chunk_kw=kw)

    # The gradient of each sample does not depend on the split, bitwise.
    x32, l32 = x.astype(np.float32), labels.astype(np.float32)
    one = [np.array(1.0, np.float32)]
    _, whole, _ = backward(layer, [x32, l32], [], one, Chunk(n=5, batch=5, **kw), [True, False])
    parts = [backward(layer, [x32[lo:hi], l32[lo:hi]], [], one,
                      Chunk(n=hi - lo, first=lo, batch=5, **kw), [True, False])[1][0]
             for lo, hi in ((0, 2), (2, 5))]
    assert np.array_equal(np.concatenate(parts), whole[0])


@pytest.mark.parametrize("loss_param, tops", [("normalization: VALID ignore_label: 2", 1),
                                              ("normalization: FULL", 2)])
def test_loss_takes_a_calls_parts_at_once(loss_param, tops):
    """forward_parts / backward_parts over a call of three parts (samples 1-2, 3-5, 6 of a
    batch of 7) give each part's loss share, probabilities and input gradient bitwise as a
    call of that part alone, with a different top diff per part."""
    x, labels = scores_and_labels((7, 3, 2, 2), (7, 1, 2, 2), 1, seed=6, ignore=2)
    x, labels = x.astype(np.float32), labels.astype(np.float32)
    layer = build(loss_text(1, loss_param, tops), [x.shape, labels.shape])
    kw = {"batch": 7, "batch_tops": {"label": labels}}
    cuts = (1, 3, 6, 7)
    call = Chunk(n=6, first=1, part_starts=tuple(c - 1 for c in cuts), **kw)
    top_diff = np.array([1.0, 0.5, 3.0], np.float32)
    out = [np.zeros(3, np.float32)] + ([np.zeros((3,) + x.shape, np.float32)] if tops > 1 else [])
    scratch = alloc_scratch(layer, 6, np.float32)
    bottom = [x[1:], labels[1:]]
    layer.forward_parts(bottom, out, [], scratch, call)
    dx = np.full_like(x[1:], 7.0)
    layer.backward_parts(out, [top_diff] + out[1:], bottom, [dx, None], [], [], scratch, call)
    for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        part = Chunk(n=hi - lo, first=lo, **kw)
        own, own_dx, _ = backward(layer, [x[lo:hi], labels[lo:hi]], [], [top_diff[k:k + 1][0]],
                                  part, [True, False])
        assert out[0][k] == own[0]
        if tops > 1:
            assert np.array_equal(out[1][k], own[1])
        assert np.array_equal(dx[lo - 1:hi - 1], own_dx[0])
    # A bad label in the second part: the error names its sample of the batch.
    labels[4, 0, 1, 0] = 9
    with pytest.raises(NetError, match=r"sample 4 of the batch, position 2"):
        layer.forward_parts(bottom, out, [], scratch, call)


def test_loss_all_ignored():
    # Caffe's normaliser is at least 1: no labels means loss 0 and no gradient, not NaN.
    x, labels = scores_and_labels((2, 3), (2,), 1)
    labels[:] = 7
    layer = build(loss_text(1, "ignore_label: 7"), [x.shape, labels.shape])
    chunk = Chunk(n=2, batch_tops={"label": labels})
    tops, diffs, _ = backward(layer, [x, labels], [], [np.array(1.0)], chunk, [True, False])
    assert tops[0] == 0 and np.all(diffs[0] == 0)


def test_loss_valid_ignore_needs_batch_labels():
    x, labels = scores_and_labels((2, 3), (2,), 1)
    layer = build(loss_text(1, "ignore_label: 0"), [x.shape, labels.shape])
    with pytest.raises(NetError, match="data layer"):
        forward(layer, [x, labels], [])
    # Other normalisations count positions, not labels: no batch labels needed.
    layer = build(loss_text(1, "ignore_label: 0 normalization: FULL"), [x.shape, labels.shape])
    forward(layer, [x, labels], [])


@pytest.mark.parametrize("bad", [3.0, -1.0, np.nan, 1e12])
def test_loss_refuses_bad_label(bad):
    x, labels = scores_and_labels((4, 3), (4,), 1)
    labels[2] = bad
    layer = build(loss_text(1), [x.shape, labels.shape])
    # The chunk holds samples 1 and 2 of the batch; the message names the batch's sample.
    with pytest.raises(NetError, match=r"sample 2 of the batch.*\[0, 3\)"):
        forward(layer, [x[1:3], labels[1:3]], [], Chunk(n=2, first=1, batch=4))


def test_loss_ignored_label_may_be_out_of_range():
    x, labels = scores_and_labels((4, 3), (4,), 1)
    labels[1] = 255
    layer = build(loss_text(1, "ignore_label: 255"), [x.shape, labels.shape])
    check_forward(layer, [x, labels], lambda x, l: loss_ref(x, l, 1, "VALID", ignore=255),
                  params=[], chunk=Chunk(n=4, batch_tops={"label": labels}))


def test_loss_refuses_label_gradient():
    x, labels = scores_and_labels((2, 3), (2,), 1)
    layer = build(loss_text(1), [x.shape, labels.shape])
    with pytest.raises(NetError, match="labels"):
        backward(layer, [x, labels], [], [np.array(1.0)])


@pytest.mark.parametrize("text, shapes, message", [
    (loss_text(1), [(2, 3, 2), (2, 3)], "number of labels"),
    (loss_text(1), [(2, 3), (3,)], "first"),
    (loss_text(1, tops=2) + " loss_weight: 1 loss_weight: 0.5", [(2, 3), (2,)], "loss_weight"),
    (loss_text(0), [(2, 3), (2,)], "batch axis"),
])
def test_loss_refused(text, shapes, message):
    with pytest.raises(NetError, match=message):
        build(text, shapes)


# -------------------------------------------------------------------------------------- Accuracy
def accuracy_text(top_k=1, axis=1, extra="", tops=1):
    top = 'top: "accuracy"' + (' top: "per_class"' if tops > 1 else "")
    return (f'type: "Accuracy" bottom: "score" bottom: "label" {top} '
            f'accuracy_param {{ top_k: {top_k} axis: {axis} {extra} }}')


def accuracy_ref(x, labels, axis, top_k, ignore=None):
    """Correct when fewer than top_k *other* classes score at least as high as the label."""
    classes = x.shape[axis]
    hits, seen = np.zeros(classes), np.zeros(classes)
    for row, label in zip(rows(x, axis), labels.reshape(-1).astype(int)):
        if label == ignore:
            continue
        seen[label] += 1
        hits[label] += np.sum(np.delete(row, label) >= row[label]) < top_k
    total = hits.sum() / seen.sum() if seen.sum() else 0.0
    per_class = np.divide(hits, seen, out=np.zeros(classes), where=seen > 0)
    return total, per_class


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("scores_shape, labels_shape, axis", CASES)
def test_accuracy_forward(top_k, scores_shape, labels_shape, axis):
    top_k = min(top_k, scores_shape[axis])
    x, labels = scores_and_labels(scores_shape, labels_shape, axis, seed=6)
    layer = build(accuracy_text(top_k, axis), [scores_shape, labels_shape])
    assert layer.top_shapes == [()]
    check_forward(layer, [x, labels], lambda x, l: accuracy_ref(x, l, axis, top_k)[0], params=[])


@pytest.mark.parametrize("top_k, want", [(1, 0.25), (2, 0.75), (3, 0.75), (4, 1.0)])
def test_accuracy_ties(top_k, want):
    # A tie with another class counts against the label (Caffe compares with >=).
    x = np.array([[1, 2, 2, 0],     # label 1 ties with class 2: rank 2
                  [3, 3, 1, 0],     # label 0 ties with class 1: rank 2
                  [0, 1, 2, 3],     # label 3 is the unique maximum: rank 1
                  [5, 5, 5, 5]], float)   # label 2 ties with all: rank 4
    labels = np.array([1, 0, 3, 2], float)
    layer = build(accuracy_text(top_k), [x.shape, labels.shape])
    check_forward(layer, [x, labels], lambda x, l: want, params=[])


def test_accuracy_per_class_and_ignore():
    x, labels = scores_and_labels((6, 4, 3), (6, 3), 1, seed=7, ignore=3)
    layer = build(accuracy_text(2, extra="ignore_label: 3", tops=2), [x.shape, labels.shape])
    assert layer.top_shapes == [(), (4,)]
    kw = {"batch_tops": {"label": labels}}
    check_forward(layer, [x, labels], lambda x, l: accuracy_ref(x, l, 1, 2, ignore=3),
                  params=[], chunk=Chunk(n=6, **kw))
    check_split_invariance(layer, [x, labels], params=[], cut=4, chunk_kw=kw)


def test_accuracy_split_invariance():
    x, labels = scores_and_labels((5, 4), (5,), 1, seed=8)
    check_split_invariance(build(accuracy_text(2), [x.shape, labels.shape]), [x, labels], params=[])


def test_accuracy_needs_batch_labels():
    x, labels = scores_and_labels((2, 3), (2,), 1)
    for text in (accuracy_text(extra="ignore_label: 0"), accuracy_text(tops=2)):
        with pytest.raises(NetError, match="data layer"):
            forward(build(text, [x.shape, labels.shape]), [x, labels], [])


def test_accuracy_refuses_bad_label():
    x, labels = scores_and_labels((3, 4), (3,), 1)
    labels[1] = 4
    with pytest.raises(NetError, match=r"label 4 \(sample 1"):
        forward(build(accuracy_text(), [x.shape, labels.shape]), [x, labels], [])


def test_accuracy_backward_does_nothing():
    x, labels = scores_and_labels((2, 3), (2,), 1)
    layer = build(accuracy_text(), [x.shape, labels.shape])
    tops, _ = forward(layer, [x, labels], [])
    layer.backward(tops, [np.zeros(())], [x, labels], [None, None], [], [], {}, Chunk(n=2))


@pytest.mark.parametrize("text, shapes, message", [
    (accuracy_text(4), [(2, 3), (2,)], "top_k"),
    (accuracy_text(0), [(2, 3), (2,)], "top_k"),
    (accuracy_text(), [(2, 3, 2), (2, 3)], "number of labels"),
])
def test_accuracy_refused(text, shapes, message):
    with pytest.raises(NetError, match=message):
        build(text, shapes)
