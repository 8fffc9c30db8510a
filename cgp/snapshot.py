"""Weights and solver state in Caffe's binary formats (.caffemodel, .solverstate).

Files are written atomically (a temporary file in the same folder, then a rename), so
a crash or a kill never leaves a half-written snapshot behind. Readers turn any
malformed input into one DataError naming the file.
"""
import math
import os
import tempfile
from pathlib import Path

import numpy as np
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from cgp.errors import CgpError, DataError
from cgp.proto import caffe_pb2, cgp_pb2

# The process umask, read once at import (reading it means setting it, which is not
# thread-safe later on).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def atomic_write(path, payload):
    """Write bytes to path via a temporary sibling file, fsync and os.replace: readers see
    the old file or the whole new one, never a part, whatever kills the writer."""
    path = writable_folder(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)   # mkstemp's 0600 -> what open() would have made
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):   # a full disk, a folder removed meanwhile, ...
            raise CgpError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    _sync_folder(path.parent)


def writable_folder(path):
    """Makes the folder that file `path` goes into, if need be, and checks that files can be
    written there: CgpError naming it otherwise. Returns path as a Path. For a writer to call
    before work whose result would otherwise be lost (a training, a conversion)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CgpError(f"cannot write {path}: {path.parent} is a file, not a folder") from None
    except OSError as e:
        raise CgpError(f"cannot write {path}: folder {path.parent}: {e.strerror or e}") from None
    # Probed by writing a file, as Caffe does: permission bits say nothing for root, nor for
    # a read-only mount or a folder such as /proc.
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
    except OSError as e:
        raise CgpError(f"cannot write {path}: folder {path.parent}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)
    return path


def _sync_folder(folder):
    """Make the rename itself durable; not every platform can open a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_bytes(path, what):
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{what} {path}: cannot read: {e.strerror or e}") from None


def _parse(data, message, path, what, allowed_unknown=()):
    """Parse bytes into message; DataError unless they are a well-formed message of its
    type: parse failures, and unknown fields at the top level (a foreign file parses with
    every field unknown or mistyped), are refused."""
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError, RecursionError) as e:
        raise DataError(f"{what} {path}: not a Caffe {type(message).__name__} "
                        f"(truncated or foreign file): {e}") from None
    unknown = [f.field_number for f in unknown_fields.UnknownFieldSet(message)
               if f.field_number not in allowed_unknown]
    if unknown:
        raise DataError(f"{what} {path}: not a Caffe {type(message).__name__} (foreign or "
                        f"corrupt file: field {unknown[0]} is not part of the message)")
    return message


def blob_to_array(blob, where):
    """A BlobProto's float data as an array of its shape: the `shape` form, or Caffe's
    legacy num/channels/height/width form (a 4-d array)."""
    if len(unknown_fields.UnknownFieldSet(blob)):
        raise DataError(f"{where}: not a Caffe BlobProto (it holds fields BlobProto does not have)")
    if blob.HasField("shape"):
        shape = tuple(int(d) for d in blob.shape.dim)
    else:
        shape = (blob.num, blob.channels, blob.height, blob.width)
    if any(d < 0 for d in shape):
        raise DataError(f"{where}: negative dimension in shape {shape}")
    values = blob.data if len(blob.data) else blob.double_data
    size = math.prod(shape)
    if len(values) != size:
        raise DataError(f"{where}: {len(values)} values for shape {shape} ({size} values)")
    return np.array(values, np.float32).reshape(shape)


def read_blob(path, what):
    """A .binaryproto file (one BlobProto, e.g. Caffe's mean image) as a float32 array."""
    blob = _parse(_read_bytes(path, what), caffe_pb2.BlobProto(), path, what)
    return blob_to_array(blob, f"{what} {path}")


def array_to_blob(array, blob):
    blob.shape.dim.extend(array.shape)
    blob.data.extend(np.asarray(array, np.float32).ravel().tolist())
    return blob


def layer_to_proto(entry, phase, lp):
    """The LayerParameter Caffe writes for a layer: the prototxt's, with the phase set and,
    on a loss layer without loss_weight, the weight 1 that Caffe's LossLayer adds."""
    lp.CopyFrom(entry.layer.lp)
    del lp.blobs[:]
    if not lp.HasField("phase"):
        lp.phase = phase
    if not lp.loss_weight and entry.layer.default_loss_weight:
        lp.loss_weight.append(entry.layer.default_loss_weight)
    return lp


def net_to_proto(net):
    """NetParameter with the net's layers in prototxt order and their learned blobs, as
    Caffe's Net::ToProto writes it. The Split layers cgp inserts are left out: they have
    no blobs, and Caffe ignores a saved net's missing layers when it loads one."""
    proto = caffe_pb2.NetParameter(name=net.name)
    views = dict(zip((id(e) for e in net.entries), net.param_views(net.params)))
    entries = [e for e in net.sources + net.entries if e.layer.type_name != "Split"]
    for entry in sorted(entries, key=lambda e: e.layer.index):
        lp = layer_to_proto(entry, net.phase, proto.layer.add())
        for array in views.get(id(entry), []):
            array_to_blob(array, lp.blobs.add())
    return proto


def write_caffemodel(path, net):
    atomic_write(path, net_to_proto(net).SerializeToString())


def read_caffemodel(path):
    """{layer name: [arrays]} of every layer with blobs (new or V1 layer format)."""
    proto = _parse(_read_bytes(path, "weights file"), caffe_pb2.NetParameter(), path,
                   "weights file")
    layers = list(proto.layer) or list(proto.layers)
    if not layers:
        raise DataError(f"weights file {path}: not a Caffe model (a NetParameter without "
                        "layers)")
    weights = {}
    for lp in layers:
        if len(lp.blobs):
            if lp.name in weights:
                raise DataError(f"weights file {path}: two layers named '{lp.name}' hold blobs")
            weights[lp.name] = [blob_to_array(b, f"weights file {path}, layer '{lp.name}' "
                                                 f"blob {i}") for i, b in enumerate(lp.blobs)]
    return weights


