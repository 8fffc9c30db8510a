"""Caffe's MemoryData layer: batches of arrays that Python hands over (pycaffe's
net.set_input_arrays(data, labels)), a batch_size at a time, going round.

Caffe's other ways in (AddDatumVector, AddMatVector, which apply transform_param) are C++
only: cgp refuses a transform_param that would not be applied.
"""
import numpy as np

from cgp.errors import DataError, shorten
from cgp.layers.base import Source, register


@register("MemoryData")
class MemoryDataLayer(Source):
    """tops data (batch_size, channels, height, width) and label (batch_size,)."""
    tops = (2, 2)
    params_read = ("memory_data_param", "transform_param")
    arrays = None     # (data, labels) from set_arrays

    def setup(self, bottom_shapes):
        mp = self.lp.memory_data_param
        if self.lp.HasField("transform_param") and self.lp.transform_param.ListFields():
            raise self.error("transform_param is not applied to arrays given from Python "
                             "(Caffe applies it to Datum and cv::Mat input alone); transform "
                             "the arrays first and remove it")
        shape = (mp.batch_size, mp.channels, mp.height, mp.width)
        if min(shape) < 1:
            raise self.error(f"memory_data_param needs batch_size, channels, height and width "
                             f"of at least 1, got {shape}")
        self.shapes = [shape, (mp.batch_size,)]
        return self.shapes

    def set_arrays(self, data, labels):
        """data (n, C, H, W) and labels (n,), float32, n a multiple of batch_size (Caffe's
        MemoryDataLayer::Reset); kept, not copied, as Caffe keeps them."""
        data, labels = np.asarray(data), np.asarray(labels)
        where = f"set_input_arrays for layer '{shorten(self.name)}' (MemoryData)"
        if data.dtype != np.float32 or labels.dtype != np.float32:
            raise DataError(f"{where}: data and labels must be float32 arrays, got "
                            f"{data.dtype} and {labels.dtype}")
        if data.shape[1:] != self.shapes[0][1:] or data.ndim != 4:
            raise DataError(f"{where}: data of shape {data.shape}; the layer takes (n,) + "
                            f"{self.shapes[0][1:]}")
        if labels.shape != data.shape[:1]:
            raise DataError(f"{where}: labels of shape {labels.shape} for {len(data)} samples")
        if len(data) == 0 or len(data) % self.shapes[0][0]:
            raise DataError(f"{where}: {len(data)} samples; give a multiple of the batch size "
                            f"{self.shapes[0][0]}")
        self.arrays = (data, labels)

    def __len__(self):
        return len(self.arrays[0]) if self.arrays is not None else self.shapes[0][0]

    def load(self, start, iteration, seed, rows=None):
        """The batch whose first record is `start`, counted round the arrays."""
        if self.arrays is None:
            raise DataError(f"layer '{shorten(self.name)}' (MemoryData) has no data: hand it "
                            "arrays from Python, net.set_input_arrays(data, labels)")
        data, labels = self.arrays
        batch = self.shapes[0][0]
        first = start % len(data)
        part = range(batch) if rows is None else rows
        index = (first + np.arange(part.start, part.stop)) % len(data)
        return [np.ascontiguousarray(data[index]), np.ascontiguousarray(labels[index])]
