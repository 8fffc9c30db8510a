"""Source layers: Data (a data set, or a Caffe LMDB or LevelDB of raw or encoded Datum
records, with Caffe's TransformationParameter), Input and DummyData; ImageData and HDF5Data
live in image_data.py and hdf5_data.py.

Sources run once per iteration on the whole batch, before the batch is cut into chunks,
so the data order and the random crops and mirrors are global and seeded: no chunk or
thread ever draws them. Which records a batch holds is a pure function of its start
position, and each sample's crop and mirror a pure function of (seed, layer, iteration,
sample), so a resumed run reads exactly what an uninterrupted one would, and a process
that computes only some samples of the batch (an MPI rank) reads only their records.
"""
from functools import cached_property
from pathlib import Path

import numpy as np

from cgp.datasets import store
from cgp.errors import DataError, shorten
from cgp.fillers import SUPPORTED as FILLERS
from cgp.fillers import fill
from cgp.kernels import data as K
from cgp.layers.base import Source, register
from cgp.data.databases import open_database
from cgp.data.lmdb_data import ArrayRecords
from cgp.proto import caffe_pb2
from cgp.snapshot import read_blob

DATASET_SCHEME = ("mnist", "cifar10")
DB = caffe_pb2.DataParameter


def open_source(source, options, backend=None, color=None):
    """The records of a Data layer's `source` (see cgp.data.lmdb_data): a bundled data set split,
    written 'mnist:train', 'cifar10:test', ..., or the path of a Caffe LMDB or LevelDB
    folder, relative to the working directory as in Caffe. backend: the prototxt's
    data_param.backend if it was given, else None; color: how encoded images decode."""
    name, _, split = source.partition(":")
    if name in DATASET_SCHEME and split in ("train", "test"):
        return ArrayRecords(*store.load(name, split, options.data_dir, options.download),
                            name=f"data set {source}")
    path = Path(source)
    schemes = ", ".join(n + ":train|test" for n in DATASET_SCHEME)
    if not source or not path.exists():
        raise DataError(f"data source '{shorten(source)}' not found: no database folder at "
                        f"{shorten(Path.cwd() / source)} (paths are relative to the working "
                        f"directory, as in Caffe), and not one of cgp's data sets ({schemes})")
    names = {DB.LMDB: "lmdb", DB.LEVELDB: "leveldb"}
    return open_database(path, names.get(backend), color)


# TransformationParameter fields that Caffe's old format kept in data_param.
LEGACY_TRANSFORM = ("scale", "mean_file", "crop_size", "mirror")


def refuse_legacy_transform(layer, param, name):
    """An old place of a transformation field, which Caffe ignores in the current format."""
    legacy = [f for f in LEGACY_TRANSFORM if param.HasField(f)]
    if legacy:
        raise layer.error(f"{name}.{legacy[0]} is Caffe's old place for this setting; move it "
                          "into transform_param (Caffe's upgrade_net_proto_text does this)")


def encoded_color(layer, tp):
    """How encoded images decode, from transform_param: True (force_color), False
    (force_gray) or None (each image's own channels), as Caffe's DataTransformer."""
    if tp.force_color and tp.force_gray:
        raise layer.error("transform_param: set force_color or force_gray, not both")
    return True if tp.force_color else False if tp.force_gray else None


