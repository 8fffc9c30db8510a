"""The layer contract and the registry of layers by Caffe type name.

A layer holds its configuration and shapes only. Activations, gradients and scratch space live
in buffers that the engine owns, one set per worker, so a single layer object serves every
chunk of every iteration on every thread.

The minimal path: a layer with a forward and a backward kernel
--------------------------------------------------------------
A new layer is a pair of kernels (free @njit functions over preallocated flat arrays, in its
family's file cgp/kernels/<family>.py), one registered class in cgp/layers/<family>.py, and a
test of a few lines with the harness tests/layer_check.py. The class defines:

    @register("CaffeType")   the layer's Caffe type name
    params_read              the LayerParameter `*_param` messages it reads, e.g.
                             ("convolution_param",); the net refuses any other one set in
                             the prototxt, by name (default: none)
    setup(bottom_shapes)     -> top shapes; checks self.lp and the bottom shapes, raising
                             self.error(...) for a user's mistake
    param_shapes()           learnable blobs, in Caffe's blob order, and param_fillers(),
                             one FillerParameter each (only a layer that learns)
    scratch_shapes(n)        work space for calls of up to n samples (only if needed)
    forward_calls(bottom, top, params, scratch, chunk)
    backward_calls(top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk)
                             generators of (kernel, args) pairs, in call order

Caffe's AbsVal, as cgp/layers/activation.py registers it (kernels: cgp/kernels/activation.py):

    @register("AbsVal")
    class AbsVal(Layer):
        # y = |x|; dy/dx = sign(x), 0 at x = 0

        def setup(self, bottom_shapes):
            return [tuple(bottom_shapes[0])]

        def forward_calls(self, bottom, top, params, scratch, chunk):
            yield K.absval_forward, (flat(bottom[0]), flat(top[0]))

        def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff,
                           scratch, chunk):
            if bottom_diff[0] is not None:
                yield K.absval_backward, (flat(bottom[0]), flat(top_diff[0]),
                                          flat(bottom_diff[0]))

On the device and in ONNX: the same module, next to the layer
------------------------------------------------------------
A layer that runs on the device engine (cgp.device) and exports to ONNX
(cgp.commands.onnx_export) registers those next to itself, in its own module, so a new
layer is one module (plus its kernels and its test):

    @device_op(TanH)              # cgp/layers/activation.py's
    class TanHOp(DeviceOp):       # over array module self.xp, on the device's arrays
        def forward(self, bottom, top, params, scratch, chunk):
            top[0][...] = self.xp.tanh(bottom[0])
        def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff,
                     scratch, chunk): ...

A device op keeps the per-call protocol below (forward and backward, their arguments and
the accumulation rule), and its layer's stages: where the layer's forward_calls
(backward_calls) yield SYNC at a sum over the batch, the op's forward (backward) is a
generator that yields SYNC there (BatchNorm's), with its shares in scratch["sums"] as the
layer's; cgp.device.ops says the rest.

    @onnx_converter(AbsVal)
    def absval_onnx(g, e, bottoms, tops, params, read):
        g.node("Abs", bottoms, tops)

A layer with neither (the default, which register() sets, never inherited from a base
class) is refused by name by `--device gpu` ("no device op") and by `cgp export` ("no ONNX
conversion"). Neither a device op nor a converter imports CuPy or onnx: they are handed
the array module and the graph builder.

The net asks each worker's layers for their calls once, on that worker's buffers, and then
makes only those calls at every step (cgp.net.BoundCall): no Python of the layer runs per
call. What the calls may rely on, and what they must keep:
- Every array has axis 0 = chunk.n samples: a C-contiguous view of a buffer sized for the
  largest call. flat() and view() (below) reshape one without a copy, and refuse to copy.
- The calls may depend on which arrays they get and on the call's layout (chunk.n, first,
  batch, part_starts); never on the values in the arrays, nor on chunk.iteration, chunk.seed
  or chunk.batch_tops: the same calls run again at every step on new values. Nothing is
  kept in the layer object during a call: it serves every worker at once.
- Accumulation: param_diff arrays are added to (+=), bottom_diff arrays overwritten;
  bottom_diff[i] is None where no gradient flows into bottom i.
- A call covers chunk.parts parts, consecutive chunks of the engine's fixed split (see
  Chunk): param_diff[j] is (parts,) + blob j's shape, and part i's gradient, at [i], must be
  what a call of part i alone would give, so that no result depends on how chunks are
  grouped into calls. chunk.starts gives the parts' first samples; part_span() hands all
  parts' gradients to one kernel (Convolution, InnerProduct).
- Caffe's `engine` field (DEFAULT, CAFFE or CUDNN, in convolution_param, pooling_param,
  relu_param, sigmoid_param, tanh_param, lrn_param and softmax_param) picks an implementation
  in Caffe. In cgp it is a hint that is ignored, with any value: every layer runs cgp's CPU
  kernels, which follow Caffe's CPU math. No layer reads or refuses it.

Performance hooks (optional; Layer's class attributes, under "Performance hooks")
--------------------------------------------------------------------------------
- in_place, backward_reads_top: run in place where the prototxt names a top like its
  bottom and sharing the buffers changes no bit (ReLU).
- can_overwrite_param_diff: backward sets the parameter gradients instead of adding to them,
  so the engine skips zeroing them (InnerProduct).
- factor_shape(): the first parameter's gradient is handed over as the two factors of a
  product that the engine forms while it sums the chunks (InnerProduct).
- forward_parts/backward_parts: a batch-value layer takes every part of a call at once
  rather than one at a time (SoftmaxWithLoss).
register() derives the flags the engine reads from what a class defines, so that no flag
and method can disagree: is_source (load), can_factor_param_diff (factor_shape) and
takes_parts (forward_parts and backward_parts).
- work_scratch: the scratch buffers that hold nothing from one step of a call to the next,
  which the engine gives once per worker where calls pause at sums over the batch
  (Convolution, Pooling, InnerProduct, LRN).

The per-call protocol: calls_each_time = True
---------------------------------------------
A layer that must run Python at every call, because it reads the iteration or the seed
(Dropout's mask), or values (SoftmaxWithLoss and Accuracy check the labels and count them
over the batch), declares calls_each_time = True and defines forward(bottom, top, params,
scratch, chunk) and backward(top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
chunk), which the net calls at every call with that call's chunk. Batch-value layers
(reduces_batch: losses, accuracies) always run this way: the net calls them one part at a
time, or once per call through forward_parts/backward_parts. register()
refuses a class that overrides forward or backward without declaring calls_each_time, one that
declares it and hands its calls over too, and one that does neither, so that no layer leaves
the bound calls without saying so.

Sources: load()
---------------
Data layers (Data, Input: subclasses of Source; is_source, which register() sets for a class
that defines load) take no bottoms and make no per-chunk calls: the trainer runs
load(start, iteration, seed, rows) once per iteration on the batch (or on the samples `rows`
that this process computes), before the batch is cut into chunks, and sets `options`
(cgp.net.RunOptions) before setup (see cgp/layers/data.py).

Sums over the whole batch: batch_sums = (forward, backward)
-----------------------------------------------------------
A layer whose output depends on sums over the whole batch (BatchNorm's mean and variance)
says how many such sums its forward and its backward take, and yields SYNC in its
forward_calls (backward_calls) between the calls before a sum and those after it. The calls
before write each part's share of sum k into scratch["sums"][k][0], a (parts, m_k) float64
array (sum_sizes() gives m_k); the engine pauses every call of the batch there, adds the
chunks' shares in the fixed tree over chunk index into scratch["sums"][k][1], an (m_k,)
float64 array that every call sees, and runs the layer's sync(k, totals, params) once
(turning sums into means, updating moving averages); the calls after read the total. So the
statistics are the whole batch's, bitwise the same however the batch is cut and grouped.
Every call then keeps its buffers through each pause; scratch that no step reads after the
step that wrote it (work_scratch: a kernel's work space, not forward's record for backward)
is one per worker instead.
"""
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, NamedTuple

