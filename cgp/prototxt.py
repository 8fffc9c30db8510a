"""Read and write Caffe's text prototxt files (nets, solvers) as caffe_pb2 messages.

Parsing, and Caffe's upgrades of deprecated formats on load (cgp.caffe.upgrade); no checks of what a
net means (layer types, shapes) and no binary files. Every failure is a PrototxtError whose
message is "<file>:<line>:<col>: <what>".
"""
import math
import sys
from pathlib import Path

from functools import lru_cache

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from cgp.errors import PrototxtError, shorten
from cgp.proto import caffe_pb2, cgp_pb2
from cgp.caffe.upgrade import V1_TYPES, note, upgrade_net

# Caffe's own spelling of each old SolverParameter.solver_type value as a `type` string.
_SOLVER_TYPE_NAMES = {
    caffe_pb2.SolverParameter.SGD: "SGD",
    caffe_pb2.SolverParameter.NESTEROV: "Nesterov",
    caffe_pb2.SolverParameter.ADAGRAD: "AdaGrad",
    caffe_pb2.SolverParameter.RMSPROP: "RMSProp",
    caffe_pb2.SolverParameter.ADADELTA: "AdaDelta",
    caffe_pb2.SolverParameter.ADAM: "Adam",
}


def to_stderr(line):
    """Where notes go when the caller gives no log: Caffe's glog writes them to stderr."""
    print(line, file=sys.stderr)


def parse_text(text, message, filename="<string>"):
    """Parse prototxt `text` into `message` (a caffe_pb2 message, filled in place) and return it."""
    filename = shorten(filename)
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        what = _located(e, filename)
        if "V1LayerParameter.LayerType" in what:
            known = ", ".join(caffe_pb2.V1LayerParameter.LayerType.Name(t) for t in V1_TYPES)
            what += f" (the V1 format's layer types are: {known})"
        raise PrototxtError(what) from None
    # Caffe's C++ parser rejects a message that lacks a `required` field; Python's does not.
    if not message.IsInitialized():
        missing = ", ".join(message.FindInitializationErrors())
        raise PrototxtError(f"{filename}: required field(s) not set: {shorten(missing)}")
    return message


def parse_net(text, filename="<string>", log=to_stderr):
    """Parse a net prototxt into a NetParameter, upgrading deprecated formats as Caffe does
    on load (V1 layers, legacy input fields: cgp.caffe.upgrade) with one note to `log`."""
    return upgraded(parse_text(text, caffe_pb2.NetParameter(), filename), filename, log)


def upgraded(net, where, log=to_stderr):
    """net (a NetParameter) upgraded in place as Caffe's UpgradeNetAsNeeded does, saying so
    in one line to log if it changed anything."""
    where = shorten(where)
    done = upgrade_net(net, where)
    if done:
        log(note(done, where))
    return net


@lru_cache(maxsize=None)
def _solver_text():
    """The message a solver prototxt is parsed into: caffe.SolverParameter's fields and
    cgp.SolverExtras' (the forks' large-batch fields), in one descriptor (their numbers
    never meet), so that a file may name both and a misspelt field is still refused."""
    pool = descriptor_pool.DescriptorPool()
    proto = descriptor_pb2.FileDescriptorProto()
    caffe_pb2.DESCRIPTOR.CopyToProto(proto)
    pool.Add(proto)
    union = descriptor_pb2.FileDescriptorProto(name="cgp_solver_text.proto", package="cgp_text",
                                               dependency=[proto.name])
    message = union.message_type.add()
    caffe_pb2.SolverParameter.DESCRIPTOR.CopyToProto(message)
    message.name = "SolverText"
    message.ClearField("nested_type")
    message.ClearField("enum_type")
    extras = descriptor_pb2.DescriptorProto()
    cgp_pb2.SolverExtras.DESCRIPTOR.CopyToProto(extras)
    message.field.extend(extras.field)
    for field in message.field:   # the nested enums stay caffe.SolverParameter's
        if field.type_name.startswith(".caffe.SolverParameter."):
            continue
        if field.type_name and not field.type_name.startswith("."):
            field.type_name = f".caffe.{field.type_name}"
    pool.Add(union)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("cgp_text.SolverText"))


def solver_extras(solver):
    """The forks' large-batch fields of a SolverParameter that parse_solver read
    (cgp.SolverExtras; their defaults where the file has none)."""
    return cgp_pb2.SolverExtras.FromString(solver.SerializeToString())


def format_solver(solver):
    """A SolverParameter's prototxt text, the forks' fields (solver_extras) included."""
    return text_format.MessageToString(_solver_text().FromString(solver.SerializeToString()))


