"""Source layers: Data (a data set with Caffe's TransformationParameter) and Input.

Sources run once per iteration on the whole batch, before the batch is cut into chunks,
so the data order and the random crops and mirrors are global and seeded: no chunk or
thread ever draws them. Which records a batch holds is a pure function of its start
position, so a resumed run reads exactly what an uninterrupted one would.
"""
import numpy as np

from cgp.datasets import store
from cgp.errors import DataError
from cgp.layers.base import Layer, register
from cgp.proto import caffe_pb2

DATASET_SCHEME = ("mnist", "cifar10")


def open_source(source, options):
    """The records of a Data layer's `source`: (images uint8 (M, C, H, W), labels (M,)).

    A source is a bundled data set split, written 'mnist:train', 'cifar10:test', ... ."""
    name, _, split = source.partition(":")
    if name in DATASET_SCHEME and split in ("train", "test"):
        return store.load(name, split, options.data_dir, options.download)
    raise DataError(f"data source {source!r}: cgp reads the data sets "
                    f"{', '.join(n + ':train|test' for n in DATASET_SCHEME)}; "
                    "LMDB directories are not supported yet")


@register("Data")
class DataLayer(Layer):
    bottoms = (0, 0)
    tops = (1, 2)
    is_source = True
    options = None  # RunOptions, set by the net before setup

    def setup(self, bottom_shapes):
        dp, tp = self.lp.data_param, self.lp.transform_param
        if dp.batch_size <= 0:
            raise self.error("data_param.batch_size must be positive")
        images, labels = open_source(dp.source, self.options)
        self.images, self.labels = images, labels.astype(np.float32)
        self.batch = dp.batch_size
        channels, height, width = images.shape[1:]
        self.mean = self._mean(tp, images.shape[1:])
        self.crop = tp.crop_size
        if self.crop and (self.crop > height or self.crop > width):
            raise self.error(f"crop_size {self.crop} is larger than the {height}x{width} images")
        out_h, out_w = (self.crop, self.crop) if self.crop else (height, width)
        shapes = [(self.batch, channels, out_h, out_w)]
        if len(self.lp.top) == 2:
            shapes.append((self.batch,))
        return shapes

    def _mean(self, tp, shape):
        """Per-pixel (mean_file) or per-channel (mean_value) mean, broadcastable to a record."""
        if tp.HasField("mean_file") and tp.mean_value:
            raise self.error("specify either mean_file or mean_value, not both")
        if tp.HasField("mean_file"):
            blob = read_mean_file(tp.mean_file)
            if blob.shape != shape:
                raise self.error(f"mean_file {tp.mean_file} has shape {blob.shape}, "
                                 f"the records have {shape}")
            return blob
        if tp.mean_value:
            values = np.array(tp.mean_value, np.float32)
            if len(values) == 1:
                values = np.repeat(values, shape[0])
            if len(values) != shape[0]:
                raise self.error(f"{len(values)} mean_value entries for {shape[0]} channels "
                                 "(give one, or one per channel)")
            return values.reshape(-1, 1, 1)
        return None

    def __len__(self):
        return len(self.images)

    def load(self, start, iteration, seed):
        """The batch of records start, start+1, ... (wrapping around the data set, as
        Caffe's reader does), transformed: [data (N, C, H', W') float32, label (N,)]."""
        index = (start + np.arange(self.batch)) % len(self.images)
        data = self.images[index].astype(np.float32)
        if self.mean is not None:
            data -= self.mean
        if self.lp.transform_param.scale != 1:
            data *= np.float32(self.lp.transform_param.scale)
        data = self._crop_and_mirror(data, iteration, seed)
        tops = [np.ascontiguousarray(data)]
        if len(self.lp.top) == 2:
            tops.append(self.labels[index])
        return tops

    def _crop_and_mirror(self, data, iteration, seed):
        tp = self.lp.transform_param
        train = self.phase == caffe_pb2.TRAIN
        if not (self.crop or tp.mirror):
            return data
        # One stream per (seed, layer, iteration): the whole batch's draws come from it
        # in sample order, so they never depend on how the batch is later cut.
        rng = np.random.Generator(np.random.Philox(key=[seed & (2**64 - 1), self.index],
                                                   counter=[iteration, 0, 0, 0]))
        n, _, height, width = data.shape
        if self.crop:
            if train:
                top = rng.integers(0, height - self.crop + 1, n)
                left = rng.integers(0, width - self.crop + 1, n)
            else:  # Caffe crops the centre at test time
                top = np.full(n, (height - self.crop) // 2)
                left = np.full(n, (width - self.crop) // 2)
            data = np.stack([d[:, t:t + self.crop, l:l + self.crop]
                             for d, t, l in zip(data, top, left)])
        if tp.mirror and train:
            flip = rng.random(n) < 0.5
            data[flip] = data[flip][..., ::-1]
        return data


def read_mean_file(path):
    """A Caffe mean .binaryproto (BlobProto) as a float32 array (C, H, W)."""
    try:
        with open(path, "rb") as f:
            blob = caffe_pb2.BlobProto.FromString(f.read())
    except OSError as e:
        raise DataError(f"mean_file {path}: cannot read: {e.strerror}") from None
    except Exception as e:  # protobuf's DecodeError
        raise DataError(f"mean_file {path}: not a Caffe BlobProto: {e}") from None
    shape = tuple(blob.shape.dim) or (blob.channels, blob.height, blob.width)
    shape = shape[1:] if len(shape) == 4 else shape
    values = np.array(blob.data, np.float32)
    if values.size != int(np.prod(shape)):
        raise DataError(f"mean_file {path}: {values.size} values for shape {shape}")
    return values.reshape(shape)


@register("Input")
class InputLayer(Layer):
    """Blobs the caller fills (deploy nets); zeros until set with `values`."""
    bottoms = (0, 0)
    tops = (1, None)
    is_source = True
    options = None

    def setup(self, bottom_shapes):
        shapes = [tuple(s.dim) for s in self.lp.input_param.shape]
        if len(shapes) == 1:
            shapes *= len(self.lp.top)
        if len(shapes) != len(self.lp.top):
            raise self.error(f"input_param gives {len(shapes)} shapes for {len(self.lp.top)} tops")
        self.values = [np.zeros(s, np.float32) for s in shapes]
        return shapes

    def __len__(self):
        return self.values[0].shape[0]

    def load(self, start, iteration, seed):
        return self.values
