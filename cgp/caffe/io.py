"""pycaffe's caffe.io for cgp: the Transformer that turns images into a net's input and back,
load_image and resize_image (with Pillow, the `images` extra), oversample (ten crops), and
the BlobProto and Datum conversions (a mean .binaryproto as an array, an LMDB record).
"""
import numpy as np

from cgp.errors import CgpError, require


def load_image(filename, color=True):
    """An image file as float32 (H, W, 3) RGB in [0, 1] (color), or (H, W, 1) grey, as
    pycaffe's load_image."""
    Image = require("PIL.Image", "images", "caffe.io.load_image", "Pillow")
    try:
        with Image.open(filename) as image:
            pixels = np.asarray(image.convert("RGB" if color else "L"), np.float32) / 255
    except OSError as e:
        raise CgpError(f"caffe.io.load_image: cannot read image {filename}: {e}") from None
    return pixels if pixels.ndim == 3 else pixels[:, :, None]


def resize_image(image, new_dims):
    """(H, W, K) float image resized to new_dims (height, width), each channel bilinearly,
    as pycaffe's resize_image (order 1)."""
    Image = require("PIL.Image", "images", "caffe.io.resize_image", "Pillow")
    image = np.asarray(image, np.float32)
    height, width = (int(d) for d in new_dims)
    if image.shape[:2] == (height, width):
        return image.copy()
    planes = [np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, k]), "F").resize(
        (width, height), Image.BILINEAR), np.float32) for k in range(image.shape[2])]
    return np.stack(planes, axis=2)


def blobproto_to_array(blob, return_diff=False):
    """A BlobProto's data (or diff) as an array of its shape: legacy num/channels/height/
    width blobs as 4-d; a blob of one value and no shape as that value (0-d), as Caffe's
    scalar blobs. A ValueError where the values do not fit the shape, as pycaffe's."""
    values = np.array(blob.diff if return_diff else blob.data, np.float32)
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    elif any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        shape = (blob.num, blob.channels, blob.height, blob.width)
    elif values.size == 1:
        return values.reshape(())
    else:
        shape = (0,)
    if int(np.prod(shape)) != values.size:
        raise ValueError(f"a BlobProto of {values.size} values and shape {shape}: they do "
                         "not fit (give shape.dim, or num, channels, height and width)")
    return values.reshape(shape)


def array_to_blobproto(array, diff=None):
    """A BlobProto holding array (and diff) with its shape."""
    from cgp.proto import caffe_pb2
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(np.shape(array))
    blob.data.extend(np.asarray(array, np.float32).ravel().tolist())
    if diff is not None:
        blob.diff.extend(np.asarray(diff, np.float32).ravel().tolist())
    return blob


