"""Caffe's HDF5 snapshots (`snapshot_format: HDF5`): .caffemodel.h5 weights and
.solverstate.h5 solver states, read and written with h5py (the `hdf5` extra).

The layout is Caffe's (Net::ToHDF5, SGDSolver::SnapshotSolverStateToHDF5 and their
readers): a model holds a group "data" with one group per layer, named as the layer, whose
datasets "0", "1", ... are its parameter blobs (float32, the blob's shape); a blob shared
with an earlier layer is written by its owner only. A solver state holds the scalar int32
datasets "iter" and "current_step", the string "learned_net" (the model's path), and a group
"history" of datasets "0", "1", ...: every history blob in Caffe's order. cgp adds the
dataset "cgp_resume", its ResumeState (cgp/proto/cgp.proto) as bytes, which Caffe never
looks up. A layer name holding '/' becomes nested groups (HDF5 splits names at '/'); Caffe
itself cannot write such a model, and skips such layers when it reads one.

Files are made in memory and written with snapshot.atomic_write, so a snapshot is whole or
absent; a file that is not what it should be is one DataError naming it.
"""
import io

import numpy as np

from cgp.errors import DataError, require

SIGNATURE = b"\x89HDF\r\n\x1a\n"


def require_h5py(what):
    return require("h5py", "hdf5", f"{what}: HDF5 files", error=DataError)


def is_hdf5(path, data=None):
    """Whether `path` is an HDF5 snapshot: named *.h5 (Caffe's rule), or, given its bytes,
    starting with HDF5's signature."""
    return str(path).endswith(".h5") or (data is not None and data[:8] == SIGNATURE)


def _file(data, path, what):
    """An h5py File over the bytes of `path`, read-only."""
    h5py = require_h5py(f"{what} {path}")
    if data[:8] != SIGNATURE:
        raise DataError(f"{what} {path}: not an HDF5 file (Caffe reads files named *.h5 as "
                        "HDF5; this one does not start with HDF5's signature)")
    try:
        return h5py.File(io.BytesIO(data), "r")
    except (OSError, ValueError) as e:
        raise DataError(f"{what} {path}: not a readable HDF5 file: {e}") from None


def _bytes(fill):
    """The bytes of a new HDF5 file that fill(h5py.File) writes."""
    h5py = require_h5py("HDF5 snapshot")
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        fill(f)
    return buffer.getvalue()


def _read_array(dataset, where):
    if not hasattr(dataset, "dtype") or dataset.dtype.kind not in "fiu":
        raise DataError(f"{where}: not a numeric dataset")
    return np.asarray(dataset[()], np.float32)


def model_bytes(net):
    """The .caffemodel.h5 of a net: Net::ToHDF5's layout (see the module's docstring), the
    layers in prototxt order, cgp's Split layers left out as by the binary writer."""
    views = dict(zip((id(e) for e in net.entries), net.param_views(net.params)))
    entries = [e for e in net.sources + net.entries if e.layer.type_name != "Split"]

    def fill(f):
        data = f.create_group("data")
        for entry in sorted(entries, key=lambda e: e.layer.index):
            group = data.require_group(entry.layer.name)
            for j, (p, array) in enumerate(zip(entry.params, views.get(id(entry), []))):
                blob = net.param_blobs[p]
                if blob.layer == entry.layer.name and blob.index == j:   # its owner
                    group.create_dataset(str(j), data=np.asarray(array, np.float32))
    return _bytes(fill)


class Partial(list):
    """A layer's blobs from an HDF5 model: None where the file has no dataset, which is
    right where the net shares that blob with an earlier layer (Caffe writes owners only);
    it may also be shorter than the layer's blobs for that reason."""


def read_model(data, path):
    """{layer name: Partial([arrays or None])} of every layer group of a .caffemodel.h5."""
    with _file(data, path, "weights file") as f:
        top = f.get("data")
        if top is None or not hasattr(top, "keys"):
            raise DataError(f"weights file {path}: not a Caffe HDF5 model (no group 'data')")
        if not len(top):
            raise DataError(f"weights file {path}: its group 'data' holds no layers")
        weights = {}

        def visit(name, item):
            if hasattr(item, "keys"):       # a group: a layer (nested where its name has '/')
                blobs = {int(k): item[k] for k in item.keys()
                         if k.isdigit() and not hasattr(item[k], "keys")}
                if blobs:      # as the binary reader: the layers that hold blobs
                    arrays = Partial([None] * (max(blobs) + 1))
                    for j, dataset in blobs.items():
                        arrays[j] = _read_array(dataset, f"weights file {path}, layer "
                                                         f"'{name}' blob {j}")
                    weights[name] = arrays
        top.visititems(visit)
    return weights


def solverstate_bytes(iteration, learned_net, solver, net, resume=None):
    """The .solverstate.h5 of SGDSolver::SnapshotSolverStateToHDF5 (module docstring)."""
    def fill(f):
        f.create_dataset("iter", data=np.int32(iteration))
        name = str(learned_net).encode()
        f.create_dataset("learned_net", data=np.array(name, dtype=f"S{len(name) + 1}"))
        f.create_dataset("current_step", data=np.int32(solver.current_step))
        history = f.create_group("history")
        k = 0
        for values in solver.histories:
            for blob in net.param_blobs:
                history.create_dataset(str(k), data=values[blob.offset:blob.offset + blob.size]
                                       .reshape(blob.shape).astype(np.float32))
                k += 1
        if resume is not None:
            f.create_dataset("cgp_resume", data=np.frombuffer(resume.SerializeToString(),
                                                              np.uint8))
    return _bytes(fill)


def read_solverstate(data, path):
    """(iter, learned_net, current_step, [history arrays], serialized ResumeState or None)
    of a .solverstate.h5."""
    what = "solver state"
    with _file(data, path, what) as f:
        for name in ("iter", "current_step", "history"):
            if name not in f:
                raise DataError(f"{what} {path}: not a Caffe HDF5 solver state (no '{name}')")
        try:
            iteration, step = int(f["iter"][()]), int(f["current_step"][()])
            learned = f["learned_net"][()] if "learned_net" in f else b""
        except (TypeError, ValueError, AttributeError) as e:
            raise DataError(f"{what} {path}: iter, current_step or learned_net is not what "
                            f"Caffe writes ({e})") from None
        learned = (learned.decode(errors="replace") if isinstance(learned, bytes)
                   else str(learned)).rstrip("\0")
        history = f["history"]
        keys = sorted(history.keys(), key=lambda k: int(k) if k.isdigit() else -1)
        if keys != [str(k) for k in range(len(keys))]:
            raise DataError(f"{what} {path}: its history holds {keys[:4]}...; Caffe writes "
                            "datasets '0', '1', ...")
        arrays = [_read_array(history[k], f"{what} {path}, history {k}") for k in keys]
        resume = bytes(np.asarray(f["cgp_resume"][()], np.uint8)) if "cgp_resume" in f else None
    return iteration, learned, step, arrays, resume
