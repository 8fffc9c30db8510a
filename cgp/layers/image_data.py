"""Caffe's ImageData layer: images named by a list file of `path label` lines, decoded as
Caffe's OpenCV path does (cgp.data.images), resized to new_height x new_width if given, then
transformed as the Data layer's records (TransformationParameter).

Which image record r of the run reads is a pure function of (seed, r): the list is read in
order, or with shuffle in a fresh order each epoch, the order of epoch e drawn from a stream
keyed by (seed, layer, e) alone. So a resumed run, and any number of processes each reading
its own samples of a batch, read the same images, and each decodes only the images it reads.
"""
from pathlib import Path

import numpy as np

from cgp.errors import DataError
from cgp.data.images import read_image, read_list
from cgp.layers.base import register
from cgp.layers.data import (LabeledSource, Transform, refuse_legacy_transform,
                             sample_stream)

# sample_stream purposes of this layer's draws that are not per sample.
SHUFFLE, SKIP = 1 << 20, (1 << 20) + 1


class ImageList:
    """The images of a list file as records: record r is line order(r // N)[r % N] (N
    lines), offset by rand_skip. `decoded` counts the images decoded so far."""

    def __init__(self, layer):
        ip = layer.lp.image_data_param
        self.layer, self.source, self.root = layer, ip.source, ip.root_folder
        self.lines = read_list(ip.source)
        self.size = (ip.new_height, ip.new_width)
        self.color = ip.is_color
        self.shuffle = ip.shuffle
        self.rand_skip = ip.rand_skip
        if self.rand_skip > len(self.lines):
            raise DataError(f"image list '{self.source}': rand_skip {self.rand_skip} is more "
                            f"than its {len(self.lines)} images")
        self.decoded = 0
        self._orders = {}       # (seed, epoch) -> its order, for the last two epochs read

    def __len__(self):
        return len(self.lines)

    def line(self, record, seed):
        """The list line (path, label, number) that record `record` reads."""
        skip = 0
        if self.rand_skip:   # Caffe skips a random number (below rand_skip) of records once
            skip = int(sample_stream(seed, self.layer.index, 0, 0, SKIP).integers(self.rand_skip))
        epoch, position = divmod(record + skip, len(self.lines))
        if not self.shuffle:
            return self.lines[position]
        key = (seed, epoch)
        if key not in self._orders:
            rng = sample_stream(seed, self.layer.index, epoch, 0, SHUFFLE)
            self._orders = {k: v for k, v in self._orders.items() if k[1] == epoch - 1}
            self._orders[key] = rng.permutation(len(self.lines))
        return self.lines[self._orders[key][position]]

    def where(self, line):
        path, _, number = line
        return f"image list {self.source}:{number} ('{path}')"

    def image(self, line):
        """The image of a list line, (C, H, W) uint8."""
        path = self.root + line[0]     # Caffe prepends root_folder as it is
        where = self.where(line)
        if not Path(path).is_file():
            hint = ("" if not self.root or self.root.endswith("/") else
                    f"; root_folder '{self.root}' is prepended as it is, as in Caffe: end it "
                    "with '/'")
            raise DataError(f"{where}: image not found at {Path(path).absolute()}{hint}")
        image = read_image(path, *self.size, self.color, where)
        self.decoded += 1
        return np.ascontiguousarray(image.transpose(2, 0, 1))

    def read(self, start, count, seed):
        """Images (a list of (C, H, W) uint8) and labels (count,) of records start.."""
        lines = [self.line(start + j, seed) for j in range(count)]
        return lines, [self.image(line) for line in lines], np.array([l[1] for l in lines],
                                                                        np.float32)


@register("ImageData")
class ImageDataLayer(LabeledSource):
    tops = (2, 2)
    params_read = ("image_data_param", "transform_param")

    def setup(self, bottom_shapes):
        ip = self.lp.image_data_param
        self._label_rules = []   # (classes, ignore_label or None, layer name): label_rule
        if ip.batch_size <= 0:
            raise self.error("image_data_param.batch_size must be positive")
        if (ip.new_height > 0) != (ip.new_width > 0):
            raise self.error("set new_height and new_width together (Caffe's rule), or neither")
        refuse_legacy_transform(self, ip, "image_data_param")
        try:
            # The list's first image sets the shape, as the first Caffe reads does.
            self.images = ImageList(self)
            shape = self.images.image(self.images.lines[0]).shape
        except DataError as e:
            raise DataError(f"layer '{self.name}': {e}") from None
        self.batch = ip.batch_size
        self.transform = Transform(self, shape)
        return [(self.batch,) + self.transform.out_shape, (self.batch,)]

    def __len__(self):
        return len(self.images)

    def load(self, start, iteration, seed, rows=None):
        """The transformed images and labels of records start + rows (default: the whole
        batch), decoding those images alone."""
        rows = range(self.batch) if rows is None else rows
        lines, images, labels = self.images.read(start + rows.start, len(rows), seed)
        if self._label_rules:
            self._check_labels(labels, lambda i: self.images.where(lines[i]))
        data = self.transform(images, iteration, seed, rows.start,
                              lambda s: self.images.where(lines[s]))
        return [data, labels]
