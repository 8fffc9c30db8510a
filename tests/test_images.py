"""Images as Caffe reads them: OpenCV's INTER_LINEAR resize against a NumPy model of its
rules (and how far Pillow's bilinear resize is from it), decoding into BGR, the ImageData
layer, encoded Datum records in an LMDB, `cgp convert imageset` and `cgp compute-mean`, a
process reading only its own samples, and training from images on 1 and 2 workers."""
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from cgp.data import images

from cgp.data import lmdb_data
from cgp.data.convert import compute_mean, convert_imageset
from cgp.errors import DataError
from cgp.layers.data import DataLayer
from cgp.layers.image_data import ImageDataLayer
from cgp.net import RunOptions
from cgp.proto import caffe_pb2
from cgp.train import RunConfig, Trainer

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("lmdb")


# -- OpenCV's INTER_LINEAR ------------------------------------------------------------------

def opencv_linear(src, height, width):
    """NumPy model of cv::resize(src, (width, height), INTER_LINEAR) on uint8 (H, W, C), as
    OpenCV 2.4 / 3.x compute it on x86: source coordinate (d + 0.5) * scale - 0.5 in float32,
    weights (1 - f, f) * 2048 rounded to even, x clamped at the borders with f = 0, rows
    clamped; horizontal sums in int32; the vertical pass in SSE2 arithmetic
    ((s >> 4) * b >> 16, summed, + 2 >> 2) for the elements its vector loops cover and
    (s0 b0 + s1 b1 + 2^21) >> 22 for the rest of each row."""
    H, W, C = src.shape

    def coordinates(n, m):
        f = ((np.arange(m) + 0.5) * (1.0 / (m / n)) - 0.5).astype(np.float32)
        i = np.floor(f).astype(np.int64)
        return i, (f - i.astype(np.float32)).astype(np.float32)

    def weights(f):
        return (np.rint((np.float32(1) - f) * np.float32(2048)).astype(np.int64),
                np.rint(f * np.float32(2048)).astype(np.int64))

    sx, fx = coordinates(W, width)
    fx[(sx < 0) | (sx >= W - 1)] = 0
    sx = np.clip(sx, 0, W - 1)
    a0, a1 = weights(fx)
    sy, fy = coordinates(H, height)
    b0, b1 = weights(fy)
    pixels = src.astype(np.int64)
    h = pixels[:, sx] * a0[None, :, None] + pixels[:, np.minimum(sx + 1, W - 1)] * a1[None, :, None]
    r0 = h[np.clip(sy, 0, H - 1)].reshape(height, -1)
    r1 = h[np.clip(sy + 1, 0, H - 1)].reshape(height, -1)
    b0, b1 = b0[:, None], b1[:, None]
    sse = ((((r0 >> 4) * b0) >> 16) + (((r1 >> 4) * b1) >> 16) + 2) >> 2
    plain = (r0 * b0 + r1 * b1 + (1 << 21)) >> 22
    n = width * C
    covered = 16 * (n // 16)                       # the 16-wide loop, then the 4-wide one
    while covered < n - 4:
        covered += 4
    out = np.where(np.arange(n)[None, :] < covered, sse, plain)
    return np.clip(out, 0, 255).astype(np.uint8).reshape(height, width, C)


SIZES = [((40, 30), (17, 13)), ((64, 48), (32, 24)), ((10, 8), (23, 19)), ((33, 47), (33, 47)),
         ((100, 80), (30, 21)), ((5, 7), (1, 1)), ((1, 9), (4, 3))]


@pytest.mark.parametrize("channels", [1, 3])
def test_resize_is_opencvs_inter_linear(channels):
    rng = np.random.default_rng(channels)
    for (H, W), (h, w) in SIZES:
        src = rng.integers(0, 256, (H, W, channels)).astype(np.uint8)
        assert np.array_equal(images.resize(src, h, w), opencv_linear(src, h, w)), (H, W, h, w)
    # Halving: the two-tap average of 2 x 2 pixels, OpenCV's INTER_AREA fast path's bits.
    src = rng.integers(0, 256, (8, 6, channels)).astype(np.int64)
    area = (src[0::2, 0::2] + src[0::2, 1::2] + src[1::2, 0::2] + src[1::2, 1::2] + 2) >> 2
    assert np.array_equal(images.resize(src.astype(np.uint8), 4, 3), area)


def test_pillows_bilinear_is_not_opencvs():
    """Measured, on uniform noise (3 channels): Pillow's BILINEAR averages over the pixels an
    output pixel covers when it shrinks, so it is far from OpenCV's two-tap blend (up to 124
    levels at 100x80 -> 30x21, 59 at an exact halving); enlarging, both blend two pixels and
    differ by 1 in about a quarter of the pixels (rounding); at the same size neither moves."""
    rng = np.random.default_rng(0)
    measured = {}
    for (H, W), (h, w) in SIZES[:5]:
        src = rng.integers(0, 256, (H, W, 3)).astype(np.uint8)
        pil = np.stack([np.asarray(Image.fromarray(src[:, :, c]).resize((w, h), Image.BILINEAR))
                        for c in range(3)], axis=2)
        measured[(H, W, h, w)] = int(np.abs(pil.astype(int) - opencv_linear(src, h, w)).max())
    assert measured == {(40, 30, 17, 13): 107, (64, 48, 32, 24): 59, (10, 8, 23, 19): 1,
                        (33, 47, 33, 47): 0, (100, 80, 30, 21): 124}


# -- decoding ---------------------------------------------------------------------------------

def save(path, pixels, kind=None):
    """Write an RGB (or gray) uint8 image with Pillow; returns its pixels as cgp reads them
    (BGR, (H, W, C))."""
    Image.fromarray(pixels if pixels.ndim == 2 else pixels).save(path, kind)
    return pixels[:, :, None] if pixels.ndim == 2 else pixels[:, :, ::-1]


def test_decoding_gives_opencvs_channels(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (6, 5, 3)).astype(np.uint8)
    bgr = save(tmp_path / "c.png", rgb)
    gray = save(tmp_path / "g.png", rgb[:, :, 0])
    data = (tmp_path / "c.png").read_bytes()
    assert np.array_equal(images.decode(data, True, "c"), bgr)
    assert np.array_equal(images.decode(data, None, "c"), bgr)          # native: color
    luma = np.asarray(Image.fromarray(rgb).convert("L"))[:, :, None]
    assert np.array_equal(images.decode(data, False, "c"), luma)
    gdata = (tmp_path / "g.png").read_bytes()
    assert np.array_equal(images.decode(gdata, None, "g"), gray)        # native: one channel
    assert np.array_equal(images.decode(gdata, True, "g"), np.repeat(gray, 3, axis=2))
    # A color JPEG read as gray: libjpeg's luma, as OpenCV's reader gives it.
    Image.fromarray(rgb).save(tmp_path / "c.jpg", quality=95)
    jpeg = images.decode((tmp_path / "c.jpg").read_bytes(), False, "j")
    assert jpeg.shape == (6, 5, 1)
    with Image.open(tmp_path / "c.jpg") as im:
        assert np.abs(jpeg[:, :, 0].astype(int) - np.asarray(im.convert("L"))).max() <= 1
    with pytest.raises(DataError, match="^where: not an image that can be decoded"):
        images.decode(b"\x89PNG but not really", None, "where")


# -- ImageData ----------------------------------------------------------------------------------

def write_images(folder, count, rng, size=(10, 12), vary=False):
    """count images (PNG and JPEG) in folder, and list.txt naming them with labels;
    returns the list of (name, label)."""
    folder.mkdir(exist_ok=True)
    entries = []
    for i in range(count):
        h, w = (size[0] + i % 3, size[1] + i % 2) if vary else size
        name = f"im {i}.png" if i % 2 else f"im{i}.jpg"     # a path may hold a space
        Image.fromarray(rng.integers(0, 256, (h, w, 3)).astype(np.uint8)).save(folder / name)
        entries.append((name, i % 5))
    (folder / "list.txt").write_text("".join(f"{n} {l}\n" for n, l in entries))
    return entries


def image_layer(folder, params="", transform="", phase=caffe_pb2.TRAIN, batch=4):
    lp = text_format.Parse(
        f'name: "images" type: "ImageData" top: "data" top: "label" image_data_param {{ '
        f'source: "{folder / "list.txt"}" root_folder: "{folder}/" batch_size: {batch} '
        f'{params} }} transform_param {{ {transform} }}', caffe_pb2.LayerParameter())
    layer = ImageDataLayer(lp, index=0, phase=phase)
    layer.options = RunOptions()
    return layer, layer.setup([])


def test_image_data_reads_the_list_as_caffe(tmp_path):
    rng = np.random.default_rng(2)
    entries = write_images(tmp_path / "img", 7, rng)
    layer, shapes = image_layer(tmp_path / "img", "new_height: 8 new_width: 9")
    assert shapes == [(4, 3, 8, 9), (4,)]
    data, labels = layer.load(5, 0, 0)            # records 5, 6, then 0, 1: wrapping
    want = [images.resize(images.read_image(tmp_path / "img" / entries[i][0], 0, 0, True, ""),
                          8, 9).transpose(2, 0, 1) for i in (5, 6, 0, 1)]
    assert np.array_equal(data, np.array(want, np.float32))
    assert labels.tolist() == [entries[i][1] for i in (5, 6, 0, 1)]
    gray, shapes = image_layer(tmp_path / "img", "is_color: false")
    assert shapes == [(4, 1, 10, 12), (4,)]


def test_image_data_shuffle_is_global_and_seeded(tmp_path):
    """Each epoch a permutation of the list, a function of (seed, epoch): the same for any
    split of the batch, another for another seed or epoch."""
    write_images(tmp_path / "img", 6, np.random.default_rng(3))
    layer, _ = image_layer(tmp_path / "img", "shuffle: true", batch=3)
    epochs = [np.concatenate([layer.load(s, 0, 9)[1] for s in (e * 6, e * 6 + 3)])
              for e in range(3)]
    assert all(sorted(e.tolist()) == [0, 0, 1, 2, 3, 4] for e in epochs)
    labels = [layer.images.line(r, 9)[2] for r in range(18)]
    assert labels[:6] != labels[6:12] and sorted(labels[:6]) == list(range(1, 7))
    assert [layer.images.line(r, 8)[2] for r in range(6)] != labels[:6]
    again, _ = image_layer(tmp_path / "img", "shuffle: true", batch=3)
    assert [again.images.line(r, 9)[2] for r in range(18)] == labels
    # rand_skip: the records start a drawn number (below rand_skip) of lines on, once.
    skipped, _ = image_layer(tmp_path / "img", "rand_skip: 5", batch=3)
    first = [skipped.images.line(r, 9)[2] for r in range(8)]
    assert first[0] <= 5 and first == [(first[0] - 1 + r) % 6 + 1 for r in range(8)]


def test_a_process_decodes_only_its_own_samples(tmp_path):
    """load(..., rows) decodes the images of those samples alone (ImageData and an encoded
    LMDB), and gives what the whole batch gives there, crops and mirrors included."""
    write_images(tmp_path / "img", 9, np.random.default_rng(4), vary=True)
    convert_imageset(f"{tmp_path / 'img'}/", tmp_path / "img" / "list.txt", tmp_path / "db",
                     encoded=True, log=lambda line: None)
    layer, _ = image_layer(tmp_path / "img", "shuffle: true", "crop_size: 8 mirror: true",
                           batch=6)
    lp = text_format.Parse(f'name: "d" type: "Data" top: "data" top: "label" data_param {{ '
                           f'source: "{tmp_path / "db"}" batch_size: 6 backend: LMDB }} '
                           'transform_param { crop_size: 8 mirror: true }',
                           caffe_pb2.LayerParameter())
    data = DataLayer(lp, index=0, phase=caffe_pb2.TRAIN)
    data.options = RunOptions()
    data.setup([])
    assert data.records.encoded and data.records.cached
    for source, counter in ((layer, lambda: layer.images.decoded),
                            (data, lambda: data.records.decoded)):
        whole = source.load(6, 2, 5)
        before = counter()
        part = source.load(6, 2, 5, range(2, 5))
        assert counter() - before == 3
        assert np.array_equal(part[0], whole[0][2:5]) and np.array_equal(part[1], whole[1][2:5])


def test_images_of_several_sizes(tmp_path):
    """With crop_size, images of several sizes crop one at a time (Caffe too); without it
    they are refused, naming the list line."""
    write_images(tmp_path / "img", 4, np.random.default_rng(5), vary=True)
    layer, shapes = image_layer(tmp_path / "img", transform="crop_size: 9",
                                phase=caffe_pb2.TEST)
    assert shapes[0] == (4, 3, 9, 9) and layer.load(0, 0, 0)[0].shape == (4, 3, 9, 9)
    layer, _ = image_layer(tmp_path / "img")
    with pytest.raises(DataError, match=r"list.txt:2 \('im 1.png'\): image is 11x13, the first "
                                        r"10x12: images of several sizes need crop_size"):
        layer.load(0, 0, 0)


def test_image_list_mistakes(tmp_path):
    folder = tmp_path / "img"
    write_images(folder, 3, np.random.default_rng(6))
    text = (folder / "list.txt").read_text()
    (folder / "list.txt").write_text(text + "missing.jpg 1\n")
    layer, _ = image_layer(folder, batch=4)
    with pytest.raises(DataError, match=rf"image list {folder}/list.txt:4 \('missing.jpg'\): "
                                        rf"image not found at {folder}/missing.jpg"):
        layer.load(0, 0, 0)
    (folder / "list.txt").write_text("im0.jpg 1\nim 1.png one\n")
    with pytest.raises(DataError, match=r"list.txt:2: expected 'path label' with an integer "
                                        r"label, got 'im 1.png one'"):
        image_layer(folder)
    (folder / "list.txt").write_text("im0.jpg 1\n")
    with pytest.raises(DataError, match="prepended as it is, as in Caffe: end it with '/'"):
        lp = text_format.Parse(f'name: "i" type: "ImageData" top: "d" top: "l" image_data_param '
                               f'{{ source: "{folder}/list.txt" root_folder: "{folder}" }}',
                               caffe_pb2.LayerParameter())
        ImageDataLayer(lp).setup([])
    (folder / "bad.jpg").write_bytes(b"not a jpeg")
    (folder / "list.txt").write_text("bad.jpg 1\n")
    with pytest.raises(DataError, match=r"layer 'images': image list .*list.txt:1 \('bad.jpg'\): "
                                        "not an image that can be decoded"):
        image_layer(folder)


def test_a_missing_image_on_the_command_line(tmp_path):
    (tmp_path / "list.txt").write_text("gone.png 0\n")
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "i" type: "ImageData" top: "data" top: "label" '
        'image_data_param { source: "list.txt" batch_size: 2 } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        'inner_product_param { num_output: 2 } }')
    out = subprocess.run([sys.executable, "-m", "cgp", "time", "--model", "net.prototxt"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "list.txt:1 ('gone.png'): image not found" in out.stderr


# -- encoded records, convert imageset, compute-mean -----------------------------------------------

def test_convert_imageset_raw_and_encoded(tmp_path):
    rng = np.random.default_rng(7)
    entries = write_images(tmp_path / "img", 5, rng)
    root, listfile = f"{tmp_path / 'img'}/", tmp_path / "img" / "list.txt"
    lines = []
    convert_imageset(root, listfile, tmp_path / "raw", resize_height=6, resize_width=7,
                     log=lines.append)
    assert lines == ["A total of 5 images.", "Processed 5 files."]
    convert_imageset(root, listfile, tmp_path / "enc", encoded=True, log=lines.append)
    convert_imageset(root, listfile, tmp_path / "png", encoded=True, encode_type="png",
                     gray=True, shuffle=True, seed=3, log=lines.append)
    import lmdb
    env = lmdb.open(str(tmp_path / "enc"), readonly=True, lock=False)
    with env.begin() as txn:
        keys = [bytes(k) for k, _ in txn.cursor()]
        first = caffe_pb2.Datum.FromString(txn.get(keys[1]))
    env.close()
    assert keys == [f"{i:08d}_{name}".encode() for i, (name, _) in enumerate(entries)]
    assert first.encoded and first.data == (tmp_path / "img" / "im 1.png").read_bytes()
    raw = lmdb_data.LmdbRecords(tmp_path / "raw")
    enc = lmdb_data.LmdbRecords(tmp_path / "enc")
    png = lmdb_data.LmdbRecords(tmp_path / "png")
    assert not raw.encoded and raw.shape == (3, 6, 7) and enc.shape == (3, 10, 12)
    assert png.shape == (1, 10, 12)
    gray = lmdb_data.LmdbRecords(tmp_path / "enc", color=False)     # force_gray
    assert gray.shape == (1, 10, 12) and gray.read(0, 5)[0].shape == (5, 1, 10, 12)
    gray.close()
    raw_images, labels = raw.read(0, 5)
    enc_images, enc_labels = enc.read(0, 5)
    assert labels.tolist() == enc_labels.tolist() == [l for _, l in entries]
    for i, (name, _) in enumerate(entries):
        pixels = images.read_image(tmp_path / "img" / name, 0, 0, True, "")
        assert np.array_equal(enc_images[i], pixels.transpose(2, 0, 1))
        assert np.array_equal(raw_images[i], images.resize(pixels, 6, 7).transpose(2, 0, 1))
    assert sorted(png.read(0, 5)[1].tolist()) == sorted(labels.tolist())
    mean = compute_mean(tmp_path / "enc", tmp_path / "mean.binaryproto", log=lines.append)
    assert np.allclose(mean, enc_images.astype(np.float64).mean(axis=0), atol=1e-4)
    blob = caffe_pb2.BlobProto.FromString((tmp_path / "mean.binaryproto").read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 10, 12)
    assert any(line.startswith("mean_value channel [2]: ") for line in lines)
    for db in (raw, enc, png):
        db.close()


def test_convert_imageset_and_compute_mean_command_line(tmp_path):
    write_images(tmp_path / "img", 3, np.random.default_rng(8))
    run = [sys.executable, "-m", "cgp"]
    out = subprocess.run(run + ["convert", "imageset", "--resize_height", "5", "--resize_width",
                                "5", "--encoded", "--encode_type", "png", "img/",
                                "img/list.txt", "db"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(run + ["compute-mean", "db", "mean.binaryproto"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0 and "Number of channels: 3" in out.stdout, out.stderr
    assert read_blob_shape(tmp_path / "mean.binaryproto") == (1, 3, 5, 5)
    out = subprocess.run(run + ["convert", "imageset", "img/", "img/nolist.txt", "db2"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "nolist.txt" in out.stderr and "Traceback" not in out.stderr


def read_blob_shape(path):
    blob = caffe_pb2.BlobProto.FromString(path.read_bytes())
    return blob.num, blob.channels, blob.height, blob.width


def test_an_encoded_record_that_is_not_an_image(tmp_path):
    import lmdb
    good = caffe_pb2.Datum(label=1, encoded=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "x.png")
    good.data = (tmp_path / "x.png").read_bytes()
    bad = caffe_pb2.Datum(data=b"\xff\xd8\xff\xe0 not a JPEG", label=2, encoded=True)
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"a", good.SerializeToString())
        txn.put(b"b", bad.SerializeToString())
    env.close()
    db = lmdb_data.LmdbRecords(tmp_path / "db")
    with pytest.raises(DataError, match=rf"^LMDB {tmp_path}/db: record 1 \(key b\): not an "
                                        "image that can be decoded"):
        db.read(0, 2)


# -- training --------------------------------------------------------------------------------------

NET = """
name: "tiny"
layer {{ name: "d" type: "{kind}" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.0039 crop_size: 6 mirror: true mean_value: 100 }}
  {param} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 3 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


def test_training_from_images_is_the_same_on_1_and_2_workers(tmp_path):
    """A tiny net from an ImageData list (shuffled, resized) and from an encoded LMDB of the
    same images: identical weights for 1 and 2 workers; both sources read the same pixels."""
    write_images(tmp_path / "img", 10, np.random.default_rng(9), vary=True)
    convert_imageset(f"{tmp_path / 'img'}/", tmp_path / "img" / "list.txt", tmp_path / "db",
                     resize_height=8, resize_width=8, encoded=True, encode_type="png",
                     log=lambda line: None)
    sources = {
        "ImageData": f'image_data_param {{ source: "{tmp_path}/img/list.txt" root_folder: '
                     f'"{tmp_path}/img/" batch_size: 4 new_height: 8 new_width: 8 }}',
        "Data": f'data_param {{ source: "{tmp_path}/db" batch_size: 4 backend: LMDB }}'}
    results = {}
    for kind, param in sources.items():
        for threads in (1, 2):
            sp = text_format.Parse('base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" display: 0 '
                                   'random_seed: 5 snapshot_after_train: false',
                                   caffe_pb2.SolverParameter())
            text_format.Parse(NET.format(kind=kind, param=param), sp.net_param)
            trainer = Trainer(sp, None, RunConfig(threads=threads, chunks=4, progress=False,
                                                  workers="threads"), log=lambda line: None)
            losses = [float(trainer.step()[0]) for _ in range(4)]
            trainer.close()
            results[kind, threads] = (losses, trainer.net.params.copy())
    for kind in sources:
        (l1, p1), (l2, p2) = results[kind, 1], results[kind, 2]
        assert l1 == l2 and np.array_equal(p1, p2) and np.all(np.isfinite(l1))
    # The list's order and the LMDB's are the same, unshuffled: the same training.
    assert results["ImageData", 1][0] == results["Data", 1][0]
