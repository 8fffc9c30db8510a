"""One harness for every layer test: build a layer from its prototxt text, run it on
plain arrays, compare with a NumPy float64 reference, check gradients against central
finite differences in float64, and check that splitting the batch changes nothing.

A new layer's test is a few lines:

    layer = build('type: "ReLU" bottom: "x" top: "y"', [(2, 3, 4, 4)])
    check_forward(layer, [x], lambda x: np.maximum(x, 0))
    check_gradients(layer, [x])
"""
import numpy as np
from google.protobuf import text_format

from cgp.layers import REGISTRY, Chunk, alloc_scratch
from cgp.proto import caffe_pb2


def build(text, bottom_shapes, phase=caffe_pb2.TRAIN, index=0, name="layer"):
    """Parse one LayerParameter from text (name defaults to 'layer') and set it up."""
    lp = text_format.Parse(text, caffe_pb2.LayerParameter())
    if not lp.name:
        lp.name = name
    layer = REGISTRY[lp.type](lp, index=index, phase=phase)
    layer.top_shapes = [tuple(s) for s in layer.setup([tuple(s) for s in bottom_shapes])]
    layer.bottom_shapes = [tuple(s) for s in bottom_shapes]
    return layer


def rand(shape, seed=0):
    """float64 values that float32 holds exactly, so copies compare exactly."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(float)


def blob_names(field, count):
    """A layer's `count` bottoms or tops (field "bottom" or "top"): 'bottom: "b0" ...'."""
    return " ".join(f'{field}: "{field[0]}{i}"' for i in range(count))


def random_params(layer, dtype=np.float64, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(dtype) for s in layer.param_shapes()]


def _top_shape(layer, shape, n):
    return tuple(shape) if layer.reduces_batch else (n,) + tuple(shape[1:])


def forward(layer, bottom, params, chunk=None):
    """Run forward on arrays whose axis 0 is the chunk; returns (tops, scratch)."""
    n = bottom[0].shape[0]
    dtype = bottom[0].dtype
    chunk = chunk or Chunk(n=n)
    tops = [np.zeros(_top_shape(layer, s, n), dtype) for s in layer.top_shapes]
    scratch = alloc_scratch(layer, n, dtype)
    layer.forward(bottom, tops, params, scratch, chunk)
    return tops, scratch


def backward(layer, bottom, params, top_diff, chunk=None, propagate=None):
    """Forward then backward; returns (tops, bottom_diffs, param_diffs): one gradient per
    parameter blob, or, when the chunk has several parts, (parts,) + the blob's shape."""
    n = bottom[0].shape[0]
    chunk = chunk or Chunk(n=n)
    tops, scratch = forward(layer, bottom, params, chunk)
    propagate = propagate if propagate is not None else [True] * len(bottom)
    # Fill with garbage: input-gradient kernels must overwrite, not add.
    bottom_diff = [np.full_like(b, 7.0) if p else None for b, p in zip(bottom, propagate)]
    param_diff = [np.zeros((chunk.parts,) + p.shape, p.dtype) for p in params]
    layer.backward(tops, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk)
    return tops, bottom_diff, [d[0] for d in param_diff] if chunk.parts == 1 else param_diff


def check_forward(layer, bottom, reference, params=None, rtol=1e-5, atol=1e-6, chunk=None):
    """Run the layer in float32 and compare every top with reference(*bottom, *params)
    computed in float64 (reference returns one array or a tuple of arrays)."""
    params = params if params is not None else random_params(layer)
    b32 = [np.ascontiguousarray(b, np.float32) for b in bottom]
    p32 = [np.ascontiguousarray(p, np.float32) for p in params]
    tops, _ = forward(layer, b32, p32, chunk)
    want = reference(*[np.asarray(b, np.float64) for b in bottom],
                     *[np.asarray(p, np.float64) for p in params])
    want = want if isinstance(want, tuple) else (want,)
    assert len(want) == len(tops)
    for got, ref in zip(tops, want):
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol)
    return tops


