"""A Caffe NetParameter built for one phase: the layers that the phase includes, blob
shapes, the flat parameter layout, and forward/backward over a run of chunks of the batch.

The net knows nothing about threads. Every top gets its own buffer (in-place layers in
the prototxt are renamed internally), except an in-place ReLU's where sharing changes no
bit (Layer.in_place), and a blob read by several layers gets a Split layer, as Caffe
inserts one: each buffer has one writer and one reader per pass, besides such a ReLU,
which rewrites its bottom's.
"""
import math
import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from cgp.errors import NetError, shorten
from cgp.fillers import fill
from cgp.layers import REGISTRY, SYNC, aligned_zeros, alloc_scratch, supported_types
from cgp.proto import caffe_pb2
from cgp.prototxt import beyond_int, non_finite, upgraded
from cgp.runtime import spin

PHASES = {caffe_pb2.TRAIN: "TRAIN", caffe_pb2.TEST: "TEST"}


@dataclass(frozen=True)
class RunOptions:
    """Run settings that data layers need; passed explicitly, never read from globals."""
    data_dir: str = None
    download: bool = True


@dataclass
class Entry:
    """One layer in the built net with its blob ids."""
    layer: object
    bottoms: list
    tops: list
    params: list = field(default_factory=list)     # indices into Net.param_blobs
    propagate: list = field(default_factory=list)  # per bottom: does a gradient flow into it
    backward: bool = False


@dataclass
class ParamBlob:
    """One learnable blob in the flat parameter array."""
    layer: str
    index: int
    shape: tuple
    offset: int
    lr_mult: float
    decay_mult: float

    @property
    def size(self):
        return math.prod(self.shape)


def _bytes(n):
    """A byte count for a message: MiB, GiB or TiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30)):
        if n >= 1 << shift:
            return f"{n / 2**shift:.1f} {unit}"
    return f"{n / 2**20:.1f} MiB"


def state_meets_rule(state, rule):
    """Caffe's NetStateRule test (phase, level range, stages)."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    if any(s not in state.stage for s in rule.stage):
        return False
    if any(s in state.stage for s in rule.not_stage):
        return False
    return True


def layer_included(lp, state):
    if lp.include and lp.exclude:
        raise NetError(f"layer '{shorten(lp.name)}': specify either include or exclude rules, "
                       "not both")
    if lp.include:
        return any(state_meets_rule(state, r) for r in lp.include)
    return not any(state_meets_rule(state, r) for r in lp.exclude)


def build_net(param, source, phase=caffe_pb2.TRAIN, options=RunOptions(), stages=(), level=0):
    """Net(param, ...), whose errors also name `source`, where the net came from (its file):
    a layer's name alone does not say which file to fix."""
    try:
        return Net(param, phase, options, stages, level)
    except NetError as e:
        raise NetError(f"{source}: {e}") from None