class Transform:
    """Caffe's DataTransformer for one layer: (value - mean) * scale in float32, then a crop
    (random in TRAIN, the centre in TEST) and a mirror drawn per sample. Over a batch of
    records of one shape, or one record at a time where they differ in size (image files,
    encoded images), which crop_size then makes one."""

    def __init__(self, layer, shape):
        """shape: (C, H, W) of the first record, which sets the output's unless cropped."""
        self.layer, self.shape = layer, tuple(shape)
        tp = layer.lp.transform_param
        self.tp = tp
        self.mean = self._mean(tp, self.shape)
        self.scale = np.float32(tp.scale)
        self.crop = tp.crop_size
        channels, height, width = self.shape
        if self.crop and (self.crop > height or self.crop > width):
            raise layer.error(f"crop_size {self.crop} is larger than the {height}x{width} images")
        self.out_shape = (channels,) + ((self.crop, self.crop) if self.crop else (height, width))
        self._mean_rows = {}   # record shape -> the mean over a whole record, flat

    def _mean_row(self, shape):
        """What the transform kernel takes: the mean over a whole record of `shape`."""
        if self.mean is None:
            return np.empty(0, np.float32)
        if shape not in self._mean_rows:
            self._mean_rows[shape] = np.ascontiguousarray(
                np.broadcast_to(self.mean, shape), np.float32).reshape(-1)
        return self._mean_rows[shape]

    def _mean(self, tp, shape):
        """Per-pixel (mean_file) or per-channel (mean_value) mean, broadcastable to a record."""
        if tp.HasField("mean_file") and tp.mean_value:
            raise self.layer.error("specify either mean_file or mean_value, not both")
        if tp.HasField("mean_file"):
            blob = read_mean_file(tp.mean_file)
            if blob.shape != shape:
                raise self.layer.error(f"mean_file {tp.mean_file} has shape {blob.shape}, "
                                       f"the records have {shape}")
            return blob
        if tp.mean_value:
            values = np.array(tp.mean_value, np.float32)
            if len(values) == 1:
                values = np.repeat(values, shape[0])
            if len(values) != shape[0]:
                raise self.layer.error(f"{len(values)} mean_value entries for {shape[0]} "
                                       "channels (give one, or one per channel)")
            return values.reshape(-1, 1, 1)
        return None

    def __call__(self, images, iteration, seed, first, where):
        """images: (n, C, H, W) uint8 or float32, or a list of (C, H, W) arrays, the batch's
        samples from `first` on -> (n,) + out_shape float32. where(s): names sample s in
        errors."""
        if isinstance(images, np.ndarray) and images.shape[1:] == self.shape:
            return self._batch(images, iteration, seed, first)
        out = np.empty((len(images),) + self.out_shape, np.float32)
        for s, image in enumerate(images):
            self._check(image.shape, where(s))
            out[s] = self._batch(image[None], iteration, seed, first + s)[0]
        return out

    def _check(self, shape, where):
        if shape[0] != self.shape[0]:
            raise DataError(f"{where}: image has {shape[0]} channels, the first "
                            f"{self.shape[0]}; cgp needs one number of channels")
        if not self.crop and shape != self.shape:
            raise DataError(f"{where}: image is {shape[1]}x{shape[2]}, the first "
                            f"{self.shape[1]}x{self.shape[2]}: images of several sizes need "
                            "crop_size (or new_height/new_width, or resized records)")
        if self.crop and (self.crop > shape[1] or self.crop > shape[2]):
            raise DataError(f"{where}: image is {shape[1]}x{shape[2]}, smaller than "
                            f"crop_size {self.crop}")
        if self.mean is not None and self.mean.shape[1:] != (1, 1) and self.mean.shape != shape:
            raise DataError(f"{where}: image is {shape[1]}x{shape[2]}, the mean_file "
                            f"{self.mean.shape[1]}x{self.mean.shape[2]}")

    def _batch(self, images, iteration, seed, first):
        n = len(images)
        data = np.empty(images.shape, np.float32)
        K.transform(np.ascontiguousarray(images).reshape(n, -1),
                    self._mean_row(images.shape[1:]), self.scale, data.reshape(n, -1))
        return self._crop_and_mirror(data, iteration, seed, first)

    def _crop_and_mirror(self, data, iteration, seed, first=0):
        """Caffe's DataTransformer: a random crop in TRAIN and the centre crop in TEST; a
        random mirror in both phases (Caffe mirrors at test time too when mirror is set).
        data's samples are the batch's from sample `first` on."""
        train = self.layer.phase == caffe_pb2.TRAIN
        if not (self.crop or self.tp.mirror):
            return data
        n, channels, height, width = data.shape
        crop_h, crop_w = (self.crop, self.crop) if self.crop else (height, width)
        out = np.empty((n, channels, crop_h, crop_w), np.float32)
        for s in range(n):
            # One stream per sample, keyed by (seed, layer, iteration, sample): the draws
            # never depend on how the batch is cut or which thread reads it. Caffe's order
            # of draws: the mirror coin, then the crop offsets.
            rng = sample_stream(seed, self.layer.index, iteration, first + s)
            flip = bool(rng.integers(0, 2)) if self.tp.mirror else False
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


