"""Record sets for the Data layer: Caffe databases of Datum records (LMDB here; LevelDB in
cgp/data/leveldb_data.py, through the same reader) and the bundled data sets held in memory,
behind one small interface (len, shape, read(start, count), where(position), close).

read(start, count) returns the records start, start+1, ... in key order, wrapping around
at the end as Caffe's reader does, so which records a batch holds is a function of its
start alone. A Datum holds raw pixels (or float_data), or an encoded image (JPEG, PNG, as
convert_imageset --encoded writes) that is decoded only when its record is read (cgp.data.images),
so a process decodes only the records it reads. Small databases are read once into memory
(raw records decoded, encoded ones kept as bytes); bigger ones are read batch by batch by one
reader thread that fetches the next batch while the current one trains. It reads records
only: transformations are the Data layer's, writing databases convert.py's. The `lmdb`
package is an optional dependency, imported only when a database is opened.
"""
import collections
import os
import signal
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from cgp.data import images
from cgp.errors import DataError, require, shorten
from cgp.proto import caffe_pb2

# Databases whose records take at most this many bytes (raw records as float32, encoded
# ones as stored) are read into memory once; bigger ones are streamed. Tests lower it to
# exercise the streaming reader.
CACHE_BYTES = 1 << 30
# One key is kept every ANCHOR_STRIDE records, so that a read can seek to any position
# without a list of every key of a big database.
ANCHOR_STRIDE = 1024


def require_lmdb(what):
    return require("lmdb", "lmdb", f"{what}: reading and writing LMDB databases",
                   error=DataError)


class ArrayRecords:
    """Records held in memory: images (M, C, H, W) uint8 or float32, labels (M,). name: what
    they are, for messages ("data set mnist:train", "LMDB path")."""

    def __init__(self, images, labels, name="records"):
        if len(images) == 0:
            raise DataError(f"{name}: the data set holds no records")
        self.images = images
        self.labels = np.asarray(labels, np.float32)
        self.shape = tuple(images.shape[1:])
        self.name = name

    def __len__(self):
        return len(self.images)

    def where(self, position):
        """Which record a position (wrapping) is, for a message."""
        return f"{self.name}: record {position % len(self.images)}"

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


def parse_datum(value, where):
    """One serialized caffe.Datum, checked to be one."""
    datum = caffe_pb2.Datum()
    try:
        datum.ParseFromString(bytes(value))
    except (DecodeError, RuntimeError, ValueError, RecursionError) as e:
        raise DataError(f"{where} is not a caffe Datum ({shorten(e)})") from None
    if len(unknown_fields.UnknownFieldSet(datum)):
        raise DataError(f"{where} is not a caffe Datum (it holds fields that Datum does not have)")
    return datum


def decode_datum(value, where, color=None):
    """One serialized caffe.Datum -> (record (C, H, W) uint8 or float32, label). An encoded
    one is decoded as Caffe's DataTransformer does: color True / False forces 3 channels or
    1 (force_color, force_gray), None keeps the image's own (BGR for color). Float records
    holding NaN or infinities are refused: they would only show as a NaN loss."""
    datum = parse_datum(value, where)
    if datum.encoded:
        image = images.decode(datum.data, color, where)
        return np.ascontiguousarray(image.transpose(2, 0, 1)), datum.label
    c, h, w = datum.channels, datum.height, datum.width
    if min(c, h, w) <= 0:
        raise DataError(f"{where} is not a caffe Datum (channels x height x width is "
                        f"{c} x {h} x {w})")
    size = c * h * w
    if len(datum.data) == size:
        record = np.frombuffer(datum.data, np.uint8).reshape(c, h, w)
    elif not datum.data and len(datum.float_data) == size:
        record = np.array(datum.float_data, np.float32).reshape(c, h, w)
        if not np.isfinite(record).all():
            at = np.unravel_index(np.flatnonzero(~np.isfinite(record))[0], record.shape)
            raise DataError(f"{where} holds {record[at]} at (channel, row, column) "
                            f"{tuple(int(i) for i in at)}; float_data must be finite")
    else:
        raise DataError(f"{where} is not a caffe Datum ({len(datum.data)} data bytes and "
                        f"{len(datum.float_data)} float_data values for {c} x {h} x {w})")
    return record, datum.label


