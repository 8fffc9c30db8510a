"""Record sets for the Data layer: Caffe LMDB databases of Datum records, and the bundled
data sets held in memory, behind one small interface (len, shape, read(start, count)).

read(start, count) returns the records start, start+1, ... in key order, wrapping around
at the end as Caffe's reader does, so which records a batch holds is a function of its
start alone. Small databases are decoded once into memory; bigger ones are read batch by
batch by one reader thread that fetches the next batch while the current one trains. It
reads records only: transformations are the Data layer's, writing databases convert.py's.
The `lmdb` package is an optional dependency, imported only when a database is opened.
"""
import collections
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from cgp.errors import DataError
from cgp.proto import caffe_pb2

# Databases whose records take at most this many bytes as float32 are decoded into memory
# once; bigger ones are streamed. Tests lower it to exercise the streaming reader.
CACHE_BYTES = 1 << 30
# One key is kept every ANCHOR_STRIDE records, so that a read can seek to any position
# without a list of every key of a big database.
ANCHOR_STRIDE = 1024


def require_lmdb(what):
    try:
        import lmdb
    except ImportError:
        raise DataError(f"{what}: reading and writing LMDB databases needs the 'lmdb' package: "
                        "pip install 'cgp[lmdb]' (or pip install lmdb)") from None
    return lmdb


class ArrayRecords:
    """Records held in memory: images (M, C, H, W) uint8 or float32, labels (M,)."""

    def __init__(self, images, labels):
        if len(images) == 0:
            raise DataError("the data set holds no records")
        self.images = images
        self.labels = np.asarray(labels, np.float32)
        self.shape = tuple(images.shape[1:])

    def __len__(self):
        return len(self.images)

    def read(self, start, count):
        """Records start, start+1, ... (wrapping): images (count, C, H, W), labels (count,).
        A run that does not wrap is a view of the records (no copy: the caller transforms
        them into arrays of its own)."""
        first = start % len(self.images)
        if first + count <= len(self.images):
            return self.images[first:first + count], self.labels[first:first + count]
        index = (start + np.arange(count)) % len(self.images)
        return self.images[index], self.labels[index]

    def close(self):
        pass


def decode_datum(value, where):
    """One serialized caffe.Datum -> (record (C, H, W) uint8 or float32, label)."""
    datum = caffe_pb2.Datum()
    try:
        datum.ParseFromString(bytes(value))
    except (DecodeError, RuntimeError, ValueError) as e:
        raise DataError(f"{where} is not a caffe Datum ({e})") from None
    if len(unknown_fields.UnknownFieldSet(datum)):
        raise DataError(f"{where} is not a caffe Datum (it holds fields that Datum does not have)")
    if datum.encoded:
        raise DataError(f"{where} is an encoded image (JPEG/PNG bytes); cgp reads raw Datum "
                        "records only: convert the images without --encoded "
                        "(Caffe's convert_imageset --encoded=false)")
    c, h, w = datum.channels, datum.height, datum.width
    if min(c, h, w) <= 0:
        raise DataError(f"{where} is not a caffe Datum (channels x height x width is "
                        f"{c} x {h} x {w})")
    size = c * h * w
    if len(datum.data) == size:
        record = np.frombuffer(datum.data, np.uint8).reshape(c, h, w)
    elif not datum.data and len(datum.float_data) == size:
        record = np.array(datum.float_data, np.float32).reshape(c, h, w)
    else:
        raise DataError(f"{where} is not a caffe Datum ({len(datum.data)} data bytes and "
                        f"{len(datum.float_data)} float_data values for {c} x {h} x {w})")
    return record, datum.label


# One lmdb.Environment per database folder, shared by every reader in the process: LMDB
# forbids opening one database twice in a process.
_ENVS = {}
_ENVS_LOCK = threading.RLock()
# Readers dropped without close(): their finalizer runs from the garbage collector, on
# whichever thread happens to allocate, possibly while it holds a lock that shutting down
# needs (ours, the thread pool's, lmdb's): it only queues the shutdown, and the next reader
# opened, read or closed runs the queue.
_ORPHANS = collections.deque()


def _open_env(path):
    lmdb = require_lmdb(f"LMDB {path}")
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        if key in _ENVS:
            _ENVS[key][1] += 1
            return _ENVS[key][0]
        try:
            # lock=False: never write lock.mdb, so read-only folders work; cgp only reads.
            env = lmdb.open(str(path), readonly=True, lock=False, readahead=False,
                            max_readers=512)
        except lmdb.Error as e:
            raise DataError(f"LMDB {path}: cannot open: {e}") from None
        _ENVS[key] = [env, 1]
        return env


def _release_env(path):
    with _ENVS_LOCK:
        entry = _ENVS.get(os.path.realpath(path))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            entry[0].close()
            del _ENVS[os.path.realpath(path)]


def _key_text(key):
    return bytes(key).decode("ascii", errors="backslashreplace")


class _FloatRecords(Exception):
    """A float_data record among raw ones: decode into float32 instead of uint8."""


