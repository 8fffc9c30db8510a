"""pycaffe's caffe.io for cgp: the Transformer that turns images into a net's input and back,
load_image and resize_image (with Pillow, the `images` extra), and the BlobProto
conversions (a mean .binaryproto as an array). Not here: Datum conversions, oversample.
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
    """A BlobProto's data (or diff) as an array of its shape (legacy num/channels/height/
    width blobs as 4-d)."""
    values = blob.diff if return_diff else blob.data
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    else:
        shape = (blob.num, blob.channels, blob.height, blob.width)
    return np.array(values, np.float32).reshape(shape)


def array_to_blobproto(array, diff=None):
    """A BlobProto holding array (and diff) with its shape."""
    from cgp.proto import caffe_pb2
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(np.shape(array))
    blob.data.extend(np.asarray(array, np.float32).ravel().tolist())
    if diff is not None:
        blob.diff.extend(np.asarray(diff, np.float32).ravel().tolist())
    return blob


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