class Net:
    def __init__(self, param, phase=caffe_pb2.TRAIN, options=RunOptions(), stages=(), level=0):
        self.name = param.name
        self.phase = phase
        self.options = options
        state = caffe_pb2.NetState()
        state.CopyFrom(param.state)
        state.phase = phase
        state.level = level or state.level
        state.stage.extend(s for s in stages if s not in state.stage)
        if param.input or param.layers:   # a NetParameter made in code, not read by cgp
            param = upgraded(type(param).FromString(param.SerializeToString()),
                             f"net '{shorten(param.name)}'")

        self.blob_names = []     # blob id -> the name it had in the prototxt
        self.blob_shapes = []    # blob id -> full Caffe shape, axis 0 = global batch
        self.blob_ids = {}       # prototxt name -> latest blob id (after this layer)
        self.sources = []        # data layers: run once per iteration on the whole batch
        self.entries = []        # every other layer, in forward order
        self._versions = {}      # prototxt name -> how many layers have written it
        self._readers = {}       # blob id -> how many layers read it
        self._split_queue = {}   # shared blob id -> Split outputs not yet handed to a reader
        self._writers = {}       # blob id -> the layer (not a data layer) that wrote it last
        lps = [lp for lp in param.layer if layer_included(lp, state)]
        if not lps:
            raise NetError(f"net '{shorten(param.name)}' has no layers in phase {PHASES[phase]}")
        self._available = psutil.virtual_memory().available   # what blobs are checked against
        consumers = self._count_consumers(lps)
        for index, lp in enumerate(lps):
            self._add_layer(lp, index, consumers)
        # Source blob id -> the data layer's prototxt top name, which losses look labels up by.
        self.source_names = {t: name for e in self.sources
                             for name, t in zip(e.layer.lp.top, e.tops)}
        # Source blobs that a layer reads for the whole batch, not per chunk (labels that a
        # loss counts: Layer.batch_bottoms), by the name it looks them up by.
        names = {e.layer.lp.bottom[i] for e in self.entries for i in e.layer.batch_bottoms}
        self.batch_read = {t for t, name in self.source_names.items() if name in names}
        self.batch_size = self._batch_size()
        # Bytes of one sample's activations and their gradients (float32).
        self.sample_bytes = 8 * sum(math.prod(s[1:]) for s in self.blob_shapes if s)
        self._layout_params()
        self._tell_sources_the_classes()
        self.loss_weights = self._loss_weights()
        self._plan_backward()
        self.zero_ranges = self._plan_param_overwrites()
        self.batch_values = {t for e in self.entries if e.layer.reduces_batch for t in e.tops}
        # A call may cover several chunks (see Chunk) unless a per-sample layer reads a batch
        # value, which exists once per chunk.
        self.groupable = not any(b in self.batch_values for e in self.entries
                                 if not e.layer.reduces_batch for b in e.bottoms)
        # Per entry: whether a call runs it once over all its parts (Layer.takes_parts); not
        # where it reads a batch value, which each part holds on its own.
        self.whole_calls = [e.layer.reduces_batch and e.layer.takes_parts
                            and not any(b in self.batch_values for b in e.bottoms)
                            for e in self.entries]
        # The sums over the whole batch that calls pause at (Layer.batch_sums), in the order
        # a step reaches them, as (entry, the layer's sum index): forward's, then backward's
        # (the last entries first; only where the entry runs backward).
        self.forward_syncs = [(i, k) for i, e in enumerate(self.entries)
                              for k in range(e.layer.batch_sums[0])]
        self.backward_syncs = [(i, e.layer.batch_sums[0] + k)
                               for i, e in reversed(list(enumerate(self.entries)))
                               if e.backward for k in range(e.layer.batch_sums[1])]

    # -- building ----------------------------------------------------------------
    def _count_consumers(self, lps):
        """How many layers read each (name, version) so that Split layers can be placed."""
        version, counts = {}, {}
        for lp in lps:
            for b in lp.bottom:
                key = (b, version.get(b, 0))
                counts[key] = counts.get(key, 0) + 1
            for t in lp.top:
                version[t] = version.get(t, 0) + 1
        return counts

    def _new_blob(self, name, shape):
        self.blob_names.append(name)
        self.blob_shapes.append(tuple(int(d) for d in shape))
        return len(self.blob_names) - 1

    def _add_layer(self, lp, index, consumers):
        cls = REGISTRY.get(lp.type)
        if cls is None:
            raise NetError(f"layer '{shorten(lp.name)}': unsupported layer type "
                           f"'{shorten(lp.type)}'; supported types: "
                           f"{', '.join(supported_types())}")
        bad = non_finite(lp)
        if bad is not None:
            raise NetError(f"layer '{shorten(lp.name)}': {bad[0]} is {bad[1]}; a number in a "
                           "prototxt must be finite")
        bad = beyond_int(lp)
        if bad is not None:
            raise NetError(f"layer '{shorten(lp.name)}': {bad[0]} is {bad[1]}, beyond "
                           "2147483647, the largest value Caffe reads into this field")
        bottoms = []
        for b in lp.bottom:
            if b not in self.blob_ids:
                raise NetError(f"layer '{shorten(lp.name)}': bottom blob '{shorten(b)}' is not "
                               f"produced by any earlier layer in phase {PHASES[self.phase]}")
            bottoms.append(self._take(b))
        layer = cls(lp, index=index, phase=self.phase)
        source = getattr(layer, "is_source", False)
        if source:
            layer.options = self.options
        top_shapes = layer.setup([self.blob_shapes[b] for b in bottoms])
        if len(top_shapes) != len(lp.top):
            raise NetError(f"layer '{shorten(lp.name)}': produces {len(top_shapes)} tops, "
                           f"prototxt names {len(lp.top)}")
        self._check_tops(lp)
        self._check_sizes(layer, top_shapes)
        shared = self._in_place(layer, bottoms)
        tops = []
        for name, shape in zip(lp.top, top_shapes):
            version = self._version(name) + 1
            blob = bottoms[0] if shared else self._new_blob(name, shape)
            self._versions[name] = version
            self._readers[blob] = consumers.get((name, version), 0)
            self.blob_ids[name] = blob
            tops.append(blob)
        entry = Entry(layer, bottoms, tops)
        if source:
            self.sources.append(entry)
        else:
            self.entries.append(entry)
            self._writers.update((t, layer) for t in tops)
        # Splits for this layer's tops go right after it.
        for blob in tops:
            if self._readers[blob] > 1:
                self._add_split(blob)

    def _check_tops(self, lp):
        """Caffe's rule: a blob has one writer, unless a layer rewrites it in place (its top
        j named as its bottom j); a second writer would silently replace what the first
        wrote for every later reader."""
        written = set()
        for j, name in enumerate(lp.top):
            in_place = j < len(lp.bottom) and lp.bottom[j] == name
            if (name in self.blob_ids and not in_place) or name in written:
                raise NetError(f"layer '{shorten(lp.name)}': top blob '{shorten(name)}' is "
                               "already produced by another layer (Caffe: 'produced by "
                               "multiple sources'); only a layer in place, whose top is named "
                               "as its bottom at the same position, may write it again")
            written.add(name)

    def _check_sizes(self, layer, top_shapes):
        """Refuses, before anything is allocated, a top or learnable blob with a dimension
        below 1, or one whose values for a single sample (a parameter: all of it) cannot fit
        in the memory available: a huge num_output or pad would otherwise end in NumPy's
        allocation error, or in the kernel's out-of-memory killer. Sizes are Python
        integers, which never overflow."""
        named = [(f"top '{shorten(name)}'", shape, 8 * math.prod(shape[1:]) if shape else 8)
                 for name, shape in zip(layer.lp.top, top_shapes)]
        named += [(f"learnable blob {i}", shape, 4 * math.prod(shape))
                  for i, shape in enumerate(layer.param_shapes())]
        for what, shape, _ in named:
            if any(int(d) < 1 for d in shape):
                raise layer.error(f"{what} would have shape {tuple(shape)}; every dimension "
                                  "must be at least 1")
        what, shape, size = max(named, key=lambda n: n[2], default=(None, None, 0))
        if size > self._available:
            per = "one sample of it with its gradient" if what.startswith("top") else "it"
            raise layer.error(f"{what} of shape {tuple(shape)} needs {_bytes(size)} for "
                              f"{per}; this machine has {_bytes(self._available)} of "
                              "memory available")

    def _in_place(self, layer, bottoms):
        """Whether the layer's one top takes its one bottom's buffers (Layer.in_place): the
        prototxt names them alike, as Caffe's in-place layers, and no other layer, not even
        the one that wrote the bottom in its backward, would see the change."""
        lp = layer.lp
        if not (layer.in_place and len(lp.top) == 1 and list(lp.top) == list(lp.bottom)
                and not lp.propagate_down):
            return False
        writer = self._writers.get(bottoms[0])
        return (writer is not None and not writer.backward_reads_top
                and self._readers[bottoms[0]] == 1)

    def _version(self, name):
        return self._versions.get(name, 0)

    def _add_split(self, blob):
        """Caffe's automatic Split: one copy per reader, gradients summed in reader order."""
        name = self.blob_names[blob]
        lp = caffe_pb2.LayerParameter(name=f"{name}_split", type="Split", bottom=[name])
        count = self._readers[blob]
        lp.top.extend(f"{name}_split_{j}" for j in range(count))
        layer = REGISTRY["Split"](lp, index=-1, phase=self.phase)
        shapes = layer.setup([self.blob_shapes[blob]])
        tops = [self._new_blob(name, s) for s in shapes]
        self.entries.append(Entry(layer, [blob], tops))
        self._split_queue[blob] = list(tops)

    def _take(self, name):
        """The blob id a reader of `name` gets: its own Split output if the blob is shared."""
        blob = self.blob_ids[name]
        queue = self._split_queue.get(blob)
        return queue.pop(0) if queue else blob

    def _batch_size(self):
        sizes = {self.blob_shapes[t][0] for e in self.sources for t in e.tops if self.blob_shapes[t]}
        if not self.sources:
            raise NetError(f"net '{shorten(self.name)}' has no data layer (Data or Input) in phase "
                           f"{PHASES[self.phase]}")
        if len(sizes) != 1:
            raise NetError(f"net '{shorten(self.name)}': data layers disagree on the batch size: "
                           f"{sorted(sizes)}")
        return sizes.pop()

    def _layout_params(self):
        """One flat array for all learnable blobs; blobs shared by name (ParamSpec.name) share
        their slice, so their gradients add up in it as Caffe's shared params do."""
        self.param_blobs = []
        shared = {}
        offset = 0
        for entry in self.entries:
            layer, lp = entry.layer, entry.layer.lp
            shapes = [tuple(int(d) for d in s) for s in layer.param_shapes()]
            if len(lp.param) > len(shapes):
                raise NetError(f"layer '{shorten(lp.name)}': {len(lp.param)} param specs for "
                               f"{len(shapes)} learnable blobs")
            for i, shape in enumerate(shapes):
                spec = lp.param[i] if i < len(lp.param) else caffe_pb2.ParamSpec()
                if spec.name and spec.name in shared:
                    owner = self.param_blobs[shared[spec.name]]
                    if owner.shape != shape:
                        raise NetError(f"layer '{shorten(lp.name)}': shared param "
                                       f"'{shorten(spec.name)}' has shape "
                                       f"{shape} here but {owner.shape} in layer '{owner.layer}'")
                    entry.params.append(shared[spec.name])
                    continue
                blob = ParamBlob(lp.name, i, shape, offset, spec.lr_mult, spec.decay_mult)
                offset += blob.size
                if spec.name:
                    shared[spec.name] = len(self.param_blobs)
                entry.params.append(len(self.param_blobs))
                self.param_blobs.append(blob)
        self.n_params = offset
        self._check_memory_floor()
        self.params = np.zeros(offset, np.float32)
        self.lr_mult = np.zeros(offset, np.float32)
        self.decay_mult = np.zeros(offset, np.float32)
        for blob in self.param_blobs:
            self.lr_mult[blob.offset:blob.offset + blob.size] = blob.lr_mult
            self.decay_mult[blob.offset:blob.offset + blob.size] = blob.decay_mult

    def _check_memory_floor(self):
        """Refuses a net that cannot run in the memory available, before its parameters are
        allocated: what any run of it holds at least, its parameters four times (values,
        learning-rate and decay multipliers, one gradient), one sample's activations with
        their gradients, and three copies of the batch the data layers load."""
        params = 16 * self.n_params
        sources = 12 * sum(math.prod(self.blob_shapes[t]) for e in self.sources
                           for t in e.tops)
        need = params + self.sample_bytes + sources
        if need > self._available:
            raise NetError(f"net '{shorten(self.name)}' needs at least {_bytes(need)} of "
                           f"memory ({self.n_params} parameters: {_bytes(params)}; one "
                           f"sample's activations: {_bytes(self.sample_bytes)}; the batch of "
                           f"its data layers: {_bytes(sources)}); this machine has "
                           f"{_bytes(self._available)} available")

    def _tell_sources_the_classes(self):
        """Hands each data layer that takes label rules (label_rule) the class count and
        ignore_label of every loss or accuracy that reads its labels, straight or through
        Split layers: the data layer then refuses a bad label where it reads it, naming the
        record, instead of a worker finding it in the middle of a batch."""
        origin = {}   # blob id -> (data layer, top index) it is a copy of
        for entry in self.sources:
            for j, blob in enumerate(entry.tops):
                origin[blob] = (entry.layer, j)
        for entry in self.entries:
            layer = entry.layer
            if layer.type_name == "Split" and entry.bottoms[0] in origin:
                origin.update((t, origin[entry.bottoms[0]]) for t in entry.tops)
            elif (getattr(layer, "classes", None) and len(entry.bottoms) == 2
                  and entry.bottoms[1] in origin):
                source, j = origin[entry.bottoms[1]]
                if hasattr(source, "label_rule"):
                    source.label_rule(j, layer.classes,
                                      layer.ignore if getattr(layer, "has_ignore", False)
                                      else None, layer.name)

    def _plan_backward(self):
        """Caffe's need_backward: a blob needs a gradient when something learnable lies
        upstream of it and it leads to a loss; propagate_down can stop it. Diff buffers
        of blobs that lead to no loss are never written, so they stay zero."""
        needs = [False] * len(self.blob_names)
        for entry in self.entries:
            lp = entry.layer.lp
            learnable = any(self.param_blobs[p].lr_mult != 0 for p in entry.params)
            flows = [needs[b] for b in entry.bottoms]
            if lp.propagate_down and entry.layer.type_name != "Split":
                if len(lp.propagate_down) != len(entry.bottoms):
                    raise NetError(f"layer '{shorten(lp.name)}': propagate_down has "
                                   f"{len(lp.propagate_down)} values for "
                                   f"{len(entry.bottoms)} bottoms")
                flows = [f and bool(p) for f, p in zip(flows, lp.propagate_down)]
            entry.propagate = flows
            entry.backward = learnable or any(flows)
            for t in entry.tops:
                needs[t] = learnable or any(flows)
        under_loss = set(self.loss_weights)
        for entry in reversed(self.entries):
            if any(t in under_loss for t in entry.tops):
                under_loss.update(entry.bottoms)
            else:
                entry.backward = False
                entry.propagate = [False] * len(entry.bottoms)

    def _plan_param_overwrites(self):
        """Let layers that can set their parameter gradients do so where they alone write
        them, and list in self.factorable those that may also hand their first parameter's
        gradient over as factors; returns the (lo, hi) ranges of the flat gradient that
        chunks must zero."""
        users = {}
        for entry in self.entries:
            for p in entry.params:
                users[p] = users.get(p, 0) + 1
        set_by_layer = set()
        self.factorable = []  # entry indices whose first parameter's gradient may be factored
        for index, entry in enumerate(self.entries):
            layer = entry.layer
            alone = entry.backward and all(users[p] == 1 for p in entry.params)
            layer.overwrite_param_diff = layer.can_overwrite_param_diff and alone
            if layer.overwrite_param_diff:
                set_by_layer.update(entry.params)
            if layer.can_factor_param_diff and alone and entry.params:
                self.factorable.append(index)
        ranges = []
        for i, blob in enumerate(self.param_blobs):
            if i in set_by_layer:
                continue
            lo, hi = blob.offset, blob.offset + blob.size
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        return ranges

    def _loss_weights(self):
        """Blob id -> loss weight, for every top that contributes to the loss."""
        weights = {}
        for entry in self.entries:
            lp, layer = entry.layer.lp, entry.layer
            if lp.loss_weight and len(lp.loss_weight) != len(entry.tops):
                raise NetError(f"layer '{shorten(lp.name)}': loss_weight has "
                               f"{len(lp.loss_weight)} values for {len(entry.tops)} tops")
            for i, t in enumerate(entry.tops):
                w = lp.loss_weight[i] if lp.loss_weight else (layer.default_loss_weight if i == 0 else 0)
                if w:
                    if self.blob_shapes[t] != ():
                        raise NetError(f"layer '{shorten(lp.name)}': loss_weight on top "
                                       f"'{shorten(lp.top[i])}' "
                                       f"of shape {self.blob_shapes[t]}; cgp supports loss "
                                       "weights on scalar (loss) tops only")
                    weights[t] = float(w)
        return weights

    # -- parameters --------------------------------------------------------------
    def param_views(self, flat):
        """Per entry, the list of views of `flat` (any array laid out like self.params; a
        (parts, n_params) array gives views of shape (parts,) + the blob's)."""
        lead = flat.shape[:-1]
        views = [flat[..., b.offset:b.offset + b.size].reshape(lead + b.shape)
                 for b in self.param_blobs]
        return [[views[p] for p in e.params] for e in self.entries]

    def init_params(self, seed):
        """Fill parameters with the prototxt fillers, drawing in layer order from one seed."""
        rng = np.random.default_rng(seed)
        views = self.param_views(self.params)
        done = set()
        for entry, layer_views in zip(self.entries, views):
            fillers = entry.layer.param_fillers()
            for p, view, fp in zip(entry.params, layer_views, fillers):
                if p not in done and isinstance(fp, np.ndarray):   # a Python layer's values
                    view[...] = fp
                elif p not in done:
                    fill(view, fp, rng, where=f"layer '{entry.layer.name}'")
                    done.add(p)

    def blob_param(self, layer_name):
        """The ParamBlobs of one layer (by prototxt name), in Caffe's blob order."""
        for entry in self.entries:
            if entry.layer.name == layer_name:
                return [self.param_blobs[p] for p in entry.params]
        return []

    # -- outputs -----------------------------------------------------------------
    def scalar_outputs(self):
        """(blob id, display name) of every batch-value top that no layer reads: the
        values Caffe prints as 'net output #i'."""
        read = {b for e in self.entries for b in e.bottoms}
        out = []
        for entry in self.entries:
            for name, t in zip(entry.layer.lp.top, entry.tops):
                if entry.layer.reduces_batch and t not in read and self.blob_shapes[t] == ():
                    out.append((t, name))
        return out

    # -- one call: a run of chunks ------------------------------------------------
    def call_views(self, ws, chunk, batch_data, first=0):
        """Per-blob data views for a call of `chunk`'s samples in workspace ws, the source
        blobs viewed in batch_data (source blob id -> array of the batch's samples from
        sample `first` on: the whole batch, or the part this process computes)."""
        data = ws.views(chunk.n)
        lo, hi = chunk.first - first, chunk.first - first + chunk.n
        for blob, array in batch_data.items():
            data[blob] = array[lo:hi]
        return data

    def batch_tops(self, batch):
        """What layers read of the whole batch (Layer.batch_bottoms): batch's arrays (source
        blob id -> whole-batch array) of those blobs, keyed by the data layers' top names,
        as Chunk.batch_tops takes them."""
        return {self.source_names[t]: a for t, a in batch.items() if t in self.batch_read}

    def bind(self, ws, chunk, data, params, param_diffs=None, plan=None, scratch=None):
        """The layer calls of calls laid out as `chunk` on these arrays (see BoundCall).
        data: call_views'; params: per-entry views (from param_views); param_diffs: per
        entry the (parts,) + blob shape views of param_views that backward adds the
        parameter gradients into (layers with overwrite_param_diff set theirs: callers zero
        only self.zero_ranges); plan: per entry (backward, propagate) in place of the
        entries' own flags; scratch: per entry the layers' scratch in place of the
        workspace's (Workspace.with_work)."""
        return BoundCall(self, ws, chunk, data, params, param_diffs, plan, scratch)

    def forward(self, ws, chunk, batch_data, params, clock=None):
        """One call's forward (BoundCall.forward) with its layer calls bound for it alone;
        returns the data views that backward takes."""
        data = self.call_views(ws, chunk, batch_data)
        self.bind(ws, chunk, data, params).forward(chunk, clock)
        return data

    def backward(self, ws, chunk, data, params, param_diffs, plan=None, clock=None,
                 progress=None):
        """Backward after forward (BoundCall.backward), bound for this call alone."""
        self.bind(ws, chunk, data, params, param_diffs, plan).backward(chunk, clock, progress)

    def _part_of(self, blob, array, k, a, b):
        """Part k's slice of a blob's array: its samples a:b, or its own batch value (a view,
        also of a scalar)."""
        return array[k, ...] if blob in self.batch_values else array[a:b]

    def _part(self, data, blobs, k, a, b):
        return [self._part_of(blob, data[blob], k, a, b) for blob in blobs]

    def describe(self):
        """Caffe-like lines: each layer with its top shapes, and the parameter count."""
        lines = []
        for entry in self.sources + self.entries:
            for name, t in zip(entry.layer.lp.top, entry.tops):
                lines.append(f"{entry.layer.name:>16} ({entry.layer.type_name}) -> {name} "
                             f"{self.blob_shapes[t]}")
        lines.append(f"{self.n_params} learnable parameters")
        return lines