# -- LMDB ---------------------------------------------------------------------------------

# One lmdb.Environment per database folder, shared by every reader in the process: LMDB
# forbids opening one database twice in a process.
_ENVS = {}
_ENVS_LOCK = threading.RLock()


def _open_env(path):
    """The shared lmdb.Environment of database folder `path`, checked (_check_env)."""
    lmdb = require_lmdb(f"LMDB {shorten(path)}")
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
            raise DataError(f"LMDB {shorten(path)}: cannot open: {shorten(e)} (not an LMDB "
                            "database, or a damaged one)") from None
        try:
            extent = _check_env(env, path)
            _walk_in_child(path)
        except BaseException:
            env.close()
            raise
        _ENVS[key] = [env, 1, extent]
        return env


# Walks every record's key and value, reading neither: what _index then does in this
# process, and what LMDB may end with an assertion (SIGABRT) on a damaged page.
_WALK = """import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, readahead=False, max_readers=512)
with env.begin(buffers=True) as txn:
    for record in txn.cursor().iternext(keys=True, values=True):
        pass
"""


def _walk_in_child(path):
    """Where LMDB could return an error for a damaged page, it sometimes asserts and aborts
    the process instead (mdb_cursor_next on a page of the wrong type): the walk runs first
    in a child process, whose death is one DataError here. An error the child meets is
    left to this process's own walk, which says it. A child that cannot start is skipped."""
    size = os.path.getsize(Path(path) / "data.mdb")
    try:
        child = subprocess.run([sys.executable, "-c", _WALK, str(path)], capture_output=True,
                               text=True, timeout=60 + size / 50e6)
    except subprocess.TimeoutExpired:
        raise DataError(f"LMDB {shorten(path)}: walking its records did not end (a damaged "
                        "database whose pages form a loop?); copy the database again") from None
    except OSError:
        return
    if child.returncode < 0:
        raise DataError(f"LMDB {shorten(path)} is damaged: reading it ended the reader with "
                        f"{signal.Signals(-child.returncode).name} "
                        f"({shorten(child.stderr.strip()) or 'no message'}); copy the database "
                        "again")


def _check_env(env, path):
    """What can be checked of a database before reading it: that data.mdb holds every page
    the database says it has (a copy cut short would otherwise end the process with
    SIGBUS on the first read past its end). Returns (first, past the last) address of the
    file's bytes in the environment's memory map, which reads check records against."""
    import lmdb
    try:
        info, page = env.info(), env.stat()["psize"]
    except lmdb.Error as e:
        raise DataError(f"LMDB {shorten(path)}: cannot read: {shorten(e)}") from None
    size = os.path.getsize(Path(path) / "data.mdb")
    need = (info["last_pgno"] + 1) * page
    if size < need:
        raise DataError(f"LMDB {shorten(path)}: data.mdb is truncated or damaged: "
                        f"{size} bytes, but its last page ({info['last_pgno']}) ends at byte "
                        f"{need}; copy the database again")
    start = _map_start(Path(path) / "data.mdb")
    return None if start is None else (start, start + size)


def _map_start(file):
    """The address at which this process maps `file` (the line of /proc/self/maps for its
    offset 0), or None where that cannot be told: not Linux, or the file mapped twice.
    The binding does not say where LMDB maps a database."""
    target = os.path.realpath(file)
    starts = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5] == target and int(fields[2], 16) == 0:
                    starts.append(int(fields[0].split("-")[0], 16))
    except (OSError, ValueError):
        return None
    return starts[0] if len(starts) == 1 else None


def _extent(path):
    with _ENVS_LOCK:
        return _ENVS[os.path.realpath(path)][2]


