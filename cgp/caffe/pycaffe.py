"""pycaffe's Python interface on cgp: `import cgp as caffe` runs the common subset of scripts
written for Caffe's `import caffe` (Net, the solvers, blobs and params as NumPy arrays).

A Net runs forward and backward on one thread over the whole batch, in one call through the
layers (Caffe's semantics: blobs hold the whole batch, and the user may write into them). A
solver is cgp's Trainer, on `threads` workers, bitwise the same for any thread count.
What differs from pycaffe, and why (each said again where it applies):
- set_mode_gpu() (and set_device(i)) make the solvers made after it train on the GPU
  (cgp train --device gpu); a Net's own forward() and backward() stay on the CPU.
- Training data is a pure function of the iteration (runs resume bit for bit), so
  solver.net.forward() reads the batch of the solver's next iteration without taking it
  from the solver, where Caffe's would shift the data the solver trains on.
- solver.step(n) trains, displays and snapshots as Caffe's Step; the periodic tests that
  Caffe's Step runs are left to solver.solve() (run solver.test_nets[i].forward() to test).
- Parameter diffs hold the gradient of the latest backward(): backward() clears them first
  (Caffe adds until its solver clears them; clear_param_diffs() clears them as Caffe's).
  After solver.step(n) (and apply_update()), solver.net's hold what Caffe's do: the last
  update's step, which was subtracted from the weights (the batch's summed gradient scaled
  by the rate, regularized, with momentum).
- caffe.Net warns about a `*_param` message a layer does not read, and ignores it, as
  Caffe does (DummyData's transform_param in Caffe's own tests); `cgp train` refuses one.
- Names that pycaffe has and cgp does not (UNSUPPORTED) raise PycaffeUnsupported, which
  says so and what to use instead, never a bare AttributeError.
"""
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from cgp.caffe.pylayer import LegacyAxes
from cgp.errors import CgpError

# caffe.proto's Phase values, as pycaffe's caffe.TRAIN and caffe.TEST. (caffe_pb2 and the
# layers are imported where used: `import cgp` reaches this module for any name it lacks.)
TRAIN = 0
TEST = 1
SEED = 1701               # fillers and random crops of a Net made from Python (cgp's default)


class PycaffeUnsupported(CgpError, AttributeError):
    """A pycaffe name or call that cgp does not provide. An AttributeError too, so that
    hasattr() and getattr(..., default) keep working on the module."""


# pycaffe's module-level names that cgp does not provide: what each would need instead.
UNSUPPORTED = {
    "set_random_seed": "give seed= to the solver, or random_seed in the solver prototxt "
                       "(cgp keeps no global random state)",
    "Classifier": "use caffe.Net with caffe.io.Transformer and net.forward()",
    "Detector": "use caffe.Net with caffe.io.Transformer and net.forward()",
    "NCCL": "multi-GPU training is not supported; give threads= to the solver instead",
    "set_solver_count": "multi-GPU training is not supported; give threads= to the solver",
    "set_solver_rank": "multi-GPU training is not supported; give threads= to the solver",
    "set_multiprocess": "multi-GPU training is not supported; give threads= to the solver",
    "solver_count": "multi-GPU training is not supported; give threads= to the solver",
    "solver_rank": "multi-GPU training is not supported; give threads= to the solver",
    "Timer": "use time.perf_counter(), or `cgp time` for per-layer timings",
    "init_log": "glog is not used: give log=print to the solver, or run `cgp train --log`",
    "log": "glog is not used: give log=print to the solver, or run `cgp train --log`",
    "get_solver_from_string": "write the solver to a file and use caffe.get_solver(path)",
    "AdaDeltaSolver_from_string": "write the solver to a file",
}

# Methods of pycaffe's Net and Solver that cgp does not provide.
UNSUPPORTED_NET = {
    "forward_backward_all": "call net.forward_all(...) and net.backward_all(...)",
    "after_forward": "layer callbacks are not supported",
    "before_forward": "layer callbacks are not supported",
    "after_backward": "layer callbacks are not supported",
    "before_backward": "layer callbacks are not supported",
}
UNSUPPORTED_SOLVER = {
    "add_callback": "solver callbacks are not supported",
    "share_weights": "test nets share the train net's weights already",
    "param": "read the solver prototxt with cgp.prototxt.read_solver(path)",
}


