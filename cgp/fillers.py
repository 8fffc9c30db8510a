"""Caffe's weight fillers (FillerParameter) over NumPy arrays.

Draws come from one NumPy Generator seeded by the solver's random_seed and consumed
in layer order, so initial weights depend on the seed alone. They do not reproduce
Caffe's own random numbers (Caffe's RNG is not portable); load a .caffemodel for that.
"""
import numpy as np

from cgp.errors import NetError

SUPPORTED = ("constant", "uniform", "gaussian", "xavier", "msra", "positive_unitball", "bilinear")


def _fan(shape, variance_norm, fp):
    count = int(np.prod(shape))
    fan_in = count // shape[0] if len(shape) else 1
    fan_out = count // shape[1] if len(shape) > 1 else 1
    if variance_norm == fp.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if variance_norm == fp.FAN_OUT:
        return fan_out
    return fan_in


def fill(array, fp, rng, where="?", shape=None):
    """Fill `array` in place according to the FillerParameter `fp`. shape: the whole blob's
    shape where `array` is a part of it (a sample of DummyData's top), for the fans of
    xavier and msra; array's own by default."""
    kind = fp.type
    shape = array.shape if shape is None else shape
    if kind == "constant":
        array[...] = fp.value
    elif kind == "uniform":
        if not fp.min <= fp.max:   # Caffe's caffe_rng_uniform: CHECK_LE(a, b)
            raise NetError(f"{where}: the uniform filler needs min <= max, got min {fp.min:g} "
                           f"and max {fp.max:g}")
        array[...] = rng.uniform(fp.min, fp.max, array.shape)
    elif kind == "gaussian":
        if not fp.std > 0:   # Caffe's caffe_rng_gaussian: CHECK_GT(sigma, 0)
            raise NetError(f"{where}: the gaussian filler needs std > 0, got {fp.std:g}")
        array[...] = rng.normal(fp.mean, fp.std, array.shape)
        if fp.sparse >= 0:
            # Caffe keeps each weight with probability sparse / num_inputs.
            if array.ndim < 2:
                raise NetError(f"{where}: a sparse gaussian filler needs a blob of 2 or more axes")
            keep = min(1.0, fp.sparse / (array.size / array.shape[0]))
            array *= rng.random(array.shape) < keep
    elif kind == "xavier":
        scale = np.sqrt(3.0 / _fan(shape, fp.variance_norm, fp))
        array[...] = rng.uniform(-scale, scale, array.shape)
    elif kind == "msra":
        std = np.sqrt(2.0 / _fan(shape, fp.variance_norm, fp))
        array[...] = rng.normal(0.0, std, array.shape)
    elif kind == "positive_unitball":
        values = rng.random(array.shape).reshape(array.shape[0], -1)
        array[...] = (values / values.sum(axis=1, keepdims=True)).reshape(array.shape)
    elif kind == "bilinear":
        if array.ndim != 4 or array.shape[2] != array.shape[3]:
            raise NetError(f"{where}: the bilinear filler needs a square 4-d kernel, got {array.shape}")
        size = array.shape[3]
        f = np.ceil(size / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        x = np.arange(size)
        kernel = (1 - np.abs(x / f - c))
        array[...] = kernel[:, None] * kernel[None, :]
    else:
        raise NetError(f"{where}: unknown filler type '{kind}'; supported: {', '.join(SUPPORTED)}")