def check_gradients(layer, bottom, params=None, check=None, eps=1e-6, rtol=1e-4, atol=1e-7,
                    chunk=None, seed=1, check_params=True):
    """Compare analytic gradients of L = sum_i <top_i, W_i> (W random) with central
    differences, in float64, for every bottom flagged in `check` and every param (unless
    check_params is off: statistics a layer keeps in its blobs, which have no gradient)."""
    bottom = [np.array(b, np.float64) for b in bottom]
    params = [np.array(p, np.float64) for p in (params if params is not None
                                                 else random_params(layer))]
    check = check if check is not None else [True] * len(bottom)
    rng = np.random.default_rng(seed)
    n = bottom[0].shape[0]
    weights = [rng.standard_normal(_top_shape(layer, s, n)) for s in layer.top_shapes]

    def objective():
        tops, _ = forward(layer, bottom, params, chunk)
        return sum(float(np.sum(t * w)) for t, w in zip(tops, weights))

    _, bottom_diff, param_diff = backward(layer, bottom, params, weights, chunk, propagate=check)
    targets = [(b, d, f"bottom {i}") for i, (b, d, c) in enumerate(zip(bottom, bottom_diff, check)) if c]
    if check_params:
        targets += [(p, d, f"param {i}") for i, (p, d) in enumerate(zip(params, param_diff))]
    for array, analytic, what in targets:
        numeric = np.zeros_like(array)
        flat, num = array.reshape(-1), numeric.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            plus = objective()
            flat[i] = old - eps
            minus = objective()
            flat[i] = old
            num[i] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol,
                                   err_msg=f"{layer.type_name} gradient of {what}")


def check_split_invariance(layer, bottom, params=None, cut=None, chunk_kw=None):
    """Running the batch as two chunks must give bitwise the per-sample tops and,
    for batch-value tops (losses), shares that add up to the whole-batch value."""
    bottom = [np.ascontiguousarray(b, np.float32) for b in bottom]
    params = [np.asarray(p, np.float32) for p in (params if params is not None
                                                   else random_params(layer))]
    n = bottom[0].shape[0]
    cut = cut if cut is not None else n // 2
    kw = dict(chunk_kw or {})
    whole, _ = forward(layer, bottom, params, Chunk(n=n, first=0, batch=n, **kw))
    parts = [forward(layer, [b[lo:hi] for b in bottom], params,
                     Chunk(n=hi - lo, first=lo, batch=n, **kw))[0]
             for lo, hi in ((0, cut), (cut, n))]
    for i, top in enumerate(whole):
        if layer.reduces_batch:
            np.testing.assert_allclose(parts[0][i] + parts[1][i], top, rtol=1e-5, atol=1e-6)
        else:
            joined = np.concatenate([parts[0][i], parts[1][i]])
            assert np.array_equal(joined, top), f"{layer.type_name}: top {i} depends on the split"


def check_parts(layer, bottom, starts, params=None):
    """Backward over a call of several parts (chunks) must give each part the parameter
    gradients of a call with that part alone, and the same input gradients, bitwise."""
    bottom = [np.ascontiguousarray(b, np.float32) for b in bottom]
    params = [np.asarray(p, np.float32) for p in (params if params is not None
                                                   else random_params(layer))]
    n = bottom[0].shape[0]
    tops, _ = forward(layer, bottom, params, Chunk(n=n))
    top_diff = [np.random.default_rng(5).standard_normal(t.shape).astype(np.float32)
                for t in tops]
    _, whole_dx, whole_dp = backward(layer, bottom, params, top_diff,
                                     Chunk(n=n, batch=n, part_starts=tuple(starts)))
    for k, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        # The part alone, where it lies in the batch (a blob with a row per sample reads
        # its own).
        _, dx, dp = backward(layer, [b[lo:hi] for b in bottom], params,
                             [d[lo:hi] for d in top_diff], Chunk(n=hi - lo, first=lo, batch=n))
        for got, want in zip(whole_dp, dp):
            assert np.array_equal(got[k], want), f"{layer.type_name}: part {k}'s gradient"
        for got, want in zip(whole_dx, dx):
            assert np.array_equal(got[lo:hi], want), f"{layer.type_name}: part {k}'s dx"
