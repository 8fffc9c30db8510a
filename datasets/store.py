"""Where data sets live: find a local copy in a fixed order, else download one and verify it.
It does not parse the files (mnist.py and cifar10.py do) and keeps nothing in memory."""

import hashlib
import http.client
import os
import sys
import tarfile
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import cgp.datasets
from cgp.datasets import cifar10, mnist
from cgp.errors import DataError

try:
    from tqdm import tqdm
except ImportError:  # the bar is a nicety: downloads work without it
    tqdm = None

ENV_VAR = "CGP_DATA_DIR"
TIMEOUT = 60        # seconds of silence from a server before that mirror counts as failed
CHUNK = 1 << 20
# What a failed download raises: URLError/HTTPError and socket errors are OSErrors,
# IncompleteRead is an HTTPException, an unknown URL scheme is a ValueError.
NETWORK_ERRORS = (OSError, http.client.HTTPException, ValueError)


@dataclass(frozen=True)
class Source:
    """A file to download and the checksum its publisher gives for it."""
    filename: str
    algo: str    # "md5" or "sha256": whichever is published, so anyone can check it by hand
    digest: str


@dataclass(frozen=True)
class DataSet:
    reader: object           # module with missing(root) -> [names] and load(split, root)
    sources: tuple           # Source, ...
    mirrors: tuple           # base URLs tried in turn; a file's URL is base + filename
    members: tuple = ()      # for tar archives: the members to extract, by exact name


# MNIST: the md5 sums of the .gz files that the mirrors serve, as torchvision publishes them
# (torchvision/datasets/mnist.py). The copy bundled in datasets/mnist/ was recompressed
# (gzip -9 -n), so its .gz files have other sums (datasets/mnist/SHA256SUMS) but the same content.
# CIFAR-10: the md5 published on https://www.cs.toronto.edu/~kriz/cifar.html.
DATASETS = {
    "mnist": DataSet(
        reader=mnist,
        sources=(Source("train-images-idx3-ubyte.gz", "md5", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
                 Source("train-labels-idx1-ubyte.gz", "md5", "d53e105ee54ea40749a09fcbcd1e9432"),
                 Source("t10k-images-idx3-ubyte.gz", "md5", "9fb629c4189551a2d022fa330f9573f3"),
                 Source("t10k-labels-idx1-ubyte.gz", "md5", "ec29112dd5afa0611ce80d1b7f02629c")),
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "http://yann.lecun.com/exdb/mnist/")),
    "cifar10": DataSet(
        reader=cifar10,
        sources=(Source("cifar-10-binary.tar.gz", "md5", "c32a1d4ab5d03f1284b67883e8d87530"),),
        mirrors=("https://www.cs.toronto.edu/~kriz/",),
        members=tuple(f"{cifar10.FOLDER}/{name}"
                      for names in cifar10.FILES.values() for name in names)),
}


def load(name, split, data_dir=None, download=True):
    """locate() the data set, then read one split: images uint8 (N, C, H, W), labels uint8 (N,)."""
    return dataset(name).reader.load(split, locate(name, data_dir, download))


def dataset(name):
    """The registry entry for `name`; DataError naming the known ones otherwise."""
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}: known are {', '.join(DATASETS)}")
    return DATASETS[name]


def locate(name, data_dir=None, download=True, mirrors=None):
    """The folder that holds data set `name`, looked for in this order:

    1. data_dir (the --data-dir option): the files in data_dir itself or in data_dir/<name>.
       If they are in neither, DataError at once: an explicit choice never falls back.
    2. $CGP_DATA_DIR/<name>: CGP_DATA_DIR is a root holding one folder per data set.
    3. the copy shipped with the package, <cgp.datasets>/<name> (MNIST only).
    4. the user cache, $XDG_CACHE_HOME/cgp/<name>, or ~/.cache/cgp/<name>.
    5. if download is true, a download into that cache from `mirrors` (base URLs; default the
       data set's own), each file verified against its published checksum.
    Otherwise one DataError lists every place looked, every URL tried and how to get the data."""
    spec = dataset(name)
    if data_dir is not None:
        return _in_data_dir(name, spec, Path(data_dir))
    looked = ["--data-dir: not given"]
    places = []
    if os.environ.get(ENV_VAR):
        places.append((f"${ENV_VAR}/{name}", Path(os.environ[ENV_VAR]) / name))
    else:
        looked.append(f"${ENV_VAR}: not set")
    places.append(("package copy", package_dir(name)))
    places.append(("user cache", cache_dir(name)))
    for label, folder in places:
        absent = _absent(spec, folder)
        if absent is None:
            return folder
        looked.append(f"{label} {folder}: {absent}")
    failures = ["not tried: download is off"]
    if download:
        failures = _download(spec, cache_dir(name), mirrors or spec.mirrors)
        if not failures:
            return cache_dir(name)
    raise DataError(_not_found_message(name, spec, mirrors or spec.mirrors, looked, failures))


