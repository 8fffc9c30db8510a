"""Shape layers: Slice, Crop, Tile and Silence, with Caffe's parameters.

None learns anything. Where Caffe shares memory (a one-top Slice), cgp copies. Slicing or
tiling along the batch axis would mix the samples that chunks keep apart and is refused;
Crop may name axis 0, whose offset Caffe's rules force to 0 (the crop's reference has the
same batch).
"""
import math

import numpy as np

from cgp.kernels import elementwise as E
from cgp.kernels import shape as K
from cgp.layers.base import Layer, assign, check_axis, flat, onnx_converter, register, view


@register("Slice")
class Slice(Layer):
    """Cuts the bottom along slice_param.axis (default 1; the old slice_dim also works) at
    slice_point (one fewer than the tops, increasing), or into equal parts without them;
    the inverse of Concat."""
    tops = (1, None)
    params_read = ("slice_param",)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.slice_param
        shape = tuple(bottom_shapes[0])
        if p.HasField("axis") and p.HasField("slice_dim"):
            raise self.error("give either slice_param.axis or slice_dim, not both")
        axis = p.slice_dim if p.HasField("slice_dim") else p.axis
        self.axis = check_axis(self, axis, len(shape))
        size, count = shape[self.axis], len(self.lp.top)
        points = list(p.slice_point)
        if points:
            if len(points) != count - 1:
                raise self.error(f"{len(points)} slice_point(s) for {count} tops: give one "
                                 f"fewer than the tops")
            edges = [0] + points + [size]
            if any(b <= a for a, b in zip(edges, edges[1:])):
                raise self.error(f"slice_point {points} must increase strictly, within "
                                 f"(0, {size}) (the size of axis {self.axis} of {shape})")
            self.sizes = [b - a for a, b in zip(edges, edges[1:])]
        else:
            if size % count:
                raise self.error(f"{count} tops do not divide axis {self.axis} of {shape} "
                                 f"evenly: give slice_point")
            self.sizes = [size // count] * count
        self.outer = math.prod(shape[1:self.axis])
        self.inner = math.prod(shape[self.axis + 1:])
        return [shape[:self.axis] + (s,) + shape[self.axis + 1:] for s in self.sizes]

    def _rows(self, a, size, n):
        return view(a, (n * self.outer, size * self.inner))

    def forward_calls(self, bottom, top, params, scratch, chunk):
        n, total = chunk.n, sum(self.sizes)
        x = self._rows(bottom[0], total, n)
        offset = 0
        for y, size in zip(top, self.sizes):
            yield E.concat_backward, (x, self._rows(y, size, n), offset * self.inner)
            offset += size

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is None:
            return
        n, total = chunk.n, sum(self.sizes)
        dx = self._rows(bottom_diff[0], total, n)
        offset = 0
        for dy, size in zip(top_diff, self.sizes):
            if dy is None:   # a top that no loss reads: its part of the gradient is 0
                yield assign, (dx[:, offset * self.inner:(offset + size) * self.inner], 0)
            else:
                yield E.concat_forward, (self._rows(dy, size, n), dx, offset * self.inner)
            offset += size


@register("Crop")
class Crop(Layer):
    """Crops bottom 0 to the shape of bottom 1 on the axes from crop_param.axis (default 2)
    on, at crop_param.offset: none (0), one for every such axis, or one per axis. Backward
    puts the gradient in the window and zeros elsewhere."""
    bottoms = (2, 2)
    params_read = ("crop_param",)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.crop_param
        big, ref = (tuple(s) for s in bottom_shapes)
        ndim = len(big)
        if len(ref) != ndim:
            raise self.error(f"the bottoms must have the same number of axes: {big} and {ref}")
        if not -ndim <= p.axis < ndim:
            raise self.error(f"axis {p.axis} is out of range for a {ndim}-d blob")
        start = p.axis % ndim
        offsets = list(p.offset)
        if len(offsets) > 1 and start + len(offsets) != ndim:
            raise self.error(f"{len(offsets)} offsets for the {ndim - start} axes from axis "
                             f"{start}: give one, or one per axis")
        self.offsets = [0] * ndim
        small = list(big)
        for i in range(start, ndim):
            off = offsets[0] if len(offsets) == 1 else (offsets[i - start] if offsets else 0)
            if big[i] - off < ref[i]:
                raise self.error(f"the crop of axis {i} is out of bounds: size {ref[i]} at "
                                 f"offset {off} in {big[i]} (bottoms {big} and {ref})")
            small[i] = ref[i]
            self.offsets[i] = off
        self.big, self.small = big, tuple(small)
        return [self.small]

    def _shapes(self, n):
        """The shapes and offsets for a call of n samples, int64 arrays for the kernel."""
        big = np.array((n,) + self.big[1:], np.int64)
        small = np.array((n,) + self.small[1:], np.int64)
        return big, small, np.array(self.offsets, np.int64)

    def forward_calls(self, bottom, top, params, scratch, chunk):
        yield K.crop_copy, (flat(bottom[0]), flat(top[0]), *self._shapes(chunk.n), True)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is not None:
            dx = flat(bottom_diff[0])
            yield assign, (dx, 0)
            yield K.crop_copy, (dx, flat(top_diff[0]), *self._shapes(chunk.n), False)


@register("Tile")
class Tile(Layer):
    """Repeats the bottom tile_param.tiles times along tile_param.axis (default 1): the axes
    from it on, whole, one copy after another. Backward adds the copies' gradients."""
    params_read = ("tile_param",)
    backward_reads_top = False

    def setup(self, bottom_shapes):
        p = self.lp.tile_param
        shape = tuple(bottom_shapes[0])
        self.axis = check_axis(self, p.axis, len(shape))
        if not p.HasField("tiles"):
            raise self.error("tile_param.tiles must be given")
        if p.tiles <= 0:
            raise self.error(f"tile_param.tiles must be positive, got {p.tiles}")
        self.tiles = int(p.tiles)
        self.outer = math.prod(shape[1:self.axis])
        self.inner = math.prod(shape[self.axis:])
        return [shape[:self.axis] + (shape[self.axis] * self.tiles,) + shape[self.axis + 1:]]

    def forward_calls(self, bottom, top, params, scratch, chunk):
        rows = chunk.n * self.outer
        yield K.tile_forward, (view(bottom[0], (rows, self.inner)),
                               view(top[0], (rows, self.tiles * self.inner)), self.tiles)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        if bottom_diff[0] is not None:
            rows = chunk.n * self.outer
            yield K.tile_backward, (view(top_diff[0], (rows, self.tiles * self.inner)),
                                    view(bottom_diff[0], (rows, self.inner)), self.tiles)


@register("Silence")
class Silence(Layer):
    """Takes any bottoms and makes no top, so that Caffe prints no unused output; its
    gradient to each bottom is zero."""
    bottoms = (1, None)
    tops = (0, 0)

    def setup(self, bottom_shapes):
        return []

    def forward_calls(self, bottom, top, params, scratch, chunk):
        return iter(())

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        for dx in bottom_diff:
            if dx is not None:
                yield assign, (dx, 0)


# -- on the device (cgp.device.ops) and in ONNX (cgp.commands.onnx_export) -------------------------

@onnx_converter(Slice)
def slice_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    g.node("Split", [bottoms[0], g.ints(f"{layer.name}/sizes", layer.sizes)], tops,
           axis=layer.axis)


@onnx_converter(Crop)
def crop_onnx(g, e, bottoms, tops, params, read):
    """Bottom 0's window of bottom 1's shape; bottom 1 gives its shape only (and the batch
    axis, whose offset is 0, stays whole)."""
    layer = e.layer
    g.reads.add(bottoms[1])
    axes = [i for i in range(1, len(layer.big)) if layer.small[i] != layer.big[i]]
    if not axes:
        g.node("Identity", [bottoms[0]], tops)
        return
    starts = [layer.offsets[i] for i in axes]
    ends = [layer.offsets[i] + layer.small[i] for i in axes]
    g.node("Slice", [bottoms[0], g.ints(f"{layer.name}/starts", starts),
                     g.ints(f"{layer.name}/ends", ends), g.ints(f"{layer.name}/axes", axes)],
           tops)


@onnx_converter(Tile)
def tile_onnx(g, e, bottoms, tops, params, read):
    layer = e.layer
    repeats = [1] * len(g.net.blob_shapes[e.bottoms[0]])
    repeats[layer.axis] = layer.tiles
    g.node("Tile", [bottoms[0], g.ints(f"{layer.name}/repeats", repeats)], tops)


@onnx_converter(Silence)
def silence_onnx(g, e, bottoms, tops, params, read):
    """No value: its bottoms are no outputs (and what only they needed is left out)."""
    g.reads.update(bottoms)