def _address(buffer):
    """Where a buffer that LMDB handed over starts in memory (without reading it)."""
    return np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]


def _check_inside(buffer, extent, where):
    """A key or value must lie inside the file: a damaged size field would otherwise point
    past its end, where reading ends the process with SIGBUS."""
    if extent is None:
        return
    start = _address(buffer)
    if len(buffer) and not extent[0] <= start <= start + len(buffer) <= extent[1]:
        raise DataError(f"{where} is damaged: its {len(buffer)} bytes would lie outside "
                        "data.mdb; copy the database again")


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
    return shorten(bytes(key).decode("ascii", errors="backslashreplace"), 100)


def _lmdb_errors():
    """The lmdb binding's error class, for except clauses (the package may be missing)."""
    try:
        import lmdb
    except ImportError:
        return ()
    return (lmdb.Error,)


class LmdbStore:
    """How the reader reaches an LMDB: open and release its environment (shared in the
    process, checked: _open_env), begin a read transaction whose cursor has lmdb's set_key,
    item, key, next and iternext, check that what it hands over lies inside data.mdb, and
    which errors of the binding a damaged database raises."""
    kind = "LMDB"

    def open(self, path):
        return _open_env(path)

    def release(self, path):
        _release_env(path)

    def begin(self, env):
        """(cursor, end): a cursor of a new read transaction, and the call that ends it."""
        txn = env.begin(buffers=True)
        return txn.cursor(), txn.abort

    def checker(self, path):
        """check(buffer, where): refuses a key or value outside the file (_check_inside)."""
        extent = _extent(path)
        return lambda buffer, where: _check_inside(buffer, extent, where)

    def errors(self):
        return _lmdb_errors()


# -- the reader, for any store ---------------------------------------------------------------

# Readers dropped without close(): their finalizer runs from the garbage collector, on
# whichever thread happens to allocate, possibly while it holds a lock that shutting down
# needs (ours, the thread pool's, the database's): it only queues the shutdown, and the next
# reader opened, read or closed runs the queue.
_ORPHANS = collections.deque()


class _FloatRecords(Exception):
    """A float_data record among raw ones: decode into float32 instead of uint8."""


class _Cursor:
    """A read transaction and cursor positioned by record index. Used by one thread only."""

    def __init__(self, store, handle, path, anchors, count):
        self.store, self.handle, self.path = store, handle, path
        self.anchors, self.count = anchors, count
        self.check = store.checker(path)
        self.cursor = None
        self._end = None
        self.position = None     # the record index the cursor points at, None if unknown

    def seek(self, index):
        if self.cursor is None:
            self.cursor, self._end = self.store.begin(self.handle)
        if self.position == index:
            return
        anchor, skip = divmod(index, ANCHOR_STRIDE)
        if not self.cursor.set_key(self.anchors[anchor]):
            raise DataError(f"{self.store.kind} {shorten(self.path)}: the database changed "
                            f"while being read (key {_key_text(self.anchors[anchor])} is gone)")
        for _ in range(skip):
            self.cursor.next()
        self.position = index

    def values(self, start, count):
        """[(where, value bytes), ...] of records start.. (wrapping). The store's errors (a
        damaged page) become a DataError naming the database."""
        try:
            return self._values(start, count)
        except self.store.errors() as e:
            self.position = None
            raise DataError(f"{self.store.kind} {shorten(self.path)}: cannot read records from "
                            f"{start} on: {shorten(e)} (a damaged database: copy it "
                            "again)") from None

    def key(self, index):
        """The key of record `index`, for a message."""
        self.seek(index)
        self.position = None
        return _key_text(self.cursor.key())

    def _values(self, start, count):
        out = []
        index = start % self.count
        while len(out) < count:
            run = min(count - len(out), self.count - index)
            self.seek(index)
            self.position = None     # unknown until the run is read (an error may stop it)
            for j in range(run):
                key, value = self.cursor.item()
                where = (f"{self.store.kind} {shorten(self.path)}: record {index + j} "
                         f"(key {_key_text(key)})")
                self.check(value, where)
                out.append((where, bytes(value)))
                self.cursor.next()
            index = (index + run) % self.count
            self.position = index if index else None   # past the end: seek to the start
        return out

    def close(self):
        if self.cursor is not None:
            self._end()
            self.cursor = self._end = None


