"""Source layers: Data (a data set or a Caffe LMDB, with Caffe's TransformationParameter)
and Input.

Sources run once per iteration on the whole batch, before the batch is cut into chunks,
so the data order and the random crops and mirrors are global and seeded: no chunk or
thread ever draws them. Which records a batch holds is a pure function of its start
position, and each sample's crop and mirror a pure function of (seed, layer, iteration,
sample), so a resumed run reads exactly what an uninterrupted one would.
"""
from functools import cached_property
from pathlib import Path

import numpy as np

from cgp.datasets import store
from cgp.errors import DataError, shorten
from cgp.kernels import data as K
from cgp.layers.base import Layer, register
from cgp.lmdb_data import ArrayRecords, LmdbRecords
from cgp.proto import caffe_pb2
from cgp.snapshot import read_blob

DATASET_SCHEME = ("mnist", "cifar10")


def open_source(source, options, backend=None):
    """The records of a Data layer's `source` (see cgp.lmdb_data): a bundled data set split,
    written 'mnist:train', 'cifar10:test', ..., or the path of a Caffe LMDB folder,
    relative to the working directory as in Caffe. backend: the prototxt's
    data_param.backend if it was given, else None."""
    name, _, split = source.partition(":")
    if name in DATASET_SCHEME and split in ("train", "test"):
        return ArrayRecords(*store.load(name, split, options.data_dir, options.download),
                            name=f"data set {source}")
    path = Path(source)
    schemes = ", ".join(n + ":train|test" for n in DATASET_SCHEME)
    if not source or not path.exists():
        raise DataError(f"data source '{shorten(source)}' not found: no LMDB folder at "
                        f"{shorten(Path.cwd() / source)} (paths are relative to the working "
                        f"directory, as in Caffe), and not one of cgp's data sets ({schemes})")
    if backend == caffe_pb2.DataParameter.LEVELDB:
        raise DataError(f"data source '{shorten(source)}': backend LEVELDB is not supported; "
                        "cgp reads LMDB databases (backend: LMDB); convert the data with "
                        "--backend=lmdb")
    if path.is_dir() and (path / "data.mdb").is_file():
        return LmdbRecords(path)
    if path.is_dir() and (path / "CURRENT").is_file():
        raise DataError(f"data source '{shorten(source)}' is a LevelDB database; cgp reads "
                        "LMDB only: convert the data with --backend=lmdb")
    raise DataError(f"data source '{shorten(source)}' is not an LMDB database (no data.mdb in "
                    f"{shorten(path.resolve())})")


# TransformationParameter fields that Caffe's old format kept in data_param.
LEGACY_TRANSFORM = ("scale", "mean_file", "crop_size", "mirror")