def unsupported(where, name, table):
    """PycaffeUnsupported for pycaffe's `name` (module, Net or solver): what to do instead."""
    hint = table.get(name)
    if hint is None:
        return AttributeError(f"{where} has no attribute '{name}' (cgp's pycaffe interface "
                              f"does not know it; see cgp/caffe/pycaffe.py for what it covers)")
    return PycaffeUnsupported(f"pycaffe's {where}.{name} is not supported by cgp: {hint}")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise unsupported("caffe", name, UNSUPPORTED)


# -- modes -----------------------------------------------------------------------------
# Where the solvers made next train: set_mode_cpu() / set_mode_gpu() and set_device().
_MODE = {"device": "cpu", "device_id": None}


def set_mode_cpu():
    """Solvers made from now on train on the CPU (the default)."""
    _MODE["device"] = "cpu"


def set_mode_gpu():
    """Solvers made from now on train on a GPU (cgp train --device gpu: CuPy, the gpu extra);
    a Net's forward() and backward() stay on the CPU."""
    _MODE["device"] = "gpu"


def set_device(device_id=0):
    """The GPU that solvers made from now on use, by CUDA index (default: the local rank's)."""
    _MODE["device_id"] = int(device_id)


def has_nccl():
    """False: cgp has no NCCL (multi-GPU) build, as a CPU build of Caffe."""
    return False


def layer_type_list():
    """The Caffe layer types cgp runs, as pycaffe's caffe.layer_type_list()."""
    from cgp.layers import supported_types
    return supported_types()


# -- blobs -----------------------------------------------------------------------------
class Blob(LegacyAxes):
    """A blob of a Net: `data` and `diff` are NumPy float32 arrays of Caffe's shape for the
    whole batch, which the user may read and write in place."""

    def __init__(self, net, name, data, diff):
        self._net, self.name = net, name
        self._data, self._diff = data, diff

    @property
    def data(self):
        self._net._current(self.name)
        return self._data

    @property
    def diff(self):
        self._net._current(self.name)
        return self._diff

    @property
    def shape(self):
        return tuple(self._data.shape)

    def reshape(self, *shape):
        """A new shape for an input blob (an Input layer's top); takes effect at the net's
        next reshape() or forward(), which rebuild the net for it, as Caffe's do."""
        self._net._reshape_input(self.name, tuple(int(d) for d in shape))


class _LayerView:
    """pycaffe's net.layers[i]: the layer's type and its learnable blobs."""

    def __init__(self, name, type_name, blobs):
        self.name, self.type, self.blobs = name, type_name, blobs


# -- nets ------------------------------------------------------------------------------
def lenient(param, where):
    """param less the `*_param` messages its layers do not read, each named in a warning:
    Caffe ignores them (its tests give DummyData a transform_param); cgp train refuses them."""
    import warnings
    from cgp.layers import REGISTRY
    from cgp.layers.base import PARAM_MESSAGES

    for lp in param.layer:
        cls = REGISTRY.get(lp.type)
        for name in PARAM_MESSAGES if cls is not None else ():
            if name not in cls.params_read and lp.HasField(name):
                warnings.warn(f"{where}: layer '{lp.name}' (type {lp.type}) does not read "
                              f"{name}; ignored, as Caffe does", stacklevel=3)
                lp.ClearField(name)
    return param


def _phase(value, where):
    if value in (TRAIN, TEST) and not isinstance(value, bool):
        return int(value)
    raise CgpError(f"{where}: phase must be caffe.TRAIN or caffe.TEST, got {value!r}")


