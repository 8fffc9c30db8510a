"""Python layers (caffe.Layer) that tests/test_python_layer.py runs: a data layer and a layer
that couples the samples of a batch."""
import numpy as np
import caffe


class Batches(caffe.Layer):
    """data (N, 4) and label (N,) from a seeded stream, a new batch at each forward."""

    def setup(self, bottom, top):
        self.batch = int(self.param_str)
        self.rng = np.random.RandomState(5 + self.phase)

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, 4)
        top[1].reshape(self.batch)

    def forward(self, bottom, top):
        x = self.rng.randn(self.batch, 4).astype(np.float32)
        top[0].data[...] = x
        top[1].data[...] = x[:, 0] + x[:, 1] > 0


class Centre(caffe.Layer):
    """top = x - its mean over the batch + b, b learned (one per feature)."""

    def setup(self, bottom, top):
        self.blobs.add_blob(bottom[0].data.shape[1])
        self.blobs[0].data[...] = 0.5

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = x - x.mean(0) + self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        self.blobs[0].diff[...] += dy.sum(0)
        if propagate_down[0]:
            bottom[0].diff[...] = dy - dy.mean(0)


class Total(caffe.Layer):
    """A loss as one value, top shape (1,): what cgp refuses for a layer with bottoms."""

    def reshape(self, bottom, top):
        top[0].reshape(1)

    def forward(self, bottom, top):
        top[0].data[0] = np.square(bottom[0].data).sum() / 2