import numpy as np

from cgp.comm.local import sum_over_chunks
from cgp.errors import NetError, shorten
from cgp.proto import caffe_pb2
from cgp.runtime.memory import aligned_zeros

REGISTRY = {}

# Every `*_param` message of Caffe's LayerParameter (`param`, the repeated ParamSpec, is not
# one): what a layer's params_read names, and what the net refuses where a layer does not.
PARAM_MESSAGES = tuple(f.name for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields
                       if f.name.endswith("_param"))


def register(*type_names):
    """Class decorator: make a layer available under its Caffe type name(s), once it keeps
    the contract (check_contract). The layer starts with no device op and no ONNX
    conversion of its own (not its base class's): device_op and onnx_converter, next to it
    in its module, give it those."""
    def add(cls):
        cls.is_source = cls.load is not Layer.load
        cls.can_factor_param_diff = cls.factor_shape is not Layer.factor_shape
        cls.takes_parts = hasattr(cls, "forward_parts")
        check_contract(cls)
        for name in type_names:
            REGISTRY[name] = cls
        cls.type_name = type_names[0]
        cls.device_op = None
        cls.to_onnx = None
        return cls
    return add


def device_op(*layer_classes):
    """Class decorator: the DeviceOp of these registered layer classes (cgp.device.ops
    finds it as the layer's device_op)."""
    def add(op_class):
        for cls in layer_classes:
            _check_registered(cls, "device op", op_class.__name__)
            cls.device_op = op_class
        return op_class
    return add