class Net:
    """pycaffe's Net: Net(model, phase, weights=None, level=0, stages=()), or the older
    Net(model, weights, phase). cgp adds data_dir= and download= (where Data layers find
    their data set, as `cgp train --data-dir`) and seed= (fillers and random crops)."""

    def __init__(self, model, *args, weights=None, phase=None, level=0, stages=(),
                 data_dir=None, download=True, seed=SEED):
        from cgp.net import RunOptions, build_net
        from cgp.prototxt import read_model
        from cgp.snapshot import load_weights

        where = f"caffe.Net({str(model)!r}, ...)"
        if len(args) > 2:
            raise CgpError(f"{where}: expected Net(model, phase) or Net(model, weights, phase)")
        if len(args) == 2:
            weights, phase = args
        elif len(args) == 1:
            if isinstance(args[0], (str, Path)):
                weights = args[0]
            else:
                phase = args[0]
        if phase is None:
            raise CgpError(f"{where}: give the phase, caffe.TRAIN or caffe.TEST")
        self._model, self._phase = str(model), _phase(phase, where)
        self._stages, self._level = tuple(stages or ()), level
        self._options = RunOptions(data_dir, download)
        self.seed = seed
        self._param = lenient(read_model(model), self._model)
        net = build_net(self._param, self._model, self._phase, self._options,
                        stages=self._stages, level=level)
        net.init_params(seed)
        if weights is not None:
            for name in str(weights).split(","):
                load_weights(net, name)
        self._attach(net)

    @classmethod
    def _wrap(cls, net, seed):
        """A Net over a cgp.net.Net that something else (a solver) built and owns."""
        self = cls.__new__(cls)
        self._model, self._phase, self._param = net.name, net.phase, None
        self.seed = seed
        self._attach(net)
        return self

    def _attach(self, net):
        """Whole-batch buffers, and the names and order of Caffe's blobs and layers."""
        from cgp.layers import Chunk, aligned_zeros
        from cgp.net import Workspace

        self._net = net
        self._cursor = 0        # the next batch Data layers read
        self._stale = None      # a function that brings the blobs up to date, or None
        self._exact = set()     # blobs already up to date while stale
        self._pending_shapes = {}
        n = net.batch_size
        self._ws = Workspace(net, n, with_diff=True)
        self._inputs = {t: aligned_zeros(net.blob_shapes[t], np.float32)
                        for e in net.sources for t in e.tops}
        self._chunk = dict(n=n, first=0, batch=n, part_starts=(0, n),
                           batch_tops=net.batch_tops(self._inputs))
        self._data = net.call_views(self._ws, Chunk(**self._chunk), self._inputs)
        self._diff = self._ws.diff_views(n)
        self._param_views = net.param_views(net.params)
        self._grads = aligned_zeros((1, net.n_params), np.float32)
        self._grad_views = net.param_views(self._grads)
        self._layout()

    # -- Caffe's names -----------------------------------------------------------------
    def _layout(self):
        """Caffe's layer order (data layers at their place, each automatic Split right after
        the layer whose top it splits) and blob names (a Split's tops named as Caffe names
        them); net.blobs maps a name to its last version's data (in-place layers rewrite
        it) and its first version's diff (their backward rewrites it last)."""
        net = self._net
        # A Split copies what the last layer before it wrote (an in-place chain's last, as
        # Caffe's insert_splits names it), and runs right after that layer.
        producer = {}                      # blob id -> (entry, top index) of its last writer
        splits = {}                        # id(entry) -> [(Split, its bottom's top index)]
        for e in net.sources + net.entries:
            if e.layer.type_name == "Split":
                src, j = producer[e.bottoms[0]]
                splits.setdefault(id(src), []).append((e, j))
            for j, t in enumerate(e.tops):
                producer[t] = (e, j)
        plain = sorted((e for e in net.sources + net.entries if e.layer.type_name != "Split"),
                       key=lambda e: e.layer.index)
        self._order, names, layer_names = [], {}, []
        for e in plain:
            for j, t in enumerate(e.tops):
                names[t] = e.layer.lp.top[j]
            self._order.append(e)
            layer_names.append(e.layer.name)
            for s, j in splits.get(id(e), []):
                base = f"{net.blob_names[s.bottoms[0]]}_{e.layer.name}_{j}_split"
                for k, t in enumerate(s.tops):
                    names[t] = f"{base}_{k}"
                self._order.append(s)
                layer_names.append(base)
        self._layer_names = layer_names
        self._entry_index = {id(e): i for i, e in enumerate(net.entries)}
        first, last = OrderedDict(), {}
        available = []
        for e in self._order:
            for b in e.bottoms:
                if names[b] in available:
                    available.remove(names[b])
            for t in e.tops:
                first.setdefault(names[t], t)
                last[names[t]] = t
                if names[t] not in available:
                    available.append(names[t])
        self._names = names
        self._blobs = OrderedDict(
            (name, Blob(self, name, self._batch_view(last[name], self._data),
                        self._batch_view(blob, self._diff)))
            for name, blob in first.items())
        self._params = OrderedDict()
        self.layers = []
        for name, e in zip(layer_names, self._order):
            index = self._entry_index.get(id(e))
            blobs = []
            if index is not None:
                blobs = [Blob(self, f"{name}[{k}]", data, diff[0]) for k, (data, diff) in
                         enumerate(zip(self._param_views[index], self._grad_views[index]))]
            if blobs:
                self._params[name] = blobs
            self.layers.append(_LayerView(name, e.layer.type_name, blobs))
        self.inputs = [names[t] for e in net.sources if e.layer.type_name == "Input"
                       for t in e.tops]
        self.outputs = sorted(available)    # as Caffe: its set of unconsumed blob names
        self.top_names = OrderedDict((n, [names[t] for t in e.tops])
                                     for n, e in zip(layer_names, self._order))
        self.bottom_names = OrderedDict((n, [names[b] for b in e.bottoms])
                                        for n, e in zip(layer_names, self._order))

    def _batch_view(self, blob, arrays):
        """A blob's whole-batch array: a batch value (a loss) as a 0-d view of its one part."""
        if blob in self._net.batch_values:
            return arrays[blob][0, ...]
        return arrays[blob]

    @property
    def blobs(self):
        return self._blobs

    @property
    def params(self):
        self._sync_params()
        return self._params

    @property
    def layer_dict(self):
        return OrderedDict(zip(self._layer_names, self.layers))

    @property
    def blob_loss_weights(self):
        """{blob name: its loss weight} for every blob, 0 for those that are no loss."""
        weights = {self._names[b]: w for b, w in self._net.loss_weights.items()}
        return OrderedDict((name, float(weights.get(name, 0.0))) for name in self._blobs)

    def set_input_arrays(self, data, labels):
        """Hands data (n, C, H, W) and labels (n,), float32, n a multiple of the batch size, to
        the net's first layer, a MemoryData layer; forward() then reads them a batch at a
        time from the first, going round (Caffe's set_input_arrays)."""
        first = self._order[0] if self._order else None
        if first is None or first.layer.type_name != "MemoryData":
            raise CgpError(f"net.set_input_arrays: the first layer of net '{self._net.name}' "
                           "must be a MemoryData layer, as in Caffe")
        first.layer.set_arrays(data, labels)
        self._cursor = 0

    def clear_param_diffs(self):
        """Zeroes every parameter diff (Caffe's ClearParamDiffs)."""
        self._grads[...] = 0

    def share_with(self, other):
        """Shares other's weights (Caffe's ShareTrainedLayersWith): both nets then read and
        write one parameter array. The nets' learnable blobs must match, layer by layer."""
        if self._param is None:
            raise CgpError(f"net.share_with: net '{self._net.name}' belongs to a solver, "
                           "whose weights it keeps; call other.share_with(solver.net)")
        mine = [(b.layer, b.shape) for b in self._net.param_blobs]
        theirs = [(b.layer, b.shape) for b in other._net.param_blobs]
        if mine != theirs:
            raise CgpError(f"net.share_with: nets '{self._net.name}' and '{other._net.name}' "
                           "differ in their learnable blobs (layers or shapes); cgp shares "
                           "the weights of nets whose blobs match")
        other._sync_params()
        self._net.params = other._net.params
        self._param_views = self._net.param_views(self._net.params)
        self._layout()

    def _batches(self, arrays, batch):
        """Dicts of `batch` rows of each array in turn, the last padded with zeros."""
        counts = {len(a) for a in arrays.values()}
        if len(counts) != 1:
            raise CgpError(f"net.forward_all: the arrays have different lengths {sorted(counts)}")
        total = counts.pop()
        for lo in range(0, total, batch):
            part = {}
            for name, array in arrays.items():
                rows = np.asarray(array[lo:lo + batch], np.float32)
                if len(rows) < batch:
                    rows = np.concatenate([rows, np.zeros((batch - len(rows),) + rows.shape[1:],
                                                          np.float32)])
                part[name] = rows
            yield part

    def forward_all(self, blobs=None, **kwargs):
        """forward() over arrays of any length, a batch at a time (the last padded): returns
        {output (and each of `blobs`): the rows for every input row}, as pycaffe's."""
        return self._all(lambda part: self.forward(blobs=blobs, **part), kwargs,
                         list(self.outputs) + list(blobs or ()))

    def backward_all(self, diffs=None, **kwargs):
        """backward() over output diffs of any length, a batch at a time: returns {input (and
        each of `diffs`): its diff for every row}, as pycaffe's."""
        return self._all(lambda part: self.backward(diffs=diffs, **part), kwargs,
                         list(self.inputs) + list(diffs or ()))

    def _all(self, run, arrays, names):
        """run(part) for each batch of `arrays` (once where none are given), the rows of
        each result gathered, the padding left out; a batch value (a loss) once per batch."""
        results = {name: [] for name in names}
        total = len(next(iter(arrays.values()))) if arrays else None
        batch = self._blobs[next(iter(arrays))]._data.shape[0] if arrays else None
        for part in self._batches(arrays, batch) if arrays else [{}]:
            for name, value in run(part).items():
                value = np.array(value, copy=True)
                rows = results.setdefault(name, [])
                if value.ndim:
                    rows.extend(value)
                else:
                    rows.append(value)
        per_row = {name for name, blob in self._blobs.items() if blob._data.ndim}
        return {name: np.asarray(rows[:total] if name in per_row else rows)
                for name, rows in results.items()}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported("Net", name, UNSUPPORTED_NET)

    # -- hooks for solver nets -----------------------------------------------------------
    def _current(self, name):
        """Brings the blobs up to date before `name` is read, where they are stale."""
        if self._stale is not None and name not in self._exact:
            stale, self._stale = self._stale, None
            stale()

    def _sync_params(self):
        """Makes the parameters current (a test net copies the train net's)."""

    def _next_batch(self):
        """(record position, iteration) of the batch that Data layers read next."""
        k = self._cursor
        self._cursor += 1
        return k * self._net.batch_size, k

    # -- forward and backward ------------------------------------------------------------
    def _layer_index(self, name, default):
        if name is None:
            return default
        if name not in self._layer_names:
            raise CgpError(f"net '{self._net.name}' has no layer '{name}' (its layers: "
                           f"{', '.join(self._layer_names)})")
        return self._layer_names.index(name)

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """pycaffe's forward: kwargs set input blobs (any data layer's tops: a data layer
        whose tops are all given reads nothing, one whose tops are partly given reads its
        batch, which they then replace); Data layers read their next batch, Input layers
        keep what their blobs hold. Runs layers start..end (names, inclusive);
        returns {output (or end's top) name: its data}, plus the blobs named in `blobs`."""
        self._stale, self._exact = None, set()
        self._pending_reshape()
        sources = {self._names[t] for e in self._net.sources for t in e.tops}
        given = {}
        for name, value in kwargs.items():
            if name not in sources:
                raise CgpError(f"net.forward({name}=...): '{name}' is not an input of net "
                               f"'{self._net.name}' (its data layers' tops: "
                               f"{', '.join(sorted(sources))})")
            shape = self._blobs[name]._data.shape
            given[name] = np.asarray(value, np.float32)
            if given[name].shape != shape:
                raise CgpError(f"net.forward({name}=...): an array of shape "
                               f"{given[name].shape} for blob '{name}' of shape {shape} "
                               f"(reshape it first: net.blobs['{name}'].reshape(...))")
        lo = self._layer_index(start, 0)
        hi = self._layer_index(end, len(self._order) - 1)
        self._sync_params()
        self._run_forward(lo, hi, given=given)
        outputs = self.outputs if end is None else self.top_names[self._layer_names[hi]]
        return {name: self._blobs[name]._data for name in list(outputs) + list(blobs or ())}

    def _run_forward(self, lo, hi, given=None, params=None, batch=None):
        """Layers lo..hi of Caffe's order; data layers read `batch` ((position, iteration)),
        or their next one, unless all their tops are `given` ({blob name: array}), which
        then replace what they read."""
        from cgp.layers import Chunk
        from cgp.commands.timing import denormals
        from threadpoolctl import threadpool_limits

        net = self._net
        sources = {id(e) for e in net.sources}
        loads = [e for e in self._order[lo:hi + 1] if id(e) in sources
                 and e.layer.type_name != "Input"
                 and not all(self._names[t] in (given or {}) for t in e.tops)]
        position, iteration = batch if batch is not None else (
            self._next_batch() if loads else (0, self._cursor))
        for e in loads:
            for t, array in zip(e.tops, e.layer.load(position, iteration, self.seed)):
                self._inputs[t][...] = array
        for name, array in (given or {}).items():
            self._blobs[name]._data[...] = array
        chunk = Chunk(iteration=iteration, seed=self.seed, **self._chunk)
        params = params if params is not None else self._param_views
        with threadpool_limits(limits=1), denormals(True):
            for e in self._order[lo:hi + 1]:
                index = self._entry_index.get(id(e))
                if index is not None:
                    self._forward_entry(index, params[index], chunk)
        self._iteration = iteration

    def _forward_entry(self, i, params, chunk):
        """Entry i over the whole batch as one call of one part, by the layer contract."""
        net, data, scratch = self._net, self._data, self._ws.scratch[i]
        e = net.entries[i]
        bottoms = [data[b][0, ...] if b in net.batch_values else data[b] for b in e.bottoms]
        if net.whole_calls[i]:
            e.layer.forward_parts(bottoms, [data[t][:1] for t in e.tops], params, scratch, chunk)
        elif e.layer.reduces_batch:
            e.layer.forward(bottoms, [data[t][0, ...] for t in e.tops], params, scratch[0], chunk)
        else:
            e.layer.forward(bottoms, [data[t] for t in e.tops], params, scratch, chunk)

    def _plan(self):
        """Per entry (backward?, [propagate to bottom i?]): Caffe's need_backward (the
        net's), or with force_backward every layer, into every bottom but labels."""
        net = self._net
        force = self._param is not None and self._param.force_backward
        plan = []
        for e in net.entries:
            if not force:
                plan.append((e.backward, list(e.propagate)))
            elif e.layer.reduces_batch:
                plan.append((e.backward, [e.backward and j == 0 for j in range(len(e.bottoms))]))
            else:
                plan.append((True, [True] * len(e.bottoms)))
        return plan

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """pycaffe's backward after forward: kwargs set output diffs (a net without a loss:
        the gradient to propagate); losses get their loss weight. Runs layers start..end
        of Caffe's order backwards (start the later one, as pycaffe); clears the parameter
        diffs first. Returns {input (or end's bottom) name: its diff}, plus `diffs`."""
        from cgp.layers import Chunk
        from cgp.commands.timing import denormals
        from threadpoolctl import threadpool_limits

        net = self._net
        self._current(None)
        for name, value in kwargs.items():
            if name not in self.outputs:
                raise CgpError(f"net.backward({name}=...): '{name}' is not an output of net "
                               f"'{net.name}' (outputs: {', '.join(self.outputs)})")
            self._blobs[name]._diff[...] = np.asarray(value, np.float32)
        hi = self._layer_index(start, len(self._order) - 1)
        lo = self._layer_index(end, 0)
        for blob, weight in net.loss_weights.items():
            self._diff[blob][...] = weight
        self._grads[...] = 0
        plan = self._plan()
        chunk = Chunk(iteration=getattr(self, "_iteration", 0), seed=self.seed, **self._chunk)
        with threadpool_limits(limits=1), denormals(True):
            for e in reversed(self._order[lo:hi + 1]):
                index = self._entry_index.get(id(e))
                if index is not None and plan[index][0]:
                    self._backward_entry(index, plan[index][1], chunk)
        names = self.inputs if end is None else self.bottom_names[self._layer_names[lo]]
        return {name: self._blobs[name]._diff for name in list(names) + list(diffs or ())}

    def _backward_entry(self, i, propagate, chunk):
        net, data, diff, scratch = self._net, self._data, self._diff, self._ws.scratch[i]
        e = net.entries[i]
        params, pd = self._param_views[i], self._grad_views[i]
        bottoms = [data[b][0, ...] if b in net.batch_values else data[b] for b in e.bottoms]
        bottom_diff = [diff[b] if f else None for b, f in zip(e.bottoms, propagate)]
        if net.whole_calls[i]:
            e.layer.backward_parts([data[t][:1] for t in e.tops], [diff[t][:1] for t in e.tops],
                                   bottoms, bottom_diff, params, pd, scratch, chunk)
        elif e.layer.reduces_batch:
            e.layer.backward([data[t][0, ...] for t in e.tops], [diff[t][0, ...] for t in e.tops],
                             bottoms, bottom_diff, params, [d[0:1] for d in pd], scratch[0],
                             chunk)
        else:
            e.layer.backward([data[t] for t in e.tops], [diff[t] for t in e.tops], bottoms,
                             bottom_diff, params, pd, scratch, chunk)

    # -- weights and shapes ----------------------------------------------------------------
    def save(self, path):
        """Writes the weights as a .caffemodel (Caffe's net.save)."""
        from cgp.snapshot import write_caffemodel
        self._sync_params()
        write_caffemodel(Path(path), self._net)

    def copy_from(self, path):
        """Copies weights from a .caffemodel (or .caffemodel.h5) by layer name (Caffe's
        net.copy_from)."""
        from cgp.snapshot import load_weights
        load_weights(self._net, path)

    def save_hdf5(self, path):
        """Writes the weights in Caffe's HDF5 layout, whatever the name (net.save_hdf5)."""
        from cgp.data.hdf5 import model_bytes
        from cgp.snapshot import atomic_write
        self._sync_params()
        atomic_write(Path(path), model_bytes(self._net))

    def load_hdf5(self, path):
        """Copies weights from a model in Caffe's HDF5 layout (net.load_hdf5): copy_from,
        which knows an HDF5 file by its first bytes."""
        self.copy_from(path)

    def _reshape_input(self, name, shape):
        if name not in self.inputs:
            raise CgpError(f"blob '{name}'.reshape(...): only an Input layer's top can be "
                           f"reshaped in cgp (inputs of net '{self._net.name}': "
                           f"{', '.join(self.inputs) or 'none'})")
        if self._param is None:
            raise CgpError(f"blob '{name}'.reshape(...): the net belongs to a solver")
        self._pending_shapes[name] = shape

    def reshape(self):
        """Rebuilds the net for the input shapes given to Blob.reshape (Caffe's reshape)."""
        self._pending_reshape()

    def _pending_reshape(self):
        """Rebuilds the net for new input shapes, keeping its weights and input values where
        they still fit."""
        from cgp.net import build_net
        from cgp.proto import caffe_pb2

        if not self._pending_shapes:
            return
        param = caffe_pb2.NetParameter()
        param.CopyFrom(self._param)
        for lp in param.layer:
            if lp.type != "Input":
                continue
            shapes = list(lp.input_param.shape)
            if len(shapes) == 1 and len(lp.top) > 1:
                shapes = [caffe_pb2.BlobShape(dim=shapes[0].dim) for _ in lp.top]
            del lp.input_param.shape[:]
            for top, old in zip(lp.top, shapes):
                lp.input_param.shape.add().dim.extend(self._pending_shapes.get(top, old.dim))
        self._pending_shapes = {}
        old = self._net
        net = build_net(param, self._model, self._phase, self._options, stages=self._stages,
                        level=self._level)
        if net.n_params != old.n_params:
            raise CgpError(f"net '{old.name}': the new input shapes change the shapes of "
                           "learned parameters (an InnerProduct after them, most likely)")
        net.params[...] = old.params
        self._param = param
        self._attach(net)


