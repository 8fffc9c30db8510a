"""`cgp convert` and `cgp compute-mean`: write Caffe databases of Datum records and mean
images, as Caffe's tools do: MNIST or CIFAR-10 as an LMDB (convert_mnist_data,
convert_cifar_data), images named by a list file as an LMDB or LevelDB, raw or encoded
(convert_imageset), and the mean image of a database (compute_image_mean).

MNIST and CIFAR-10 records keep the files' order (neither Caffe tool shuffles), with Caffe's
keys: the zero-padded index, 8 digits for MNIST and 5 for CIFAR-10; an image set's keys are
convert_imageset's, '%08d_<path>'. A raw Datum holds channels, height, width, the uint8
pixels (C x H x W, BGR for color images, as OpenCV reads them) and the label; an encoded one
the image file's bytes and the label. It reads the data sets through cgp.datasets, images
through cgp.data.images, and databases through cgp.data.lmdb_data.
"""
from pathlib import Path

import numpy as np

from cgp.data import images as imagelib
from cgp.datasets import store
from cgp.errors import CgpError, DataError
from cgp.data.databases import open_database
from cgp.data.lmdb_data import require_lmdb
from cgp.proto import caffe_pb2
from cgp.snapshot import atomic_write, writable_folder

KEY_DIGITS = {"mnist": 8, "cifar10": 5}
COMMIT_EVERY = 1000    # records per transaction, as convert_mnist_data commits
DEFAULT_MAP_SIZE = 1 << 20   # liblmdb's default, where Caffe's LMDB writer starts
BACKENDS = ("lmdb", "leveldb")


def datum_bytes(image, label):
    """A serialized Datum for one uint8 image (C, H, W) and its label."""
    c, h, w = image.shape
    datum = caffe_pb2.Datum(channels=c, height=h, width=w, data=image.tobytes(), label=int(label))
    return datum.SerializeToString()


def write_lmdb(out, images, labels, digits, log=print):
    """Create the LMDB folder `out` with one Datum per image, keys '%0{digits}d'."""
    records = ((f"{i:0{digits}d}".encode(), datum_bytes(images[i], labels[i]))
               for i in range(len(images)))
    count = write_db(out, records, "lmdb")
    log(f"Processed {count} files.")


def _batches(records, size=COMMIT_EVERY):
    batch = []
    for record in records:
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_db(out, records, backend, log=None):
    """Create the database folder `out` ("lmdb" or "leveldb") holding the (key, value) pairs
    of the iterable `records`; returns how many. Written as Caffe's db_lmdb.cpp and
    db_leveldb.cpp write: batches of COMMIT_EVERY records, one transaction each; an LMDB
    starts from LMDB's default map size and doubles it whenever a batch does not fit, so the
    file comes out as Caffe's tools make it. log, if given, hears "Processed N files." after
    each batch, as convert_imageset says."""
    out = Path(out)
    if out.exists():
        raise CgpError(f"{out} already exists: cgp creates a new database (remove it first)")
    count = 0
    if backend == "leveldb":
        from cgp.data.leveldb_data import open_db
        db = open_db(out, create=True)
        try:
            for batch in _batches(records):
                with db.write_batch() as writes:
                    for key, value in batch:
                        writes.put(key, value)
                count += len(batch)
                if log:
                    log(f"Processed {count} files.")
        finally:
            db.close()
        return count
    lmdb = require_lmdb(f"LMDB {out}")
    try:
        env = lmdb.open(str(out), map_size=DEFAULT_MAP_SIZE, subdir=True)
    except (lmdb.Error, OSError) as e:
        raise DataError(f"LMDB {out}: cannot create: {e}") from None
    try:
        for batch in _batches(records):
            while True:
                try:
                    with env.begin(write=True) as txn:
                        for key, value in batch:
                            txn.put(key, value)
                    break
                except lmdb.MapFullError:
                    env.set_mapsize(2 * env.info()["map_size"])
            count += len(batch)
            if log:
                log(f"Processed {count} files.")
    except lmdb.Error as e:
        raise DataError(f"LMDB {out}: cannot write: {e}") from None
    finally:
        env.close()
    return count


def mean_blob(total, count):
    """Caffe's compute_image_mean result: the float32 sum over `count` records divided by
    the count in float32, as a BlobProto in the legacy 1 x C x H x W form Caffe writes."""
    mean = total / np.float32(count)
    c, h, w = total.shape
    blob = caffe_pb2.BlobProto(num=1, channels=c, height=h, width=w)
    blob.data.extend(mean.ravel().tolist())
    return blob


def image_mean(images):
    """Caffe's compute_image_mean of an array of images (N, C, H, W): sums in float32,
    record by record. Returns the BlobProto."""
    total = np.zeros(images.shape[1:], np.float32)
    for image in images:
        total += image          # uint8 -> float32, one rounding per addition as Caffe's
    return mean_blob(total, len(images))


