"""Weights and solver state in Caffe's binary formats (.caffemodel, .solverstate), and in
its HDF5 ones (.caffemodel.h5, .solverstate.h5: cgp.data.hdf5) where a path ends in .h5; and the
snapshots of a run: each a pair of the two, under a prefix that one run at a time holds.

Files are written atomically (a temporary file in the same folder, then a rename), so
a crash or a kill never leaves a half-written file behind; a snapshot's two files are
committed in a fixed order that a later run can finish (write_snapshot,
recover_snapshots). Readers turn any malformed input into one DataError naming the file.
"""
import errno
import math
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from cgp.data import hdf5
from cgp.errors import CgpError, DataError, shorten
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
                        f"(truncated or foreign file): {shorten(e)}") from None
    unknown = [f.field_number for f in unknown_fields.UnknownFieldSet(message)
               if f.field_number not in allowed_unknown]
    if unknown:
        raise DataError(f"{what} {path}: not a Caffe {type(message).__name__} (foreign or "
                        f"corrupt file: field {unknown[0]} is not part of the message)")
    return message


def _text(value, what):
    """A string field of a parsed binary file: protobuf hands one that is not UTF-8 over as
    bytes (a damaged or foreign file)."""
    if isinstance(value, bytes):
        raise DataError(f"{what} is not text ({shorten(value)}): a damaged or foreign file")
    return value


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
    with np.errstate(over="ignore"):   # a double beyond float32's range: refused below
        array = np.array(values, np.float32).reshape(shape)
    finite = np.isfinite(array)
    if not finite.all():
        # Also a finite double too big for float32: it would train as an infinity.
        at = np.flatnonzero(~finite.ravel())[0]
        raise DataError(f"{where}: value {values[at]} at index {at} (of {size}) is not a "
                        "finite float32; a weights file holding NaN or infinities is "
                        "refused (the run that wrote it had diverged)")
    return array


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
    """Binary, or HDF5 (cgp.data.hdf5) where path ends in .h5, as Caffe chooses."""
    atomic_write(path, model_bytes(path, net))


def model_bytes(path, net):
    """What write_caffemodel writes to `path`: HDF5 where it ends in .h5, else binary."""
    return hdf5.model_bytes(net) if hdf5.is_hdf5(path) else net_to_proto(net).SerializeToString()


def read_caffemodel(path):
    """{layer name: [arrays]} of every layer with blobs (new or V1 layer format, or an
    HDF5 model: cgp.data.hdf5)."""
    data = _read_bytes(path, "weights file")
    if hdf5.is_hdf5(path, data):
        return hdf5.read_model(data, path)
    proto = _parse(data, caffe_pb2.NetParameter(), path, "weights file")
    layers = list(proto.layer) or list(proto.layers)
    if not layers:
        raise DataError(f"weights file {path}: not a Caffe model (a NetParameter without "
                        "layers)")
    weights = {}
    for lp in layers:
        if len(lp.blobs):
            name = _text(lp.name, f"weights file {path}: a layer name")
            if name in weights:
                raise DataError(f"weights file {path}: two layers named '{shorten(name)}' "
                                "hold blobs")
            weights[name] = [blob_to_array(b, f"weights file {path}, layer "
                                              f"'{shorten(name)}' blob {i}")
                             for i, b in enumerate(lp.blobs)]
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
        log(f"Copied weights of {len(copied)} layers from {path}: "
            f"{shorten(', '.join(copied) or '-', 1000)}")
        if skipped:
            log(f"Skipped {len(skipped)} layers not in the net: "
                f"{shorten(', '.join(skipped), 1000)}")
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
        if isinstance(arrays, hdf5.Partial) and len(arrays) <= len(blobs):
            # An HDF5 model leaves out blobs shared with an earlier layer (Caffe's rule).
            arrays = arrays + [None] * (len(blobs) - len(arrays))
            for i, (blob, array) in enumerate(zip(blobs, arrays)):
                if array is None and blob.layer == name:
                    raise DataError(f"weights file {path}: layer '{shorten(name)}' has no blob "
                                    f"{i}, which it does not share with another layer")
        if len(blobs) != len(arrays):
            raise DataError(f"weights file {path}: layer '{shorten(name)}' has {len(arrays)} "
                            f"blobs, the net expects {len(blobs)}")
        for i, (blob, array) in enumerate(zip(blobs, arrays)):
            if array is not None and not _fits(array, blob.shape):
                raise DataError(f"weights file {path}: layer '{shorten(name)}' blob {i} has shape "
                                f"{array.shape}, the net expects {blob.shape} (rename the "
                                "layer to learn it from scratch instead)")
        for blob, array in zip(blobs, arrays):
            if array is not None:
                net.params[blob.offset:blob.offset + blob.size] = array.ravel()
        copied.append(name)
    return copied, skipped