def parse_solver(text, filename="<string>", log=to_stderr):
    """Parse a solver prototxt into a SolverParameter, upgrading the old `solver_type` as
    Caffe does, and the nets it holds (net_param, train_net_param, test_net_param) as
    parse_net does. The large-batch fields of Intel's and NVIDIA's Caffe (cgp.SolverExtras)
    are read too and kept in it as unknown fields (solver_extras gets them back)."""
    try:
        both = parse_text(text, _solver_text()(), filename)
    except PrototxtError as e:
        raise PrototxtError(str(e).replace("cgp_text.SolverText", "caffe.SolverParameter")) \
            from None
    solver = caffe_pb2.SolverParameter.FromString(both.SerializeToString())
    if solver.HasField("solver_type"):
        if solver.HasField("type"):
            raise PrototxtError(
                f"{shorten(filename)}: give the solver either 'type' or the old 'solver_type', "
                "not both")
        solver.type = _SOLVER_TYPE_NAMES[solver.solver_type]
        solver.ClearField("solver_type")
    for field in ("net_param", "train_net_param"):
        if solver.HasField(field):
            upgraded(getattr(solver, field), f"{filename} ({field})", log)
    for i, net in enumerate(solver.test_net_param):
        upgraded(net, f"{filename} (test_net_param {i})", log)
    return solver


def read_net(path, log=to_stderr):
    """Read a net prototxt file into a NetParameter (parse_net)."""
    return parse_net(_read_text(path), str(path), log)


def read_model(path, log=to_stderr):
    """read_net for a file the user named (--model): a missing one is said as such."""
    if not Path(path).is_file():
        where = "" if Path(path).is_absolute() else f" (looked in {shorten(Path.cwd())})"
        raise PrototxtError(f"model '{shorten(path)}' not found{where}")
    return read_net(path, log)


def read_solver(path, log=to_stderr):
    """Read a solver prototxt file into a SolverParameter (parse_solver)."""
    return parse_solver(_read_text(path), str(path), log)


def format_message(msg):
    """The prototxt text of a message, as Caffe would read it back."""
    return text_format.MessageToString(msg)


def _read_text(path):
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise PrototxtError(f"{shorten(path)}: cannot read prototxt file: "
                            f"{e.strerror or shorten(e)}") from None
    except UnicodeDecodeError as e:
        raise PrototxtError(f"{shorten(path)}: not a text file (byte {e.start} is not "
                            "UTF-8)") from None


def _located(error, filename):
    """'<file>:<line>:<col>: <message>' from a ParseError, whose str() starts with 'line:col : '.
    The message quotes the token that failed, which may be any length: it is shortened."""
    line, col = error.GetLine(), error.GetColumn()
    what = str(error)
    if line is None:
        return f"{filename}: {shorten(what, 300)}"
    where = f"{line}:{col}" if col is not None else f"{line}"
    prefix = f"{where} : "
    if what.startswith(prefix):
        what = what[len(prefix):]
    return f"{filename}:{where}: {shorten(what, 300)}"


def non_finite(msg, skip=("blobs",), path=""):
    """(field path, value) of the first NaN or infinite float in a message and the messages
    it holds, or None. Fields named in `skip` are not looked at: by default a layer's
    `blobs` (weights in a prototxt), which the weights readers check."""
    for fd, value in msg.ListFields():
        name = f"{path}{fd.name}"
        if fd.name in skip:
            continue
        values = value if fd.is_repeated else [value]
        if fd.type in (fd.TYPE_FLOAT, fd.TYPE_DOUBLE):
            for k, v in enumerate(values):
                if not math.isfinite(v):
                    return (f"{name}[{k}]" if fd.is_repeated else name), v
        elif fd.type == fd.TYPE_MESSAGE:
            for k, child in enumerate(values):
                found = non_finite(child, skip,
                                   f"{name}[{k}]." if fd.is_repeated else f"{name}.")
                if found is not None:
                    return found
    return None


def beyond_int(msg, path=""):
    """(field path, value) of the first unsigned 32-bit field in a message (or the messages
    it holds) above 2**31 - 1, or None: Caffe reads them into an int, where such a value
    turns negative (a stride, a pad, a num_output)."""
    for fd, value in msg.ListFields():
        name = f"{path}{fd.name}"
        values = value if fd.is_repeated else [value]
        if fd.type == fd.TYPE_UINT32:
            for k, v in enumerate(values):
                if v >= 2**31:
                    return (f"{name}[{k}]" if fd.is_repeated else name), v
        elif fd.type == fd.TYPE_MESSAGE:
            for k, child in enumerate(values):
                found = beyond_int(child, f"{name}[{k}]." if fd.is_repeated else f"{name}.")
                if found is not None:
                    return found
    return None
