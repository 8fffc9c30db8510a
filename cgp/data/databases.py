"""Opening a Caffe database folder for reading: an LMDB (cgp.data.lmdb_data) or a LevelDB
(cgp.data.leveldb_data), as the files in it say, checked against the backend a user named."""
from pathlib import Path

from cgp.errors import DataError, shorten
from cgp.data.leveldb_data import LevelDbRecords
from cgp.data.lmdb_data import LmdbRecords


def open_database(path, backend=None, color=None, what="data source"):
    """The records of the Caffe database folder `path`, LMDB (data.mdb) or LevelDB (CURRENT)
    as its files say. backend: "lmdb" or "leveldb" where the user named one, which must be
    what the folder holds (Caffe would fail to open it otherwise); color: see decode_datum."""
    path = Path(path)
    lmdb, leveldb = (path / "data.mdb").is_file(), (path / "CURRENT").is_file()
    if backend == "leveldb" and lmdb or backend == "lmdb" and leveldb:
        found, other = ("LMDB", "LEVELDB") if lmdb else ("LevelDB", "LMDB")
        raise DataError(f"{what} '{shorten(path)}' is an {found} database but its backend is "
                        f"given as {other}: set backend: {found.upper()}")
    if path.is_dir() and lmdb:
        return LmdbRecords(path, color=color)
    if path.is_dir() and (leveldb or backend == "leveldb"):
        return LevelDbRecords(path, color=color)
    if not path.exists():
        raise DataError(f"{what} '{shorten(path)}' not found (looked in {shorten(Path.cwd())})")
    raise DataError(f"{what} '{shorten(path)}' is not a database: {shorten(path.resolve())} "
                    "holds neither data.mdb (LMDB) nor CURRENT (LevelDB)")