def sample_stream(seed, layer, iteration, sample, purpose=0):
    """The random stream of one sample of one iteration in one source layer: a pure function
    of its keys (purpose: 0 crops and mirrors, others for other draws)."""
    return np.random.Generator(np.random.Philox(
        key=[seed & (2**64 - 1), layer], counter=[iteration, sample, purpose, 0]))


class LabeledSource(Source):
    """A source whose second top holds class labels, which it checks as it reads them."""

    def label_rule(self, top, classes, ignore, reader):
        """Layer `reader` (a loss, an accuracy) takes the labels of top `top` as classes
        0 .. classes - 1, or `ignore` (None: no ignore_label): load() checks each batch's
        labels against every such rule, so that a bad label is named by its record."""
        if top == 1:
            self._label_rules.append((classes, ignore, reader))

    def _check_labels(self, labels, where):
        """where(i): the record of sample i, for the message."""
        whole = np.trunc(labels)    # as the losses read a label: converted to int
        for classes, ignore, reader in self._label_rules:
            bad = ~np.isfinite(whole) | (whole < 0) | (whole >= classes)
            if ignore is not None:
                bad &= whole != ignore
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise DataError(
                    f"layer '{shorten(self.name)}': {where(i)}: label "
                    f"{labels[i]:g} is not a class of layer '{shorten(reader)}', which "
                    f"takes labels 0 to {classes - 1}"
                    + (f" or the ignore_label {ignore}" if ignore is not None else ""))


@register("Data")
class DataLayer(LabeledSource):
    tops = (1, 2)
    params_read = ("data_param", "transform_param")

    def setup(self, bottom_shapes):
        dp, tp = self.lp.data_param, self.lp.transform_param
        self._label_rules = []   # (classes, ignore_label or None, layer name): label_rule
        if dp.batch_size <= 0:
            raise self.error("data_param.batch_size must be positive")
        refuse_legacy_transform(self, dp, "data_param")
        if dp.rand_skip:
            raise self.error("data_param.rand_skip is not supported (Caffe's current Data "
                             "layer ignores it too); remove it")
        backend = dp.backend if dp.HasField("backend") else None
        color = True if dp.force_encoded_color else encoded_color(self, tp)
        try:
            self.records = open_source(dp.source, self.options, backend, color)
        except DataError as e:
            raise DataError(f"layer '{shorten(self.name)}': {e}") from None
        self.batch = dp.batch_size
        self.transform = Transform(self, self.records.shape)
        shapes = [(self.batch,) + self.transform.out_shape]
        if len(self.lp.top) == 2:
            shapes.append((self.batch,))
        return shapes

    def __len__(self):
        return len(self.records)

    def close(self):
        self.records.close()

    def load(self, start, iteration, seed, rows=None):
        """The batch of records start, start+1, ... (wrapping around the data set, as
        Caffe's reader does), transformed: [data (N, C, H', W') float32, label (N,)]; or of
        the batch's samples `rows` (a range) alone, which reads only their records.
        Caffe's order of operations per element: (value - mean) * scale, in float32."""
        rows = range(self.batch) if rows is None else rows
        first = start + rows.start
        images, labels = self.records.read(first, len(rows))
        if self._label_rules:
            self._check_labels(labels, lambda i: self.records.where(first + i))
        data = self.transform(images, iteration, seed, rows.start,
                              lambda s: self.records.where(first + s))
        tops = [np.ascontiguousarray(data)]
        if len(self.lp.top) == 2:
            tops.append(np.array(labels, np.float32))   # a copy: records may be a view
        return tops


