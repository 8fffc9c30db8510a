"""The layer contract and the registry of layers by Caffe type name.

A layer holds its configuration and shapes only. Activations, gradients and scratch
space live in buffers that the engine owns, one set per worker, so a single layer
object serves every chunk of every iteration on every thread.
"""
import mmap
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, NamedTuple

import numpy as np

from cgp.errors import NetError, shorten

REGISTRY = {}


def register(*type_names):
    """Class decorator: make a layer available under its Caffe type name(s)."""
    def add(cls):
        for name in type_names:
            REGISTRY[name] = cls
        cls.type_name = type_names[0]
        return cls
    return add


def supported_types():
    return sorted(REGISTRY)


# Bytes every engine buffer's first element is aligned to: a vector load or store that
# straddles two cache lines costs two, and NumPy aligns its allocations to 16 bytes only, so
# the same buffer would run at one speed in one process and at another in the next.
ALIGN = 64


def aligned_zeros(shape, dtype, shared=False):
    """np.zeros(shape, dtype) whose data starts on an ALIGN-byte boundary. shared: in an
    anonymous shared mapping (page-aligned), which processes forked later share with this
    one: the buffers worker processes write (cgp.procs)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if shared:
        # The array's base keeps the mapping alive; the pages go when the last view does.
        return np.frombuffer(mmap.mmap(-1, max(size, 1)), np.uint8, size).view(dtype).reshape(shape)
    raw = np.zeros(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size].view(dtype).reshape(shape)


def alloc_scratch(layer, n, dtype):
    """A layer's scratch buffers for chunks of up to n samples. scratch_shapes gives a
    shape (the run's float dtype) or a (shape, dtype) pair, e.g. int32 argmax indices."""
    buffers = {}
    for name, spec in layer.scratch_shapes(n).items():
        if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], tuple):
            shape, kind = spec
        else:
            shape, kind = spec, dtype
        buffers[name] = aligned_zeros(shape, kind)
    return buffers


@dataclass(frozen=True)
class Chunk:
    """Where one layer call's samples sit in their iteration: what layers that couple
    samples need.

    A call covers one or more consecutive chunks of the engine's fixed split, its *parts*:
    parameter gradients are kept per part (see Layer), so results never depend on how many
    parts a call covers. Losses and accuracies divide by the *global* batch, so each chunk's
    scalar output is its share of the batch value and the engine sums the shares in a fixed
    order; those layers run one part at a time or take the parts at once. Random streams are
    keyed by (seed, iteration, global sample index, layer index), never by thread or chunk,
    so any split of the batch draws the same numbers.
    """
    n: int                  # samples in this call
    first: int = 0          # index within the global batch of the call's first sample
    batch: int = 0          # global batch size (0 means: n, a whole batch in one chunk)
    iteration: int = 0
    seed: int = 0
    # Data-layer tops for the whole batch, by blob name (e.g. labels, for a loss that
    # normalises by the number of non-ignored labels in the batch).
    batch_tops: Mapping[str, np.ndarray] = field(default_factory=dict)
    # Where each part starts within the call's samples, then n: (0, ..., n). Empty means
    # one part, (0, n).
    part_starts: tuple = ()

    @property
    def batch_size(self):
        return self.batch or self.n

    @property
    def starts(self):
        """The part boundaries as an int64 array (0, ..., n), for kernels."""
        return np.array(self.part_starts or (0, self.n), np.int64)

    @property
    def parts(self):
        return max(1, len(self.part_starts) - 1)

    @cached_property
    def each_part(self):
        """[(Chunk of part k alone, its first sample in the call, past its last), ...]; built
        once per call (a frozen dataclass still takes a cached_property), and only where a
        layer runs one part at a time: a Chunk costs the interpreter about 2 us."""
        if len(self.part_starts) <= 2:
            return [(self, 0, self.n)]
        return [(Chunk(n=b - a, first=self.first + a, batch=self.batch,
                       iteration=self.iteration, seed=self.seed, batch_tops=self.batch_tops), a, b)
                for a, b in zip(self.part_starts[:-1], self.part_starts[1:])]