class _Cursor:
    """A read transaction and cursor positioned by record index. Used by one thread only."""

    def __init__(self, env, path, anchors, count):
        self.env, self.path, self.anchors, self.count = env, path, anchors, count
        self.txn = None
        self.cursor = None
        self.position = None     # the record index the cursor points at, None if unknown

    def seek(self, index):
        if self.txn is None:
            self.txn = self.env.begin(buffers=True)
            self.cursor = self.txn.cursor()
        if self.position == index:
            return
        anchor, skip = divmod(index, ANCHOR_STRIDE)
        if not self.cursor.set_key(self.anchors[anchor]):
            raise DataError(f"LMDB {self.path}: the database changed while being read "
                            f"(key {_key_text(self.anchors[anchor])} is gone)")
        for _ in range(skip):
            self.cursor.next()
        self.position = index

    def read(self, start, count, shape, dtype):
        """Decode records start.. (wrapping): images (count, *shape) dtype, labels (count,)."""
        images = np.empty((count,) + shape, dtype)
        labels = np.empty(count, np.float32)
        done, index = 0, start % self.count
        while done < count:
            run = min(count - done, self.count - index)
            self.seek(index)
            self.position = None     # unknown until the run is read (an error may stop it)
            for j in range(run):
                key, value = self.cursor.item()
                where = f"LMDB {self.path}: record {index + j} (key {_key_text(key)})"
                record, label = decode_datum(value, where)
                if record.shape != shape:
                    raise DataError(f"{where} has shape {record.shape}, the first record "
                                    f"{shape}; cgp needs records of one shape")
                if record.dtype != dtype and dtype == np.uint8:
                    raise _FloatRecords
                images[done + j] = record
                labels[done + j] = label
                self.cursor.next()
            done += run
            index = (index + run) % self.count
            self.position = index if index else None   # past the end: seek to the start
        return images, labels

    def close(self):
        if self.txn is not None:
            self.txn.abort()
            self.txn = self.cursor = None


class LmdbRecords:
    """The Datum records of one Caffe LMDB database, in key order."""

    def __init__(self, path, cache_bytes=None):
        _shut_down_orphans()
        self.path = Path(path)
        cache_bytes = CACHE_BYTES if cache_bytes is None else cache_bytes
        env = _open_env(self.path)
        try:
            anchors, count, first = self._index(env)
            self.count = count
            record, _ = decode_datum(first, f"LMDB {self.path}: record 0 (key "
                                            f"{_key_text(anchors[0])})")
            self.shape = record.shape
            cursor = _Cursor(env, self.path, anchors, count)
            if count * record.size * 4 <= cache_bytes:
                self._memory = self._decode_all(cursor, record.dtype)
                _release_env(self.path)
                self._reader = None
                return
        except BaseException:
            _release_env(self.path)
            raise
        self._memory = None
        # The one thread that reads the database: it owns the transaction and decodes the
        # next batch while the current one trains.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="cgp-lmdb")
        self._cursor = cursor
        self._pending = None     # (start, count, future) of the batch read ahead
        self._finalizer = weakref.finalize(self, _ORPHANS.append,
                                           (self._reader, cursor, self.path))
        self._finalizer.atexit = False

    def _index(self, env):
        """(every ANCHOR_STRIDE-th key, record count, the first value): one pass over keys."""
        anchors, count = [], 0
        with env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            for key in cursor.iternext(keys=True, values=False):
                if count % ANCHOR_STRIDE == 0:
                    anchors.append(bytes(key))
                count += 1
            if count == 0:
                raise DataError(f"LMDB {self.path}: the database holds no records")
            first = bytes(txn.get(anchors[0]))
        return anchors, count, first

    def _decode_all(self, cursor, dtype):
        """Every record, decoded once: uint8 images if every record is raw bytes."""
        try:
            try:
                images, labels = cursor.read(0, self.count, self.shape, dtype)
            except _FloatRecords:
                images, labels = cursor.read(0, self.count, self.shape, np.float32)
        finally:
            cursor.close()
        return ArrayRecords(images, labels)

    def __len__(self):
        return self.count

    @property
    def cached(self):
        return self._memory is not None

    def read(self, start, count):
        """Records start, start+1, ... (wrapping): images (count, C, H, W), labels (count,)."""
        if self._memory is not None:
            return self._memory.read(start, count)
        if _ORPHANS:
            _shut_down_orphans()
        start %= self.count
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (start, count):
            future = pending[2]
        else:
            # Not the batch read ahead (a jump, e.g. a resume): read this one now. The
            # stale read, if still running, finishes first on the same single thread.
            future = self._reader.submit(self._cursor.read, start, count, self.shape,
                                         np.float32)
        result = future.result()
        following = (start + count) % self.count
        self._pending = (following, count, self._reader.submit(
            self._cursor.read, following, count, self.shape, np.float32))
        return result

    def close(self):
        if self._reader is not None:
            self._pending = None
            args = self._finalizer.detach()
            if args is not None:
                _shut_down(*args[2][0])
        _shut_down_orphans()


def _shut_down_orphans():
    while _ORPHANS:
        try:
            args = _ORPHANS.popleft()
        except IndexError:   # another thread took the last one
            return
        _shut_down(*args)


def _shut_down(reader, cursor, path):
    """Stop the reader thread, end its transaction (on that thread), release the env."""
    try:
        reader.submit(cursor.close)
    except RuntimeError:     # the interpreter is shutting down: nothing left to submit to
        pass
    reader.shutdown(wait=True, cancel_futures=False)
    _release_env(path)
