"""Caffe's Python layer (type: "Python", python_param { module layer param_str }): a class
derived from caffe.Layer (cgp.caffe.pylayer), found on sys.path (PYTHONPATH) as Caffe finds
it, run on the whole batch as in Caffe.

How the engine runs it: the batch is cut into chunks, but a Python layer sees the whole
batch, so it is a layer that sums over the batch (Layer.batch_sums, as BatchNorm): its
forward is one sum, its backward another. Each chunk copies its rows of the bottoms (of the
top diffs) into its row of the sum's shares, zero elsewhere; the engine adds the chunks'
shares in its fixed tree, which puts every chunk's rows in place (x + 0 is exactly x), and
sync() then runs the layer's Python on the whole batch, once, writing the tops (the bottom
and parameter diffs) into the sum's total, whence each chunk copies its rows back. So the
results are bitwise the same for any number of workers and MPI ranks (every rank runs the
layer on the whole batch), as long as the layer computes the same thing from the same
batch. What it costs: the sums are float64 and one row per chunk, so memory of
8 * chunks * batch values of the layer's bottoms and tops (diffs too), and while the
Python runs, every other worker waits. Its parameter gradient is added into chunk 0's.

A Python layer without bottoms is a data layer (a source): load() runs its forward once per
batch, before the batch is cut. Its tops need the batch axis first; a 0-d top is given one
axis of size 1. Not supported: tops without the batch axis on a layer with bottoms (a loss
as one value), and --workers processes for a layer with bottoms (its Python object would be
a different copy in each process).
"""
import importlib
import math
import os

import numpy as np

from cgp.caffe.pylayer import BlobVec, Layer as UserLayer, PyBlob
from cgp.errors import NetError, shorten
from cgp.layers.base import SYNC, Layer, assign, flat, register


def _add(target, values):
    """target += values (float64, cast): a parameter gradient added into chunk 0's."""
    np.add(target, values.reshape(target.shape), out=target, casting="unsafe")


def _check_run_here(layer, pid):
    if os.getpid() != pid:
        raise NetError(f"layer '{shorten(layer.name)}' (type Python): a Python layer with "
                       "bottoms runs in the process that built the net, not in worker "
                       "processes: train with --workers threads (or --threads 1)")