def array_to_datum(arr, label=None):
    """A (C, H, W) array as a Datum: uint8 arrays as its bytes, any other as float_data;
    label only where given (Caffe's caffe.io.array_to_datum)."""
    from cgp.proto import caffe_pb2
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError(f"array_to_datum: an array of shape {arr.shape}; a Datum holds a "
                         "(channels, height, width) array")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(arr.astype(np.float32).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def datum_to_array(datum):
    """A Datum's values as a (C, H, W) array: uint8 from its bytes, else float32 from
    float_data (Caffe's caffe.io.datum_to_array; an encoded image: cgp.data.images)."""
    shape = (datum.channels, datum.height, datum.width)
    if datum.encoded:
        raise ValueError("datum_to_array: the Datum holds an encoded image (JPEG or PNG); "
                         "decode it with Pillow first")
    if datum.data:
        return np.frombuffer(datum.data, np.uint8).reshape(shape).copy()
    return np.array(datum.float_data, np.float32).reshape(shape)


def oversample(images, crop_dims):
    """Ten crops of each (H, W, K) image: the four corners and the centre, and their mirror
    images, as (10 * len(images), crop_h, crop_w, K) float32 (Caffe's oversample)."""
    images = [np.asarray(im, np.float32) for im in images]
    if not images:
        return np.zeros((0, *crop_dims, 0), np.float32)
    height, width = images[0].shape[:2]
    crop_h, crop_w = (int(d) for d in crop_dims)
    if crop_h > height or crop_w > width:
        raise ValueError(f"oversample: crops of {crop_h}x{crop_w} from {height}x{width} images")
    corners = [(0, 0), (0, width - crop_w), (height - crop_h, 0),
               (height - crop_h, width - crop_w),
               ((height - crop_h) // 2, (width - crop_w) // 2)]
    crops = []
    for im in images:
        if im.shape[:2] != (height, width):
            raise ValueError(f"oversample: images of different sizes, {im.shape[:2]} and "
                             f"{(height, width)}")
        five = [im[y:y + crop_h, x:x + crop_w] for y, x in corners]
        crops += five + [c[:, ::-1] for c in five]
    return np.stack(crops).astype(np.float32)


class Transformer:
    """pycaffe's Transformer: preprocess(name, image) makes a net input of an (H, W, K) image:
    resize to the input's size, transpose, swap channels, scale raw values, subtract the
    mean, scale the input, in that order; deprocess undoes it. inputs: {blob name: shape},
    e.g. {'data': net.blobs['data'].data.shape}."""

    def __init__(self, inputs):
        self.inputs = {name: tuple(shape) for name, shape in inputs.items()}
        self.transpose, self.channel_swap = {}, {}
        self.raw_scale, self.mean, self.input_scale = {}, {}, {}

    def _check(self, name):
        if name not in self.inputs:
            raise CgpError(f"Transformer: '{name}' is not one of its inputs "
                           f"({', '.join(self.inputs)})")

    def preprocess(self, name, data):
        self._check(name)
        x = np.array(data, np.float32)
        size = self.inputs[name][2:]
        if x.shape[:2] != tuple(size):
            x = resize_image(x, size)
        if name in self.transpose:
            x = x.transpose(self.transpose[name])
        if name in self.channel_swap:
            x = x[self.channel_swap[name], :, :]
        if name in self.raw_scale:
            x *= self.raw_scale[name]
        if name in self.mean:
            x -= self.mean[name]
        if name in self.input_scale:
            x *= self.input_scale[name]
        return x

    def deprocess(self, name, data):
        self._check(name)
        x = np.array(data, np.float32).squeeze()
        if name in self.input_scale:
            x /= self.input_scale[name]
        if name in self.mean:
            x += self.mean[name]
        if name in self.raw_scale:
            x /= self.raw_scale[name]
        if name in self.channel_swap:
            x = x[np.argsort(self.channel_swap[name]), :, :]
        if name in self.transpose:
            x = x.transpose(np.argsort(self.transpose[name]))
        return x

    def set_transpose(self, name, order):
        """The order of the image's axes in the input, e.g. (2, 0, 1): HWC -> CHW."""
        self._check(name)
        if len(order) != len(self.inputs[name]) - 1:
            raise CgpError(f"Transformer.set_transpose('{name}', {order}): the order must "
                           f"have {len(self.inputs[name]) - 1} axes (input {self.inputs[name]})")
        self.transpose[name] = tuple(order)

    def set_channel_swap(self, name, order):
        """The channels' order after transposing, e.g. (2, 1, 0): RGB -> BGR."""
        self._check(name)
        if len(order) != self.inputs[name][1]:
            raise CgpError(f"Transformer.set_channel_swap('{name}', {order}): one entry per "
                           f"channel of the input ({self.inputs[name][1]})")
        self.channel_swap[name] = list(order)

    def set_raw_scale(self, name, scale):
        """Multiplies the raw values, e.g. 255 for load_image's [0, 1] into [0, 255]."""
        self._check(name)
        self.raw_scale[name] = scale

    def set_mean(self, name, mean):
        """A per-channel (C,) or per-pixel (C, H, W) mean, subtracted after raw scaling."""
        self._check(name)
        mean = np.asarray(mean, np.float32)
        channels, size = self.inputs[name][1], tuple(self.inputs[name][2:])
        if mean.ndim == 1:
            if mean.shape[0] != channels:
                raise CgpError(f"Transformer.set_mean('{name}'): {mean.shape[0]} channel means "
                               f"for {channels} channels")
            mean = mean[:, None, None]
        elif mean.shape[0] != channels or mean.shape[1:] != size:
            raise CgpError(f"Transformer.set_mean('{name}'): a mean of shape {mean.shape}; "
                           f"the input is {self.inputs[name][1:]}")
        self.mean[name] = mean

    def set_input_scale(self, name, scale):
        """Multiplies the input after the mean is subtracted."""
        self._check(name)
        self.input_scale[name] = scale
