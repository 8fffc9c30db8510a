"""pycaffe's caffe.Layer, the base class of Python layers (type: "Python" in a prototxt), and
the blobs such a layer sees. How the engine runs them: cgp/layers/python.py.

    class Scale10(caffe.Layer):
        def setup(self, bottom, top): self.k = float(self.param_str or 10)
        def reshape(self, bottom, top): top[0].reshape(*bottom[0].data.shape)
        def forward(self, bottom, top): top[0].data[...] = self.k * bottom[0].data
        def backward(self, top, propagate_down, bottom):
            if propagate_down[0]: bottom[0].diff[...] = self.k * top[0].diff

A layer sees the whole batch, as in Caffe, as float32 NumPy arrays; self.param_str and
self.phase (caffe.TRAIN or caffe.TEST) are set before setup; learnable blobs made with
self.blobs.add_blob(*shape) in setup hold the values setup writes as their initial weights.
"""
import math

import numpy as np

from cgp.errors import CgpError


class LegacyAxes:
    """Caffe's count and legacy num, channels, height and width of a blob, from the `shape`
    its class gives: as Caffe's LegacyShape, only for blobs of up to 4 axes."""

    @property
    def count(self):
        return math.prod(self.shape)

    def _axis(self, i):
        shape = self.shape
        if len(shape) > 4:
            raise CgpError(f"a blob of shape {shape} has {len(shape)} axes; num, channels, "
                           "height and width need at most 4: use .shape")
        return ((1,) * (4 - len(shape)) + shape)[i]

    num = property(lambda self: self._axis(0))
    channels = property(lambda self: self._axis(1))
    height = property(lambda self: self._axis(2))
    width = property(lambda self: self._axis(3))


class PyBlob(LegacyAxes):
    """A bottom, top or learnable blob of a Python layer: data and diff are float32 arrays of
    its shape; reshape(*shape) gives it new (zeroed) ones."""

    def __init__(self, shape=()):
        self.reshape(*shape)

    def reshape(self, *shape):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"reshape{shape}: dimensions must not be negative")
        self.data = np.zeros(shape, np.float32)
        self.diff = np.zeros(shape, np.float32)

    @property
    def shape(self):
        return tuple(self.data.shape)


class BlobVec(list):
    """A Python layer's learnable blobs (self.blobs), as Caffe's: add_blob(*shape) appends a
    zeroed one."""

    def add_blob(self, *shape):
        self.append(PyBlob(shape))


class Layer:
    """pycaffe's caffe.Layer: subclass it and define setup, reshape, forward and backward
    (see the module). The net sets param_str, phase and blobs before setup."""
    param_str = ""
    phase = 0

    def __init__(self, param=None):
        # Caffe makes a Python layer as cls(its LayerParameter).
        self.layer_param = param
        self.blobs = BlobVec()

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass


class ScaleLayer(Layer):
    """An example Python layer, top = k * bottom with k = float(param_str) (default 1):
    python_param { module: "cgp.caffe.pylayer" layer: "ScaleLayer" param_str: "2" }."""

    def setup(self, bottom, top):
        if len(bottom) != 1 or len(top) != 1:
            raise ValueError("ScaleLayer takes one bottom and one top")
        self.k = float(self.param_str or 1)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.k * top[0].diff
