"""The machinery that runs kernels, apart from the layers' own kernels (cgp.kernels): SIMD
code generation (simd), BLAS (blas), counter-based random numbers (philox), the
floating-point environment (fpenv), waiting on shared counters (spin), and the compiled
halves of the reduction (reduce) and of the solvers' update (update).

Importing this package (cgp.kernels does, first) makes Numba's on-disk cache of cgp's
compiled functions depend on every compiled source of cgp. Numba checks only the file that
defines a function, never the files it calls into, and simd's code generators are compiled
into every convolution: after an edit of simd.py it would load stale machine code. Here a
cached function of cgp is fresh only if none of those files has changed (SourceStamp).
"""
import hashlib
from importlib.util import find_spec
from pathlib import Path

from numba.core import caching


def compiled_sources():
    """The .py files whose code Numba compiles into cgp's kernels: this package's and
    cgp.kernels' (wherever the install put them), in a fixed order."""
    folders = [Path(__file__).parent]
    kernels = find_spec("cgp.kernels")
    folders += [Path(p) for p in kernels.submodule_search_locations]
    return [path for folder in folders for path in sorted(folder.glob("*.py"))]


def sources_hash(paths):
    """SHA-256 over the names and contents of the files."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class SourceStamp:
    """A Numba cache locator's freshness stamp for cgp's functions: Numba's own stamp of the
    defining file, plus the hash of every compiled source (computed once per process)."""
    _hash = None
    _folders = None

    @classmethod
    def handles(cls, py_file):
        if cls._folders is None:
            cls._folders = {p.parent.resolve() for p in compiled_sources()}
        return Path(py_file).resolve().parent in cls._folders

    def get_source_stamp(self):
        if SourceStamp._hash is None:
            SourceStamp._hash = sources_hash(compiled_sources())
        return super().get_source_stamp(), SourceStamp._hash

    @classmethod
    def from_function(cls, py_func, py_file):
        return super().from_function(py_func, py_file) if cls.handles(py_file) else None


class UserProvidedLocator(SourceStamp, caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR, where the user set it."""


class InTreeLocator(SourceStamp, caching.InTreeCacheLocator):
    """The cache beside the sources (__pycache__), as Numba's default."""


class UserWideLocator(SourceStamp, caching.UserWideCacheLocator):
    """The user's cache folder, where the sources' folder cannot be written."""


# Tried before Numba's own locators; they decline any file that is not cgp's.
caching.CacheImpl._locator_classes[:0] = [UserProvidedLocator, InTreeLocator, UserWideLocator]