@register("Data")
class DataLayer(Layer):
    bottoms = (0, 0)
    tops = (1, 2)
    params_read = ("data_param", "transform_param")
    is_source = True
    options = None  # RunOptions, set by the net before setup

    def setup(self, bottom_shapes):
        dp, tp = self.lp.data_param, self.lp.transform_param
        self._label_rules = []   # (classes, ignore_label or None, layer name): label_rule
        if dp.batch_size <= 0:
            raise self.error("data_param.batch_size must be positive")
        legacy = [f for f in LEGACY_TRANSFORM if dp.HasField(f)]
        if legacy:
            raise self.error(f"data_param.{legacy[0]} is Caffe's old place for this setting; "
                             "move it into transform_param (Caffe's upgrade_net_proto_text "
                             "does this)")
        if dp.rand_skip:
            raise self.error("data_param.rand_skip is not supported (Caffe's current Data "
                             "layer ignores it too); remove it")
        backend = dp.backend if dp.HasField("backend") else None
        try:
            self.records = open_source(dp.source, self.options, backend)
        except DataError as e:
            raise DataError(f"layer '{shorten(self.name)}': {e}") from None
        self.batch = dp.batch_size
        channels, height, width = self.records.shape
        self.mean = self._mean(tp, self.records.shape)
        # What the transform kernel takes: the mean over a whole record, and the scale.
        self._mean_row = (np.empty(0, np.float32) if self.mean is None else np.ascontiguousarray(
            np.broadcast_to(self.mean, self.records.shape), np.float32).reshape(-1))
        self._scale = np.float32(tp.scale)
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
        return len(self.records)

    def close(self):
        self.records.close()

    def label_rule(self, top, classes, ignore, reader):
        """Layer `reader` (a loss, an accuracy) takes the labels of top `top` as classes
        0 .. classes - 1, or `ignore` (None: no ignore_label): load() checks each batch's
        labels against every such rule, so that a bad label is named by its record."""
        if top == 1:
            self._label_rules.append((classes, ignore, reader))

    def _check_labels(self, labels, start):
        whole = np.trunc(labels)    # as the losses read a label: converted to int
        for classes, ignore, reader in self._label_rules:
            bad = ~np.isfinite(whole) | (whole < 0) | (whole >= classes)
            if ignore is not None:
                bad &= whole != ignore
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise DataError(
                    f"layer '{shorten(self.name)}': {self.records.where(start + i)}: label "
                    f"{labels[i]:g} is not a class of layer '{shorten(reader)}', which "
                    f"takes labels 0 to {classes - 1}"
                    + (f" or the ignore_label {ignore}" if ignore is not None else ""))

    def load(self, start, iteration, seed, rows=None):
        """The batch of records start, start+1, ... (wrapping around the data set, as
        Caffe's reader does), transformed: [data (N, C, H', W') float32, label (N,)]; or of
        the batch's samples `rows` (a range) alone, which reads only their records.
        Caffe's order of operations per element: (value - mean) * scale, in float32."""
        rows = range(self.batch) if rows is None else rows
        images, labels = self.records.read(start + rows.start, len(rows))
        if self._label_rules:
            self._check_labels(labels, start + rows.start)
        n = len(images)
        data = np.empty(images.shape, np.float32)
        K.transform(images.reshape(n, -1), self._mean_row, self._scale, data.reshape(n, -1))
        data = self._crop_and_mirror(data, iteration, seed, rows.start)
        tops = [np.ascontiguousarray(data)]
        if len(self.lp.top) == 2:
            tops.append(np.array(labels, np.float32))   # a copy: records may be a view
        return tops

    def _crop_and_mirror(self, data, iteration, seed, first=0):
        """Caffe's DataTransformer: a random crop in TRAIN and the centre crop in TEST; a
        random mirror in both phases (Caffe mirrors at test time too when mirror is set).
        data's samples are the batch's from sample `first` on."""
        tp = self.lp.transform_param
        train = self.phase == caffe_pb2.TRAIN
        if not (self.crop or tp.mirror):
            return data
        n, channels, height, width = data.shape
        crop_h, crop_w = (self.crop, self.crop) if self.crop else (height, width)
        out = np.empty((n, channels, crop_h, crop_w), np.float32)
        for s in range(n):
            # One stream per sample, keyed by (seed, layer, iteration, sample): the draws
            # never depend on how the batch is cut or which thread reads it. Caffe's order
            # of draws: the mirror coin, then the crop offsets.
            rng = np.random.Generator(np.random.Philox(
                key=[seed & (2**64 - 1), self.index], counter=[iteration, first + s, 0, 0]))
            flip = bool(rng.integers(0, 2)) if tp.mirror else False
            top, left = 0, 0
            if self.crop:
                if train:
                    top = int(rng.integers(0, height - self.crop + 1))
                    left = int(rng.integers(0, width - self.crop + 1))
                else:
                    top, left = (height - self.crop) // 2, (width - self.crop) // 2
            window = data[s, :, top:top + crop_h, left:left + crop_w]
            out[s] = window[..., ::-1] if flip else window
        return out


def read_mean_file(path):
    """A Caffe mean .binaryproto as a float32 array (C, H, W): its leading num axis of 4-d
    blobs (compute_image_mean writes 1 x C x H x W) is dropped."""
    mean = read_blob(path, "mean_file")
    if mean.ndim == 4 and mean.shape[0] != 1:
        raise DataError(f"mean_file {path}: holds {mean.shape[0]} images; a mean file holds one")
    return mean[0] if mean.ndim == 4 else mean


@register("Input")
class InputLayer(Layer):
    """Blobs the caller fills (deploy nets); zeros until set with `values`."""
    bottoms = (0, 0)
    tops = (1, None)
    params_read = ("input_param",)
    is_source = True
    options = None

    def setup(self, bottom_shapes):
        shapes = [tuple(s.dim) for s in self.lp.input_param.shape]
        if len(shapes) == 1:
            shapes *= len(self.lp.top)
        if len(shapes) != len(self.lp.top):
            raise self.error(f"input_param gives {len(shapes)} shapes for {len(self.lp.top)} tops")
        self.shapes = shapes
        return shapes

    @cached_property
    def values(self):
        """The arrays of the tops, zeros until the caller fills them: made on first use,
        after the net has checked that their shapes fit in memory."""
        return [np.zeros(s, np.float32) for s in self.shapes]

    def __len__(self):
        return self.shapes[0][0]

    def load(self, start, iteration, seed, rows=None):
        """The tops as the caller set them; NaN or infinite values are refused here, where
        they enter the net, rather than found as a NaN loss later."""
        for name, value in zip(self.lp.top, self.values):
            if not np.isfinite(value).all():
                first = np.argwhere(~np.isfinite(value))[0]
                raise DataError(f"layer '{shorten(self.name)}': top '{shorten(name)}' holds "
                                f"{value[tuple(first)]} at {tuple(int(i) for i in first)}; "
                                "input values must be finite")
        return self.values if rows is None else [v[rows.start:rows.stop] for v in self.values]
