"""cgp: coarse-grain batch-parallel CPU trainer for Caffe networks.

Also pycaffe's interface, for `import cgp as caffe` (cgp.caffe: pycaffe, netspec, io, draw,
coord_map, Python layers), imported on first use so that `import cgp` and the command line
stay quick; `cgp pycaffe SCRIPT` runs a script's own `import caffe` as cgp (cgp.caffe.run).
"""
import importlib

# Name -> the module that defines it.
_EXPORTS = {name: "cgp.caffe.pycaffe" for name in (
    "TRAIN", "TEST", "Net", "Blob", "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver",
    "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver", "set_mode_cpu",
    "set_mode_gpu", "set_device", "layer_type_list", "has_nccl", "PycaffeUnsupported")}
_EXPORTS["Layer"] = "cgp.caffe.pylayer"
_EXPORTS.update({name: "cgp.caffe.netspec" for name in ("NetSpec", "params", "to_proto")})
# caffe.io, caffe.net_spec; caffe.layers is the package cgp.layers, which also makes
# NetSpec's layers (L.Convolution(...)): a submodule always wins over a name given here.
_MODULES = {"io": "cgp.caffe.io", "net_spec": "cgp.caffe.netspec", "layers": "cgp.layers",
            "draw": "cgp.caffe.draw", "coord_map": "cgp.caffe.coord_map"}


def __getattr__(name):
    if name == "proto":   # caffe.proto.caffe_pb2 at once, as pycaffe's `import caffe` gives it
        importlib.import_module("cgp.proto.caffe_pb2")
        return importlib.import_module("cgp.proto")
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name.startswith("__"):
        raise AttributeError(f"module 'cgp' has no attribute '{name}'")
    # pycaffe names that cgp lacks raise PycaffeUnsupported, saying so; others AttributeError.
    return getattr(importlib.import_module("cgp.caffe.pycaffe"), name)