# The field of cgp's SolverStateTrailer: unknown to Caffe's SolverState (see cgp.proto).
RESUME_FIELD = cgp_pb2.SolverStateTrailer.DESCRIPTOR.fields_by_name["cgp_resume"].number


def write_solverstate(path, iteration, learned_net, solver, net, resume=None):
    """Write solverstate_bytes(...) to path atomically (HDF5's where path ends in .h5)."""
    atomic_write(path, state_bytes(path, iteration, learned_net, solver, net, resume))


def state_bytes(path, iteration, learned_net, solver, net, resume=None):
    """What write_solverstate writes to `path`: HDF5 where it ends in .h5, else binary."""
    make = hdf5.solverstate_bytes if hdf5.is_hdf5(path) else solverstate_bytes
    return make(iteration, learned_net, solver, net, resume)


def solverstate_bytes(iteration, learned_net, solver, net, resume=None):
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
    return payload


# -- snapshots: pairs under a prefix -------------------------------------------------
# A snapshot is <prefix>_iter_<N>.caffemodel and .solverstate, Caffe's names and formats
# (.caffemodel.h5 and .solverstate.h5 with snapshot_format HDF5).
# write_snapshot writes both to temporary files named after them (pair_temp), syncs them,
# then renames the .caffemodel's and only then the .solverstate's: a .solverstate that
# exists always has its weights in place. A kill between the two renames leaves the
# .solverstate's temporary file alone, whole (synced before the first rename), which the
# next run on the prefix renames (recover_snapshots); a kill before leaves both temporary
# files, which it deletes. Either way the pair ends up whole, old or new.