# -- solvers ---------------------------------------------------------------------------
def _quiet(line):
    pass


class _SolverNet(Net):
    """solver.net: the solver's train net. Its blobs after step() hold the last iteration's
    forward (its exact outputs at once; the other blobs computed from that batch and the
    weights before its update when first read); forward() reads the batch of the next
    iteration without taking it from the solver."""

    def _next_batch(self):
        return self._solver._train_batch(self._solver._trainer.iter)


class _TestNet(Net):
    """solver.test_nets[i]: a test net with the train net's weights (Caffe shares them by
    layer name); forward() reads the next test batch."""

    def _sync_params(self):
        from cgp.train import copy_shared
        copy_shared(self._solver._trainer.net, self._net)


class Solver:
    """pycaffe's solver: Solver(path) with the solver type the prototxt names; SGDSolver,
    AdamSolver, ... with theirs. cgp adds threads= and chunks= (results depend on chunks,
    never on threads), workers= ('threads' or 'processes'), seed= (over random_seed),
    data_dir=, download=, snapshot_prefix= and log= (a function given each log line;
    default: quiet)."""
    TYPE = None

    def __init__(self, path, threads=1, chunks=16, workers=None, seed=None, data_dir=None,
                 download=True, snapshot_prefix=None, log=None):
        from cgp.prototxt import read_solver
        from cgp.train import RunConfig, Trainer

        sp = read_solver(path)
        if self.TYPE is not None:
            sp.type = self.TYPE
        extra = {"workers": workers} if workers is not None else {}
        config = RunConfig(threads=threads, chunks=chunks, seed=seed, data_dir=data_dir,
                           download=download, progress=False, snapshot_prefix=snapshot_prefix,
                           **_MODE, **extra)
        self._sp, self._log = sp, log or _quiet
        self._trainer = Trainer(sp, str(path), config, log=self._log)
        self._closer = weakref.finalize(self, self._trainer.close)
        seed = self._trainer.seed
        self.net = _SolverNet._wrap(self._trainer.net, seed)
        self.net._solver = self
        self.test_nets = []
        for net in self._trainer.test_nets:
            test = _TestNet._wrap(net, seed)
            test._solver = self
            self.test_nets.append(test)

    @property
    def iter(self):
        return self._trainer.iter

    @property
    def type(self):
        return self._sp.type

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported("Solver", name, UNSUPPORTED_SOLVER)

    def _train_batch(self, it, last=False):
        """(record position, data iteration) of iteration it's first pass (its last with
        `last`): iter_size passes per iteration, counted from the trainer's data origin, as
        the Trainer reads them."""
        size = max(1, self._sp.iter_size)
        k = size - 1 if last else 0
        return ((it - self._trainer.data_origin) * size + k) * self._trainer.net.batch_size, \
            it * size + k

    def step(self, iters):
        """Trains `iters` iterations, displaying (to log) and snapshotting as Caffe's Step
        does; no periodic tests (solve() runs them)."""
        from threadpoolctl import threadpool_limits

        t, sp = self._trainer, self._sp
        end = t.iter + int(iters)
        result = None
        with threadpool_limits(limits=1):
            while t.iter < end:
                n = end - t.iter
                if sp.snapshot > 0:
                    n = min(n, sp.snapshot - t.iter % sp.snapshot)
                if t.iter + n == end:   # the last iteration alone, its weights kept before
                    if n > 1:
                        t.steps(n - 1, self._display)
                    before = t.net.params.copy()
                    result = t.steps(1, self._display)
                else:
                    t.steps(n, self._display)
                if sp.snapshot > 0 and t.iter % sp.snapshot == 0:
                    t.snapshot()
        if result is not None:
            self._after_step(t.iter - 1, before, result[1])
            # As Caffe's diffs after a step: the step taken (the update writes it over the
            # summed gradient, Solver.apply).
            self.net._grads[0][...] = t.train_step.updater.gradient

    def apply_update(self):
        """One update of the weights from solver.net's parameter diffs, at the current
        iteration's rate (Caffe's ApplyUpdate: the iteration count stays; the diffs then
        hold the step taken)."""
        t = self._trainer
        self.net._sync_params()
        t.solver.update(t.net.params, self.net._grads[0].astype(t.net.params.dtype, copy=False),
                        t.iter)
        self.net._stale, self.net._exact = None, set()

    def _display(self, it, loss, outputs, rate):
        sp = self._sp
        if self._log is not _quiet and sp.display and it % sp.display == 0:
            self._log(f"Iteration {it}, loss = {loss:.6g}")
            for j, (name, value) in enumerate(outputs.items()):
                self._log(f"    Train net output #{j}: {name} = {value:.6g}")
            self._log(f"Iteration {it}, lr = {rate:.6g}")
        return False

    def _after_step(self, it, weights, outputs):
        """solver.net's blobs: the trainer's outputs of iteration `it` now, the other blobs
        computed when first read from its last pass's batch and `weights` (before its
        update)."""
        net = self.net
        for name, value in outputs.items():
            if name in net._blobs:
                net._blobs[name]._data[...] = value
        net._exact = set(outputs)

        def recompute():
            views = self._trainer.net.param_views(weights)
            net._run_forward(0, len(net._order) - 1, params=views,
                             batch=self._train_batch(it, last=True))
            for name, value in outputs.items():
                if name in net._blobs:
                    net._blobs[name]._data[...] = value
        net._stale = recompute

    def solve(self, resume=None):
        """Trains to max_iter with Caffe's tests, display and snapshots (cgp train's loop);
        resume: a .solverstate to restore first."""
        if resume is not None:
            self.restore(resume)
        self.net._stale, self.net._exact = None, set()
        return self._trainer.solve()

    def snapshot(self):
        """Writes <prefix>_iter_<N>.caffemodel and .solverstate; returns the .caffemodel path."""
        return str(self._trainer.snapshot())

    def restore(self, path):
        """Resumes from a .solverstate (and the .caffemodel it names)."""
        self._trainer.restore(str(path))
        self.net._stale, self.net._exact = None, set()

    def close(self):
        """Stops the workers (also done when the solver is garbage collected or at exit)."""
        self._closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def get_solver(path, **options):
    """A solver of the type the prototxt names (pycaffe's caffe.get_solver)."""
    return Solver(path, **options)


class SGDSolver(Solver):
    TYPE = "SGD"


class NesterovSolver(Solver):
    TYPE = "Nesterov"


class AdaGradSolver(Solver):
    TYPE = "AdaGrad"


class RMSPropSolver(Solver):
    TYPE = "RMSProp"


class AdaDeltaSolver(Solver):
    TYPE = "AdaDelta"


class AdamSolver(Solver):
    TYPE = "Adam"