def onnx_converter(*layer_classes):
    """Function decorator: convert(g, entry, bottoms, tops, params, read), the ONNX
    conversion of these registered layer classes (cgp.commands.onnx_export finds it as the
    layer's to_onnx): g is the export's Graph (its onnx module is g.onnx; nothing here
    imports onnx), entry the net's entry of the layer, bottoms and tops ONNX value names,
    params the layer's weights (float32 copies), read the blobs that exported layers read."""
    def add(convert):
        for cls in layer_classes:
            _check_registered(cls, "ONNX converter", convert.__name__)
            cls.to_onnx = staticmethod(convert)
        return convert
    return add


def _check_registered(cls, what, name):
    if REGISTRY.get(getattr(cls, "type_name", None)) is not cls:
        raise TypeError(f"{what} {name} names layer class {cls.__name__}, which is not "
                        f"registered: register the layer first")


def check_contract(cls):
    """Refuse, with a TypeError naming it, a layer class that would leave the bound calls
    without saying so (the module's docstring), or that names a message that is not one of
    LayerParameter's `*_param` messages."""
    name = cls.__name__
    unknown = [m for m in cls.params_read if m not in PARAM_MESSAGES]
    if isinstance(cls.params_read, str) or unknown:
        raise TypeError(f"layer class {name}: params_read must be a tuple of LayerParameter's "
                        f"*_param message names, got {cls.params_read!r}")
    if cls.is_source:
        return
    each_time = (cls.forward is not Layer.forward, cls.backward is not Layer.backward)
    hands_over = (cls.forward_calls is not Layer.forward_calls,
                  cls.backward_calls is not Layer.backward_calls)
    if cls.calls_each_time:
        if not all(each_time):
            raise TypeError(f"layer class {name} declares calls_each_time: it must define "
                            f"forward and backward")
        if any(hands_over):
            raise TypeError(f"layer class {name} declares calls_each_time and also defines "
                            f"forward_calls/backward_calls: the net would bind those; keep one "
                            f"protocol")
    else:
        if any(each_time):
            raise TypeError(f"layer class {name} overrides forward/backward without declaring "
                            f"calls_each_time = True: the net would call it at every call "
                            f"instead of binding its kernel calls. Hand the calls over with "
                            f"forward_calls/backward_calls, or declare the per-call protocol")
        if not all(hands_over):
            raise TypeError(f"layer class {name} must define forward_calls and backward_calls "
                            f"(or declare calls_each_time = True and define forward and "
                            f"backward)")
        if cls.reduces_batch:
            raise TypeError(f"layer class {name} has reduces_batch: the net calls batch-value "
                            f"layers at every call; declare calls_each_time = True and define "
                            f"forward and backward")
    parts = (hasattr(cls, "forward_parts"), hasattr(cls, "backward_parts"))
    if any(parts) and not (all(parts) and cls.reduces_batch):
        raise TypeError(f"layer class {name} takes the parts at once: it needs reduces_batch, "
                        f"forward_parts and backward_parts")
    if any(cls.batch_sums) and (cls.calls_each_time or cls.reduces_batch
                                or cls.sync is Layer.sync or cls.sum_sizes is Layer.sum_sizes):
        raise TypeError(f"layer class {name} has batch_sums: it hands its calls over (SYNC "
                        f"between them) and defines sum_sizes and sync")