class BoundCall:
    """A net's layer calls for the calls of one layout (Chunk.n, first, batch, part_starts)
    on one set of arrays: a workspace, the source blobs' views, the parameters and their
    gradient views. A worker's calls repeat on the same arrays at every step, so this is
    built once and run at each: the kernel calls of layers that hand theirs over
    (Layer.forward_calls) are made as they were listed, with their arguments; the other
    layers are called each time with argument lists made once. Bound calls make exactly the
    kernel calls that calling the layers would, so results stay bitwise the same.

    Where the net sums over the whole batch (Net.forward_syncs, backward_syncs), its calls
    come in *segments*, cut at each sum: forward segment s runs up to forward sum s, and
    backward segment s from backward sum s - 1 on. The engine runs every call's segment, then
    the sum, then the next segments; a call that holds the whole batch runs them all and
    makes the sums itself."""

    def __init__(self, net, ws, chunk, data, params, param_diffs=None, plan=None, scratch=None):
        self.net, self.chunk, self.data, self.params = net, chunk, data, params
        self.scratch = ws.scratch if scratch is None else scratch
        self.diff = ws.diff_views(chunk.n)
        self._layout = (chunk.n, chunk.first, chunk.batch, chunk.part_starts)
        self._forward, self._forward_syncs = _segments(
            [(i, self._forward_steps(i, entry, p, scratch), 0) for i, (entry, p, scratch)
             in enumerate(zip(net.entries, params, self.scratch))])
        self._backward, self._backward_syncs = (None, []) if param_diffs is None else _segments(
            [(i, self._backward_steps(i, entry, p, pd, scratch, plan[i] if plan else None),
              entry.layer.batch_sums[0])
             for i, (entry, p, pd, scratch)
             in reversed(list(enumerate(zip(net.entries, params, param_diffs,
                                             self.scratch))))])
        # Loss tops' gradients: their loss weights, set again by every backward.
        self._seeds = [(self.diff[blob], weight) for blob, weight in net.loss_weights.items()
                       ] if self._backward is not None else []

    def _check(self, chunk):
        layout = (chunk.n, chunk.first, chunk.batch, chunk.part_starts)
        if layout != self._layout:
            raise ValueError(f"a call of layout {layout} on calls bound for {self._layout} "
                             f"(n, first, batch, part_starts)")

    @property
    def segments(self):
        """(forward segments, backward segments): one each where nothing sums the batch."""
        return len(self._forward), len(self._backward) if self._backward else 0

    def forward(self, chunk, clock=None, segment=None):
        """Forward the samples of `chunk` (one or more parts, see Chunk; laid out as the
        bound one, its iteration and seed its own). Fills the data views, whose batch-value
        tops hold one value per part. clock: optional array, clock[i] += seconds spent in
        entry i. segment: that forward segment alone (the engine's), else every segment,
        with the sums between them made here (a call of the whole batch)."""
        self._check(chunk)
        for s in range(len(self._forward)) if segment is None else [segment]:
            if segment is None and s:
                self._sum_here(chunk, self._forward_syncs[s - 1])
            self._run(self._forward[s], chunk, clock)

    def backward(self, chunk, clock=None, progress=None, segment=None):
        """Backward of `chunk` after its forward; adds the parameter gradients into the
        bound param_diffs. clock as in forward. progress: an int64 array to which 1 is added
        atomically at index i once entry i is done (or has nothing to do), for a reduction
        that waits for it. segment: as forward's."""
        self._check(chunk)
        if segment in (None, 0):
            for d, weight in self._seeds:
                d[...] = weight
        for s in range(len(self._backward)) if segment is None else [segment]:
            if segment is None and s:
                self._sum_here(chunk, self._backward_syncs[s - 1])
            self._run(self._backward[s], chunk, clock, progress)

    def _run(self, steps, chunk, clock, progress=None):
        for i, step, done in steps:
            if step is not None:
                started = time.perf_counter() if clock is not None else 0.0
                step(chunk)
                if clock is not None:
                    clock[i] += time.perf_counter() - started
            if done and progress is not None:
                spin.fetch_add(progress, i, 1)

    def _sum_here(self, chunk, sync):
        """Sum (entry i, its sum k) made by this call, which holds the whole batch."""
        i, k = sync
        self.net.entries[i].layer.sum_now(k, self.scratch[i], self.params[i], chunk)

    def _forward_steps(self, i, entry, p, scratch):
        """Entry i's forward as [step(chunk), ...]: one step per segment it spans."""
        net, data, layer, parts = self.net, self.data, entry.layer, self.chunk.parts
        if net.whole_calls[i]:
            args = ([data[b] for b in entry.bottoms], [data[t][:parts] for t in entry.tops],
                    p, scratch)
            return [lambda chunk: layer.forward_parts(*args, chunk)]
        if layer.reduces_batch:   # one part at a time
            each = [(net._part(data, entry.bottoms, k, a, b), [data[t][k, ...] for t in entry.tops],
                     p, scratch[k]) for k, (_, a, b) in enumerate(self.chunk.each_part)]
            return [_per_part(layer.forward, each)]
        args = ([data[b] for b in entry.bottoms], [data[t] for t in entry.tops], p, scratch)
        return _steps(layer.forward_calls(*args, self.chunk), layer.forward, args)

    def _backward_steps(self, i, entry, p, pd, scratch, flags):
        """Entry i's backward as [step(chunk), ...], or None where it has none. flags:
        (backward, propagate) in place of the entry's."""
        net, data, diff, layer = self.net, self.data, self.diff, entry.layer
        backward, propagate = flags or (entry.backward, entry.propagate)
        if not backward:
            return None
        parts = self.chunk.parts
        bottom_diff = [diff[b] if f else None for b, f in zip(entry.bottoms, propagate)]
        if net.whole_calls[i]:
            args = ([data[t][:parts] for t in entry.tops], [diff[t][:parts] for t in entry.tops],
                    [data[b] for b in entry.bottoms], bottom_diff, p, pd, scratch)
            return [lambda chunk: layer.backward_parts(*args, chunk)]
        if layer.reduces_batch:   # one part at a time
            each = [([data[t][k, ...] for t in entry.tops], [diff[t][k, ...] for t in entry.tops],
                     net._part(data, entry.bottoms, k, a, b),
                     [None if d is None else net._part_of(entry.bottoms[j], d, k, a, b)
                      for j, d in enumerate(bottom_diff)],
                     p, [d[k:k + 1] for d in pd], scratch[k])
                    for k, (_, a, b) in enumerate(self.chunk.each_part)]
            return [_per_part(layer.backward, each)]
        args = ([data[t] for t in entry.tops], [diff[t] for t in entry.tops],
                [data[b] for b in entry.bottoms], bottom_diff, p, pd, scratch)
        return _steps(layer.backward_calls(*args, self.chunk), layer.backward, args)


