"""Reader for IDX files (the MNIST format), plain or gzip-compressed, into numpy uint8 arrays.
Only the unsigned-byte data type (0x08) is supported; the other IDX types (int8, int16, int32,
float32, float64) raise DataError."""

import gzip
import math
import zlib
from pathlib import Path

import numpy as np

from cgp.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"
UBYTE = 0x08
TYPE_NAMES = {0x08: "unsigned byte", 0x09: "signed byte", 0x0B: "int16", 0x0C: "int32",
              0x0D: "float32", 0x0E: "float64"}


def read_bytes(path):
    """The file's contents, gunzipped if they start with the gzip magic bytes 1f 8b.

    The contents decide, not the name: mirrors and users rename files, and some tools
    gunzip a file but keep its .gz name."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror or error}") from None
    if data[:2] != GZIP_MAGIC:
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:  # bad header or CRC, cut short, bad stream
        raise DataError(f"{path}: corrupt gzip data: {error}") from None


def read_idx(path, ndim=None):
    """Read an IDX file into a writable uint8 array with the shape its header gives.

    Header: magic 0x0000TTDD (TT data type, DD number of dimensions), then DD big-endian
    uint32 sizes, then exactly prod(sizes) bytes of data.
    ndim: the number of dimensions required (3 for images, 1 for labels), or None for any."""
    path = Path(path)
    data = read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: truncated: {len(data)} bytes, too short for an IDX header")
    magic = int.from_bytes(data[:4], "big")
    dtype, dims = data[2], data[3]
    if data[0] != 0 or data[1] != 0:
        raise DataError(f"{path}: not an IDX file: magic number 0x{magic:08X}, expected "
                        f"0x0000TTDD (0x00000803 for images, 0x00000801 for labels)")
    if dtype != UBYTE:
        kind = TYPE_NAMES.get(dtype, "unknown type")
        raise DataError(f"{path}: magic number 0x{magic:08X}: IDX data type 0x{dtype:02X} ({kind}) "
                        f"is not supported, only 0x08 (unsigned byte)")
    if ndim is not None and dims != ndim:
        raise DataError(f"{path}: magic number 0x{magic:08X} means {dims}-d data, "
                        f"expected {ndim}-d (0x{0x800 + ndim:08X})")
    header = 4 + 4 * dims
    if len(data) < header:
        raise DataError(f"{path}: truncated: the header of {dims}-d data needs {header} bytes, "
                        f"found {len(data)}")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    expected = math.prod(shape)
    found = len(data) - header
    if found < expected:
        raise DataError(f"{path}: truncated: expected {expected} bytes of data, found {found}")
    if found > expected:
        raise DataError(f"{path}: {found - expected} unexpected bytes after the {expected} bytes "
                        f"of data that the header {shape} announces")
    # frombuffer over bytes is read-only; the copy gives callers an array they may modify.
    return np.frombuffer(data, np.uint8, count=expected, offset=header).reshape(shape).copy()
