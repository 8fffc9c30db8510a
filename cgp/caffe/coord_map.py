"""pycaffe's caffe.coord_map on cgp's NetSpec: how the spatial coordinates of one top map onto
another's through convolution, pooling, deconvolution, crop and pointwise layers, and crop(),
which makes the Crop layer that aligns them (as FCN's nets are written).

A map is (axis, a, b): output coordinate = a * input coordinate + b along the spatial axes
after `axis` (a convolution's channel axis, as its axis field; a Crop's axis less one), axis
None for a pointwise layer (any); a and b are arrays, one entry per spatial axis, or scalars
where the layer's parameters are.
"""
import numpy as np

from cgp.caffe.netspec import layers as L

# Layers that keep every coordinate where it is.
POINTWISE = {"AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Exp", "Log",
             "LRN", "MVN", "Power", "PReLU", "ReLU", "Scale", "Sigmoid", "Split", "TanH",
             "Threshold"}


class UndefinedMapException(Exception):
    """A layer through which coordinates do not map (InnerProduct, ...)."""


class AxisMismatchException(Exception):
    """Two maps along different axes."""


def _fields(fn, message):
    """The layer's fields: those of its `message` dict where given so, else its own."""
    return fn.params.get(message, fn.params)


def _array(value):
    return np.array(value, ndmin=1)


def conv_params(fn):
    """(axis, stride, effective kernel size, pad) of a Convolution, Deconvolution or Pooling
    layer; the kernel's effective size counts its dilation."""
    fields = _fields(fn, "pooling_param" if fn.type_name == "Pooling" else "convolution_param")
    legacy = {"kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w"} & set(fields)
    if legacy:
        raise AssertionError(f"coord_map: layer {fn.type_name} gives {sorted(legacy)}; give "
                             "kernel_size, stride and pad (cropping does not read _h/_w)")
    kernel = _array(fields["kernel_size"])
    dilation = _array(fields.get("dilation", 1))
    return (fields.get("axis", 1), _array(fields.get("stride", 1)), (kernel - 1) * dilation + 1,
            _array(fields.get("pad", 0)))


def crop_params(fn):
    """(axis, offset) of a Crop layer: axis 2 and offset 0 unless given."""
    fields = _fields(fn, "crop_param")
    return fields.get("axis", 2), _array(fields.get("offset", 0))


def coord_map(fn):
    """The map of one layer, from its bottom's coordinates to its top's."""
    kind = fn.type_name
    if kind in ("Convolution", "Pooling", "Im2col"):
        axis, stride, kernel, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (kernel - 1) / 2) / stride
    if kind == "Deconvolution":
        axis, stride, kernel, pad = conv_params(fn)
        return axis, stride, (kernel - 1) / 2 - pad
    if kind in POINTWISE:
        return None, 1, 0
    if kind == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset   # Crop's axis is the first spatial one
    raise UndefinedMapException(f"no coordinate map through a {kind} layer")


def compose(first, then):
    """The map `first` followed by `then` (whose coordinates are first's outputs)."""
    ax1, a1, b1 = first
    ax2, a2, b2 = then
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException(f"maps along axes {ax1} and {ax2}")
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(mapping):
    """The map that undoes `mapping`."""
    ax, a, b = mapping
    return ax, 1 / a, -b / a


def _mappable_bottoms(top):
    """The bottoms whose coordinates map onto top's: all of them, but a Crop's first alone
    (its second only gives the size)."""
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == "Crop" else inputs


def _ancestors(top, breadth_first=False):
    """{top or an ancestor: the map from top's coordinates to that blob's}, walking back
    through every layer that has a map; in the order found, nearest first where
    breadth_first."""
    maps, frontier = {top: (None, 1, 0)}, [top]
    while frontier:
        current = frontier.pop(0 if breadth_first else -1)
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in _mappable_bottoms(current):
            if bottom not in maps:
                maps[bottom] = compose(maps[current], step)
                frontier.append(bottom)
    return maps


def coord_map_from_to(top_from, top_to):
    """(axis, a, b): top_to's coordinate = a * top_from's + b, through their nearest common
    ancestor. RuntimeError where no chain of mappable layers joins them."""
    from_maps = _ancestors(top_from)
    for blob, to_map in _ancestors(top_to, breadth_first=True).items():
        if blob in from_maps:
            return compose(to_map, inverse(from_maps[blob]))
    raise RuntimeError("coord_map: cannot map between these tops; are they joined by spatial "
                       "layers (convolution, pooling, deconvolution, crop, pointwise)?")


def crop(top_from, top_to):
    """L.Crop(top_from, top_to) with the axis and offsets that align top_from to top_to;
    AssertionError where the scales differ or the offsets are negative or fractional."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.asarray(a), np.asarray(b)
    if not (a == 1).all():
        raise AssertionError(f"crop: scale mismatch (a = {a}): the tops differ in stride")
    if not (b <= 0).all():
        raise AssertionError(f"crop: negative crop (b = {b}): top_from is smaller than top_to")
    if not (np.round(b) == b).all():
        raise AssertionError(f"crop: fractional offset (b = {b})")
    return L.Crop(top_from, top_to,
                  crop_param=dict(axis=int(ax) + 1, offset=[int(v) for v in -np.round(b)]))
