"""Caffe LevelDB databases of Datum records (`backend: LEVELDB`, e.g. Caffe's siamese
example) for the Data layer, read by cgp.data.lmdb_data's reader through `plyvel` (the `leveldb`
extra, a wheel with LevelDB inside), and written by `cgp convert imageset --backend leveldb`.

LevelDB lets one process at a time open a database: every reader in a process shares one
handle, and a process that finds the database locked by another waits a while for it
(MPI ranks on one machine opening it one after the other), then says so.
"""
import os
import threading
import time

from cgp.errors import DataError, require, shorten
from cgp.data.lmdb_data import DatabaseRecords

# How long to wait for a database another process holds open.
LOCK_WAIT_S = 60

# One plyvel.DB per database folder, shared by every reader in the process: [db, users].
_DBS = {}
_DBS_LOCK = threading.RLock()


def require_plyvel(what):
    return require("plyvel", "leveldb", f"{what}: reading and writing LevelDB databases",
                   error=DataError)


def _message(error):
    text = error.args[0] if error.args else error
    return shorten(text.decode(errors="replace") if isinstance(text, bytes) else str(text))


def open_db(path, create=False):
    """A plyvel.DB of the folder `path` (created, with create); errors as DataError."""
    plyvel = require_plyvel(f"LevelDB {shorten(path)}")
    waited = 0.0
    while True:
        try:
            return plyvel.DB(str(path), create_if_missing=create, error_if_exists=create)
        except plyvel.IOError as e:
            if "lock" not in _message(e) or waited >= LOCK_WAIT_S:
                raise DataError(f"LevelDB {shorten(path)}: cannot open: {_message(e)} (LevelDB "
                                "lets one process at a time open a database: convert it to an "
                                "LMDB, which any number of processes read)") from None
        except plyvel.Error as e:
            raise DataError(f"LevelDB {shorten(path)}: cannot {'create' if create else 'open'}: "
                            f"{_message(e)}") from None
        time.sleep(0.1)
        waited += 0.1


class _Cursor:
    """A LevelDB snapshot's iterator with the lmdb cursor calls the reader makes: set_key,
    item, key, next, iternext."""

    def __init__(self, db):
        self.snapshot = db.snapshot()
        self.iterator = self.snapshot.iterator()
        self.current = None

    def set_key(self, key):
        self.iterator.seek(key)
        self.current = next(self.iterator, None)
        return self.current is not None and self.current[0] == key

    def item(self):
        return self.current

    def key(self):
        return self.current[0]

    def next(self):
        self.current = next(self.iterator, None)
        return self.current is not None

    def iternext(self, keys=True, values=True):
        for key, value in self.snapshot.iterator():
            yield (key, value) if keys and values else (key if keys else value)

    def close(self):
        self.iterator.close()
        self.snapshot.close()


class LevelDbStore:
    """How the reader reaches a LevelDB (see lmdb_data.LmdbStore)."""
    kind = "LevelDB"

    def open(self, path):
        key = os.path.realpath(path)
        with _DBS_LOCK:
            if key not in _DBS:
                _DBS[key] = [open_db(path), 0]
            _DBS[key][1] += 1
            return _DBS[key][0]

    def release(self, path):
        key = os.path.realpath(path)
        with _DBS_LOCK:
            entry = _DBS.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    entry[0].close()
                    del _DBS[key]

    def begin(self, db):
        cursor = _Cursor(db)
        return cursor, cursor.close

    def checker(self, path):
        """plyvel hands over copies, never the file's own bytes: nothing to check."""
        return lambda buffer, where: None

    def errors(self):
        try:
            import plyvel
        except ImportError:
            return ()
        return (plyvel.Error,)


class LevelDbRecords(DatabaseRecords):
    """The Datum records of one Caffe LevelDB database (a folder holding CURRENT)."""
    store = LevelDbStore()