class Factors(NamedTuple):
    """A call's factored parameter gradient, A^T @ B per part: the layer copies its A and B
    here, (rows, J) and (rows, L) for the call's rows (its parts' rows, in order), instead of
    forming the products."""
    a: np.ndarray
    b: np.ndarray


def part_span(a):
    """a: (parts, ...) per-part gradients, each part C-contiguous, at a fixed distance from
    the next -> (one flat view from a[0] over all the parts, elements from a part to the
    next), the form kernels take: a view of varying strides would compile a kernel for each
    memory layout."""
    size = a[0].size
    step = a.strides[0] // a.itemsize if a.shape[0] > 1 else size
    if not a[0].flags.c_contiguous or step < size:
        raise ValueError(f"per-part gradients must be C-contiguous and apart, got strides "
                         f"{a.strides}")
    return np.lib.stride_tricks.as_strided(a[0], ((a.shape[0] - 1) * step + size,),
                                           (a.itemsize,), writeable=True), step


class Layer:
    """Base class. Subclasses register with @register("CaffeType") and override:

    setup(bottom_shapes) -> top_shapes
        Shapes are full Caffe shapes with axis 0 the *global* batch N. Validate the
        layer's parameters and bottom shapes here and raise self.error(...).
    param_shapes() -> [shape, ...]   learnable blobs, in Caffe's blob order
    param_fillers() -> [FillerParameter, ...]   one per learnable blob
    scratch_shapes(n) -> {name: shape or (shape, dtype)}   per-worker scratch for chunks
        of up to n samples; a bare shape takes the run's float dtype
    forward(bottom, top, params, scratch, chunk)
    backward(top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk)
        or, for a layer whose kernel calls follow from its arrays and the call's layout alone,
        forward_calls / backward_calls (below), which forward and backward then run.

    In forward/backward every array has axis 0 = chunk.n samples (a view of a buffer
    sized for the largest call), except the tops of layers with `reduces_batch`
    (losses, accuracy) whose shapes are exactly what setup returned; the net calls those
    layers with one part (chunk) at a time, unless they take the parts at once (takes_parts).
    A call covers chunk.parts parts (see Chunk): param_diff[j] is (parts,) + blob j's shape,
    part i's gradient at [i], which must be what a call with part i alone would give (or a
    Factors, see can_factor_param_diff).
    Accumulation rule: param_diff arrays are *added to* (or set, when
    overwrite_param_diff is on); bottom_diff arrays are *overwritten*.
    bottom_diff[i] is None when no gradient needs to flow into bottom i.
    """
    type_name = "?"
    bottoms = (1, 1)           # allowed number of bottoms (min, max); max None = any
    tops = (1, 1)              # allowed number of tops
    reduces_batch = False      # tops are batch values (a loss, an accuracy), not per sample
    # A batch-value layer that can run every part of a call at once says so, and defines
    # forward_parts / backward_parts: arguments as forward's and backward's, but with each
    # batch-value top (and its diff) as (parts,) + the top's shape, part k's at [k], and
    # scratch sized for the call. The net then calls it once per call rather than once per
    # part: for LeNet's loss, half of a call's Python, which threads take in turn.
    takes_parts = False
    # A layer whose backward can *set* its parameter gradients (bitwise as if it added them
    # to zeros) says so; the net turns that on where no other layer shares those blobs, and
    # the engine then skips zeroing them in each chunk's private buffer: one pass less over
    # memory per chunk.
    can_overwrite_param_diff = False
    overwrite_param_diff = False
    # A layer whose first parameter's gradient for a chunk is a product A^T @ B of two
    # per-row matrices it holds in backward (InnerProduct: the output gradient and the input)
    # says so with factor_shape(); the engine may then pass it, in place of that gradient's
    # array, a Factors to copy A and B into, and forms the products itself while it sums
    # the chunks, with the same bits and no per-chunk copy of the gradient in memory.
    can_factor_param_diff = False
    default_loss_weight = 0.0  # Caffe gives loss layers weight 1 on their first top
    # In place, as Caffe runs a layer whose prototxt names its top like its bottom: a layer
    # whose forward and backward give the same bits with top and bottom one buffer (and
    # top diff and bottom diff another) says so with in_place; the net then gives the top
    # its bottom's buffers where the layer that wrote the bottom does not read its own top
    # again (backward_reads_top False) and no other layer reads the bottom. No second copy
    # of the blob is then written and read back, each way (cifar10_quick's ReLUs: its
    # steps 1.026x as fast, README's design notes).
    in_place = False
    backward_reads_top = True

    def __init__(self, lp, index=0, phase=0):
        """lp: caffe_pb2.LayerParameter; index: position in the net (keys random
        streams); phase: caffe_pb2.TRAIN (0) or caffe_pb2.TEST (1)."""
        self.lp = lp
        self.name = lp.name
        self.index = index
        self.phase = phase
        self._check_counts(len(lp.bottom), self.bottoms, "bottom")
        self._check_counts(len(lp.top), self.tops, "top")

    def _check_counts(self, count, allowed, what):
        low, high = allowed
        if count < low or (high is not None and count > high):
            want = f"{low}" if low == high else f"{low} to {high if high is not None else 'any'}"
            raise self.error(f"takes {want} {what}(s), got {count}")

    def error(self, message):
        return NetError(f"layer '{shorten(self.name)}' (type {self.type_name}): {message}")

    # -- set up once -------------------------------------------------------------
    def setup(self, bottom_shapes):
        raise NotImplementedError

    def param_shapes(self):
        return []

    def param_fillers(self):
        return []

    def scratch_shapes(self, n):
        return {}

    def factor_shape(self):
        """(rows per sample, J, L) of a factored gradient A^T @ B (see can_factor_param_diff):
        A is (rows, J) and B (rows, L) per sample, and the gradient is (J, L)."""
        raise NotImplementedError

    # -- per chunk ---------------------------------------------------------------
    # A layer whose calls depend on nothing but its arrays (which buffers, not the values in
    # them) and the call's layout (chunk.n, first, batch, part_starts; not its iteration,
    # seed or batch_tops) yields them from forward_calls and backward_calls as (kernel,
    # args) pairs, in order, and reads no array between them. A worker's calls repeat on
    # the same arrays at every step, so the net keeps the pairs and makes only the calls
    # (cgp.net.BoundCall): building the arguments at every call made most of a 4-sample
    # LeNet call's fixed cost (104 - 160 us of it, 39 - 61 us since: README's design notes,
    # bench/python_overhead.py). Layers that read the iteration, the seed or their data in Python
    # (Dropout, the losses) return None and override forward and backward.
    def forward_calls(self, bottom, top, params, scratch, chunk):
        return None

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        return None

    def forward(self, bottom, top, params, scratch, chunk):
        for kernel, args in self.forward_calls(bottom, top, params, scratch, chunk):
            kernel(*args)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        for kernel, args in self.backward_calls(top, top_diff, bottom, bottom_diff, params,
                                                param_diff, scratch, chunk):
            kernel(*args)


def assign(target, value):
    """target[...] = value, as a call that a layer's forward_calls can hand over."""
    target[...] = value


def check_axis(layer, axis, ndim):
    """Caffe's canonical axis (negative counts from the end), refusing the batch axis:
    an op along axis 0 would couple the samples that chunks keep apart."""
    if not -ndim <= axis < ndim:
        raise layer.error(f"axis {axis} is out of range for a {ndim}-d blob")
    axis %= ndim
    if axis == 0:
        raise layer.error("axis 0 (the batch axis) is not supported: cgp splits the batch "
                          "into independent chunks")
    return axis