def _segments(entries):
    """[(i, steps or None, index of its first sum), ...] in the order they run -> (segments:
    [[(i, step, whether it is entry i's last step), ...], ...], cut between an entry's steps
    (at its SYNCs), and the sums at those cuts, [(i, the layer's sum index), ...])."""
    segments, syncs = [[]], []
    for i, steps, first in entries:
        if steps is None:
            segments[-1].append((i, None, True))
            continue
        for j, step in enumerate(steps):
            if j:
                segments.append([])
                syncs.append((i, first + j - 1))
            segments[-1].append((i, step, j == len(steps) - 1))
    return segments, syncs


def _steps(calls, method, args):
    """[step(chunk), ...]: the kernel calls a layer handed over (listed now, made at every
    call), one step per stretch between SYNCs; or where it hands none over (None), the
    layer's method with args and the call's chunk."""
    if calls is None:
        return [lambda chunk: method(*args, chunk)]
    stretches = [[]]
    for call in calls:
        if call is SYNC:
            stretches.append([])
        else:
            stretches[-1].append(call)

    def step_of(stretch):
        def step(chunk):
            for kernel, kernel_args in stretch:
                kernel(*kernel_args)
        return step
    return [step_of(stretch) for stretch in stretches]


def _per_part(method, each):
    """step(chunk): the layer's method called for each part of the chunk, with that part's
    args from `each`."""
    def step(chunk):
        for args, (part, _, _) in zip(each, chunk.each_part):
            method(*args, part)
    return step


