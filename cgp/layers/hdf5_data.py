"""Caffe's HDF5Data layer: the rows of HDF5 files named in a list file, each top read from
the dataset of the top's name (h5py, the `hdf5` extra), as float32, untransformed.

Records run through the files in list order; with shuffle, each epoch takes the files in a
fresh order and each file's rows in a fresh order (Caffe reshuffles both as it goes), drawn
from streams keyed by (seed, layer, epoch) alone, so any process reading any samples of a
batch reads the same rows, and only those rows.
"""
from pathlib import Path

import numpy as np

from cgp.errors import DataError
from cgp.data.hdf5 import require_h5py
from cgp.layers.base import Source, register
from cgp.layers.data import sample_stream

SHUFFLE = 1 << 20     # the sample_stream purpose of the shuffles


def read_file_list(source):
    """The .h5 paths listed in `source`, one a line (blank lines skipped), as Caffe reads them."""
    try:
        names = [line.strip() for line in Path(source).read_text().splitlines()]
    except OSError as e:
        raise DataError(f"HDF5 file list '{source}': cannot read: {e.strerror or e} (paths are "
                        "relative to the working directory, as in Caffe)") from None
    except UnicodeDecodeError:
        raise DataError(f"HDF5 file list '{source}': not a text file (it lists .h5 files, one "
                        "a line)") from None
    names = [n for n in names if n]
    if not names:
        raise DataError(f"HDF5 file list '{source}' names no files")
    return names


@register("HDF5Data")
class HDF5DataLayer(Source):
    tops = (1, None)
    params_read = ("hdf5_data_param",)

    def setup(self, bottom_shapes):
        hp = self.lp.hdf5_data_param
        if hp.batch_size <= 0:
            raise self.error("hdf5_data_param.batch_size must be positive")
        self.batch, self.shuffle = hp.batch_size, hp.shuffle
        try:
            self.files, shapes = self._open(hp.source)
        except DataError as e:
            raise DataError(f"layer '{self.name}': {e}") from None
        self.rows = np.array([len(f[self.lp.top[0]]) for f in self.files])
        self.starts = np.concatenate([[0], np.cumsum(self.rows)])
        self._orders = {}
        return [(self.batch,) + s for s in shapes]

    def _open(self, source):
        """Every listed file, open, checked to hold a dataset per top with one row count per
        file and one row shape per top: (files, row shapes)."""
        h5py = require_h5py(f"HDF5 file list '{source}'")
        files, shapes = [], None
        try:
            for name in read_file_list(source):
                try:
                    f = h5py.File(name, "r")
                except (OSError, ValueError) as e:
                    raise DataError(f"HDF5 file {name} (listed in {source}): cannot open: "
                                    f"{e}") from None
                files.append(f)
                shapes = self._check(h5py, f, name, shapes)
        except BaseException:
            for f in files:
                f.close()
            raise
        return files, shapes

    def _check(self, h5py, f, name, shapes):
        found = []
        for top in self.lp.top:
            dataset = f.get(top)
            if isinstance(dataset, h5py.Dataset):
                found.append(dataset)
                continue
            held = ", ".join(sorted(k for k in f.keys())) or "nothing"
            raise DataError(f"HDF5 file {name} has no dataset '{top}' (a top of layer "
                            f"'{self.name}' reads the dataset of its name); it holds: {held}")
        if any(d.ndim == 0 for d in found):
            raise DataError(f"HDF5 file {name}: dataset '{self.lp.top[0]}' is a scalar; "
                            "HDF5Data reads rows of datasets of 1 or more axes")
        counts = {d.shape[0] for d in found}
        if len(counts) > 1:
            raise DataError(f"HDF5 file {name}: the datasets {list(self.lp.top)} hold "
                            f"{sorted(counts)} rows; they need one row count")
        if counts == {0}:
            raise DataError(f"HDF5 file {name}: its datasets hold no rows")
        rows = [tuple(d.shape[1:]) for d in found]
        if shapes is not None and rows != shapes:
            raise DataError(f"HDF5 file {name}: rows of shapes {rows}, the first file's are "
                            f"{shapes}")
        return rows

    def __len__(self):
        return int(self.starts[-1])

    def close(self):
        for f in self.files:
            f.close()

    def _order(self, seed, epoch):
        """(file order, row order per file) of an epoch."""
        key = (seed, epoch)
        if key not in self._orders:
            rng = sample_stream(seed, self.index, epoch, 0, SHUFFLE)
            files = rng.permutation(len(self.files))
            rows = [rng.permutation(n) for n in self.rows]
            self._orders = {k: v for k, v in self._orders.items() if k[1] == epoch - 1}
            self._orders[key] = (files, rows)
        return self._orders[key]

    def _where(self, record, seed):
        """(file index, row) of record `record`."""
        epoch, position = divmod(record, len(self))
        if not self.shuffle:
            k = int(np.searchsorted(self.starts, position, side="right") - 1)
            return k, position - self.starts[k]
        files, rows = self._order(seed, epoch)
        ends = np.cumsum(self.rows[files])
        j = int(np.searchsorted(ends, position, side="right"))
        k = int(files[j])
        return k, int(rows[k][position - (ends[j] - self.rows[k])])

    def load(self, start, iteration, seed, rows=None):
        """Rows start + rows (default: the whole batch) of every top, reading those rows
        alone, as float32."""
        rows = range(self.batch) if rows is None else rows
        places = [self._where(start + r, seed) for r in rows]
        tops = [np.empty((len(rows),) + self.files[0][t].shape[1:], np.float32)
                for t in self.lp.top]
        for k in sorted({p[0] for p in places}):
            mine = [(i, row) for i, (f, row) in enumerate(places) if f == k]
            wanted = sorted({row for _, row in mine})   # h5py reads increasing rows
            for top, name in zip(tops, self.lp.top):
                values = self.files[k][name][wanted]
                at = {row: j for j, row in enumerate(wanted)}
                for i, row in mine:
                    top[i] = values[at[row]]
        return tops