class _Decoder:
    """Decodes a database's records: what the reader thread needs of its DatabaseRecords,
    without holding on to it (a reader dropped unclosed must be collectable)."""

    def __init__(self, color, encoded, shape=None):
        self.color, self.encoded, self.shape = color, encoded, shape
        self.decoded = 0      # encoded images decoded so far

    def decode(self, where, value):
        record, label = decode_datum(value, where, self.color)
        if self.encoded:
            self.decoded += 1
        return record, label

    def assemble(self, values, dtype):
        """Decode [(where, value), ...] -> (images, labels): images (n, C, H, W) of dtype,
        or for encoded records of several shapes a list of (C, H, W) uint8 arrays."""
        records, labels = [], np.empty(len(values), np.float32)
        for j, (where, value) in enumerate(values):
            record, labels[j] = self.decode(where, value)
            if record.shape != self.shape and not self.encoded:
                raise DataError(f"{where} has shape {record.shape}, the first record "
                                f"{self.shape}; cgp needs records of one shape")
            if record.dtype != dtype and dtype == np.uint8:
                if self.encoded:
                    raise DataError(f"{where} holds float_data among encoded images; cgp "
                                    "needs a database of one kind of record")
                raise _FloatRecords
            records.append(record)
        if any(r.shape != records[0].shape for r in records):
            return records, labels
        batch = np.empty((len(records),) + records[0].shape, dtype)
        for j, record in enumerate(records):
            batch[j] = record
        return batch, labels


def _read(cursor, decoder, start, count):
    """On the reader thread: records start.. decoded (raw ones as float32: a float_data
    record may come)."""
    return decoder.assemble(cursor.values(start, count),
                            np.uint8 if decoder.encoded else np.float32)