class Workspace:
    """One worker's buffers: data and diff for every blob, sized for calls of up to n_max
    samples in up to `parts` parts of up to part_max samples, and each layer's scratch.
    Reused for every call the worker runs. A batch value (a loss) gets one buffer per
    part, as does the scratch of a layer that makes them one part at a time (not
    Net.whole_calls). A layer that sums over the batch (Layer.batch_sums) gets its parts'
    shares and the totals in scratch["sums"]: `sums`, per entry [(shares, total), ...], where
    the engine gives them, else its own.
    Source (data layer) blobs get no data buffer: calls read views of the batch.
    shared: every buffer in memory that worker processes forked later share (the engine's
    buffers of a group whose segments several workers run).
    work: False leaves out the layers' work scratch (Layer.work_scratch): the engine's
    workspace of a group, whose calls take the work scratch of the worker that runs them
    (work_scratch(), BoundCall's scratch)."""

    def __init__(self, net, n_max, with_diff=True, dtype=np.float32, parts=1, part_max=None,
                 shared=False, sums=None, work=True):
        part_max = part_max or n_max
        self._per_sample = [b not in net.batch_values for b in range(len(net.blob_names))]

        def alloc(blob):
            shape = net.blob_shapes[blob]
            return aligned_zeros((n_max,) + shape[1:] if self._per_sample[blob]
                                 else (parts,) + shape, dtype, shared)

        sources = {t for e in net.sources for t in e.tops}
        self.data = [None if b in sources else alloc(b) for b in range(len(net.blob_names))]
        self.diff = [alloc(b) for b in range(len(net.blob_names))] if with_diff else None
        self.scratch = [[alloc_scratch(e.layer, part_max, dtype, shared) for _ in range(parts)]
                        if e.layer.reduces_batch and not whole
                        else alloc_scratch(e.layer, n_max, dtype, shared, parts,
                                           None if work else False)
                        for e, whole in zip(net.entries, net.whole_calls)]
        for i, entry in enumerate(net.entries):
            if sums is not None and sums[i] is not None:
                self.scratch[i]["sums"] = sums[i]
        self._views = {}

    def _sliced(self, arrays, n):
        return [a[:n] if a is not None and per else a for a, per in zip(arrays, self._per_sample)]

    def views(self, n):
        """Fresh list of per-blob data views for a call of n samples (callers fill in
        the source blobs)."""
        if n not in self._views:
            self._views[n] = (self._sliced(self.data, n),
                              self._sliced(self.diff, n) if self.diff is not None else None)
        return list(self._views[n][0])

    def diff_views(self, n):
        self.views(n)
        return self._views[n][1]

    def with_work(self, work):
        """Per entry, the layer's scratch with the work scratch `work` (work_scratch()'s)
        added: what a worker's calls in this workspace take (Workspace(work=False))."""
        return [dict(own, **extra) if isinstance(own, dict) else own
                for own, extra in zip(self.scratch, work)]


def work_scratch(net, n_max, dtype=np.float32):
    """Per entry, the layers' work scratch (Layer.work_scratch) for calls of up to n_max
    samples: one worker's, for the calls it runs in workspaces made with work=False ({} for
    layers called one part at a time, whose workspaces keep all of theirs)."""
    return [{} if e.layer.reduces_batch and not whole
            else alloc_scratch(e.layer, n_max, dtype, work=True)
            for e, whole in zip(net.entries, net.whole_calls)]
