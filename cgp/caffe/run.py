"""`import caffe` resolving to cgp, for pycaffe scripts run unchanged: `cgp pycaffe SCRIPT
[ARGS]` (or `python -m cgp.caffe.run SCRIPT [ARGS]`) runs a script with the alias in place
(run_script, run_module); `import cgp.caffe.alias` installs it in a running interpreter.

The alias is `caffe` = the package cgp in sys.modules, plus an import finder that maps each
`caffe.X` submodule to the cgp module that provides it (caffe.proto.caffe_pb2, caffe.io,
caffe.draw, ...), so that both are one module object: two copies of caffe_pb2 would clash in
protobuf's registry. It is never installed over a real Caffe unless asked (force=True,
`cgp pycaffe --force`); the wheel ships no top-level `caffe` package.
"""
import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
from pathlib import Path

from cgp.errors import CgpError

# pycaffe's submodules that cgp keeps elsewhere; any other caffe.X is cgp.X (caffe.proto).
SUBMODULES = {
    "caffe.io": "cgp.caffe.io",
    "caffe.draw": "cgp.caffe.draw",
    "caffe.coord_map": "cgp.caffe.coord_map",
    "caffe.net_spec": "cgp.caffe.netspec",
    "caffe.pycaffe": "cgp.caffe.pycaffe",
    "caffe._caffe": "cgp.caffe.pycaffe",
}


def target(fullname):
    """The cgp module that stands for pycaffe's module `fullname` ('caffe...')."""
    if fullname == "caffe":
        return "cgp"
    return SUBMODULES.get(fullname, "cgp" + fullname[len("caffe"):])


class _AliasLoader(importlib.abc.Loader):
    """Hands over the already imported cgp module, keeping its own __spec__ (the import
    system would set the alias's)."""

    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `caffe.X` as the cgp module that provides it (target)."""

    def find_spec(self, fullname, path=None, module=None):
        if not fullname.startswith("caffe."):
            return None
        try:
            found = importlib.import_module(target(fullname))
        except ModuleNotFoundError:
            return None          # import caffe.nothing: the usual ModuleNotFoundError
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(found),
                                              is_package=hasattr(found, "__path__"))


def real_caffe():
    """Where a `caffe` other than cgp's alias would be imported from, or None."""
    module = sys.modules.get("caffe")
    if module is not None:
        return None if module is sys.modules.get("cgp") else getattr(module, "__file__", "?")
    spec = importlib.util.find_spec("caffe")
    return None if spec is None else (spec.origin or ", ".join(spec.submodule_search_locations))


def install(force=False):
    """Makes `import caffe` (and caffe.proto.caffe_pb2, caffe.io, caffe.draw, caffe.coord_map,
    caffe.net_spec) resolve to cgp. Refuses, naming it, where a real Caffe is importable,
    unless force."""
    import cgp
    found = None if any(isinstance(f, AliasFinder) for f in sys.meta_path) else real_caffe()
    if found is not None and not force:
        raise CgpError(f"a real Caffe is importable ({found}); cgp does not stand in for it "
                       "unless asked: cgp pycaffe --force, or cgp.caffe.alias.install(force=True)")
    for name in [n for n in sys.modules if n == "caffe" or n.startswith("caffe.")]:
        del sys.modules[name]
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
    sys.modules["caffe"] = cgp


def run_script(path, args=(), force=False):
    """Runs the Python file `path` as __main__ with sys.argv [path, *args] and its folder
    first on sys.path, as `python path args` would, with the alias installed."""
    install(force)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    runpy.run_path(str(path), run_name="__main__")


def run_module(name, args=(), force=False):
    """Runs module `name` as `python -m name args` would, with the alias installed."""
    install(force)
    sys.argv = [name, *args]
    sys.path.insert(0, "")
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def add_arguments(parser):
    """`cgp pycaffe`'s arguments (and python -m cgp.caffe.run's)."""
    parser.add_argument("--force", action="store_true",
                        help="stand in for caffe even where a real Caffe is importable")
    parser.add_argument("-m", dest="module", default=None, help="run a module (as python -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                        help="the script and its arguments (with -m: the module's arguments)")


DESCRIPTION = ("Runs SCRIPT (or -m MODULE) as `python SCRIPT ARGS` would, with `import caffe`, "
               "caffe.proto.caffe_pb2, caffe.io, caffe.draw and caffe.coord_map resolving to "
               "cgp. Refuses where a real Caffe is importable, unless --force.")


def run(args, log=print):
    """Runs what add_arguments' args name; a user's mistake is a CgpError."""
    if args.module is not None:
        run_module(args.module, args.args, force=args.force)
    elif not args.args:
        raise CgpError("cgp pycaffe: give the script to run (or -m MODULE)")
    else:
        run_script(args.args[0], args.args[1:], force=args.force)
    return 0


def main(argv=None):
    """python -m cgp.caffe.run [--force] SCRIPT [ARGS] | -m MODULE [ARGS]."""
    parser = argparse.ArgumentParser(prog="python -m cgp.caffe.run", description=DESCRIPTION)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except CgpError as e:
        print(f"cgp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