def supported_types():
    return sorted(REGISTRY)


class DeviceOp:
    """Base of the device ops (cgp.device.ops): a layer's forward and backward over arrays on
    the device, with the per-call protocol's names and arguments (Layer.forward and
    Layer.backward), and the same stages around sums over the batch: a layer with
    batch_sums makes its op's forward (backward) a generator that yields SYNC at each sum,
    where the layer's forward_calls (backward_calls) yield it. No refusals by default. Here,
    not in cgp.device, so that a layer's module defines its op without importing the device
    engine."""

    def __init__(self, layer, xp):
        self.layer, self.xp = layer, xp

    @staticmethod
    def refuses(layer):
        """Why the device cannot run this configuration of the layer, or None."""
        return None

    def forward(self, bottom, top, params, scratch, chunk):
        raise NotImplementedError

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        """Nothing flows back (Accuracy)."""


class Layer:
    """Base class of every layer; the module's docstring says what a subclass defines.

    In forward/backward (or the calls they hand over) every array has axis 0 = chunk.n
    samples (a view of a buffer sized for the largest call), except the tops of layers with
    `reduces_batch` (losses, accuracy), whose shapes are exactly what setup returned; the net
    calls those layers with one part (chunk) at a time, unless they take the parts at once
    (takes_parts). A call covers chunk.parts parts (see Chunk): param_diff[j] is (parts,) +
    blob j's shape, part i's gradient at [i], which must be what a call with part i alone
    would give (or a Factors, see can_factor_param_diff).
    Accumulation rule: param_diff arrays are *added to* (or set, when overwrite_param_diff is
    on); bottom_diff arrays are *overwritten*. bottom_diff[i] is None when no gradient needs
    to flow into bottom i.
    """
    # -- every layer ---------------------------------------------------------------------
    type_name = "?"            # set by @register: the first Caffe type name
    # The layer's DeviceOp class (@device_op) and its ONNX converter (@onnx_converter), set
    # next to the layer in its module; None: the device engine (export) refuses the layer,
    # by name.
    device_op = None
    to_onnx = None
    bottoms = (1, 1)           # allowed number of bottoms (min, max); max None = any
    tops = (1, 1)              # allowed number of tops
    # The LayerParameter `*_param` messages the layer reads (Caffe's: e.g. SoftmaxWithLoss
    # reads softmax_param and loss_param); one it does not read, set in the prototxt, is
    # refused. `engine` in those messages is a hint cgp ignores.
    params_read = ()
    reduces_batch = False      # tops are batch values (a loss, an accuracy), not per sample
    default_loss_weight = 0.0  # Caffe gives loss layers weight 1 on their first top
    # Bottoms (by index) whose whole batch the layer reads from chunk.batch_tops, as a loss
    # that counts the batch's labels does: the engine provides them batch-wide.
    batch_bottoms = ()

    # -- the per-call protocol and sources (the module's docstring) -------------------------
    # The net calls forward and backward at every call, with that call's chunk, instead of
    # binding kernel calls that forward_calls/backward_calls hand over once.
    calls_each_time = False
    # A data layer: load(start, iteration, seed, rows) once per iteration on the batch
    # (set by register() where the class defines load).
    is_source = False

    # -- performance hooks (optional) ------------------------------------------------------
    # In place, as Caffe runs a layer whose prototxt names its top like its bottom: a layer
    # whose forward and backward give the same bits with top and bottom one buffer (and
    # top diff and bottom diff another) says so with in_place; the net then gives the top
    # its bottom's buffers where the layer that wrote the bottom does not read its own top
    # again (backward_reads_top False) and no other layer reads the bottom. No second copy
    # of the blob is then written and read back, each way (cifar10_quick's ReLUs: its
    # steps 1.026x as fast, README's design notes). backward_reads_top False: this layer's
    # backward never reads its own top, which an in-place layer after it may then rewrite.
    in_place = False
    backward_reads_top = True

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
    # (Set by register() where the class defines factor_shape.)
    can_factor_param_diff = False
    # A batch-value layer that can run every part of a call at once defines
    # forward_parts / backward_parts (register() then sets takes_parts): arguments as forward's and backward's, but with each
    # batch-value top (and its diff) as (parts,) + the top's shape, part k's at [k], and
    # scratch sized for the call. The net then calls it once per call rather than once per
    # part: for LeNet's loss, half of a call's Python, which threads take in turn.
    takes_parts = False

    # -- sums over the whole batch (the module's docstring) ---------------------------------
    batch_sums = (0, 0)   # how many sums forward and backward take
    # The names of scratch_shapes' buffers that hold nothing from one step of a call to the
    # next (written and read within one stretch of kernel calls, never kept from forward to
    # backward): where calls pause at sums over the batch, the engine gives the calls one
    # set of them per worker rather than one per call. Any other buffer is kept per call.
    work_scratch = ()

    def __init__(self, lp, index=0, phase=0):
        """lp: caffe_pb2.LayerParameter; index: position in the net (keys random
        streams); phase: caffe_pb2.TRAIN (0) or caffe_pb2.TEST (1)."""
        self.lp = lp
        self.name = lp.name
        self.index = index
        self.phase = phase
        self._check_counts(len(lp.bottom), self.bottoms, "bottom")
        self._check_counts(len(lp.top), self.tops, "top")
        self._check_params_read()

    def _check_counts(self, count, allowed, what):
        low, high = allowed
        if count < low or (high is not None and count > high):
            want = f"{low}" if low == high else f"{low} to {high if high is not None else 'any'}"
            raise self.error(f"takes {want} {what}(s), got {count}")

    def _check_params_read(self):
        """A `*_param` message that this layer does not read is a mistake (another layer's
        settings, or a type changed without them): refused by name, not ignored."""
        for name in PARAM_MESSAGES:
            if name not in self.params_read and self.lp.HasField(name):
                reads = " and ".join(self.params_read) or "no *_param message"
                raise self.error(f"{name} is not read by {self.type_name} layers (they read "
                                 f"{reads}); remove it")

    def error(self, message):
        return NetError(f"layer '{shorten(self.name)}' (type {self.type_name}): {message}")

    # -- set up once -------------------------------------------------------------
    def setup(self, bottom_shapes):
        """-> top shapes. Shapes are full Caffe shapes with axis 0 the *global* batch N.
        Validate the layer's parameters and bottom shapes here and raise self.error(...)."""
        raise NotImplementedError

    def param_shapes(self):
        """[shape, ...]: the learnable blobs, in Caffe's blob order."""
        return []

    def param_fillers(self):
        """[FillerParameter, ...]: one per learnable blob."""
        return []

    def scratch_shapes(self, n):
        """{name: shape or (shape, dtype)}: per-worker scratch for calls of up to n samples;
        a bare shape takes the run's float dtype."""
        return {}

    def factor_shape(self):
        """(rows per sample, J, L) of a factored gradient A^T @ B (see can_factor_param_diff):
        A is (rows, J) and B (rows, L) per sample, and the gradient is (J, L)."""
        raise NotImplementedError

    def sum_sizes(self):
        """[m_k, ...]: the elements of each sum over the whole batch (batch_sums), forward's
        then backward's."""
        raise NotImplementedError

    def sync(self, k, totals, params):
        """Sum k over the whole batch is totals[k] ((m_k,) float64, the chunks' shares added
        in the fixed tree; totals: every sum of this layer's, those before k finished):
        finish it in place (e.g. into a mean) and do what a sum is done for once per batch (a
        moving average in params). Called once per batch, before any call reads it."""
        raise NotImplementedError

    # -- per call ----------------------------------------------------------------
    # A layer whose calls depend on nothing but its arrays (which buffers, not the values in
    # them) and the call's layout (chunk.n, first, batch, part_starts; not its iteration,
    # seed or batch_tops) yields them from forward_calls and backward_calls as (kernel,
    # args) pairs, in order, and reads no array between them. A worker's calls repeat on
    # the same arrays at every step, so the net keeps the pairs and makes only the calls
    # (cgp.net.BoundCall): building the arguments at every call made most of a 4-sample
    # LeNet call's fixed cost (104 - 160 us of it, 39 - 61 us since: README's design notes,
    # bench/python_overhead.py). Layers that read the iteration, the seed or their data in
    # Python (Dropout, the losses) declare calls_each_time and override forward and backward.
    def forward_calls(self, bottom, top, params, scratch, chunk):
        return None

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        return None

    def forward(self, bottom, top, params, scratch, chunk):
        """The layer's forward now: its forward_calls made in order (or, with calls_each_time,
        the layer's own); at a SYNC, the sum over the call's parts (sum_now)."""
        self._make(self.forward_calls(bottom, top, params, scratch, chunk), 0, scratch, params,
                   chunk)

    def backward(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk):
        self._make(self.backward_calls(top, top_diff, bottom, bottom_diff, params, param_diff,
                                       scratch, chunk), self.batch_sums[0], scratch, params,
                   chunk)

    def _make(self, calls, k, scratch, params, chunk):
        for call in calls:
            if call is SYNC:
                self.sum_now(k, scratch, params, chunk)
                k += 1
            else:
                call[0](*call[1])

    def sum_now(self, k, scratch, params, chunk):
        """Sum k over the batch made by a call that holds the whole batch: its parts' shares
        (scratch["sums"]) added in the engine's tree over chunks, then sync."""
        if chunk.n != chunk.batch_size:
            raise ValueError(f"a call of {chunk.n} of {chunk.batch_size} samples cannot sum "
                             "over the batch alone: the engine makes those sums")
        sums = scratch["sums"]
        shares, total = sums[k]
        sum_over_chunks(shares[:chunk.parts], total)
        self.sync(k, [t for _, t in sums], params)

    # -- sources -----------------------------------------------------------------
    def load(self, start, iteration, seed, rows=None):
        """A source's tops for the batch whose first record is `start`: the whole batch, or
        its samples `rows` (a range) alone, reading only their records (a rank's share)."""
        raise NotImplementedError