class DatabaseRecords:
    """The Datum records of one Caffe database, in key order. color: how encoded images
    decode (see decode_datum)."""
    store = LmdbStore()

    def __init__(self, path, cache_bytes=None, color=None):
        _shut_down_orphans()
        self.path = Path(path)
        self.name = f"{self.store.kind} {shorten(self.path)}"
        cache_bytes = CACHE_BYTES if cache_bytes is None else cache_bytes
        handle = self.store.open(self.path)
        try:
            try:
                anchors, count, first = self._index(handle)
            except self.store.errors() as e:
                raise DataError(f"{self.name}: cannot read: {shorten(e)} (a damaged database: "
                                "copy it again)") from None
            self.count = count
            self._anchors = anchors
            where = f"{self.name}: record 0 (key {_key_text(anchors[0])})"
            self._decoder = _Decoder(color, parse_datum(first, where).encoded)
            record, _ = self._decoder.decode(where, first)
            self.shape = self._decoder.shape = record.shape
            cursor = _Cursor(self.store, handle, self.path, anchors, count)
            # Encoded records are kept as bytes: about the first one's size each.
            size = count * (len(first) if self.encoded else record.size * 4)
            if size <= cache_bytes:
                self._memory = self._read_all(cursor, record.dtype)
                self.store.release(self.path)
                self._reader = None
                return
        except BaseException:
            self.store.release(self.path)
            raise
        self._memory = None
        # The one thread that reads the database: it owns the transaction and decodes the
        # next batch while the current one trains.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"cgp-{self.store.kind}")
        self._cursor = cursor
        self._pending = None     # (start, count, future) of the batch read ahead
        self._last = None        # the start of the last read, to guess the next one
        self._finalizer = weakref.finalize(self, _ORPHANS.append,
                                           (self._reader, cursor, self.store, self.path))
        self._finalizer.atexit = False

    def _index(self, handle):
        """(every ANCHOR_STRIDE-th key, record count, the first value): one pass over the
        records, which checks that each key and value lies inside the file (not reading
        them)."""
        anchors, count, first = [], 0, None
        check = self.store.checker(self.path)
        cursor, end = self.store.begin(handle)
        try:
            for key, value in cursor.iternext(keys=True, values=True):
                where = f"{self.name}: record {count}"
                check(key, f"{where}'s key")
                check(value, where)
                if count % ANCHOR_STRIDE == 0:
                    anchors.append(bytes(key))
                if count == 0:
                    first = bytes(value)
                count += 1
        finally:
            end()
        if count == 0:
            raise DataError(f"{self.name}: the database holds no records")
        return anchors, count, first

    @property
    def encoded(self):
        return self._decoder.encoded

    @property
    def decoded(self):
        """How many encoded images this reader has decoded (the first one at opening)."""
        return self._decoder.decoded

    def _read_all(self, cursor, dtype):
        """Every record into memory: raw ones decoded (uint8 images if every record is raw
        bytes), encoded ones as their bytes, decoded when read."""
        try:
            values = cursor.values(0, self.count)
        finally:
            cursor.close()
        if self.encoded:
            return values
        try:
            images, labels = self._decoder.assemble(values, dtype)
        except _FloatRecords:
            images, labels = self._decoder.assemble(values, np.float32)
        return ArrayRecords(images, labels, name=self.name)

    def __len__(self):
        return self.count

    def where(self, position):
        """Which record a position (wrapping) is, with its key, for a message."""
        index = position % self.count
        where = f"{self.name}: record {index}"
        try:
            handle = self.store.open(self.path)
        except DataError:
            return where
        cursor = _Cursor(self.store, handle, self.path, self._anchors, self.count)
        try:
            return f"{where} (key {cursor.key(index)})"
        except (DataError, *self.store.errors()):
            return where
        finally:
            cursor.close()
            self.store.release(self.path)

    @property
    def cached(self):
        return self._memory is not None

    def read(self, start, count):
        """Records start, start+1, ... (wrapping): images (count, C, H, W) (a list of
        (C, H, W) arrays where encoded images differ in shape), labels (count,)."""
        if isinstance(self._memory, ArrayRecords):
            return self._memory.read(start, count)
        if self._memory is not None:
            first = start % self.count
            index = (first + np.arange(count)) % self.count
            return self._decoder.assemble([self._memory[i] for i in index], np.uint8)
        if _ORPHANS:
            _shut_down_orphans()
        # The next read is guessed to start as far from this one as this one from the last:
        # the batch size, or under MPI, where a process reads its samples of each batch.
        step = start - self._last if self._last is not None and start > self._last else count
        self._last = start
        start %= self.count
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (start, count):
            future = pending[2]
        else:
            # Not the batch read ahead (a jump, e.g. a resume): read this one now. The
            # stale read, if still running, finishes first on the same single thread.
            future = self._reader.submit(_read, self._cursor, self._decoder, start, count)
        result = future.result()
        following = (start + step) % self.count
        self._pending = (following, count, self._reader.submit(
            _read, self._cursor, self._decoder, following, count))
        return result

    def close(self):
        if self._reader is not None:
            self._pending = None
            args = self._finalizer.detach()
            if args is not None:
                _shut_down(*args[2][0])
        _shut_down_orphans()


class LmdbRecords(DatabaseRecords):
    """The Datum records of one Caffe LMDB database (a folder holding data.mdb)."""
    store = LmdbStore()


def _shut_down_orphans():
    while _ORPHANS:
        try:
            args = _ORPHANS.popleft()
        except IndexError:   # another thread took the last one
            return
        _shut_down(*args)


def _shut_down(reader, cursor, store, path):
    """Stop the reader thread, end its transaction (on that thread), release the database."""
    try:
        reader.submit(cursor.close)
    except RuntimeError:     # the interpreter is shutting down: nothing left to submit to
        pass
    reader.shutdown(wait=True, cancel_futures=False)
    store.release(path)