def read_mean_file(path):
    """A Caffe mean .binaryproto as a float32 array (C, H, W): its leading num axis of 4-d
    blobs (compute_image_mean writes 1 x C x H x W) is dropped."""
    mean = read_blob(path, "mean_file")
    if mean.ndim == 4 and mean.shape[0] != 1:
        raise DataError(f"mean_file {path}: holds {mean.shape[0]} images; a mean file holds one")
    return mean[0] if mean.ndim == 4 else mean


@register("Input")
class InputLayer(Source):
    """Blobs the caller fills (deploy nets); zeros until set with `values`."""
    tops = (1, None)
    params_read = ("input_param",)

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


@register("DummyData")
class DummyDataLayer(Source):
    """Caffe's DummyData: each top filled by its data_filler (constant 0 if none is given;
    one filler for every top, or one per top). A filler that draws fills each sample from
    its own stream, a pure function of (seed, layer, iteration, sample, top): the batch is
    new at every iteration, as Caffe refills it, and any split of it draws the same."""
    tops = (1, None)
    params_read = ("dummy_data_param",)

    def setup(self, bottom_shapes):
        dp = self.lp.dummy_data_param
        tops = len(self.lp.top)
        shapes = self._shapes(dp, tops)
        fillers = list(dp.data_filler) or [caffe_pb2.FillerParameter(type="constant")]
        if len(fillers) not in (1, tops):
            raise self.error(f"{len(dp.data_filler)} data_filler entries for {tops} tops "
                             "(give none, one, or one per top)")
        self.fillers = fillers * tops if len(fillers) == 1 else fillers
        for fp in self.fillers:
            if fp.type not in FILLERS:
                raise self.error(f"unknown filler type '{fp.type}'; supported: "
                                 f"{', '.join(FILLERS)}")
        self.shapes = shapes
        return shapes

    def _shapes(self, dp, tops):
        legacy = [dp.num, dp.channels, dp.height, dp.width]
        if dp.shape:
            if any(legacy):
                raise self.error("give dummy_data_param's shape or its num/channels/height/"
                                 "width, not both")
            shapes = [tuple(int(d) for d in s.dim) for s in dp.shape]
        else:
            if any(len(values) not in (1, tops) for values in legacy):
                raise self.error("dummy_data_param's num, channels, height and width need one "
                                 "value each, or one per top")
            shapes = [tuple(int(v[i if len(v) > 1 else 0]) for v in legacy) for i in range(tops)]
        if len(shapes) == 1:
            shapes *= tops
        if len(shapes) != tops:
            raise self.error(f"dummy_data_param gives {len(shapes)} shapes for {tops} tops")
        if any(len(s) == 0 or min(s) <= 0 for s in shapes):
            raise self.error(f"shapes {shapes}: every top needs a batch axis and positive sizes")
        return shapes

    def __len__(self):
        return self.shapes[0][0]

    def load(self, start, iteration, seed, rows=None):
        tops = []
        for k, (shape, fp) in enumerate(zip(self.shapes, self.fillers)):
            part = range(shape[0]) if rows is None else rows
            top = np.empty((len(part),) + shape[1:], np.float32)
            if fp.type == "constant":
                top[...] = fp.value
            for s in ([] if fp.type == "constant" else range(len(part))):
                rng = sample_stream(seed, self.index, iteration, part.start + s, 1 + k)
                fill(top[s:s + 1], fp, rng, f"layer '{self.name}' top {k}", shape)
            tops.append(top)
        return tops