class Source(Layer):
    """A data layer (the module's "Sources"): no bottoms; it defines load, and the net sets
    options before setup."""
    bottoms = (0, 0)
    options = None   # cgp.net.RunOptions

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


# -- helpers for layer files -------------------------------------------------------------

def view(a, shape):
    """a reshaped to `shape` without a copy; refuses an array that would need one, whose
    writes would be lost."""
    if not a.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous array, got strides {a.strides}")
    return a.reshape(shape)


def flat(a):
    """a as a flat view (see view)."""
    return view(a, -1)


# Yielded by forward_calls / backward_calls between the calls before a sum over the whole batch
# and those after it (Layer.batch_sums).
SYNC = "sync"


def assign(target, value):
    """target[...] = value, as a call that a layer's forward_calls can hand over."""
    target[...] = value


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


def no_backward(layer, bottom_diff):
    """The backward calls of a layer Caffe gives no backward (NOT_IMPLEMENTED): none, or,
    where the net needs a gradient through it, its refusal, raised as the calls are bound,
    before any step, as Caffe stops at its first backward."""
    if any(d is not None for d in bottom_diff):
        raise layer.error("has no gradient (Caffe implements none), but the net needs one "
                          "through it: keep its top away from the loss or set "
                          "propagate_down: false on the layer after it")
    return iter(())


