"""The layer contract (cgp/layers/base.py): `engine:` is a hint cgp ignores."""
import numpy as np
import pytest

from layer_check import backward, build, random_params

SHAPE = (2, 3, 4, 4)
# Layer text with {} where the engine goes, and its bottom shapes.
ENGINES = {
    "Convolution": ('type: "Convolution" bottom: "x" top: "y" '
                    'convolution_param { num_output: 2 kernel_size: 3 {} }', [SHAPE]),
    "LRN": ('type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 {} }', [SHAPE]),
    "LRN within": ('type: "LRN" bottom: "x" top: "y" '
                   'lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL {} }', [SHAPE]),
    "Pooling": ('type: "Pooling" bottom: "x" top: "y" '
                'pooling_param { pool: MAX kernel_size: 2 stride: 2 {} }', [SHAPE]),
    "ReLU": ('type: "ReLU" bottom: "x" top: "y" relu_param { {} }', [SHAPE]),
    "Sigmoid": ('type: "Sigmoid" bottom: "x" top: "y" sigmoid_param { {} }', [SHAPE]),
    "TanH": ('type: "TanH" bottom: "x" top: "y" tanh_param { {} }', [SHAPE]),
    "Softmax": ('type: "Softmax" bottom: "x" top: "y" softmax_param { {} }', [SHAPE]),
    "SoftmaxWithLoss": ('type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss" '
                        'softmax_param { {} }', [(2, 3), (2,)]),
}


@pytest.mark.parametrize("engine", ["DEFAULT", "CAFFE", "CUDNN"])
@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_engine_is_a_hint_cgp_ignores(kind, engine):
    """Any engine builds the layer and gives the bits of the layer without one."""
    text, shapes = ENGINES[kind]
    plain = build(text.replace("{}", ""), shapes)
    hinted = build(text.replace("{}", f"engine: {engine}"), shapes)
    rng = np.random.default_rng(2)
    bottom = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if kind == "SoftmaxWithLoss":
        bottom[1] = np.array([0, 2], np.float32)
    params = random_params(plain, np.float32)
    top_diff = [rng.standard_normal(s if plain.reduces_batch else (shapes[0][0],) + s[1:])
                .astype(np.float32) for s in plain.top_shapes]
    propagate = [True] + [False] * (len(shapes) - 1)
    want = backward(plain, bottom, params, top_diff, propagate=propagate)
    got = backward(hinted, bottom, params, top_diff, propagate=propagate)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert (a is None and b is None) or a.tobytes() == b.tobytes()