def pair_temp(path):
    """The temporary file that write_snapshot writes `path` through: '.<name>.tmp'."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def prefix_parts(prefix):
    """(folder, stem) of a snapshot prefix: '<folder>/<stem>_iter_<N>.caffemodel'. A prefix
    that ends in '/' has an empty stem, as in Caffe."""
    probe = Path(f"{prefix}_iter_0.caffemodel")
    return probe.parent, probe.name[:-len("_iter_0.caffemodel")]


def snapshot_paths(prefix, iteration, h5=False):
    """(model, state): <prefix>_iter_<iteration>.caffemodel and .solverstate, with .h5."""
    ext = ".h5" if h5 else ""
    return (Path(f"{prefix}_iter_{iteration}.caffemodel{ext}"),
            Path(f"{prefix}_iter_{iteration}.solverstate{ext}"))


def write_snapshot(prefix, iteration, net, solver, resume=None, h5=False):
    """Write the snapshot <prefix>_iter_<iteration>.caffemodel and .solverstate as a pair
    (see above), in HDF5 with h5; returns the model's path. CgpError naming the file when
    the disk refuses (full, removed): the snapshot written before is then left as it was."""
    model, state = snapshot_paths(prefix, iteration, h5)
    writable_folder(model)
    payloads = [(model, model_bytes(model, net)),
                (state, state_bytes(state, iteration, model, solver, net, resume))]
    temps = [pair_temp(path) for path, _ in payloads]
    try:
        for temp, (_, payload) in zip(temps, payloads):
            with open(temp, "wb") as f:   # open() applies the umask, as Caffe's writer
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
    except BaseException as e:
        for temp in temps:
            temp.unlink(missing_ok=True)
        if isinstance(e, OSError):   # a full disk, a folder removed meanwhile, ...
            raise CgpError(f"cannot write snapshot {model}: {e.strerror or e}") from None
        raise
    try:
        with _signals_held():   # a Ctrl-C now waits for the pair to be committed
            os.replace(temps[0], model)
            _sync_folder(model.parent)
            os.replace(temps[1], state)
            _sync_folder(model.parent)
    except OSError as e:
        raise CgpError(f"cannot write snapshot {model}: {e.strerror or e} (the next run on "
                       f"this prefix completes or removes it)") from None
    return model


@contextmanager
def _signals_held(signums=(signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))):
    """Ctrl-C, SIGTERM and SIGHUP that arrive meanwhile take effect when the block ends:
    their handlers are set aside and the signals raised again after. Python runs signal
    handlers in the main thread only, so only there; elsewhere the block runs as is."""
    caught = []
    try:
        old = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
               for s in signums if s is not None}
    except ValueError:    # not the main thread
        yield
        return
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
        for signum in caught:
            signal.raise_signal(signum)


def recover_snapshots(prefix, log=None):
    """Finish what interrupted runs left of the prefix's snapshots: a .solverstate's
    temporary file found alone is the second half of a committed pair and takes its name;
    every other temporary file of the prefix (of write_snapshot, atomic_write or
    writable_folder's probe) is deleted. Touches only files named after the prefix's
    snapshots. Returns the names of the snapshots completed."""
    folder, stem = prefix_parts(prefix)
    pattern = re.compile(re.escape(f".{stem}_iter_") + r"(\d+)\.(caffemodel|solverstate)"
                         r"(\.h5)?(\.tmp|\.\w{8}\.tmp|\.\w{8}\.probe)$")
    try:
        names = [e.name for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    temps = {}
    for name in names:
        match = pattern.match(name)
        if match:
            temps.setdefault((int(match[1]), match[3] or ""), []).append(
                (match[2], match[4], folder / name))
    completed, removed = [], []
    for (iteration, ext), files in sorted(temps.items()):   # ext: ".h5" for HDF5 pairs
        pair = {kind: path for kind, suffix, path in files if suffix == ".tmp"}
        state = folder / f"{stem}_iter_{iteration}.solverstate{ext}"
        if set(pair) == {"solverstate"} and _is_state_of(pair["solverstate"], iteration):
            os.replace(pair["solverstate"], state)
            _sync_folder(folder)
            completed.append(state)
            files = [f for f in files if f[2] != pair["solverstate"]]
        for _, _, path in files:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if log is not None:
        for state in completed:
            log(f"Completed the snapshot {state} that an interrupted run had left half "
                "committed")
        if removed:
            log(f"Removed {len(removed)} temporary file(s) of interrupted snapshot writes: "
                f"{shorten(', '.join(removed), 500)}")
    return completed


def _is_state_of(path, iteration):
    """Whether the file holds a SolverState (binary or HDF5) of that iteration (a synced
    temporary file does; this guards against one that something else wrote)."""
    try:
        data = path.read_bytes()
        if data[:8] == hdf5.SIGNATURE:
            return hdf5.read_solverstate(data, path)[0] == iteration
        state = caffe_pb2.SolverState.FromString(data)
    except (OSError, DecodeError, RuntimeError, ValueError, RecursionError, DataError):
        return False
    return state.iter == iteration


def recover_snapshot(path, log=None):
    """recover_snapshots for the prefix of the .solverstate `path`, where its name is a
    snapshot's and a commit of it was cut short, under that prefix's lock (CgpError if
    another run holds it)."""
    match = re.fullmatch(r"(.*)_iter_\d+\.solverstate(\.h5)?", str(path))
    if match is None or not pair_temp(path).exists():
        return
    lock = lock_prefix(match[1])
    try:
        recover_snapshots(match[1], log)
    finally:
        if lock is not None:
            lock.release()


# -- one run per prefix ---------------------------------------------------------------
# A run holds an OS lock on a file beside its snapshots, '.<stem>.lock', for as long as it
# runs: fcntl.lockf, a POSIX record lock, which the OS drops when the process ends however
# it ends (SIGKILL too) and which forked worker processes do not inherit (a flock would
# stay held by workers that outlive a killed main process). Such locks belong to the
# process, so every Trainer of one process shares its lock (_LOCKS counts them), and no
# other code may open and close the lock file (closing any descriptor of it drops it).
_LOCKS = {}    # realpath of a lock file -> [descriptor, users]


class PrefixLock:
    """A user's share of the process's lock on a prefix; release() once when done."""

    def __init__(self, key):
        self.key = key

    def release(self):
        key, self.key = self.key, None
        entry = _LOCKS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _LOCKS[key]
            os.close(entry[0])   # drops the OS lock


def lock_prefix(prefix):
    """Takes this process's lock on a snapshot prefix: a PrefixLock, or None where no lock
    can be had (no fcntl, a folder that cannot be written: a snapshot would then fail with
    its own message). CgpError naming the other run when one holds it."""
    try:
        import fcntl
    except ImportError:     # Windows
        return None
    path = lock_path(prefix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(path)
        if key in _LOCKS:
            _LOCKS[key][1] += 1
            return PrefixLock(key)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() if e.errno in (
            errno.EACCES, errno.EAGAIN) else None
        os.close(fd)
        if holder is None:    # locks not supported there (some network file systems)
            return None
        holder = shorten(", ".join(holder.splitlines())) or f"its lock file {path}"
        raise CgpError(f"snapshot prefix '{shorten(prefix)}' is in use by another run "
                       f"({holder}): two runs on one prefix would overwrite each other's "
                       "snapshots; wait for it to end, or give this run another "
                       "--snapshot-prefix") from None
    try:
        command = psutil.Process().cmdline()   # as typed: 'python -m cgp train ...'
    except psutil.Error:
        command = [sys.executable] + sys.argv
    command = shorten(shlex.join(command), 1000)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\ncommand {command}\nsince "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _LOCKS[key] = [fd, 1]
    return PrefixLock(key)


def lock_path(prefix):
    folder, stem = prefix_parts(prefix)
    return folder / (f".{stem}.lock" if stem else ".snapshots.lock")


def read_solverstate(path, solver, net):
    """Restore the solver's histories from a .solverstate. Returns (SolverState, cgp's
    ResumeState or None when the file has none, as a file Caffe wrote)."""
    data = _read_bytes(path, "solver state")
    if hdf5.is_hdf5(path, data):
        iteration, learned, step, history, trailer = hdf5.read_solverstate(data, path)
        state = caffe_pb2.SolverState(iter=iteration, learned_net=learned, current_step=step)
        resume = (None if trailer is None else
                  _parse(trailer, cgp_pb2.ResumeState(), path, "solver state (cgp_resume)"))
    else:
        state = _parse(data, caffe_pb2.SolverState(), path, "solver state",
                       allowed_unknown=(RESUME_FIELD,))
        resume = None
        if any(f.field_number == RESUME_FIELD for f in unknown_fields.UnknownFieldSet(state)):
            trailer = _parse(data, cgp_pb2.SolverStateTrailer(), path, "solver state",
                             allowed_unknown=(1, 2, 3, 4))
            resume = trailer.cgp_resume
            if len(unknown_fields.UnknownFieldSet(resume)):
                raise DataError(f"solver state {path}: cgp's resume record is corrupt")
        history = [blob_to_array(b, f"solver state {path}, history {k}")
                   for k, b in enumerate(state.history)]
    if state.iter < 0:
        raise DataError(f"solver state {path}: negative iteration {state.iter}")
    _text(state.learned_net, f"solver state {path}: its learned_net")
    if resume is not None:
        if resume.HasField("seed") and not 0 <= resume.seed < 2**63:
            raise DataError(f"solver state {path}: its seed {resume.seed} is outside 0 to "
                            "2**63 - 1, the seeds cgp accepts (as --seed)")
        if not 0 <= resume.data_origin <= state.iter:
            raise DataError(f"solver state {path}: cgp's resume record is corrupt (data "
                            f"origin {resume.data_origin} for iteration {state.iter})")
    expected = len(solver.histories) * len(net.param_blobs)
    if len(history) != expected:
        raise DataError(f"solver state {path}: {len(history)} history blobs, the "
                        f"{solver.type} solver on this net needs {expected} "
                        f"({len(solver.histories)} per parameter blob, {len(net.param_blobs)} "
                        f"blobs): written for another net or solver type?")
    arrays = []
    for k, array in enumerate(history):
        blob = net.param_blobs[k % len(net.param_blobs)]
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