# -- scratch buffers ---------------------------------------------------------------------

def scratch_specs(layer, n, dtype, work=None):
    """{name: (shape, dtype)} of the layer's scratch buffers for calls of up to n samples
    (scratch_shapes gives a shape, of the run's float dtype, or a (shape, dtype) pair);
    work: True for its work_scratch alone, False for the others, None for all."""
    specs = {}
    for name, spec in layer.scratch_shapes(n).items():
        if work is not None and (name in layer.work_scratch) != work:
            continue
        if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], tuple):
            specs[name] = spec
        else:
            specs[name] = (spec, dtype)
    return specs


def alloc_scratch(layer, n, dtype, shared=False, parts=1, work=None):
    """A layer's scratch buffers for chunks of up to n samples, e.g. int32 argmax indices
    (scratch_specs; work: which of them). shared: in memory that worker processes forked
    later share. A layer that sums over the batch gets "sums" (not with work=True):
    (shares (parts, m_k), total (m_k,)) float64 per sum (Layer.batch_sums)."""
    buffers = {}
    if any(layer.batch_sums) and not work:
        buffers["sums"] = [(aligned_zeros((parts, m), np.float64, shared),
                            aligned_zeros(m, np.float64, shared)) for m in layer.sum_sizes()]
    for name, (shape, kind) in scratch_specs(layer, n, dtype, work).items():
        buffers[name] = aligned_zeros(shape, kind, shared)
    return buffers
