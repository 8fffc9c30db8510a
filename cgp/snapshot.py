"""Weights and solver state in Caffe's binary formats (.caffemodel, .solverstate).

Files are written atomically (a temporary file in the same folder, then a rename), so
a crash or a kill never leaves a half-written snapshot behind. Readers turn any
malformed input into one DataError naming the file.
"""
import os
import tempfile
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from cgp.errors import DataError
from cgp.proto import caffe_pb2


def atomic_write(path, payload):
    """Write bytes to path via a temporary sibling file and os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read_message(path, message, what):
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{what} {path}: cannot read: {e.strerror}") from None
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise DataError(f"{what} {path}: not a Caffe {type(message).__name__} "
                        f"(truncated or foreign file): {e}") from None
    return message


def blob_to_array(blob, where):
    """A BlobProto's float data as an array of its shape (the `shape` or legacy 4-d form)."""
    if blob.HasField("shape"):
        shape = tuple(int(d) for d in blob.shape.dim)
    else:
        shape = (blob.num, blob.channels, blob.height, blob.width)
    values = blob.data if len(blob.data) else blob.double_data
    if len(values) != int(np.prod(shape)):
        raise DataError(f"{where}: {len(values)} values for shape {shape}")
    return np.array(values, np.float32).reshape(shape)


def array_to_blob(array, blob):
    blob.shape.dim.extend(array.shape)
    blob.data.extend(np.asarray(array, np.float32).ravel().tolist())
    return blob


def net_to_proto(net, layer_params):
    """NetParameter with the net's layers and their learned blobs (Caffe's ToProto)."""
    proto = caffe_pb2.NetParameter(name=net.name)
    views = [[] for _ in net.sources] + net.param_views(net.params)
    for entry, blobs in zip(net.sources + net.entries, views):
        if entry.layer.type_name == "Split":
            continue
        lp = proto.layer.add()
        lp.CopyFrom(layer_params.get(entry.layer.name, entry.layer.lp))
        del lp.blobs[:]
        for array in blobs:
            array_to_blob(array, lp.blobs.add())
    return proto


def write_caffemodel(path, net):
    atomic_write(path, net_to_proto(net, {}).SerializeToString())


def read_caffemodel(path):
    """{layer name: [arrays]} of every layer with blobs (new or V1 layer format)."""
    proto = _read_message(path, caffe_pb2.NetParameter(), "weights file")
    layers = list(proto.layer) or list(proto.layers)
    weights = {}
    for lp in layers:
        if len(lp.blobs):
            weights[lp.name] = [blob_to_array(b, f"weights file {path}, layer '{lp.name}'")
                                for b in lp.blobs]
    return weights


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
            if array.size != blob.size or (array.shape != blob.shape and array.ndim == len(blob.shape)):
                raise DataError(f"weights file {path}: layer '{name}' blob {i} has shape "
                                f"{array.shape}, the net expects {blob.shape}")
            net.params[blob.offset:blob.offset + blob.size] = array.ravel()
        copied.append(name)
    return copied, skipped


def write_solverstate(path, iteration, learned_net, solver, net):
    """SolverState: iteration, the .caffemodel path, every history blob in Caffe's order
    (all blobs of the first history, then of the second), and current_step."""
    state = caffe_pb2.SolverState(iter=iteration, learned_net=str(learned_net),
                                  current_step=solver.current_step)
    for history in solver.histories:
        for blob in net.param_blobs:
            array_to_blob(history[blob.offset:blob.offset + blob.size].reshape(blob.shape),
                          state.history.add())
    atomic_write(path, state.SerializeToString())


def read_solverstate(path, solver, net):
    """Restore the solver's histories from a .solverstate; returns the SolverState."""
    state = _read_message(path, caffe_pb2.SolverState(), "solver state")
    expected = len(solver.histories) * len(net.param_blobs)
    if len(state.history) != expected:
        raise DataError(f"solver state {path}: {len(state.history)} history blobs, the "
                        f"{solver.type} solver on this net needs {expected}")
    for k, blob_proto in enumerate(state.history):
        history = solver.histories[k // len(net.param_blobs)]
        blob = net.param_blobs[k % len(net.param_blobs)]
        array = blob_to_array(blob_proto, f"solver state {path}, history {k}")
        if array.size != blob.size:
            raise DataError(f"solver state {path}: history {k} has shape {array.shape}, "
                            f"the net's blob is {blob.shape}")
        history[blob.offset:blob.offset + blob.size] = array.ravel()
    solver.current_step = state.current_step
    return state