def _fits(array, shape):
    """Whether a saved blob fits a net blob: the same shape, or Caffe's legacy 4-d form of
    it (num, channels, height, width, padded with leading 1s), as Caffe's ShapeEquals."""
    if array.shape == tuple(shape):
        return True
    legacy = (1,) * (4 - len(shape)) + tuple(shape)
    return array.ndim == 4 and len(shape) <= 4 and array.shape == legacy


def load_weights(net, path, log=None):
    """copy_weights from the .caffemodel file `path`, saying with log (unless None) which
    layers it copied and which it skipped; returns the copied layers' names."""
    copied, skipped = copy_weights(net, read_caffemodel(path), path)
    if log is not None:
        log(f"Copied weights of {len(copied)} layers from {path}: {', '.join(copied) or '-'}")
        if skipped:
            log(f"Skipped {len(skipped)} layers not in the net: {', '.join(skipped)}")
    return copied


def layers_without(net, copied):
    """The names of the net's layers with parameters that are not in `copied`, in order."""
    return list(dict.fromkeys(b.layer for b in net.param_blobs if b.layer not in copied))


def copy_weights(net, weights, path):
    """Copy blobs into the net by layer name (Caffe's CopyTrainedLayersFrom).
    Returns (copied layer names, skipped layer names); a shape mismatch is an error."""
    copied, skipped = [], []
    for name, arrays in weights.items():
        blobs = net.blob_param(name)
        if not blobs:
            skipped.append(name)
            continue
        if len(blobs) != len(arrays):
            raise DataError(f"weights file {path}: layer '{name}' has {len(arrays)} blobs, "
                            f"the net expects {len(blobs)}")
        for i, (blob, array) in enumerate(zip(blobs, arrays)):
            if not _fits(array, blob.shape):
                raise DataError(f"weights file {path}: layer '{name}' blob {i} has shape "
                                f"{array.shape}, the net expects {blob.shape} (rename the "
                                "layer to learn it from scratch instead)")
        for blob, array in zip(blobs, arrays):
            net.params[blob.offset:blob.offset + blob.size] = array.ravel()
        copied.append(name)
    return copied, skipped


# The field of cgp's SolverStateTrailer: unknown to Caffe's SolverState (see cgp.proto).
RESUME_FIELD = cgp_pb2.SolverStateTrailer.DESCRIPTOR.fields_by_name["cgp_resume"].number


def write_solverstate(path, iteration, learned_net, solver, net, resume=None):
    """SolverState: iteration, the .caffemodel path as given (Caffe writes it relative, as
    named by the snapshot prefix), every history blob in Caffe's order (all blobs of the
    first history, then of the second), and current_step; then cgp's ResumeState, if
    given, as a trailer that Caffe's reader ignores (see cgp/proto/cgp.proto)."""
    state = caffe_pb2.SolverState(iter=iteration, learned_net=str(learned_net),
                                  current_step=solver.current_step)
    for history in solver.histories:
        for blob in net.param_blobs:
            array_to_blob(history[blob.offset:blob.offset + blob.size].reshape(blob.shape),
                          state.history.add())
    payload = state.SerializeToString()
    if resume is not None:
        payload += cgp_pb2.SolverStateTrailer(cgp_resume=resume).SerializeToString()
    atomic_write(path, payload)


def read_solverstate(path, solver, net):
    """Restore the solver's histories from a .solverstate. Returns (SolverState, cgp's
    ResumeState or None when the file has none, as a file Caffe wrote)."""
    data = _read_bytes(path, "solver state")
    state = _parse(data, caffe_pb2.SolverState(), path, "solver state",
                   allowed_unknown=(RESUME_FIELD,))
    resume = None
    if any(f.field_number == RESUME_FIELD for f in unknown_fields.UnknownFieldSet(state)):
        trailer = _parse(data, cgp_pb2.SolverStateTrailer(), path, "solver state",
                         allowed_unknown=(1, 2, 3, 4))
        resume = trailer.cgp_resume
        if len(unknown_fields.UnknownFieldSet(resume)):
            raise DataError(f"solver state {path}: cgp's resume record is corrupt")
    if state.iter < 0:
        raise DataError(f"solver state {path}: negative iteration {state.iter}")
    expected = len(solver.histories) * len(net.param_blobs)
    if len(state.history) != expected:
        raise DataError(f"solver state {path}: {len(state.history)} history blobs, the "
                        f"{solver.type} solver on this net needs {expected} "
                        f"({len(solver.histories)} per parameter blob, {len(net.param_blobs)} "
                        f"blobs): written for another net or solver type?")
    arrays = []
    for k, blob_proto in enumerate(state.history):
        blob = net.param_blobs[k % len(net.param_blobs)]
        array = blob_to_array(blob_proto, f"solver state {path}, history {k}")
        if not _fits(array, blob.shape):
            raise DataError(f"solver state {path}: history {k} has shape {array.shape}, "
                            f"the net's blob ({blob.layer} {blob.index}) is {blob.shape}")
        arrays.append(array)
    # Everything checked: only now change the solver.
    for k, array in enumerate(arrays):
        history = solver.histories[k // len(net.param_blobs)]
        blob = net.param_blobs[k % len(net.param_blobs)]
        history[blob.offset:blob.offset + blob.size] = array.ravel()
    solver.current_step = state.current_step
    return state, resume