def convert(dataset, out, split="train", data_dir=None, download=True, limit=None, mean=None,
            log=print):
    if dataset not in KEY_DIGITS:
        raise CgpError(f"cgp convert: unknown data set '{dataset}'; known: "
                       f"{', '.join(KEY_DIGITS)}")
    if limit is not None and limit < 1:
        raise CgpError(f"--limit must be at least 1, got {limit}")
    require_lmdb(f"LMDB {out}")
    for path in (out, mean) if mean else (out,):   # before any work that would be lost
        writable_folder(path)
    images, labels = store.load(dataset, split, data_dir, download)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    log(f"cgp convert: {dataset} {split}, {len(images)} records of {images.shape[1:]} -> {out}")
    write_lmdb(out, images, labels, KEY_DIGITS[dataset], log)
    if mean:
        atomic_write(mean, image_mean(images).SerializeToString())
        log(f"Mean image written to {mean}")


def match_ext(path, kind):
    """Caffe's matchExt: whether the file's extension is `kind` (jpeg counting as jpg)."""
    ext = path.rpartition(".")[2].lower() if "." in path else path.lower()
    kind = kind.lower()
    return ext == kind or (kind == "jpg" and ext == "jpeg")


def imageset_records(root, listfile, lines, height, width, gray, encoded, encode_type,
                     check_size):
    """(key, Datum bytes) of each list line, as convert_imageset's ReadImageToDatum makes
    them: the image decoded (which checks it), resized, and stored raw (C x H x W, BGR), or
    encoded: the file's own bytes where it is not resized and already of the asked kind,
    else encoded again."""
    first = None
    for line_id, (path, label, number) in enumerate(lines):
        where = f"image list {listfile}:{number} ('{path}')"
        full = root + path       # Caffe prepends the root folder as it is
        if not Path(full).is_file():
            raise DataError(f"{where}: image not found at {Path(full).absolute()}")
        image = imagelib.read_image(full, height, width, not gray, where)
        if check_size:
            first = first or image.shape
            if image.shape != first:
                raise DataError(f"{where}: image is {image.shape[1]}x{image.shape[0]}, the "
                                f"first {first[1]}x{first[0]} (--check_size)")
        if encoded:
            kind = encode_type or (path.rpartition(".")[2].lower() if "." in path else "")
            if not kind:
                raise DataError(f"{where}: cannot guess the encoding from the file name; give "
                                "--encode_type")
            if not height and not width and match_ext(path, kind):
                data = Path(full).read_bytes()
            else:
                data = imagelib.encode(image, kind, where)
            value = caffe_pb2.Datum(data=data, label=label, encoded=True).SerializeToString()
        else:
            value = datum_bytes(np.ascontiguousarray(image.transpose(2, 0, 1)), label)
        yield f"{line_id:08d}_{path}".encode(), value


def convert_imageset(root, listfile, out, resize_height=0, resize_width=0, gray=False,
                     shuffle=False, encoded=False, encode_type="", backend="lmdb",
                     check_size=False, seed=0, log=print):
    """Caffe's convert_imageset: the images of `listfile` (lines 'path label'), each path
    prefixed by `root`, into a new database `out`. shuffle: the lines in a random order
    drawn from `seed` (Caffe draws it from its own generator)."""
    if backend not in BACKENDS:
        raise CgpError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if (resize_height > 0) != (resize_width > 0) or min(resize_height, resize_width) < 0:
        raise CgpError("give --resize_height and --resize_width together, both positive")
    imagelib.require_pillow("cgp convert imageset")
    writable_folder(out)
    lines = imagelib.read_list(listfile)
    if shuffle:
        log("Shuffling data")
        lines = [lines[i] for i in np.random.default_rng(seed).permutation(len(lines))]
    log(f"A total of {len(lines)} images.")
    records = imageset_records(root, listfile, lines, resize_height, resize_width, gray,
                               encoded, encode_type, check_size)
    write_db(out, records, backend, log)


def compute_mean(db, out=None, backend=None, log=print):
    """Caffe's compute_image_mean: the mean image of every record of the database `db`
    (encoded records decoded with their own channels), summed in float32 record by record;
    written to `out` as a .binaryproto if given. Returns the mean as (C, H, W) float32."""
    if out:
        writable_folder(out)
    records = open_database(db, backend, what="database")
    try:
        total, count = None, 0
        for start in range(0, len(records), COMMIT_EVERY):
            images, _ = records.read(start, min(COMMIT_EVERY, len(records) - start))
            for j, image in enumerate(images):
                if total is None:
                    total = np.zeros(image.shape, np.float32)
                elif image.shape != total.shape:
                    raise DataError(f"{records.where(start + j)}: image of shape {image.shape},"
                                    f" the first {total.shape}; a mean needs one shape")
                total += image
            count += len(images)
    finally:
        records.close()
    log(f"Processed {count} files.")
    blob = mean_blob(total, count)
    if out:
        atomic_write(out, blob.SerializeToString())
        log(f"Write to {out}")
    mean = np.array(blob.data, np.float32).reshape(total.shape)
    log(f"Number of channels: {mean.shape[0]}")
    for c, value in enumerate(mean.reshape(mean.shape[0], -1).mean(axis=1, dtype=np.float64)):
        log(f"mean_value channel [{c}]: {value:g}")
    return mean