def package_dir(name):
    """The copy of data set `name` shipped in the package (it may not exist)."""
    return Path(cgp.datasets.__file__).parent / name


def cache_dir(name):
    """The per-user download folder: $XDG_CACHE_HOME/cgp/<name>, or ~/.cache/cgp/<name>."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative path, as if the variable were unset.
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "cgp" / name


def fetch(url, path, algo, digest, timeout=TIMEOUT):
    """Download url to path, atomically: into a temporary file beside path, checked against
    the hex digest, then renamed. On any failure the temporary file is deleted and path is
    untouched; a checksum mismatch raises DataError, network failures their own errors."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"cgp: downloading {url}", file=sys.stderr)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        checksum = hashlib.new(algo)
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as reply:
            size = int(reply.headers.get("Content-Length") or 0) or None
            for chunk in _chunks(reply, size, path.name):
                out.write(chunk)
                checksum.update(chunk)
        if checksum.hexdigest() != digest:
            raise DataError(f"{url}: {algo} checksum mismatch: expected {digest}, "
                            f"got {checksum.hexdigest()}; the download was deleted")
        os.replace(temp, path)
    finally:
        Path(temp).unlink(missing_ok=True)


def extract(archive, dest, members):
    """Extract the regular files named in `members` from a tar archive into dest.

    Members are matched by exact name against that fixed list, so absolute paths, '..' and
    links in the archive are never written; everything else in it is ignored."""
    dest = Path(dest)
    found = set()
    try:
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                if info.name not in members or not info.isfile():
                    continue
                target = dest / info.name
                target.parent.mkdir(parents=True, exist_ok=True)
                handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
                try:
                    with os.fdopen(handle, "wb") as out, tar.extractfile(info) as data:
                        while chunk := data.read(CHUNK):
                            out.write(chunk)
                    os.replace(temp, target)
                finally:
                    Path(temp).unlink(missing_ok=True)
                found.add(info.name)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise DataError(f"{archive}: cannot extract: {error}") from None
    absent = [name for name in members if name not in found]
    if absent:
        raise DataError(f"{archive}: the archive lacks {', '.join(absent)}")


def _chunks(stream, size, desc):
    """Yield the stream's chunks, with a progress bar on a terminal if tqdm is installed."""
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=desc, disable=None) if tqdm else None
    try:
        while chunk := stream.read(CHUNK):
            if bar:
                bar.update(len(chunk))
            yield chunk
    finally:
        if bar:
            bar.close()


def _in_data_dir(name, spec, data_dir):
    tried = []
    for folder in (data_dir, data_dir / name):
        absent = _absent(spec, folder)
        if absent is None:
            return folder
        tried.append(f"{folder}: {absent}")
    raise DataError(f"--data-dir {data_dir}: no {name} data there:\n  " + "\n  ".join(tried))


def _absent(spec, folder):
    """None if folder holds the data set, else why not."""
    if not folder.is_dir():
        return "a file, not a folder" if folder.exists() else "no such folder"
    names = spec.reader.missing(folder)
    if not names:
        return None
    why = getattr(spec.reader, "foreign", lambda folder: None)(folder)
    return f"missing {', '.join(names)}" + (f"; {why}" if why else "")


def _download(spec, dest, mirrors):
    """Download the data set's sources into dest, trying the mirrors in turn for each, and
    unpack archives. Returns one line per failed attempt if some file could not be had,
    else []."""
    failures = []
    for source in spec.sources:
        path = dest / source.filename
        # fetch() only ever leaves verified files, so one that exists came from an earlier
        # run that stopped before unpacking it or before fetching the other files.
        if path.is_file():
            continue
        for base in mirrors:
            url = base if base.endswith("/") else base + "/"
            url += source.filename
            try:
                fetch(url, path, source.algo, source.digest)
                break
            except (DataError, *NETWORK_ERRORS) as error:
                failures.append(f"{url}: {error}")
        else:
            return failures
    if spec.members:
        for source in spec.sources:
            try:
                extract(dest / source.filename, dest, spec.members)
            except DataError as error:
                return [str(error)]
            (dest / source.filename).unlink()  # the unpacked files replace the archive
    absent = _absent(spec, dest)
    return [f"downloaded into {dest}, but {absent}"] if absent else []


def _not_found_message(name, spec, mirrors, looked, failures):
    urls = [(base if base.endswith("/") else base + "/") + source.filename
            for source in spec.sources for base in mirrors]
    return "\n".join(
        [f"data set {name!r} not found. Looked in:"]
        + [f"  {line}" for line in looked]
        + ["Download:"] + [f"  {line}" for line in failures]
        + ["To get the data, download (one mirror is enough):"] + [f"  {url}" for url in urls]
        + ["then unpack archives, and pass --data-dir DIR with the files in DIR,",
           f"or set {ENV_VAR}=ROOT with the files in ROOT/{name}/."])