@register("Python")
class PythonLayer(Layer):
    """A caffe.Layer subclass of the user's, run on the whole batch (see the module)."""
    bottoms = (0, None)
    tops = (0, None)
    params_read = ("python_param",)
    batch_sums = (1, 1)
    options = None

    def __init__(self, lp, index=0, phase=0):
        super().__init__(lp, index, phase)
        # Without bottoms, a data layer (Net reads is_source and load from the layer): the
        # class itself hands its calls over, as register() sees it.
        self.is_source = not lp.bottom
        if self.is_source:
            self.load = self._load
        self._pid = os.getpid()
        self._propagate = [True] * len(lp.bottom)

    def _make_user(self):
        """The user's layer object, its param_str and phase set, not yet set up."""
        pp = self.lp.python_param
        if not pp.module or not pp.layer:
            raise self.error("python_param needs module and layer (the Python module on "
                             "sys.path / PYTHONPATH and the class in it)")
        # The module says `import caffe`, meaning the framework that runs it: cgp, unless a
        # real Caffe is importable (cgp.caffe.run).
        from cgp.caffe.run import install, real_caffe
        if real_caffe() is None:
            install()
        try:
            module = importlib.import_module(pp.module)
        except ModuleNotFoundError as e:
            if e.name != pp.module.split(".")[0] and e.name != pp.module:
                raise   # the module itself imports something missing: its own error
            raise self.error(f"python_param module '{shorten(pp.module)}' is not on sys.path "
                             "(add its folder to PYTHONPATH)") from None
        cls = getattr(module, pp.layer, None)
        if cls is None or not isinstance(cls, type):
            raise self.error(f"python_param layer '{shorten(pp.layer)}': module "
                             f"'{shorten(pp.module)}' has no such class")
        # Only a caffe.Layer is made: a net file names a class, never any callable.
        if not issubclass(cls, UserLayer):
            raise self.error(f"python_param layer '{shorten(pp.layer)}' of module "
                             f"'{shorten(pp.module)}' is not a caffe.Layer subclass")
        user = cls(self.lp)   # as Caffe makes it
        user.param_str = pp.param_str
        user.phase = self.phase
        if not isinstance(getattr(user, "blobs", None), BlobVec):
            user.blobs = BlobVec()
        return user

    # -- set up once -------------------------------------------------------------
    def setup(self, bottom_shapes):
        """The user's setup and reshape on zeroed bottoms of these shapes: the tops' shapes
        and the learnable blobs (their values after setup are their initial weights)."""
        self.user = self._make_user()
        self.bottom = [PyBlob(s) for s in bottom_shapes]
        self.top = [PyBlob() for _ in self.lp.top]
        self.user.setup(self.bottom, self.top)
        self.user.reshape(self.bottom, self.top)
        self.initial = [np.array(b.data, np.float32) for b in self.user.blobs]
        shapes = [t.shape for t in self.top]
        if self.is_source:
            shapes = [s if s else (1,) for s in shapes]
            for t, s in zip(self.top, shapes):
                t.data, t.diff = t.data.reshape(s), t.diff.reshape(s)
            self.shapes = shapes
            return shapes
        n = bottom_shapes[0][0] if bottom_shapes[0] else None
        for name, s in zip(self.lp.bottom, bottom_shapes):
            if not s or s[0] != n:
                raise self.error(f"bottom '{shorten(name)}' has shape {s}: a Python layer's "
                                 f"bottoms need the batch axis first ({n} samples)")
        for name, s in zip(self.lp.top, shapes):
            if not s or s[0] != n:
                raise self.error(f"top '{shorten(name)}' has shape {s}: cgp runs a Python layer "
                                 f"with bottoms only where each top keeps the batch axis first "
                                 f"({n} samples); a loss as one value is not supported")
        # Where each blob sits in the sums: forward's (bottoms, then tops) and backward's
        # (top diffs, bottom diffs, parameter diffs), rows of `width` values each.
        self.widths_bottom = [math.prod(s[1:]) for s in bottom_shapes]
        self.widths_top = [math.prod(s[1:]) for s in shapes]
        self.batch = n
        return shapes

    def param_shapes(self):
        return [a.shape for a in self.initial]

    def param_fillers(self):
        """The values setup wrote (Net.init_params copies an array as it is)."""
        return list(self.initial)

    def sum_sizes(self):
        n = self.batch
        rows = n * (sum(self.widths_bottom) + sum(self.widths_top))
        return [rows, rows + sum(a.size for a in self.initial)]

    def _offsets(self, widths, start=0):
        offsets = []
        for w in widths:
            offsets.append(start)
            start += self.batch * w
        return offsets, start

    # -- per call: rows into the sums, and back ------------------------------------------
    def _parts(self, arrays, widths, offsets, chunk):
        """(part p, array j's rows of part p, where they sit in a sum) for each part of the
        call and each array given (None: no gradient wanted there)."""
        for p, (a, b) in enumerate(zip(chunk.part_starts[:-1] or (0,),
                                       chunk.part_starts[1:] or (chunk.n,))):
            first = chunk.first + a
            for array, w, off in zip(arrays, widths, offsets):
                if array is not None:
                    yield p, flat(array[a:b]), slice(off + first * w, off + (first + b - a) * w)

    def _rows_in(self, arrays, widths, offsets, chunk, shares):
        """Calls copying each part's rows into its row of the sum's shares; the part that
        holds sample 0 zeroes its whole row first (the tree sum leaves the total there)."""
        if chunk.first == 0:
            yield assign, (shares[0], 0.0)
        for p, rows, where in self._parts(arrays, widths, offsets, chunk):
            yield assign, (shares[p][where], rows)

    def _rows_out(self, arrays, widths, offsets, chunk, total):
        """Calls copying each part's rows out of the sum's total."""
        for _, rows, where in self._parts(arrays, widths, offsets, chunk):
            yield assign, (rows, total[where])

    def _through_sum(self, sums, sent, sent_widths, got, got_widths, chunk):
        """The calls of one pass through a sum (shares, total): each part's rows of `sent`
        into the shares, SYNC (the user's Python runs on the batch's total), then the rows
        of `got` out of the total, laid out after those of `sent`. Returns where the rows of
        `got` end in the total."""
        shares, total = sums
        offs_sent, end = self._offsets(sent_widths)
        offs_got, end = self._offsets(got_widths, end)
        yield from self._rows_in(sent, sent_widths, offs_sent, chunk, shares)
        yield SYNC
        yield from self._rows_out(got, got_widths, offs_got, chunk, total)
        return end

    def forward_calls(self, bottom, top, params, scratch, chunk):
        _check_run_here(self, self._pid)   # bound in a worker process: refused at once
        yield from self._through_sum(scratch["sums"][0], bottom, self.widths_bottom, top,
                                     self.widths_top, chunk)

    def backward_calls(self, top, top_diff, bottom, bottom_diff, params, param_diff, scratch,
                       chunk):
        self._propagate = [d is not None for d in bottom_diff]
        sums = scratch["sums"][1]
        end = yield from self._through_sum(sums, top_diff, self.widths_top, bottom_diff,
                                           self.widths_bottom, chunk)
        total = sums[1]
        if chunk.first == 0:
            for pd, a in zip(param_diff, self.initial):
                yield _add, (pd[0], total[end:end + a.size])
                end += a.size

    # -- once per batch: the user's Python -------------------------------------------------
    def _blobs(self, blobs, widths, offsets, values, what):
        for blob, w, off in zip(blobs, widths, offsets):
            getattr(blob, what)[...] = values[off:off + self.batch * w].reshape(blob.shape)

    def _same_shapes(self):
        for name, t, w in zip(self.lp.top, self.top, self.widths_top):
            if t.shape[:1] != (self.batch,) or math.prod(t.shape[1:]) != w:
                raise self.error(f"reshape gave top '{shorten(name)}' shape {t.shape}; cgp "
                                 "fixes a net's shapes when it builds it")

    def sync(self, k, totals, params):
        _check_run_here(self, self._pid)
        user = self.user
        for blob, p in zip(user.blobs, params):
            blob.data = p
        offs_b, end = self._offsets(self.widths_bottom)
        offs_t, _ = self._offsets(self.widths_top, end)
        self._blobs(self.bottom, self.widths_bottom, offs_b, totals[0], "data")
        if k == 0:
            user.reshape(self.bottom, self.top)
            self._same_shapes()
            user.forward(self.bottom, self.top)
            self._same_shapes()   # forward may reshape its tops too
            for t, off in zip(self.top, offs_t):
                totals[0][off:off + t.data.size] = t.data.ravel()
            return
        self._blobs(self.top, self.widths_top, offs_t, totals[0], "data")
        offs_td, end = self._offsets(self.widths_top)
        offs_bd, end = self._offsets(self.widths_bottom, end)
        self._blobs(self.top, self.widths_top, offs_td, totals[1], "diff")
        for b in self.bottom:
            b.diff[...] = 0
        for blob in user.blobs:
            blob.diff = np.zeros(blob.data.shape, np.float32)
        user.backward(self.top, list(self._propagate), self.bottom)
        for b, off in zip(self.bottom, offs_bd):
            totals[1][off:off + b.diff.size] = b.diff.ravel()
        for blob in user.blobs:
            totals[1][end:end + blob.diff.size] = blob.diff.ravel()
            end += blob.diff.size

    # -- a data layer ------------------------------------------------------------------
    def __len__(self):
        return self.shapes[0][0]

    def _load(self, start, iteration, seed, rows=None):
        """The user's forward (after its reshape) on no bottoms: the whole batch's tops, or
        their samples `rows`."""
        user = self.user
        user.reshape([], self.top)
        for name, t, s in zip(self.lp.top, self.top, self.shapes):
            if t.data.size != math.prod(s):
                raise self.error(f"reshape gave top '{shorten(name)}' shape {t.shape}; it was "
                                 f"{s} when the net was built")
            t.data = t.data.reshape(s)
        user.forward([], self.top)
        tops = [np.array(t.data, np.float32).reshape(s) for t, s in zip(self.top, self.shapes)]
        return tops if rows is None else [a[rows.start:rows.stop] for a in tops]
