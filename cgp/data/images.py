"""Images as Caffe's data layers read them through OpenCV: list files of `path label` lines,
image files and encoded Datum bytes (JPEG, PNG, ...) decoded with Pillow (the `images`
extra) into OpenCV's channel order (BGR) and layout, resized with OpenCV's INTER_LINEAR
arithmetic, and encoded again for `cgp convert imageset --encoded`. No transformation
(mean, crop): the data layers do that.

Where Pillow and OpenCV differ, and what is done about it:
- Resizing: Pillow's BILINEAR widens its filter when it shrinks an image (it averages over
  the source pixels an output pixel covers) where cv::resize INTER_LINEAR always blends the
  two nearest source pixels, in 11-bit fixed point. cgp resizes with its own kernel of
  OpenCV's rules (kernels/data.py resize_linear), not with Pillow; tests/test_images.py
  measures both against a NumPy model of those rules.
- Grayscale: a JPEG read as grayscale is decoded straight to its luma channel (Pillow's
  draft mode), as OpenCV's libjpeg reader does; other formats convert with ITU-R 601 luma
  weights in fixed point, as both libraries do, possibly 1 apart where they round.
"""
import io
from pathlib import Path

import numpy as np

from cgp.errors import DataError, require
from cgp.kernels import data as K

COEF_SCALE = 1 << 11    # OpenCV's INTER_RESIZE_COEF_SCALE: weights in 11-bit fixed point
GRAY_MODES = ("1", "L", "LA", "I", "F", "I;16", "I;16L", "I;16B", "I;16N")


def require_pillow(what):
    return require("PIL.Image", "images", f"{what}: reading images", "Pillow", DataError)


def decode(data, color, where):
    """Encoded image bytes -> (H, W, C) uint8 in OpenCV's order (BGR for color). color: True
    for 3 channels (IMREAD_COLOR), False for 1 (IMREAD_GRAYSCALE), None for the image's own:
    1 for a grayscale image, 3 otherwise (IMREAD_ANYCOLOR, Caffe's native decoding)."""
    Image = require_pillow(where)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if color is False and image.format == "JPEG" and image.mode != "L":
                image.draft("L", image.size)     # libjpeg's own luma, as OpenCV's reader
            image.load()
            return _pixels(image, color)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"{where}: not an image that can be decoded ({e})") from None


def _pixels(image, color):
    """A loaded Pillow image as (H, W, C) uint8, BGR."""
    if image.mode.startswith("I"):       # 16-bit: OpenCV keeps the high byte
        gray = (np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2) if color else gray[:, :, None]
    if color is False or (color is None and image.mode in GRAY_MODES):
        return np.asarray(image.convert("L"))[:, :, None]
    rgb = np.asarray(image.convert("RGB"))
    return np.ascontiguousarray(rgb[:, :, ::-1])


def read_image(path, height, width, color, where):
    """Caffe's ReadImageToCVMat: the image file `path` as (H, W, C) uint8 BGR, resized to
    height x width (INTER_LINEAR) when both are positive. where: names it in errors."""
    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise DataError(f"{where}: cannot read image {path}: {e.strerror or e}") from None
    image = decode(data, color, where)
    return resize(image, height, width) if height > 0 and width > 0 else image


def read_list(source):
    """[(path, label, line number), ...] of a list file: each line an image path and an
    integer label after its last space (a path may hold spaces), as Caffe reads it; blank
    lines are skipped."""
    try:
        text = Path(source).read_text()
    except OSError as e:
        raise DataError(f"image list '{source}': cannot read: {e.strerror or e} (paths are "
                        "relative to the working directory, as in Caffe)") from None
    except UnicodeDecodeError:
        raise DataError(f"image list '{source}': not a text file") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        path, _, label = line.rpartition(" ")
        try:
            lines.append((path, int(label), number))
        except ValueError:
            raise DataError(f"image list {source}:{number}: expected 'path label' with an "
                            f"integer label, got '{line}'") from None
        if not path:
            raise DataError(f"image list {source}:{number}: no image path before the label")
    if not lines:
        raise DataError(f"image list '{source}' names no images")
    return lines


def axis_table(src, dst, border):
    """OpenCV's resize tables along one axis of src -> dst pixels: (dst, 2) source indices of
    the two taps, clamped into the image, and (dst, 2) int32 weights. Each output pixel
    centre maps to (d + 0.5) * scale - 0.5 (scale = 1 / (dst / src), in double, then float32);
    the weights are 1 - f and f of its fraction, times 2048 rounded to even. border: reset the
    fraction to 0 past either edge, as OpenCV does along x (not along y)."""
    scale = 1.0 / (dst / src)
    f = ((np.arange(dst) + 0.5) * scale - 0.5).astype(np.float32)
    s = np.floor(f).astype(np.int64)
    f = f - s.astype(np.float32)
    if border:
        past = (s < 0) | (s >= src - 1)
        f[past] = 0
        s = np.where(s < 0, 0, np.where(s >= src - 1, src - 1, s))
    weights = np.stack([np.rint((np.float32(1) - f) * np.float32(COEF_SCALE)),
                        np.rint(f * np.float32(COEF_SCALE))], axis=1).astype(np.int32)
    taps = np.clip(np.stack([s, s + 1], axis=1), 0, src - 1)
    return taps, weights


def simd_end(width):
    """How many elements of an output row (width = columns x channels) OpenCV's SSE2
    vertical pass computes; the rest take its plain C arithmetic."""
    x = 0
    while x <= width - 16:
        x += 16
    while x < width - 4:
        x += 4
    return x


def resize(image, height, width):
    """(H, W, C) uint8 -> (height, width, C) uint8 as cv::resize INTER_LINEAR."""
    H, W, C = image.shape
    xofs, alpha = axis_table(W, width, border=True)
    rows, beta = axis_table(H, height, border=False)
    out = np.empty((height, width, C), np.uint8)
    K.resize_linear(np.ascontiguousarray(image), out, xofs, alpha, rows, beta,
                    simd_end(width * C))
    return out


# Pillow's name for each format Caffe's convert_imageset can be asked to encode to.
FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "bmp": "BMP", "tif": "TIFF",
           "tiff": "TIFF", "ppm": "PPM", "pgm": "PPM", "webp": "WEBP"}


def encode(image, kind, where):
    """(H, W, C) uint8 BGR (or gray) -> the bytes of an image file of `kind` (an extension:
    jpg, png, ...), as cv::imencode writes it (JPEG at OpenCV's default quality, 95)."""
    Image = require_pillow(where)
    name = FORMATS.get(kind.lower())
    if name is None:
        raise DataError(f"{where}: cannot encode images as '{kind}'; known: "
                        f"{', '.join(sorted(FORMATS))}")
    pixels = image[:, :, 0] if image.shape[2] == 1 else image[:, :, ::-1]
    out = io.BytesIO()
    options = {"quality": 95} if name == "JPEG" else {}
    Image.fromarray(np.ascontiguousarray(pixels)).save(out, name, **options)
    return out.getvalue()
